"""Tiles of a (rows, cols) view for the elementwise-with-reduction kernels (kl_div, jsd): a 1-D grid
of [BLOCK_M, BLOCK_N] tiles, several short rows a tile or a segment of a long row."""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from tigon._kernels.launch import cache_by_size, cdiv, next_power_of_2, pow2_at_most


@triton.jit
def tile_indices(pid, col_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row and column indices (int64) of program ``pid``'s tile on the 1-D grid, row-major."""
    pid_m = (pid // col_tiles).to(tl.int64)
    pid_n = (pid % col_tiles).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols


@triton.jit
def load_tile(ptr, row_stride, col_stride, rows, cols, mask):
    """A [BLOCK_M, BLOCK_N] tile of a strided (rows, cols) view, upcast to fp32 at once (0 outside)."""
    tile = tl.load(ptr + rows[:, None] * row_stride + cols[None, :] * col_stride, mask=mask, other=0.0)
    return tile.to(tl.float32)


@dataclass(frozen=True)
class TileConfig:
    """The tiles' launch settings (kl_div and jsd; docs/tuning.md)."""

    # Elements one program's tile aims at: 16 (fp32) to 32 (bf16) bytes per thread per input at 8
    # warps, enough loads in flight per thread to stream at full bandwidth without spilling.
    tile_elements: int = 8192
    elements_per_warp: int = 1024
    max_warps: int = 8


CONFIG = TileConfig()


@dataclass(frozen=True)
class TileLaunch:
    """Tiling of a (rows, cols) view by elementwise-with-reduction kernels (KL, JSD), 1-D grid."""

    block_m: int
    block_n: int
    num_warps: int
    col_tiles: int
    programs: int


def elementwise_tile_launch(num_rows: int, num_cols: int, *, config: TileConfig | None = None) -> TileLaunch:
    """A row segment of up to ``tile_elements``, and several short rows per tile when rows are short."""
    return _tile_launch(num_rows, num_cols, config or CONFIG)


@cache_by_size
def _tile_launch(num_rows, num_cols, config) -> TileLaunch:
    block_n = min(next_power_of_2(num_cols), config.tile_elements)
    block_m = max(1, pow2_at_most(num_rows, config.tile_elements // block_n))
    num_warps = max(1, min(block_m * block_n // config.elements_per_warp, config.max_warps))
    col_tiles = cdiv(num_cols, block_n)
    return TileLaunch(block_m, block_n, num_warps, col_tiles, cdiv(num_rows, block_m) * col_tiles)
