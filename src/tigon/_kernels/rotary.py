"""What rope and mrope share: the cos/sin and pass-through tile helpers of their kernels, and the
q/k layouts (strides in (batch, head, position, dim) order; outputs allocated in the inputs' memory
order). rope.py's module docstring derives the kernels that use them."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tigon._kernels.inputs import check_tensor
from tigon._kernels.launch import cache_by_size

UNSQUEEZE_DIMS = (1, 2)  # q, k as [B, H, T, D] (1) or [B, T, H, D] (2)

# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def load_trig(
    ptr, stride_b, stride_t, stride_d, batch, positions, cols, mask,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, EVICT: tl.constexpr,
):
    """One (BLOCK_H, BLOCK_T, BLOCK_HALF) fp32 tile of cos or sin, the same row for every head.

    Loaded at the full tile shape (head stride 0) rather than as (BLOCK_T, BLOCK_HALF) and broadcast:
    then it gets the layout of the q/k tile, and the broadcast costs no shared-memory layout
    conversion; the repeated addresses are L1 hits.
    """
    rows = ptr + batch * stride_b + positions.to(tl.int64) * stride_t                 # (BLOCK_T,)
    tile = rows[None, :, None] + (cols * stride_d)[None, None, :]
    tile = tl.broadcast_to(tile, (BLOCK_H, BLOCK_T, BLOCK_HALF))
    return tl.load(tile, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)


@triton.jit
def copy_tile(x_ptrs, out_ptrs, mask):
    """The pass-through dims (Dr <= d < D): upcast after the load, round once at the store."""
    x_pass = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, x_pass.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def q_or_k(is_q, q_rows, q_stride_d, k_rows, k_stride_d, cols):
    """(BLOCK_H, BLOCK_T, len(cols)) pointers to dims ``cols`` of each tile row: q's row where
    ``is_q`` (BLOCK_H,) holds, k's row elsewhere.

    Selecting whole pointers (not strides) keeps each side's contiguity along the dims: the
    condition is constant along them, so Triton's alignment analysis still sees unit-stride runs
    and vectorises the loads and stores as it does for one tensor.
    """
    return tl.where(
        is_q[:, None, None],
        q_rows[:, :, None] + (cols * q_stride_d)[None, None, :],
        k_rows[:, :, None] + (cols * k_stride_d)[None, None, :],
    )




@triton.jit
def store_rotation(x1, x2, c1, c2, s1, s2, out1_ptrs, out2_ptrs, mask, BACKWARD: tl.constexpr):
    """out1 = x1·c1 − x2·s1, out2 = x2·c2 + x1·s2 (forward), or the transpose, out1 = x1·c1 + x2·s2,
    out2 = x2·c2 − x1·s1 (backward), rounded once to the outputs' dtype at the store."""
    if BACKWARD:
        out1 = x1 * c1 + x2 * s2
        out2 = x2 * c2 - x1 * s1
    else:
        out1 = x1 * c1 - x2 * s1
        out2 = x2 * c2 + x1 * s2
    out_dtype = out1_ptrs.dtype.element_ty
    tl.store(out1_ptrs, out1.to(out_dtype), mask=mask)
    tl.store(out2_ptrs, out2.to(out_dtype), mask=mask)


@triton.jit
def head_block_rows(
    x_ptr, x_stride_b, x_stride_h, x_stride_t, out_ptr, out_stride_b, out_stride_h, out_stride_t,
    batch, head_start, num_heads, positions, position_mask, BLOCK_H: tl.constexpr,
):
    """(x rows, out rows, row mask), each (BLOCK_H, BLOCK_T): the head-block tiling's BLOCK_H heads from
    ``head_start`` of one tensor at ``positions`` of one batch element. Offsets are int64 per (head,
    position) row, so tensors past 2**31 elements address correctly."""
    heads = head_start + tl.arange(0, BLOCK_H)
    row_mask = (heads < num_heads)[:, None] & position_mask[None, :]
    x_rows = x_ptr + batch * x_stride_b + (
        heads[:, None].to(tl.int64) * x_stride_h + positions[None, :].to(tl.int64) * x_stride_t
    )
    out_rows = out_ptr + batch * out_stride_b + (
        heads[:, None].to(tl.int64) * out_stride_h + positions[None, :].to(tl.int64) * out_stride_t
    )
    return x_rows, out_rows, row_mask


