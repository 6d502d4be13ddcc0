r"""The row machinery the three norms share (rms_norm, layer_norm, post_norm_join).

- Tile loads and the backward's per-tile terms (x̂, g), the fp32 partial-row update of dw (and db)
  and the split of a band's columns between programs.
- Split rows: a row longer than one program's registers is cut into slices, one program a slice;
  the programs of a row swap their partial row sums through a small global buffer as they reach
  each row (:func:`exchange_row_sums`) and add them in the same order, so every element is read
  from HBM once. :func:`split_rows_scratch` makes that buffer.
- The fixed-order sum of the bands' partial rows (:func:`partial_rows_sum_kernel`): dw and db are
  reduced without atomics, so the same input gives bitwise the same gradient on every run.
- Launch geometry: :class:`NormTuning` (the settings of one direction; each norm's config holds
  one per direction), and the tiles and persistent grids they give (:func:`tile_launch`,
  :func:`split_forward_launch`, :func:`backward_launch`).

The regimes and their derivation are in rms_norm's module docstring (``ops/rms_norm.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tigon._interpreter import interpreter_active
from tigon._kernels.launch import (
    cache_by_size,
    cdiv,
    next_power_of_2,
    persistent_programs,
    pow2_at_most,
    tracing_active,
    wrap_triton,
)

# --------------------------------------------------------------------------------------------- kernels


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
    geometry is LayerNorm's tuned one (dev/tune_norm.py fused-ln), which passes its own."""
    stand_in = dw if dw is not None else db
    wrap_triton(partial_rows_sum_kernel)[(cdiv(hidden, block_cols),)](
        dw_partial if dw is not None else stand_in, db_partial if db is not None else stand_in,
        stand_in if dw is None else dw, stand_in if db is None else db,
        bands, hidden,
        BLOCK_BANDS=block_bands, BLOCK_COLS=block_cols, HAS_WEIGHT=dw is not None, HAS_BIAS=db is not None,
        num_warps=warps,
    )


# -------------------------------------------------------------------------------------- launch config


# -------------------------------------------------------------------------------------- launch geometry


@dataclass(frozen=True)
class NormTuning:
    """The launch settings of one direction of a norm (dev/tune_norm.py sweeps them on a GPU).

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


def warps_for(tile: int, tuning: NormTuning) -> int:
    return max(1, min(tile // tuning.elements_per_warp, tuning.max_warps))


@cache_by_size
def split_forward_launch(num_rows: int, hidden: int, tuning: NormTuning) -> tuple[NormLaunch, int]:
    cfg = tile_launch(num_rows, hidden, tuning)
    if cfg.single_pass or hidden > tuning.split_max_hidden:
        return cfg, 1
    return NormLaunch(1, tuning.split_slice, tuning.split_warps, True), cdiv(hidden, tuning.split_slice)


@cache_by_size  # keyed on the tuning too: tests and dev/tune_norm.py pass their own
def tile_launch(num_rows: int, hidden: int, tuning: NormTuning) -> NormLaunch:
    block_n = next_power_of_2(hidden)
    if block_n > tuning.max_fused_hidden:
        return NormLaunch(1, tuning.chunk, warps_for(tuning.chunk, tuning), False)
    block_m = max(1, pow2_at_most(num_rows, tuning.tile_elements // block_n))
    return NormLaunch(block_m, block_n, warps_for(block_m * block_n, tuning), True)


@cache_by_size
def backward_launch(
    num_rows: int, hidden: int, device: torch.device, tuning: NormTuning
) -> NormBackwardLaunch:
    tile = tile_launch(num_rows, hidden, tuning)
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
        split = max(1, min(tuning.stream_split, cdiv(hidden, tuning.chunk), target))
        block_m = max(1, pow2_at_most(num_rows, tuning.stream_rows))
        stages = tuning.stream_stages
    bands = max(1, min(target // split, cdiv(num_rows, block_m)))
    rows_per_band = cdiv(cdiv(num_rows, bands), block_m) * block_m
    bands = cdiv(num_rows, rows_per_band)
    return NormBackwardLaunch(
        block_m, tile.block_n, warps or warps_for(block_m * tile.block_n, tuning), tile.single_pass,
        bands=bands, split=split, rows_per_band=rows_per_band, stages=stages,
        evict_first=tuning.stream_evict_first and not tile.single_pass,
    )


# ------------------------------------------------------------------------------------ split-row scratch


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
