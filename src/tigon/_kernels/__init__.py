"""The building blocks several ops share, behind one import surface.

The only private package other packages may import from (tests/test_layering.py checks it). Nothing
here imports from tigon.ops, nn, losses or patching; the modules import each other directly, and
every other package imports from here. Each module says what it holds:

- ``inputs``: argument checks that name the argument, row views, autocast's dtype
- ``fp32_math``: fp32 scalars and transcendentals in few instructions, in kernels
- ``launch``: launching kernels: registered torch ops, the eager fast path, launch geometry
- ``matmul``: matmuls into a chosen dtype, shared casts, bias gradients
- ``elementwise_tiles``: tiles of a (rows, cols) view for elementwise-with-reduction kernels
- ``softmax_rows``: a row's softmax statistics, loss and gradient (the cross-entropy row kernels' pieces)
- ``cross_entropy_launch``: the cross-entropy row kernels' launch config and geometry
- ``loss_gradients``: loss gradients made in the forward, brought to grad_output in the backward
- ``vocab_chunks``: cross-entropy over chunks of the vocabulary (the fused linear losses)
- ``lm_head_chunks``: the LM head's logits a chunk at a time: operands, chunks, buffer, matmul
- ``logprob_rows``: the log-prob head's row path (chunk statistics and gradients)
- ``logprob_tiles``: the log-prob head's tile path (statistics folded into the matmul's tiles)
- ``add_round_matmul``: D = round(C + Aᵀ·B): the last product of a chunked fp32 sum, added and rounded
- ``divergence_rows``: KL, JSD and TVD terms of rows of log-probabilities
- ``norm_rows``: the norms' shared rows: split-row sums, partial rows, launch geometry
- ``norm_launch``: RMSNorm's launch config, whose geometry layer_norm and the norm joins share
- ``rotary``: rotary embeddings' argument checks, strides and tables
- ``glu_activations``: the gated units' activations and their derivatives, in kernels
- ``triton_key``: Triton's compiler key, hashed on a background thread before the first kernel lookup
"""

