r"""Fused log-probability head: per-token log p(target) and entropy of ``input @ linear_weight.T``.

Forward. With X (N, H) the tokens, W (V, H) the head, b (V,) its bias, σ = ``logit_scale``,
κ = ``softcap``, T = ``temperature``; everything after the matmul in fp32::

    l_j   = X·W_jᵀ + b_j                       fp32 accumulation, never rounded to the input dtype
    z_j   = σ·l_j / T                          (softcap=None)
    z_j   = (κ/T)·tanh(σ·l_j / κ)              (softcap=κ)
    lse   = log Σ_j exp(z_j)                   online over class chunks: running max m, s = Σ e^(z−m)
    lp    = z_t − lse                          logprobs (t = target)
    Hent  = −Σ_j p_j·log p_j = log s − (Σ_j e^(z_j−m)·(z_j − m)) / s          entropy

T folds into the cross-entropy kernels' parametrisation: z = σ'·l with σ' = σ/T, or κ'·tanh(σ·l/κ)
with κ' = κ/T; so the scaling helpers of cross_entropy.py (``scaled_logits``, ``scaled_with_slope``)
serve unchanged. Σ e·(z − m) is kept relative to the running max (rescaled as
r·(S + (m − m')·s) with r = e^(m − m') when the max moves to m'): entropy without the cancellation
of lse − Σ p·z when the logits are large. Rows whose target is ``ignore_index`` give 0 and pass no
gradient; a target outside [0, V) gives NaN (eager mode raises first; see RangeCheck).

With ``extras`` the same pass also yields TRL 1.16's per-token metrics (its ``_ChunkedLogProbFunction``
/ ``FusedCausalLMOutput``): ``log_sum_sq_probs = log Σ p² = log Σ e^(2(z−m)) − 2 log s``,
``mean_logits = Σ_j z_j / V`` (the temperature-scaled, softcapped logits z, as TRL's ``_transform``),
``is_top1 = z_t ≥ max z and z_t > max_{j<t} z_j`` (bool: torch.argmax's first-maximum rule, a tie
with an earlier class is not top-1). They are detached; 0 / False on ignored rows (TRL masks them so).

Backward. Upstream gradients g_lp, g_H per token (any strides, stride 0 included; either may be
absent). With p = softmax(z)::

    ∂lp/∂z_j   = [j = t] − p_j
    ∂Hent/∂z_j = −Σ_k (∂p_k/∂z_j)(log p_k + 1) = −p_j(log p_j + 1) + p_j·Σ_k p_k(log p_k + 1)
               = −p_j·(log p_j + Hent)
    dz_j       = g_lp·([j = t] − p_j) − g_H·p_j·(log p_j + Hent)
    ∂z_j/∂l_j  = σ/T                                 or   (σ/T)·(1 − tanh²(σ·l_j/κ))   (softcap)
    dl_j       = dz_j · ∂z_j/∂l_j                   (d/dy κ·tanh(y/κ) = 1 − tanh²; chain through σ, T)
    dX = dl·W      dW = dlᵀ·X      db = Σ_rows dl

The forward keeps only lse (and Hent when asked) per token; the backward recomputes each chunk of
logits (arbitrary upstream gradients cannot be folded into the forward), turns it into dl by one
kernel (written in the matmul dtype: in place for fp32, into a second buffer otherwise) and feeds it
to the two gradient matmuls before the next chunk is made. The chunk kernels and their torch ops (the
row path) are in ``tigon._kernels.logprob_rows``, which the single-pass losses run too.

Chunking (by classes, all N tokens × Vc classes): chunk c's fp32 logits L_c = X·W_cᵀ (one matmul),
folded into each row's running statistics; the backward makes each again, then dW[c] = dl_cᵀ·X in
one matmul over all tokens (K = N: one rounding of dW, no sum of partials in bf16) and
dX += dl_c·W_c summed in fp32. Vc is chosen from the workspace (fp32 chunk plus its dl twin) and
aligned to whole matmul tiles. The workspace is twice the weight's bytes, within
[``workspace_bytes``, ``max_workspace_bytes``] (256 MiB to 1 GiB; ``FusedLinearLogprobsConfig``):
each chunk's dX product reads and writes the fp32 accumulator (N·H·4 bytes: 134 MB at N = 8192,
H = 4096), and narrower chunks make narrower matmuls, so wider chunks are faster, while the peak stays
a small multiple of the dW the op returns anyway: the widest chunks the budget allows measured
fastest at H = 4096 and H = 896 (``dev/tune_logprobs_chunks.py``; docs/tuning.md, "Timings quoted in
the source").

Speed of light (N tokens, H hidden, V classes, element size e): 4 matmuls of 2·N·H·V flops each
(forward logits; backward recompute, dX, dW), 1 for a forward without gradient. Beyond them the
chunk traffic: forward writes and reads N·V·4 bytes of fp32 logits; backward writes and reads them
again and writes and reads N·V·e of dl. At N = 8192, H = 4096, V = 151936 (bf16): 10.2 Tflop per
matmul against ≈ 25 GB of chunk traffic in forward + backward, so the traffic costs about half a
matmul's time more (docs/tuning.md, "Timings quoted in the source").

The tile path (``_kernels/logprob_tiles.py``, the default for bf16/fp16 heads on an sm_90+ GPU in eager mode)
removes the fp32 traffic: a Triton matmul does the statistics (forward) or dl (backward) in its
epilogue on the fp32 accumulator, so the forward writes only per-tile partials (a few bytes per
256 logits) and the backward writes dl alone (N·V·e) for cuBLAS's dX and dW matmuls. Its chunks hold
only dl, so they are about three times as wide in the same workspace. At the benchmark shapes it
measured faster than the four cuBLAS matmuls alone, TRL 1.16's head and the row kernels above, both
forward and backward together and the forward alone (docs/tuning.md, "Timings quoted in the source").

Memory beyond the inputs and the returned gradients: one fp32 chunk (plus its dl twin in the input
dtype), per-token fp32 statistics, and by classes an fp32 dX accumulator (N·H·4); on the tile path
the dl chunk, the accumulator and the forward's partials. TRL 1.16 holds a (4096, 32768) bf16 tile
(256 MiB) and fp32 accumulators for dX and dW (V·H·4: 2.5 GB at the benchmark's head, twice the bf16
weight: the workspace here is at most that).

Reference: :func:`fused_linear_logprobs_reference` (plain torch: F.linear in fp32, log_softmax).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from tigon._kernels import (
    LOGPROB_CHUNK_GRAD,
    LOGPROB_CHUNK_GRAD_INPLACE,
    LOGPROB_CHUNK_STATS,
    REDUCTION_SCALES,
    TILES_COMBINE,
    TILES_GRAD,
    TILES_STATS,
    LogprobOptions,
    RangeCheck,
    autocast_off,
    chunk_buffer,
    chunk_view,
    class_chunks,
    compute_operands,
    head_compute_dtype,
    linear_fp32,
    matmul_accumulate,
    part_rows,
    tiles_available,
)
from tigon.ops.cross_entropy import check_loss_options, check_target
from tigon.ops.fused_linear_cross_entropy import check_linear_head

# ------------------------------------------------------------------------------------ launch config


@dataclass(frozen=True)
class FusedLinearLogprobsConfig:
    """Every launch setting of the op.

    The workspace: one chunk of fp32 logits plus its gradient twin in the matmul dtype may take
    ``weight_fraction`` × the weight's bytes, but at least ``workspace_bytes`` (TRL's tile is 4096 ×
    32768 bf16 = 256 MiB) and at most ``max_workspace_bytes`` (module docs: wider chunks are faster).
    Class chunks are multiples of ``class_align`` (whole matmul tiles) and at least that wide.
    ``class_chunk`` forces a chunk width (tests use it to make several chunks at small sizes). The row
    kernels run one program per token on a GPU (``block_v`` classes a block over ``num_warps`` warps:
    the narrow-chunk setting tuned for cross_entropy's chunk kernels, CHUNK_BLOCK_V / CHUNK_WARPS), a
    persistent handful under the interpreter.

    ``tiles``: the matmul with the row math in its epilogue (``_kernels/logprob_tiles.py``: no logits in
    memory) where it can run: None on a GPU of sm_90 or newer in eager mode, True wherever the
    operands allow (the interpreter too: tests), False never. Its workspace is the gradient twin
    alone, in the same budget, cut into equal chunks. ``tile_*``: its tiling (rows, classes and hidden
    units a tile step, row blocks a group, pipeline stages, warps, warp specialisation, the epilogue on
    the whole tile or on its two halves), the fastest of a sweep (``dev/tune_logprob_tiles.py``;
    docs/tuning.md, "fused_linear_logprobs").
    """

    workspace_bytes: int = 256 << 20
    max_workspace_bytes: int = 1 << 30
    weight_fraction: float = 2.0
    class_align: int = 512
    class_chunk: int | None = None
    block_v: int = 1024
    num_warps: int = 4
    tiles: bool | None = None
    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    tile_group: int = 8
    tile_stages: int = 4
    tile_warps: int = 8
    tile_warp_specialize: bool = True
    tile_epilogue_split: int = 2

    def workspace(self, weight_bytes: int) -> int:
        return min(self.max_workspace_bytes, max(self.workspace_bytes, int(self.weight_fraction * weight_bytes)))

    def chunk_classes(self, num_tokens: int, vocab: int, grad_elem: int, weight_bytes: int = 0) -> int:
        """Vc for N tokens: fp32 logits (4 bytes) plus the gradient twin (``grad_elem``, 0 in place), in
        the workspace a weight of ``weight_bytes`` gets."""
        if self.class_chunk is not None:
            return max(1, min(vocab, self.class_chunk))
        fit = self.workspace(weight_bytes) // max(1, num_tokens * (4 + grad_elem))
        return min(vocab, max(self.class_align, fit // self.class_align * self.class_align))

    def tile_chunks(self, num_tokens: int, vocab: int, grad_elem: int, weight_bytes: int, part_rows: int):
        """(forward, backward) class chunks of the tile path: the forward's partials (``part_rows`` fp32
        values a row per ``tile_n`` classes) and the backward's gradient twin each fill the workspace,
        in chunks of equal width (the last one narrower by less than ``class_align``)."""
        if self.class_chunk is not None:
            chunk = max(1, min(vocab, self.class_chunk))
            return chunk, chunk
        workspace = self.workspace(weight_bytes)

        def equal(bytes_a_class, classes=1):
            """Chunk width where N tokens take ``bytes_a_class`` bytes per ``classes`` classes (integers)."""
            fit = workspace * classes // max(1, num_tokens * bytes_a_class)
            fit = max(self.class_align, fit // self.class_align * self.class_align)
            count = -(-vocab // fit)
            width = -(-vocab // count)
            return min(vocab, -(-width // self.class_align) * self.class_align)

        return equal(part_rows * 4, self.tile_n), equal(grad_elem)

    def tiling(self) -> tuple:
        return (self.tile_m, self.tile_n, self.tile_k, self.tile_group, self.tile_stages, self.tile_warps,
                self.tile_warp_specialize, self.tile_epilogue_split)


DEFAULT_CONFIG = FusedLinearLogprobsConfig()

def _forward_pass(x, w, b, t, opts: LogprobOptions, chunk: int, launch: tuple[int, int]):
    """(logprobs, lse, entropy, log_sum_sq_probs, mean_logits, is_top1), each (N,), over class chunks."""
    num_tokens, vocab = x.shape[0], w.shape[0]
    buffer = chunk_buffer(num_tokens * min(chunk, vocab), torch.float32, x.device)
    chunks = class_chunks(vocab, chunk)
    state = torch.empty(0, dtype=torch.float32, device=x.device)
    outputs = None
    for i, (c0, c1) in enumerate(chunks):
        logits = linear_fp32(x, w[c0:c1], b[c0:c1] if b is not None else None, chunk_view(buffer, num_tokens, c1 - c0))
        state, *outputs = LOGPROB_CHUNK_STATS(
            logits, t, state, c0, vocab, i == 0, i == len(chunks) - 1, opts.ignore_index, opts.logit_scale,
            opts.softcap, opts.softcap_scale, opts.entropy, opts.extras, *launch,
        )
    logprobs, lse, ent, log_sum_sq, mean, top1 = outputs
    return logprobs, lse, ent, log_sum_sq, mean, top1.bool()


def _tile_operand(x, w, wanted):
    """x as the tile kernel reads it (unit stride along H), or None where the tiles do not run."""
    if wanted is False or x.dtype == torch.float32 or (wanted is None and not x.is_cuda):
        return None  # (before the copy that a strided x would cost)
    x = x.contiguous()
    return x if tiles_available(x, w, wanted) else None


def _forward_tiles(x, w, b, t, opts: LogprobOptions, chunk: int, tiling: tuple):
    """_forward_pass's outputs from the tile kernel: partials per class chunk, folded into the state."""
    num_tokens, vocab = x.shape[0], w.shape[0]
    z_t = torch.full((num_tokens,), float("nan"), dtype=torch.float32, device=x.device)
    chunks = class_chunks(vocab, chunk)
    state = torch.empty(0, dtype=torch.float32, device=x.device)
    outputs = None
    for i, (c0, c1) in enumerate(chunks):
        part = TILES_STATS(x, w[c0:c1], b[c0:c1] if b is not None else None, t, z_t, c0, *opts.transform(),
                           opts.entropy, opts.extras, *tiling)                     # (k, P, N)
        state, *outputs = TILES_COMBINE(part, z_t, t, state, vocab, i == 0, i == len(chunks) - 1,
                                        opts.ignore_index, opts.entropy, opts.extras)
        part = None
    logprobs, lse, ent, log_sum_sq, mean, top1 = outputs
    return logprobs, lse, ent, log_sum_sq, mean, top1.bool()


