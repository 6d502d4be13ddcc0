r"""Post-norm residual joins: ``s = residual + rms_norm(x)``, and the next norm of ``s``, in one pass.

Sandwich-norm decoder layers (Gemma-2, Gemma-3) normalise a sublayer's output before it joins the
residual stream, and the stream is normalised again at once for the next sublayer::

    s = residual + rms_norm(attention_out, w_post)        (sandwich_norm_join: one kernel)
    y = rms_norm(s, w_pre)                                 y feeds the MLP
    s' = s + rms_norm(mlp_out, w_post')                    (post_norm_join: one kernel)

Stock (and with separate norm kernels) that is three kernels per join and two more in the backward
(the fp32 residual gradients summed by autograd, the cast of the norm's gradient), each a pass over
the [tokens, hidden] activations. Here the join is one pass forward and one backward; the tensors
saved are the ones the separate ops save (x for the first norm, s for the second).

Forward, per row (``n``, ``s``, ``y`` rounded where transformers rounds them, see below)::

    rstd₁ = 1/sqrt(mean(x²) + eps)            n = norm₁(x)  (x̂ = x·rstd₁, then the casting's rule)
    s     = residual + n
    rstd₂ = 1/sqrt(mean(s²) + next_eps)       y = norm₂(s)  (ŝ = s·rstd₂)

with, for a norm of input ``v`` (io dtype = v's) and scale ``offset + w`` (rms_norm.py's module
docstring): casting "llama" ``r_v(v̂)·(offset + w)`` in the promotion of v's and w's dtypes, casting
"gemma" ``r_v(v̂·(offset + w))``. So n's dtype is x's or, for llama casting with a wider weight,
fp32; s's is the promotion of residual's and n's (fp32 under autocast: the residual stream is fp32,
the sublayer output bf16); y's is norm₂'s, or ``out_dtype``.

Backward, with rounding taken as the identity (as autograd does for ``.to``), ``dy`` the gradient of
y and ``dS`` that of the s output (the residual stream's later uses)::

    g₂  = dy·(offset + w₂),   c₂ = mean(g₂·ŝ)
    ds  = rstd₂·(g₂ − ŝ·c₂) + dS              the gradient of s, both of its uses
    dresidual = ds                             (rounded to residual's dtype; without norm₂, dS itself:
                                               no pass at all, as autograd's add passes it on)
    dn  = r_n(ds)                              (autograd's cast of the add's gradient to n's dtype)
    g₁  = dn·(offset + w₁),   c₁ = mean(g₁·x̂)
    dx  = rstd₁·(g₁ − x̂·c₁)
    dw₁ = Σ_rows dn·r_x(x̂) (llama) or dn·x̂ (gemma);   dw₂ likewise with dy and ŝ

dw₁ and dw₂ are reduced as rms_norm.py's backward reduces dw: the persistent grid's bands each
accumulate an fp32 partial row, summed in a fixed order (bitwise repeatable, no atomics).

Bytes (speed of light), M rows of N, element sizes b_x, b_r, b_s, b_y (b_dy: y's gradient)::

    forward   read x, residual; write s, y (M·N each, in its dtype), rstd₁, rstd₂ (4M each)
    backward  read dy, dS, s, x; write dx, dresidual; dw₁, dw₂ (fp32 partials, a few rows);
              without norm₂: read dS, x; write dx, dw₁

OLMo-2/3 normalise after each sublayer only: both of their joins are ``post_norm_join``.

Against the three separate kernels (norm, add, norm; with bf16 x, fp32 residual and bf16 y: 20 bytes
an element forward, 34 backward counting autograd's sum and cast), the join moves 12 and 18.

Rows are held in registers (one pass over each tensor); rows longer than
``CONFIG.max_fused_hidden`` (8192, RMSNorm's backward limit) are not fused: the functions run rms_norm, the add
and rms_norm as three ops there (the same values and gradients).

Reference: :func:`post_norm_join_reference` / :func:`sandwich_norm_join_reference` (transformers'
``Gemma2DecoderLayer`` lines ``hidden_states = residual + self.post_attention_layernorm(...)`` and
the ``pre_feedforward_layernorm`` that follows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tigon._kernels import (
    FLOAT_DTYPES,
    RMS_NORM_CONFIG,
    TigonOp,
    as_fp32,
    as_rows,
    cdiv,
    check_real,
    check_tensor,
    load_tile,
    norm_backward_launch,
    norm_launch,
    sum_partial_rows,
    wrap_triton,
)
from tigon.ops.rms_norm import (
    check_rms_norm_args,
    check_scale,
    rms_norm,
    rms_norm_output_dtype,
    rms_norm_reference,
)


@dataclass(frozen=True)
class NormJoinConfig:
    """Launch settings of the fused join; its tiles and grid are otherwise RMSNorm's (``RMS_NORM_CONFIG``)."""

    # Rows up to this many elements are fused (held in registers forward and backward); longer rows
    # run as three separate ops. The backward holds four row tiles (dy, dS, s, x): RMSNorm's
    # backward limit is the one.
    max_fused_hidden: int = RMS_NORM_CONFIG.backward.max_fused_hidden
    # The backward's warps: RMSNorm's backward geometry (bands, rows a tile) with at most this many
    # elements of a tile per warp, since this kernel holds four row tiles and two scale and two dw
    # vectors where RMSNorm's holds two (and their prefetched successors).
    bwd_elements_per_warp: int = 512
    bwd_max_warps: int = 16


