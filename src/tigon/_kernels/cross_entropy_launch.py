"""The cross-entropy row kernels' launch settings (one frozen config) and the geometry they give: rows
held in registers, or streamed in blocks over a persistent grid. cross_entropy launches its rows
with them, and the fused linear losses' vocabulary chunks (``vocab_chunks``) their widest chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tigon._kernels.launch import cache_by_size, next_power_of_2
from tigon._kernels.softmax_rows import EVICT_FIRST, EVICT_LAST, EVICT_NORMAL, RowLaunch, programs_per_sm


@dataclass(frozen=True)
class CrossEntropyConfig:
    """Launch settings of the row kernels: the one place that decides their geometry.

    The defaults are the fastest settings measured in docs/tuning.md ("cross_entropy"); dev/tune_ce.py
    sweeps them by passing configs to :func:`launch_cross_entropy_rows`.
    """

    # Registers regime: a row whose padded width is at most this is held in registers between the
    # statistics and the gradient (read once). One fp32 register per element holds exp(z − max)
    # (two with softcap, which also keeps ∂z/∂l), so the softcap limit is lower.
    max_single_block_v: int = 32768
    max_single_block_v_softcap: int = 16384
    # fp32 row values per thread: warps = padded width / (32 × this), at most single_max_warps.
    single_values_per_thread: int = 16
    single_max_warps: int = 32
    # Persistent grid of this many programs per SM, rows dealt round-robin.
    single_programs_per_sm: float = 4
    # Each program loads its next row before reducing the current one (ROW_PREFETCH).
    single_row_prefetch: bool = True
    # Streamed regime (longer rows, read twice): blocks of this width over this many warps.
    stream_block_v: int = 16384
    stream_warps: int = 32
    # Softcap rows (bound by the MUFU pipe, their pass 1 without reductions) take their own blocks.
    stream_softcap_block_v: int = 8192
    stream_softcap_warps: int = 16
    # Blocks loaded ahead into registers while one is reduced: stream_prefetch with the L2 hints,
    # where the rows in flight (programs × row bytes) take at most stream_hinted_max_bytes;
    # stream_wide_prefetch without hints beyond (pass 1's evict-last would only crowd pass 2 out).
    stream_prefetch: int = 1
    stream_wide_prefetch: int = 2
    stream_hinted_max_bytes: int = 96 << 20
    # Softcap rows: this many blocks ahead whatever their width, and hinted whatever their bytes.
    stream_softcap_prefetch: int = 1
    stream_softcap_hinted: bool = True
    # L2 eviction hints on the streamed passes (pass 1 evict_last; pass 2 and its stores evict_first).
    stream_l2_hints: bool = True
    # Programs per SM of the streamed grid (fractional: fewer rows in flight, less L2 needed).
    stream_programs_per_sm: float = 2.0

    def single_warps(self, block_v: int) -> int:
        return max(1, min(block_v // (32 * self.single_values_per_thread), self.single_max_warps))


CONFIG = CrossEntropyConfig()


def default_cross_entropy_config() -> CrossEntropyConfig:
    """The config the ops launch with (read at each launch, so a test may swap CONFIG)."""
    return CONFIG


def row_launch(num_rows: int, width: int, device: torch.device, *, softcap: bool = False,
               elem_bytes: int = 2, config: CrossEntropyConfig | None = None) -> RowLaunch:
    """Geometry for rows of ``width`` classes: registers or streamed, as ``config`` (default CONFIG) says."""
    return _row_launch(num_rows, width, device, softcap, elem_bytes, config or CONFIG)


@cache_by_size
def _row_launch(num_rows, width, device, softcap, elem_bytes, config) -> RowLaunch:
    max_single = config.max_single_block_v_softcap if softcap else config.max_single_block_v
    padded = next_power_of_2(width)
    if padded <= max_single:
        programs = programs_per_sm(device, config.single_programs_per_sm)
        return RowLaunch(padded, config.single_warps(padded), True, max(1, min(num_rows, programs)),
                         row_prefetch=config.single_row_prefetch)
    return streamed_launch(num_rows, width, device, softcap, elem_bytes, config, hinted=True)


def streamed_launch(num_rows, width, device, softcap, elem_bytes, config, *, hinted: bool) -> RowLaunch:
    """The persistent streamed grid (also the fused linear loss's widest vocabulary chunks, which
    pass ``hinted=False``: they keep the unhinted setting they were measured with)."""
    padded = next_power_of_2(width)
    if softcap:
        stream_block_v, stream_warps = config.stream_softcap_block_v, config.stream_softcap_warps
    else:
        stream_block_v, stream_warps = config.stream_block_v, config.stream_warps
    if padded < stream_block_v:  # one block (a narrow vocabulary chunk)
        block_v, num_warps = padded, config.single_warps(padded)
    else:
        block_v, num_warps = stream_block_v, stream_warps
    programs = max(1, min(num_rows, programs_per_sm(device, config.stream_programs_per_sm)))
    hinted = hinted and (
        (softcap and config.stream_softcap_hinted) or programs * width * elem_bytes <= config.stream_hinted_max_bytes
    )
    hints = (EVICT_LAST, EVICT_FIRST, EVICT_FIRST) if hinted and config.stream_l2_hints else (EVICT_NORMAL,) * 3
    if softcap:
        prefetch = config.stream_softcap_prefetch
    else:
        prefetch = config.stream_prefetch if hinted else config.stream_wide_prefetch
    return RowLaunch(block_v, num_warps, False, programs, prefetch, *hints)