def _backward_pass(x, w, b, t, lse, entropy, grad_lp, grad_ent, opts, chunk, launch, need, grad_dtypes,
                   tiling=None):
    """(dx, dw, db): each class chunk of logits remade, turned into dl, and fed to the matmuls. With
    ``tiling`` (x as :func:`_tile_operand` made it) the tile kernel makes dl itself, logits unwritten."""
    need_dx, need_dw, need_db = need
    dx_dtype, dw_dtype, db_dtype = grad_dtypes
    num_tokens, vocab = x.shape[0], w.shape[0]
    inplace = x.dtype == torch.float32 and tiling is None
    cols = min(chunk, vocab)
    buffer = None if tiling is not None else chunk_buffer(num_tokens * cols, torch.float32, x.device)
    grad_buffer = None if inplace else chunk_buffer(num_tokens * cols, x.dtype, x.device)
    dx32 = torch.empty(x.shape, dtype=torch.float32, device=x.device) if need_dx else None
    dw = torch.empty(w.shape, dtype=dw_dtype, device=x.device) if need_dw else None
    db = torch.empty(vocab, dtype=db_dtype, device=x.device) if need_db else None
    for i, (c0, c1) in enumerate(class_chunks(vocab, chunk)):
        w_c = w[c0:c1]
        if tiling is not None:
            dlogits = chunk_view(grad_buffer, num_tokens, c1 - c0)
            if dlogits is None:
                dlogits = torch.empty((num_tokens, c1 - c0), dtype=x.dtype, device=x.device)
            TILES_GRAD(x, w_c, b[c0:c1] if b is not None else None, t, lse, entropy, grad_lp, grad_ent, dlogits,
                       c0, *opts.transform(), *tiling)                            # (N, Vc) in the matmul dtype
            _gradient_matmuls(x, w_c, dlogits, dx32, dw, db, c0, c1, first=i == 0)
            dlogits = None
            continue
        logits = linear_fp32(x, w_c, b[c0:c1] if b is not None else None, chunk_view(buffer, num_tokens, c1 - c0))
        args = (t, lse, entropy, grad_lp, grad_ent, c0, *opts.transform(), *launch)
        if inplace:
            LOGPROB_CHUNK_GRAD_INPLACE(logits, *args)
            dlogits = logits                                               # (N, Vc) fp32, overwritten
        else:
            dlogits = chunk_view(grad_buffer, num_tokens, c1 - c0)
            if dlogits is None:
                dlogits = torch.empty((num_tokens, c1 - c0), dtype=x.dtype, device=x.device)
            LOGPROB_CHUNK_GRAD(logits, dlogits, *args)                             # (N, Vc) in the matmul dtype
        _gradient_matmuls(x, w_c, dlogits, dx32, dw, db, c0, c1, first=i == 0)
        logits = dlogits = None
    buffer = grad_buffer = None  # freed before dX is made in its own dtype
    dx = (dx32 if dx_dtype == torch.float32 else dx32.to(dx_dtype)) if need_dx else None
    return dx, dw, db


