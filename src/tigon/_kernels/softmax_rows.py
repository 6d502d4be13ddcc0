r"""The softmax-row machinery of the cross-entropy losses: what ``cross_entropy`` and the
vocabulary-chunk kernels of ``fused_linear_cross_entropy`` (``_vocab_chunks``) share.

Per row, in fp32: the scaled (and softcapped) logits z, the running statistics (max, Σ exp, Σ w·z)
folded one block at a time, the row's loss α·ℓ + β·ζ and the gradient coefficients, and the two
streamed passes over a row (pass 1 first block first, pass 2 last block first, with blocks loaded
ahead and L2 eviction hints). The formulas and their derivation are in ``cross_entropy``'s module
docstring, which uses the same names. Also here: the one-program kernel of the reduction factors
α, β, W and the out-of-range target check (``REDUCTION_SCALES``), and the launch helpers the row
kernels' launchers share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tigon._kernels.fp32_math import LOG2E, copysign_nonnegative, fast_exp, fast_reciprocal, reciprocal_1_to_2
from tigon._kernels.launch import TigonOp, persistent_programs, wrap_triton

# Softcapped rows take κ as their fixed softmax shift up to this κ: 2κ·log2(e) = 115 < 126, so
# e^(z − κ) never leaves fp32's normal range (the smallest term, e^(−2κ), flushes to 0 past κ ≈ 43.6).
MAX_SHIFT_SOFTCAP = 40.0
# L2 eviction policies as the kernels take them (load_hinted / store_hinted).
EVICT_NORMAL, EVICT_LAST, EVICT_FIRST = 0, 1, 2
# The reduction-factor kernel: one program walks the targets (and class weights) in blocks of this.
REDUCTION_SCALES_BLOCK = 1024
REDUCTION_SCALES_WARPS = 4


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def tanh_parts(l, softcap_scale, RECIPROCAL_ON_FMA: tl.constexpr = False):
    """(t, e·r, r) with t = tanh(|σ/κ|·l), e = e^(−2|σ·l/κ|), r = 1/(1 + e) (softcap_scale = σ/κ).

    tanh(a) = sign(a)·(1 − e)/(1 + e) with e = e^(−2|a|) ∈ (0, 1] (no overflow for any a), and
    (1 − e)/(1 + e) = r − e·r with 1 + e ∈ (1, 2]: a reciprocal that needs no range guard. With the
    constants folded into one scalar (e = 2^(c·|l|), c = −2·log2(e)·|σ/κ|) and the sign set by a
    bitwise or, t costs 6 instructions an element, two of them MUFU, where tanh from ``tl.exp`` and
    ``/`` took 18 (see fp32_math's transcendentals). The sign of σ is left to the caller's κ
    (:func:`signed_softcap`): z = κ·tanh(σ·l/κ) = κ_s·t. RECIPROCAL_ON_FMA takes r on the FMA pipe
    (fp32_math.reciprocal_1_to_2): for the statistics pass, whose ~14 other instructions an element
    leave the issue slots idle while its three MUFU instructions wait on that pipe.
    """
    e = tl.exp2(tl.abs(l) * (tl.abs(softcap_scale) * (-2.0 * LOG2E)))
    if RECIPROCAL_ON_FMA:
        r = reciprocal_1_to_2(1.0 + e)
    else:
        r = fast_reciprocal(1.0 + e)
    e_r = e * r
    return copysign_nonnegative(r - e_r, l), e_r, r


@triton.jit
def signed_softcap(softcap, softcap_scale):
    """κ_s = κ with the sign of σ, so that z = κ_s·t for t from :func:`tanh_parts`."""
    return tl.where(softcap_scale < 0, -softcap, softcap)


@triton.jit
def softcap_slope(e_r, r, logit_scale):
    """∂z/∂l = σ·(1 − tanh²) taken as σ·4e·r²: 1 − t² from a rounded t ≈ ±1 cancels (a 6% error at
    |σ·l/κ| ≈ 7 in fp32, and 0 past 9), 4e/(1 + e)² does not."""
    return e_r * (r * (4.0 * logit_scale))


@triton.jit
def softcapped(l, logit_scale, softcap, softcap_scale):
    """(z, ∂z/∂l) for z = κ·tanh(σ·l/κ)."""
    t, e_r, r = tanh_parts(l, softcap_scale)
    return signed_softcap(softcap, softcap_scale) * t, softcap_slope(e_r, r, logit_scale)


@triton.jit
def scaled_logits(l, logit_scale, softcap, softcap_scale, HAS_SOFTCAP: tl.constexpr):
    """z = σ·l, or κ·tanh(σ·l/κ) with softcap_scale = σ/κ."""
    if HAS_SOFTCAP:
        z, _slope = softcapped(l, logit_scale, softcap, softcap_scale)
    else:
        z = l * logit_scale
    return z


@triton.jit
def stats_update(
    z, mask, cols, weight_ptr, m, s, wz,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
):
    """Fold one block of z into the running max m, Σ exp(z − m) and Σ w·z (smoothing only)."""
    z_masked = tl.where(mask, z, float("-inf"))
    m_new = tl.maximum(m, tl.max(z_masked, axis=0))
    # A row that is -inf so far (masked vocabulary) keeps shift 0, so exp never sees -inf - -inf.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    s = s * fast_exp(m - shift) + tl.sum(fast_exp(z_masked - shift), axis=0)
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            wz += tl.sum(tl.where(mask, w * z, 0.0), axis=0)
        else:
            wz += tl.sum(tl.where(mask, z, 0.0), axis=0)
    return m_new, s, wz


@triton.jit
def stats_block(
    l, mask, cols, weight_ptr, m, s, wz, sums, wz_sums, logit_scale, softcap, softcap_scale,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    SOFTCAP_SHIFT: tl.constexpr,
):
    """Fold one block of fp32 logits ``l`` into the row statistics.

    SOFTCAP_SHIFT (cross_entropy's docstring): per-lane sums of e^(z − κ) (``sums``) and w·z
    (``wz_sums``), reduced once after the row; otherwise the running (m, s, wz) of stats_update.
    """
    if SOFTCAP_SHIFT:
        t, _e_r, _r = tanh_parts(l, softcap_scale, RECIPROCAL_ON_FMA=True)
        k2 = signed_softcap(softcap, softcap_scale) * LOG2E
        sums += tl.where(mask, tl.exp2(t * k2 - softcap * LOG2E), 0.0)  # e^(κ_s·t − κ), z ≤ κ
        if HAS_SMOOTHING:
            z = t * signed_softcap(softcap, softcap_scale)
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                wz_sums += tl.where(mask, w * z, 0.0)
            else:
                wz_sums += tl.where(mask, z, 0.0)
    else:
        z = scaled_logits(l, logit_scale, softcap, softcap_scale, HAS_SOFTCAP)
        m, s, wz = stats_update(z, mask, cols, weight_ptr, m, s, wz, HAS_WEIGHT, HAS_SMOOTHING)
    return m, s, wz, sums, wz_sums


@triton.jit
def target_terms(
    row_in, in_col_stride, t, col0, width, vocab, weight_ptr, logit_scale, softcap, softcap_scale,
    HAS_WEIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    """(w_y, z_y, in_chunk) for target t; the logits row covers classes [col0, col0 + width).

    A target outside [0, V) gets w_y = z_y = NaN (the row's loss and gradient become NaN); the loads
    use a clamped index, so no address outside the row or the weight vector is ever formed, and the
    row is read only when the target is in it (a chunk of no classes is never read).
    """
    in_range = (t >= 0) & (t < vocab)
    t_safe = tl.where(in_range, t, 0).to(tl.int32)
    if HAS_WEIGHT:
        w_y = tl.load(weight_ptr + t_safe).to(tl.float32)
    else:
        w_y = 1.0
    w_y = tl.where(in_range, w_y, float("nan"))
    in_chunk = in_range & (t >= col0) & (t < col0 + width)
    local = tl.where(in_chunk, t - col0, 0).to(tl.int32)
    l_y = tl.load(row_in + local * in_col_stride, mask=in_chunk, other=0.0).to(tl.float32)
    z_y = scaled_logits(l_y, logit_scale, softcap, softcap_scale, HAS_SOFTCAP)
    z_y = tl.where(in_range, z_y, float("nan"))
    return w_y, z_y, in_chunk


@triton.jit
def row_loss(
    lse, z_y, w_y, wz, weight_sum, inv_vocab, label_smoothing, z_loss, ce_scale, z_scale,
    HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
):
    """α·ℓ + β·ζ for one row (cross_entropy's docstring)."""
    ce = (1.0 - label_smoothing) * w_y * (lse - z_y)
    if HAS_SMOOTHING:
        ce += label_smoothing * inv_vocab * (weight_sum * lse - wz)
    loss = ce * ce_scale
    if HAS_Z_LOSS:
        loss += z_loss * lse * lse * z_scale
    return loss


@triton.jit
def grad_coefficients(
    lse, w_y, weight_sum, inv_vocab, label_smoothing, z_loss, ce_scale, z_scale, row_scale,
    HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
):
    """∂loss/∂z_j = p_coef·p_j − target_coef·[j = y] − smooth_coef·w_j (all times row_scale)."""
    target_coef = (1.0 - label_smoothing) * w_y * ce_scale * row_scale
    p_coef = (1.0 - label_smoothing) * w_y
    if HAS_SMOOTHING:
        p_coef += label_smoothing * weight_sum * inv_vocab
    p_coef = p_coef * ce_scale
    if HAS_Z_LOSS:
        p_coef += 2.0 * z_loss * lse * z_scale
    p_coef = p_coef * row_scale
    smooth_coef = label_smoothing * inv_vocab * ce_scale * row_scale
    return p_coef, target_coef, smooth_coef


@triton.jit
def local_column(t, col0, width):
    """Target t's column in a row of ``width`` classes starting at class col0, as an int32, or −1
    when t is elsewhere (another chunk, out of range): the per-element test ``cols == column`` is
    then one 32-bit compare, where an int64 target cost four instructions an element."""
    return tl.where((t >= col0) & (t < col0 + width), t - col0, -1).to(tl.int32)


@triton.jit
def grad_block(
    p, slope, cols, mask, t_local, weight_ptr, p_coef, target_coef, smooth_coef,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
):
    """∂loss/∂l for one block, from p = softmax(z) and slope = ∂z/∂l."""
    g = p * p_coef
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            g -= smooth_coef * w
        else:
            g -= smooth_coef
    g = tl.where(cols == t_local, g - target_coef, g)
    return g * slope


@triton.jit
def load_scaled_with_slope(
    row_in, in_col_stride, cols, mask, logit_scale, softcap, softcap_scale, HAS_SOFTCAP: tl.constexpr,
):
    """Load one block of logits (fp32 at once) and return z and ∂z/∂l."""
    l = tl.load(row_in + cols * in_col_stride, mask=mask, other=0.0).to(tl.float32)
    return scaled_with_slope(l, logit_scale, softcap, softcap_scale, HAS_SOFTCAP)


@triton.jit
def scaled_with_slope(l, logit_scale, softcap, softcap_scale, HAS_SOFTCAP: tl.constexpr):
    """z = softcap·tanh(l·softcap_scale) (softcap_scale folds logit_scale in), or l·logit_scale; and ∂z/∂l."""
    if HAS_SOFTCAP:
        z, slope = softcapped(l, logit_scale, softcap, softcap_scale)
    else:
        z = l * logit_scale
        slope = logit_scale
    return z, slope


@triton.jit
def store_zeros(row_out, out_col_stride, width, BLOCK_V: tl.constexpr):
    for start in range(0, width, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        zeros = tl.zeros([BLOCK_V], dtype=tl.float32).to(row_out.dtype.element_ty)
        tl.store(row_out + cols * out_col_stride, zeros, mask=cols < width)


@triton.jit
def load_hinted(ptrs, mask, POLICY: tl.constexpr):
    """tl.load with an L2 eviction hint: 0 none, 1 evict_last (read again soon), 2 evict_first."""
    if POLICY == 1:
        x = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
    elif POLICY == 2:
        x = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def store_hinted(ptrs, value, mask, POLICY: tl.constexpr):
    """tl.store with an L2 eviction hint (as :func:`load_hinted`)."""
    if POLICY == 2:
        tl.store(ptrs, value, mask=mask, eviction_policy="evict_first")
    else:
        tl.store(ptrs, value, mask=mask)


@triton.jit
def stream_stats(
    row_in, in_col_stride, width, weight_ptr, m, s, wz, logit_scale, softcap, softcap_scale,
    BLOCK_V: tl.constexpr, PREFETCH: tl.constexpr, READ_POLICY: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    SOFTCAP_SHIFT: tl.constexpr,
):
    """Pass 1 over a row, first block first, folding each block into (m, s, wz).

    What keeps loads in flight while a block is reduced (cross_entropy's docstring, "Streamed"): the
    next PREFETCH (1 or 2) blocks are loaded into registers before the current block is reduced.
    Loads past the row are masked off entirely.
    With SOFTCAP_SHIFT the blocks add into per-lane sums, reduced here once, after the row.
    """
    sums = tl.zeros([BLOCK_V], tl.float32)
    wz_sums = tl.zeros([BLOCK_V], tl.float32)
    cols = tl.arange(0, BLOCK_V)
    ahead = load_hinted(row_in + cols * in_col_stride, cols < width, READ_POLICY)
    if PREFETCH == 2:
        cols = BLOCK_V + tl.arange(0, BLOCK_V)
        ahead2 = load_hinted(row_in + cols * in_col_stride, cols < width, READ_POLICY)
    for start in range(0, width, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < width
        l = ahead.to(tl.float32)
        next_cols = cols + PREFETCH * BLOCK_V
        if PREFETCH == 2:
            ahead = ahead2
            ahead2 = load_hinted(row_in + next_cols * in_col_stride, next_cols < width, READ_POLICY)
        else:
            ahead = load_hinted(row_in + next_cols * in_col_stride, next_cols < width, READ_POLICY)
        m, s, wz, sums, wz_sums = stats_block(
            l, mask, cols, weight_ptr, m, s, wz, sums, wz_sums, logit_scale, softcap, softcap_scale,
            HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, SOFTCAP_SHIFT,
        )
    if SOFTCAP_SHIFT:
        # the incoming state (a previous vocabulary chunk's, or m = −inf, s = 0) moved to shift κ
        s = s * fast_exp(m - softcap) + tl.sum(sums, axis=0)
        wz += tl.sum(wz_sums, axis=0)
        m = softcap
    return m, s, wz


@triton.jit
def grad_store(
    l, cols, mask, row_out, out_col_stride, t_local, weight_ptr, lse, p_coef, target_coef, smooth_coef,
    logit_scale, softcap, softcap_scale, STORE_POLICY: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    """∂loss/∂l of one streamed block of fp32 logits ``l``, stored in the output's dtype."""
    if HAS_SOFTCAP:
        # p = e^(z − lse) as 2^(t·κ_s·log2 e − lse·log2 e): one fma, as z and lse are bounded by
        # κ + ln V the rounding of lse·log2 e stays within a few fp32 ulp of the exponent.
        t, e_r, r = tanh_parts(l, softcap_scale)
        p = tl.exp2(t * (signed_softcap(softcap, softcap_scale) * LOG2E) - lse * LOG2E)
        slope = softcap_slope(e_r, r, logit_scale)
    else:
        p = fast_exp(l * logit_scale - lse)
        slope = logit_scale
    g = grad_block(p, slope, cols, mask, t_local, weight_ptr, p_coef, target_coef, smooth_coef,
                   HAS_WEIGHT, HAS_SMOOTHING)
    store_hinted(row_out + cols * out_col_stride, g.to(row_out.dtype.element_ty), mask, STORE_POLICY)


@triton.jit
def stream_grad(
    row_in, in_col_stride, row_out, out_col_stride, width, t_local, weight_ptr, lse,
    p_coef, target_coef, smooth_coef, logit_scale, softcap, softcap_scale,
    BLOCK_V: tl.constexpr, PREFETCH: tl.constexpr, READ_POLICY: tl.constexpr, STORE_POLICY: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    """Pass 2 over a row, last block first: the blocks pass 1 read last are the likeliest in L2.

    Loads are kept in flight as in pass 1 (PREFETCH blocks ahead in registers). In
    place (row_out = row_in) it is safe: each element is loaded and stored by the same thread (one
    layout), every load of a block precedes its stores in program order, and a prefetched block is
    one not yet stored (the walk visits each block once).
    """
    num_blocks = tl.cdiv(width, BLOCK_V)
    last = (num_blocks - 1) * BLOCK_V
    cols = last + tl.arange(0, BLOCK_V)
    ahead = load_hinted(row_in + cols * in_col_stride, cols < width, READ_POLICY)
    if PREFETCH == 2:
        cols = last - BLOCK_V + tl.arange(0, BLOCK_V)
        ahead2 = load_hinted(row_in + cols * in_col_stride, cols >= 0, READ_POLICY)
    for i in range(0, num_blocks):
        cols = last - i * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = cols < width
        l = ahead.to(tl.float32)
        next_cols = cols - PREFETCH * BLOCK_V
        if PREFETCH == 2:
            ahead = ahead2
            ahead2 = load_hinted(row_in + next_cols * in_col_stride, next_cols >= 0, READ_POLICY)
        else:
            ahead = load_hinted(row_in + next_cols * in_col_stride, next_cols >= 0, READ_POLICY)
        grad_store(l, cols, mask, row_out, out_col_stride, t_local, weight_ptr, lse, p_coef,
                   target_coef, smooth_coef, logit_scale, softcap, softcap_scale, STORE_POLICY,
                   HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP)


@triton.jit
def reduction_scales_kernel(
    target_ptr, target_stride,              # (N,) class indices
    weight_ptr,                             # (V,) class weights   [HAS_WEIGHT]
    scales_ptr,                             # fp32 (3,) out: α, β, W = Σ class weights
    bad_ptr,                                # int64 (2,) out: any non-ignored target outside [0, V), its value
    num_rows, vocab, ignore_index,
    BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr, MEAN: tl.constexpr,
):
    """One program: the reduction factors and the out-of-range check in one pass over the targets.

    mean: α = 1/Σ w_y and β = 1/n over the n non-ignored rows, both 0 when n = 0 (loss 0, not NaN);
    sum and none: 1. A fixed-order sum, so the factors are deterministic.
    """
    count = tl.zeros((), tl.float32)
    target_weight = tl.zeros((), tl.float32)
    first_bad = tl.full((), num_rows, tl.int64)
    for start in range(0, num_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        t = tl.load(target_ptr + rows.to(tl.int64) * target_stride, mask=rows < num_rows, other=ignore_index)
        t = t.to(tl.int64)
        valid = (rows < num_rows) & (t != ignore_index)
        in_range = (t >= 0) & (t < vocab)
        count += tl.sum(valid.to(tl.float32), axis=0)
        if HAS_WEIGHT:
            ok = valid & in_range
            w = tl.load(weight_ptr + tl.where(ok, t, 0).to(tl.int32), mask=ok, other=0.0).to(tl.float32)
            target_weight += tl.sum(w, axis=0)
        bad_rows = tl.where(valid & ~in_range, rows.to(tl.int64), num_rows)
        first_bad = tl.minimum(first_bad, tl.min(bad_rows, axis=0))
    if HAS_WEIGHT:
        weight_sum = tl.zeros((), tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            w = tl.load(weight_ptr + cols, mask=cols < vocab, other=0.0).to(tl.float32)
            weight_sum += tl.sum(w, axis=0)
    else:
        weight_sum = vocab * 1.0
        target_weight = count
    if MEAN:
        any_valid = count > 0
        ce_scale = tl.where(any_valid, 1.0 / tl.where(any_valid, target_weight, 1.0), 0.0)
        z_scale = tl.where(any_valid, 1.0 / tl.maximum(count, 1.0), 0.0)
    else:
        ce_scale = 1.0
        z_scale = 1.0
    tl.store(scales_ptr, ce_scale)
    tl.store(scales_ptr + 1, z_scale)
    tl.store(scales_ptr + 2, weight_sum)
    any_bad = first_bad < num_rows
    bad_value = tl.load(target_ptr + tl.where(any_bad, first_bad, 0) * target_stride, mask=any_bad, other=0)
    tl.store(bad_ptr, any_bad.to(tl.int64))
    tl.store(bad_ptr + 1, bad_value.to(tl.int64))


# -------------------------------------------------------------------------------------- launch helpers


@dataclass(frozen=True)
class RowLaunch:
    """Block geometry of one launch of a row kernel (decided by the op's config)."""

    block_v: int
    num_warps: int
    single_block: bool
    programs: int
    prefetch: int = 1           # streamed: blocks loaded ahead into registers
    first_read_policy: int = EVICT_NORMAL
    second_read_policy: int = EVICT_NORMAL
    store_policy: int = EVICT_NORMAL
    row_prefetch: bool = False  # single block: the next row loaded ahead


def programs_per_sm(device: torch.device, per_sm: float) -> int:
    """A persistent grid of ``per_sm`` (maybe fractional) programs per SM; the interpreter's few."""
    if device.type != "cuda":
        return persistent_programs(device)
    return max(1, round(per_sm * persistent_programs(device, 1)))


def option_flags(weight, label_smoothing, z_loss, softcap):
    return dict(
        HAS_WEIGHT=weight is not None,
        HAS_SMOOTHING=label_smoothing > 0.0,
        HAS_Z_LOSS=z_loss != 0.0,
        HAS_SOFTCAP=softcap is not None,
    )


def softcap_args(softcap, logit_scale):
    """(softcap, σ/κ) for the kernels; zeros when there is no softcap (the kernels ignore them)."""
    if softcap is None:
        return 0.0, 0.0
    return float(softcap), float(logit_scale) / float(softcap)


def softcap_shift(softcap) -> bool:
    """Whether pass 1 takes κ as its fixed softmax shift (cross_entropy's docstring): softcapped logits lie in
    [−κ, κ], and e^(z − κ) ≥ e^(−2κ) must stay a normal fp32 number (κ ≤ MAX_SHIFT_SOFTCAP)."""
    return softcap is not None and softcap <= MAX_SHIFT_SOFTCAP


def row_scale_args(row_scale, placeholder):
    """(pointer, stride) of the optional per-row gradient scale; a placeholder pointer when absent."""
    return (row_scale, row_scale.stride(0)) if row_scale is not None else (placeholder, 0)


def _reduction_scales_impl(
    target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int, reduction: str, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales fp32 (3,): α, β, W; bad int64 (2,): any out-of-range target, its value), one launch."""
    scales = torch.empty(3, dtype=torch.float32, device=target.device)
    bad = torch.empty(2, dtype=torch.int64, device=target.device)
    wrap_triton(reduction_scales_kernel)[(1,)](
        target, target.stride(0) if target.dim() else 0,
        weight if weight is not None else scales,
        scales, bad,
        target.numel(), vocab, ignore_index,
        BLOCK=REDUCTION_SCALES_BLOCK, HAS_WEIGHT=weight is not None, MEAN=reduction == "mean",
        num_warps=REDUCTION_SCALES_WARPS,
    )
    return scales, bad


REDUCTION_SCALES = TigonOp("cross_entropy_reduction_scales", _reduction_scales_impl)
