r"""The log-probability head's matmul with its row math in the epilogue: no logits in memory.

fused_linear_logprobs.py's row-kernel path makes each class chunk of fp32 logits L_c = X·W_cᵀ with cuBLAS,
writes it (N·Vc·4 bytes), and reads it back in a row kernel: at N = 8192 and V = 151936 that is 5 GB
written and 5 GB read in the forward, and again in the backward before dl is written. Here a
persistent Triton matmul computes a (BM, BN) tile of l = X·W_cᵀ (+ b) in its fp32 accumulator and does
the row math on the tile where it lies, in registers (``MODE``):

* ``STATS`` (forward): per row of the tile, with z the scaled logits (fused_linear_logprobs.py) and
  m_i = max z over the tile's classes::

      s_i = Σ e^(z − m_i)     S_i = Σ e^(z − m_i)(z − m_i)     Q_i = Σ e^(2(z − m_i))
      Σz_i = Σ z              b_i = max {z_j : j < t}

  written as partials (k, P, N), P = the chunk's column tiles; z_t goes to its own (N,) vector from the
  one tile that holds the target. ``logprobs_tiles_combine_kernel`` then folds the P partials of every row into its
  running state exactly as the row kernel folds blocks of classes (m' = max(m, m_i), r = e^(m − m'),
  r_i = e^(m_i − m')):

      s ← r·s + r_i·s_i       S ← r·(S + (m − m')·s) + r_i·(S_i + (m_i − m')·s_i)      Q ← r²·Q + r_i²·Q_i

  and writes the outputs after the last chunk. The forward writes k·4/BN bytes per logit (0.1 at k = 6,
  BN = 256) instead of 8.
* ``GRAD`` (backward): dl of the tile (fused_linear_logprobs.py's backward) stored in the matmul dtype,
  the operand of the two gradient matmuls (cuBLAS). The fp32 logits are neither written nor read.

The tiles are loaded by TMA (host-made tensor descriptors, zero-filled past the edges) in a persistent
loop over output tiles in grouped order (``GROUP`` row blocks sweep the column blocks together, so each
W tile is read from L2 by the row blocks that share it), software-pipelined over ``STAGES`` buffers and,
with ``WARP_SPECIALIZE``, with loads and MMAs in their own warps. With ``SPLIT`` 2 the epilogue runs on
the tile's two halves of BN/2 classes one after the other (the STATS partials of the halves merged as
below before they are stored): its fp32 temporaries take half the registers beside the accumulator,
which measured a faster forward at H = 4096 (dev/tune_logprob_tiles.py; docs/tuning.md, "Timings
quoted in the source").
The products are exact in fp32 and
summed in an fp32 accumulator, as cuBLAS's are (in another order). Used where TMA can read the operands
(bf16 or fp16, rows 16-byte aligned; :func:`tiles_available`); fp32 operands keep cuBLAS, whose fp32
matmul is IEEE (``tl.dot`` of fp32 is TF32 unless told otherwise, and IEEE there is slow).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon._interpreter import interpreter_active
from tigon._kernels.fp32_math import as_fp32, fast_exp
from tigon._kernels.launch import (
    INTERPRETER_PROGRAMS,
    PLAIN_TENSORS,
    TigonOp,
    cdiv,
    persistent_programs,
    tracing_active,
    wrap_triton,
)
from tigon._kernels.softmax_rows import local_column, scaled_logits, scaled_with_slope

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - a Triton without host-side descriptors: the cuBLAS path only
    TensorDescriptor = None

STATS = tl.constexpr(0)
GRAD = tl.constexpr(1)
# Rows of the partials and of the running state (fp32, (k, P, N) and (k, N)), in this order:
# tile max m, s, S (entropy), Q (extras), Σ z (extras), max z before the target (extras).
PART_M, PART_S, PART_ENT, PART_SQ, PART_SUM, PART_BEFORE = (tl.constexpr(i) for i in range(6))
STATE_ROWS = 6
# The interpreter computes tl.dot of 16-bit tiles in fp32 (numpy has no bf16 matmul): widen them there.
INTERPRET = tl.constexpr(interpreter_active())


def part_rows(entropy: bool, extras: bool) -> int:
    """How many of the partial rows a call writes: m and s always, S with entropy, the rest with extras."""
    return STATE_ROWS if extras else (3 if entropy else 2)


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def tile_position(tile, num_m, num_n, GROUP: tl.constexpr):
    """(row block, column block) of the tile-th output tile, GROUP row blocks at a time."""
    per_group = GROUP * num_n
    first_m = (tile // per_group) * GROUP
    group_rows = tl.minimum(num_m - first_m, GROUP)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def logprobs_tiles_kernel(
    x_desc, w_desc,                         # TMA: X (N, H) in (BM, BK) blocks; W_c (Vc, H) in (BN, BK) blocks
    bias_ptr,                               # (Vc,) the chunk's bias   [HAS_BIAS]
    target_ptr, target_stride,              # (N,) class indices
    part_ptr,                               # (k, P, N) fp32 partials out   [STATS]
    z_t_ptr,                                # (N,) fp32: z of the target, written by its tile   [STATS]
    lse_ptr, entropy_ptr,                   # (N,) fp32 from the forward   [GRAD; entropy: HAS_ENTROPY_GRAD]
    grad_lp_ptr, grad_lp_stride,            # (N,) upstream gradient of logprobs   [GRAD, HAS_LOGPROB_GRAD]
    grad_ent_ptr, grad_ent_stride,          # (N,) upstream gradient of entropy    [GRAD, HAS_ENTROPY_GRAD]
    grad_ptr, grad_row_stride,              # (N, Vc) dl out in the matmul dtype   [GRAD]
    num_rows, width, hidden, col0, ignore_index, logit_scale, softcap, softcap_scale,
    MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_EXTRAS: tl.constexpr,
    HAS_LOGPROB_GRAD: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, SPLIT: tl.constexpr,
):
    """l = X·W_cᵀ (+ b) one (BM, BN) tile at a time, and per tile the STATS or GRAD epilogue (module docs),
    on the whole tile or (``SPLIT`` 2) on its two halves of BN/2 classes."""
    logit_scale, softcap, softcap_scale = as_fp32(logit_scale), as_fp32(softcap), as_fp32(softcap_scale)
    num_m = tl.cdiv(num_rows, BM)
    num_n = tl.cdiv(width, BN)
    k_tiles = tl.cdiv(hidden, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE, num_stages=STAGES):
        pid_m, pid_n = tile_position(tile, num_m, num_n, GROUP)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(k_tiles):
            a = x_desc.load([pid_m * BM, k * BK])          # (BM, BK)
            b = w_desc.load([pid_n * BN, k * BK])          # (BN, BK)
            if INTERPRET:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc)                      # (BM, BN) fp32
        rows = pid_m * BM + tl.arange(0, BM)
        row_in = rows < num_rows
        t = tl.load(target_ptr + rows.to(tl.int64) * target_stride, mask=row_in, other=ignore_index).to(tl.int64)
        t_local = local_column(t, col0, width)             # (BM,) −1 where the target is elsewhere
        if SPLIT == 2:
            # the epilogue on two (BM, BN/2) halves: half the registers for its temporaries
            l0, l1 = tl.split(tl.permute(tl.reshape(acc, [BM, 2, BN // 2]), (0, 2, 1)))
            cols0 = pid_n * BN + tl.arange(0, BN // 2)
            cols1 = cols0 + BN // 2
        else:
            l0 = acc
            cols0 = pid_n * BN + tl.arange(0, BN)
        if MODE == STATS:
            m, s, ent, sq, z_sum, before, z_t = _stats_slab(
                l0, cols0, width, bias_ptr, t, t_local, col0, logit_scale, softcap, softcap_scale,
                HAS_BIAS, HAS_SOFTCAP, HAS_ENTROPY, HAS_EXTRAS)
            if SPLIT == 2:
                m1, s1, ent1, sq1, z_sum1, before1, z_t1 = _stats_slab(
                    l1, cols1, width, bias_ptr, t, t_local, col0, logit_scale, softcap, softcap_scale,
                    HAS_BIAS, HAS_SOFTCAP, HAS_ENTROPY, HAS_EXTRAS)
                # the two halves merged as the combine kernel merges tiles (module docs)
                m_new = tl.maximum(m, m1)
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                moved = tl.where(m == float("-inf"), 0.0, m - shift)
                moved1 = tl.where(m1 == float("-inf"), 0.0, m1 - shift)
                r = tl.where(m == float("-inf"), 0.0, fast_exp(moved))
                r1 = tl.where(m1 == float("-inf"), 0.0, fast_exp(moved1))
                ent = r * (ent + moved * s) + r1 * (ent1 + moved1 * s1)
                sq = r * r * sq + r1 * r1 * sq1
                s = r * s + r1 * s1
                m = m_new
                z_sum += z_sum1
                before = tl.maximum(before, before1)
                z_t += z_t1  # (0 in the half without the target)
            part = part_ptr + pid_n.to(tl.int64) * num_rows + rows
            plane = (tl.zeros((), tl.int64) + tl.cdiv(width, BN)) * num_rows  # one row of partials: P × N
            tl.store(part + PART_M * plane, m, mask=row_in)
            tl.store(part + PART_S * plane, s, mask=row_in)
            if HAS_ENTROPY:
                tl.store(part + PART_ENT * plane, ent, mask=row_in)
            if HAS_EXTRAS:
                tl.store(part + PART_SQ * plane, sq, mask=row_in)
                tl.store(part + PART_SUM * plane, z_sum, mask=row_in)
                tl.store(part + PART_BEFORE * plane, before, mask=row_in)
            holds = row_in & (t_local >= pid_n * BN) & (t_local < pid_n * BN + BN)
            tl.store(z_t_ptr + rows, z_t, mask=holds)
        else:
            lse = tl.load(lse_ptr + rows, mask=row_in, other=0.0)
            g_lp = tl.zeros([BM], tl.float32)
            if HAS_LOGPROB_GRAD:
                g_lp = tl.load(grad_lp_ptr + rows.to(tl.int64) * grad_lp_stride, mask=row_in, other=0.0)
                g_lp = g_lp.to(tl.float32)
            g_ent = tl.zeros([BM], tl.float32)
            ent = tl.zeros([BM], tl.float32)
            if HAS_ENTROPY_GRAD:
                g_ent = tl.load(grad_ent_ptr + rows.to(tl.int64) * grad_ent_stride, mask=row_in, other=0.0)
                g_ent = g_ent.to(tl.float32)
                ent = tl.load(entropy_ptr + rows, mask=row_in, other=0.0)
            _grad_slab(l0, cols0, rows, row_in, width, bias_ptr, t, t_local, ignore_index, lse, g_lp, g_ent, ent,
                       grad_ptr, grad_row_stride, logit_scale, softcap, softcap_scale, HAS_BIAS, HAS_SOFTCAP,
                       HAS_LOGPROB_GRAD, HAS_ENTROPY_GRAD)
            if SPLIT == 2:
                _grad_slab(l1, cols1, rows, row_in, width, bias_ptr, t, t_local, ignore_index, lse, g_lp, g_ent,
                           ent, grad_ptr, grad_row_stride, logit_scale, softcap, softcap_scale, HAS_BIAS,
                           HAS_SOFTCAP, HAS_LOGPROB_GRAD, HAS_ENTROPY_GRAD)


@triton.jit
def _stats_slab(l, cols, width, bias_ptr, t, t_local, col0, logit_scale, softcap, softcap_scale,
                HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr,
                HAS_EXTRAS: tl.constexpr):
    """Per row of a slab of l (rows × the columns ``cols`` of the chunk): the STATS partials (module docs)
    and z_t where the slab holds the target (0 elsewhere)."""
    col_in = cols < width
    if HAS_BIAS:
        l += tl.load(bias_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    z = scaled_logits(l, logit_scale, softcap, softcap_scale, HAS_SOFTCAP)
    z_in = tl.where(col_in[None, :], z, float("-inf"))
    m = tl.max(z_in, axis=1)
    # a row that is −inf throughout keeps shift 0, so exp never sees −inf − −inf
    shift = tl.where(m == float("-inf"), 0.0, m)
    e = fast_exp(z_in - shift[:, None])                    # 0 past the chunk's edge
    s = tl.sum(e, axis=1)
    ent = tl.zeros_like(s)
    sq = tl.zeros_like(s)
    z_sum = tl.zeros_like(s)
    before = tl.full(s.shape, float("-inf"), tl.float32)
    if HAS_ENTROPY:
        ent = tl.sum(e * tl.where(col_in[None, :], z - shift[:, None], 0.0), axis=1)
    if HAS_EXTRAS:
        sq = tl.sum(e * e, axis=1)
        z_sum = tl.sum(tl.where(col_in[None, :], z, 0.0), axis=1)
        before = tl.max(tl.where(col_in[None, :] & (col0 + cols[None, :] < t[:, None]), z, float("-inf")), axis=1)
    # z_t from the same z as the maximum: is_top1 compares bit-identical values
    z_t = tl.sum(tl.where(cols[None, :] == t_local[:, None], z, 0.0), axis=1)
    return m, s, ent, sq, z_sum, before, z_t


@triton.jit
def _grad_slab(l, cols, rows, row_in, width, bias_ptr, t, t_local, ignore_index, lse, g_lp, g_ent, ent, grad_ptr,
               grad_row_stride, logit_scale, softcap, softcap_scale, HAS_BIAS: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_LOGPROB_GRAD: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr):
    """dl of a slab of l (rows × the columns ``cols`` of the chunk), stored in the gradient's dtype."""
    col_in = cols < width
    if HAS_BIAS:
        l += tl.load(bias_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    z, slope = scaled_with_slope(l, logit_scale, softcap, softcap_scale, HAS_SOFTCAP)
    log_p = z - lse[:, None]
    p = fast_exp(log_p)
    dz = tl.zeros(l.shape, tl.float32)
    if HAS_LOGPROB_GRAD:
        dz = g_lp[:, None] * (tl.where(cols[None, :] == t_local[:, None], 1.0, 0.0) - p)
    if HAS_ENTROPY_GRAD:
        dz -= g_ent[:, None] * p * (log_p + ent[:, None])
    # ignored rows pass no gradient (their lse is 0: p may overflow there, and is not used)
    dl = tl.where((t != ignore_index)[:, None], dz * slope, 0.0)
    out = grad_ptr + rows.to(tl.int64)[:, None] * grad_row_stride + cols[None, :]
    tl.store(out, dl.to(grad_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


@triton.jit
def logprobs_tiles_combine_kernel(
    part_ptr, num_tiles,                    # (k, P, N) fp32 partials of one chunk
    z_t_ptr,                                # (N,) fp32 z of the target (NaN where no chunk held it)
    target_ptr, target_stride,              # (N,) class indices
    state_in_ptr, state_out_ptr,            # (6, N) fp32 running state   [not IS_FIRST / not IS_LAST]
    logprob_ptr, lse_ptr,                   # (N,) fp32 out   [IS_LAST]
    entropy_ptr,                            # (N,) fp32 out   [IS_LAST and HAS_ENTROPY]
    log_sum_sq_ptr, mean_ptr, top1_ptr,     # (N,) fp32, fp32, uint8 out   [IS_LAST and HAS_EXTRAS]
    num_rows, vocab, ignore_index,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, IS_FIRST: tl.constexpr, IS_LAST: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, HAS_EXTRAS: tl.constexpr,
):
    """Fold a chunk's tile partials into each row's state (module docs); the last chunk writes outputs."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_in = rows < num_rows
    if IS_FIRST:
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_R], tl.float32)
        ent = tl.zeros([BLOCK_R], tl.float32)
        sq = tl.zeros([BLOCK_R], tl.float32)
        z_sum = tl.zeros([BLOCK_R], tl.float32)
        before = tl.full([BLOCK_R], float("-inf"), tl.float32)
    else:
        m = tl.load(state_in_ptr + PART_M * num_rows + rows, mask=row_in, other=float("-inf"))
        s = tl.load(state_in_ptr + PART_S * num_rows + rows, mask=row_in, other=0.0)
        ent = tl.load(state_in_ptr + PART_ENT * num_rows + rows, mask=row_in, other=0.0)
        sq = tl.load(state_in_ptr + PART_SQ * num_rows + rows, mask=row_in, other=0.0)
        z_sum = tl.load(state_in_ptr + PART_SUM * num_rows + rows, mask=row_in, other=0.0)
        before = tl.load(state_in_ptr + PART_BEFORE * num_rows + rows, mask=row_in, other=float("-inf"))
    plane = (tl.zeros((), tl.int64) + num_tiles) * num_rows  # (an int 1 arrives as a constexpr)
    for p0 in range(0, num_tiles, BLOCK_P):
        tiles = p0 + tl.arange(0, BLOCK_P)
        mask = (tiles < num_tiles)[:, None] & row_in[None, :]
        part = part_ptr + tiles.to(tl.int64)[:, None] * num_rows + rows[None, :]     # (BLOCK_P, BLOCK_R)
        m_i = tl.load(part + PART_M * plane, mask=mask, other=float("-inf"))
        s_i = tl.load(part + PART_S * plane, mask=mask, other=0.0)
        m_new = tl.maximum(m, tl.max(m_i, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        moved = tl.where(m == float("-inf"), 0.0, m - shift)             # ≤ 0; 0 while s = 0
        moved_i = tl.where(m_i == float("-inf"), 0.0, m_i - shift[None, :])
        r = fast_exp(moved)
        r_i = tl.where(m_i == float("-inf"), 0.0, fast_exp(moved_i))
        if HAS_ENTROPY:
            ent_i = tl.load(part + PART_ENT * plane, mask=mask, other=0.0)
            ent = r * (ent + moved * s) + tl.sum(r_i * (ent_i + moved_i * s_i), axis=0)
        if HAS_EXTRAS:
            sq = sq * r * r + tl.sum(r_i * r_i * tl.load(part + PART_SQ * plane, mask=mask, other=0.0), axis=0)
            z_sum += tl.sum(tl.load(part + PART_SUM * plane, mask=mask, other=0.0), axis=0)
            before = tl.maximum(
                before, tl.max(tl.load(part + PART_BEFORE * plane, mask=mask, other=float("-inf")), axis=0)
            )
        s = s * r + tl.sum(r_i * s_i, axis=0)
        m = m_new
    if IS_LAST:
        t = tl.load(target_ptr + rows.to(tl.int64) * target_stride, mask=row_in, other=ignore_index)
        valid = t != ignore_index
        z_t = tl.load(z_t_ptr + rows, mask=row_in, other=0.0)  # NaN for a target outside [0, V)
        s = tl.where(row_in, s, 1.0)  # (rows past the end: nothing to take the log of; not stored)
        sq = tl.where(row_in, sq, 1.0)
        log_s = tl.log(s)
        lse = tl.where(m == float("-inf"), 0.0, m) + log_s
        lse = tl.where(z_t == z_t, lse, float("nan"))
        tl.store(logprob_ptr + rows, tl.where(valid, z_t - lse, 0.0), mask=row_in)
        tl.store(lse_ptr + rows, tl.where(valid, lse, 0.0), mask=row_in)
        if HAS_ENTROPY:
            # (+ lse − lse: NaN with the row's lse, 0 otherwise)
            tl.store(entropy_ptr + rows, tl.where(valid, log_s - ent / s + (lse - lse), 0.0), mask=row_in)
        if HAS_EXTRAS:
            tl.store(log_sum_sq_ptr + rows, tl.where(valid, tl.log(sq) - 2.0 * log_s, 0.0), mask=row_in)
            tl.store(mean_ptr + rows, tl.where(valid, z_sum / vocab, 0.0), mask=row_in)
            top1 = valid & (z_t >= m) & (z_t > before)
            tl.store(top1_ptr + rows, top1.to(tl.uint8), mask=row_in)
    else:
        tl.store(state_out_ptr + PART_M * num_rows + rows, m, mask=row_in)
        tl.store(state_out_ptr + PART_S * num_rows + rows, s, mask=row_in)
        tl.store(state_out_ptr + PART_ENT * num_rows + rows, ent, mask=row_in)
        tl.store(state_out_ptr + PART_SQ * num_rows + rows, sq, mask=row_in)
        tl.store(state_out_ptr + PART_SUM * num_rows + rows, z_sum, mask=row_in)
        tl.store(state_out_ptr + PART_BEFORE * num_rows + rows, before, mask=row_in)


# ------------------------------------------------------------------------------------------ launchers


def tma_operands(a: torch.Tensor, b: torch.Tensor, wanted: bool | None) -> bool:
    """Whether a tile kernel fed by host-made TMA descriptors can take these two operands: ``wanted`` None
    decides by the device (a GPU with TMA, sm_90 or newer; eager mode: Inductor does not take host-made
    descriptors), True asks for it wherever the operands allow (the interpreter included), False never.
    The operands: plain bf16 or fp16 tensors of one dtype (module docs), unit stride along their last dim,
    rows and addresses 16-byte aligned (TMA's rule)."""
    if wanted is False or TensorDescriptor is None or tracing_active():
        return False
    if type(a) not in PLAIN_TENSORS or type(b) not in PLAIN_TENSORS:  # a DTensor, a subclass: no address
        return False
    if wanted is None and not (a.is_cuda and torch.cuda.get_device_capability(a.device)[0] >= 9):
        return False
    if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype:
        return False
    return tma_rows(a) and tma_rows(b)


def tma_rows(t: torch.Tensor) -> bool:
    """TMA's rule for a 2-D tensor it reads or writes: unit stride along the last dim, rows and address
    16-byte aligned."""
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def tiles_available(x: torch.Tensor, w: torch.Tensor, wanted: bool | None) -> bool:
    """Whether the tile kernel can run this head (:func:`tma_operands`), its rows of H 16-byte aligned too."""
    return tma_operands(x, w, wanted) and (x.shape[-1] * x.element_size()) % 16 == 0


def tile_programs(device: torch.device) -> int:
    """The persistent loop's stride: one program per multiprocessor on a GPU (each loops over tiles), a
    handful under the interpreter. A constexpr of the kernel, fixed per device: a problem of fewer tiles
    launches one program a tile, each running one iteration of the same compiled loop (no compilation
    per small size)."""
    return INTERPRETER_PROGRAMS if device.type != "cuda" else persistent_programs(device, 1)


def _launch_tiles(mode, x, w_c, b_c, target, col0, transform, tiling, *, part=None, z_t=None, lse=None,
                  entropy=None, grad_lp=None, grad_ent=None, grad=None, has_entropy=False, has_extras=False):
    ignore_index, logit_scale, softcap, softcap_scale = transform
    bm, bn, bk, group, stages, warps, specialize, split = tiling
    num_rows, width = x.shape[0], w_c.shape[0]
    tiles = cdiv(num_rows, bm) * cdiv(width, bn)
    if tiles == 0:
        return
    programs = tile_programs(x.device)
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w_c, [bn, bk])
    any_ptr = part if part is not None else grad
    wrap_triton(logprobs_tiles_kernel)[(min(programs, tiles),)](
        x_desc, w_desc,
        b_c if b_c is not None else any_ptr,
        target, target.stride(0),
        part if part is not None else any_ptr, z_t if z_t is not None else any_ptr,
        lse if lse is not None else any_ptr, entropy if entropy is not None else any_ptr,
        *((grad_lp, grad_lp.stride(0)) if grad_lp is not None else (any_ptr, 0)),
        *((grad_ent, grad_ent.stride(0)) if grad_ent is not None else (any_ptr, 0)),
        *((grad, grad.stride(0)) if grad is not None else (any_ptr, 0)),
        num_rows, width, x.shape[1], col0, ignore_index, logit_scale, 0.0 if softcap is None else softcap,
        softcap_scale,
        MODE=mode, BM=bm, BN=bn, BK=bk, GROUP=group, NUM_PROGRAMS=programs, STAGES=stages,
        WARP_SPECIALIZE=specialize and x.is_cuda, HAS_BIAS=b_c is not None, HAS_SOFTCAP=softcap is not None,
        HAS_ENTROPY=has_entropy, HAS_EXTRAS=has_extras, HAS_LOGPROB_GRAD=grad_lp is not None,
        HAS_ENTROPY_GRAD=grad_ent is not None, SPLIT=split, num_warps=warps,
    )


def _tiles_stats_impl(
    x: torch.Tensor,
    w_c: torch.Tensor,
    b_c: torch.Tensor | None,
    target: torch.Tensor,
    z_t: torch.Tensor,
    col0: int,
    ignore_index: int,
    logit_scale: float,
    softcap: float | None,
    softcap_scale: float,
    entropy: bool,
    extras: bool,
    block_m: int,
    block_n: int,
    block_k: int,
    group: int,
    stages: int,
    num_warps: int,
    warp_specialize: bool,
    epilogue_split: int,
) -> torch.Tensor:
    """The chunk's partials (k, P, N); z_t written where the chunk holds the target."""
    num_rows, width = x.shape[0], w_c.shape[0]
    part = torch.empty((part_rows(entropy, extras), cdiv(width, block_n), num_rows), dtype=torch.float32,
                       device=x.device)
    _launch_tiles(STATS.value, x, w_c, b_c, target, col0, (ignore_index, logit_scale, softcap, softcap_scale),
                  (block_m, block_n, block_k, group, stages, num_warps, warp_specialize, epilogue_split),
                  part=part, z_t=z_t, has_entropy=entropy, has_extras=extras)
    return part


def _tiles_grad_impl(
    x: torch.Tensor,
    w_c: torch.Tensor,
    b_c: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    grad: torch.Tensor,
    col0: int,
    ignore_index: int,
    logit_scale: float,
    softcap: float | None,
    softcap_scale: float,
    block_m: int,
    block_n: int,
    block_k: int,
    group: int,
    stages: int,
    num_warps: int,
    warp_specialize: bool,
    epilogue_split: int,
) -> None:
    """dl of the chunk into ``grad`` (N, Vc)."""
    _launch_tiles(GRAD.value, x, w_c, b_c, target, col0, (ignore_index, logit_scale, softcap, softcap_scale),
                  (block_m, block_n, block_k, group, stages, num_warps, warp_specialize, epilogue_split),
                  lse=lse, entropy=entropy, grad_lp=grad_logprobs, grad_ent=grad_entropy, grad=grad)


COMBINE_BLOCK_R = 128
COMBINE_BLOCK_P = 16


def _tiles_combine_impl(
    part: torch.Tensor,
    z_t: torch.Tensor,
    target: torch.Tensor,
    state: torch.Tensor,
    vocab: int,
    is_first: bool,
    is_last: bool,
    ignore_index: int,
    entropy: bool,
    extras: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(state after the chunk, logprobs, lse, entropy, log_sum_sq_probs, mean_logits, is_top1), as the
    row kernel's CHUNK_STATS returns them."""
    num_rows = z_t.shape[0]
    device = z_t.device

    def out(shape, wanted, dtype=torch.float32):
        return torch.empty(shape if wanted else (0,), dtype=dtype, device=device)

    state_out = out((STATE_ROWS, num_rows), not is_last)
    logprobs, lse = out((num_rows,), is_last), out((num_rows,), is_last)
    ent = out((num_rows,), is_last and entropy)
    log_sum_sq, mean = out((num_rows,), is_last and extras), out((num_rows,), is_last and extras)
    top1 = out((num_rows,), is_last and extras, torch.uint8)
    if num_rows == 0:
        return state_out, logprobs, lse, ent, log_sum_sq, mean, top1
    placeholder = logprobs if is_last else state_out
    wrap_triton(logprobs_tiles_combine_kernel)[(cdiv(num_rows, COMBINE_BLOCK_R),)](
        part, part.shape[1], z_t, target, target.stride(0),
        state if not is_first else placeholder, state_out if not is_last else placeholder,
        logprobs if is_last else placeholder, lse if is_last else placeholder,
        ent if is_last and entropy else placeholder,
        log_sum_sq if is_last and extras else placeholder,
        mean if is_last and extras else placeholder,
        top1 if is_last and extras else placeholder,
        num_rows, vocab, ignore_index,
        BLOCK_R=COMBINE_BLOCK_R, BLOCK_P=COMBINE_BLOCK_P, IS_FIRST=is_first, IS_LAST=is_last,
        HAS_ENTROPY=entropy, HAS_EXTRAS=extras, num_warps=4,
    )
    return state_out, logprobs, lse, ent, log_sum_sq, mean, top1


# ------------------------------------------------------------------------------------------ torch ops

TILES_STATS = TigonOp("fused_linear_logprobs_tiles_stats", _tiles_stats_impl, mutates_args={"z_t"})
TILES_GRAD = TigonOp("fused_linear_logprobs_tiles_grad_", _tiles_grad_impl, mutates_args={"grad"})
TILES_COMBINE = TigonOp("fused_linear_logprobs_tiles_combine", _tiles_combine_impl)