def _gradient_matmuls(x, w_c, dlogits, dx32, dw, db, c0, c1, *, first):
    """One chunk's share of the gradients (None where not needed) from its dl (N, Vc)."""
    if dw is not None:
        matmul_accumulate(dw[c0:c1], dlogits.t(), x, first=True)       # (Vc, H): one matmul, K = N
    if dx32 is not None:
        matmul_accumulate(dx32, dlogits, w_c, first=first)             # (N, H), fp32 sum over chunks
    if db is not None:
        db[c0:c1] = dlogits.sum(0, dtype=torch.float32)


# ------------------------------------------------------------------------------------------- autograd


class FusedLinearLogprobsFunction(torch.autograd.Function):
    """Forward: per-row statistics only; backward: recompute every chunk with the upstream gradients."""

    @staticmethod
    def forward(ctx, input, linear_weight, linear_bias, target, ignore_index, temperature, softcap, logit_scale,
                entropy, extras, compute_dtype, chunks, block_v, num_warps, tiles, tiling, need_input, need_weight,
                need_bias):
        ctx.set_materialize_grads(False)
        opts = LogprobOptions.make(ignore_index, temperature, softcap, logit_scale, entropy, extras)
        launch = (block_v, num_warps)
        chunk, tile_forward_chunk, _ = chunks
        with autocast_off(input.device):
            x, w, b = compute_operands(input, linear_weight, linear_bias, compute_dtype)
            t = target.reshape(-1)
            x_tiles = _tile_operand(x, w, tiles)
            if x_tiles is not None:
                outputs = _forward_tiles(x_tiles, w, b, t, opts, tile_forward_chunk, tiling)
            else:
                outputs = _forward_pass(x, w, b, t, opts, chunk, launch)
            logprobs, lse, ent, log_sum_sq, mean, top1 = outputs
        need = (need_input, need_weight, need_bias)
        ctx.opts, ctx.chunks, ctx.launch, ctx.need = opts, chunks, launch, need
        ctx.tiles, ctx.tiling = tiles, tiling
        ctx.compute_dtype, ctx.input_shape = compute_dtype, input.shape
        ctx.grad_dtypes = (input.dtype, linear_weight.dtype, linear_bias.dtype if linear_bias is not None else None)
        if any(need):
            ctx.save_for_backward(input, linear_weight, linear_bias, target, lse, ent if entropy else None)
        shape = target.shape
        # The extras carry no gradient; they are detached by the caller (fused_linear_token_stats), not
        # marked here: AOTAutograd (torch.compile) asks for gradients of outputs marked so and fails.
        extra = (log_sum_sq.view(shape), mean.view(shape), top1.view(shape)) if extras else (None, None, None)
        return (logprobs.view(shape), ent.view(shape) if entropy else None) + extra

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        nothing = (None,) * 19
        if not any(ctx.need) or (grad_logprobs is None and grad_entropy is None):
            return nothing
        input, linear_weight, linear_bias, target, lse, ent = ctx.saved_tensors
        if not ctx.opts.entropy:
            grad_entropy = None
        with autocast_off(input.device):
            x, w, b = compute_operands(input, linear_weight, linear_bias, ctx.compute_dtype)
            t = target.reshape(-1)
            g_lp = grad_logprobs.reshape(-1) if grad_logprobs is not None else None
            g_ent = grad_entropy.reshape(-1) if grad_entropy is not None else None
            chunk, _, tile_backward_chunk = ctx.chunks
            x_tiles = _tile_operand(x, w, ctx.tiles)
            if x_tiles is not None:
                x, chunk, tiling = x_tiles, tile_backward_chunk, ctx.tiling
            else:
                tiling = None
            dx, dw, db = _backward_pass(
                x, w, b, t, lse, ent, g_lp, g_ent, ctx.opts, chunk, ctx.launch, ctx.need, ctx.grad_dtypes, tiling
            )
        dx = dx.view(ctx.input_shape) if dx is not None else None
        return (dx, dw, db) + nothing[3:]


