"""What rope and mrope share: the cos/sin and pass-through tile helpers of their kernels, and the
q/k layouts (strides in (batch, head, position, dim) order; outputs allocated in the inputs' memory
order). rope.py's module docstring derives the kernels that use them."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tigon.ops._launch import cache_by_size

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
    (the sort with a Python key cost ~14 µs a call on a CPU, more than a quarter of the op's host time)."""

    def outer_first(d):
        return -strides[d] if strides[d] != 0 and shape[d] != 1 else -math.inf

    return tuple(sorted(range(len(shape)), key=outer_first))


@cache_by_size
def _inverse_of(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(order.index(d) for d in range(len(order)))


def empty_in_order(shape, order: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty([shape[d] for d in order], dtype=dtype, device=device).permute(_inverse_of(order))
