r"""The vocabulary-chunk kernels of ``fused_linear_cross_entropy`` (its chunks of classes).

When the fused linear loss cuts the vocabulary into chunks of classes, each chunk of logits
(N, width) is just written by the chunk's matmul and read twice by these kernels, in the same
formulas as ``cross_entropy`` (``_softmax_rows``):

- :func:`cross_entropy_chunk_stats_kernel` folds the chunk into each row's running state
  (max, Σ exp(z − max), Σ w·z, z_y), and on the last chunk writes lse and the row's loss;
- :func:`cross_entropy_chunk_grad_kernel` overwrites the chunk with ∂loss/∂logits from lse.

Geometry (:class:`VocabChunkConfig`): a chunk up to ``row_max_width`` classes wide runs one small
program per row, so that each SM holds many rows' loads at once; a wider chunk (a small N, whose
whole vocabulary is one chunk) takes cross_entropy's persistent streamed grid without L2 hints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tigon._kernels.cross_entropy_launch import CrossEntropyConfig, default_cross_entropy_config, streamed_launch
from tigon._kernels.fp32_math import as_fp32
from tigon._kernels.launch import TigonOp, cache_by_size, next_power_of_2, persistent_programs, wrap_triton
from tigon._kernels.softmax_rows import (
    RowLaunch,
    grad_coefficients,
    local_column,
    option_flags,
    row_loss,
    row_scale_args,
    softcap_args,
    softcap_shift,
    store_zeros,
    stream_grad,
    stream_stats,
    target_terms,
)

# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def cross_entropy_chunk_stats_kernel(
    chunk_ptr, chunk_row_stride,            # (N, width) logits of classes [col0, col0 + width), unit stride
    target_ptr, target_stride,              # (N,) class indices
    weight_ptr,                             # (V,) class weights (whole vocabulary)   [HAS_WEIGHT]
    scales_ptr,                             # fp32 (3,): α, β, W
    state_ptr,                              # (4, N) fp32 in/out: running max, Σ exp(z − max), Σ w·z, z_y
    loss_ptr, lse_ptr,                      # (N,) out, fp32, written on the last chunk   [IS_LAST]
    num_rows, vocab, col0, width, ignore_index, label_smoothing, z_loss, logit_scale, softcap, softcap_scale,
    BLOCK_V: tl.constexpr, PREFETCH: tl.constexpr, IS_LAST: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, SOFTCAP_SHIFT: tl.constexpr,
):
    """Vocabulary-chunked pass 1 (fused linear CE): fold one chunk of classes into each row's state.

    Ignored rows are skipped (never read). On the last chunk the row's lse and loss are written.
    """
    label_smoothing, z_loss, logit_scale = as_fp32(label_smoothing), as_fp32(z_loss), as_fp32(logit_scale)
    softcap, softcap_scale = as_fp32(softcap), as_fp32(softcap_scale)
    for row64 in range(tl.program_id(0).to(tl.int64), num_rows, tl.num_programs(0)):
        t = tl.load(target_ptr + row64 * target_stride).to(tl.int64)
        if t == ignore_index:
            if IS_LAST:
                tl.store(loss_ptr + row64, 0.0)
                tl.store(lse_ptr + row64, 0.0)
        else:
            row_in = chunk_ptr + row64 * chunk_row_stride
            m = tl.load(state_ptr + row64)
            s = tl.load(state_ptr + num_rows + row64)
            wz = tl.load(state_ptr + 2 * num_rows + row64)
            m, s, wz = stream_stats(
                row_in, 1, width, weight_ptr + col0, m, s, wz, logit_scale, softcap, softcap_scale,
                BLOCK_V, PREFETCH, 0, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, SOFTCAP_SHIFT,
            )
            w_y, z_y, in_chunk = target_terms(
                row_in, 1, t, col0, width, vocab, weight_ptr, logit_scale, softcap, softcap_scale,
                HAS_WEIGHT, HAS_SOFTCAP,
            )
            # z_y starts as NaN in the state: a target outside [0, V) never lands in a chunk.
            z_y = tl.where(in_chunk, z_y, tl.load(state_ptr + 3 * num_rows + row64))
            if IS_LAST:
                ce_scale = tl.load(scales_ptr)
                z_scale = tl.load(scales_ptr + 1)
                weight_sum = tl.load(scales_ptr + 2)
                lse = tl.where(m == float("-inf"), 0.0, m) + tl.log(s)
                loss = row_loss(lse, z_y, w_y, wz, weight_sum, 1.0 / vocab, label_smoothing, z_loss,
                                ce_scale, z_scale, HAS_SMOOTHING, HAS_Z_LOSS)
                tl.store(loss_ptr + row64, loss)
                tl.store(lse_ptr + row64, lse)
            else:
                tl.store(state_ptr + row64, m)
                tl.store(state_ptr + num_rows + row64, s)
                tl.store(state_ptr + 2 * num_rows + row64, wz)
                tl.store(state_ptr + 3 * num_rows + row64, z_y)


@triton.jit
def cross_entropy_chunk_grad_kernel(
    chunk_ptr, chunk_row_stride,            # (N, width) in/out: logits of classes [col0, +width) -> gradient
    target_ptr, target_stride,              # (N,) class indices
    weight_ptr,                             # (V,) class weights (whole vocabulary)   [HAS_WEIGHT]
    scales_ptr,                             # fp32 (3,): α, β, W
    row_scale_ptr, row_scale_stride,        # (N,) factor on each row's gradient   [HAS_ROW_SCALE]
    lse_ptr,                                # (N,) fp32 logsumexp from the stats pass
    num_rows, vocab, col0, width, ignore_index, label_smoothing, z_loss, logit_scale, softcap, softcap_scale,
    BLOCK_V: tl.constexpr, PREFETCH: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,
):
    """Vocabulary-chunked pass 2 (fused linear CE): overwrite one chunk of logits with the gradient."""
    label_smoothing, z_loss, logit_scale = as_fp32(label_smoothing), as_fp32(z_loss), as_fp32(logit_scale)
    softcap, softcap_scale = as_fp32(softcap), as_fp32(softcap_scale)
    ce_scale = tl.load(scales_ptr)
    z_scale = tl.load(scales_ptr + 1)
    weight_sum = tl.load(scales_ptr + 2)
    for row64 in range(tl.program_id(0).to(tl.int64), num_rows, tl.num_programs(0)):
        row_ptr = chunk_ptr + row64 * chunk_row_stride
        t = tl.load(target_ptr + row64 * target_stride).to(tl.int64)
        if t == ignore_index:
            store_zeros(row_ptr, 1, width, BLOCK_V)
        else:
            in_range = (t >= 0) & (t < vocab)
            if HAS_WEIGHT:
                w_y = tl.load(weight_ptr + tl.where(in_range, t, 0).to(tl.int32)).to(tl.float32)
            else:
                w_y = 1.0
            w_y = tl.where(in_range, w_y, float("nan"))
            if HAS_ROW_SCALE:
                row_scale = tl.load(row_scale_ptr + row64 * row_scale_stride).to(tl.float32)
            else:
                row_scale = 1.0
            lse = tl.load(lse_ptr + row64)
            p_coef, target_coef, smooth_coef = grad_coefficients(
                lse, w_y, weight_sum, 1.0 / vocab, label_smoothing, z_loss, ce_scale, z_scale, row_scale,
                HAS_SMOOTHING, HAS_Z_LOSS,
            )
            t_local = local_column(t, col0, width)  # −1 when the target is in another chunk
            stream_grad(
                row_ptr, 1, row_ptr, 1, width, t_local, weight_ptr + col0, lse,
                p_coef, target_coef, smooth_coef, logit_scale, softcap, softcap_scale,
                BLOCK_V, PREFETCH, 0, 0, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP,
            )


# -------------------------------------------------------------------------------------- launch config


@dataclass(frozen=True)
class VocabChunkConfig:
    """Launch settings of the vocabulary-chunk kernels (docs/tuning.md, "fused_linear_cross_entropy";
    dev/tune_flce_chunks.py passes configs to the launchers below)."""

    # Chunks up to this many classes wide: one program per row, blocks of block_v over num_warps
    # warps, prefetch blocks loaded ahead. Wider chunks take cross_entropy's streamed grid.
    row_max_width: int = 16384
    block_v: int = 1024
    num_warps: int = 4
    prefetch: int = 1


CONFIG = VocabChunkConfig()


def chunk_launch(num_rows: int, width: int, device: torch.device, *, softcap: bool = False, elem_bytes: int = 2,
                 config: VocabChunkConfig | None = None, rows_config: CrossEntropyConfig | None = None) -> RowLaunch:
    """Geometry for chunks of ``width`` classes (defaults: CONFIG, and cross_entropy's config beyond
    ``row_max_width``)."""
    return _chunk_launch(num_rows, width, device, softcap, elem_bytes, config or CONFIG,
                         rows_config or default_cross_entropy_config())


@cache_by_size
def _chunk_launch(num_rows, width, device, softcap, elem_bytes, config, rows_config) -> RowLaunch:
    padded = next_power_of_2(width)
    if padded <= config.row_max_width:  # one program a row
        programs = num_rows if device.type == "cuda" else min(num_rows, persistent_programs(device))
        return RowLaunch(min(padded, config.block_v), config.num_warps, False, max(1, programs), config.prefetch)
    return streamed_launch(num_rows, width, device, softcap, elem_bytes, rows_config, hinted=False)


# ------------------------------------------------------------------------------------------ launchers


def _chunk_setup(chunk, weight, label_smoothing, z_loss, softcap, logit_scale, config, rows_config):
    num_rows, width = chunk.shape
    cfg = chunk_launch(num_rows, width, chunk.device, softcap=softcap is not None,
                       elem_bytes=chunk.element_size(), config=config, rows_config=rows_config)
    flags = dict(**option_flags(weight, label_smoothing, z_loss, softcap), PREFETCH=cfg.prefetch,
                 num_warps=cfg.num_warps)
    return cfg, softcap_args(softcap, logit_scale), flags


def launch_vocab_chunk_stats(
    chunk, target, weight, scales, state, loss_rows, lse, col0, vocab, is_last,
    ignore_index, label_smoothing, z_loss, softcap, logit_scale, *,
    config: VocabChunkConfig | None = None, rows_config: CrossEntropyConfig | None = None,
):
    num_rows, width = chunk.shape
    if num_rows == 0:
        return
    cfg, (softcap_value, softcap_scale), flags = _chunk_setup(
        chunk, weight, label_smoothing, z_loss, softcap, logit_scale, config, rows_config
    )
    wrap_triton(cross_entropy_chunk_stats_kernel)[(cfg.programs,)](
        chunk, chunk.stride(0),
        target, target.stride(0),
        weight if weight is not None else scales,
        scales, state, loss_rows, lse,
        num_rows, vocab, col0, width, ignore_index, label_smoothing, z_loss, logit_scale,
        softcap_value, softcap_scale,
        BLOCK_V=cfg.block_v, IS_LAST=is_last, SOFTCAP_SHIFT=softcap_shift(softcap), **flags,
    )


def launch_vocab_chunk_grad(
    chunk, target, weight, scales, row_scale, lse, col0, vocab,
    ignore_index, label_smoothing, z_loss, softcap, logit_scale, *,
    config: VocabChunkConfig | None = None, rows_config: CrossEntropyConfig | None = None,
):
    num_rows, width = chunk.shape
    if num_rows == 0:
        return
    cfg, (softcap_value, softcap_scale), flags = _chunk_setup(
        chunk, weight, label_smoothing, z_loss, softcap, logit_scale, config, rows_config
    )
    wrap_triton(cross_entropy_chunk_grad_kernel)[(cfg.programs,)](
        chunk, chunk.stride(0),
        target, target.stride(0),
        weight if weight is not None else scales,
        scales,
        *row_scale_args(row_scale, scales),
        lse,
        num_rows, vocab, col0, width, ignore_index, label_smoothing, z_loss, logit_scale,
        softcap_value, softcap_scale,
        BLOCK_V=cfg.block_v, HAS_ROW_SCALE=row_scale is not None, **flags,
    )


# ------------------------------------------------------------------------------------------ torch ops


def _chunk_stats_impl(
    chunk: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    scales: torch.Tensor,
    state: torch.Tensor,
    loss_rows: torch.Tensor,
    lse: torch.Tensor,
    col0: int,
    vocab: int,
    is_last: bool,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    logit_scale: float,
) -> None:
    launch_vocab_chunk_stats(
        chunk, target, weight, scales, state, loss_rows, lse, col0, vocab, is_last,
        ignore_index, label_smoothing, z_loss, softcap, logit_scale,
    )


def _chunk_grad_impl(
    chunk: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    scales: torch.Tensor,
    row_scale: torch.Tensor | None,
    lse: torch.Tensor,
    col0: int,
    vocab: int,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    logit_scale: float,
) -> None:
    launch_vocab_chunk_grad(
        chunk, target, weight, scales, row_scale, lse, col0, vocab,
        ignore_index, label_smoothing, z_loss, softcap, logit_scale,
    )


VOCAB_CHUNK_STATS = TigonOp("cross_entropy_chunk_stats_", _chunk_stats_impl, mutates_args={"state", "loss_rows", "lse"})
VOCAB_CHUNK_GRAD = TigonOp("cross_entropy_chunk_grad_", _chunk_grad_impl, mutates_args={"chunk"})
