r"""Multimodal rotary position embedding (M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL), forward and backward.

cos/sin carry three position streams, temporal, height and width: ``cos[s, b, t]`` (``s`` = 0, 1, 2) is
the ``[Dr]`` row of stream s at position t, ``Dr = cos.shape[-1]`` even, ``half = Dr / 2``. Each
rotary frequency j (0 <= j < half) takes its angle from one stream, ``stream(j)``, fixed by
``mrope_section = (n_t, n_h, n_w)`` with ``n_t + n_h + n_w = half``:

    sectioned  (Qwen2-VL, Qwen2.5-VL)   stream(j) = 0 for j < n_t, 1 for j < n_t + n_h, else 2
    interleaved (Qwen3-VL)              stream(j) = 1 if j % 3 == 1 and j < 3·n_h,
                                                    2 if j % 3 == 2 and j < 3·n_w, else 0

(the second is transformers' ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``: frequencies
1, 4, 7, ... below ``3·n_h`` come from the height stream, 2, 5, 8, ... below ``3·n_w`` from the width
stream, everything else from the temporal one). Both halves of the rotary dims follow frequency j:
dims j and j + half of the combined row come from stream(j), as transformers' 4.x
``apply_multimodal_rotary_pos_emb`` splits cos by ``mrope_section * 2``. With the combined rows

    c1[j] = cos[stream(j), b, t, j]      c2[j] = cos[stream(j), b, t, j + half]     (s1, s2 from sin)

the op is the rotate_half rope of :mod:`tigon.ops.rope` (its docstring derives it)::

    out1 = x1·c1 − x2·s1        out2 = x2·c2 + x1·s2        out_pass = x_pass       (forward)
    dx1  = g1·c1 + g2·s2        dx2  = g2·c2 − g1·s1        dx_pass  = g_pass       (backward)

The map is linear in x and the backward is its transpose (the rotation by −sin for the usual
``cat(freqs, freqs)`` tables; the form above is exact for any cos/sin). cos/sin get no gradient.

The combined rows are never materialised: the kernels compute stream(j) for the tile's columns
and add ``stream(j)·stride_s`` to each cos/sin column's offset, so a column reads the one plane it
needs. Everything else is rope's: the same two tilings, chosen by the same rule
(:func:`tigon.ops.rope.rope_launch`, :class:`~tigon.ops.rope.RopeConfig`), the same layouts (q, k read
as ``[B, H, T, D]`` through four strides each, so ``unsqueeze_dim=2`` and the transpose of a
projection are read in place; outputs and gradients dense in q's and k's memory order), the same
cos/sin tile loads and pass-through copy. Offsets are int64 per (head, position) row and per cos/sin
column.

Bytes (speed of light), element size b, N_q = B·Hq·T·D, N_k = B·Hk·T·D: forward and backward each
read and write q and k once, ``2·(N_q + N_k)·b``, plus the cos/sin columns they select (``B·T·Dr``
elements of each table's ``3·B·T·Dr``).

Reference: :func:`mrope_reference` (transformers 4.x ``apply_multimodal_rotary_pos_emb`` for the
sectioned layout, Qwen3-VL's interleaved recomposition for the other, then rope's reference with its
partial-rotary split). Output dtypes follow its type promotion (fp32 cos/sin with bf16 q give fp32
outputs); dq, dk have q's and k's dtypes.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tigon._kernels import (
    TigonOp,
    bhtd_strides,
    cdiv,
    check_int,
    check_qk,
    check_rot_dim,
    copy_tile,
    dim_order,
    empty_in_order,
    head_block_rows,
    load_trig,
    q_or_k,
    store_rotation,
    token_tile_rows,
    wrap_triton,
)
from tigon.ops.rope import CONFIG as ROPE_CONFIG
from tigon.ops.rope import RopeConfig, rope_launch, rope_reference

NUM_STREAMS = 3  # temporal, height, width


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _trig_columns(
    cols, stride_s, stride_d, section_t, section_h, section_w, INTERLEAVED: tl.constexpr, TRIG_VEC: tl.constexpr,
):
    """(BLOCK_HALF,) int64 offsets of frequencies ``cols`` in a [3, B, T, Dr] table: the column in the
    plane of its stream, ``stream(j)·stride_s + j·stride_d`` (the module docstring's stream(j)).

    ``TRIG_VEC`` > 1 (set by the launcher only where it holds, see :func:`_trig_vector`): the offsets
    run in aligned groups of that many consecutive elements, which lets the compiler vectorise the
    cos/sin loads as it does rope's (it cannot see through the stream's plane offset on its own).
    """
    if INTERLEAVED:
        phase = cols % 3
        stream = tl.where(
            (phase == 1) & (cols < 3 * section_h), 1, tl.where((phase == 2) & (cols < 3 * section_w), 2, 0)
        )
    else:
        stream = (cols >= section_t).to(tl.int32) + (cols >= section_t + section_h).to(tl.int32)
    offsets = stream.to(tl.int64) * stride_s + cols.to(tl.int64) * stride_d
    if TRIG_VEC > 1:
        offsets = tl.max_contiguous(tl.multiple_of(offsets, TRIG_VEC), TRIG_VEC)
    return offsets


@triton.jit
def _rotate_mrope_tile(
    x1_ptrs, x2_ptrs, out1_ptrs, out2_ptrs, mask,  # (BLOCK_H, BLOCK_T, BLOCK_HALF) pointers and mask
    cos_ptr, cos_stride_s, cos_stride_b, cos_stride_t, cos_stride_d,   # (3, B, T, Dr); batch stride 0 if shared
    sin_ptr, sin_stride_s, sin_stride_b, sin_stride_t, sin_stride_d,
    batch, positions, cols, half_rot, section_t, section_h, section_w,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr, TRIG_EVICT: tl.constexpr, TRIG_VEC: tl.constexpr,
):
    """rope's ``_rotate_tile`` with each cos/sin column read from its stream's plane.

    rope's ``load_trig`` adds ``cols · stride_d`` to each row; given unit stride and the columns'
    element offsets (stream plane included, :func:`_trig_columns`), it reads the combined rows.
    """
    sections = (section_t, section_h, section_w)
    cos_cols = _trig_columns(cols, cos_stride_s, cos_stride_d, *sections, INTERLEAVED, TRIG_VEC)
    sin_cols = _trig_columns(cols, sin_stride_s, sin_stride_d, *sections, INTERLEAVED, TRIG_VEC)
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x2_ptrs, mask=mask, other=0.0).to(tl.float32)
    c1 = load_trig(cos_ptr, cos_stride_b, cos_stride_t, 1, batch, positions, cos_cols, mask,
                    BLOCK_H, BLOCK_T, BLOCK_HALF, TRIG_EVICT)
    c2 = load_trig(cos_ptr, cos_stride_b, cos_stride_t, 1, batch, positions, cos_cols + half_rot * cos_stride_d,
                    mask, BLOCK_H, BLOCK_T, BLOCK_HALF, TRIG_EVICT)
    s1 = load_trig(sin_ptr, sin_stride_b, sin_stride_t, 1, batch, positions, sin_cols, mask,
                    BLOCK_H, BLOCK_T, BLOCK_HALF, TRIG_EVICT)
    s2 = load_trig(sin_ptr, sin_stride_b, sin_stride_t, 1, batch, positions, sin_cols + half_rot * sin_stride_d,
                    mask, BLOCK_H, BLOCK_T, BLOCK_HALF, TRIG_EVICT)
    store_rotation(x1, x2, c1, c2, s1, s2, out1_ptrs, out2_ptrs, mask, BACKWARD)


@triton.jit
def _mrope_heads(
    x_ptr, x_stride_b, x_stride_h, x_stride_t, x_stride_d,     # (B, H, T, D) rotated input, any strides
    out_ptr, out_stride_b, out_stride_h, out_stride_t, out_stride_d,    # (B, H, T, D) out
    cos_ptr, cos_stride_s, cos_stride_b, cos_stride_t, cos_stride_d,   # (3, B, T, Dr)
    sin_ptr, sin_stride_s, sin_stride_b, sin_stride_t, sin_stride_d,
    batch, head_start, num_heads, positions, position_mask, half_rot, rot_dim, head_dim,
    section_t, section_h, section_w,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, TRIG_EVICT: tl.constexpr,
    TRIG_VEC: tl.constexpr,
):
    """One (BLOCK_H heads, BLOCK_T positions, D) tile of one tensor and one batch element (rope's
    ``_rotate_heads`` with stream-selected cos/sin)."""
    x_rows, out_rows, row_mask = head_block_rows(                                    # (BLOCK_H, BLOCK_T)
        x_ptr, x_stride_b, x_stride_h, x_stride_t, out_ptr, out_stride_b, out_stride_h, out_stride_t,
        batch, head_start, num_heads, positions, position_mask, BLOCK_H,
    )
    cols = tl.arange(0, BLOCK_HALF)
    mask = row_mask[:, :, None] & (cols < half_rot)[None, None, :]        # (BLOCK_H, BLOCK_T, BLOCK_HALF)
    _rotate_mrope_tile(
        x_rows[:, :, None] + (cols * x_stride_d)[None, None, :],
        x_rows[:, :, None] + ((cols + half_rot) * x_stride_d)[None, None, :],
        out_rows[:, :, None] + (cols * out_stride_d)[None, None, :],
        out_rows[:, :, None] + ((cols + half_rot) * out_stride_d)[None, None, :],
        mask,
        cos_ptr, cos_stride_s, cos_stride_b, cos_stride_t, cos_stride_d,
        sin_ptr, sin_stride_s, sin_stride_b, sin_stride_t, sin_stride_d,
        batch, positions, cols, half_rot, section_t, section_h, section_w,
        BLOCK_H, BLOCK_T, BLOCK_HALF, INTERLEAVED, BACKWARD, TRIG_EVICT, TRIG_VEC,
    )
    if HAS_PASS:
        pass_cols = rot_dim + tl.arange(0, BLOCK_PASS)
        copy_tile(
            x_rows[:, :, None] + (pass_cols * x_stride_d)[None, None, :],
            out_rows[:, :, None] + (pass_cols * out_stride_d)[None, None, :],
            row_mask[:, :, None] & (pass_cols < head_dim)[None, None, :],
        )


@triton.jit
def mrope_kernel(
    q_ptr, q_stride_b, q_stride_h, q_stride_t, q_stride_d,         # (B, Hq, T, D) q, or d(q_out) backward
    k_ptr, k_stride_b, k_stride_h, k_stride_t, k_stride_d,         # (B, Hk, T, D) k, or d(k_out)
    q_out_ptr, qo_stride_b, qo_stride_h, qo_stride_t, qo_stride_d,  # (B, Hq, T, D) out: q_out, or dq
    k_out_ptr, ko_stride_b, ko_stride_h, ko_stride_t, ko_stride_d,  # (B, Hk, T, D) out: k_out, or dk
    cos_ptr, cos_stride_s, cos_stride_b, cos_stride_t, cos_stride_d,  # (3, B, T, Dr); batch stride 0 if shared
    sin_ptr, sin_stride_s, sin_stride_b, sin_stride_t, sin_stride_d,  # (3, B, T, Dr)
    seq_len, num_q_heads, num_k_heads, half_rot, rot_dim, head_dim, section_t, section_h, section_w,
    q_head_blocks, head_blocks,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, TRIG_EVICT: tl.constexpr,
    TRIG_VEC: tl.constexpr,
):
    """Head-block tiling (rope's ``rope_kernel``): BLOCK_H heads of q (or of k) × BLOCK_T positions of
    one batch element a program, head blocks fastest so that programs sharing cos/sin rows run together."""
    pid = tl.program_id(0)
    head_block = pid % head_blocks
    batch_position_block = pid // head_blocks
    position_blocks = tl.cdiv(seq_len, BLOCK_T)
    batch = (batch_position_block // position_blocks).to(tl.int64)
    positions = (batch_position_block % position_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    position_mask = positions < seq_len
    if head_block < q_head_blocks:
        _mrope_heads(
            q_ptr, q_stride_b, q_stride_h, q_stride_t, q_stride_d,
            q_out_ptr, qo_stride_b, qo_stride_h, qo_stride_t, qo_stride_d,
            cos_ptr, cos_stride_s, cos_stride_b, cos_stride_t, cos_stride_d,
            sin_ptr, sin_stride_s, sin_stride_b, sin_stride_t, sin_stride_d,
            batch, head_block * BLOCK_H, num_q_heads, positions, position_mask, half_rot, rot_dim, head_dim,
            section_t, section_h, section_w,
            BLOCK_H, BLOCK_T, BLOCK_HALF, BLOCK_PASS, HAS_PASS, INTERLEAVED, BACKWARD, TRIG_EVICT, TRIG_VEC,
        )
    else:
        _mrope_heads(
            k_ptr, k_stride_b, k_stride_h, k_stride_t, k_stride_d,
            k_out_ptr, ko_stride_b, ko_stride_h, ko_stride_t, ko_stride_d,
            cos_ptr, cos_stride_s, cos_stride_b, cos_stride_t, cos_stride_d,
            sin_ptr, sin_stride_s, sin_stride_b, sin_stride_t, sin_stride_d,
            batch, (head_block - q_head_blocks) * BLOCK_H, num_k_heads, positions, position_mask,
            half_rot, rot_dim, head_dim, section_t, section_h, section_w,
            BLOCK_H, BLOCK_T, BLOCK_HALF, BLOCK_PASS, HAS_PASS, INTERLEAVED, BACKWARD, TRIG_EVICT, TRIG_VEC,
        )


@triton.jit
def mrope_token_kernel(
    q_ptr, q_stride_b, q_stride_h, q_stride_t, q_stride_d,         # (B, Hq, T, D) q, or d(q_out) backward
    k_ptr, k_stride_b, k_stride_h, k_stride_t, k_stride_d,         # (B, Hk, T, D) k, or d(k_out)
    q_out_ptr, qo_stride_b, qo_stride_h, qo_stride_t, qo_stride_d,  # (B, Hq, T, D) out: q_out, or dq
    k_out_ptr, ko_stride_b, ko_stride_h, ko_stride_t, ko_stride_d,  # (B, Hk, T, D) out: k_out, or dk
    cos_ptr, cos_stride_s, cos_stride_b, cos_stride_t, cos_stride_d,  # (3, B, T, Dr); batch stride 0 if shared
    sin_ptr, sin_stride_s, sin_stride_b, sin_stride_t, sin_stride_d,  # (3, B, T, Dr)
    seq_len, num_q_heads, num_k_heads, half_rot, rot_dim, head_dim, section_t, section_h, section_w,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    HAS_PASS: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, TRIG_EVICT: tl.constexpr,
    TRIG_VEC: tl.constexpr,
):
    """Token tiling (rope's ``rope_token_kernel``): every head of q AND k × BLOCK_T positions a program.

    Tile row h is q's head h for h < Hq and k's head h − Hq after (rows past Hq + Hk masked), each
    row's pointers selected with rope's ``q_or_k``; q and k (and their outputs) share a dtype.
    """
    batch, positions, is_q, row_mask, q_rows, k_rows, qo_rows, ko_rows = token_tile_rows(
        tl.program_id(0), seq_len, num_q_heads, num_k_heads,
        q_ptr, q_stride_b, q_stride_h, q_stride_t, k_ptr, k_stride_b, k_stride_h, k_stride_t,
        q_out_ptr, qo_stride_b, qo_stride_h, qo_stride_t, k_out_ptr, ko_stride_b, ko_stride_h, ko_stride_t,
        BLOCK_H, BLOCK_T,
    )
    cols = tl.arange(0, BLOCK_HALF)
    mask = row_mask[:, :, None] & (cols < half_rot)[None, None, :]        # (BLOCK_H, BLOCK_T, BLOCK_HALF)
    _rotate_mrope_tile(
        q_or_k(is_q, q_rows, q_stride_d, k_rows, k_stride_d, cols),
        q_or_k(is_q, q_rows, q_stride_d, k_rows, k_stride_d, cols + half_rot),
        q_or_k(is_q, qo_rows, qo_stride_d, ko_rows, ko_stride_d, cols),
        q_or_k(is_q, qo_rows, qo_stride_d, ko_rows, ko_stride_d, cols + half_rot),
        mask,
        cos_ptr, cos_stride_s, cos_stride_b, cos_stride_t, cos_stride_d,
        sin_ptr, sin_stride_s, sin_stride_b, sin_stride_t, sin_stride_d,
        batch, positions, cols, half_rot, section_t, section_h, section_w,
        BLOCK_H, BLOCK_T, BLOCK_HALF, INTERLEAVED, BACKWARD, TRIG_EVICT, TRIG_VEC,
    )
    if HAS_PASS:
        pass_cols = rot_dim + tl.arange(0, BLOCK_PASS)
        copy_tile(
            q_or_k(is_q, q_rows, q_stride_d, k_rows, k_stride_d, pass_cols),
            q_or_k(is_q, qo_rows, qo_stride_d, ko_rows, ko_stride_d, pass_cols),
            row_mask[:, :, None] & (pass_cols < head_dim)[None, None, :],
        )


# -------------------------------------------------------------------------------------- launch config


@dataclasses.dataclass(frozen=True)
class MropeConfig:
    """Launch settings: rope's (``rope``, the tilings, their blocks and warps and the choice between
    them; the tiles are the same shapes, only the cos/sin addresses differ), read when this module
    is imported."""

    rope: RopeConfig = ROPE_CONFIG


CONFIG = MropeConfig()


# ------------------------------------------------------------------------------------------ launchers


def _stream_strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(stream, batch, position, dim) strides of a [3, B, T, Dr] cos/sin; batch stride 0 for B = 1."""
    ss, sb, st, sd = t.stride()
    return ss, (0 if t.shape[1] == 1 else sb), st, sd


def _trig_vector(cos, sin, mrope_section, interleaved) -> int:
    """How many consecutive cos/sin elements the kernels may load as one vector: the largest power of
    two up to 16 bytes that divides every place where a run of one stream's columns starts (the
    section boundaries, the second half, the stream planes, the rows, the batches), or 1. The
    interleaved layout changes stream every column: 1."""
    if interleaved or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        return 1
    section_t, section_h, _ = mrope_section
    starts = [section_t, section_t + section_h, cos.shape[-1] // 2]
    for t in (cos, sin):
        starts += [t.stride(0), t.stride(2)] + ([t.stride(1)] if t.shape[1] > 1 else [])
    vec = 16 // max(cos.element_size(), sin.element_size())
    while vec > 1 and any(n % vec for n in starts):
        vec //= 2
    return vec


def _launch(x_q, x_k, out_q, out_k, cos, sin, mrope_section, interleaved, unsqueeze_dim, backward):
    """Rotate x_q → out_q and x_k → out_k (all four shaped like q / k) in one launch."""
    batch = x_q.shape[0]
    seq_len, head_dim = x_q.shape[3 - unsqueeze_dim], x_q.shape[3]
    num_q_heads, num_k_heads = x_q.shape[unsqueeze_dim], x_k.shape[unsqueeze_dim]
    rot_dim = cos.shape[-1]
    if batch == 0 or seq_len == 0 or head_dim == 0 or num_q_heads + num_k_heads == 0:
        return
    same_dtypes = x_q.dtype == x_k.dtype and out_q.dtype == out_k.dtype
    cfg = rope_launch(seq_len, num_q_heads, num_k_heads, rot_dim, head_dim, same_dtypes, config=CONFIG.rope)
    batch_position_blocks = batch * cdiv(seq_len, cfg.block_t)
    section_t, section_h, section_w = mrope_section
    tensors = (
        x_q, *bhtd_strides(x_q, unsqueeze_dim),
        x_k, *bhtd_strides(x_k, unsqueeze_dim),
        out_q, *bhtd_strides(out_q, unsqueeze_dim),
        out_k, *bhtd_strides(out_k, unsqueeze_dim),
        cos, *_stream_strides(cos),
        sin, *_stream_strides(sin),
        seq_len, num_q_heads, num_k_heads, rot_dim // 2, rot_dim, head_dim, section_t, section_h, section_w,
    )
    blocks = dict(
        BLOCK_H=cfg.block_h, BLOCK_T=cfg.block_t, BLOCK_HALF=cfg.block_half, BLOCK_PASS=cfg.block_pass,
        HAS_PASS=cfg.has_pass, INTERLEAVED=interleaved, BACKWARD=backward, num_warps=cfg.num_warps,
        TRIG_EVICT=CONFIG.rope.trig_eviction, TRIG_VEC=_trig_vector(cos, sin, mrope_section, interleaved),
    )
    if cfg.token_tiling:
        wrap_triton(mrope_token_kernel)[(batch_position_blocks,)](*tensors, **blocks)
        return
    q_head_blocks = cdiv(num_q_heads, cfg.block_h)
    head_blocks = q_head_blocks + cdiv(num_k_heads, cfg.block_h)
    wrap_triton(mrope_kernel)[(batch_position_blocks * head_blocks,)](*tensors, q_head_blocks, head_blocks, **blocks)


# ------------------------------------------------------------------------------- torch ops + autograd


def _mrope_impl(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mrope_section: list[int],
    interleaved: bool, unsqueeze_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    trig_dtype = torch.promote_types(cos.dtype, sin.dtype)
    q_out = empty_in_order(q.shape, dim_order(q), torch.promote_types(q.dtype, trig_dtype), q.device)
    k_out = empty_in_order(k.shape, dim_order(k), torch.promote_types(k.dtype, trig_dtype), k.device)
    _launch(q, k, q_out, k_out, cos, sin, mrope_section, interleaved, unsqueeze_dim, False)
    return q_out, k_out


def _mrope_backward_impl(
    dq_out: torch.Tensor,
    dk_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: list[int],
    interleaved: bool,
    unsqueeze_dim: int,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
    q_order: list[int],
    k_order: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk) in q's and k's dtypes and memory orders (``q_order``: :func:`dim_order` of q)."""
    dq = empty_in_order(dq_out.shape, q_order, q_dtype, dq_out.device)
    dk = empty_in_order(dk_out.shape, k_order, k_dtype, dk_out.device)
    _launch(dq_out, dk_out, dq, dk, cos, sin, mrope_section, interleaved, unsqueeze_dim, True)
    return dq, dk


def _setup_mrope(ctx, inputs, output):
    q, k, cos, sin, mrope_section, interleaved, unsqueeze_dim = inputs
    q_out, k_out = output
    ctx.save_for_backward(cos, sin)
    ctx.args = (list(mrope_section), interleaved, unsqueeze_dim)
    ctx.q_meta = (q.shape, q.dtype, dim_order(q), q_out.dtype)
    ctx.k_meta = (k.shape, k.dtype, dim_order(k), k_out.dtype)


def _mrope_grad(ctx, dq_out, dk_out):
    cos, sin = ctx.saved_tensors
    q_shape, q_dtype, q_order, q_out_dtype = ctx.q_meta
    k_shape, k_dtype, k_order, k_out_dtype = ctx.k_meta
    # An output that got no gradient arrives as None: a stride-0 zero costs no memory.
    if dq_out is None:
        dq_out = torch.zeros((), dtype=q_out_dtype, device=cos.device).expand(q_shape)
    if dk_out is None:
        dk_out = torch.zeros((), dtype=k_out_dtype, device=cos.device).expand(k_shape)
    dq, dk = MROPE_BACKWARD(dq_out, dk_out, cos, sin, *ctx.args, q_dtype, k_dtype, q_order, k_order)
    return dq, dk, None, None, None, None, None


MROPE_BACKWARD = TigonOp("mrope_backward", _mrope_backward_impl)
MROPE = TigonOp("mrope", _mrope_impl, setup_context=_setup_mrope, backward=_mrope_grad)


# ------------------------------------------------------------------------------------ public function


def _check_args(q, k, cos, sin, mrope_section, unsqueeze_dim):
    layout, batch, seq_len, head_dim = check_qk(q, k, cos, sin, unsqueeze_dim)
    if cos.dim() != 4 or cos.shape[0] != NUM_STREAMS or cos.shape[2] != seq_len or cos.shape[1] not in (1, batch):
        raise ValueError(
            f"cos has shape {tuple(cos.shape)}, expected [3, {batch}, {seq_len}, Dr] or [3, 1, {seq_len}, Dr] "
            f"(temporal, height and width streams) for q of shape {tuple(q.shape)} ({layout})"
        )
    rot_dim = cos.shape[-1]
    check_rot_dim(rot_dim, head_dim)
    if (
        isinstance(mrope_section, (str, bytes))
        or not isinstance(mrope_section, Sequence)
        or len(mrope_section) != NUM_STREAMS
        or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 0 for n in mrope_section)
        or sum(mrope_section) != rot_dim // 2
    ):
        raise ValueError(
            f"mrope_section must be 3 non-negative ints (temporal, height, width frequencies) summing to "
            f"Dr / 2 = {rot_dim // 2} (cos.shape[-1] = {rot_dim}), got {mrope_section!r}"
        )


def mrope(q, k, cos, sin, mrope_section, *, unsqueeze_dim=1, interleaved=False):
    """Apply multimodal rotary position embedding to q and k; returns ``(q_out, k_out)``.

    ``cos``/``sin``: ``[3, B, T, Dr]`` (or ``[3, 1, T, Dr]``), the temporal, height and width streams'
    tables. ``mrope_section``: three ints summing to ``Dr / 2``, how many rotary frequencies each
    stream gives. ``interleaved=False``: the sectioned layout of Qwen2-VL / Qwen2.5-VL (transformers
    4.x ``apply_multimodal_rotary_pos_emb``: frequencies ``[0, n_t)`` from the temporal stream, the
    next ``n_h`` from the height one, the rest from the width one); ``interleaved=True``: Qwen3-VL's
    (frequency j from the height stream where ``j % 3 == 1`` and ``j < 3·n_h``, the width stream where
    ``j % 3 == 2`` and ``j < 3·n_w``, the temporal one elsewhere). Then rope as :func:`tigon.ops.rope`:
    ``unsqueeze_dim=1`` takes q ``[B, Hq, T, D]`` and k ``[B, Hk, T, D]``, ``unsqueeze_dim=2`` takes
    ``[B, T, H, D]``; with ``Dr < D`` only the first ``Dr`` dims rotate. Any strides. Gradients flow to
    q and k only. Output dtypes: q's and k's promoted with cos/sin's, as transformers'.
    """
    check_int(unsqueeze_dim, "unsqueeze_dim")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be True or False, got {interleaved!r}")
    _check_args(q, k, cos, sin, mrope_section, unsqueeze_dim)
    return MROPE(q, k, cos, sin, [int(n) for n in mrope_section], bool(interleaved), int(unsqueeze_dim))


# ------------------------------------------------------------------------------------------ reference


def _interleave_streams(table, mrope_section):
    """Qwen3-VL's ``recomposition_frequencies`` on one ``[3, ..., half]`` table: the temporal stream,
    with positions ``offset, offset + 3, ...`` below ``3·n`` taken from height (offset 1) and width (2)."""
    combined = table[0].clone()
    for stream in (1, 2):
        columns = slice(stream, 3 * mrope_section[stream], 3)
        combined[..., columns] = table[stream, ..., columns]
    return combined


def mrope_cos_sin(cos, sin, mrope_section, *, interleaved=False):
    """The ``[B, T, Dr]`` cos/sin rows the streams combine into (what the kernels never build).

    Sectioned: transformers 4.x ``apply_multimodal_rotary_pos_emb``'s
    ``cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section * 2, dim=-1))], -1)``. Interleaved:
    Qwen3-VL's recomposition applied to each half of the rotary dims.
    """

    def combine(table):
        if not interleaved:
            parts = table.split(list(mrope_section) * 2, dim=-1)
            return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
        half = table.shape[-1] // 2
        halves = (table[..., :half], table[..., half:])
        return torch.cat([_interleave_streams(part, mrope_section) for part in halves], dim=-1)

    return combine(cos), combine(sin)


def mrope_reference(q, k, cos, sin, mrope_section, *, unsqueeze_dim=1, interleaved=False, io_dtype=None):
    """The combined cos/sin rows (:func:`mrope_cos_sin`), then :func:`tigon.ops.rope.rope_reference`
    (rotate_half rope, partial rotary; ``io_dtype`` rounds each output once to that dtype)."""
    cos, sin = mrope_cos_sin(cos, sin, mrope_section, interleaved=interleaved)
    return rope_reference(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, io_dtype=io_dtype)
