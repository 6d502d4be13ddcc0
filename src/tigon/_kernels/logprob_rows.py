r"""The log-prob head's row path: the logits of a chunk of classes, made by a matmul into an fp32
buffer, folded into each token's online-softmax state by one program a row (the tile path, which
folds the matmul's tiles as they are made, is ``logprob_tiles``). Shared by the log-prob head
(tigon.ops.fused_linear_logprobs) and the single-pass losses (tigon.losses), which run the same
passes over their own chunks.

The math (the state, the outputs and their gradients) is derived in
``tigon.ops.fused_linear_logprobs``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tigon._kernels.fp32_math import as_fp32, fast_exp
from tigon._kernels.launch import TigonOp, persistent_programs, wrap_triton
from tigon._kernels.matmul import HAS_MM_OUT_DTYPE
from tigon._kernels.softmax_rows import local_column, scaled_logits, scaled_with_slope, store_zeros

# Rows of the per-token state carried between class chunks (fp32, (STATE_ROWS, N)).
STATE_ROWS = 7  # running max m, s = Σ e^(z−m), Σ e^(z−m)(z−m), Σ e^(2(z−m)), Σ z, max z before t, z_t

# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def logprobs_chunk_stats_kernel(
    chunk_ptr, chunk_row_stride,            # (N, width) fp32 logits of classes [col0, col0 + width), unit stride
    target_ptr, target_stride,              # (N,) class indices
    state_in_ptr, state_out_ptr,            # (7, N) fp32: state before / after this chunk   [not IS_FIRST / IS_LAST]
    logprob_ptr, lse_ptr,                   # (N,) fp32 out   [IS_LAST]
    entropy_ptr,                            # (N,) fp32 out   [IS_LAST and HAS_ENTROPY]
    log_sum_sq_ptr, mean_ptr, top1_ptr,     # (N,) fp32, fp32, uint8 out   [IS_LAST and HAS_EXTRAS]
    num_rows, vocab, col0, width, ignore_index, logit_scale, softcap, softcap_scale,
    BLOCK_V: tl.constexpr, IS_FIRST: tl.constexpr, IS_LAST: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, HAS_EXTRAS: tl.constexpr,
):
    """Fold one chunk of classes into each row's online-softmax state; the last chunk writes outputs.

    Per block of z: m' = max(m, max z), r = e^(m − m'); s ← r·s + Σ e^(z − m'),
    S ← r·(S + (m − m')·s) + Σ e^(z − m')(z − m') (entropy), Q ← r²·Q + Σ e^(2(z − m')) (extras).
    Σ z, the max before the target and z_t are kept per lane and reduced once after the chunk; z_t is
    taken from the same vector of z as the maximum, so ``is_top1`` compares bit-identical values.
    Ignored rows are never read.
    """
    logit_scale, softcap, softcap_scale = as_fp32(logit_scale), as_fp32(softcap), as_fp32(softcap_scale)
    for row64 in range(tl.program_id(0).to(tl.int64), num_rows, tl.num_programs(0)):
        t = tl.load(target_ptr + row64 * target_stride).to(tl.int64)
        if t == ignore_index:
            if IS_LAST:
                tl.store(logprob_ptr + row64, 0.0)
                tl.store(lse_ptr + row64, 0.0)
                if HAS_ENTROPY:
                    tl.store(entropy_ptr + row64, 0.0)
                if HAS_EXTRAS:
                    tl.store(log_sum_sq_ptr + row64, 0.0)
                    tl.store(mean_ptr + row64, 0.0)
                    tl.store(top1_ptr + row64, tl.zeros((), tl.uint8))
        else:
            if IS_FIRST:
                m = tl.full((), float("-inf"), tl.float32)
                s = tl.zeros((), tl.float32)
                ent = tl.zeros((), tl.float32)
                sq = tl.zeros((), tl.float32)
                z_sum = tl.zeros((), tl.float32)
                before = tl.full((), float("-inf"), tl.float32)
                z_t = tl.full((), float("nan"), tl.float32)  # stays NaN for a target outside [0, V)
            else:
                m = tl.load(state_in_ptr + row64)
                s = tl.load(state_in_ptr + num_rows + row64)
                ent = tl.load(state_in_ptr + 2 * num_rows + row64)
                sq = tl.load(state_in_ptr + 3 * num_rows + row64)
                z_sum = tl.load(state_in_ptr + 4 * num_rows + row64)
                before = tl.load(state_in_ptr + 5 * num_rows + row64)
                z_t = tl.load(state_in_ptr + 6 * num_rows + row64)
            t_local = local_column(t, col0, width)  # −1 when the target is elsewhere
            row_in = chunk_ptr + row64 * chunk_row_stride
            z_sum_lanes = tl.zeros([BLOCK_V], tl.float32)
            before_lanes = tl.full([BLOCK_V], float("-inf"), tl.float32)
            z_t_lanes = tl.zeros([BLOCK_V], tl.float32)
            for start in range(0, width, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                mask = cols < width
                l = tl.load(row_in + cols, mask=mask, other=0.0).to(tl.float32)
                z = scaled_logits(l, logit_scale, softcap, softcap_scale, HAS_SOFTCAP)
                z_t_lanes += tl.where(cols == t_local, z, 0.0)
                z = tl.where(mask, z, float("-inf"))
                m_new = tl.maximum(m, tl.max(z, axis=0))
                # a row that is −inf so far keeps shift 0, so exp never sees −inf − −inf
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                moved = tl.where(m == float("-inf"), 0.0, m - shift)  # ≤ 0; 0 while s = 0
                r = fast_exp(moved)
                e = fast_exp(z - shift)  # 0 where masked
                if HAS_ENTROPY:
                    ent = r * (ent + moved * s) + tl.sum(e * tl.where(mask, z - shift, 0.0), axis=0)
                if HAS_EXTRAS:
                    sq = sq * r * r + tl.sum(e * e, axis=0)
                    z_sum_lanes += tl.where(mask, z, 0.0)
                    before_lanes = tl.maximum(before_lanes, tl.where(col0 + cols < t, z, float("-inf")))
                s = s * r + tl.sum(e, axis=0)
                m = m_new
            z_t = tl.where(t_local >= 0, tl.sum(z_t_lanes, axis=0), z_t)
            if HAS_EXTRAS:
                z_sum += tl.sum(z_sum_lanes, axis=0)
                before = tl.maximum(before, tl.max(before_lanes, axis=0))
            if IS_LAST:
                log_s = tl.log(s)
                lse = tl.where(m == float("-inf"), 0.0, m) + log_s
                # z_t is NaN for a target outside [0, V): NaN lse makes the backward NaN too
                lse = tl.where(z_t == z_t, lse, float("nan"))
                tl.store(logprob_ptr + row64, z_t - lse)
                tl.store(lse_ptr + row64, lse)
                if HAS_ENTROPY:
                    # (+ lse − lse: NaN with the row's lse, 0 otherwise)
                    tl.store(entropy_ptr + row64, log_s - ent / s + (lse - lse))
                if HAS_EXTRAS:
                    tl.store(log_sum_sq_ptr + row64, tl.log(sq) - 2.0 * log_s)
                    tl.store(mean_ptr + row64, z_sum / vocab)
                    tl.store(top1_ptr + row64, ((z_t >= m) & (z_t > before)).to(tl.uint8))
            else:
                tl.store(state_out_ptr + row64, m)
                tl.store(state_out_ptr + num_rows + row64, s)
                tl.store(state_out_ptr + 2 * num_rows + row64, ent)
                tl.store(state_out_ptr + 3 * num_rows + row64, sq)
                tl.store(state_out_ptr + 4 * num_rows + row64, z_sum)
                tl.store(state_out_ptr + 5 * num_rows + row64, before)
                tl.store(state_out_ptr + 6 * num_rows + row64, z_t)


@triton.jit
def logprobs_chunk_grad_kernel(
    chunk_ptr, chunk_row_stride,            # (N, width) fp32 logits of classes [col0, col0 + width), unit stride
    grad_ptr, grad_row_stride,              # (N, width) out: dl in the matmul dtype; may be chunk itself
    target_ptr, target_stride,              # (N,) class indices
    lse_ptr, entropy_ptr,                   # (N,) fp32 from the forward   [entropy: HAS_ENTROPY_GRAD]
    grad_lp_ptr, grad_lp_stride,            # (N,) upstream gradient of logprobs   [HAS_LOGPROB_GRAD]
    grad_ent_ptr, grad_ent_stride,          # (N,) upstream gradient of entropy    [HAS_ENTROPY_GRAD]
    num_rows, col0, width, ignore_index, logit_scale, softcap, softcap_scale,
    BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_LOGPROB_GRAD: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
):
    """dl_j = (g_lp·([j = t] − p_j) − g_H·p_j·(log p_j + Hent))·∂z_j/∂l_j over one chunk (module docs).

    In place (grad = chunk, fp32) it is safe: each element is loaded and stored by the same thread.
    """
    logit_scale, softcap, softcap_scale = as_fp32(logit_scale), as_fp32(softcap), as_fp32(softcap_scale)
    for row64 in range(tl.program_id(0).to(tl.int64), num_rows, tl.num_programs(0)):
        row_out = grad_ptr + row64 * grad_row_stride
        t = tl.load(target_ptr + row64 * target_stride).to(tl.int64)
        if t == ignore_index:
            store_zeros(row_out, 1, width, BLOCK_V)
        else:
            row_in = chunk_ptr + row64 * chunk_row_stride
            lse = tl.load(lse_ptr + row64)
            if HAS_LOGPROB_GRAD:
                g_lp = tl.load(grad_lp_ptr + row64 * grad_lp_stride).to(tl.float32)
            else:
                g_lp = 0.0
            if HAS_ENTROPY_GRAD:
                g_ent = tl.load(grad_ent_ptr + row64 * grad_ent_stride).to(tl.float32)
                ent = tl.load(entropy_ptr + row64)
            else:
                g_ent = 0.0
                ent = 0.0
            t_local = local_column(t, col0, width)
            for start in range(0, width, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                mask = cols < width
                l = tl.load(row_in + cols, mask=mask, other=0.0).to(tl.float32)
                z, slope = scaled_with_slope(l, logit_scale, softcap, softcap_scale, HAS_SOFTCAP)
                log_p = z - lse
                p = fast_exp(log_p)
                dz = tl.zeros([BLOCK_V], tl.float32)
                if HAS_LOGPROB_GRAD:
                    dz = g_lp * (tl.where(cols == t_local, 1.0, 0.0) - p)
                if HAS_ENTROPY_GRAD:
                    dz -= g_ent * p * (log_p + ent)
                tl.store(row_out + cols, (dz * slope).to(grad_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------ launchers


def _programs(num_rows: int, device: torch.device) -> int:
    """One program per token on a GPU; the interpreter's persistent handful."""
    return max(1, num_rows if device.type == "cuda" else min(num_rows, persistent_programs(device)))


def _chunk_stats_impl(
    chunk: torch.Tensor,
    target: torch.Tensor,
    state: torch.Tensor,
    col0: int,
    vocab: int,
    is_first: bool,
    is_last: bool,
    ignore_index: int,
    logit_scale: float,
    softcap: float | None,
    softcap_scale: float,
    entropy: bool,
    extras: bool,
    block_v: int,
    num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(state after the chunk, logprobs, lse, entropy, log_sum_sq_probs, mean_logits, is_top1); the
    state is empty on the last chunk, the outputs on the others (and each output not asked for)."""
    num_rows, width = chunk.shape
    device = chunk.device

    def out(rows, wanted, dtype=torch.float32):
        return torch.empty(rows if wanted else (0,), dtype=dtype, device=device)

    state_out = out((STATE_ROWS, num_rows), not is_last)
    logprobs, lse = out((num_rows,), is_last), out((num_rows,), is_last)
    ent = out((num_rows,), is_last and entropy)
    log_sum_sq, mean = out((num_rows,), is_last and extras), out((num_rows,), is_last and extras)
    top1 = out((num_rows,), is_last and extras, torch.uint8)  # 0/1; made bool outside the op (Inductor
    # cannot lower a bool-to-uint8 view inside it)
    if num_rows == 0:
        return state_out, logprobs, lse, ent, log_sum_sq, mean, top1
    placeholder = logprobs if is_last else state_out
    wrap_triton(logprobs_chunk_stats_kernel)[(_programs(num_rows, device),)](
        chunk, chunk.stride(0),
        target, target.stride(0),
        state if not is_first else placeholder, state_out if not is_last else placeholder,
        logprobs if is_last else placeholder, lse if is_last else placeholder,
        ent if is_last and entropy else placeholder,
        log_sum_sq if is_last and extras else placeholder,
        mean if is_last and extras else placeholder,
        top1 if is_last and extras else placeholder,
        num_rows, vocab, col0, width, ignore_index, logit_scale,
        0.0 if softcap is None else softcap, softcap_scale,
        BLOCK_V=block_v, IS_FIRST=is_first, IS_LAST=is_last, HAS_SOFTCAP=softcap is not None,
        HAS_ENTROPY=entropy, HAS_EXTRAS=extras, num_warps=num_warps,
    )
    return state_out, logprobs, lse, ent, log_sum_sq, mean, top1


def launch_logprob_chunk_grad(
    chunk, grad, target, lse, entropy, grad_logprobs, grad_entropy, col0,
    ignore_index, logit_scale, softcap, softcap_scale, block_v, num_warps,
):
    """dl of one chunk into ``grad`` (which may be ``chunk``)."""
    num_rows, width = chunk.shape
    if num_rows == 0 or width == 0:
        return
    wrap_triton(logprobs_chunk_grad_kernel)[(_programs(num_rows, chunk.device),)](
        chunk, chunk.stride(0),
        grad, grad.stride(0),
        target, target.stride(0),
        lse, entropy if entropy is not None else lse,
        *((grad_logprobs, grad_logprobs.stride(0)) if grad_logprobs is not None else (lse, 0)),
        *((grad_entropy, grad_entropy.stride(0)) if grad_entropy is not None else (lse, 0)),
        num_rows, col0, width, ignore_index, logit_scale, 0.0 if softcap is None else softcap, softcap_scale,
        BLOCK_V=block_v, HAS_SOFTCAP=softcap is not None,
        HAS_LOGPROB_GRAD=grad_logprobs is not None, HAS_ENTROPY_GRAD=grad_entropy is not None,
        num_warps=num_warps,
    )


def _chunk_grad_impl(
    chunk: torch.Tensor,
    grad: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    col0: int,
    ignore_index: int,
    logit_scale: float,
    softcap: float | None,
    softcap_scale: float,
    block_v: int,
    num_warps: int,
) -> None:
    launch_logprob_chunk_grad(chunk, grad, target, lse, entropy, grad_logprobs, grad_entropy, col0,
                      ignore_index, logit_scale, softcap, softcap_scale, block_v, num_warps)


def _chunk_grad_inplace_impl(
    chunk: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    col0: int,
    ignore_index: int,
    logit_scale: float,
    softcap: float | None,
    softcap_scale: float,
    block_v: int,
    num_warps: int,
) -> None:
    launch_logprob_chunk_grad(chunk, chunk, target, lse, entropy, grad_logprobs, grad_entropy, col0,
                      ignore_index, logit_scale, softcap, softcap_scale, block_v, num_warps)


# ------------------------------------------------------------------------------------------ torch ops

LOGPROB_CHUNK_STATS = TigonOp("fused_linear_logprobs_chunk_stats", _chunk_stats_impl)
LOGPROB_CHUNK_GRAD = TigonOp("fused_linear_logprobs_chunk_grad_", _chunk_grad_impl, mutates_args={"grad"})
LOGPROB_CHUNK_GRAD_INPLACE = TigonOp(
    "fused_linear_logprobs_chunk_grad_inplace_", _chunk_grad_inplace_impl, mutates_args={"chunk"}
)


# ------------------------------------------------------------------------------------ chunked passes


@dataclass(frozen=True)
class LogprobOptions:
    """The logit transform as the kernels take it (temperature folded in) and the row options."""

    ignore_index: int
    logit_scale: float          # σ/T
    softcap: float | None       # κ/T
    softcap_scale: float        # σ/κ (0 without softcap)
    entropy: bool
    extras: bool

    @staticmethod
    def make(ignore_index, temperature, softcap, logit_scale, entropy, extras):
        inv_t = 1.0 / temperature
        return LogprobOptions(
            int(ignore_index), logit_scale * inv_t, None if softcap is None else softcap * inv_t,
            0.0 if softcap is None else logit_scale / softcap, bool(entropy), bool(extras),
        )

    def transform(self):
        return (self.ignore_index, self.logit_scale, self.softcap, self.softcap_scale)


def linear_fp32(x, w, b, out):
    """x·wᵀ + b in fp32, from operands in the compute dtype, never rounded to it.

    On a GPU a bf16/fp16 matmul writes its fp32 accumulator itself (aten::mm's ``out_dtype``);
    elsewhere the operands are widened first (every product of two bf16/fp16 values is exact in fp32).
    """
    if x.dtype == torch.float32:
        logits = torch.mm(x, w.t(), out=out) if out is not None else x @ w.t()
    elif HAS_MM_OUT_DTYPE and x.is_cuda:
        if out is not None:
            logits = torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
        else:
            logits = torch.mm(x, w.t(), out_dtype=torch.float32)
    else:
        wide = x.float() @ w.float().t()
        logits = out.copy_(wide) if out is not None else wide
    if b is not None:
        logits.add_(b)
    return logits
