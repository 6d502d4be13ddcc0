r"""RMSNorm and fused residual-add + RMSNorm, forward and backward in Triton.

Forward, per row :math:`x \in \mathbb{R}^N` (``N = hidden``)::

    rstd  = 1 / sqrt(mean(x²) + eps)                 one fp32 scalar per row, saved
    x̂     = x · rstd
    y     = r(x̂) · (offset + w)        casting="llama"   (r = round to x.dtype, as transformers'
                                                          LlamaRMSNorm does before the multiply)
    y     = r(x̂ · (offset + w))        casting="gemma"   (everything fp32, one rounding at the end)

``add_rms_norm`` first forms ``s = r(x + residual)`` (the decoder's residual stream, returned) and
normalises ``s`` in the same pass.

Backward. With ``g = dy · (offset + w)`` (``dy`` when there is no weight), and rounding treated as the
identity (as autograd does for ``.to(dtype)``)::

    ∂x̂/∂x   = rstd · (I − x̂ x̂ᵀ / N)
    dx      = rstd · (g − x̂ · c),        c = mean(g · x̂)             one row reduction
    dw      = Σ_rows dy · r(x̂)   (llama)     Σ_rows dy · x̂   (gemma)
    ds      = dx + d(s-output)            add_rms_norm: the residual stream's own gradient joins here,
                                          and dx = dresidual = ds

Only ``x`` (or ``s``) and ``rstd`` are saved; ``x̂`` is recomputed. ``dw`` is reduced without
atomics: each program of the persistent backward grid owns a fixed band of rows and writes its own
fp32 partial row; the partials are summed in a fixed order, so the same input gives bitwise the
same gradient on every run.

Bytes (speed of light), M rows, element size b::

    forward   read x (and residual) M·N·b, w N·b; write y (and s) M·N·b, rstd 4M
    backward  read dy, x M·N·b each (and d(s-output)), w, rstd; write dx M·N·b, dw N·b

Reference: :func:`rms_norm_reference` (transformers' ``LlamaRMSNorm`` / ``GemmaRMSNorm``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from tigon.ops._common import TigonOp, as_fp32, as_rows, check_tensor, next_power_of_2, persistent_programs

CASTINGS = ("llama", "gemma")


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _load_row_tile(
    x_ptr, x_row_stride, x_col_stride, res_ptr, res_row_stride, res_col_stride, sum_ptr,
    rows, cols, mask, hidden,
    HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr,
):
    """Load a [BLOCK_M, BLOCK_N] tile of the rows being normalised, upcast to fp32 at once.

    With a residual the row is s = r(x + residual), rounded to the io dtype exactly as the eager
    ``x + residual`` is, so that the norm sees the values the reference sees.
    """
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(
            res_ptr + rows[:, None] * res_row_stride + cols[None, :] * res_col_stride, mask=mask, other=0.0
        ).to(tl.float32)
        s = (x + res).to(x_ptr.dtype.element_ty)
        if STORE_SUM:
            tl.store(sum_ptr + rows[:, None] * hidden + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    return x


@triton.jit
def _scale_and_store(
    x, rstd, weight_ptr, y_ptr, rows, cols, mask, hidden, offset,
    IO_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr, LLAMA_CASTING: tl.constexpr,
):
    """y = r(x̂)·(offset + w) (llama) or r(x̂·(offset + w)) (gemma) for one tile."""
    x_hat = x * rstd[:, None]
    if LLAMA_CASTING:
        x_hat = x_hat.to(IO_DTYPE).to(tl.float32)
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32) + offset
        x_hat = x_hat * w[None, :]
    tl.store(y_ptr + rows[:, None] * hidden + cols[None, :], x_hat.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_fwd_kernel(
    x_ptr, x_row_stride, x_col_stride,          # (M, N) input, any strides
    res_ptr, res_row_stride, res_col_stride,    # (M, N) residual added to x first   [HAS_RESIDUAL]
    sum_ptr,                                    # (M, N) out, contiguous: r(x + res)   [HAS_RESIDUAL]
    weight_ptr,                                 # (N,) scale; the kernel uses offset + w [HAS_WEIGHT]
    y_ptr,                                      # (M, N) out, contiguous
    rstd_ptr,                                   # (M,) out, fp32
    num_rows, hidden, eps, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, LLAMA_CASTING: tl.constexpr,
):
    """One program normalises BLOCK_M rows.

    SINGLE_PASS: the whole row fits one BLOCK_N tile and stays in registers between the reduction
    and the scaling (x read once). Otherwise the row is streamed in BLOCK_N chunks twice; the second
    read comes from L2, where the row was left by the first.
    """
    eps, offset = as_fp32(eps), as_fp32(offset)
    IO_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < hidden)[None, :]
        x = _load_row_tile(
            x_ptr, x_row_stride, x_col_stride, res_ptr, res_row_stride, res_col_stride, sum_ptr,
            rows, cols, mask, hidden, HAS_RESIDUAL, True,
        )
        sum_sq = tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(sum_sq / hidden + eps)
        _scale_and_store(
            x, rstd, weight_ptr, y_ptr, rows, cols, mask, hidden, offset, IO_DTYPE, HAS_WEIGHT, LLAMA_CASTING
        )
    else:
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < hidden)[None, :]
            x = _load_row_tile(
                x_ptr, x_row_stride, x_col_stride, res_ptr, res_row_stride, res_col_stride, sum_ptr,
                rows, cols, mask, hidden, HAS_RESIDUAL, True,
            )
            sum_sq += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(sum_sq / hidden + eps)
        for start in range(0, hidden, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < hidden)[None, :]
            # s is recomputed from x and residual rather than read back from sum_ptr: another thread
            # of this program stored it, and nothing orders that store before this load.
            x = _load_row_tile(
                x_ptr, x_row_stride, x_col_stride, res_ptr, res_row_stride, res_col_stride, sum_ptr,
                rows, cols, mask, hidden, HAS_RESIDUAL, False,
            )
            _scale_and_store(
                x, rstd, weight_ptr, y_ptr, rows, cols, mask, hidden, offset, IO_DTYPE, HAS_WEIGHT,
                LLAMA_CASTING,
            )
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _grad_tile(
    dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, x_col_stride, weight_ptr,
    rows, cols, mask, rstd, hidden, offset,
    HAS_WEIGHT: tl.constexpr,
):
    """Load one tile of dy and x (fp32) and form x̂ = x·rstd and g = dy·(offset + w)."""
    dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :] * dy_col_stride, mask=mask, other=0.0)
    dy = dy.to(tl.float32)
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=mask, other=0.0)
    x_hat = x.to(tl.float32) * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32) + offset
        g = dy * w[None, :]
    else:
        g = dy
    return dy, x_hat, g


@triton.jit
def _dx_store(
    g, x_hat, c, rstd, dsum_ptr, dsum_row_stride, dsum_col_stride, dx_ptr, rows, cols, mask, hidden, eps,
    HAS_DSUM: tl.constexpr,
):
    """dx = rstd·(g − x̂·c), plus the residual stream's own gradient for add_rms_norm.

    At hidden == 1, g − x̂·c = g·(1 − x̂²) cancels to nothing in fp32 (x̂² = 1 − eps·rstd²), so that
    case uses the exact form g·eps·rstd² instead.
    """
    if hidden == 1:
        dx = g * (eps * rstd * rstd * rstd)[:, None]
    else:
        dx = (g - x_hat * c[:, None]) * rstd[:, None]
    if HAS_DSUM:
        dsum = tl.load(
            dsum_ptr + rows[:, None] * dsum_row_stride + cols[None, :] * dsum_col_stride, mask=mask, other=0.0
        )
        dx += dsum.to(tl.float32)
    tl.store(dx_ptr + rows[:, None] * hidden + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_bwd_kernel(
    dy_ptr, dy_row_stride, dy_col_stride,           # (M, N) gradient of y, any strides (stride 0 too)
    x_ptr, x_row_stride, x_col_stride,              # (M, N) the normalised input (x, or s = x + res)
    weight_ptr,                                     # (N,)                              [HAS_WEIGHT]
    rstd_ptr,                                       # (M,) fp32, saved by the forward
    dsum_ptr, dsum_row_stride, dsum_col_stride,     # (M, N) gradient of the s output   [HAS_DSUM]
    dx_ptr,                                         # (M, N) out, contiguous
    dw_partial_ptr,                                 # (programs, N) out, fp32: this program's Σ dy·r(x̂)
    num_rows, hidden, eps, offset, rows_per_program,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_DSUM: tl.constexpr, LLAMA_CASTING: tl.constexpr,
):
    """Persistent: program p owns rows [p·rows_per_program, (p+1)·rows_per_program).

    SINGLE_PASS keeps the row tile in registers and the program's dw partial in registers across
    all its rows. Otherwise each row is streamed twice in BLOCK_N chunks (c first, then dx) and the
    dw partial is accumulated in the program's own row of dw_partial (zeroed by the launcher); the
    load and the store of one chunk use the same layout, so each element is read back by the thread
    that wrote it.
    """
    eps, offset = as_fp32(eps), as_fp32(offset)
    IO_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    row_begin = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, num_rows)
    dw_row_ptr = dw_partial_ptr + pid.to(tl.int64) * hidden
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < hidden
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        # Software prefetch: the next tile's dy and x loads are issued before this tile's reductions
        # and stores, so that each program always has a tile of loads in flight (kept in the io dtype,
        # half the registers of fp32, and upcast when they become the current tile).
        rows = row_begin + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        dy_next = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :] * dy_col_stride, mask=mask, other=0.0)
        x_next = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=mask, other=0.0)
        rstd_next = tl.load(rstd_ptr + rows, mask=rows < row_end, other=0.0)
        for row_start in range(row_begin, row_end, BLOCK_M):
            rows = row_start + tl.arange(0, BLOCK_M)
            mask = (rows < row_end)[:, None] & col_mask[None, :]
            dy = dy_next.to(tl.float32)
            rstd = rstd_next
            x_hat = x_next.to(tl.float32) * rstd[:, None]
            nxt = rows + BLOCK_M
            nxt_mask = (nxt < row_end)[:, None] & col_mask[None, :]
            dy_next = tl.load(
                dy_ptr + nxt[:, None] * dy_row_stride + cols[None, :] * dy_col_stride, mask=nxt_mask, other=0.0
            )
            x_next = tl.load(
                x_ptr + nxt[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=nxt_mask, other=0.0
            )
            rstd_next = tl.load(rstd_ptr + nxt, mask=nxt < row_end, other=0.0)
            if HAS_WEIGHT:
                g = dy * w[None, :]
            else:
                g = dy
            c = tl.sum(g * x_hat, axis=1) / hidden
            _dx_store(
                g, x_hat, c, rstd, dsum_ptr, dsum_row_stride, dsum_col_stride, dx_ptr, rows, cols, mask,
                hidden, eps, HAS_DSUM,
            )
            if HAS_WEIGHT:
                if LLAMA_CASTING:
                    x_hat = x_hat.to(IO_DTYPE).to(tl.float32)
                dw_acc += tl.sum(dy * x_hat, axis=0)
        if HAS_WEIGHT:
            tl.store(dw_row_ptr + cols, dw_acc, mask=cols < hidden)
    else:
        for row_start in range(row_begin, row_end, BLOCK_M):
            rows = row_start + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            c = tl.zeros([BLOCK_M], dtype=tl.float32)
            for start in range(0, hidden, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = row_mask[:, None] & (cols < hidden)[None, :]
                dy, x_hat, g = _grad_tile(
                    dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, x_col_stride, weight_ptr,
                    rows, cols, mask, rstd, hidden, offset, HAS_WEIGHT,
                )
                c += tl.sum(g * x_hat, axis=1)
            c = c / hidden
            for start in range(0, hidden, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = row_mask[:, None] & (cols < hidden)[None, :]
                dy, x_hat, g = _grad_tile(
                    dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, x_col_stride, weight_ptr,
                    rows, cols, mask, rstd, hidden, offset, HAS_WEIGHT,
                )
                _dx_store(
                    g, x_hat, c, rstd, dsum_ptr, dsum_row_stride, dsum_col_stride, dx_ptr, rows, cols, mask,
                    hidden, eps, HAS_DSUM,
                )
                if HAS_WEIGHT:
                    if LLAMA_CASTING:
                        x_hat = x_hat.to(IO_DTYPE).to(tl.float32)
                    col_mask = cols < hidden
                    dw = tl.load(dw_row_ptr + cols, mask=col_mask, other=0.0)
                    tl.store(dw_row_ptr + cols, dw + tl.sum(dy * x_hat, axis=0), mask=col_mask)


# -------------------------------------------------------------------------------------- launch config

@dataclass(frozen=True)
class NormTuning:
    """The knobs of one direction's launch geometry (scripts/tune_norm.py sweeps them on a GPU).

    max_fused_hidden: rows longer than this are streamed in chunks instead of held in registers.
      The backward holds about twice as many live values per element as the forward (dy, x, their
      prefetched successors, g, dw), hence its lower limit; past it a register tile would spill.
    tile_elements: what a program's tile aims at for short rows (several rows per program, so that
      a hidden size of 96 still moves a useful amount per program).
    elements_per_warp / max_warps: warps = tile / elements_per_warp, capped.
    programs_per_sm: persistent programs per multiprocessor (backward only).
    """

    max_fused_hidden: int
    chunk: int
    tile_elements: int
    elements_per_warp: int
    max_warps: int
    programs_per_sm: int = 1


FWD_TUNING = NormTuning(max_fused_hidden=65536, chunk=4096, tile_elements=4096, elements_per_warp=512, max_warps=16)
BWD_TUNING = NormTuning(
    max_fused_hidden=8192, chunk=4096, tile_elements=4096, elements_per_warp=512, max_warps=16, programs_per_sm=2
)
# Kept as names of their own: tests pick sizes on both sides of these regime boundaries.
MAX_FUSED_HIDDEN_FWD = FWD_TUNING.max_fused_hidden
MAX_FUSED_HIDDEN_BWD = BWD_TUNING.max_fused_hidden


@dataclass(frozen=True)
class NormLaunch:
    """Block geometry for one norm kernel launch (shared by the RMSNorm and LayerNorm kernels)."""

    block_m: int
    block_n: int
    num_warps: int
    single_pass: bool


def norm_launch(num_rows: int, hidden: int, *, backward: bool) -> NormLaunch:
    tuning = BWD_TUNING if backward else FWD_TUNING
    block_n = next_power_of_2(hidden)
    if block_n > tuning.max_fused_hidden:
        warps = max(1, min(tuning.chunk // tuning.elements_per_warp, tuning.max_warps))
        return NormLaunch(1, tuning.chunk, warps, False)
    block_m = max(1, min(tuning.tile_elements // block_n, next_power_of_2(num_rows)))
    num_warps = max(1, min(block_m * block_n // tuning.elements_per_warp, tuning.max_warps))
    return NormLaunch(block_m, block_n, num_warps, True)


# ------------------------------------------------------------------------------------------ launchers


def _forward(x, residual, weight, eps, offset, casting):
    """Launch the forward on any-shaped x; returns (y, s or None, rstd) with y, s shaped like x."""
    hidden = x.shape[-1]
    x2 = as_rows(x)
    num_rows = x2.shape[0]
    llama = casting == "llama"
    y_dtype = torch.promote_types(x.dtype, weight.dtype) if (llama and weight is not None) else x.dtype
    y = torch.empty(x.shape, dtype=y_dtype, device=x.device)
    rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if num_rows == 0 or hidden == 0:
        return y, s, rstd
    r2 = as_rows(residual) if residual is not None else x2
    cfg = norm_launch(num_rows, hidden, backward=False)
    grid = (triton.cdiv(num_rows, cfg.block_m),)
    wrap_triton(rms_norm_fwd_kernel)[grid](
        x2, x2.stride(0), x2.stride(1),
        r2, r2.stride(0), r2.stride(1),
        s if s is not None else y,
        weight if weight is not None else x2,
        y, rstd,
        num_rows, hidden, eps, offset,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SINGLE_PASS=cfg.single_pass,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, LLAMA_CASTING=llama,
        num_warps=cfg.num_warps,
    )
    return y, s, rstd


def _backward(dy, x, weight, rstd, dsum, eps, offset, casting):
    """Launch the backward; returns (dx, dw) with dw an empty tensor when there is no weight."""
    hidden = x.shape[-1]
    x2, dy2 = as_rows(x), as_rows(dy)
    num_rows = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if weight is None:
        dw = torch.empty(0, dtype=x.dtype, device=x.device)
    if num_rows == 0 or hidden == 0:
        return dx, (torch.zeros_like(weight) if weight is not None else dw)
    cfg = norm_launch(num_rows, hidden, backward=True)
    programs = min(persistent_programs(x.device, BWD_TUNING.programs_per_sm), triton.cdiv(num_rows, cfg.block_m))
    rows_per_program = triton.cdiv(triton.cdiv(num_rows, programs), cfg.block_m) * cfg.block_m
    programs = triton.cdiv(num_rows, rows_per_program)
    # The streaming kernel accumulates into its partial row, so only that path needs it zeroed.
    alloc = torch.empty if cfg.single_pass else torch.zeros
    dw_partial = alloc((programs, hidden), dtype=torch.float32, device=x.device) if weight is not None else rstd
    ds2 = as_rows(dsum) if dsum is not None else dy2
    wrap_triton(rms_norm_bwd_kernel)[(programs,)](
        dy2, dy2.stride(0), dy2.stride(1),
        x2, x2.stride(0), x2.stride(1),
        weight if weight is not None else x2,
        rstd,
        ds2, ds2.stride(0), ds2.stride(1),
        dx, dw_partial,
        num_rows, hidden, eps, offset, rows_per_program,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SINGLE_PASS=cfg.single_pass,
        HAS_WEIGHT=weight is not None, HAS_DSUM=dsum is not None, LLAMA_CASTING=casting == "llama",
        num_warps=cfg.num_warps,
    )
    if weight is not None:
        dw = dw_partial.sum(dim=0).to(weight.dtype)
    return dx, dw


# ------------------------------------------------------------------------------- torch ops + autograd



def _rms_norm_impl(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str
) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, rstd = _forward(x, None, weight, eps, offset, casting)
    return y, rstd


def _add_rms_norm_impl(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, s, rstd = _forward(x, residual, weight, eps, offset, casting)
    return y, s, rstd


def _rms_norm_backward_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    dsum: torch.Tensor | None,
    eps: float,
    offset: float,
    casting: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, x, weight, rstd, dsum, eps, offset, casting)


RMS_NORM_BACKWARD = TigonOp("rms_norm_backward", _rms_norm_backward_impl)


def _setup_rms_norm(ctx, inputs, output):
    x, weight, eps, offset, casting = inputs
    _y, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.eps, ctx.offset, ctx.casting = eps, offset, casting
    ctx.mark_non_differentiable(rstd)


def _rms_norm_grad(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = RMS_NORM_BACKWARD(dy, x, weight, rstd, None, ctx.eps, ctx.offset, ctx.casting)
    return dx, (dw if weight is not None else None), None, None, None


def _setup_add_rms_norm(ctx, inputs, output):
    _x, _residual, weight, eps, offset, casting = inputs
    _y, s, rstd = output
    ctx.save_for_backward(s, weight, rstd)
    ctx.eps, ctx.offset, ctx.casting = eps, offset, casting
    ctx.mark_non_differentiable(rstd)


def _add_rms_norm_grad(ctx, dy, dsum, _drstd):
    s, weight, rstd = ctx.saved_tensors
    ds, dw = RMS_NORM_BACKWARD(dy, s, weight, rstd, dsum, ctx.eps, ctx.offset, ctx.casting)
    return ds, ds, (dw if weight is not None else None), None, None, None


RMS_NORM = TigonOp("rms_norm", _rms_norm_impl, setup_context=_setup_rms_norm, backward=_rms_norm_grad)
ADD_RMS_NORM = TigonOp(
    "add_rms_norm", _add_rms_norm_impl, setup_context=_setup_add_rms_norm, backward=_add_rms_norm_grad
)


# ------------------------------------------------------------------------------------ public functions


def _check_args(x, weight, eps, casting, *, residual=None):
    check_tensor(x, "x")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the hidden dimension is the last)")
    if residual is not None:
        check_tensor(residual, "residual", device=x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)}, expected x's {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual has dtype {residual.dtype}, expected x's {x.dtype}")
    if weight is not None:
        check_tensor(weight, "weight", device=x.device)
        if weight.shape != (x.shape[-1],):
            raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {CASTINGS}, got {casting!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def rms_norm(x, weight, eps=1e-6, *, offset=0.0, casting="llama"):
    """RMSNorm over the last dim of ``x``; see the module docstring for the math.

    ``weight=None`` means no scale (``offset`` is then unused). Gemma's ``1 + weight`` is
    ``offset=1.0``. Output dtype: llama casting promotes x with the weight (fp32 weights with bf16 x
    give fp32, as transformers does); gemma casting returns x's dtype.
    """
    _check_args(x, weight, eps, casting)
    y, _ = RMS_NORM(x, weight, float(eps), float(offset), casting)
    return y


def add_rms_norm(x, residual, weight, eps=1e-6, *, offset=0.0, casting="llama"):
    """``s = x + residual; y = rms_norm(s, ...)`` in one pass; returns ``(y, s)``."""
    _check_args(x, weight, eps, casting, residual=residual)
    y, s, _ = ADD_RMS_NORM(x, residual, weight, float(eps), float(offset), casting)
    return y, s


# ------------------------------------------------------------------------------------------ reference


def rms_norm_reference(x, weight, eps=1e-6, *, offset=0.0, casting="llama", io_dtype=None):
    """transformers' LlamaRMSNorm (casting="llama") and GemmaRMSNorm (casting="gemma"), in PyTorch.

    Computes in fp32 (fp64 when x is fp64) and rounds to ``io_dtype`` (default x.dtype) where the
    transformers module rounds. Tests pass fp64 tensors with ``io_dtype`` set to the dtype under test:
    the same roundings, with nothing else lost.
    """
    io_dtype = io_dtype or x.dtype
    wide = x.dtype == torch.float64
    h = x.to(torch.float64 if wide else torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        h = h.to(io_dtype)
        if wide:
            h = h.to(torch.float64)
        return h if weight is None else (offset + weight) * h
    if weight is not None:
        h = h * (offset + weight.to(h.dtype))
    h = h.to(io_dtype)
    return h.to(torch.float64) if wide else h


def add_rms_norm_reference(x, residual, weight, eps=1e-6, *, offset=0.0, casting="llama", io_dtype=None):
    """``s = x + residual`` (rounded to io_dtype) then :func:`rms_norm_reference`; returns (y, s)."""
    s = x + residual
    if io_dtype is not None and x.dtype == torch.float64:
        s = s.to(io_dtype).to(torch.float64)
    return rms_norm_reference(s, weight, eps, offset=offset, casting=casting, io_dtype=io_dtype), s