# ----------------------------------------------------------------------------------- public functions


class TokenStats(NamedTuple):
    """Per-token outputs of :func:`fused_linear_token_stats`, each of ``target``'s shape (or None)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    log_sum_sq_probs: torch.Tensor | None
    mean_logits: torch.Tensor | None
    is_top1: torch.Tensor | None


def _check_number(name, value, *, positive=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if value != value or abs(value) == float("inf") or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite number{' > 0' if positive else ''}, got {value}")


def check_head_options(temperature, softcap, logit_scale, ignore_index) -> None:
    """The head's scalar options, checked without tensors (the loss classes check them when built)."""
    _check_number("temperature", temperature, positive=True)
    if softcap is not None:
        _check_number("softcap", softcap, positive=True)
    _check_number("logit_scale", logit_scale)
    # the loss options shared with cross_entropy (ignore_index's type among them); no class weights here
    check_loss_options(None, None, None, ignore_index, 0.0, "none", 0.0, softcap, logit_scale)


def check_logprob_arguments(input, linear_weight, target, linear_bias, temperature, softcap, logit_scale,
                     ignore_index, entropy, extras):
    vocab = check_linear_head(input, linear_weight, linear_bias)
    check_head_options(temperature, softcap, logit_scale, ignore_index)
    for name, flag in (("entropy", entropy), ("extras", extras)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    check_target(target, input.shape[:-1], input.device)
    return vocab


def fused_linear_token_stats(
    input,
    linear_weight,
    target,
    *,
    linear_bias=None,
    temperature=1.0,
    softcap=None,
    logit_scale=1.0,
    ignore_index=-100,
    entropy=False,
    extras=False,
    config: FusedLinearLogprobsConfig | None = None,
) -> TokenStats:
    """:func:`fused_linear_logprobs`, plus TRL 1.16's per-token metrics when ``extras=True``.

    ``log_sum_sq_probs`` (log Σ p²), ``mean_logits`` (mean over V of the scaled logits z) and
    ``is_top1`` (bool: the target is torch.argmax of z) come from the same pass over the logits,
    detached; 0 / False where the target is ``ignore_index``; None without ``extras``.
    """
    vocab = check_logprob_arguments(input, linear_weight, target, linear_bias, temperature, softcap, logit_scale,
                             ignore_index, entropy, extras)
    config = DEFAULT_CONFIG if config is None else config
    compute_dtype = head_compute_dtype(input, linear_weight, linear_bias)
    num_tokens = target.numel()
    grad_elem = 0 if compute_dtype == torch.float32 else torch.finfo(compute_dtype).bits // 8
    weight_bytes = linear_weight.numel() * linear_weight.element_size()
    chunks = (config.chunk_classes(num_tokens, vocab, grad_elem, weight_bytes),
              *config.tile_chunks(num_tokens, vocab, grad_elem, weight_bytes, part_rows(entropy, extras)))
    _, bad = REDUCTION_SCALES(target.reshape(-1), None, int(ignore_index), "sum", vocab)
    check = RangeCheck(bad)
    grad_on = torch.is_grad_enabled()
    outputs = FusedLinearLogprobsFunction.apply(
        input, linear_weight, linear_bias, target, int(ignore_index), float(temperature),
        None if softcap is None else float(softcap), float(logit_scale), entropy, extras, compute_dtype,
        chunks, config.block_v, config.num_warps, config.tiles, config.tiling(),
        grad_on and input.requires_grad, grad_on and linear_weight.requires_grad,
        grad_on and linear_bias is not None and linear_bias.requires_grad,
    )
    check.raise_if_bad(vocab, ignore_index)  # after the launches: nothing was written to inputs
    logprobs, ent, *extra = outputs
    return TokenStats(logprobs, ent, *(None if e is None else e.detach() for e in extra))


def fused_linear_logprobs(
    input,
    linear_weight,
    target,
    *,
    linear_bias=None,
    temperature=1.0,
    softcap=None,
    logit_scale=1.0,
    ignore_index=-100,
    entropy=False,
    config: FusedLinearLogprobsConfig | None = None,
):
    """Per-token ``(logprobs, entropy)`` of ``input @ linear_weight.T + linear_bias`` without its logits.

    ``input`` ``[..., H]``, ``linear_weight`` ``(V, H)``, ``linear_bias`` ``(V,)`` or None, ``target``
    ``input.shape[:-1]``. Logits are scaled by ``logit_scale``, softcapped (``softcap*tanh(z/softcap)``)
    and divided by ``temperature`` (module docstring). Both outputs float32 with ``target``'s shape,
    0 where the target is ``ignore_index``; ``entropy`` is None unless ``entropy=True``. Gradients
    flow from both to input, linear_weight and linear_bias.
    """
    stats = fused_linear_token_stats(
        input, linear_weight, target, linear_bias=linear_bias, temperature=temperature, softcap=softcap,
        logit_scale=logit_scale, ignore_index=ignore_index, entropy=entropy, config=config,
    )
    return stats.logprobs, stats.entropy


# ------------------------------------------------------------------------------------------ reference


def fused_linear_logprobs_reference(
    input, linear_weight, target, *, linear_bias=None, temperature=1.0, softcap=None, logit_scale=1.0,
    ignore_index=-100, entropy=False,
):
    """The contract in plain PyTorch, with the full logits.

    Operands are cast as F.linear casts them under autocast, then the logits are computed in fp32
    (fp64 for fp64 inputs, as tests pass them) and never rounded to the operands' dtype.
    """
    device_type = input.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        input, linear_weight = input.to(dtype), linear_weight.to(dtype)
        linear_bias = linear_bias.to(dtype) if linear_bias is not None else None
    wide = torch.float64 if input.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type, enabled=False):
        bias = linear_bias.to(wide) if linear_bias is not None else None
        z = torch.nn.functional.linear(input.to(wide), linear_weight.to(wide), bias) * logit_scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        log_p = torch.log_softmax(z, dim=-1)                                  # (..., V)
        valid = target != ignore_index
        safe = torch.where(valid, target, torch.zeros_like(target)).long()
        logprobs = log_p.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * valid
        ent = -(log_p.exp() * log_p).sum(-1) * valid if entropy else None
    return logprobs, ent