from tigon._kernels.add_round_matmul import (
    SUM_ROUND,
    SumRoundConfig,
    sum_round,
    sum_round_available,
    sum_round_reference,
    sum_round_tiles_kernel,
)
from tigon._kernels.cross_entropy_launch import (
    CrossEntropyConfig,
    default_cross_entropy_config,
    row_launch,
    streamed_launch,
)
from tigon._kernels.divergence_rows import (
    FORWARD_KL,
    INDEX_DTYPES,
    MIXED,
    REVERSE_KL,
    TVD,
    beta_mode,
    check_labels,
    check_pair,
    divergence_backward,
    divergence_bwd_kernel,
    divergence_forward,
    divergence_fwd_kernel,
    jsd_terms,
    rows_counted,
)
from tigon._kernels.elementwise_tiles import (
    TileConfig,
    TileLaunch,
    elementwise_tile_launch,
    load_tile,
    tile_indices,
)
from tigon._kernels.fp32_math import (
    LOG2E,
    as_fp32,
    copysign_nonnegative,
    fast_exp,
    fast_reciprocal,
    reciprocal_1_to_2,
)
from tigon._kernels.glu_activations import (
    gate_activation,
    stable_sigmoid,
)
from tigon._kernels.inputs import (
    FLOAT_DTYPES,
    as_rows,
    autocast_dtype,
    autocast_off,
    check_int,
    check_real,
    check_tensor,
)
from tigon._kernels.launch import (
    INTERPRETER_PROGRAMS,
    PLAIN_TENSORS,
    FastLaunch,
    OpaqueOp,
    TigonOp,
    cache_by_size,
    cdiv,
    function_apply,
    next_power_of_2,
    persistent_programs,
    pow2_at_most,
    shapes_only,
    tracing_active,
    wrap_triton,
)
from tigon._kernels.lm_head_chunks import (
    LossOptions,
    chunk_buffer,
    chunk_view,
    class_chunks,
    compute_operands,
    head_compute_dtype,
    linear_into,
)
from tigon._kernels.logprob_rows import (
    LOGPROB_CHUNK_GRAD,
    LOGPROB_CHUNK_GRAD_INPLACE,
    LOGPROB_CHUNK_STATS,
    LogprobOptions,
    launch_logprob_chunk_grad,
    linear_fp32,
    logprobs_chunk_grad_kernel,
    logprobs_chunk_stats_kernel,
)
from tigon._kernels.logprob_tiles import (
    COMBINE_BLOCK_P,
    COMBINE_BLOCK_R,
    GRAD,
    PART_BEFORE,
    PART_ENT,
    PART_M,
    PART_S,
    PART_SQ,
    PART_SUM,
    STATS,
    TILES_COMBINE,
    TILES_GRAD,
    TILES_STATS,
    logprobs_tiles_combine_kernel,
    logprobs_tiles_kernel,
    part_rows,
    tile_position,
    tile_programs,
    tiles_available,
    tma_operands,
    tma_rows,
)
from tigon._kernels.loss_gradients import (
    SCALE_ROWS,
    SCALE_ROWS_BLOCK,
    SCALE_ROWS_WARPS,
    RangeCheck,
    SavedGradientsFunction,
    apply_grad_output,
    launch_scale_rows,
    scale_lazily,
    scale_rows_kernel,
)
from tigon._kernels.matmul import (
    HAS_MM_OUT_DTYPE,
    cast_all,
    cast_stacked,
    fp32_product_in_place,
    matmul_accumulate,
    matmul_to,
    sum_rows_to,
)
from tigon._kernels.norm_launch import (
    CONFIG as RMS_NORM_CONFIG,
)
from tigon._kernels.norm_launch import (
    RMSNormConfig,
    default_rms_norm_config,
    norm_backward_launch,
    norm_launch,
    rms_norm_forward_launch,
    rms_norm_output_dtype,
)
from tigon._kernels.norm_rows import (
    NormBackwardLaunch,
    NormLaunch,
    NormTuning,
    accumulate_partial,
    add_parts,
    backward_launch,
    exchange_row_sums,
    grad_tile,
    lacking_part,
    load_grad_rows,
    load_rows,
    part_chunks,
    partial_rows_sum_kernel,
    publish_part_sums,
    read_row_sums,
    split_forward_launch,
    split_rows_scratch,
    sum_partial_rows,
    tile_launch,
    warps_for,
)
from tigon._kernels.rotary import (
    UNSQUEEZE_DIMS,
    bhtd_strides,
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
)
from tigon._kernels.softmax_rows import (
    EVICT_FIRST,
    EVICT_LAST,
    EVICT_NORMAL,
    MAX_SHIFT_SOFTCAP,
    REDUCTION_SCALES,
    REDUCTION_SCALES_BLOCK,
    REDUCTION_SCALES_WARPS,
    RowLaunch,
    grad_block,
    grad_coefficients,
    grad_store,
    load_hinted,
    load_scaled_with_slope,
    local_column,
    option_flags,
    programs_per_sm,
    reduction_scales_kernel,
    row_loss,
    row_scale_args,
    scaled_logits,
    scaled_with_slope,
    signed_softcap,
    softcap_args,
    softcap_shift,
    softcap_slope,
    softcapped,
    stats_block,
    stats_update,
    store_hinted,
    store_zeros,
    stream_grad,
    stream_stats,
    tanh_parts,
    target_terms,
)
from tigon._kernels.triton_key import (
    prehash_triton_key,
    wait_for_triton_key,
)
from tigon._kernels.vocab_chunks import (
    VOCAB_CHUNK_GRAD,
    VOCAB_CHUNK_STATS,
    VocabChunkConfig,
    chunk_launch,
    cross_entropy_chunk_grad_kernel,
    cross_entropy_chunk_stats_kernel,
    launch_vocab_chunk_grad,
    launch_vocab_chunk_stats,
)

