r"""Rotary position embedding (rotate_half convention), q and k in one launch, forward and backward.

Forward, per head vector :math:`x \in \mathbb{R}^D` at position t, with the first ``Dr`` dims rotated
(``Dr = cos.shape[-1]``, even; ``half = Dr / 2``) and c, s the rows ``cos[b, t]``, ``sin[b, t]``::

    x = [x1 | x2 | x_pass]                    x1 = x[:half], x2 = x[half:Dr], x_pass = x[Dr:]
    rotate_half(x[:Dr]) = [-x2 | x1]
    out1 = x1·c1 − x2·s1                      (c1, s1 = first halves of c, s; c2, s2 the second)
    out2 = x2·c2 + x1·s2
    out_pass = x_pass

Backward. The map is linear in x, so the gradient is its transpose applied to g = d(out)::

    dx1 = g1·c1 + g2·s2
    dx2 = g2·c2 − g1·s1
    dx_pass = g_pass

For the usual cos/sin (``cat(freqs, freqs)``: c1 = c2, s1 = s2) this is the same rotation with sin
negated; the form above stays exact for any cos/sin. One kernel serves both directions:
``out1 = x1·c1 + x2·a``, ``out2 = x2·c2 + x1·b`` with (a, b) = (−s1, s2) forward, (s2, −s1) backward.
cos/sin get no gradient.

Layouts. q and k are read as logical ``[B, H, T, D]`` through four strides each, so the
``unsqueeze_dim=2`` layout ``[B, T, H, D]`` and the transpose of a projection's output are the same
kernel with the strides permuted; nothing is copied. Outputs are dense in q's and k's memory order
(as eager elementwise ops allocate theirs), and the backward writes dq and dk in that order too, so
the gradient flows back through ``view(...).transpose(1, 2)`` without a copy. cos/sin of shape
``[T, Dr]`` or ``[1, T, Dr]`` are read with batch stride 0.

Tilings (:func:`rope_launch` picks one; both take the same arguments and share the rotation code)::

    head-block  rope_kernel        a program: BLOCK_H heads of q OR of k × BLOCK_T positions
    token       rope_token_kernel  a program: all Hq + Hk heads of q AND k × BLOCK_T positions

The head-block tiling takes BLOCK_H = the largest power of two dividing both head counts, so that
no block is partly masked; with many shared heads (32 / 8, 16 / 8) it comes close to SOL at the
benchmark shapes (docs/tuning.md, "rope"). When that power of two is small it falls short:
Qwen2.5-0.5B's 14 / 2 heads of 64 give
BLOCK_H = 2, eight programs per block of positions, each reading 256 contiguous bytes per position
of the ``[B, T, H, D]`` projection and the same cos/sin rows again (measured well short of SOL,
docs/tuning.md, "rope"). The token tiling
then makes the tile's rows the Hq + Hk heads (padded to a power of two, the padding masked): row h
is q's head h for h < Hq, k's head h − Hq after, each row's pointers chosen with ``tl.where``. A
program reads cos/sin once per position for every head, and a token's q and k rows in one tile. It
is taken when the head-block tiling would hold fewer than ``token_tiling_below_block_h`` heads, one
position's padded heads fit in ``token_tile_elements``, and q and k (and their outputs) share a
dtype (one pointer type for the select); the head-block tiling serves every other case.

Bytes (speed of light), element size b, N_q = B·Hq·T·D, N_k = B·Hk·T·D::

    forward   read q, k; write q_out, k_out        2·(N_q + N_k)·b     (+ cos, sin: 2·B·T·Dr)
    backward  read dq_out, dk_out; write dq, dk    2·(N_q + N_k)·b     (+ cos, sin)

Reference: :func:`rope_reference` (transformers' ``apply_rotary_pos_emb``, with the partial-rotary
split the transformers models use). Output dtypes follow its type promotion: fp32 cos/sin with bf16
q give fp32 outputs; dq, dk have q's and k's dtypes. ``output_dtype`` asks for other output dtypes:
attention under autocast casts fp32 q_out (and k_out) to bf16 anyway, so ``tigon.patch`` has rope
write that bf16 copy itself (the same values, with no fp32 outputs written, read and cast forward,
nor bf16 gradients widened backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tigon._kernels import (
    TigonOp,
    bhtd_strides,
    cache_by_size,
    cdiv,
    check_int,
    check_qk,
    check_rot_dim,
    copy_tile,
    dim_order,
    empty_in_order,
    head_block_rows,
    load_trig,
    next_power_of_2,
    pow2_at_most,
    q_or_k,
    store_rotation,
    token_tile_rows,
    wrap_triton,
)

# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _rotate_tile(
    x1_ptrs, x2_ptrs, out1_ptrs, out2_ptrs, mask,  # (BLOCK_H, BLOCK_T, BLOCK_HALF) pointers and mask
    cos_ptr, cos_stride_b, cos_stride_t, cos_stride_d,         # (B, T, Dr); batch stride 0 if shared
    sin_ptr, sin_stride_b, sin_stride_t, sin_stride_d,
    batch, positions, cols, half_rot,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr,
    TRIG_EVICT: tl.constexpr,
):
    """out1 = x1·c1 + x2·a, out2 = x2·c2 + x1·b with (a, b) = (−s1, s2) forward, (s2, −s1) backward.

    x1/out1 point at each row's dims ``cols``, x2/out2 at ``cols + half_rot``; row (h, t) is at
    position ``positions[t]`` of batch element ``batch``, whatever tensor it belongs to.
    """
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x2_ptrs, mask=mask, other=0.0).to(tl.float32)
    c1 = load_trig(cos_ptr, cos_stride_b, cos_stride_t, cos_stride_d, batch, positions, cols, mask,
                    BLOCK_H, BLOCK_T, BLOCK_HALF, TRIG_EVICT)
    c2 = load_trig(cos_ptr, cos_stride_b, cos_stride_t, cos_stride_d, batch, positions, cols + half_rot,
                    mask, BLOCK_H, BLOCK_T, BLOCK_HALF, TRIG_EVICT)
    s1 = load_trig(sin_ptr, sin_stride_b, sin_stride_t, sin_stride_d, batch, positions, cols, mask,
                    BLOCK_H, BLOCK_T, BLOCK_HALF, TRIG_EVICT)
    s2 = load_trig(sin_ptr, sin_stride_b, sin_stride_t, sin_stride_d, batch, positions, cols + half_rot,
                    mask, BLOCK_H, BLOCK_T, BLOCK_HALF, TRIG_EVICT)
    store_rotation(x1, x2, c1, c2, s1, s2, out1_ptrs, out2_ptrs, mask, BACKWARD)


@triton.jit
def _rotate_heads(
    x_ptr, x_stride_b, x_stride_h, x_stride_t, x_stride_d,     # (B, H, T, D) rotated input, any strides
    out_ptr, out_stride_b, out_stride_h, out_stride_t, out_stride_d,    # (B, H, T, D) out
    cos_ptr, cos_stride_b, cos_stride_t, cos_stride_d,         # (B, T, Dr); batch stride 0 if shared
    sin_ptr, sin_stride_b, sin_stride_t, sin_stride_d,
    batch, head_start, num_heads, positions, position_mask, half_rot, rot_dim, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    HAS_PASS: tl.constexpr, BACKWARD: tl.constexpr, TRIG_EVICT: tl.constexpr,
):
    """Rotate one (BLOCK_H heads, BLOCK_T positions, D) tile of one tensor and one batch element.

    Offsets are int64 per (head, position) row, so tensors past 2**31 elements address correctly.
    """
    x_rows, out_rows, row_mask = head_block_rows(                                    # (BLOCK_H, BLOCK_T)
        x_ptr, x_stride_b, x_stride_h, x_stride_t, out_ptr, out_stride_b, out_stride_h, out_stride_t,
        batch, head_start, num_heads, positions, position_mask, BLOCK_H,
    )
    cols = tl.arange(0, BLOCK_HALF)
    mask = row_mask[:, :, None] & (cols < half_rot)[None, None, :]        # (BLOCK_H, BLOCK_T, BLOCK_HALF)
    _rotate_tile(
        x_rows[:, :, None] + (cols * x_stride_d)[None, None, :],
        x_rows[:, :, None] + ((cols + half_rot) * x_stride_d)[None, None, :],
        out_rows[:, :, None] + (cols * out_stride_d)[None, None, :],
        out_rows[:, :, None] + ((cols + half_rot) * out_stride_d)[None, None, :],
        mask,
        cos_ptr, cos_stride_b, cos_stride_t, cos_stride_d,
        sin_ptr, sin_stride_b, sin_stride_t, sin_stride_d,
        batch, positions, cols, half_rot,
        BLOCK_H, BLOCK_T, BLOCK_HALF, BACKWARD, TRIG_EVICT,
    )
    if HAS_PASS:
        pass_cols = rot_dim + tl.arange(0, BLOCK_PASS)
        copy_tile(
            x_rows[:, :, None] + (pass_cols * x_stride_d)[None, None, :],
            out_rows[:, :, None] + (pass_cols * out_stride_d)[None, None, :],
            row_mask[:, :, None] & (pass_cols < head_dim)[None, None, :],
        )


@triton.jit
def rope_kernel(
    q_ptr, q_stride_b, q_stride_h, q_stride_t, q_stride_d,         # (B, Hq, T, D) q, or d(q_out) backward
    k_ptr, k_stride_b, k_stride_h, k_stride_t, k_stride_d,         # (B, Hk, T, D) k, or d(k_out)
    q_out_ptr, qo_stride_b, qo_stride_h, qo_stride_t, qo_stride_d,  # (B, Hq, T, D) out: q_out, or dq
    k_out_ptr, ko_stride_b, ko_stride_h, ko_stride_t, ko_stride_d,  # (B, Hk, T, D) out: k_out, or dk
    cos_ptr, cos_stride_b, cos_stride_t, cos_stride_d,             # (B, T, Dr) cos; batch stride 0 if shared
    sin_ptr, sin_stride_b, sin_stride_t, sin_stride_d,             # (B, T, Dr) sin
    seq_len, num_q_heads, num_k_heads, half_rot, rot_dim, head_dim, q_head_blocks, head_blocks,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    HAS_PASS: tl.constexpr, BACKWARD: tl.constexpr, TRIG_EVICT: tl.constexpr,
):
    """Head-block tiling. One program: BLOCK_H heads of q (or of k) × BLOCK_T positions of one batch
    element.

    The flat grid runs over (batch, position block) × head block with the head block fastest, so the
    programs that share a cos/sin tile run side by side and all but the first read it from L2.
    """
    pid = tl.program_id(0)
    head_block = pid % head_blocks
    batch_position_block = pid // head_blocks
    position_blocks = tl.cdiv(seq_len, BLOCK_T)
    batch = (batch_position_block // position_blocks).to(tl.int64)
    positions = (batch_position_block % position_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    position_mask = positions < seq_len
    if head_block < q_head_blocks:
        _rotate_heads(
            q_ptr, q_stride_b, q_stride_h, q_stride_t, q_stride_d,
            q_out_ptr, qo_stride_b, qo_stride_h, qo_stride_t, qo_stride_d,
            cos_ptr, cos_stride_b, cos_stride_t, cos_stride_d,
            sin_ptr, sin_stride_b, sin_stride_t, sin_stride_d,
            batch, head_block * BLOCK_H, num_q_heads, positions, position_mask, half_rot, rot_dim, head_dim,
            BLOCK_H, BLOCK_T, BLOCK_HALF, BLOCK_PASS, HAS_PASS, BACKWARD, TRIG_EVICT,
        )
    else:
        _rotate_heads(
            k_ptr, k_stride_b, k_stride_h, k_stride_t, k_stride_d,
            k_out_ptr, ko_stride_b, ko_stride_h, ko_stride_t, ko_stride_d,
            cos_ptr, cos_stride_b, cos_stride_t, cos_stride_d,
            sin_ptr, sin_stride_b, sin_stride_t, sin_stride_d,
            batch, (head_block - q_head_blocks) * BLOCK_H, num_k_heads, positions, position_mask,
            half_rot, rot_dim, head_dim,
            BLOCK_H, BLOCK_T, BLOCK_HALF, BLOCK_PASS, HAS_PASS, BACKWARD, TRIG_EVICT,
        )


@triton.jit
def rope_token_kernel(
    q_ptr, q_stride_b, q_stride_h, q_stride_t, q_stride_d,         # (B, Hq, T, D) q, or d(q_out) backward
    k_ptr, k_stride_b, k_stride_h, k_stride_t, k_stride_d,         # (B, Hk, T, D) k, or d(k_out)
    q_out_ptr, qo_stride_b, qo_stride_h, qo_stride_t, qo_stride_d,  # (B, Hq, T, D) out: q_out, or dq
    k_out_ptr, ko_stride_b, ko_stride_h, ko_stride_t, ko_stride_d,  # (B, Hk, T, D) out: k_out, or dk
    cos_ptr, cos_stride_b, cos_stride_t, cos_stride_d,             # (B, T, Dr) cos; batch stride 0 if shared
    sin_ptr, sin_stride_b, sin_stride_t, sin_stride_d,             # (B, T, Dr) sin
    seq_len, num_q_heads, num_k_heads, half_rot, rot_dim, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    HAS_PASS: tl.constexpr, BACKWARD: tl.constexpr, TRIG_EVICT: tl.constexpr,
):
    """Token tiling. One program: every head of q AND k × BLOCK_T positions of one batch element.

    Tile row h (of BLOCK_H = Hq + Hk padded to a power of two) is q's head h for h < Hq and k's head
    h − Hq after that; rows past Hq + Hk are masked. Each row's pointers are chosen between q's and
    k's (and between q_out's and k_out's) with ``tl.where``, so q and k must share a dtype, as must
    the outputs (the launcher falls back to the head-block tiling otherwise). cos/sin are loaded at
    the full tile shape by the same ``load_trig`` as the head-block tiling: one compiled form, the
    tile's own layout, and the rows repeated over heads are L1 hits; each position's cos/sin row
    comes from memory once, for all heads. Offsets are int64 per (head, position) row, as in
    ``_rotate_heads``.
    """
    batch, positions, is_q, row_mask, q_rows, k_rows, qo_rows, ko_rows = token_tile_rows(
        tl.program_id(0), seq_len, num_q_heads, num_k_heads,
        q_ptr, q_stride_b, q_stride_h, q_stride_t, k_ptr, k_stride_b, k_stride_h, k_stride_t,
        q_out_ptr, qo_stride_b, qo_stride_h, qo_stride_t, k_out_ptr, ko_stride_b, ko_stride_h, ko_stride_t,
        BLOCK_H, BLOCK_T,
    )
    cols = tl.arange(0, BLOCK_HALF)
    mask = row_mask[:, :, None] & (cols < half_rot)[None, None, :]        # (BLOCK_H, BLOCK_T, BLOCK_HALF)
    _rotate_tile(
        q_or_k(is_q, q_rows, q_stride_d, k_rows, k_stride_d, cols),
        q_or_k(is_q, q_rows, q_stride_d, k_rows, k_stride_d, cols + half_rot),
        q_or_k(is_q, qo_rows, qo_stride_d, ko_rows, ko_stride_d, cols),
        q_or_k(is_q, qo_rows, qo_stride_d, ko_rows, ko_stride_d, cols + half_rot),
        mask,
        cos_ptr, cos_stride_b, cos_stride_t, cos_stride_d,
        sin_ptr, sin_stride_b, sin_stride_t, sin_stride_d,
        batch, positions, cols, half_rot,
        BLOCK_H, BLOCK_T, BLOCK_HALF, BACKWARD, TRIG_EVICT,
    )
    if HAS_PASS:
        pass_cols = rot_dim + tl.arange(0, BLOCK_PASS)
        copy_tile(
            q_or_k(is_q, q_rows, q_stride_d, k_rows, k_stride_d, pass_cols),
            q_or_k(is_q, qo_rows, qo_stride_d, ko_rows, ko_stride_d, pass_cols),
            row_mask[:, :, None] & (pass_cols < head_dim)[None, None, :],
        )


# -------------------------------------------------------------------------------------- launch config

@dataclass(frozen=True)
class RopeConfig:
    """Launch settings of both tilings (docs/tuning.md, "rope"; dev/tune_rope.py sweeps them)."""

    # Head-block tiling (rope_kernel): elements (heads × positions × padded head dim) one program
    # moves per tensor, and warps: one per elements_per_warp elements, at most max_warps (2048 bf16
    # values are 4 KB read and 4 KB written a program; 8 warps give each thread 8 values, so many
    # small programs keep every SM's loads in flight).
    tile_elements: int = 2048
    elements_per_warp: int = 256
    max_warps: int = 8
    # Heads per program: the largest power of two dividing both head counts (so neither q's nor k's
    # last block is partly masked), at most this many; positions fill the rest of the tile.
    max_block_h: int = 16
    # Token tiling (rope_token_kernel): taken where the head-block tiling would put fewer than
    # token_tiling_below_block_h heads in a program (gcd(Hq, Hk) has a small power-of-two part: 14 / 2
    # gives 2) and one position's Hq + Hk heads, padded to a power of two, fit in token_tile_elements.
    # 0 never takes it, above max_block_h takes it wherever it fits; where heads per program are
    # already >= 4 it is 1-5% slower, hence the threshold.
    token_tiling_below_block_h: int = 4
    token_tile_elements: int = 4096
    token_elements_per_warp: int = 256
    token_max_warps: int = 8
    # Eviction policy of the cos/sin loads (both tilings): "", "evict_first" or "evict_last". A
    # program's cos/sin rows are read once per head of its tile and by the other head blocks of the
    # same positions, while q and k stream through the caches once: "evict_last" keeps the rows.
    trig_eviction: str = "evict_last"


CONFIG = RopeConfig()


@dataclass(frozen=True)
class RopeLaunch:
    """Block geometry for one launch (forward and backward use the same)."""

    token_tiling: bool  # rope_token_kernel (every q and k head per program), else rope_kernel
    block_h: int  # tile rows: a block of q's or of k's heads; Hq + Hk padded in the token tiling
    block_t: int
    block_half: int
    block_pass: int
    has_pass: bool
    num_warps: int


def _floor_power_of_2(n: int) -> int:
    """The largest power of two <= n (1 for n < 1)."""
    return 1 << max(0, int(n).bit_length() - 1)


def rope_launch(
    seq_len: int, num_q_heads: int, num_k_heads: int, rot_dim: int, head_dim: int, same_dtypes: bool, *,
    config: RopeConfig | None = None,
) -> RopeLaunch:
    """The tiling and its blocks. ``same_dtypes``: q and k share a dtype, and so do their outputs
    (the token tiling selects between their pointers, which must then have one type)."""
    return _rope_launch(seq_len, num_q_heads, num_k_heads, rot_dim, head_dim, same_dtypes, config or CONFIG)


@cache_by_size
def _rope_launch(seq_len, num_q_heads, num_k_heads, rot_dim, head_dim, same_dtypes, config) -> RopeLaunch:
    block_half = next_power_of_2(rot_dim // 2)
    has_pass = head_dim > rot_dim
    block_pass = next_power_of_2(head_dim - rot_dim) if has_pass else 1
    row = 2 * block_half + (block_pass if has_pass else 0)
    common = math.gcd(num_q_heads, num_k_heads) or max(num_q_heads, num_k_heads, 1)
    block_h = min(common & -common, config.max_block_h, _floor_power_of_2(config.tile_elements // row))
    all_heads = next_power_of_2(num_q_heads + num_k_heads)
    token_tiling = (
        same_dtypes and block_h < config.token_tiling_below_block_h and all_heads * row <= config.token_tile_elements
    )
    if token_tiling:
        block_h, tile = all_heads, config.token_tile_elements
        per_warp, max_warps = config.token_elements_per_warp, config.token_max_warps
    else:
        tile, per_warp, max_warps = config.tile_elements, config.elements_per_warp, config.max_warps
    block_t = pow2_at_most(seq_len, _floor_power_of_2(tile // (block_h * row)))
    # A padded row of 2·block_half + block_pass need not be a power of two; Triton's warps must be.
    num_warps = _floor_power_of_2(max(1, min(block_h * block_t * row // per_warp, max_warps)))
    return RopeLaunch(token_tiling, block_h, block_t, block_half, block_pass, has_pass, num_warps)


# ------------------------------------------------------------------------------------------ launchers


def _cos_sin_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, position, dim) strides of cos/sin; batch stride 0 for [T, Dr] and [1, T, Dr]."""
    if t.dim() == 2:
        return 0, t.stride(0), t.stride(1)
    return (0 if t.shape[0] == 1 else t.stride(0)), t.stride(1), t.stride(2)


