r"""The gated activation of MoE experts on the packed gate/up projection, forward and backward.

transformers' MoE experts (``integrations/moe.py``: the eager loop, ``grouped_mm``, ``batched_mm``)
compute one matmul for gate and up together and hand its output ``x`` ``[tokens, 2I]`` to the
experts' ``_apply_gate``, which splits it and gates::

    layout "halves"       g = x[:, :I],   u = x[:, I:]        (Mixtral, Qwen3-MoE, ...: ``chunk(2)``)
    layout "interleaved"  g = x[:, 0::2], u = x[:, 1::2]      (GPT-OSS)

Activations, with ``r`` rounding to x's dtype exactly where the eager code rounds:

    silu / gelu_tanh / gelu       h = r(act(g)) · u                       (tigon.ops.glu's math)
    clamped_swiglu (GPT-OSS)      g' = min(g, limit),  u' = clamp(u, −limit, limit)
                                  s  = r(σ(r(α·g'))),  glu = r(g'·s),  v = r(u' + 1)
                                  h  = v · glu

Backward, dh the gradient of h (roundings taken as the identity, as autograd does; autograd's clamp
passes the gradient where the value lies inside the closed interval)::

    GLU:             du = dh · a,      dg = dh · u · act'(g)              (a = r(act(g)))
    clamped_swiglu:  du = dh · glu · [−limit ≤ u ≤ limit]
                     dg = dh · v · (s + g'·α·s·(1 − s)) · [g ≤ limit]

Both halves of the gradient land in one ``[tokens, 2I]`` buffer, in x's layout, written by the one
backward pass that reads dh and x: no chunk/cat, no second pass over the intermediate. Only x is saved;
the backward recomputes the activation from it.

Tiles are (BLOCK_M rows) × (BLOCK_N columns of h); offsets are int64 throughout (rows × strides past
2^31 elements, and transposed views whose column stride is the row count). x and dh are read through
any strides (a stride-0 dh from ``.sum()`` too); h and dx are written contiguous. In the interleaved
layout a tile's 2·BLOCK_N packed columns are one contiguous run per row, loaded (and, for dx, stored)
whole and split (joined) in registers.

Bytes (speed of light), T tokens, element size b::

    forward   read x (2TI); write h (TI)                              3·T·I·b
    backward  read dh (TI), x (2TI); write dx (2TI)                   5·T·I·b

Reference: :func:`moe_glu_reference` (the eager ``_apply_gate`` of each layout and activation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon._kernels import (
    TigonOp,
    as_fp32,
    as_rows,
    check_real,
    check_tensor,
    gate_activation,
    stable_sigmoid,
    wrap_triton,
)
from tigon.ops.glu import ACTIVATIONS as GLU_ACTIVATIONS
from tigon.ops.glu import GluConfig, glu_launch, glu_reference

LAYOUTS = ("halves", "interleaved")
CLAMPED_SWIGLU = "clamped_swiglu"
ACTIVATIONS = (*GLU_ACTIVATIONS, CLAMPED_SWIGLU)
# GPT-OSS's swiglu_alpha and swiglu_limit (its config's defaults).
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _tile(pid, num_rows, col_blocks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows ((BLOCK_M, 1), int64), their mask, and its first column of h (int64)."""
    rows = (pid // col_blocks).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    col_start = (pid % col_blocks).to(tl.int64) * BLOCK_N
    return rows, rows < num_rows, col_start


@triton.jit
def _load_gate_up(x_ptr, x_row_stride, x_col_stride, rows, row_mask, col_start, num_cols,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERLEAVED: tl.constexpr):
    """g and u (fp32, (BLOCK_M, BLOCK_N)) for columns col_start + [0, BLOCK_N) of h.

    Interleaved: the tile's 2·BLOCK_N packed columns are read as one contiguous run per row and split
    in registers (two stride-2 loads would each fetch every sector of the run).
    """
    x_row = x_ptr + rows * x_row_stride
    if INTERLEAVED:
        packed = 2 * col_start + tl.arange(0, 2 * BLOCK_N)[None, :]
        x = tl.load(x_row + packed * x_col_stride, mask=row_mask & (packed < 2 * num_cols), other=0.0)
        g, u = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCK_N, 2)))
    else:
        cols = col_start + tl.arange(0, BLOCK_N)[None, :]
        mask = row_mask & (cols < num_cols)
        g = tl.load(x_row + cols * x_col_stride, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_row + (num_cols + cols) * x_col_stride, mask=mask, other=0.0).to(tl.float32)
    return g, u


