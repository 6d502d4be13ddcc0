r"""RMSNorm and fused residual-add + RMSNorm, forward and backward in Triton.

Forward, per row :math:`x \in \mathbb{R}^N` (``N = hidden``)::

    rstd  = 1 / sqrt(mean(x²) + eps)                 one fp32 scalar per row, saved
    x̂     = x · rstd
    y     = r(x̂) · (offset + w)        casting="llama"   (r = round to x.dtype, as transformers'
                                                          LlamaRMSNorm does before the multiply)
    y     = r(x̂ · (offset + w))        casting="gemma"   (everything fp32, one rounding at the end)

``add_rms_norm`` first forms ``s = r(x + residual)`` (the decoder's residual stream, returned; in
torch's promotion of the two dtypes, so a bf16 sublayer output joins an fp32 stream in fp32) and
normalises ``s`` in the same pass.

Backward. With ``g = dy · (offset + w)`` (``dy`` when there is no weight), and rounding treated as the
identity (as autograd does for ``.to(dtype)``)::

    ∂x̂/∂x   = rstd · (I − x̂ x̂ᵀ / N)
    dx      = rstd · (g − x̂ · c),        c = mean(g · x̂)             one row reduction
    dw      = Σ_rows dy · r(x̂)   (llama)     Σ_rows dy · x̂   (gemma)
    ds      = dx + d(s-output)            add_rms_norm: the residual stream's own gradient joins here,
                                          and dx = dresidual = ds

Only ``x`` (or ``s``) and ``rstd`` are saved; ``x̂`` is recomputed. ``dw`` is reduced without
atomics: the persistent backward grid cuts the rows into fixed bands, each band accumulates its own
fp32 partial row (always in the same order), and the partials are summed in a fixed order, so the
same input gives bitwise the same gradient on every run.

Long rows (hidden > ``BWD_TUNING.max_fused_hidden``, 8192) do not fit one program's registers, and
c needs the whole row before any of dx. Two ways, both in :func:`rms_norm_bwd_kernel`:

- **Split rows** (up to ``split_max_hidden``, 65536): each row is cut into 8192-wide slices, one
  program a slice, each holding its slice in registers as the fused regime holds a whole row. The
  programs of a row swap their partial sums of g·x̂ through a small global buffer as they reach
  each row (:func:`exchange_row_sums`) and add them in the same order, so every element is read
  from HBM once. The forward does the same for Σx² past 32768 (``FWD_TUNING``). On the H100 this
  took the backward at 16384 / 32768 / 65536 from 0.200 / 0.222 / 0.263 ms (streamed) to 0.164 /
  0.168 / 0.190 (scripts/tune_norm.py split).
- **Streamed** (longer rows): groups of rows are read twice in column chunks, c first, then dx and
  the group's dw, the second read meant to come from L2. What decides the speed is what stays in L2
  between the two reads: the rows of every band in flight and every band's partial row; the
  ``stream_*`` knobs size the groups, the bands and the split of a band's columns between programs.

Bytes (speed of light), M rows, element size b::

    forward   read x (and residual) M·N·b, w N·b; write y (and s) M·N·b, rstd 4M
    backward  read dy, x M·N·b each (and d(s-output)), w, rstd; write dx M·N·b, dw N·b

Reference: :func:`rms_norm_reference` (transformers' ``LlamaRMSNorm`` / ``GemmaRMSNorm``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tigon.ops._common import (
    FLOAT_DTYPES,
    TigonOp,
    as_fp32,
    as_rows,
    cache_by_size,
    cdiv,
    check_tensor,
    interpreter_active,
    next_power_of_2,
    persistent_programs,
    tracing_active,
    wrap_triton,
)

CASTINGS = ("llama", "gemma")


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _load_row_tile(
    x_ptr, x_row_stride, x_col_stride, res_ptr, res_row_stride, res_col_stride, sum_ptr,
    rows, cols, mask, hidden,
    HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr,
):
    """Load a [BLOCK_M, BLOCK_N] tile of the rows being normalised, upcast to fp32 at once.

    With a residual the row is s = r(x + residual), rounded to s's dtype (torch's promotion of the
    two) exactly as the eager ``x + residual`` is, so that the norm sees the values the reference sees.
    """
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(
            res_ptr + rows[:, None] * res_row_stride + cols[None, :] * res_col_stride, mask=mask, other=0.0
        ).to(tl.float32)
        s = (x + res).to(sum_ptr.dtype.element_ty)
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
    sum_ptr,                                    # (M, N) out, contiguous: r(x + res)   [HAS_RESIDUAL; else x]
    weight_ptr,                                 # (N,) scale; the kernel uses offset + w [HAS_WEIGHT]
    y_ptr,                                      # (M, N) out, contiguous
    rstd_ptr,                                   # (M,) out, fp32
    scratch_ptr,                                # (M, split) int64, zeroed           [split > 1]
    num_rows, hidden, eps, offset,
    split, max_polls,                           # program p: rows p // split, slice p % split
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr, PARTS_BLOCK: tl.constexpr,
    RECOMPUTE_LATE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, LLAMA_CASTING: tl.constexpr,
):
    """One program normalises BLOCK_M rows.

    SINGLE_PASS: the whole row fits one BLOCK_N tile and stays in registers between the reduction
    and the scaling (x read once). With split > 1 (split rows, PARTS_BLOCK = the next power of two)
    ``split`` consecutive programs each hold one BLOCK_N-wide slice of the row and swap their
    partial Σx² (exchange_row_sums; the grid is not persistent here, but programs start in id order,
    so a program's partners are running or next to start). Otherwise the row is streamed in BLOCK_N
    chunks twice; the second read comes from L2, where the row was left by the first.
    """
    eps, offset = as_fp32(eps), as_fp32(offset)
    IO_DTYPE: tl.constexpr = sum_ptr.dtype.element_ty  # the normalised row's dtype: s's, or x's
    pid = tl.program_id(0)
    part = pid % split
    rows = (pid // split).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    if SINGLE_PASS:
        cols = part * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < hidden)[None, :]
        x = _load_row_tile(
            x_ptr, x_row_stride, x_col_stride, res_ptr, res_row_stride, res_col_stride, sum_ptr,
            rows, cols, mask, hidden, HAS_RESIDUAL, True,
        )
        sum_sq = tl.sum(x * x, axis=1)
        if PARTS_BLOCK > 1:
            sums, _sums, there = exchange_row_sums(
                sum_sq, sum_sq, rows, row_mask, part, split, scratch_ptr, scratch_ptr, max_polls, PARTS_BLOCK, False
            )
            if RECOMPUTE_LATE and tl.min(there.to(tl.int32)) == 0:  # interpreter: partners later
                for k in range(0, split):
                    lacking = row_mask & lacking_part(there, k, PARTS_BLOCK)
                    if tl.max(lacking.to(tl.int32)) > 0:
                        k_cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
                        k_x = _load_row_tile(
                            x_ptr, x_row_stride, x_col_stride, res_ptr, res_row_stride, res_col_stride, sum_ptr,
                            rows, k_cols, row_mask[:, None] & (k_cols < hidden)[None, :], hidden, HAS_RESIDUAL,
                            False,
                        )
                        redo = tl.sum(k_x * k_x, axis=1)
                        publish_part_sums(redo, redo, rows, lacking, k, split, scratch_ptr, scratch_ptr, False)
                tl.debug_barrier()  # this program's slot writes before its threads read them back
                sums, _sums, there = read_row_sums(rows, row_mask, split, scratch_ptr, scratch_ptr, PARTS_BLOCK, False)
            sum_sq = add_parts(sums, split, PARTS_BLOCK)  # in part order, whichever way each arrived
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


# Shared with layer_norm.py's backward: tile loads, x̂ and g, the partial-row update, the chunk split.


@triton.jit
def load_rows(ptr, row_stride, col_stride, rows, cols, mask, POLICY: tl.constexpr):
    """A [BLOCK_M, BLOCK_N] tile of a strided (M, N) tensor, in its own dtype (0 outside the mask).

    POLICY is the L2 eviction hint of the load: "" (normal), or "evict_first" for data read for the
    last time, so that it leaves L2 before what is still to be read again.
    """
    return tl.load(
        ptr + rows[:, None] * row_stride + cols[None, :] * col_stride, mask=mask, other=0.0, eviction_policy=POLICY
    )


@triton.jit
def load_grad_rows(
    dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, x_col_stride, rows, cols, mask,
    POLICY: tl.constexpr,
):
    """The dy and x tiles of the same rows and columns, in the io dtype (the backward's two reads)."""
    dy = load_rows(dy_ptr, dy_row_stride, dy_col_stride, rows, cols, mask, POLICY)
    x = load_rows(x_ptr, x_row_stride, x_col_stride, rows, cols, mask, POLICY)
    return dy, x


@triton.jit
def grad_tile(
    dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, x_col_stride, weight_ptr,
    rows, cols, mask, mean, rstd, hidden, offset,
    HAS_WEIGHT: tl.constexpr, CENTERED: tl.constexpr, POLICY: tl.constexpr,
):
    """Load one tile of dy and x (fp32) and form x̂ and g = dy·(offset + w).

    x̂ = (x − mean)·rstd with CENTERED (LayerNorm), x·rstd without (RMSNorm; ``mean`` unused). Padding
    lanes load dy = 0, so g = 0 there and they add nothing to any row or column sum, whatever their x̂.
    """
    dy, x = load_grad_rows(
        dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, x_col_stride, rows, cols, mask, POLICY
    )
    dy = dy.to(tl.float32)
    x = x.to(tl.float32)
    if CENTERED:
        x = x - mean[:, None]
    x_hat = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32) + offset
        g = dy * w[None, :]
    else:
        g = dy
    return dy, x_hat, g


@triton.jit
def accumulate_partial(partial_row_ptr, cols, hidden, column_sum, accumulate):
    """partial[cols] += column_sum in a band's own fp32 partial row; where ``accumulate`` is false
    (the band's first group of rows) it stores without reading, so nobody need zero the buffer."""
    # The read's bound is hidden or 0 (a product keeps hidden's divisibility, so the load stays
    # vectorised; `mask & scalar` would also do, but the interpreter mis-types it).
    read_end = hidden * accumulate.to(tl.int32)
    old = tl.load(partial_row_ptr + cols, mask=cols < read_end, other=0.0)
    tl.store(partial_row_ptr + cols, old + column_sum, mask=cols < hidden)


@triton.jit
def part_chunks(hidden, part, split, BLOCK_N: tl.constexpr):
    """(number of BLOCK_N chunks of a row, first chunk of this part, its chunk count): the row's
    chunks cut into ``split`` consecutive runs; a part may get none when split > chunks."""
    num_chunks = tl.cdiv(hidden, BLOCK_N)
    per_part = tl.cdiv(num_chunks, split)
    first = part * per_part
    return num_chunks, first, tl.maximum(tl.minimum(num_chunks - first, per_part), 0)


@triton.jit
def _tagged(value):
    """An fp32 value in the high half of a 64-bit word whose lowest bit is set: a program reading the
    word whole sees either 0 (not yet written) or the value, so no fence orders value and flag."""
    return (value.to(tl.int32, bitcast=True).to(tl.int64) << 32) | 1


@triton.jit
def _untagged(word):
    return (word >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def read_row_sums(rows, row_mask, parts, scratch_ptr, scratch2_ptr, PARTS_BLOCK: tl.constexpr, PAIRED: tl.constexpr):
    """Every part's slot of BLOCK_M rows: the [BLOCK_M, PARTS_BLOCK] sums (0 where missing and in
    slots past ``parts``), the second sums with PAIRED (else the first again), and which are there."""
    slots = tl.arange(0, PARTS_BLOCK)
    offsets = rows[:, None] * parts + slots[None, :]
    live = row_mask[:, None] & (slots < parts)[None, :]
    words = tl.load(scratch_ptr + offsets, mask=live, other=1, volatile=True)
    words2 = words
    if PAIRED:
        words2 = tl.load(scratch2_ptr + offsets, mask=live, other=1, volatile=True)
    return _untagged(words), _untagged(words2), (words & words2 & 1) != 0


@triton.jit
def exchange_row_sums(
    own, own2, rows, row_mask, part, parts, scratch_ptr, scratch2_ptr, max_polls,
    PARTS_BLOCK: tl.constexpr, PAIRED: tl.constexpr,
):
    """Split rows: the programs that hold parts of the same rows swap their partial row sums.

    Publishes this part's partial sums of BLOCK_M rows (``own``, and ``own2`` with PAIRED) in
    ``scratch[row, part]`` (an int64 buffer zeroed before the launch, one slot per row and part), then
    reads every part's slot, polling up to ``max_polls`` more times while one is still 0. Returns
    :func:`read_row_sums`'s three; the caller adds the parts up with :func:`add_parts`, in part
    order, so every program of a band gets bitwise the same row sums.

    On a GPU ``max_polls`` is 2**31 − 1: a program waits for its partners. They are the programs
    next to it in the grid (consecutive program ids, a band of rows each), the grid is at most one
    program per multiprocessor, and programs start in id order, so the partners run at the same
    time; if other kernels hold some multiprocessors, the bands wholly started finish and free
    theirs, so a band started in part always gets its remaining programs (the forward-progress
    argument of CUB's decoupled look-back, for a band instead of a predecessor). Under Triton's
    interpreter programs run one after another and a partner later in the grid cannot have run:
    the kernel polls twice and, with RECOMPUTE_LATE, computes the missing sums from the inputs
    (:func:`publish_part_sums`). A first version recomputed them on the GPU too after a bounded
    wait; its recomputed sums came out wrong there (NaN rows, cause not found), so the GPU waits.
    """
    own_slot = rows * parts + part
    tl.atomic_xchg(scratch_ptr + own_slot, _tagged(own), mask=row_mask, sem="relaxed")
    if PAIRED:
        tl.atomic_xchg(scratch2_ptr + own_slot, _tagged(own2), mask=row_mask, sem="relaxed")
    sums, sums2, there = read_row_sums(rows, row_mask, parts, scratch_ptr, scratch2_ptr, PARTS_BLOCK, PAIRED)
    polls = 0
    while (tl.min(there.to(tl.int32)) == 0) & (polls < max_polls):
        sums, sums2, there = read_row_sums(rows, row_mask, parts, scratch_ptr, scratch2_ptr, PARTS_BLOCK, PAIRED)
        polls += 1
    return sums, sums2, there


@triton.jit
def lacking_part(there, k, PARTS_BLOCK: tl.constexpr):
    """[BLOCK_M]: which rows still lack part k's sums."""
    pick = (tl.arange(0, PARTS_BLOCK) == k)[None, :]
    return tl.sum(tl.where(pick & (there == 0), 1, 0), axis=1) > 0


@triton.jit
def publish_part_sums(value, value2, rows, lacking, k, parts, scratch_ptr, scratch2_ptr, PAIRED: tl.constexpr):
    """A partner's sums, recomputed from the inputs, published in its slots for the rows that lack
    them: under the interpreter only (see exchange_row_sums), where the partner has not run yet."""
    slot = rows * parts + k
    tl.atomic_xchg(scratch_ptr + slot, _tagged(value), mask=lacking, sem="relaxed")
    if PAIRED:
        tl.atomic_xchg(scratch2_ptr + slot, _tagged(value2), mask=lacking, sem="relaxed")


@triton.jit
def add_parts(sums, parts, PARTS_BLOCK: tl.constexpr):
    """Σ over the parts of the [BLOCK_M, PARTS_BLOCK] sums, added in part order (exact picks)."""
    total = tl.zeros([sums.shape[0]], dtype=tl.float32)
    for k in range(0, parts):
        total += tl.sum(tl.where((tl.arange(0, PARTS_BLOCK) == k)[None, :], sums, 0.0), axis=1)
    return total


@triton.jit
def _dx_store(
    g, x_hat, c, rstd, dsum_ptr, dsum_row_stride, dsum_col_stride, dx_ptr, dx2_ptr, rows, cols, mask, hidden, eps,
    HAS_DSUM: tl.constexpr, HAS_DX2: tl.constexpr, POLICY: tl.constexpr,
):
    """dx = rstd·(g − x̂·c), plus the residual stream's own gradient for add_rms_norm; with HAS_DX2 also
    stored rounded to dx2's (narrower) dtype: the gradient of an add_rms_norm input held in it.

    At hidden == 1, g − x̂·c = g·(1 − x̂²) cancels to nothing in fp32 (x̂² = 1 − eps·rstd²), so that
    case uses the exact form g·eps·rstd² instead.
    """
    if hidden == 1:
        dx = g * (eps * rstd * rstd * rstd)[:, None]
    else:
        dx = (g - x_hat * c[:, None]) * rstd[:, None]
    if HAS_DSUM:
        dx += load_rows(dsum_ptr, dsum_row_stride, dsum_col_stride, rows, cols, mask, POLICY).to(tl.float32)
    tl.store(
        dx_ptr + rows[:, None] * hidden + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask,
        eviction_policy=POLICY,
    )
    if HAS_DX2:
        tl.store(
            dx2_ptr + rows[:, None] * hidden + cols[None, :], dx.to(dx2_ptr.dtype.element_ty), mask=mask,
            eviction_policy=POLICY,
        )


@triton.jit
def _rms_slice_sum(
    dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, x_col_stride, weight_ptr,
    rows, row_mask, cols, rstd, hidden, offset, HAS_WEIGHT: tl.constexpr,
):
    """Σ g·x̂ over one slice of BLOCK_M rows, from the inputs: what the slice's own program publishes,
    for the interpreter, where that program runs later (see exchange_row_sums)."""
    mask = row_mask[:, None] & (cols < hidden)[None, :]
    _dy, x_hat, g = grad_tile(
        dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, x_col_stride, weight_ptr,
        rows, cols, mask, rstd, rstd, hidden, offset, HAS_WEIGHT, False, "",
    )
    return tl.sum(g * x_hat, axis=1)


@triton.jit
def rms_norm_bwd_kernel(
    dy_ptr, dy_row_stride, dy_col_stride,           # (M, N) gradient of y, any strides (stride 0 too)
    x_ptr, x_row_stride, x_col_stride,              # (M, N) the normalised input (x, or s = x + res)
    weight_ptr,                                     # (N,)                              [HAS_WEIGHT]
    rstd_ptr,                                       # (M,) fp32, saved by the forward
    dsum_ptr, dsum_row_stride, dsum_col_stride,     # (M, N) gradient of the s output   [HAS_DSUM]
    dx_ptr,                                         # (M, N) out, contiguous
    dx2_ptr,                                        # (M, N) out, contiguous: dx narrowed   [HAS_DX2]
    dw_partial_ptr,                                 # (bands, N) out, fp32: each band's Σ dy·r(x̂)
    scratch_ptr,                                    # (M, split) int64, zeroed     [SINGLE_PASS, split > 1]
    num_rows, hidden, eps, offset,
    rows_per_band, split,                           # program p: band p // split, part p % split
    max_polls,                                      # split rows: see exchange_row_sums
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr, PARTS_BLOCK: tl.constexpr,
    RECOMPUTE_LATE: tl.constexpr,
    STAGES: tl.constexpr, EVICT_FIRST: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_DSUM: tl.constexpr, HAS_DX2: tl.constexpr, LLAMA_CASTING: tl.constexpr,
):
    """Persistent: band b owns rows [b·rows_per_band, (b+1)·rows_per_band) and one fp32 partial row.

    SINGLE_PASS: the row tile is held in registers, and the band's dw partial in registers across
    all its rows, stored once at the end. With split > 1 (split rows; PARTS_BLOCK = the next power
    of two), each of a band's ``split`` programs holds its own BLOCK_N-wide slice of every row: the
    row sum c is the sum of the slices' partial sums, swapped through ``scratch`` as each tile is
    reached (:func:`exchange_row_sums`), and each program writes dx and the partial dw row of its
    slice only. Every element is read from HBM once, as in the fused regime, for rows too long for
    one program's registers.

    Streamed: rows go BLOCK_M at a time as [BLOCK_M, BLOCK_N] tiles over column chunks, in two
    passes. Pass 1 reads the whole rows for c; pass 2 reads them again (from L2, where pass 1 left
    them: last chunk first, the most recently read) for dx and adds the group's Σ dy·r(x̂) to the
    partial row, one read-modify-write per chunk for BLOCK_M rows. With split > 1, several programs
    share a band: each computes c over the whole rows (the others' reads of the same rows hit L2)
    but writes dx and the partial only for its own run of chunks; that divides the L2 working set
    (rows in flight and partial rows) by split. See NormTuning for the knobs.
    """
    eps, offset = as_fp32(eps), as_fp32(offset)
    IO_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    # last-use loads and the dx stores may leave L2 first: what pass 2 still needs should stay
    LAST_USE: tl.constexpr = "evict_first" if EVICT_FIRST else ""
    pid = tl.program_id(0)
    band, part = pid // split, pid % split
    row_begin = band.to(tl.int64) * rows_per_band
    row_end = tl.minimum(row_begin + rows_per_band, num_rows)
    dw_row_ptr = dw_partial_ptr + band.to(tl.int64) * hidden
    if SINGLE_PASS:
        cols = part * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < hidden
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        # Software prefetch: the next tile's dy and x loads are issued before this tile's reductions
        # and stores, so that each program always has a tile of loads in flight (kept in the io dtype,
        # half the registers of fp32, and upcast when they become the current tile).
        rows = row_begin + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        dy_next, x_next = load_grad_rows(
            dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, x_col_stride, rows, cols, mask, ""
        )
        rstd_next = tl.load(rstd_ptr + rows, mask=rows < row_end, other=0.0)
        for row_start in range(row_begin, row_end, BLOCK_M):
            rows = row_start + tl.arange(0, BLOCK_M)
            mask = (rows < row_end)[:, None] & col_mask[None, :]
            dy = dy_next.to(tl.float32)
            rstd = rstd_next
            x_hat = x_next.to(tl.float32) * rstd[:, None]
            nxt = rows + BLOCK_M
            nxt_mask = (nxt < row_end)[:, None] & col_mask[None, :]
            dy_next, x_next = load_grad_rows(
                dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, x_col_stride, nxt, cols, nxt_mask, ""
            )
            rstd_next = tl.load(rstd_ptr + nxt, mask=nxt < row_end, other=0.0)
            if HAS_WEIGHT:
                g = dy * w[None, :]
            else:
                g = dy
            gx = tl.sum(g * x_hat, axis=1)
            if PARTS_BLOCK > 1:
                row_mask = rows < row_end
                sums, _sums, there = exchange_row_sums(
                    gx, gx, rows, row_mask, part, split, scratch_ptr, scratch_ptr, max_polls, PARTS_BLOCK, False
                )
                if RECOMPUTE_LATE and tl.min(there.to(tl.int32)) == 0:  # interpreter: partners later
                    for k in range(0, split):
                        lacking = row_mask & lacking_part(there, k, PARTS_BLOCK)
                        if tl.max(lacking.to(tl.int32)) > 0:
                            redo = _rms_slice_sum(
                                dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, x_col_stride,
                                weight_ptr, rows, row_mask, k * BLOCK_N + tl.arange(0, BLOCK_N), rstd, hidden,
                                offset, HAS_WEIGHT,
                            )
                            publish_part_sums(redo, redo, rows, lacking, k, split, scratch_ptr, scratch_ptr, False)
                    tl.debug_barrier()  # this program's slot writes before its threads read them back
                    sums, _sums, there = read_row_sums(
                        rows, row_mask, split, scratch_ptr, scratch_ptr, PARTS_BLOCK, False
                    )
                gx = add_parts(sums, split, PARTS_BLOCK)  # in part order, whichever way each arrived
            c = gx / hidden
            _dx_store(
                g, x_hat, c, rstd, dsum_ptr, dsum_row_stride, dsum_col_stride, dx_ptr, dx2_ptr, rows, cols, mask,
                hidden, eps, HAS_DSUM, HAS_DX2, "",
            )
            if HAS_WEIGHT:
                if LLAMA_CASTING:
                    x_hat = x_hat.to(IO_DTYPE).to(tl.float32)
                dw_acc += tl.sum(dy * x_hat, axis=0)
        if HAS_WEIGHT:
            tl.store(dw_row_ptr + cols, dw_acc, mask=cols < hidden)
    else:
        num_chunks, first_chunk, my_chunks = part_chunks(hidden, part, split, BLOCK_N)
        for row_start in range(row_begin, row_end, BLOCK_M):
            rows = row_start + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            # Pass 1, c = mean(g·x̂): summed lane by lane over the chunks and reduced across the tile
            # once, so that the loop body holds no cross-warp reduction to stall the pipelined loads.
            gx = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for chunk in tl.range(0, num_chunks, num_stages=STAGES):
                cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
                mask = row_mask[:, None] & (cols < hidden)[None, :]
                _dy, x_hat, g = grad_tile(
                    dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, x_col_stride, weight_ptr,
                    rows, cols, mask, rstd, rstd, hidden, offset, HAS_WEIGHT, False, "",
                )
                gx += g * x_hat
            c = tl.sum(gx, axis=1) / hidden
            # Pass 2 over this part's chunks, last first.
            for i in tl.range(0, my_chunks, num_stages=STAGES):
                cols = (first_chunk + my_chunks - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
                col_mask = cols < hidden
                mask = row_mask[:, None] & col_mask[None, :]
                dy, x_hat, g = grad_tile(
                    dy_ptr, dy_row_stride, dy_col_stride, x_ptr, x_row_stride, x_col_stride, weight_ptr,
                    rows, cols, mask, rstd, rstd, hidden, offset, HAS_WEIGHT, False, LAST_USE,
                )
                _dx_store(
                    g, x_hat, c, rstd, dsum_ptr, dsum_row_stride, dsum_col_stride, dx_ptr, dx2_ptr, rows, cols,
                    mask, hidden, eps, HAS_DSUM, HAS_DX2, LAST_USE,
                )
                if HAS_WEIGHT:
                    if LLAMA_CASTING:
                        x_hat = x_hat.to(IO_DTYPE).to(tl.float32)
                    accumulate_partial(dw_row_ptr, cols, hidden, tl.sum(dy * x_hat, axis=0), row_start > row_begin)
            # The next group reads this group's partial-row stores back, and a pipelined load may run
            # on another thread than the store (it lands in shared memory in its own layout): a
            # barrier orders them.
            tl.debug_barrier()


@triton.jit
def partial_rows_sum_kernel(
    dw_partial_ptr, db_partial_ptr,         # (bands, N) fp32 each: the bands' partial rows [HAS_WEIGHT, HAS_BIAS]
    dw_ptr, db_ptr,                         # (N,) out each, in the weight's / bias's dtype
    bands, hidden,
    BLOCK_BANDS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """dw = Σ_bands dw_partial, db = Σ_bands db_partial for BLOCK_COLS columns, rounded once.

    The last step of both norms' backward (LayerNorm's dw and db, RMSNorm's dw): both sums in one
    launch, each rounded to its parameter's dtype as it is stored (instead of a torch sum and a cast
    for each), lane by lane over blocks of bands in a fixed order and reduced once at the end: the
    same bands give bitwise the same result.
    """
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < hidden
    dw_acc = tl.zeros([BLOCK_BANDS, BLOCK_COLS], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_BANDS, BLOCK_COLS], dtype=tl.float32)
    for start in range(0, bands, BLOCK_BANDS):
        band = start + tl.arange(0, BLOCK_BANDS)
        mask = (band < bands)[:, None] & col_mask[None, :]
        offsets = band.to(tl.int64)[:, None] * hidden + cols[None, :]
        if HAS_WEIGHT:
            dw_acc += tl.load(dw_partial_ptr + offsets, mask=mask, other=0.0)
        if HAS_BIAS:
            db_acc += tl.load(db_partial_ptr + offsets, mask=mask, other=0.0)
    if HAS_WEIGHT:
        tl.store(dw_ptr + cols, tl.sum(dw_acc, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(db_ptr + cols, tl.sum(db_acc, axis=0).to(db_ptr.dtype.element_ty), mask=col_mask)


def sum_partial_rows(dw_partial, db_partial, dw, db, bands, hidden, *, block_bands=32, block_cols=32, warps=4):
    """dw (db) = the column sums of the (bands, hidden) fp32 partial rows, in dw's (db's) dtype, in one
    launch of :func:`partial_rows_sum_kernel`. None for a parameter that is not there. The default
    geometry is LayerNorm's tuned one (scripts/tune_norm.py fused-ln), which passes its own."""
    stand_in = dw if dw is not None else db
    wrap_triton(partial_rows_sum_kernel)[(cdiv(hidden, block_cols),)](
        dw_partial if dw is not None else stand_in, db_partial if db is not None else stand_in,
        stand_in if dw is None else dw, stand_in if db is None else db,
        bands, hidden,
        BLOCK_BANDS=block_bands, BLOCK_COLS=block_cols, HAS_WEIGHT=dw is not None, HAS_BIAS=db is not None,
        num_warps=warps,
    )


# -------------------------------------------------------------------------------------- launch config

@dataclass(frozen=True)
class NormTuning:
    """The knobs of one direction's launch geometry (scripts/tune_norm.py sweeps them on a GPU).

    max_fused_hidden: rows longer than this are streamed in chunks instead of held in registers.
      The backward holds about twice as many live values per element as the forward (dy, x, their
      prefetched successors, g, dw), hence its lower limit; past it a register tile would spill.
    chunk: the column width of a streamed tile (BLOCK_N).
    tile_elements: what a program's tile aims at for short rows (several rows per program, so that
      a hidden size of 96 still moves a useful amount per program).
    elements_per_warp / max_warps: warps = tile / elements_per_warp, capped.
    programs_per_sm: persistent programs per multiprocessor (fused backward; a fraction is allowed).

    The streamed backward (hidden > max_fused_hidden; see rms_norm_bwd_kernel):
    stream_rows: rows per [rows, chunk] tile (BLOCK_M, at most). The band's fp32 partial row is read
      and written once per chunk per group of rows, so its traffic is 8·N/stream_rows bytes a row.
    stream_split: programs sharing one band of rows (at most): each reads the whole rows for the
      row reductions but writes only its 1/split of the columns, so bands, and with them the rows in
      flight and the partial rows that must stay in L2, number programs/split.
    stream_l2_bytes: what the rows in flight and the partial rows may take of L2 together,
      bands·(rows·(dy + x row bytes) + partial row bytes). The split grows (up to stream_split)
      until one row fits, then the rows grow (up to stream_rows) while they fit. None: no budget,
      stream_rows and stream_split are used as they are.
    stream_programs_per_sm: persistent programs per multiprocessor (a fraction is allowed).
    stream_stages: software-pipelining depth of the chunk loops (tl.range num_stages; 1 = none):
      the loads of the next stages-1 chunks are in flight while one is computed.
    stream_evict_first: loads of data read for the last time (pass 2) and the dx stores carry the
      L2 evict-first hint, so that pass 1's rows and the partial rows are what L2 keeps.

    Split rows (rows longer than max_fused_hidden, up to split_max_hidden; see rms_norm_bwd_kernel
    and rms_norm_fwd_kernel): each row is cut into split_slice-wide slices, one program a slice (one
    row at a time, split_warps warps). split_programs_per_sm: the backward's persistent programs per
    multiprocessor, at most 1, since every program of the grid must be able to run at once
    (exchange_row_sums); the forward's grid has a program per slice of every row.
    """

    max_fused_hidden: int
    chunk: int
    tile_elements: int
    elements_per_warp: int
    max_warps: int
    programs_per_sm: float = 1
    stream_rows: int = 1
    stream_split: int = 1
    stream_l2_bytes: int | None = None
    stream_programs_per_sm: float = 1.0
    stream_stages: int = 1
    stream_evict_first: bool = False
    split_max_hidden: int = 0
    split_slice: int = 4096
    split_warps: int = 8
    split_programs_per_sm: float = 1.0

    def __post_init__(self):
        # block sizes are tl.arange extents
        for name in ("max_fused_hidden", "chunk", "tile_elements", "stream_rows", "split_slice"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"NormTuning.{name} must be a power of two, got {value}")
        if not 0 < self.split_programs_per_sm <= 1:
            raise ValueError(f"NormTuning.split_programs_per_sm must be in (0, 1], got {self.split_programs_per_sm}")
        if self.stream_split < 1 or self.stream_stages < 1 or not self.stream_programs_per_sm > 0:
            raise ValueError(f"NormTuning: stream_split, stream_stages >= 1 and stream_programs_per_sm > 0 ({self})")


# Forward: rows up to 32768 held in registers; longer ones split over 16384-wide programs up to
# 131072 (RMSNorm, add_rms_norm), else streamed in 8192-wide chunks (LayerNorm's forward streams past
# 32768). A 65536-wide row held whole spills (ptxas: 1.3-3.4 KB of stack a thread); streaming it took
# add_rms_norm's forward at 1024 x 65536 from 0.386 to 0.279 ms and LayerNorm's from 0.192 to 0.142
# (scripts/tune_norm.py long-fwd, benchmarks/results/tune_norm_long-*.log), and split rows took
# add_rms_norm's to 0.195 and RMSNorm's from 0.135 to 0.125 (harness, norms-*-ninth-final.md).
FWD_TUNING = NormTuning(
    max_fused_hidden=32768, chunk=8192, tile_elements=4096, elements_per_warp=512, max_warps=16,
    split_max_hidden=131072, split_slice=16384, split_warps=16,
)
# Streamed-backward knobs from scripts/tune_norm.py's stream sweep on the H100 (2026-11-22, log in
# benchmarks/results/): one setting for every shape, backward at 81/73/62% of SOL for RMSNorm at
# N = 16384/32768/65536, 87/76% for add_rms_norm and 69/56% for LayerNorm at 16384/32768 (the
# previous setting, an L2 budget of 32 MiB with pipelined loops: 62/52/34, 70/59, 38/31).
# Fused-backward geometry from scripts/tune_norm.py fused (H100, 2026-11-22, benchmarks/results/
# tune_norm_fused-*.log): 1024 elements per warp (fewer warps per row, fewer cross-warp sums) took the
# RMSNorm backward from 0.0603 to 0.0429 ms at 16384 x 896 and add_rms_norm from 0.2516 to 0.1936 at
# 65536 x 1024 (kernel times, CUDA-graph replay).
# Split rows (scripts/tune_norm.py split, H100, benchmarks/results/tune_norm_split-*.log): 8192-wide
# slices, 8 warps, one program per SM (the best geomean of the sweep), against the streamed backward:
# RMSNorm 0.200 -> 0.164 ms at 4096 x 16384, 0.222 -> 0.168 at 2048 x 32768, 0.263 -> 0.190 at 1024 x
# 65536; add_rms_norm 0.256 -> 0.216, 0.289 -> 0.221, 0.319 -> 0.234; LayerNorm 0.229 -> 0.171,
# 0.287 -> 0.189, 0.329 -> 0.246 (kernel times by CUDA-graph replay).
BWD_TUNING = NormTuning(
    max_fused_hidden=8192, chunk=4096, tile_elements=4096, elements_per_warp=1024, max_warps=16, programs_per_sm=2,
    stream_rows=4, stream_split=2, stream_l2_bytes=None, stream_programs_per_sm=1.0, stream_stages=1,
    stream_evict_first=True,
    split_max_hidden=65536, split_slice=8192, split_warps=8, split_programs_per_sm=1.0,
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


@dataclass(frozen=True)
class NormBackwardLaunch(NormLaunch):
    """The backward's persistent grid on top of the block geometry: ``bands·split`` programs, band b
    owning rows [b·rows_per_band, (b+1)·rows_per_band) and one fp32 partial row per reduced parameter."""

    bands: int
    split: int
    rows_per_band: int
    stages: int
    evict_first: bool

    @property
    def programs(self) -> int:
        return self.bands * self.split

    @property
    def parts_split(self) -> int:
        """Split rows: the programs a row is split over (1 where rows are not split)."""
        return self.split if self.single_pass else 1

    @property
    def parts_block(self) -> int:
        """Split rows (single_pass with split > 1): the power of two that holds the parts; else 1."""
        return next_power_of_2(self.split) if self.single_pass else 1


def _warps(tile: int, tuning: NormTuning) -> int:
    return max(1, min(tile // tuning.elements_per_warp, tuning.max_warps))


def norm_launch(num_rows: int, hidden: int, *, backward: bool) -> NormLaunch:
    return _norm_launch(num_rows, hidden, BWD_TUNING if backward else FWD_TUNING)


def forward_launch(num_rows: int, hidden: int) -> tuple[NormLaunch, int]:
    """RMSNorm's forward geometry and the programs a row is split over (1: not split)."""
    return _forward_launch(num_rows, hidden, FWD_TUNING)


@cache_by_size
def _forward_launch(num_rows: int, hidden: int, tuning: NormTuning) -> tuple[NormLaunch, int]:
    cfg = _norm_launch(num_rows, hidden, tuning)
    if cfg.single_pass or hidden > tuning.split_max_hidden:
        return cfg, 1
    return NormLaunch(1, tuning.split_slice, tuning.split_warps, True), cdiv(hidden, tuning.split_slice)


@cache_by_size  # keyed on the tuning too: tests and scripts/tune_norm.py swap it
def _norm_launch(num_rows: int, hidden: int, tuning: NormTuning) -> NormLaunch:
    block_n = next_power_of_2(hidden)
    if block_n > tuning.max_fused_hidden:
        return NormLaunch(1, tuning.chunk, _warps(tuning.chunk, tuning), False)
    block_m = max(1, min(tuning.tile_elements // block_n, next_power_of_2(num_rows)))
    return NormLaunch(block_m, block_n, _warps(block_m * block_n, tuning), True)


def norm_backward_launch(
    num_rows: int, hidden: int, row_bytes: int, partials: int, device: torch.device
) -> NormBackwardLaunch:
    """The backward's launch for (num_rows, hidden) rows on ``device``.

    row_bytes: bytes of one row of the tensors pass 2 reads again (dy and x); partials: how many
    fp32 partial rows each band accumulates (1 for dw; 2 for LayerNorm's dw and db).
    """
    return _norm_backward_launch(num_rows, hidden, row_bytes, partials, device, BWD_TUNING)


@cache_by_size
def _norm_backward_launch(
    num_rows: int, hidden: int, row_bytes: int, partials: int, device: torch.device, tuning: NormTuning
) -> NormBackwardLaunch:
    tile = _norm_launch(num_rows, hidden, tuning)
    block_m, split, stages = tile.block_m, 1, 1
    warps = None  # from the tile
    if not tile.single_pass and hidden <= tuning.split_max_hidden:
        # split rows: one program a slice of each row, cdiv(hidden, slice) programs a band
        tile = NormLaunch(1, tuning.split_slice, tuning.split_warps, True)
        block_m, split, warps = 1, cdiv(hidden, tile.block_n), tuning.split_warps
        target = max(split, round(persistent_programs(device, 1) * tuning.split_programs_per_sm))
    elif tile.single_pass:
        target = max(1, round(persistent_programs(device, tuning.programs_per_sm)))
    else:
        target = max(1, round(tuning.stream_programs_per_sm * persistent_programs(device, 1)))
        max_split = max(1, min(tuning.stream_split, cdiv(hidden, tuning.chunk), target))
        max_rows = max(1, min(tuning.stream_rows, next_power_of_2(num_rows)))
        partial_bytes = 4 * hidden * partials
        budget = tuning.stream_l2_bytes

        def fits(split, rows):
            return budget is None or (target // split) * (rows * row_bytes + partial_bytes) <= budget

        split = max_split if budget is None else 1
        while split < max_split and not fits(split, 1):
            split *= 2
        split = min(split, max_split)
        block_m = max_rows if budget is None else 1
        while 2 * block_m <= max_rows and fits(split, 2 * block_m):
            block_m *= 2
        stages = tuning.stream_stages
    bands = max(1, min(target // split, cdiv(num_rows, block_m)))
    rows_per_band = cdiv(cdiv(num_rows, bands), block_m) * block_m
    bands = cdiv(num_rows, rows_per_band)
    return NormBackwardLaunch(
        block_m, tile.block_n, warps or _warps(block_m * tile.block_n, tuning), tile.single_pass,
        bands=bands, split=split, rows_per_band=rows_per_band, stages=stages,
        evict_first=tuning.stream_evict_first and not tile.single_pass,
    )


# ------------------------------------------------------------------------------------------ launchers


def split_rows_scratch(split: int, num_rows: int, sums: int, device: torch.device):
    """(scratch, scratch2, max_polls, recompute_late) for a launch: where rows are split, the planes
    of an int64 buffer (sums, rows, parts), a slot per exchanged row sum, row and part, zeroed
    (exchange_row_sums reads 0 as "not yet there"; scratch2 is the second sum's plane, or the first
    again); else a stand-in made once per device, so that an unsplit launch allocates nothing.

    On a GPU programs wait for their partners (max_polls 2**31 − 1). Under Triton's interpreter the
    programs run one after another, so a program can never see a later partner's sums: it polls
    twice (the loop runs) and recomputes them (CPU tests so take both paths: the first part of each
    row recomputes, the later parts find the sums published).
    """
    if split == 1:
        # Made once per device for real calls; under torch.compile's tracing (fake tensors) a fresh
        # one, which the compiled graph allocates: a cached fake tensor would reach later real calls.
        stand_in = torch.empty(1, dtype=torch.int64, device=device) if tracing_active() else _no_scratch(device)
        return stand_in, stand_in, 0, False
    sequential = interpreter_active()
    scratch = torch.zeros((sums, num_rows, split), dtype=torch.int64, device=device)
    return scratch[0], scratch[sums - 1], (2 if sequential else 2**31 - 1), sequential


@functools.cache
def _no_scratch(device: torch.device) -> torch.Tensor:
    """The scratch argument of launches whose rows are not split (the kernels never touch it)."""
    return torch.empty(1, dtype=torch.int64, device=device)


def _output_dtype(x_dtype, weight_dtype, casting):
    """The dtype transformers' norm returns: llama casting promotes x with the weight (fp32 weights
    with bf16 x give fp32), gemma casting keeps x's."""
    return torch.promote_types(x_dtype, weight_dtype) if (casting == "llama" and weight_dtype is not None) else x_dtype


def _forward(x, residual, weight, eps, offset, casting, out_dtype=None):
    """Launch the forward on any-shaped x; returns (y, s or None, rstd) with y, s shaped like x.

    ``out_dtype`` (None: :func:`_output_dtype`) is y's dtype: the kernel rounds its fp32 result to it
    once, as a cast of the reference's output would.
    """
    hidden = x.shape[-1]
    x2 = as_rows(x)
    num_rows = x2.shape[0]
    llama = casting == "llama"
    s_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    y_dtype = out_dtype or _output_dtype(s_dtype, weight.dtype if weight is not None else None, casting)
    y = torch.empty(x.shape, dtype=y_dtype, device=x.device)
    rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    s = torch.empty(x.shape, dtype=s_dtype, device=x.device) if residual is not None else None
    if num_rows == 0 or hidden == 0:
        return y, s, rstd
    r2 = as_rows(residual) if residual is not None else x2
    cfg, split = forward_launch(num_rows, hidden)
    scratch, _, max_polls, recompute_late = split_rows_scratch(split, num_rows, 1, x.device)
    grid = (cdiv(num_rows, cfg.block_m) * split,)
    wrap_triton(rms_norm_fwd_kernel)[grid](
        x2, x2.stride(0), x2.stride(1),
        r2, r2.stride(0), r2.stride(1),
        s if s is not None else x2,  # its dtype is the kernel's io dtype
        weight if weight is not None else x2,
        y, rstd, scratch,
        num_rows, hidden, eps, offset, split, max_polls,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SINGLE_PASS=cfg.single_pass, PARTS_BLOCK=next_power_of_2(split),
        RECOMPUTE_LATE=recompute_late,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, LLAMA_CASTING=llama,
        num_warps=cfg.num_warps,
    )
    return y, s, rstd


def _backward(dy, x, weight, rstd, dsum, eps, offset, casting, narrow_dtype=None):
    """Launch the backward; returns (dx, dw, dx2): dw an empty tensor when there is no weight, dx2 dx
    rounded to ``narrow_dtype`` by the same kernel (an empty tensor when None)."""
    hidden = x.shape[-1]
    x2, dy2 = as_rows(x), as_rows(dy)
    num_rows = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx2 = torch.empty(x.shape if narrow_dtype is not None else 0, dtype=narrow_dtype or x.dtype, device=x.device)
    if weight is None:
        dw = torch.empty(0, dtype=x.dtype, device=x.device)
    if num_rows == 0 or hidden == 0:
        return dx, (torch.zeros_like(weight) if weight is not None else dw), dx2
    row_bytes = (dy.element_size() + x.element_size()) * hidden
    cfg = norm_backward_launch(num_rows, hidden, row_bytes, 1, x.device)
    # Every element of a band's partial row is written by the band's first group, so no zeroing.
    dw_partial = torch.empty((cfg.bands, hidden), dtype=torch.float32, device=x.device) if weight is not None else rstd
    scratch, _, max_polls, recompute_late = split_rows_scratch(cfg.parts_split, num_rows, 1, x.device)
    ds2 = as_rows(dsum) if dsum is not None else dy2
    wrap_triton(rms_norm_bwd_kernel)[(cfg.programs,)](
        dy2, dy2.stride(0), dy2.stride(1),
        x2, x2.stride(0), x2.stride(1),
        weight if weight is not None else x2,
        rstd,
        ds2, ds2.stride(0), ds2.stride(1),
        dx, dx2 if narrow_dtype is not None else dx, dw_partial, scratch,
        num_rows, hidden, eps, offset, cfg.rows_per_band, cfg.split, max_polls,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SINGLE_PASS=cfg.single_pass, PARTS_BLOCK=cfg.parts_block,
        RECOMPUTE_LATE=recompute_late, STAGES=cfg.stages, EVICT_FIRST=cfg.evict_first,
        HAS_WEIGHT=weight is not None, HAS_DSUM=dsum is not None, HAS_DX2=narrow_dtype is not None,
        LLAMA_CASTING=casting == "llama", num_warps=cfg.num_warps,
    )
    if weight is not None:
        dw = torch.empty_like(weight)
        sum_partial_rows(dw_partial, None, dw, None, cfg.bands, hidden)
    return dx, dw, dx2


# ------------------------------------------------------------------------------- torch ops + autograd



def _rms_norm_impl(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str,
    out_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, rstd = _forward(x, None, weight, eps, offset, casting, out_dtype)
    return y, rstd


def _add_rms_norm_impl(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str,
    out_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, s, rstd = _forward(x, residual, weight, eps, offset, casting, out_dtype)
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
    narrow_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dy, x, weight, rstd, dsum, eps, offset, casting, narrow_dtype)


RMS_NORM_BACKWARD = TigonOp("rms_norm_backward", _rms_norm_backward_impl)


def _setup_rms_norm(ctx, inputs, output):
    x, weight, eps, offset, casting, _out_dtype = inputs
    _y, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.eps, ctx.offset, ctx.casting = eps, offset, casting
    ctx.mark_non_differentiable(rstd)


def _rms_norm_grad(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw, _ = RMS_NORM_BACKWARD(dy, x, weight, rstd, None, ctx.eps, ctx.offset, ctx.casting)
    return dx, (dw if weight is not None else None), None, None, None, None


def _setup_add_rms_norm(ctx, inputs, output):
    x, residual, weight, eps, offset, casting, _out_dtype = inputs
    _y, s, rstd = output
    ctx.save_for_backward(s, weight, rstd)
    ctx.eps, ctx.offset, ctx.casting = eps, offset, casting
    ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
    ctx.mark_non_differentiable(rstd)


def _add_rms_norm_grad(ctx, dy, dsum, _drstd):
    s, weight, rstd = ctx.saved_tensors
    # ds is in s's dtype. An input held in a narrower one (a bf16 attention output joining the fp32
    # stream) gets ds rounded to it, as autograd's add casts it: written by the same kernel.
    narrow = ctx.x_dtype if ctx.x_dtype != s.dtype else None
    ds, dw, dx = RMS_NORM_BACKWARD(dy, s, weight, rstd, dsum, ctx.eps, ctx.offset, ctx.casting, narrow)
    dx = dx if narrow is not None else ds
    return dx, ds.to(ctx.residual_dtype), (dw if weight is not None else None), None, None, None, None


RMS_NORM = TigonOp("rms_norm", _rms_norm_impl, setup_context=_setup_rms_norm, backward=_rms_norm_grad)
ADD_RMS_NORM = TigonOp(
    "add_rms_norm", _add_rms_norm_impl, setup_context=_setup_add_rms_norm, backward=_add_rms_norm_grad
)


# ------------------------------------------------------------------------------------ public functions


def check_scale(weight, name, x):
    """A norm's scale: a float tensor of shape (hidden,) on x's device (ValueError/TypeError naming it)."""
    check_tensor(weight, name, device=x.device)
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"{name} has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")


def _check_args(x, weight, eps, casting, *, residual=None):
    check_tensor(x, "x")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the hidden dimension is the last)")
    if residual is not None:
        check_tensor(residual, "residual", device=x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)}, expected x's {tuple(x.shape)}")
    if weight is not None:
        check_scale(weight, "weight", x)
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {CASTINGS}, got {casting!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def rms_norm(x, weight, eps=1e-6, *, offset=0.0, casting="llama", out_dtype=None):
    """RMSNorm over the last dim of ``x``; see the module docstring for the math.

    ``weight=None`` means no scale (``offset`` is then unused). Gemma's ``1 + weight`` is
    ``offset=1.0``. Output dtype: llama casting promotes x with the weight (fp32 weights with bf16 x
    give fp32, as transformers does); gemma casting returns x's dtype.

    ``out_dtype`` (a float dtype, or None for the above): the fp32 result rounded once to that dtype
    (for a narrower one, bitwise ``rms_norm(...).to(out_dtype)`` without the cast's pass over the
    output), and the gradient taken in that dtype. Under autocast a norm whose output only feeds
    linear layers (which cast it to the autocast dtype anyway) gives it already cast:
    ``tigon.nn.RMSNorm.autocast_output``.
    """
    _check_args(x, weight, eps, casting)
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of {FLOAT_DTYPES} or None, got {out_dtype}")
    y, _ = RMS_NORM(x, weight, float(eps), float(offset), casting, out_dtype)
    return y


def add_rms_norm(x, residual, weight, eps=1e-6, *, offset=0.0, casting="llama", out_dtype=None):
    """``s = x + residual; y = rms_norm(s, ...)`` in one pass; returns ``(y, s)``.

    x and residual may differ in dtype (a bf16 sublayer output joining the fp32 residual stream under
    autocast): s takes torch's promotion of the two, as ``x + residual`` does, and y is
    ``rms_norm(s, ...)`` of it (``out_dtype`` as for :func:`rms_norm`).
    """
    _check_args(x, weight, eps, casting, residual=residual)
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of {FLOAT_DTYPES} or None, got {out_dtype}")
    y, s, _ = ADD_RMS_NORM(x, residual, weight, float(eps), float(offset), casting, out_dtype)
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
