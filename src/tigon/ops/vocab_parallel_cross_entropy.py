r"""Fused linear + cross-entropy with the vocabulary sharded across ranks (tensor parallel).

Under tensor parallelism the LM head is split by classes: rank r holds rows [v0_r, v0_r + V_r) of
W (V, H) (transformers' ``colwise`` / ``colwise_gather_output`` plan, Megatron's vocab-parallel
head), and every rank holds the same tokens X (N, H) and targets. Stock gathers the whole logits
(N, V) onto every rank, then each computes the same softmax. Here each rank makes only its own
columns of the logits, one chunk of C tokens at a time, and the ranks exchange per-row numbers
only. With z = logit_scale·(x·wᵀ + b) (softcapped if asked) and the softmax over all V classes::

    m_r  = max over rank r's classes of z        s_r = Σ_r's classes exp(z − m_r)
    M    = max_r m_r                             S   = Σ_r s_r · exp(m_r − M)
    lse  = M + log S                             z_y = the target's z, on the one rank holding it

(plus Σ w·z for label smoothing, summed like S). Each rank folds its columns into that state with
the vocabulary-chunk kernel of ``fused_linear_cross_entropy`` (``_vocab_chunks``: the same kernel
that folds the chunks of classes of one device), the ranks combine the states (one all-reduce
MAX of m and one all-reduce SUM of the rest: 5·C floats per chunk), and the same kernel, handed
zero more classes, turns the combined state into each row's loss and lse with every option's
formula. Then the gradient kernel overwrites the rank's logits with ∂loss/∂z for its columns
(softmax − one-hot, from the global lse), and the rank computes

    dW_r = dL_rᵀ · X       (its own shard, exact: no other rank contributes to its classes)
    dX  += dL_r · W_r      (a partial sum over its classes, in fp32)

and at the end one all-reduce SUM of dX (N·H fp32) gives every rank the whole input gradient.
Per rank: the 3 matmuls over V_r classes (1/tp of the head's flops), C·V_r logits held, no
(N, V) tensor anywhere. Stock's colwise_gather_output all-gathers N·V logits in the forward and
all-reduces dX in the backward.

As in ``fused_linear_cross_entropy``, the gradients are computed in the forward and the backward
applies ``grad_output``; ``reduction="none"`` (whose backward would recompute) is not offered here.

Reference: :func:`tigon.ops.fused_linear_cross_entropy.fused_linear_cross_entropy_reference` on the
gathered weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tigon._kernels import (
    REDUCTION_SCALES,
    VOCAB_CHUNK_GRAD,
    VOCAB_CHUNK_STATS,
    LossOptions,
    RangeCheck,
    SavedGradientsFunction,
    autocast_off,
    check_int,
    check_tensor,
    chunk_buffer,
    chunk_view,
    compute_operands,
    head_compute_dtype,
    linear_into,
    matmul_accumulate,
)
from tigon.ops.cross_entropy import check_loss_options, check_target
from tigon.ops.fused_linear_cross_entropy import DTensor, chunk_plan

# ------------------------------------------------------------------------------- the ranks' row state


def _new_state(rows, device):
    """(4, rows) fp32: running max, Σ exp(z − max), Σ w·z, z of the target (NaN until found)."""
    state = torch.empty(4, rows, dtype=torch.float32, device=device)
    state[0] = float("-inf")
    state[1] = 0.0
    state[2] = 0.0
    state[3] = float("nan")
    return state


def combine_states(state, group):
    """Every rank's (max, Σ exp, Σ w·z, z_y) over its classes → the same over all classes, in place.

    S = Σ_r s_r·exp(m_r − M) with M the max over ranks; a rank with no finite logit in a row (an
    ignored row, left at −inf) adds nothing. z_y is summed over the ranks that hold the target and
    stays NaN where none does (a target outside [0, V), which the kernels turn into a NaN loss).
    """
    m = state[0].clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)                                  # (C,)
    found = ~torch.isnan(state[3])
    rescale = torch.where(state[0] == float("-inf"), 0.0, torch.exp(state[0] - m))
    sums = torch.stack([state[1] * rescale, state[2], torch.where(found, state[3], 0.0), found.float()])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)                               # (4, C)
    state[0] = m
    state[1] = sums[0]
    state[2] = sums[1]
    state[3] = torch.where(sums[3] > 0, sums[2], float("nan"))


# ------------------------------------------------------------------------------------------ the passes


def _sharded_by_tokens(x, w, b, target, class_weight, scales, need, opts, vocab, col0, group, grad_dtypes):
    """Loss rows and this rank's (dx, dw, db): the logits of its classes made C tokens at a time."""
    need_dx, need_dw, need_db = need
    num_tokens, local_vocab = x.shape[0], w.shape[0]
    plan = chunk_plan(num_tokens, local_vocab, x.shape[1], x.element_size(), dx_size=4,
                      dw_size=grad_dtypes[1].itemsize)
    # By classes on one device (chunk_plan's third way) is by tokens here: each chunk's rows need
    # every rank's classes, so the dW partials are summed in fp32 as with the fp32_dw plan.
    chunk = plan.size if plan.by_tokens else min(num_tokens, 1024)
    fp32_dw = plan.fp32_dw or not plan.by_tokens
    dx32 = torch.empty(x.shape, dtype=torch.float32, device=x.device) if need_dx else None
    dw = torch.empty(w.shape, dtype=torch.float32 if fp32_dw else grad_dtypes[1], device=x.device) if need_dw else None
    db = torch.zeros(local_vocab, dtype=torch.float32, device=x.device) if need_db else None
    buffer = chunk_buffer(min(chunk, num_tokens) * local_vocab, x.dtype, x.device)
    losses = []
    for c0 in range(0, num_tokens, chunk):
        c1 = min(num_tokens, c0 + chunk)
        x_c, t_c = x[c0:c1], target[c0:c1]
        logits = linear_into(x_c, w, b, chunk_view(buffer, c1 - c0, local_vocab))                 # (C, V_r)
        state = _new_state(c1 - c0, x.device)
        loss_c = torch.empty(c1 - c0, dtype=torch.float32, device=x.device)
        lse_c = torch.empty(c1 - c0, dtype=torch.float32, device=x.device)
        VOCAB_CHUNK_STATS(logits, t_c, class_weight, scales, state, loss_c, lse_c, col0, vocab, False, *opts.args())
        combine_states(state, group)
        # Zero more classes, last: the combined state becomes each row's loss and lse.
        VOCAB_CHUNK_STATS(logits[:, :0], t_c, class_weight, scales, state, loss_c, lse_c, col0, vocab, True,
                    *opts.args())
        losses.append(loss_c)
        if not any(need):
            continue
        VOCAB_CHUNK_GRAD(logits, t_c, class_weight, scales, None, lse_c, col0, vocab, *opts.args())
        dlogits = logits                                                                   # (C, V_r)
        if need_dx:
            matmul_accumulate(dx32[c0:c1], dlogits, w, first=True)                         # (C, H) fp32
        if need_dw:
            matmul_accumulate(dw, dlogits.t(), x_c, first=c0 == 0)                         # (V_r, H)
        if need_db:
            db += dlogits.sum(0, dtype=torch.float32)
    logits = dlogits = buffer = None
    if need_dx:
        dist.all_reduce(dx32, op=dist.ReduceOp.SUM, group=group)                           # (N, H)
    dx = dx32.to(grad_dtypes[0]) if need_dx else None
    if need_dw and dw.dtype != grad_dtypes[1]:
        dw = dw.to(grad_dtypes[1])
    db = db.to(grad_dtypes[2]) if need_db else None
    return torch.cat(losses) if len(losses) > 1 else losses[0], dx, dw, db