CONFIG = NormJoinConfig()


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _scale(weight_ptr, cols, hidden, offset, HAS_WEIGHT: tl.constexpr):
    """offset + w over the tile's columns (fp32), or 1 without a weight."""
    if HAS_WEIGHT:
        return tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32) + offset
    return tl.full(cols.shape, 1.0, tl.float32)


@triton.jit
def _norm_value(v_hat, scale, IO_DTYPE: tl.constexpr, LLAMA_CASTING: tl.constexpr):
    """A norm's output before its final rounding: r_v(v̂)·(offset + w) (llama) or v̂·(offset + w)."""
    if LLAMA_CASTING:
        v_hat = v_hat.to(IO_DTYPE).to(tl.float32)
    return v_hat * scale[None, :]


@triton.jit
def _input_grad(g, v_hat, rstd, hidden, eps):
    """dv = rstd·(g − v̂·c), c = mean(g·v̂), for one tile of whole rows.

    At hidden == 1, g − v̂·c = g·(1 − v̂²) cancels to nothing in fp32 (v̂² = 1 − eps·rstd²), so that
    case uses the exact form rstd·g·eps·rstd² = g·eps·rstd³ (as rms_norm's backward does).
    """
    if hidden == 1:
        dv = g * (eps * rstd * rstd * rstd)[:, None]
    else:
        c = tl.sum(g * v_hat, axis=1) / hidden
        dv = (g - v_hat * c[:, None]) * rstd[:, None]
    return dv