__all__ = [
    "COMBINE_BLOCK_P", "COMBINE_BLOCK_R", "CrossEntropyConfig", "EVICT_FIRST", "EVICT_LAST", "EVICT_NORMAL",
    "FLOAT_DTYPES", "FORWARD_KL", "FastLaunch", "GRAD", "HAS_MM_OUT_DTYPE", "INDEX_DTYPES",
    "INTERPRETER_PROGRAMS", "LOG2E", "LOGPROB_CHUNK_GRAD", "LOGPROB_CHUNK_GRAD_INPLACE",
    "LOGPROB_CHUNK_STATS", "LogprobOptions", "LossOptions", "MAX_SHIFT_SOFTCAP", "MIXED",
    "NormBackwardLaunch", "NormLaunch", "NormTuning", "OpaqueOp", "PART_BEFORE", "PART_ENT", "PART_M", "PART_S",
    "PART_SQ", "PART_SUM", "PLAIN_TENSORS", "REDUCTION_SCALES", "REDUCTION_SCALES_BLOCK",
    "REDUCTION_SCALES_WARPS", "REVERSE_KL", "RMSNormConfig", "RMS_NORM_CONFIG", "RangeCheck", "RowLaunch",
    "SCALE_ROWS", "SCALE_ROWS_BLOCK", "SCALE_ROWS_WARPS", "STATS", "SUM_ROUND", "SavedGradientsFunction",
    "SumRoundConfig", "TILES_COMBINE", "TILES_GRAD", "TILES_STATS", "TVD", "TigonOp", "TileConfig",
    "TileLaunch", "UNSQUEEZE_DIMS", "VOCAB_CHUNK_GRAD", "VOCAB_CHUNK_STATS", "VocabChunkConfig",
    "accumulate_partial", "add_parts", "apply_grad_output", "as_fp32", "as_rows", "autocast_dtype",
    "autocast_off", "backward_launch", "beta_mode", "bhtd_strides", "cache_by_size", "cast_all",
    "cast_stacked", "cdiv", "check_int", "check_labels", "check_pair", "check_qk", "check_real",
    "check_rot_dim", "check_tensor", "chunk_buffer", "chunk_launch", "chunk_view", "class_chunks",
    "compute_operands", "copy_tile", "copysign_nonnegative", "cross_entropy_chunk_grad_kernel",
    "cross_entropy_chunk_stats_kernel", "default_cross_entropy_config", "default_rms_norm_config",
    "dim_order", "divergence_backward", "divergence_bwd_kernel", "divergence_forward",
    "divergence_fwd_kernel", "elementwise_tile_launch", "empty_in_order", "exchange_row_sums", "fast_exp",
    "fast_reciprocal", "fp32_product_in_place", "function_apply", "gate_activation", "grad_block",
    "grad_coefficients", "grad_store", "grad_tile", "head_block_rows", "head_compute_dtype", "jsd_terms",
    "lacking_part", "launch_logprob_chunk_grad", "launch_scale_rows", "launch_vocab_chunk_grad",
    "launch_vocab_chunk_stats", "linear_fp32", "linear_into", "load_grad_rows", "load_hinted", "load_rows",
    "load_scaled_with_slope", "load_tile", "load_trig", "local_column", "logprobs_chunk_grad_kernel",
    "logprobs_chunk_stats_kernel", "logprobs_tiles_combine_kernel", "logprobs_tiles_kernel",
    "matmul_accumulate", "matmul_to", "next_power_of_2", "pow2_at_most", "norm_backward_launch", "norm_launch",
    "option_flags", "part_chunks", "part_rows", "partial_rows_sum_kernel", "persistent_programs", "prehash_triton_key",
    "programs_per_sm", "publish_part_sums", "q_or_k", "read_row_sums", "reciprocal_1_to_2",
    "reduction_scales_kernel", "rms_norm_forward_launch", "rms_norm_output_dtype", "row_launch", "row_loss",
    "row_scale_args", "rows_counted", "scale_lazily", "scale_rows_kernel", "scaled_logits",
    "scaled_with_slope", "shapes_only", "signed_softcap", "softcap_args", "softcap_shift", "softcap_slope",
    "softcapped", "split_forward_launch", "split_rows_scratch", "stable_sigmoid", "stats_block",
    "stats_update", "store_hinted", "store_rotation", "store_zeros", "stream_grad", "stream_stats",
    "streamed_launch", "sum_partial_rows", "sum_round", "sum_round_available", "sum_round_reference",
    "sum_round_tiles_kernel", "sum_rows_to", "tanh_parts", "target_terms", "tile_indices", "tile_launch",
    "tile_position", "tile_programs", "tiles_available", "tma_operands", "tma_rows", "token_tile_rows",
    "tracing_active", "wait_for_triton_key", "warps_for", "wrap_triton",
]