# ------------------------------------------------------------------------------------ public functions


def vocab_parallel_cross_entropy(
    input,
    weight_shard,
    target,
    *,
    vocab_start=None,
    vocab_size=None,
    group=None,
    bias_shard=None,
    weight=None,
    ignore_index=-100,
    label_smoothing=0.0,
    reduction="mean",
    z_loss=0.0,
    softcap=None,
    logit_scale=1.0,
):
    """``cross_entropy(input @ W.T + b, target, ...)`` where this rank holds rows
    ``[vocab_start, vocab_start + weight_shard.shape[0])`` of W (and of b) and every rank of ``group``
    the same ``input`` ``[..., H]`` and ``target``: the loss of the whole vocabulary of ``vocab_size``
    classes, the same on every rank. Gradients: the whole input gradient on every rank, this rank's
    rows of the weight (and bias) gradient. ``weight`` (vocab_size,) are class weights; options as in
    :func:`tigon.ops.cross_entropy.cross_entropy` (``reduction`` "mean" or "sum").

    ``weight_shard`` may instead be the whole head as a DTensor split by rows over a one-dimensional mesh
    (and ``bias_shard`` one split the same way, or None): the rows, their offset, the vocabulary and the
    group are then the DTensor's, and the weight's gradient comes back as a DTensor of its placement."""
    if isinstance(weight_shard, DTensor):
        if vocab_start is not None or vocab_size is not None or group is not None:
            raise ValueError("vocab_start, vocab_size and group come from a DTensor weight_shard; pass none of them")
        return fused_linear_cross_entropy_dtensor(
            input, weight_shard, target, linear_bias=bias_shard, weight=weight, ignore_index=ignore_index,
            label_smoothing=label_smoothing, reduction=reduction, z_loss=z_loss, softcap=softcap,
            logit_scale=logit_scale,
        )
    if vocab_start is None or vocab_size is None:
        raise ValueError("vocab_start and vocab_size are needed with a plain weight_shard (this rank's rows)")
    check_int(vocab_start, "vocab_start")
    check_int(vocab_size, "vocab_size")
    check_tensor(input, "input")
    if input.dim() == 0:
        raise ValueError("input must have at least one dimension (the hidden dimension is the last)")
    check_tensor(weight_shard, "weight_shard", device=input.device)
    if weight_shard.dim() != 2 or weight_shard.shape[1] != input.shape[-1]:
        raise ValueError(f"weight_shard has shape {tuple(weight_shard.shape)}, expected (V_r, {input.shape[-1]})")
    local_vocab = weight_shard.shape[0]
    if not (0 <= vocab_start and vocab_start + local_vocab <= vocab_size):
        raise ValueError(
            f"vocab_start {vocab_start} with {local_vocab} rows does not fit a vocabulary of {vocab_size}"
        )
    if bias_shard is not None:
        check_tensor(bias_shard, "bias_shard", device=input.device)
        if bias_shard.shape != (local_vocab,):
            raise ValueError(f"bias_shard has shape {tuple(bias_shard.shape)}, expected ({local_vocab},)")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum' with a sharded vocabulary, got {reduction!r}")
    compute_dtype = head_compute_dtype(input, weight_shard, bias_shard)
    check_loss_options(
        weight, vocab_size, input.device, ignore_index, label_smoothing, reduction, z_loss, softcap, logit_scale
    )
    check_target(target, input.shape[:-1], input.device)
    weight = None if weight is None else weight.contiguous()  # the class weights are read with unit stride
    scales, bad = REDUCTION_SCALES(target.reshape(-1), weight, int(ignore_index), reduction, vocab_size)
    check = RangeCheck(bad)
    opts = LossOptions(int(ignore_index), float(label_smoothing), float(z_loss),
                       None if softcap is None else float(softcap), float(logit_scale))
    grad_on = torch.is_grad_enabled()
    need = (grad_on and input.requires_grad, grad_on and weight_shard.requires_grad,
            grad_on and bias_shard is not None and bias_shard.requires_grad)
    # The gradients are made with the loss; the autograd node only brings them to grad_output.
    with torch.no_grad(), autocast_off(input.device):
        x, w, b = compute_operands(input, weight_shard, bias_shard, compute_dtype)
        grad_dtypes = (input.dtype, weight_shard.dtype, bias_shard.dtype if bias_shard is not None else None)
        loss_rows, dx, dw, db = _sharded_by_tokens(
            x, w, b, target.reshape(-1), weight, scales, need, opts, vocab_size, int(vocab_start), group, grad_dtypes
        )
    check.raise_if_bad(vocab_size, ignore_index)
    return SavedGradientsFunction.apply(loss_rows.sum(), input, weight_shard, bias_shard, dx, dw, db)