@triton.jit
def _store_gate_up(dx_ptr, dg, du, rows, row_mask, col_start, num_cols,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERLEAVED: tl.constexpr):
    """dg and du at g's and u's places in the contiguous packed gradient dx ((M, 2N))."""
    dx_row = dx_ptr + rows * (2 * num_cols)
    dtype = dx_ptr.dtype.element_ty
    if INTERLEAVED:
        packed = 2 * col_start + tl.arange(0, 2 * BLOCK_N)[None, :]
        dx = tl.reshape(tl.join(dg, du), (BLOCK_M, 2 * BLOCK_N))
        tl.store(dx_row + packed, dx.to(dtype), mask=row_mask & (packed < 2 * num_cols))
    else:
        cols = col_start + tl.arange(0, BLOCK_N)[None, :]
        mask = row_mask & (cols < num_cols)
        tl.store(dx_row + cols, dg.to(dtype), mask=mask)
        tl.store(dx_row + num_cols + cols, du.to(dtype), mask=mask)


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """r(x): fp32 x rounded to the io dtype and widened again."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _gated(g, u, alpha, limit, DTYPE: tl.constexpr, ACTIVATION: tl.constexpr):
    """h and the two partial derivatives ∂h/∂g, ∂h/∂u (formulas in the module docstring).

    The forward kernel ignores the derivatives; the compiler drops what is not used.
    """
    if ACTIVATION == "clamped_swiglu":
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = _round(stable_sigmoid(_round(alpha * gc, DTYPE)), DTYPE)
        glu = _round(gc * s, DTYPE)
        v = _round(uc + 1.0, DTYPE)
        h = v * glu
        dh_dg = tl.where(g <= limit, v * (s + gc * alpha * s * (1.0 - s)), 0.0)
        dh_du = tl.where((u >= -limit) & (u <= limit), glu, 0.0)
    else:
        act, dact = gate_activation(g, ACTIVATION)
        a = _round(act, DTYPE)
        h = a * u
        dh_dg = u * dact
        dh_du = a
    return h, dh_dg, dh_du


@triton.jit
def moe_glu_fwd_kernel(
    x_ptr, x_row_stride, x_col_stride,              # (M, 2N) packed gate/up, any strides
    h_ptr,                                          # (M, N) out, contiguous
    num_rows, num_cols, col_blocks,                 # M, N (= I), column blocks of h
    alpha, limit,                                   # clamped_swiglu's α and limit (unused otherwise)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERLEAVED: tl.constexpr, ACTIVATION: tl.constexpr,
):
    """h = gated(g, u) over one tile."""
    alpha, limit = as_fp32(alpha), as_fp32(limit)
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    rows, row_mask, col_start = _tile(tl.program_id(0), num_rows, col_blocks, BLOCK_M, BLOCK_N)
    g, u = _load_gate_up(x_ptr, x_row_stride, x_col_stride, rows, row_mask, col_start, num_cols,
                         BLOCK_M, BLOCK_N, INTERLEAVED)
    h, _, _ = _gated(g, u, alpha, limit, DTYPE, ACTIVATION)
    cols = col_start + tl.arange(0, BLOCK_N)[None, :]
    tl.store(h_ptr + rows * num_cols + cols, h.to(h_ptr.dtype.element_ty), mask=row_mask & (cols < num_cols))


@triton.jit
def moe_glu_bwd_kernel(
    dh_ptr, dh_row_stride, dh_col_stride,           # (M, N) gradient of h, any strides (stride 0 too)
    x_ptr, x_row_stride, x_col_stride,              # (M, 2N) packed gate/up, any strides
    dx_ptr,                                         # (M, 2N) gradient of x, contiguous, x's layout
    num_rows, num_cols, col_blocks,
    alpha, limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERLEAVED: tl.constexpr, ACTIVATION: tl.constexpr,
):
    """dg = dh·∂h/∂g and du = dh·∂h/∂u over one tile, stored at g's and u's places in dx."""
    alpha, limit = as_fp32(alpha), as_fp32(limit)
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    rows, row_mask, col_start = _tile(tl.program_id(0), num_rows, col_blocks, BLOCK_M, BLOCK_N)
    cols = col_start + tl.arange(0, BLOCK_N)[None, :]
    dh = tl.load(dh_ptr + rows * dh_row_stride + cols * dh_col_stride, mask=row_mask & (cols < num_cols),
                 other=0.0).to(tl.float32)
    g, u = _load_gate_up(x_ptr, x_row_stride, x_col_stride, rows, row_mask, col_start, num_cols,
                         BLOCK_M, BLOCK_N, INTERLEAVED)
    _, dh_dg, dh_du = _gated(g, u, alpha, limit, DTYPE, ACTIVATION)
    _store_gate_up(dx_ptr, dh * dh_dg, dh * dh_du, rows, row_mask, col_start, num_cols,
                   BLOCK_M, BLOCK_N, INTERLEAVED)


# -------------------------------------------------------------------------------------- launch config

# Tiles as tigon.ops.glu's strided path: the same per-thread work and register budget (a tile of h
# reads 2 values of x per element, as the glu kernels read gate and up).
CONFIG = GluConfig()


# ------------------------------------------------------------------------------------------ launchers


def _moe_glu_impl(x: torch.Tensor, interleaved: bool, activation: str, alpha: float, limit: float) -> torch.Tensor:
    num_cols = x.shape[-1] // 2
    h = torch.empty((*x.shape[:-1], num_cols), dtype=x.dtype, device=x.device)
    if h.numel() == 0:
        return h
    x2 = as_rows(x)
    cfg = glu_launch(x2.shape[0], num_cols, flat=False, config=CONFIG)
    wrap_triton(moe_glu_fwd_kernel)[(cfg.num_programs,)](
        x2, x2.stride(0), x2.stride(1),
        h,
        x2.shape[0], num_cols, cfg.col_blocks, alpha, limit,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, INTERLEAVED=interleaved, ACTIVATION=activation,
        num_warps=cfg.num_warps,
    )
    return h


def _moe_glu_backward_impl(
    dh: torch.Tensor, x: torch.Tensor, interleaved: bool, activation: str, alpha: float, limit: float
) -> torch.Tensor:
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_cols = x.shape[-1] // 2
    if dh.numel() == 0:
        return dx
    d2, x2 = as_rows(dh), as_rows(x)
    cfg = glu_launch(x2.shape[0], num_cols, flat=False, config=CONFIG)
    wrap_triton(moe_glu_bwd_kernel)[(cfg.num_programs,)](
        d2, d2.stride(0), d2.stride(1),
        x2, x2.stride(0), x2.stride(1),
        dx,
        x2.shape[0], num_cols, cfg.col_blocks, alpha, limit,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, INTERLEAVED=interleaved, ACTIVATION=activation,
        num_warps=cfg.num_warps,
    )
    return dx


# ------------------------------------------------------------------------------- torch ops + autograd


def _setup_moe_glu(ctx, inputs, output):
    x, interleaved, activation, alpha, limit = inputs
    ctx.save_for_backward(x)
    ctx.options = (interleaved, activation, alpha, limit)


def _moe_glu_grad(ctx, dh):
    (x,) = ctx.saved_tensors
    return MOE_GLU_BACKWARD(dh, x, *ctx.options), None, None, None, None


MOE_GLU_BACKWARD = TigonOp("moe_glu_backward", _moe_glu_backward_impl)
MOE_GLU = TigonOp("moe_glu", _moe_glu_impl, setup_context=_setup_moe_glu, backward=_moe_glu_grad)


# ------------------------------------------------------------------------------------ public function


def _check_options(layout, activation, alpha, limit):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    # checked whatever the activation (only clamped_swiglu uses them): a str would reach float()
    check_real(alpha, "alpha")
    check_real(limit, "limit", minimum=0.0, finite=False)


def moe_glu(gate_up, *, layout="halves", activation="silu", alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT):
    """The experts' gated activation on the packed projection ``gate_up`` ``[..., 2I]`` → ``[..., I]``.

    ``layout``: "halves" (gate is the first half, ``chunk(2, -1)``) or "interleaved" (gate at even
    columns, up at odd ones). ``activation``: "silu", "gelu_tanh", "gelu" (``act(gate) * up``) or
    "clamped_swiglu" (GPT-OSS: ``(clamp(up, ±limit) + 1) · g·σ(α·g)`` with ``g = min(gate, limit)``;
    ``alpha`` and ``limit`` are used by it only). Output in gate_up's dtype; the gradient of gate_up is
    written whole, in its layout, by one backward pass.
    """
    _check_options(layout, activation, alpha, limit)
    check_tensor(gate_up, "gate_up")
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate and up), got shape {tuple(gate_up.shape)}")
    return MOE_GLU(gate_up, layout == "interleaved", activation, float(alpha), float(limit))


# ------------------------------------------------------------------------------------------ reference


def split_gate_up(gate_up, layout="halves"):
    """(gate, up) views of the packed projection in ``layout``."""
    if layout == "interleaved":
        return gate_up[..., ::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)


def moe_glu_reference(gate_up, layout="halves", activation="silu", *, alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT,
                      io_dtype=None):
    """The eager ``_apply_gate``: ``act(gate) * up`` (transformers' default gate), or GPT-OSS's.

    For fp64 inputs in tests, ``io_dtype`` (gate_up's dtype under test) rounds every intermediate where
    eager rounds it in that dtype.
    """
    gate, up = split_gate_up(gate_up, layout)
    if activation != CLAMPED_SWIGLU:
        return glu_reference(gate, up, activation, io_dtype=io_dtype)

    def r(t):
        return t if io_dtype is None else t.to(io_dtype).to(t.dtype)

    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = r(gate * r(torch.sigmoid(r(gate * alpha))))
    return r(r(up + 1) * glu)
