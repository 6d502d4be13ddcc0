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

Long rows (hidden > ``CONFIG.backward.max_fused_hidden``, 8192) do not fit one program's registers, and
c needs the whole row before any of dx. Two ways, both in :func:`rms_norm_bwd_kernel`:

- **Split rows** (up to ``split_max_hidden``, 65536): each row is cut into 8192-wide slices, one
  program a slice, each holding its slice in registers as the fused regime holds a whole row. The
  programs of a row swap their partial sums of g·x̂ through a small global buffer as they reach
  each row (``tigon._kernels.exchange_row_sums``) and add them in the same order, so every element is
  read from HBM once. The forward does the same for Σx² past 32768 (``CONFIG.forward``); split rows
  measured faster than streaming them at the benchmark shapes (docs/tuning.md, "Norms").
- **Streamed** (longer rows): groups of rows are read twice in column chunks, c first, then dx and
  the group's dw, the second read meant to come from L2. What decides the speed is what stays in L2
  between the two reads: the rows of every band in flight and every band's partial row; the
  ``stream_*`` settings size the groups, the bands and the split of a band's columns between programs.

The machinery shared with layer_norm and post_norm_join (split-row exchange, partial rows, launch
geometry) is in ``tigon._kernels.norm_rows``; ``RMSNormConfig`` (``tigon._kernels.norm_launch``, whose
``CONFIG`` the two others read too) holds the settings of both directions.

Bytes (speed of light), M rows, element size b::

    forward   read x (and residual) M·N·b, w N·b; write y (and s) M·N·b, rstd 4M
    backward  read dy, x M·N·b each (and d(s-output)), w, rstd; write dx M·N·b, dw N·b

Reference: :func:`rms_norm_reference` (transformers' ``LlamaRMSNorm`` / ``GemmaRMSNorm``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon._kernels import (
    FLOAT_DTYPES,
    TigonOp,
    accumulate_partial,
    add_parts,
    as_fp32,
    as_rows,
    cdiv,
    check_real,
    check_tensor,
    exchange_row_sums,
    grad_tile,
    lacking_part,
    load_grad_rows,
    load_rows,
    next_power_of_2,
    norm_backward_launch,
    part_chunks,
    publish_part_sums,
    read_row_sums,
    rms_norm_forward_launch,
    rms_norm_output_dtype,
    split_rows_scratch,
    sum_partial_rows,
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


# ------------------------------------------------------------------------------------------ launchers


def _forward(x, residual, weight, eps, offset, casting, out_dtype=None):
    """Launch the forward on any-shaped x; returns (y, s or None, rstd) with y, s shaped like x.

    ``out_dtype`` (None: :func:`rms_norm_output_dtype`) is y's dtype: the kernel rounds its fp32 result to it
    once, as a cast of the reference's output would.
    """
    hidden = x.shape[-1]
    x2 = as_rows(x)
    num_rows = x2.shape[0]
    llama = casting == "llama"
    s_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    y_dtype = out_dtype or rms_norm_output_dtype(s_dtype, weight.dtype if weight is not None else None, casting)
    y = torch.empty(x.shape, dtype=y_dtype, device=x.device)
    rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    s = torch.empty(x.shape, dtype=s_dtype, device=x.device) if residual is not None else None
    if num_rows == 0 or hidden == 0:
        return y, s, rstd
    r2 = as_rows(residual) if residual is not None else x2
    cfg, split = rms_norm_forward_launch(num_rows, hidden)
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
    cfg = norm_backward_launch(num_rows, hidden, x.device)
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
    # (no .to call where ds is in the residual's dtype already: the same tensor, without the dispatch)
    d_residual = ds if ds.dtype == ctx.residual_dtype else ds.to(ctx.residual_dtype)
    return dx, d_residual, (dw if weight is not None else None), None, None, None, None


RMS_NORM = TigonOp("rms_norm", _rms_norm_impl, setup_context=_setup_rms_norm, backward=_rms_norm_grad)
ADD_RMS_NORM = TigonOp(
    "add_rms_norm", _add_rms_norm_impl, setup_context=_setup_add_rms_norm, backward=_add_rms_norm_grad
)


# ------------------------------------------------------------------------------------ public functions


def check_scale(weight, name, x):
    """A norm's scale: a float tensor of shape (hidden,) on x's device (ValueError/TypeError naming it)."""
    check_tensor(weight, name, device=x.device)
    hidden = x.shape[-1]
    if weight.dim() == 1 and weight.shape[0] != hidden:
        raise ValueError(f"x's last dim {hidden} (the hidden size) does not match {name}'s size "
                         f"{weight.shape[0]}: {name} must have shape ({hidden},)")
    if weight.shape != (hidden,):
        raise ValueError(f"{name} has shape {tuple(weight.shape)}, expected ({hidden},) (x's last dim)")


def check_rms_norm_args(x, weight, eps, casting, *, offset, residual=None):
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
    check_real(eps, "eps", minimum=0.0)
    check_real(offset, "offset")


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
    check_rms_norm_args(x, weight, eps, casting, offset=offset)
    weight = None if weight is None else weight.contiguous()  # the kernels read it with unit stride
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
    check_rms_norm_args(x, weight, eps, casting, offset=offset, residual=residual)
    weight = None if weight is None else weight.contiguous()  # the kernels read it with unit stride
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