def vocab_sharded(linear_weight) -> bool:
    """Whether ``linear_weight`` is a DTensor split by rows (classes) over a one-dimensional mesh."""
    from torch.distributed.tensor import Shard

    return (isinstance(linear_weight, DTensor) and linear_weight.device_mesh.ndim == 1
            and tuple(linear_weight.placements) == (Shard(0),))


def fused_linear_cross_entropy_dtensor(input, linear_weight, target, *, linear_bias=None, **options):
    """:func:`vocab_parallel_cross_entropy` for a DTensor head split by rows over a 1-D mesh (a bias
    split the same way, or None); a plain or replicated DTensor ``input``. Gradients come back as
    DTensors with the parameters' placements."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not vocab_sharded(linear_weight):
        raise ValueError(
            f"linear_weight is a DTensor placed {tuple(linear_weight.placements)} over a "
            f"{linear_weight.device_mesh.ndim}-D mesh; a head for the vocabulary-parallel loss is split by rows "
            "(Shard(0)) over a 1-D mesh"
        )
    mesh = linear_weight.device_mesh
    split_like_weight = (isinstance(linear_bias, DTensor) and tuple(linear_bias.placements) == (Shard(0),)
                         and linear_bias.device_mesh == mesh)
    if linear_bias is not None and not split_like_weight:
        raise ValueError("linear_bias must be split by rows over linear_weight's mesh, as the weight is")
    if isinstance(input, DTensor):
        input = input.full_tensor()
    _, offset = compute_local_shape_and_global_offset(linear_weight.shape, mesh, linear_weight.placements)
    return vocab_parallel_cross_entropy(
        input, linear_weight.to_local(), target, vocab_start=int(offset[0]), vocab_size=linear_weight.shape[0],
        group=mesh.get_group(), bias_shard=linear_bias.to_local() if linear_bias is not None else None, **options,
    )
