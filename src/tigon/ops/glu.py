r"""Gated linear units: SwiGLU and GeGLU in one kernel pair, the activation chosen at compile time.

Forward, elementwise over gate g and up u (any shape, same shape)::

    a  = r(act(g))            act = silu: g·σ(g)
                              act = gelu (tanh): g·σ(2v), v = √(2/π)·(g + 0.044715·g³)
                                                 (= ½g(1 + tanh v), written without the cancellation
                                                  of 1 + tanh v at large negative g)
                              act = gelu (erf):  ½g·(1 + erf(g/√2))
    h  = a · u

``r`` rounds to g's dtype, exactly where the eager ``act(gate) * up`` rounds, so the forward gives
eager's values; everything else is fp32 with one rounding at the store.

Backward, with dh the gradient of h (rounding taken as the identity, as autograd does)::

    du = dh · a
    dg = dh · u · act'(g)     silu:        σ(g)·(1 + g·(1 − σ(g)))
                              gelu (tanh): s + 2g·s·(1 − s)·√(2/π)·(1 + 3·0.044715·g²),  s = σ(2v)
                              gelu (erf):  ½(1 + erf(g/√2)) + g·exp(−g²/2)/√(2π)

Nothing but g and u is saved: the backward recomputes a from g. :func:`glu_backward_into` writes
dg over dh and du into a given buffer, so that the recomputing MLP (:mod:`tigon.nn.mlp`) needs no
new intermediate-sized tensor in its backward.

Layouts: contiguous operands are walked as one flat array (no row padding, every program full);
anything else (a strided slice of a fused gate_up projection, a stride-0 gradient from ``.sum()``) is
read in place through row and column strides. Outputs are contiguous.

Bytes (speed of light), N elements, element size b::

    forward   read g, u; write h                        3·N·b
    backward  read dh, g, u; write dg, du               5·N·b

Reference: :func:`glu_reference` (``act(gate) * up`` as transformers' MLPs compute it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tigon._kernels import (
    TigonOp,
    as_rows,
    cache_by_size,
    cdiv,
    check_tensor,
    gate_activation,
    next_power_of_2,
    pow2_at_most,
    wrap_triton,
)

# The activations the kernel knows, by the name the torch op takes.
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
GELU_APPROXIMATIONS = {"tanh": "gelu_tanh", "none": "gelu"}


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _tile(pid, num_rows, num_cols, num_elements, col_blocks,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FLAT: tl.constexpr):
    """Rows (int64, (BLOCK_M, 1)), columns ((1, BLOCK_N)) and mask of this program's tile.

    FLAT: every operand is contiguous, so the tensor is walked as rows of BLOCK_N elements regardless
    of its real row length; row r, column c is then element r·BLOCK_N + c of every operand.
    """
    if FLAT:
        rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
        cols = tl.arange(0, BLOCK_N)[None, :]
        mask = rows * BLOCK_N + cols < num_elements
    else:
        rows = (pid // col_blocks).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
        cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        mask = (rows < num_rows) & (cols < num_cols)
    return rows, cols, mask


@triton.jit
def glu_fwd_kernel(
    gate_ptr, gate_row_stride, gate_col_stride,     # (M, N) gate, any strides
    up_ptr, up_row_stride, up_col_stride,           # (M, N) up, any strides
    h_ptr, h_row_stride,                            # (M, N) out, contiguous
    num_rows, num_cols, num_elements, col_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FLAT: tl.constexpr, ACTIVATION: tl.constexpr,
):
    """h = r(act(g))·u over one tile. In FLAT mode the launcher passes row strides BLOCK_N, col 1."""
    rows, cols, mask = _tile(
        tl.program_id(0), num_rows, num_cols, num_elements, col_blocks, BLOCK_M, BLOCK_N, FLAT
    )
    g = tl.load(gate_ptr + rows * gate_row_stride + cols * gate_col_stride, mask=mask, other=0.0)
    g = g.to(tl.float32)
    u = tl.load(up_ptr + rows * up_row_stride + cols * up_col_stride, mask=mask, other=0.0).to(tl.float32)
    act, _ = gate_activation(g, ACTIVATION)
    a = act.to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(h_ptr + rows * h_row_stride + cols, (a * u).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def glu_bwd_kernel(
    dh_ptr, dh_row_stride, dh_col_stride,           # (M, N) gradient of h, any strides (stride 0 too)
    gate_ptr, gate_row_stride, gate_col_stride,     # (M, N) gate
    up_ptr, up_row_stride, up_col_stride,           # (M, N) up
    dgate_ptr, dup_ptr, out_row_stride,             # (M, N) outs, unit column stride; dgate may be dh
    h_ptr, h_row_stride,                            # (M, N) out, unit column stride (STORE_H only)
    num_rows, num_cols, num_elements, col_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FLAT: tl.constexpr, ACTIVATION: tl.constexpr,
    STORE_H: tl.constexpr,
):
    """du = dh·a, dg = dh·u·act'(g) over one tile; with STORE_H also h = a·u, the forward's output.

    Each element of dh, g and u is loaded before the same thread stores there, so the outputs may
    alias the inputs: dgate over a contiguous dh (the in-place variant), or dgate and du over g and u
    with h over dh (the stacked variant, g and u the two halves of one gate_up row). STORE_H serves the
    recomputing MLP, whose backward needs h again (for down_proj's weight gradient): the tile has g
    and u loaded already, so h costs one write here instead of a forward launch that reads g and u a
    second time.
    """
    rows, cols, mask = _tile(
        tl.program_id(0), num_rows, num_cols, num_elements, col_blocks, BLOCK_M, BLOCK_N, FLAT
    )
    dh = tl.load(dh_ptr + rows * dh_row_stride + cols * dh_col_stride, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + rows * gate_row_stride + cols * gate_col_stride, mask=mask, other=0.0)
    g = g.to(tl.float32)
    u = tl.load(up_ptr + rows * up_row_stride + cols * up_col_stride, mask=mask, other=0.0).to(tl.float32)
    act, dact = gate_activation(g, ACTIVATION)
    a = act.to(gate_ptr.dtype.element_ty).to(tl.float32)
    out = rows * out_row_stride + cols
    tl.store(dgate_ptr + out, (dh * u * dact).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + out, (dh * a).to(dup_ptr.dtype.element_ty), mask=mask)
    if STORE_H:
        tl.store(h_ptr + rows * h_row_stride + cols, (a * u).to(h_ptr.dtype.element_ty), mask=mask)


# -------------------------------------------------------------------------------------- launch config

@dataclass(frozen=True)
class GluConfig:
    """Tile geometry settings, forward and backward (docs/tuning.md, "glu"; dev/tune_glu.py).

    A tile of tile_elements (4096 bf16 values: 8 KB per operand; over 16 warps, 8 values a thread,
    one 16-byte vector access per operand, at most 5 operands live): few registers, so many
    programs stay resident per SM and the loads of one cover the stores of another.
    """

    tile_elements: int = 4096
    elements_per_warp: int = 256
    max_warps: int = 16
    # Strided layouts: the widest column block; shorter rows get several rows per program instead.
    max_block_n: int = 1024


CONFIG = GluConfig()


@dataclass(frozen=True)
class GluLaunch:
    """Tile geometry for one GLU kernel launch (forward and backward share it)."""

    flat: bool
    block_m: int
    block_n: int
    col_blocks: int
    num_programs: int
    num_warps: int


def glu_launch(num_rows: int, num_cols: int, *, flat: bool, config: GluConfig | None = None) -> GluLaunch:
    """The tiles for (num_rows, num_cols) operands: flat (contiguous) or by rows and column blocks."""
    return _glu_launch(num_rows, num_cols, flat, config or CONFIG)


@cache_by_size
def _glu_launch(num_rows, num_cols, flat, config) -> GluLaunch:
    if flat:
        num_elements = num_rows * num_cols
        block_n = pow2_at_most(num_elements, config.tile_elements)
        return GluLaunch(True, 1, block_n, 1, cdiv(num_elements, block_n),
                         max(1, min(block_n // config.elements_per_warp, config.max_warps)))
    block_n = min(next_power_of_2(num_cols), config.max_block_n)
    block_m = max(1, pow2_at_most(num_rows, config.tile_elements // block_n))
    col_blocks = cdiv(num_cols, block_n)
    num_warps = max(1, min(block_m * block_n // config.elements_per_warp, config.max_warps))
    num_programs = cdiv(num_rows, block_m) * col_blocks
    return GluLaunch(False, block_m, block_n, col_blocks, num_programs, num_warps)


# ------------------------------------------------------------------------------------------ launchers


def _operand_strides(t2: torch.Tensor, cfg: GluLaunch) -> tuple[int, int]:
    return (cfg.block_n, 1) if cfg.flat else (t2.stride(0), t2.stride(1))


def _forward(gate, up, activation):
    h = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if gate.numel() == 0:
        return h
    g2, u2 = as_rows(gate), as_rows(up)
    num_rows, num_cols = g2.shape
    cfg = glu_launch(num_rows, num_cols, flat=g2.is_contiguous() and u2.is_contiguous())
    wrap_triton(glu_fwd_kernel)[(cfg.num_programs,)](
        g2, *_operand_strides(g2, cfg),
        u2, *_operand_strides(u2, cfg),
        h, cfg.block_n if cfg.flat else num_cols,
        num_rows, num_cols, num_rows * num_cols, cfg.col_blocks,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, FLAT=cfg.flat, ACTIVATION=activation,
        num_warps=cfg.num_warps,
    )
    return h


def _backward(dh, gate, up, activation, dgate, dup, h=None):
    """Write dgate and dup (gate's shape, rows of one stride, unit column stride: contiguous, or the
    halves of a gate_up buffer) from dh, gate, up; and h = act(gate)·up into ``h`` (rows of a unit
    column stride) when given."""
    if gate.numel() == 0:
        return
    d2, g2, u2 = as_rows(dh), as_rows(gate), as_rows(up)
    dg2, du2 = as_rows(dgate), as_rows(dup)
    if dg2.stride() != du2.stride() or dg2.stride(1) != 1:
        raise ValueError("dgate and dup must share their row stride, with unit column stride")
    num_rows, num_cols = g2.shape
    flat = all(t.is_contiguous() for t in (d2, g2, u2, dg2, du2)) and (h is None or h.is_contiguous())
    cfg = glu_launch(num_rows, num_cols, flat=flat)
    h2 = du2 if h is None else as_rows(h)
    wrap_triton(glu_bwd_kernel)[(cfg.num_programs,)](
        d2, *_operand_strides(d2, cfg),
        g2, *_operand_strides(g2, cfg),
        u2, *_operand_strides(u2, cfg),
        dg2, du2, cfg.block_n if cfg.flat else dg2.stride(0),
        h2, cfg.block_n if cfg.flat else h2.stride(0),
        num_rows, num_cols, num_rows * num_cols, cfg.col_blocks,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, FLAT=cfg.flat, ACTIVATION=activation,
        STORE_H=h is not None, num_warps=cfg.num_warps,
    )


# ------------------------------------------------------------------------------- torch ops + autograd


def _glu_impl(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return _forward(gate, up, activation)


def _glu_backward_impl(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    _backward(dh, gate, up, activation, dgate, dup)
    return dgate, dup


def _glu_backward_into_impl(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dup: torch.Tensor, activation: str
) -> None:
    _backward(dh, gate, up, activation, dh, dup)


def _glu_backward_recompute_into_impl(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dup: torch.Tensor, h: torch.Tensor, activation: str
) -> None:
    _backward(dh, gate, up, activation, dh, dup, h)


def _glu_backward_stacked_into_impl(dh: torch.Tensor, gate_up: torch.Tensor, activation: str, store_h: bool) -> None:
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :half], gate_up[..., half:]
    _backward(dh, gate, up, activation, gate, up, dh if store_h else None)


# Mutating: writes dgate over dh and dup into dup (and h into h); see glu_backward_into.
GLU_BACKWARD_INTO = TigonOp("glu_backward_into", _glu_backward_into_impl, mutates_args={"dh", "dup"})
GLU_BACKWARD_RECOMPUTE_INTO = TigonOp(
    "glu_backward_recompute_into", _glu_backward_recompute_into_impl, mutates_args={"dh", "dup", "h"}
)
GLU_BACKWARD_STACKED_INTO = TigonOp(
    "glu_backward_stacked_into", _glu_backward_stacked_into_impl, mutates_args={"dh", "gate_up"}
)


def glu_backward_into(dh, gate, up, dup, activation, *, h=None):
    """The GLU backward in place: dh (contiguous) is overwritten with dgate, dup (contiguous) receives dup,
    and ``h`` (contiguous, optional) receives the forward's output act(gate)·up in the same pass.

    For callers that own dh and spare buffers, such as the recomputing MLP's backward; dh must have
    gate's dtype, dup up's and h their promoted dtype. Under torch.compile the registered mutating
    op is traced.
    """
    outs = [("dh", dh, gate.dtype), ("dup", dup, up.dtype)]
    if h is not None:
        outs.append(("h", h, torch.promote_types(gate.dtype, up.dtype)))
    for name, t, dtype in outs:
        if not t.is_contiguous() or t.shape != gate.shape or t.dtype != dtype:
            raise ValueError(f"{name} must be contiguous with gate's shape and {dtype}")
    if h is None:
        GLU_BACKWARD_INTO(dh, gate, up, dup, activation)
    else:
        GLU_BACKWARD_RECOMPUTE_INTO(dh, gate, up, dup, h, activation)


def glu_backward_stacked_into(dh, gate_up, activation, *, store_h=False):
    """The GLU backward of ``h = act(gate)·up`` with gate and up the two halves of one contiguous
    ``gate_up`` ``[..., 2·I]`` (one stacked projection's output), in place: ``[dgate | dup]`` is written
    over ``gate_up`` (the stacked projection's output gradient, ready for its two products), and with
    ``store_h`` the forward's h over dh (contiguous ``[..., I]``, gate_up's dtype), in one pass.
    """
    if not gate_up.is_contiguous() or gate_up.shape[-1] % 2:
        raise ValueError("gate_up must be contiguous with an even last dimension")
    if not dh.is_contiguous() or dh.shape != (*gate_up.shape[:-1], gate_up.shape[-1] // 2) or dh.dtype != gate_up.dtype:
        raise ValueError("dh must be contiguous, with gate_up's dtype and half its last dimension")
    GLU_BACKWARD_STACKED_INTO(dh, gate_up, activation, bool(store_h))


def _setup_glu(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _glu_grad(ctx, dh):
    gate, up = ctx.saved_tensors
    dgate, dup = GLU_BACKWARD(dh, gate, up, ctx.activation)
    return dgate, dup, None


GLU_BACKWARD = TigonOp("glu_backward", _glu_backward_impl)
GLU = TigonOp("glu", _glu_impl, setup_context=_setup_glu, backward=_glu_grad)


# ------------------------------------------------------------------------------------ public functions


def _check_args(gate, up):
    check_tensor(gate, "gate")
    check_tensor(up, "up", device=gate.device)
    if up.shape != gate.shape:
        raise ValueError(f"up has shape {tuple(up.shape)}, expected gate's {tuple(gate.shape)}")
    if gate.dim() == 0:
        raise ValueError("gate must have at least one dimension")


def glu(gate, up, activation):
    """``act(gate) * up`` by the kernel's activation name ("silu", "gelu_tanh", "gelu")."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    _check_args(gate, up)
    return GLU(gate, up, activation)


def swiglu(gate, up):
    """``silu(gate) * up``; output dtype is the promotion of the two. The backward recomputes silu."""
    _check_args(gate, up)
    return GLU(gate, up, "silu")


def gelu_activation_name(approximate: str) -> str:
    """The kernel's activation name for ``F.gelu``'s ``approximate`` argument ("tanh" or "none")."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {tuple(GELU_APPROXIMATIONS)}, got {approximate!r}")
    return GELU_APPROXIMATIONS[approximate]


def geglu(gate, up, *, approximate="tanh"):
    """``gelu(gate, approximate=approximate) * up`` with ``approximate`` in "tanh", "none"."""
    activation = gelu_activation_name(approximate)
    _check_args(gate, up)
    return GLU(gate, up, activation)


# ------------------------------------------------------------------------------------------ reference


def activation_reference(gate, activation):
    """The eager activation by kernel name: F.silu, or F.gelu with the matching ``approximate``."""
    if activation == "silu":
        return torch.nn.functional.silu(gate)
    return torch.nn.functional.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none")


def glu_reference(gate, up, activation="silu", *, io_dtype=None, out_dtype=None):
    """``act(gate) * up`` as the eager MLPs compute it.

    For fp64 inputs in tests: ``io_dtype`` (gate's dtype under test) rounds ``act(gate)`` where eager
    rounds it, and ``out_dtype`` (default io_dtype; the promotion of gate's and up's) rounds the product.
    """
    act = activation_reference(gate, activation)
    if io_dtype is not None:
        act = act.to(io_dtype).to(gate.dtype)
    h = act * up
    out_dtype = out_dtype or io_dtype
    if out_dtype is not None:
        h = h.to(out_dtype).to(gate.dtype)
    return h
