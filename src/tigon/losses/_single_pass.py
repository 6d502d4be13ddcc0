r"""The single pass of the post-training losses: loss and gradient from one matmul of logits.

Why. Through :func:`tigon.ops.fused_linear_logprobs` a loss costs four ``[N, H] × [H, V]``
matmuls: the forward's logits, and in the backward the logits again (the head cannot know the
upstream gradient ``∂L/∂logp`` in its forward), ``dX`` and ``dW``. Every loss of this package is a
sum over row chunks of a term that only the chunk's own log-probs decide, once a few constants are
known from ``target`` alone (counted tokens per row and in total, ``B``, ``R``,
``num_items_in_batch`` …):

* DPO, ORPO, CPO, SimPO: a mean over pairs of a function of pair ``i``'s rows ``i`` and ``B + i``,
  plus an NLL whose normaliser (the counted chosen tokens) comes from ``target``;
* KTO: a mean over rows of a function of the row; GRPO: a normalised sum over tokens.

So a chunk of whole groups (pairs, or rows) knows its part of ``∂L/∂logp`` as soon as its own
log-probs are made, and the logits need not be made again:

    logits = X_c·Wᵀ + b                        fp32, all V classes (the head's ``linear_fp32``)
    logp, lse                                  the head's stats kernel, one class chunk = all V
    g      = ∂L/∂logp_c                        torch.autograd.grad of the loss formula (below)
    dl     = g·([j = t] − p)·∂z/∂l              the head's grad kernel, in the matmul dtype
    dX_c   = dl·W        dW += dlᵀ·X_c        db += Σ_rows dl

Three matmuls for the policy (the fourth is gone), the gradients saved in the forward, and the
backward only scales them by grad_output (:func:`tigon.ops.cross_entropy.apply_grad_output`, whose
retain_graph rule hands out scaled copies when the graph is kept).

One formula. Each loss is written once, as ``formula(logps (R, T), mask (R, T)) → LossOutput``
over all rows (its constants come from ``mask`` and the loss's options). The two-pass path calls it
on the head's log-probs. Here a chunk's ``g`` is the gradient of that same formula evaluated on
the chunk's log-probs (a leaf) with the other rows held at a stand-in (−1 per counted token, finite
everywhere): the loss being a sum of chunk-local terms, the stand-in changes no gradient of the
chunk's rows. The value and the metrics come from the formula once more on all the (detached)
log-probs after the pass. The formula runs on (R, T) values — a few dozen small ops per chunk,
nothing beside the matmuls.

Precision. ``dX`` of each token is made by one matmul (no sum over chunks) and rounded once.
``dW`` is summed over the chunk's pieces in ``linear_weight``'s dtype by the matmul itself (beta =
1: each partial sum rounded once): for a bf16 head that is one bf16 rounding per piece (16 at the
benchmark's shape), far inside API.md's 3e-2; an fp32 accumulator would cost V·H·4 bytes (2.1 GB at
H = 4096, V = 128256), more than the whole workspace. ``db`` is summed in fp32.

Memory beyond the inputs and the returned gradients: one chunk of fp32 logits
(``SinglePassConfig.workspace_bytes``, at least one group: a DPO pair of 2 × 1024 tokens at
V = 128256 is 1.05 GB), one piece of ``dl`` in the matmul dtype (``grad_bytes``; fp32 operands
write ``dl`` over the logits in place), the chunk's gathered hidden states, and per-token fp32
log-probs. dW (the weight's dtype) and dX are the returned gradients themselves.

When. Eager mode with a gradient to take (:func:`applies`). Under torch.compile (the two-pass path
traces with fullgraph), or without gradients, the losses call the head as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tigon._kernels import (
    LOGPROB_CHUNK_GRAD,
    LOGPROB_CHUNK_GRAD_INPLACE,
    LOGPROB_CHUNK_STATS,
    REDUCTION_SCALES,
    LogprobOptions,
    RangeCheck,
    SavedGradientsFunction,
    compute_operands,
    head_compute_dtype,
    linear_fp32,
    matmul_accumulate,
)
from tigon.ops.fused_linear_logprobs import (
    DEFAULT_CONFIG as HEAD_CONFIG,
)
from tigon.ops.fused_linear_logprobs import check_logprob_arguments, fused_linear_logprobs

# ------------------------------------------------------------------------------------ launch config


@dataclass(frozen=True)
class SinglePassConfig:
    """Every setting of the single pass.

    ``workspace_bytes``: a chunk's fp32 logits (tokens × V × 4) may take this much; a chunk holds
    as many whole groups (pairs for the paired losses, rows otherwise) as fit, and at least one.
    ``grad_bytes``: one piece of ``dl`` in a bf16/fp16 matmul dtype (tokens × V × 2); the chunk's
    gradient matmuls run piece by piece (a multiple of ``token_align`` tokens where it fits: whole
    matmul tiles; no piece spans two rows' ranges of a paired chunk). ``groups_per_chunk`` /
    ``grad_tokens`` force those sizes (tests use them to make many chunks and pieces at small
    sizes). ``enabled=False`` keeps the two-pass path everywhere. ``block_v`` / ``num_warps``: the
    head's row-kernel launch.
    """

    workspace_bytes: int = 1 << 30
    grad_bytes: int = 256 << 20
    groups_per_chunk: int | None = None
    grad_tokens: int | None = None
    enabled: bool = True
    token_align: int = 256
    block_v: int = HEAD_CONFIG.block_v
    num_warps: int = HEAD_CONFIG.num_warps

    def chunk_groups(self, group_tokens: int, vocab: int, num_groups: int) -> int:
        if self.groups_per_chunk is not None:
            return max(1, min(num_groups, self.groups_per_chunk))
        fit = self.workspace_bytes // max(1, group_tokens * vocab * 4)
        return max(1, min(num_groups, fit))

    def piece_tokens(self, chunk_tokens: int, vocab: int, grad_elem: int) -> int:
        """Tokens of one piece of dl (``grad_elem`` 0: dl in place over fp32 logits, one piece)."""
        if self.grad_tokens is not None:
            return max(1, self.grad_tokens)
        if grad_elem == 0:
            return max(1, chunk_tokens)
        fit = self.grad_bytes // max(1, vocab * grad_elem)
        if fit >= self.token_align:
            fit = fit // self.token_align * self.token_align  # whole matmul tiles (1046 → 1024 at V = 128256)
        return max(1, min(chunk_tokens, fit))


DEFAULT_CONFIG = SinglePassConfig()


def applies(config: SinglePassConfig | None, input, linear_weight, linear_bias) -> bool:
    """Eager mode, gradients on, one of the policy's tensors wants one, and rows have tokens (rows of
    none have no logits to pass over: the head's log-probs, all empty, take them)."""
    config = DEFAULT_CONFIG if config is None else config
    if not config.enabled or torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False
    if input.dim() > 1 and input.shape[-2] == 0:
        return False
    return any(t is not None and isinstance(t, torch.Tensor) and t.requires_grad
               for t in (input, linear_weight, linear_bias))


# -------------------------------------------------------------------------------------------- pass


def _chunks(num_rows: int, num_tokens: int, paired: bool, per_chunk: int):
    """Per chunk: its contiguous token ranges [(t0, t1), …] (one, or chosen then rejected)."""
    num_groups = num_rows // 2 if paired else num_rows
    for g0 in range(0, num_groups, per_chunk):
        g1 = min(num_groups, g0 + per_chunk)
        rows = [(g0, g1), (num_groups + g0, num_groups + g1)] if paired else [(g0, g1)]
        yield [(r0, r1) for r0, r1 in rows], [(r0 * num_tokens, r1 * num_tokens) for r0, r1 in rows]


def single_pass(input, linear_weight, target, head: dict, formula, *, paired: bool,
                config: SinglePassConfig | None = None):
    """``formula(logps, mask)`` (a LossOutput) with its loss's gradients made in this one pass."""
    config = DEFAULT_CONFIG if config is None else config
    linear_bias = head["linear_bias"]
    # checked as given (int() first would take 1.5 for 1, and fail on None without naming it)
    vocab = check_logprob_arguments(input, linear_weight, target, linear_bias, head["temperature"], head["softcap"],
                             head["logit_scale"], head["ignore_index"], False, False)
    ignore_index = int(head["ignore_index"])
    num_rows, num_tokens = target.shape
    need_dx, need_dw = input.requires_grad, linear_weight.requires_grad
    need_db = linear_bias is not None and linear_bias.requires_grad
    opts = LogprobOptions.make(ignore_index, float(head["temperature"]),
                         None if head["softcap"] is None else float(head["softcap"]),
                         float(head["logit_scale"]), False, False)
    launch = (config.block_v, config.num_warps)
    device = input.device
    mask = target != ignore_index
    stand_in = torch.where(mask, -1.0, 0.0).to(torch.float32)  # the rows outside a chunk
    logps = torch.empty((num_rows, num_tokens), dtype=torch.float32, device=device)
    flat_target = target.reshape(-1)
    _, bad = REDUCTION_SCALES(flat_target, None, ignore_index, "sum", vocab)
    check = RangeCheck(bad)

    compute_dtype = head_compute_dtype(input, linear_weight, linear_bias)  # the autocast dtype, if any
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        x, w, b = compute_operands(input.detach(), linear_weight.detach(),
                                    linear_bias.detach() if linear_bias is not None else None, compute_dtype)
        inplace = compute_dtype == torch.float32
        grad_elem = 0 if inplace else x.element_size()
        group_tokens = (2 if paired else 1) * num_tokens
        num_groups = num_rows // 2 if paired else num_rows
        per_chunk = config.chunk_groups(group_tokens, vocab, num_groups)
        chunk_tokens = per_chunk * group_tokens
        piece = min(chunk_tokens, config.piece_tokens(chunk_tokens, vocab, grad_elem))
        buffer = torch.empty(chunk_tokens * vocab, dtype=torch.float32, device=device)
        grad_buffer = None if inplace else torch.empty(piece * vocab, dtype=compute_dtype, device=device)
        dx = torch.empty(x.shape, dtype=input.dtype, device=device) if need_dx else None
        dw = torch.empty(linear_weight.shape, dtype=linear_weight.dtype, device=device) if need_dw else None
        db = torch.zeros(vocab, dtype=torch.float32, device=device) if need_db else None
        first_dw = True
        empty_state = torch.empty(0, dtype=torch.float32, device=device)

        for row_ranges, token_ranges in _chunks(num_rows, num_tokens, paired, per_chunk):
            n = sum(t1 - t0 for t0, t1 in token_ranges)
            x_c = x[token_ranges[0][0]:token_ranges[0][1]] if len(token_ranges) == 1 else torch.cat(
                [x[t0:t1] for t0, t1 in token_ranges])
            t_c = flat_target[token_ranges[0][0]:token_ranges[0][1]] if len(token_ranges) == 1 else torch.cat(
                [flat_target[t0:t1] for t0, t1 in token_ranges])
            logits = linear_fp32(x_c, w, b, buffer[: n * vocab].view(n, vocab))
            _, lp, lse, *_ = LOGPROB_CHUNK_STATS(
                logits, t_c, empty_state, 0, vocab, True, True, opts.ignore_index, opts.logit_scale,
                opts.softcap, opts.softcap_scale, False, False, *launch,
            )
            rows = torch.cat([torch.arange(r0, r1, device=device) for r0, r1 in row_ranges])
            lp_rows = lp.view(-1, num_tokens)
            logps.index_copy_(0, rows, lp_rows)
            with torch.enable_grad():
                leaf = lp_rows.detach().requires_grad_(True)
                loss_c = formula(stand_in.index_copy(0, rows, leaf), mask).loss
                grad = torch.autograd.grad(loss_c, leaf, allow_unused=True)[0] if loss_c.requires_grad else None
            g = torch.zeros_like(lp) if grad is None else grad.reshape(-1).to(torch.float32).contiguous()
            # pieces of dl, none across two token ranges: each has a contiguous block of dX
            offset = 0
            for t0, t1 in token_ranges:
                for p0 in range(t0, t1, piece):
                    p1 = min(t1, p0 + piece)
                    s0, s1 = offset + p0 - t0, offset + p1 - t0
                    args = (t_c[s0:s1], lse[s0:s1], None, g[s0:s1], None, 0, *opts.transform(), *launch)
                    if inplace:
                        dl = logits[s0:s1]
                        LOGPROB_CHUNK_GRAD_INPLACE(dl, *args)
                    else:
                        dl = grad_buffer[: (s1 - s0) * vocab].view(s1 - s0, vocab)
                        LOGPROB_CHUNK_GRAD(logits[s0:s1], dl, *args)
                    if need_dw:
                        matmul_accumulate(dw, dl.t(), x[p0:p1], first=first_dw)
                        first_dw = False
                    if need_dx:
                        matmul_accumulate(dx[p0:p1], dl, w, first=True)
                    if need_db:
                        db += dl.sum(0, dtype=torch.float32)
                offset += t1 - t0
        buffer = grad_buffer = logits = dl = None
        if need_db:
            db = db.to(linear_bias.dtype)
    check.raise_if_bad(vocab, ignore_index)

    with torch.no_grad():
        out = formula(logps, mask)
    loss = SavedGradientsFunction.apply(out.loss.detach(), input, linear_weight, linear_bias, dx, dw, db)
    return out._replace(loss=loss)


def evaluate(input, linear_weight, target, head: dict, formula, *, paired: bool,
             config: SinglePassConfig | None = None):
    """``formula`` on the policy's token log-probs: by :func:`single_pass` where it :func:`applies`,
    else on the head's log-probs (two passes: torch.compile, no gradient, ``enabled=False``)."""
    if applies(config, input, linear_weight, head["linear_bias"]):
        return single_pass(input, linear_weight, target, head, formula, paired=paired, config=config)
    logps, _ = fused_linear_logprobs(input, linear_weight, target, **head)
    return formula(logps, target != head["ignore_index"])
