"""RMSNorm's launch settings (one frozen config, both directions) and the geometry they give: the
register tile or streamed chunk of a row, split rows, the backward's persistent grid. layer_norm and
the norm joins take their split and streamed geometry from here too (the regimes are the same), and
the norm joins RMSNorm's output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tigon._kernels.launch import cache_by_size
from tigon._kernels.norm_rows import (
    NormBackwardLaunch,
    NormLaunch,
    NormTuning,
    backward_launch,
    split_forward_launch,
    tile_launch,
)


@dataclass(frozen=True)
class RMSNormConfig:
    """Launch settings of both directions (docs/tuning.md, "norms"; dev/tune_norm.py sweeps them).

    forward: rows up to 32768 held in registers; longer ones split over 16384-wide programs up to
    131072, else streamed in 8192-wide chunks (a 65536-wide row held whole spills registers).
    backward: rows up to 8192 in registers (the backward holds about twice the live values a
    forward does), split over 8192-wide programs up to 65536, else streamed. layer_norm and
    post_norm_join take their split and streamed geometry from here too: the regimes are the same.
    """

    forward: NormTuning = field(default_factory=lambda: NormTuning(
        max_fused_hidden=32768, chunk=8192, tile_elements=4096, elements_per_warp=512, max_warps=16,
        split_max_hidden=131072, split_slice=16384, split_warps=16,
    ))
    backward: NormTuning = field(default_factory=lambda: NormTuning(
        max_fused_hidden=8192, chunk=4096, tile_elements=4096, elements_per_warp=1024, max_warps=16,
        programs_per_sm=2, stream_rows=4, stream_split=2, stream_programs_per_sm=1.0,
        stream_stages=1, stream_evict_first=True,
        split_max_hidden=65536, split_slice=8192, split_warps=8, split_programs_per_sm=1.0,
    ))


CONFIG = RMSNormConfig()


def default_rms_norm_config() -> RMSNormConfig:
    """The config the norms launch with (read at each launch, so a test may swap CONFIG)."""
    return CONFIG


def norm_launch(num_rows: int, hidden: int, *, backward: bool) -> NormLaunch:
    """The register tile (or streamed chunk) of one direction for (num_rows, hidden) rows."""
    return tile_launch(num_rows, hidden, CONFIG.backward if backward else CONFIG.forward)


def rms_norm_forward_launch(num_rows: int, hidden: int) -> tuple[NormLaunch, int]:
    """RMSNorm's forward geometry and the programs a row is split over (1: not split)."""
    return split_forward_launch(num_rows, hidden, CONFIG.forward)


def norm_backward_launch(num_rows: int, hidden: int, device: torch.device) -> NormBackwardLaunch:
    """The backward's launch for (num_rows, hidden) rows on ``device``."""
    return _norm_backward_launch(num_rows, hidden, device, CONFIG.backward)


# Cached as the forward's geometry is (a few µs of Python on every backward); keyed by the tuning, so
# that a swapped CONFIG is read, and by the device, whose multiprocessors set the programs.
_norm_backward_launch = cache_by_size(backward_launch)


def rms_norm_output_dtype(x_dtype, weight_dtype, casting):
    """The dtype transformers' norm returns: llama casting promotes x with the weight (fp32 weights
    with bf16 x give fp32), gemma casting keeps x's."""
    return torch.promote_types(x_dtype, weight_dtype) if (casting == "llama" and weight_dtype is not None) else x_dtype