def _launch(x_q, x_k, out_q, out_k, cos, sin, unsqueeze_dim, backward):
    """Rotate x_q → out_q and x_k → out_k (all four shaped like q / k) in one launch."""
    batch = x_q.shape[0]
    seq_len, head_dim = x_q.shape[3 - unsqueeze_dim], x_q.shape[3]
    num_q_heads, num_k_heads = x_q.shape[unsqueeze_dim], x_k.shape[unsqueeze_dim]
    rot_dim = cos.shape[-1]
    if batch == 0 or seq_len == 0 or head_dim == 0 or num_q_heads + num_k_heads == 0:
        return
    same_dtypes = x_q.dtype == x_k.dtype and out_q.dtype == out_k.dtype
    cfg = rope_launch(seq_len, num_q_heads, num_k_heads, rot_dim, head_dim, same_dtypes)
    batch_position_blocks = batch * cdiv(seq_len, cfg.block_t)
    tensors = (
        x_q, *bhtd_strides(x_q, unsqueeze_dim),
        x_k, *bhtd_strides(x_k, unsqueeze_dim),
        out_q, *bhtd_strides(out_q, unsqueeze_dim),
        out_k, *bhtd_strides(out_k, unsqueeze_dim),
        cos, *_cos_sin_strides(cos),
        sin, *_cos_sin_strides(sin),
        seq_len, num_q_heads, num_k_heads, rot_dim // 2, rot_dim, head_dim,
    )
    blocks = dict(
        BLOCK_H=cfg.block_h, BLOCK_T=cfg.block_t, BLOCK_HALF=cfg.block_half, BLOCK_PASS=cfg.block_pass,
        HAS_PASS=cfg.has_pass, BACKWARD=backward, num_warps=cfg.num_warps, TRIG_EVICT=CONFIG.trig_eviction,
    )
    if cfg.token_tiling:
        wrap_triton(rope_token_kernel)[(batch_position_blocks,)](*tensors, **blocks)
        return
    q_head_blocks = cdiv(num_q_heads, cfg.block_h)
    head_blocks = q_head_blocks + cdiv(num_k_heads, cfg.block_h)
    wrap_triton(rope_kernel)[(batch_position_blocks * head_blocks,)](*tensors, q_head_blocks, head_blocks, **blocks)