@triton.jit
def norm_join_fwd_kernel(
    x_ptr, x_row_stride, x_col_stride,          # (M, N) the sublayer's output, normalised first
    res_ptr, res_row_stride, res_col_stride,    # (M, N) the residual stream it joins
    weight_ptr,                                 # (N,) norm₁'s scale; offset + w is used  [HAS_WEIGHT]
    next_weight_ptr,                            # (N,) norm₂'s scale                      [HAS_NEXT_WEIGHT]
    s_ptr,                                      # (M, N) out, contiguous: residual + norm₁(x)
    y_ptr,                                      # (M, N) out, contiguous: norm₂(s)        [HAS_NEXT]
    rstd_ptr, next_rstd_ptr,                    # (M,) out, fp32 each (next_rstd          [HAS_NEXT])
    num_rows, hidden, eps, next_eps, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROUND_N: tl.constexpr,                      # n is rounded to x's dtype (else n is fp32)
    HAS_WEIGHT: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_NEXT_WEIGHT: tl.constexpr, LLAMA_CASTING: tl.constexpr,
):
    """One program joins BLOCK_M whole rows (BLOCK_N ≥ hidden): x and residual read once, s and y
    written once; both row reductions run on the registers."""
    eps, next_eps, offset = as_fp32(eps), as_fp32(next_eps), as_fp32(offset)
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    S_DTYPE: tl.constexpr = s_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (cols < hidden)[None, :]
    x = load_tile(x_ptr, x_row_stride, x_col_stride, rows, cols, mask)
    residual = load_tile(res_ptr, res_row_stride, res_col_stride, rows, cols, mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)
    n = _norm_value(x * rstd[:, None], _scale(weight_ptr, cols, hidden, offset, HAS_WEIGHT), X_DTYPE, LLAMA_CASTING)
    if ROUND_N:
        n = n.to(X_DTYPE).to(tl.float32)
    s = (residual + n).to(S_DTYPE)
    out_offsets = rows[:, None] * hidden + cols[None, :]
    tl.store(s_ptr + out_offsets, s, mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    if HAS_NEXT:
        s = s.to(tl.float32)
        next_rstd = tl.rsqrt(tl.sum(s * s, axis=1) / hidden + next_eps)
        next_scale = _scale(next_weight_ptr, cols, hidden, offset, HAS_NEXT_WEIGHT)
        y = _norm_value(s * next_rstd[:, None], next_scale, S_DTYPE, LLAMA_CASTING)
        tl.store(y_ptr + out_offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(next_rstd_ptr + rows, next_rstd, mask=row_mask)


@triton.jit
def norm_join_bwd_kernel(
    dy_ptr, dy_row_stride, dy_col_stride,       # (M, N) gradient of y, any strides (stride 0 too) [HAS_NEXT]
    ds_ptr, ds_row_stride, ds_col_stride,       # (M, N) gradient of the s output                  [HAS_DSUM]
    x_ptr, x_row_stride, x_col_stride,          # (M, N) x, saved
    s_ptr,                                      # (M, N) s, saved by the forward (contiguous)      [HAS_NEXT]
    weight_ptr, next_weight_ptr,                # (N,) each                       [HAS_WEIGHT, HAS_NEXT_WEIGHT]
    rstd_ptr, next_rstd_ptr,                    # (M,) fp32 each, saved                            [next: HAS_NEXT]
    dx_ptr,                                     # (M, N) out, contiguous: x's gradient
    dres_ptr,                                   # (M, N) out, contiguous: residual's gradient   [HAS_NEXT]
    dw_partial_ptr, next_dw_partial_ptr,        # (bands, N) out, fp32: each band's Σ of dw₁ / dw₂ terms
    num_rows, hidden, eps, next_eps, offset, rows_per_band,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_N: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_NEXT_WEIGHT: tl.constexpr, HAS_DSUM: tl.constexpr,
    LLAMA_CASTING: tl.constexpr,
):
    """Persistent: band b owns rows [b·rows_per_band, (b+1)·rows_per_band), BLOCK_M whole rows at a
    time, and accumulates its dw₁ / dw₂ partial rows in registers, stored once at the end."""
    eps, next_eps, offset = as_fp32(eps), as_fp32(next_eps), as_fp32(offset)
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    S_DTYPE: tl.constexpr = s_ptr.dtype.element_ty
    band = tl.program_id(0)
    row_begin = band.to(tl.int64) * rows_per_band
    row_end = tl.minimum(row_begin + rows_per_band, num_rows)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    scale = _scale(weight_ptr, cols, hidden, offset, HAS_WEIGHT)
    next_scale = _scale(next_weight_ptr, cols, hidden, offset, HAS_NEXT_WEIGHT)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    next_dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row_start in range(row_begin, row_end, BLOCK_M):
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        # every load of the tile first, so that they are in flight together
        x = load_tile(x_ptr, x_row_stride, x_col_stride, rows, cols, mask)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        if HAS_DSUM:
            ds = load_tile(ds_ptr, ds_row_stride, ds_col_stride, rows, cols, mask)
        if HAS_NEXT:
            dy = load_tile(dy_ptr, dy_row_stride, dy_col_stride, rows, cols, mask)
            s = load_tile(s_ptr, hidden, 1, rows, cols, mask)
            next_rstd = tl.load(next_rstd_ptr + rows, mask=row_mask, other=0.0)
            s_hat = s * next_rstd[:, None]
            # padding lanes: dy = 0 there, so g₂ = 0 and they add nothing to c₂ or dw₂
            ds_norm = _input_grad(dy * next_scale[None, :], s_hat, next_rstd, hidden, next_eps)
            if HAS_DSUM:
                ds += ds_norm
            else:
                ds = ds_norm
            if HAS_NEXT_WEIGHT:
                if LLAMA_CASTING:
                    s_hat = s_hat.to(S_DTYPE).to(tl.float32)
                next_dw_acc += tl.sum(dy * s_hat, axis=0)
        out_offsets = rows[:, None] * hidden + cols[None, :]
        if HAS_NEXT:
            tl.store(dres_ptr + out_offsets, ds.to(dres_ptr.dtype.element_ty), mask=mask)
        dn = ds
        if ROUND_N:
            dn = ds.to(X_DTYPE).to(tl.float32)
        x_hat = x * rstd[:, None]
        dx = _input_grad(dn * scale[None, :], x_hat, rstd, hidden, eps)
        tl.store(dx_ptr + out_offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            if LLAMA_CASTING:
                x_hat = x_hat.to(X_DTYPE).to(tl.float32)
            dw_acc += tl.sum(dn * x_hat, axis=0)
    dw_offsets = band.to(tl.int64) * hidden + cols
    if HAS_WEIGHT:
        tl.store(dw_partial_ptr + dw_offsets, dw_acc, mask=col_mask)
    if HAS_NEXT_WEIGHT:
        tl.store(next_dw_partial_ptr + dw_offsets, next_dw_acc, mask=col_mask)


# ------------------------------------------------------------------------------------------ launchers


def _rounds_n(x_dtype, weight_dtype, casting) -> bool:
    """Whether norm₁'s output is rounded to x's dtype; otherwise it is fp32 (module docstring)."""
    n_dtype = rms_norm_output_dtype(x_dtype, weight_dtype, casting)
    if n_dtype not in (x_dtype, torch.float32):  # cannot happen: promotion gives x's dtype or fp32
        raise AssertionError(f"norm output dtype {n_dtype} from x {x_dtype}")
    return n_dtype == x_dtype


def _backward_warps(cfg) -> int:
    """RMSNorm's backward warps for the tile, raised to hold this kernel's larger tiles."""
    return min(CONFIG.bwd_max_warps, max(cfg.num_warps, cfg.block_m * cfg.block_n // CONFIG.bwd_elements_per_warp))


def _forward(x, residual, weight, next_weight, eps, next_eps, offset, casting, has_next, out_dtype):
    """Launch the forward; returns (y or None, s, rstd, next_rstd or None), y and s shaped like x."""
    hidden = x.shape[-1]
    x2, r2 = as_rows(x), as_rows(residual)
    num_rows = x2.shape[0]
    weight_dtype = weight.dtype if weight is not None else None
    n_dtype = rms_norm_output_dtype(x.dtype, weight_dtype, casting)
    s = torch.empty(x.shape, dtype=torch.promote_types(residual.dtype, n_dtype), device=x.device)
    rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    y = next_rstd = None
    if has_next:
        next_dtype = next_weight.dtype if next_weight is not None else None
        y_dtype = out_dtype or rms_norm_output_dtype(s.dtype, next_dtype, casting)
        y = torch.empty(x.shape, dtype=y_dtype, device=x.device)
        next_rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows == 0 or hidden == 0:
        return y, s, rstd, next_rstd
    cfg = norm_launch(num_rows, hidden, backward=False)
    wrap_triton(norm_join_fwd_kernel)[(cdiv(num_rows, cfg.block_m),)](
        x2, x2.stride(0), x2.stride(1),
        r2, r2.stride(0), r2.stride(1),
        weight if weight is not None else x2,
        next_weight if next_weight is not None else x2,
        s, y if has_next else s, rstd, next_rstd if has_next else rstd,
        num_rows, hidden, eps, next_eps, offset,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ROUND_N=_rounds_n(x.dtype, weight_dtype, casting),
        HAS_WEIGHT=weight is not None, HAS_NEXT=has_next, HAS_NEXT_WEIGHT=next_weight is not None,
        LLAMA_CASTING=casting == "llama",
        num_warps=cfg.num_warps,
    )
    return y, s, rstd, next_rstd


def _backward(dy, dsum, x, s, weight, next_weight, rstd, next_rstd, eps, next_eps, offset, casting, residual_dtype):
    """Launch the backward; returns (dx, dresidual, dw, next_dw), a missing weight's gradient empty.

    ``dy``/``s``/``next_rstd`` are None without norm₂; ``dsum`` is None where the s output got no
    gradient. Where y got no gradient (or there is no norm₂), residual's gradient is ``dsum`` itself
    (cast to its dtype, :func:`_passed_on`); then dresidual comes back empty (an op's output may
    not alias its input).
    """
    hidden = x.shape[-1]
    x2 = as_rows(x)
    num_rows = x2.shape[0]
    has_next = s is not None and dy is not None  # y got a gradient
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dres = torch.empty(x.shape if has_next else 0, dtype=residual_dtype, device=x.device)
    empty = torch.empty(0, dtype=x.dtype, device=x.device)
    dw = torch.empty_like(weight) if weight is not None else empty
    next_dw = torch.empty_like(next_weight) if next_weight is not None else empty
    if num_rows == 0 or hidden == 0 or (dsum is None and not has_next):
        # nothing flows back (or nothing to reduce over): every gradient is zero
        return dx.zero_(), dres.zero_(), dw.zero_(), next_dw.zero_()
    cfg = norm_backward_launch(num_rows, hidden, x.device)
    partials = torch.empty((2, cfg.bands, hidden), dtype=torch.float32, device=x.device)
    dy2 = as_rows(dy) if has_next else x2
    ds2 = as_rows(dsum) if dsum is not None else x2
    wrap_triton(norm_join_bwd_kernel)[(cfg.bands,)](
        dy2, dy2.stride(0), dy2.stride(1),
        ds2, ds2.stride(0), ds2.stride(1),
        x2, x2.stride(0), x2.stride(1),
        s if has_next else dx,
        weight if weight is not None else x2, next_weight if next_weight is not None else x2,
        rstd, next_rstd if has_next else rstd,
        dx, dres if has_next else dx, partials[0], partials[1],
        num_rows, hidden, eps, next_eps, offset, cfg.rows_per_band,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        ROUND_N=_rounds_n(x.dtype, weight.dtype if weight is not None else None, casting),
        HAS_WEIGHT=weight is not None, HAS_NEXT=has_next, HAS_NEXT_WEIGHT=has_next and next_weight is not None,
        HAS_DSUM=dsum is not None, LLAMA_CASTING=casting == "llama",
        num_warps=_backward_warps(cfg),
    )
    if not has_next and next_weight is not None:
        next_dw.zero_()  # y got no gradient
    if weight is not None or (has_next and next_weight is not None):
        sum_partial_rows(
            partials[0] if weight is not None else None,
            partials[1] if has_next and next_weight is not None else None,
            dw if weight is not None else None,
            next_dw if has_next and next_weight is not None else None,
            cfg.bands, hidden,
        )
    return dx, dres, dw, next_dw


# ------------------------------------------------------------------------------- torch ops + autograd


def _post_norm_join_impl(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str
) -> tuple[torch.Tensor, torch.Tensor]:
    _, s, rstd, _ = _forward(x, residual, weight, None, eps, eps, offset, casting, False, None)
    return s, rstd


def _sandwich_norm_join_impl(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, next_weight: torch.Tensor | None,
    eps: float, next_eps: float, offset: float, casting: str, out_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(x, residual, weight, next_weight, eps, next_eps, offset, casting, True, out_dtype)


def _norm_join_backward_impl(
    dy: torch.Tensor | None, dsum: torch.Tensor | None, x: torch.Tensor, s: torch.Tensor | None,
    weight: torch.Tensor | None, next_weight: torch.Tensor | None, rstd: torch.Tensor, next_rstd: torch.Tensor | None,
    eps: float, next_eps: float, offset: float, casting: str, residual_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dy, dsum, x, s, weight, next_weight, rstd, next_rstd, eps, next_eps, offset, casting,
                     residual_dtype)


NORM_JOIN_BACKWARD = TigonOp("norm_join_backward", _norm_join_backward_impl)


def _passed_on(dsum, x, residual_dtype):
    """residual's gradient where the kernel computes none: the s output's, as autograd's add passes
    it on (cast to residual's dtype; zero where s got no gradient)."""
    if dsum is None:
        return torch.zeros(x.shape, dtype=residual_dtype, device=x.device)
    return dsum.to(residual_dtype)


def _setup_post_norm_join(ctx, inputs, output):
    x, residual, weight, eps, offset, casting = inputs
    _s, rstd = output
    ctx.save_for_backward(x, weight, rstd)  # not s: norm₁'s backward needs only x
    ctx.eps, ctx.offset, ctx.casting, ctx.residual_dtype = eps, offset, casting, residual.dtype
    ctx.mark_non_differentiable(rstd)


def _post_norm_join_grad(ctx, dsum, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, _, dw, _ = NORM_JOIN_BACKWARD(
        None, dsum, x, None, weight, None, rstd, None, ctx.eps, ctx.eps, ctx.offset, ctx.casting, ctx.residual_dtype
    )
    return dx, _passed_on(dsum, x, ctx.residual_dtype), (dw if weight is not None else None), None, None, None


def _setup_sandwich_norm_join(ctx, inputs, output):
    x, residual, weight, next_weight, eps, next_eps, offset, casting, _out_dtype = inputs
    _y, s, rstd, next_rstd = output
    ctx.save_for_backward(x, s, weight, next_weight, rstd, next_rstd)
    ctx.eps, ctx.next_eps, ctx.offset, ctx.casting, ctx.residual_dtype = eps, next_eps, offset, casting, residual.dtype
    ctx.mark_non_differentiable(rstd, next_rstd)


def _sandwich_norm_join_grad(ctx, dy, dsum, _drstd, _dnext_rstd):
    x, s, weight, next_weight, rstd, next_rstd = ctx.saved_tensors
    dx, dres, dw, next_dw = NORM_JOIN_BACKWARD(
        dy, dsum, x, s, weight, next_weight, rstd, next_rstd, ctx.eps, ctx.next_eps, ctx.offset, ctx.casting,
        ctx.residual_dtype,
    )
    if dy is None:
        dres = _passed_on(dsum, x, ctx.residual_dtype)
    return (
        dx, dres, (dw if weight is not None else None), (next_dw if next_weight is not None else None),
        None, None, None, None, None,
    )


POST_NORM_JOIN = TigonOp(
    "post_norm_join", _post_norm_join_impl, setup_context=_setup_post_norm_join, backward=_post_norm_join_grad
)
SANDWICH_NORM_JOIN = TigonOp(
    "sandwich_norm_join", _sandwich_norm_join_impl,
    setup_context=_setup_sandwich_norm_join, backward=_sandwich_norm_join_grad,
)


# ------------------------------------------------------------------------------------ public functions


def _check_join(x, residual, weight, eps, casting, offset, next_weight=None, next_eps=None):
    check_rms_norm_args(x, weight, eps, casting, offset=offset)
    check_tensor(residual, "residual", device=x.device)
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, expected x's {tuple(x.shape)}")
    if next_weight is not None:
        check_scale(next_weight, "next_weight", x)
    if next_eps is not None:
        check_real(next_eps, "next_eps", minimum=0.0)


def _fused(x) -> bool:
    return x.shape[-1] <= CONFIG.max_fused_hidden


def post_norm_join(x, residual, weight, eps=1e-6, *, offset=0.0, casting="llama"):
    """``residual + rms_norm(x, weight, eps, offset=offset, casting=casting)`` in one pass.

    The residual join of post-norm layers (Gemma-2/3's second join, OLMo-2/3's both). ``x`` and
    ``residual`` may differ in dtype (a bf16 sublayer output joining an fp32 residual stream under
    autocast): the sum takes torch's type promotion, as the eager ``residual + norm(x)`` does. Saves
    x (not the sum) for the backward.
    """
    _check_join(x, residual, weight, eps, casting, offset)
    weight = None if weight is None else weight.contiguous()  # the kernels read it with unit stride
    if not _fused(x):
        return residual + rms_norm(x, weight, eps, offset=offset, casting=casting)
    s, _ = POST_NORM_JOIN(x, residual, weight, float(eps), float(offset), casting)
    return s


def sandwich_norm_join(
    x, residual, weight, next_weight, eps=1e-6, *, next_eps=None, offset=0.0, casting="llama", out_dtype=None
):
    """``s = residual + rms_norm(x, weight, eps)`` and ``y = rms_norm(s, next_weight, next_eps)`` in one
    pass; returns ``(y, s)``.

    Both norms take ``offset`` and ``casting``; ``next_eps`` defaults to ``eps``. ``out_dtype`` is
    y's dtype as :func:`tigon.ops.rms_norm` takes it (None: norm₂'s own). ``weight`` or
    ``next_weight`` None: that norm has no scale. See the module docstring for the math.
    """
    _check_join(x, residual, weight, eps, casting, offset, next_weight, next_eps)
    weight = None if weight is None else weight.contiguous()  # the kernels read it with unit stride
    next_weight = None if next_weight is None else next_weight.contiguous()
    next_eps = eps if next_eps is None else next_eps
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of {FLOAT_DTYPES} or None, got {out_dtype}")
    if not _fused(x):
        s = residual + rms_norm(x, weight, eps, offset=offset, casting=casting)
        return rms_norm(s, next_weight, next_eps, offset=offset, casting=casting, out_dtype=out_dtype), s
    y, s, _, _ = SANDWICH_NORM_JOIN(
        x, residual, weight, next_weight, float(eps), float(next_eps), float(offset), casting, out_dtype
    )
    return y, s


# ------------------------------------------------------------------------------------------ reference


def _rounded(t, dtype):
    """``t`` rounded to ``dtype``; an fp64 tensor (the tests' stand-in for ``dtype``) stays fp64."""
    return t.to(dtype).to(torch.float64) if t.dtype == torch.float64 else t.to(dtype)


def post_norm_join_reference(x, residual, weight, eps=1e-6, *, offset=0.0, casting="llama", dtypes=None):
    """``residual + norm(x)`` as transformers computes it, in PyTorch.

    ``dtypes``: ``{"x": ..., "residual": ..., "weight": ...}``, the dtypes that fp64 tensors stand for
    (tests pass fp64 tensors and round where the real dtypes round); None: the tensors' own.
    """
    dtypes = dtypes or {"x": x.dtype, "residual": residual.dtype, "weight": getattr(weight, "dtype", None)}
    n_dtype = rms_norm_output_dtype(dtypes["x"], dtypes["weight"], casting)
    n = _rounded(rms_norm_reference(x, weight, eps, offset=offset, casting=casting, io_dtype=dtypes["x"]), n_dtype)
    return _rounded(residual + n, torch.promote_types(dtypes["residual"], n_dtype))


def sandwich_norm_join_reference(
    x, residual, weight, next_weight, eps=1e-6, *, next_eps=None, offset=0.0, casting="llama", out_dtype=None,
    dtypes=None,
):
    """:func:`post_norm_join_reference`, then transformers' norm of the sum; returns ``(y, s)``.

    ``dtypes`` as there, with ``"next_weight"`` too.
    """
    dtypes = dtypes or {
        "x": x.dtype, "residual": residual.dtype, "weight": getattr(weight, "dtype", None),
        "next_weight": getattr(next_weight, "dtype", None),
    }
    s = post_norm_join_reference(x, residual, weight, eps, offset=offset, casting=casting, dtypes=dtypes)
    s_dtype = torch.promote_types(dtypes["residual"], rms_norm_output_dtype(dtypes["x"], dtypes["weight"], casting))
    next_eps = eps if next_eps is None else next_eps
    y = rms_norm_reference(s, next_weight, next_eps, offset=offset, casting=casting, io_dtype=s_dtype)
    y_dtype = out_dtype or rms_norm_output_dtype(s_dtype, dtypes["next_weight"], casting)
    return _rounded(y, y_dtype), s
