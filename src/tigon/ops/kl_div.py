r"""KL divergence (``torch.nn.functional.kl_div``), forward and backward in Triton.

``input`` holds log-probabilities :math:`x = \log q`; ``target`` holds probabilities :math:`p`, or
log-probabilities :math:`t = \log p` with ``log_target=True``. Elementwise, exactly as torch::

    ℓ = xlogy(p, p) − p·x            log_target=False   (0 where p = 0)
    ℓ = exp(t)·(t − x)               log_target=True

reduced by ``reduction``: ``"none"`` (ℓ itself), ``"sum"``, ``"mean"`` (÷ numel) or ``"batchmean"``
(÷ ``input.shape[0]``, as torch divides; this op's default, where torch's is ``"mean"``).

Backward, with ``γ`` the upstream gradient (elementwise for ``"none"``, else the scalar divided by
the reduction's divisor)::

    ∂ℓ/∂x = −p                       (−exp(t) with log_target)
    ∂ℓ/∂p = log p + 1 − x            NaN at p = 0, as torch's: it differentiates xlogy(p, p) as
                                     log p (masked to 0 at p = 0) plus p/p (NaN at p = 0)
    ∂ℓ/∂t = exp(t)·(t − x + 1)       log_target

Neither gradient needs a reduction, so the backward is one elementwise pass. The target's gradient
is computed only when the target requires one (a teacher's distribution usually does not).

Both kernels tile the ``(rows, last dim)`` view of the inputs in ``[BLOCK_M, BLOCK_N]`` tiles on a
1-D grid (so neither dimension meets CUDA's 65535 limit on grid y), read any strides in place, and
upcast right after every load. A reduced loss is summed per tile into fp32 partials that are then
summed in a fixed order: deterministic, and fp32 however the inputs are stored; the result is
returned in the promoted input/target dtype, as torch returns it.

Bytes (speed of light), E elements, element size b::

    forward   read input and target E·b each; write E·b ("none") or one scalar
    backward  read target (and input, and γ for "none") E·b each; write ∂input E·b (and ∂target)

Reference: :func:`kl_div_reference` (``torch.nn.functional.kl_div`` in fp32 or fp64).

The tiles (``elementwise_tiles``: :func:`elementwise_tile_launch`, :class:`TileConfig`) are shared with the JSD kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tigon._kernels import (
    TigonOp,
    as_fp32,
    as_rows,
    check_tensor,
    elementwise_tile_launch,
    load_tile,
    tile_indices,
    wrap_triton,
)

REDUCTIONS = ("none", "sum", "mean", "batchmean")

# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def kl_div_fwd_kernel(
    input_ptr, input_row_stride, input_col_stride,      # (M, N) log q, any strides
    target_ptr, target_row_stride, target_col_stride,   # (M, N) p, or log p [LOG_TARGET], any strides
    loss_ptr,       # (M, N) out, contiguous: ℓ [not REDUCE];  (programs,) out, fp32: Σ ℓ per tile [REDUCE]
    num_rows, num_cols, col_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOG_TARGET: tl.constexpr, REDUCE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows, cols = tile_indices(pid, col_tiles, BLOCK_M, BLOCK_N)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    x = load_tile(input_ptr, input_row_stride, input_col_stride, rows, cols, mask)
    t = load_tile(target_ptr, target_row_stride, target_col_stride, rows, cols, mask)
    if LOG_TARGET:
        loss = tl.exp(t) * (t - x)
    else:
        # xlogy(p, p): 0 at p = 0 (padding lanes included), NaN for p < 0 as torch gives
        loss = tl.where(t == 0.0, 0.0, t * tl.log(t)) - t * x
    if REDUCE:
        tl.store(loss_ptr + pid, tl.sum(tl.sum(loss, axis=1), axis=0))
    else:
        out_offsets = rows[:, None] * num_cols + cols[None, :]
        tl.store(loss_ptr + out_offsets, loss.to(loss_ptr.dtype.element_ty), mask=mask)


@triton.jit
def kl_div_bwd_kernel(
    grad_ptr, grad_row_stride, grad_col_stride,         # (M, N) γ, any strides [not REDUCED];  () [REDUCED]
    input_ptr, input_row_stride, input_col_stride,      # (M, N) log q                          [TARGET_GRAD]
    target_ptr, target_row_stride, target_col_stride,   # (M, N) p, or log p [LOG_TARGET]
    dinput_ptr,                                         # (M, N) out, contiguous                 [INPUT_GRAD]
    dtarget_ptr,                                        # (M, N) out, contiguous                 [TARGET_GRAD]
    num_rows, num_cols, col_tiles, grad_scale,          # grad_scale: 1 / the reduction's divisor
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOG_TARGET: tl.constexpr, REDUCED: tl.constexpr,
    INPUT_GRAD: tl.constexpr, TARGET_GRAD: tl.constexpr,
):
    grad_scale = as_fp32(grad_scale)
    pid = tl.program_id(0)
    rows, cols = tile_indices(pid, col_tiles, BLOCK_M, BLOCK_N)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    if REDUCED:
        grad = tl.load(grad_ptr).to(tl.float32) * grad_scale
    else:
        grad = load_tile(grad_ptr, grad_row_stride, grad_col_stride, rows, cols, mask)
    t = load_tile(target_ptr, target_row_stride, target_col_stride, rows, cols, mask)
    p = tl.exp(t) if LOG_TARGET else t
    out_offsets = rows[:, None] * num_cols + cols[None, :]
    if INPUT_GRAD:
        tl.store(dinput_ptr + out_offsets, (-p * grad).to(dinput_ptr.dtype.element_ty), mask=mask)
    if TARGET_GRAD:
        x = load_tile(input_ptr, input_row_stride, input_col_stride, rows, cols, mask)
        if LOG_TARGET:
            dtarget = p * (t - x + 1.0) * grad
        else:
            # torch differentiates xlogy(p, p) as γ·log p (0 at p = 0) + γ·p/p (NaN at p = 0)
            dtarget = (tl.where(t == 0.0, float("nan"), tl.log(t)) + 1.0 - x) * grad
        tl.store(dtarget_ptr + out_offsets, dtarget.to(dtarget_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------ launchers


def _divisor(shape, reduction) -> float:
    """What torch divides the summed loss by."""
    if reduction == "mean":
        numel = 1
        for size in shape:
            numel *= size
        return float(numel)
    if reduction == "batchmean" and len(shape) > 0:
        return float(shape[0])
    return 1.0


def _as_2d(t):
    return as_rows(t) if t.dim() > 0 else t.reshape(1, 1)


def _forward(input, target, reduction, log_target):
    out_dtype = torch.promote_types(input.dtype, target.dtype)
    x2, t2 = _as_2d(input), _as_2d(target)
    num_rows, num_cols = x2.shape
    cfg = elementwise_tile_launch(num_rows, num_cols)
    reduce = reduction != "none"
    if reduce:
        loss = torch.empty(cfg.programs if input.numel() > 0 else 0, dtype=torch.float32, device=input.device)
    else:
        loss = torch.empty(input.shape, dtype=out_dtype, device=input.device)
    if input.numel() > 0:
        wrap_triton(kl_div_fwd_kernel)[(cfg.programs,)](
            x2, x2.stride(0), x2.stride(1),
            t2, t2.stride(0), t2.stride(1),
            loss,
            num_rows, num_cols, cfg.col_tiles,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LOG_TARGET=log_target, REDUCE=reduce,
            num_warps=cfg.num_warps,
        )
    if not reduce:
        return loss
    return (loss.sum() / _divisor(input.shape, reduction)).to(out_dtype)


def _backward(grad, input, target, reduction, log_target, input_grad, target_grad):
    # an unwanted gradient is an empty tensor (a custom op returns tensors, never None)
    dinput = torch.empty(input.shape if input_grad else (0,), dtype=input.dtype, device=input.device)
    dtarget = torch.empty(target.shape if target_grad else (0,), dtype=target.dtype, device=target.device)
    if input.numel() == 0:
        return dinput, dtarget
    x2, t2 = _as_2d(input), _as_2d(target)
    reduced = reduction != "none"
    g2 = grad if reduced else _as_2d(grad)
    num_rows, num_cols = x2.shape
    cfg = elementwise_tile_launch(num_rows, num_cols)
    wrap_triton(kl_div_bwd_kernel)[(cfg.programs,)](
        g2, g2.stride(0) if not reduced else 0, g2.stride(1) if not reduced else 0,
        x2, x2.stride(0), x2.stride(1),
        t2, t2.stride(0), t2.stride(1),
        dinput if input_grad else dtarget, dtarget if target_grad else dinput,
        num_rows, num_cols, cfg.col_tiles, 1.0 / _divisor(input.shape, reduction),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LOG_TARGET=log_target, REDUCED=reduced,
        INPUT_GRAD=input_grad, TARGET_GRAD=target_grad,
        num_warps=cfg.num_warps,
    )
    return dinput, dtarget


# ------------------------------------------------------------------------------- torch ops + autograd


def _kl_div_impl(input: torch.Tensor, target: torch.Tensor, reduction: str, log_target: bool) -> torch.Tensor:
    return _forward(input, target, reduction, log_target)


def _kl_div_backward_impl(
    grad: torch.Tensor,
    input: torch.Tensor,
    target: torch.Tensor,
    reduction: str,
    log_target: bool,
    input_grad: bool,
    target_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(grad, input, target, reduction, log_target, input_grad, target_grad)


KL_DIV_BACKWARD = TigonOp("kl_div_backward", _kl_div_backward_impl)


def _setup_kl_div(ctx, inputs, output):
    input, target, reduction, log_target = inputs
    ctx.save_for_backward(input, target)
    ctx.reduction, ctx.log_target = reduction, log_target


def _kl_div_grad(ctx, grad):
    input, target = ctx.saved_tensors
    input_grad, target_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dinput, dtarget = KL_DIV_BACKWARD(
        grad, input, target, ctx.reduction, ctx.log_target, input_grad, target_grad
    )
    return (dinput if input_grad else None), (dtarget if target_grad else None), None, None


KL_DIV = TigonOp("kl_div", _kl_div_impl, setup_context=_setup_kl_div, backward=_kl_div_grad)


# ------------------------------------------------------------------------------------- public function


def kl_div(input, target, *, reduction="batchmean", log_target=False):
    """``torch.nn.functional.kl_div(input, target, reduction=..., log_target=...)``.

    ``input`` is log-probabilities; ``target`` probabilities (log-probabilities with
    ``log_target=True``), of the same shape. ``"batchmean"`` (the default here) divides the sum by
    ``input.shape[0]``, as torch does. The result has the promoted dtype of input and target, as
    torch's; it is summed in fp32.
    """
    check_tensor(input, "input")
    check_tensor(target, "target", device=input.device)
    if target.shape != input.shape:
        raise ValueError(f"target has shape {tuple(target.shape)}, expected input's {tuple(input.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(log_target, bool):
        raise TypeError(f"log_target must be a bool, got {type(log_target).__name__}")
    return KL_DIV(input, target, reduction, log_target)


# ------------------------------------------------------------------------------------------ reference


def kl_div_reference(input, target, *, reduction="batchmean", log_target=False):
    """``F.kl_div`` computed in fp32 (fp64 when either input is fp64), in the promoted dtype."""
    out_dtype = torch.promote_types(input.dtype, target.dtype)
    wide = torch.float64 if out_dtype == torch.float64 else torch.float32
    loss = F.kl_div(input.to(wide), target.to(wide), reduction=reduction, log_target=log_target)
    return loss.to(out_dtype)