@triton.jit
def token_tile_rows(
    pid, seq_len, num_q_heads, num_k_heads,
    q_ptr, q_stride_b, q_stride_h, q_stride_t, k_ptr, k_stride_b, k_stride_h, k_stride_t,
    q_out_ptr, qo_stride_b, qo_stride_h, qo_stride_t, k_out_ptr, ko_stride_b, ko_stride_h, ko_stride_t,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The token tiling's program ``pid``: (batch, positions, is_q, row mask, q, k, q_out and k_out rows).

    Tile row h is q's head h for h < Hq and k's head h − Hq after (rows past Hq + Hk masked); the row
    pointers of both tensors are returned, and :func:`q_or_k` picks between them per row."""
    position_blocks = tl.cdiv(seq_len, BLOCK_T)
    batch = (pid // position_blocks).to(tl.int64)
    positions = (pid % position_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    is_q = heads < num_q_heads
    row_mask = (heads < num_q_heads + num_k_heads)[:, None] & (positions < seq_len)[None, :]
    q_heads = heads[:, None].to(tl.int64)                                                    # (BLOCK_H, 1)
    k_heads = q_heads - num_q_heads          # negative on q's rows: selected away, never dereferenced
    t = positions[None, :].to(tl.int64)                                                      # (1, BLOCK_T)
    q_rows = q_ptr + batch * q_stride_b + (q_heads * q_stride_h + t * q_stride_t)    # (BLOCK_H, BLOCK_T)
    k_rows = k_ptr + batch * k_stride_b + (k_heads * k_stride_h + t * k_stride_t)
    qo_rows = q_out_ptr + batch * qo_stride_b + (q_heads * qo_stride_h + t * qo_stride_t)
    ko_rows = k_out_ptr + batch * ko_stride_b + (k_heads * ko_stride_h + t * ko_stride_t)
    return batch, positions, is_q, row_mask, q_rows, k_rows, qo_rows, ko_rows

# ------------------------------------------------------------------------------------------- layouts


def bhtd_strides(t: torch.Tensor, unsqueeze_dim: int) -> tuple[int, int, int, int]:
    """Strides of a q/k-shaped tensor in (batch, head, position, dim) order."""
    sb, s1, s2, sd = t.stride()
    return (sb, s1, s2, sd) if unsqueeze_dim == 1 else (sb, s2, s1, sd)


def dim_order(t: torch.Tensor) -> tuple[int, ...]:
    """t's dims from outermost to innermost in memory (by stride; ties keep the logical order).

    Outputs and gradients are allocated densely in this order, as eager elementwise ops allocate
    theirs: the transpose of a [B, T, H, D] projection (even a strided slice of a fused qkv one)
    gets [B, T, H, D]-ordered outputs, which flow back through the transpose without a copy.
    Broadcast (stride 0) and size-1 dims say nothing about memory order and go outermost.
    """
    return _order_of(tuple(t.shape), t.stride())


@cache_by_size
def _order_of(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """:func:`dim_order` from sizes and strides, cached: it runs four times per forward and backward
    (the sort with a Python key took over a quarter of the op's host time: docs/tuning.md)."""

    def outer_first(d):
        return -strides[d] if strides[d] != 0 and shape[d] != 1 else -math.inf

    return tuple(sorted(range(len(shape)), key=outer_first))


@cache_by_size
def _inverse_of(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(order.index(d) for d in range(len(order)))


def empty_in_order(shape, order: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty([shape[d] for d in order], dtype=dtype, device=device).permute(_inverse_of(order))


# -------------------------------------------------------------------------------------------- checks


def check_qk(q, k, cos, sin, unsqueeze_dim):
    """q and k 4-D in the layout ``unsqueeze_dim`` names, of one batch, length and head dim, and
    cos/sin tensors on their device: (layout name, batch, sequence length, head dim)."""
    check_tensor(q, "q")
    check_tensor(k, "k", device=q.device)
    check_tensor(cos, "cos", device=q.device)
    check_tensor(sin, "sin", device=q.device)
    if unsqueeze_dim not in UNSQUEEZE_DIMS:
        raise ValueError(
            f"unsqueeze_dim must be 1 (q, k as [B, H, T, D]) or 2 ([B, T, H, D]), got {unsqueeze_dim!r}"
        )
    layout = "[B, H, T, D]" if unsqueeze_dim == 1 else "[B, T, H, D]"
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D {layout} for unsqueeze_dim={unsqueeze_dim}, got shape {tuple(t.shape)}"
            )
    t_dim = 3 - unsqueeze_dim
    batch, seq_len, head_dim = q.shape[0], q.shape[t_dim], q.shape[3]
    if (k.shape[0], k.shape[t_dim], k.shape[3]) != (batch, seq_len, head_dim):
        raise ValueError(
            f"k has shape {tuple(k.shape)}: batch, sequence length and head dim must match q's "
            f"{tuple(q.shape)} ({layout})"
        )
    if sin.shape != cos.shape:
        raise ValueError(f"sin has shape {tuple(sin.shape)}, expected cos's {tuple(cos.shape)}")
    return layout, batch, seq_len, head_dim


def check_rot_dim(rot_dim, head_dim):
    """The rotated dims: even, at least 2, at most the head dim."""
    if rot_dim % 2 != 0 or not 0 < rot_dim <= head_dim:
        raise ValueError(
            f"the rotary dim (cos.shape[-1] = {rot_dim}) must be even and in [2, head_dim = {head_dim}]"
        )