def rope_into(x_q, x_k, out_q, out_k, cos, sin, *, backward: bool = False) -> None:
    """Rotate ``[B, T, H, D]`` q and k (any strides) into ``out_q`` / ``out_k`` in one launch, the backward
    rotation when ``backward``; ``out`` may be ``x`` itself (each program reads its rows before writing
    them, and no two programs share a row). For nodes that own their buffers in eager mode (a fused
    attention rotates q and k inside its qkv projection's output): no autograd, not a registered op."""
    _launch(x_q, x_k, out_q, out_k, cos, sin, 2, backward)


# ------------------------------------------------------------------------------- torch ops + autograd


def _rope_impl(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
    q_out_dtype: torch.dtype | None = None,
    k_out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    trig_dtype = torch.promote_types(cos.dtype, sin.dtype)
    q_dtype = q_out_dtype or torch.promote_types(q.dtype, trig_dtype)
    k_dtype = k_out_dtype or torch.promote_types(k.dtype, trig_dtype)
    q_out = empty_in_order(q.shape, dim_order(q), q_dtype, q.device)
    k_out = empty_in_order(k.shape, dim_order(k), k_dtype, k.device)
    _launch(q, k, q_out, k_out, cos, sin, unsqueeze_dim, False)
    return q_out, k_out


def _rope_backward_impl(
    dq_out: torch.Tensor,
    dk_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
    q_order: list[int],
    k_order: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk) in q's and k's dtypes and memory orders (``q_order``: :func:`dim_order` of q)."""
    dq = empty_in_order(dq_out.shape, q_order, q_dtype, dq_out.device)
    dk = empty_in_order(dk_out.shape, k_order, k_dtype, dk_out.device)
    _launch(dq_out, dk_out, dq, dk, cos, sin, unsqueeze_dim, True)
    return dq, dk


def _setup_rope(ctx, inputs, output):
    q, k, cos, sin, unsqueeze_dim = inputs[:5]
    q_out, k_out = output
    ctx.save_for_backward(cos, sin)
    ctx.unsqueeze_dim = unsqueeze_dim
    ctx.q_meta = (q.shape, q.dtype, dim_order(q), q_out.dtype)
    ctx.k_meta = (k.shape, k.dtype, dim_order(k), k_out.dtype)


def _rope_grad(ctx, dq_out, dk_out):
    cos, sin = ctx.saved_tensors
    q_shape, q_dtype, q_order, q_out_dtype = ctx.q_meta
    k_shape, k_dtype, k_order, k_out_dtype = ctx.k_meta
    # An output that got no gradient arrives as None: a stride-0 zero costs no memory.
    if dq_out is None:
        dq_out = torch.zeros((), dtype=q_out_dtype, device=cos.device).expand(q_shape)
    if dk_out is None:
        dk_out = torch.zeros((), dtype=k_out_dtype, device=cos.device).expand(k_shape)
    dq, dk = ROPE_BACKWARD(
        dq_out, dk_out, cos, sin, ctx.unsqueeze_dim, q_dtype, k_dtype, q_order, k_order
    )
    return dq, dk, None, None, None, None, None


ROPE_BACKWARD = TigonOp("rope_backward", _rope_backward_impl)
ROPE = TigonOp("rope", _rope_impl, setup_context=_setup_rope, backward=_rope_grad)


# ------------------------------------------------------------------------------------ public function


def _check_args(q, k, cos, sin, unsqueeze_dim):
    layout, batch, seq_len, head_dim = check_qk(q, k, cos, sin, unsqueeze_dim)
    if cos.dim() not in (2, 3):
        raise ValueError(f"cos must be [B, T, Dr] or [T, Dr], got shape {tuple(cos.shape)}")
    cos_batch = cos.shape[0] if cos.dim() == 3 else 1
    if cos.shape[-2] != seq_len or cos_batch not in (1, batch):
        raise ValueError(
            f"cos has shape {tuple(cos.shape)}, expected [{batch}, {seq_len}, Dr], [1, {seq_len}, Dr] or "
            f"[{seq_len}, Dr] for q of shape {tuple(q.shape)} ({layout})"
        )
    check_rot_dim(cos.shape[-1], head_dim)


def rope(q, k, cos, sin, *, unsqueeze_dim=1, output_dtype=None):
    """Apply rotary position embedding to q and k; returns ``(q_out, k_out)``.

    transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`` (rotate_half convention):
    ``unsqueeze_dim=1`` takes q ``[B, Hq, T, D]`` and k ``[B, Hk, T, D]``; ``unsqueeze_dim=2`` takes
    ``[B, T, H, D]``. ``cos``/``sin`` are ``[B, T, Dr]``, ``[1, T, Dr]`` or ``[T, Dr]``; with ``Dr < D``
    only the first ``Dr`` dims of each head rotate and the rest pass through. Any strides (the
    transpose of a ``[B, T, H, D]`` projection is read in place). Gradients flow to q and k only.

    ``output_dtype``: None gives transformers' dtypes (q's and k's promoted with cos/sin's: bf16 q
    with fp32 cos/sin give fp32). A floating dtype gives both outputs in it, a pair ``(q's, k's)``
    each its own (None in the pair: that output's promoted dtype). Each value is computed in fp32
    and rounded once: exactly what a consumer that casts the promoted output to that dtype reads
    (attention under autocast; ``tigon.patch`` passes the autocast dtype, see
    ``tigon.patching.engine.apply_rotary_pos_emb``), without writing and re-reading fp32 copies.
    """
    check_int(unsqueeze_dim, "unsqueeze_dim")
    _check_args(q, k, cos, sin, unsqueeze_dim)
    pair = output_dtype if isinstance(output_dtype, tuple) else (output_dtype, output_dtype)
    if len(pair) != 2 or not (_output_dtype_ok(pair[0]) and _output_dtype_ok(pair[1])):
        raise TypeError(f"output_dtype must be None, a floating torch.dtype or a pair of them, got {output_dtype!r}")
    return ROPE(q, k, cos, sin, int(unsqueeze_dim), *pair)


def _output_dtype_ok(dtype) -> bool:
    return dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point)


# ------------------------------------------------------------------------------------------ reference


def rotate_half(x):
    """transformers' rotate_half: ``[x1 | x2] -> [-x2 | x1]``."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(q, k, cos, sin, *, unsqueeze_dim=1, io_dtype=None):
    """transformers' ``apply_rotary_pos_emb`` in PyTorch, with partial rotary and ``[T, Dr]`` cos/sin.

    With ``Dr < D`` the first ``Dr`` dims rotate and the rest are concatenated back, as the
    partial-rotary transformers models do. ``io_dtype`` (for fp64 inputs in tests) rounds each
    output once to that dtype.
    """
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot_dim = cos.shape[-1]

    def apply(x):
        x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
        out = x_rot * cos + rotate_half(x_rot) * sin
        if x_pass.shape[-1]:
            out = torch.cat((out, x_pass), dim=-1)
        if io_dtype is not None:
            out = out.to(io_dtype).to(x.dtype)
        return out

    return apply(q), apply(k)
