r"""Fused linear + cross-entropy: the loss of ``input @ linear_weight.T + linear_bias`` without its logits.

With X (N, H) the tokens, W (V, H) the head, b (V,) its bias and L = X·Wᵀ + b the logits::

    loss = cross_entropy(L, target, ...)               every option of tigon.ops.cross_entropy
    dL   = ∂loss/∂L                                     (N, V), from the one-pass CE kernel
    dX   = dL·W          dW = dLᵀ·X          db = Σ_rows dL

L is never held whole: it is produced one chunk at a time by cuBLAS (``torch.mm`` on chunks big
enough to run near the tensor-core peak), turned into dL in place by the CE kernel (bf16 in, bf16
out), and consumed by the two gradient matmuls before the next chunk is made. All gradients are
computed in the forward; the backward only applies ``grad_output`` (a row-scaling kernel that
skips factors of 1, see cross_entropy.py), except for ``reduction="none"``, whose per-token
grad_output must weigh each token's dL before it is summed into dW: that backward recomputes.

Three chunkings, chosen by :func:`chunk_plan` from the sizes alone:

* by tokens (C rows of L at a time): 3 matmuls in all (6·N·H·V flops), but W is read twice and
  dW read and written once per chunk, and dW is summed over N/C chunks in the weight's dtype.
  Summing k bf16 partials drifts: measured relative error of dW against fp64 with random data is
  1.7e-3 for k = 1, 3.5e-3 for k = 8, 4.7e-3 for k = 16, 6.5e-3 for k = 32 (the final rounding
  alone gives 1.7e-3). So by-tokens is used only when the chunk allowed by the memory budget gives
  k ≤ max_token_chunks (12, ≈ 4.2e-3 < the 5e-3 target).
* by tokens with an fp32 dW accumulator (``ChunkPlan.fp32_dw``, a bf16/fp16 weight): the same 3
  matmuls, the dW matmul adding its fp32 product into the accumulator itself (``out_dtype``), and
  dW rounded to its dtype once at the end: exact to one rounding, as an unfused loss's dW. The price
  is memory, 4·V·H bytes of accumulator, and per chunk a read and a write of it (8·V·H bytes for
  2·C·V·H flops), so the chunks are as large as the budget allows and never under
  fp32_dw_min_token_chunk (1024) tokens. Its budget is not the gradients' (1.35× of 0.29 GB at the
  small head below leaves room for no accumulator at all) but ``logits_fraction`` (0.6) of the
  bytes of the whole logits N·V·2, which eager and torch.compile hold (compile's peak at the
  small head is 1.9× those bytes), and never more than ``fp32_dw_max_bytes`` (1.5 GiB): a long
  sequence, whose logits grow with N, keeps the small plans of the memory it trains in. Used
  whenever by tokens in the weight's dtype would take more than one chunk and accumulator + chunk
  fit that budget. In bf16, 4·V·H + 2·C·V ≤ 0.6·2·N·V (dX aside) is H ≤ (1.2·N − 2·C)/4, V
  cancelling: at N = 8192 and C = 1024, H ≤ 1945, so only the small heads get it; the 1.5 GiB cap
  then asks 4·V·H + 2·V·H (the rounded dW) ≤ 1.61 GB, V·H ≤ 268M (Qwen2.5's 151936 × 896 = 136M;
  Llama-3.2-1B's 128256 × 2048 = 263M passes the logits budget at N = 8192 first). Each chunk's dW
  matmul reads and writes the accumulator, so chunks are as large as the budget allows: that
  traffic (8·V·H bytes a chunk) is what the plan pays over an unfused loss's single dW matmul
  (measured clearly slower at the small head than the same matmul into bf16 without accumulating;
  docs/tuning.md, "Timings quoted in the source"). Off the GPU
  the matmul cannot add into fp32 itself: each chunk's product is rounded to bf16 first, then
  summed in fp32 (the running sum is no longer rounded to bf16). The last chunk's matmul adds its
  product to the accumulator and rounds the sum to dW's dtype itself (``_kernels/add_round_matmul.py``,
  ``ChunkPlan.sum_round``, on a GPU with TMA): no cast kernel, and 6·V·H bytes fewer
  (measured faster than cuBLAS's sum and the cast at the small head's last chunk; docs/tuning.md,
  "Timings quoted in the source"). It
  writes dW while it reads the chunk and the accumulator, so the plan cuts the last chunk to what
  fits beside dW (fp32_dw_plan), unless that would take a chunk more.
* by classes (all N tokens × Vc classes at a time): pass 1 makes every chunk once for the row
  statistics (lse), pass 2 makes each again (the last one is still there) and writes dL, then
  dW[chunk] = dLᵀ·X in one matmul over all tokens (one rounding) and dX += dL·W[chunk] in fp32.
  4 matmuls (8·N·H·V flops) but exact to one rounding and with large matmuls (K = N for dW, M = N
  for the others) even when H is small. Used when neither by-tokens plan fits: small H makes the
  gradients small, hence the memory budget and C small (H = 2048, V = 128256: 16 chunks of 512),
  while the accumulator and the rounded dW pass the logits budget (1.58 GB against 1.26 GB).

Memory beyond the inputs: the gradients (dX, dW, db) plus one chunk of L, sized to
``workspace_fraction`` of the gradient bytes (at least ``min_workspace_bytes``; both in
:class:`FusedLinearCrossEntropyConfig`; by tokens in dW's dtype, up to ``max_workspace_fraction`` where
that gives chunks of ``min_token_chunk`` tokens, 1024, when the first budget gives fewer), plus fp32
per-token state and, by classes, an fp32 dX
accumulator (dX in its own dtype is made from it after the chunk buffer is freed, so the
accumulator takes its place in the budget). With the fp32 dW accumulator (:func:`fp32_dw_peak_bytes`):
dX + accumulator + one chunk + the loss rows while chunks are made; dX + accumulator + dW + the last
chunk while the add-and-round matmul rounds dW (or without the last chunk, freed before the cast).
The plans this makes at the benchmark heads (N = 8192, bf16), with their peaks: docs/tuning.md,
"fused_linear_cross_entropy".

Under torch.compile the chunked passes are one opaque op (``tigon::fused_linear_cross_entropy_passes``,
``_regrad`` for reduction="none"'s backward; ``tigon._kernels.OpaqueOp``): planned and run on the real
sizes when the graph runs, exactly as in eager mode, so one graph serves every number of tokens (traced,
the loop would bake its chunk bounds into the graph: a recompile per sequence length).

Under ``torch.autocast`` input, weight and bias are cast to the autocast dtype, as F.linear does;
the loss math is fp32 regardless. Gradients come back in each argument's own dtype (an fp32 master
weight gets an fp32 dW; by tokens it is accumulated from per-chunk partials in fp32, as the
fp32_dw plan accumulates a 16-bit one).

Reference: :func:`fused_linear_cross_entropy_reference` (F.linear, then cross_entropy_reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tigon._kernels import (
    REDUCTION_SCALES,
    VOCAB_CHUNK_GRAD,
    VOCAB_CHUNK_STATS,
    LossOptions,
    OpaqueOp,
    RangeCheck,
    apply_grad_output,
    autocast_off,
    check_tensor,
    chunk_buffer,
    chunk_view,
    class_chunks,
    compute_operands,
    head_compute_dtype,
    linear_into,
    matmul_accumulate,
    sum_round,
    sum_round_available,
)
from tigon.ops.cross_entropy import (
    CROSS_ENTROPY_FWD,
    CROSS_ENTROPY_FWD_INPLACE,
    check_loss_options,
    check_target,
    cross_entropy_reference,
)

try:  # refused as linear_weight (FSDP2 shards, tensor-parallel heads: vocab_parallel_cross_entropy.py)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = ()

# -------------------------------------------------------------------------------------- chunk planning


@dataclass(frozen=True)
class FusedLinearCrossEntropyConfig:
    """How the logits are cut into chunks (docs/tuning.md, "fused_linear_cross_entropy"). The
    vocabulary-chunk kernels' own block sizes and warps are ``tigon._kernels.VocabChunkConfig``."""

    # One chunk of logits may take this fraction of the bytes of the gradients the op returns (a
    # peak of 1.35× the gradients is the budget; the rest covers per-token state and rounding).
    workspace_fraction: float = 0.33
    # Below this, chunks are never made smaller: small problems run as one chunk.
    min_workspace_bytes: int = 64 << 20
    # By tokens, dW is a sum of this many partials at most in the weight's dtype (accuracy).
    max_token_chunks: int = 12
    # By tokens in dW's 16-bit dtype, chunks get at least this many tokens where that takes at most
    # max_workspace_fraction of the gradients' bytes: each chunk's dW matmul (K = its tokens) reads and
    # writes all of dW, and short ones run below the matmul's rate. At Gemma-2-2B's head (H = 2304,
    # V = 256000, N = 8192) fewer chunks of 1024 measured faster than more of 768 for a little more
    # workspace (dev/tune_flce_token_chunks.py; docs/tuning.md, "Timings quoted in the source"); at
    # Llama-3-8B's, where the budget gives 1280, larger chunks were no faster.
    min_token_chunk: int = 1024
    max_workspace_fraction: float = 0.45
    # By tokens with an fp32 dW, each chunk's dW matmul reads and writes all of dW (8·V·H bytes) for
    # 2·C·V·H flops, C/4 flops per byte: at C ≥ 512 tokens that is ≥ 128 flops per byte.
    min_fp32_token_chunk: int = 512
    # ... and the GPU's matmul needs a few hundred flops per byte (its peak matmul rate over its
    # memory bandwidth; docs/tuning.md, "Timings quoted in the source") not to wait
    # on that read and write: with an fp32 dW, token chunks get at least this many tokens (when
    # there are as many) even past the workspace budget, C·V·2 bytes of logits (1 GB at V = 256000).
    fp32_token_chunk: int = 2048
    # A 16-bit dW may instead be summed in an fp32 accumulator by tokens (chunk_plan): that plan's
    # peak beyond the inputs (gradients, accumulator, one chunk of logits) may reach this fraction of
    # the bytes of the whole logits in the compute dtype, N·V·2 in bf16, which eager and
    # torch.compile hold (with their gradient besides) ...
    logits_fraction: float = 0.6
    # ... and never more than this many bytes (long sequences keep the plans that save memory).
    fp32_dw_max_bytes: int = 3 << 29
    # ... with token chunks of at least this many tokens: each chunk's dW matmul reads and writes the
    # fp32 accumulator (8·V·H bytes) for 2·C·V·H flops, C/4 flops per byte (256 at C = 1024).
    fp32_dw_min_token_chunk: int = 1024
    # Chunk sizes are multiples of these: whole 256-row and 512-column blocks divide evenly into
    # cuBLAS's tiles (and the chunk kernels' column blocks).
    token_align: int = 256
    class_align: int = 512
    # With the fp32 dW accumulator, the last chunk's dW matmul adds its product to the accumulator and
    # rounds the sum to dW's dtype itself (_kernels/add_round_matmul.py) instead of cuBLAS's sum and a cast
    # kernel: None where the device decides (a GPU with TMA, eager mode), True wherever the operands
    # allow (the interpreter too), False never.
    sum_round: bool | None = None


CONFIG = FusedLinearCrossEntropyConfig()
# By classes: bytes per token·hidden of the fp32 dX accumulator; by tokens with fp32_dw, bytes per
# class·hidden of the fp32 dW accumulator.
DX_ACCUMULATOR_BYTES = 4
DW_ACCUMULATOR_BYTES = 4
# fp32 loss rows: one chunk's, then all of them concatenated.
LOSS_ROW_BYTES = 8


@dataclass(frozen=True)
class ChunkPlan:
    """How the logits are cut: ``size`` tokens per chunk (by_tokens) or ``size`` classes per chunk;
    ``fp32_dw``: by tokens, dW is summed over the chunks in fp32 and rounded to its dtype once;
    ``last``: by tokens, the final chunk takes this many tokens (at most ``size``; 0: what remains);
    ``sum_round``: with fp32_dw, the last chunk, the accumulator and dW rounded from it fit the budget
    together (the add-and-round matmul may write dW while it reads the other two)."""

    by_tokens: bool
    size: int
    fp32_dw: bool = False
    last: int = 0
    sum_round: bool = False

    def token_chunks(self, num_tokens: int) -> list[tuple[int, int]]:
        """(start, end) of each token chunk: ``size`` tokens each, then ``last`` (or what remains)."""
        body = max(num_tokens - self.last, 0) if 0 < self.last < num_tokens else num_tokens
        chunks = [(c0, min(body, c0 + self.size)) for c0 in range(0, body, self.size)]
        return chunks + ([(body, num_tokens)] if body < num_tokens else [])


def chunk_plan(
    num_tokens: int, vocab: int, hidden: int, elem_size: int, *, dx_size: int | None = None,
    dw_size: int | None = None, config: FusedLinearCrossEntropyConfig | None = None,
) -> ChunkPlan:
    """Chunking for N tokens, V classes, H hidden, logits of ``elem_size`` bytes (see module docs).

    ``dx_size`` and ``dw_size`` are the element sizes of the gradients returned for the input and
    the weight (default: ``elem_size``). An fp32 weight gradient (the fp32 master weight of mixed
    precision) is summed over token chunks in fp32, so the max_token_chunks accuracy limit does not
    apply to it; its chunks get fp32_token_chunk tokens at least, past the workspace budget if need
    be, so that the dW matmul (K = the chunk's tokens) is bound by its flops rather than by the read
    and write of the fp32 dW. A 16-bit weight gradient that would take more than one token chunk
    is summed in an fp32 accumulator when that fits the logits_fraction budget
    (:func:`fp32_dw_plan`), else by tokens in its dtype (at most max_token_chunks) or by classes.
    """
    config = config or CONFIG
    dx_size = elem_size if dx_size is None else dx_size
    dw_size = elem_size if dw_size is None else dw_size
    gradient_bytes = num_tokens * hidden * dx_size + vocab * hidden * dw_size
    workspace = max(config.workspace_fraction * gradient_bytes, config.min_workspace_bytes)
    tokens_fit = int(workspace // (vocab * elem_size))
    if dw_size >= 4:
        tokens_fit = max(tokens_fit, config.fp32_token_chunk)
    if tokens_fit >= num_tokens:
        return ChunkPlan(True, max(num_tokens, 1))
    if dw_size < DW_ACCUMULATOR_BYTES:
        plan = fp32_dw_plan(num_tokens, vocab, hidden, elem_size, dx_size=dx_size, dw_size=dw_size, config=config)
        if plan is not None:
            return plan
    tokens_fit = tokens_fit // config.token_align * config.token_align
    if dw_size < 4 and tokens_fit < config.min_token_chunk:
        wider = config.max_workspace_fraction * gradient_bytes
        if config.min_token_chunk * vocab * elem_size <= wider:
            tokens_fit = config.min_token_chunk
    chunks = -(-num_tokens // tokens_fit) if tokens_fit > 0 else None
    fp32_sum = dw_size >= 4 and tokens_fit >= config.min_fp32_token_chunk
    if chunks is not None and (fp32_sum or chunks <= config.max_token_chunks):
        return ChunkPlan(True, _balanced(num_tokens, tokens_fit, config.token_align))
    # By classes, dX in its own dtype is made from the fp32 accumulator only after the last chunk
    # (the chunk buffer is freed first), so while chunks are made the accumulator stands in for it.
    accumulator = num_tokens * hidden * (DX_ACCUMULATOR_BYTES - dx_size)
    classes_fit = int((workspace - accumulator) // (num_tokens * elem_size))
    return ChunkPlan(False, min(vocab, max(config.class_align, classes_fit // config.class_align * config.class_align)))


def _balanced(num_tokens, tokens_fit, align):
    """The fewest chunks of at most ``tokens_fit`` tokens, made as even as ``align`` allows."""
    chunks = -(-num_tokens // tokens_fit)
    size = -(-num_tokens // chunks)
    return min(tokens_fit, -(-size // align) * align)


def fp32_dw_peak_bytes(
    num_tokens: int, vocab: int, hidden: int, elem_size: int, chunk: int, *, dx_size: int, dw_size: int,
    last: int | None = None,
) -> int:
    """Peak bytes beyond the inputs, by tokens with an fp32 dW accumulator and ``chunk`` tokens of
    logits: while the chunks are made, dX + the accumulator + one chunk + the loss rows; then dX + the
    accumulator + dW rounded to its dtype, after the chunk buffer is freed (``last`` None: cuBLAS's sum,
    then a cast) or beside the ``last`` tokens of the final chunk, whose buffer is made anew at its size
    (the add-and-round matmul writes dW while it reads them and the accumulator). A bias adds its fp32
    sum and its gradient, (4 + its size)·V bytes (under 0.1% at the benchmark heads)."""
    dx = num_tokens * hidden * dx_size
    accumulator = vocab * hidden * DW_ACCUMULATOR_BYTES
    loss_rows = num_tokens * LOSS_ROW_BYTES
    making = dx + accumulator + chunk * vocab * elem_size + loss_rows
    rounding = dx + accumulator + vocab * hidden * dw_size
    if last is not None:
        rounding += last * vocab * elem_size + loss_rows
    return max(making, rounding)


def fp32_dw_plan(
    num_tokens: int, vocab: int, hidden: int, elem_size: int, *, dx_size: int, dw_size: int,
    config: FusedLinearCrossEntropyConfig | None = None,
) -> ChunkPlan | None:
    """By tokens with an fp32 dW accumulator, in chunks as large as logits_fraction of the whole
    logits' bytes (at most fp32_dw_max_bytes) allows once dX and the accumulator are counted
    (fp32_dw_peak_bytes); None when chunks of fp32_dw_min_token_chunk tokens do not fit. One chunk
    of all the tokens needs no accumulator: dW is then one matmul, rounded once in its own dtype.

    The last chunk may also hold dW rounded from the accumulator (``sum_round``: the add-and-round
    matmul writes it while it reads the chunk): where even chunks would not leave room for it, the
    last chunk is cut to what fits and the others share the rest evenly; where no last chunk of
    token_align tokens fits beside dW, or only with a chunk more than even chunks take, the last chunk's
    product is summed by cuBLAS like the others and dW cast once the chunks are freed. At N = 8192,
    V = 151936, H = 896 in bf16: 2 chunks of 3072 tokens and a last one of 2048 (1.49 GB, the budget,
    while the chunks are made; 1.45 GB in the last one), where 3 even chunks of 2816 would take
    1.61 GB in the last one."""
    config = config or CONFIG
    align = config.token_align
    budget = min(config.logits_fraction * num_tokens * vocab * elem_size, config.fp32_dw_max_bytes)
    held = num_tokens * hidden * dx_size + vocab * hidden * DW_ACCUMULATOR_BYTES   # dX + accumulator
    dw_bytes = vocab * hidden * dw_size
    if held + dw_bytes > budget:                                                   # the final rounding
        return None
    room = budget - held - num_tokens * LOSS_ROW_BYTES                              # for one chunk
    row_bytes = vocab * elem_size
    tokens_fit = int(room // row_bytes) // align * align
    if tokens_fit < max(config.fp32_dw_min_token_chunk, align):
        return None
    if tokens_fit >= num_tokens:
        return ChunkPlan(True, num_tokens)
    even = _balanced(num_tokens, tokens_fit, align)
    last_fit = int((room - dw_bytes) // row_bytes) // align * align                 # beside dW
    if last_fit >= align:
        if num_tokens - (-(-num_tokens // even) - 1) * even <= last_fit:             # even chunks fit
            return ChunkPlan(True, even, fp32_dw=True, sum_round=True)
        # The fewest chunks, k − 1 of at most tokens_fit and a last one of at most last_fit: the
        # others share what the last one leaves as evenly as they can (aligned where that leaves
        # the last token_align tokens at least), the last takes the rest (at most last_fit, and
        # fewer than the others: they are larger than the even size).
        chunks = 1 + -(-(num_tokens - last_fit) // tokens_fit)
        if chunks > -(-num_tokens // even):  # a chunk more (8·V·H bytes of the accumulator) costs more
            return ChunkPlan(True, even, fp32_dw=True)                    # than the cast (6·V·H)
        size = -(-(num_tokens - last_fit) // (chunks - 1))
        aligned = -(-size // align) * align
        if aligned <= tokens_fit and num_tokens - (chunks - 1) * aligned >= align:
            size = aligned
        last = num_tokens - (chunks - 1) * size
        if last > 0:
            return ChunkPlan(True, size, fp32_dw=True, last=last, sum_round=True)
    return ChunkPlan(True, even, fp32_dw=True)


# ------------------------------------------------------------------------------------ chunked passes


def _mm_into(out, a, b):
    """out[...] = a @ b; written by the matmul itself when the dtypes allow it (eager mode)."""
    if out.dtype == a.dtype and not torch.compiler.is_compiling():
        torch.mm(a, b, out=out)
    else:
        out.copy_(a @ b)


def _by_tokens(x, w, b, target, class_weight, scales, row_scale, need, opts, plan, grad_dtypes):
    """Loss rows and (dx, dw, db) with the logits made C = ``plan.size`` tokens at a time.

    dW is summed over the chunks in its own dtype, or with ``plan.fp32_dw`` in an fp32 accumulator
    (by the matmul itself on the GPU) and rounded to its dtype once: by the last chunk's add-and-round
    matmul where the plan has room for it (``plan.sum_round``) and it runs (``CONFIG.sum_round``), else
    by a cast once the chunk buffer is freed. With ``plan.sum_round`` a last chunk smaller than the
    others gets a buffer of its own size (fp32_dw_peak_bytes).
    """
    need_dx, need_dw, need_db = need
    num_tokens, vocab = x.shape[0], w.shape[0]
    any_grad = need_dx or need_dw or need_db
    dx_dtype, dw_dtype, db_dtype = grad_dtypes
    dw_sum_dtype = torch.float32 if plan.fp32_dw else dw_dtype
    dx = torch.empty(x.shape, dtype=dx_dtype, device=x.device) if need_dx else None
    # no tokens, no chunks: dW is the empty sum
    dw = (torch.empty if num_tokens else torch.zeros)(w.shape, dtype=dw_sum_dtype, device=x.device) if need_dw else None
    db = torch.zeros(vocab, dtype=torch.float32, device=x.device) if need_db else None
    chunks = plan.token_chunks(num_tokens)
    buffer_rows = max([0] + [c1 - c0 for c0, c1 in chunks])
    buffer = chunk_buffer(buffer_rows * vocab, x.dtype, x.device)
    logits = dlogits = None
    losses = []
    for i, (c0, c1) in enumerate(chunks):
        x_c = x[c0:c1]
        is_last = i == len(chunks) - 1
        if is_last and plan.sum_round and buffer is not None and c1 - c0 < buffer_rows:
            logits = dlogits = buffer = None                               # freed before the smaller one is made
            buffer = chunk_buffer((c1 - c0) * vocab, x.dtype, x.device)
        logits = linear_into(x_c, w, b, chunk_view(buffer, c1 - c0, vocab))       # (C, V)
        if not any_grad:
            loss_c, _ = CROSS_ENTROPY_FWD(logits, target[c0:c1], class_weight, scales, *opts.args(), False)
            losses.append(loss_c)
            continue
        row_scale_c = row_scale[c0:c1] if row_scale is not None else None
        losses.append(CROSS_ENTROPY_FWD_INPLACE(
            logits, target[c0:c1], class_weight, scales, row_scale_c, *opts.args()
        ))
        dlogits = logits                                                   # (C, V), overwritten in place
        if need_dx:
            _mm_into(dx[c0:c1], dlogits, w)                                # (C, H)
        if need_dw and is_last and i > 0 and plan.sum_round and dw.dtype != dw_dtype and dw_dtype == x.dtype \
                and sum_round_available(dlogits, x_c, CONFIG.sum_round):
            rounded = torch.empty(w.shape, dtype=dw_dtype, device=x.device)
            dw = sum_round(dlogits, x_c, dw, rounded)                      # (V, H): round(acc + dlᵀ·X_c)
        elif need_dw:
            matmul_accumulate(dw, dlogits.t(), x_c, first=i == 0)          # (V, H)
        if need_db:
            db += dlogits.sum(0, dtype=torch.float32)
    logits = dlogits = buffer = None  # freed before the accumulator is rounded (fp32_dw_peak_bytes)
    if need_dw and dw.dtype != dw_dtype:
        dw = dw.to(dw_dtype)
    if not losses:
        losses = [torch.zeros(0, dtype=torch.float32, device=x.device)]
    loss_rows = torch.cat(losses) if len(losses) > 1 else losses[0]
    return loss_rows, dx, dw, (db.to(db_dtype) if need_db else None)


def _lse_by_classes(x, w, b, target, class_weight, scales, opts, chunk, buffer):
    """Pass 1 by classes: per-row losses and lse; returns them and the last chunk's logits."""
    num_tokens, vocab = x.shape[0], w.shape[0]
    state = torch.empty(4, num_tokens, dtype=torch.float32, device=x.device)
    state[0] = float("-inf")     # running max
    state[1] = 0.0               # Σ exp(z − max)
    state[2] = 0.0               # Σ w·z (label smoothing)
    state[3] = float("nan")      # z of the target: stays NaN for a target outside [0, V)
    loss_rows = torch.empty(num_tokens, dtype=torch.float32, device=x.device)
    lse = torch.empty(num_tokens, dtype=torch.float32, device=x.device)
    chunks = class_chunks(vocab, chunk)
    logits = None
    for i, (c0, c1) in enumerate(chunks):
        logits = linear_into(x, w[c0:c1], b[c0:c1] if b is not None else None, chunk_view(buffer, num_tokens, c1 - c0))
        is_last = i == len(chunks) - 1
        VOCAB_CHUNK_STATS(
            logits, target, class_weight, scales, state, loss_rows, lse, c0, vocab, is_last, *opts.args()
        )
    return loss_rows, lse, logits


def _by_classes(x, w, b, target, class_weight, scales, row_scale, need, opts, chunk, grad_dtypes, lse=None):
    """Loss rows and (dx, dw, db) with the logits made ``chunk`` classes (all tokens) at a time.

    ``lse`` (from an earlier pass 1) skips pass 1: the backward of reduction="none" recomputes only
    the gradient pass.
    """
    need_dx, need_dw, need_db = need
    num_tokens, vocab = x.shape[0], w.shape[0]
    dx_dtype, dw_dtype, db_dtype = grad_dtypes
    buffer = chunk_buffer(num_tokens * min(chunk, vocab), x.dtype, x.device)
    chunks = class_chunks(vocab, chunk)
    logits = None
    loss_rows = None
    if lse is None:
        loss_rows, lse, logits = _lse_by_classes(x, w, b, target, class_weight, scales, opts, chunk, buffer)
    if not (need_dx or need_dw or need_db):
        return loss_rows, lse, None, None, None
    dx32 = torch.empty(x.shape, dtype=torch.float32, device=x.device) if need_dx else None
    dw = torch.empty(w.shape, dtype=dw_dtype, device=x.device) if need_dw else None
    db = torch.empty(vocab, dtype=db_dtype, device=x.device) if need_db else None
    # Last chunk first: pass 1 left its logits in the buffer, so it needs no second matmul.
    for i, (c0, c1) in enumerate(reversed(chunks)):
        w_c = w[c0:c1]
        if logits is None:
            logits = linear_into(x, w_c, b[c0:c1] if b is not None else None, chunk_view(buffer, num_tokens, c1 - c0))
        VOCAB_CHUNK_GRAD(logits, target, class_weight, scales, row_scale, lse, c0, vocab, *opts.args())
        dlogits = logits                                                   # (N, Vc), overwritten in place
        if need_dw:
            _mm_into(dw[c0:c1], dlogits.t(), x)                            # (Vc, H): one matmul, K = N
        if need_dx:
            matmul_accumulate(dx32, dlogits, w_c, first=i == 0)            # (N, H), fp32 sum over chunks
        if need_db:
            db[c0:c1] = dlogits.sum(0, dtype=torch.float32)
        logits = dlogits = None
    buffer = None  # freed before dX is made in its own dtype (chunk_plan counts on it)
    return loss_rows, lse, (dx32.to(dx_dtype) if need_dx else None), dw, db


# ------------------------------------------------------------------------------ the passes as one op


def _plan(x, w, dx_dtype, dw_dtype):
    """The chunking of this head (chunk_plan), from the compute operands and the gradients' dtypes."""
    return chunk_plan(
        x.shape[0], w.shape[0], x.shape[1], x.element_size(), dx_size=dx_dtype.itemsize, dw_size=dw_dtype.itemsize,
    )


def _wanted(t, dtype, device):
    """``t``, or an empty (0,) tensor where the output is not wanted (a registered op returns no None)."""
    return t if t is not None else torch.empty(0, dtype=dtype, device=device)


def _passes_impl(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor, class_weight: torch.Tensor | None,
    scales: torch.Tensor, ignore_index: int, label_smoothing: float, z_loss: float, softcap: float | None,
    logit_scale: float, need_dx: bool, need_dw: bool, need_db: bool, keep_lse: bool, dx_dtype: torch.dtype,
    dw_dtype: torch.dtype, db_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's chunked passes over the compute operands x (N, H), w (V, H), b (V,): loss rows (N,)
    fp32; lse (N,) fp32 where ``keep_lse`` (by classes: the rows' log-sum-exp, which the backward of
    reduction="none" reuses; by tokens zeros, unused), else (0,); dx (N, H), dw (V, H), db (V,) in their
    dtypes where needed (for grad_output = 1), else (0,)."""
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap, logit_scale)
    need, grad_dtypes = (need_dx, need_dw, need_db), (dx_dtype, dw_dtype, db_dtype)
    plan = _plan(x, w, dx_dtype, dw_dtype)
    with torch.no_grad(), autocast_off(x.device):
        if plan.by_tokens:
            loss_rows, dx, dw, db = _by_tokens(
                x, w, b, target, class_weight, scales, None, need, opts, plan, grad_dtypes
            )
            lse = torch.zeros_like(loss_rows) if keep_lse else None
        else:
            loss_rows, lse, dx, dw, db = _by_classes(
                x, w, b, target, class_weight, scales, None, need, opts, plan.size, grad_dtypes
            )
    return (
        loss_rows, _wanted(lse if keep_lse else None, torch.float32, x.device), _wanted(dx, dx_dtype, x.device),
        _wanted(dw, dw_dtype, x.device), _wanted(db, db_dtype or torch.float32, x.device),
    )


def _passes_fake(
    x, w, b, target, class_weight, scales, ignore_index, label_smoothing, z_loss, softcap, logit_scale,
    need_dx, need_dw, need_db, keep_lse, dx_dtype, dw_dtype, db_dtype,
):
    """The outputs' shapes from the symbolic sizes, none of them read as a number (no chunk plan)."""
    (num_tokens, hidden), vocab = x.shape, w.shape[0]
    f32 = torch.float32
    return (
        x.new_empty(num_tokens, dtype=f32), x.new_empty(num_tokens if keep_lse else 0, dtype=f32),
        x.new_empty((num_tokens, hidden) if need_dx else (0,), dtype=dx_dtype),
        x.new_empty((vocab, hidden) if need_dw else (0,), dtype=dw_dtype),
        x.new_empty(vocab if need_db else 0, dtype=db_dtype or f32),
    )


def _regrad_impl(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor, class_weight: torch.Tensor | None,
    scales: torch.Tensor, row_scale: torch.Tensor, lse: torch.Tensor, ignore_index: int, label_smoothing: float,
    z_loss: float, softcap: float | None, logit_scale: float, need_dx: bool, need_dw: bool, need_db: bool,
    dx_dtype: torch.dtype, dw_dtype: torch.dtype, db_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of reduction="none": the gradient pass again, each token's dL weighed by its
    ``row_scale`` (grad_output) before dW sums over tokens; by classes from the forward's ``lse``."""
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap, logit_scale)
    need, grad_dtypes = (need_dx, need_dw, need_db), (dx_dtype, dw_dtype, db_dtype)
    plan = _plan(x, w, dx_dtype, dw_dtype)
    with torch.no_grad(), autocast_off(x.device):
        if plan.by_tokens:
            _, dx, dw, db = _by_tokens(x, w, b, target, class_weight, scales, row_scale, need, opts, plan, grad_dtypes)
        else:
            _, _, dx, dw, db = _by_classes(
                x, w, b, target, class_weight, scales, row_scale, need, opts, plan.size, grad_dtypes, lse=lse
            )
    return (
        _wanted(dx, dx_dtype, x.device), _wanted(dw, dw_dtype, x.device),
        _wanted(db, db_dtype or torch.float32, x.device),
    )


def _regrad_fake(
    x, w, b, target, class_weight, scales, row_scale, lse, ignore_index, label_smoothing, z_loss, softcap,
    logit_scale, need_dx, need_dw, need_db, dx_dtype, dw_dtype, db_dtype,
):
    return _passes_fake(
        x, w, b, target, class_weight, scales, ignore_index, label_smoothing, z_loss, softcap, logit_scale,
        need_dx, need_dw, need_db, False, dx_dtype, dw_dtype, db_dtype,
    )[2:]


# One opaque op each: one compiled graph for every number of tokens (module docs, "Under torch.compile")
FLCE_PASSES = OpaqueOp("fused_linear_cross_entropy_passes", _passes_impl, _passes_fake)
FLCE_REGRAD = OpaqueOp("fused_linear_cross_entropy_regrad", _regrad_impl, _regrad_fake)


# ------------------------------------------------------------------------------------------- autograd


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Gradients in the forward (chunked); the backward applies grad_output lazily."""

    @staticmethod
    def forward(
        ctx, input, linear_weight, linear_bias, target, weight, scales, ignore_index, label_smoothing,
        reduction, z_loss, softcap, logit_scale, compute_dtype, need_input, need_weight, need_bias,
    ):
        with autocast_off(input.device):
            x, w, b = compute_operands(input, linear_weight, linear_bias, compute_dtype)
        options = (ignore_index, label_smoothing, z_loss, softcap, logit_scale)
        need = (need_input, need_weight, need_bias)
        grad_dtypes = (input.dtype, linear_weight.dtype, linear_bias.dtype if linear_bias is not None else None)
        grads_now = any(need) and reduction != "none"
        now = need if grads_now else (False, False, False)
        keep_lse = any(need) and not grads_now
        loss_rows, lse, dx, dw, db = FLCE_PASSES(
            x, w, b, target.reshape(-1), weight, scales, *options, *now, keep_lse, *grad_dtypes
        )
        ctx.reduction, ctx.options, ctx.need = reduction, options, need
        ctx.compute_dtype, ctx.grad_dtypes, ctx.input_shape = compute_dtype, grad_dtypes, input.shape
        if grads_now:
            applied = [
                torch.ones(rows, dtype=torch.float32, device=x.device) for rows in (x.shape[0], w.shape[0], 1)
            ]
            ctx.save_for_backward(*(g if n else None for g, n in zip((dx, dw, db), need, strict=True)), *applied)
        elif any(need):
            # reduction="none": each token's grad_output weighs its dL before dW sums over tokens, so
            # the backward recomputes the gradient pass (by classes it reuses lse).
            ctx.save_for_backward(input, linear_weight, linear_bias, target, weight, scales, lse)
        return loss_rows if reduction == "none" else loss_rows.sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if ctx.reduction != "none":
            dx, dw, db, applied_x, applied_w, applied_b = ctx.saved_tensors
            dx, dw, db = apply_grad_output(ctx, grad_loss, [(dx, applied_x), (dw, applied_w), (db, applied_b)])
            dx = dx.view(ctx.input_shape) if dx is not None else None
            return (dx, dw, db) + (None,) * 13
        input, linear_weight, linear_bias, target, weight, scales, lse = ctx.saved_tensors
        with autocast_off(grad_loss.device):
            x, w, b = compute_operands(input, linear_weight, linear_bias, ctx.compute_dtype)
        dx, dw, db = FLCE_REGRAD(
            x, w, b, target.reshape(-1), weight, scales, grad_loss.reshape(-1), lse, *ctx.options, *ctx.need,
            *ctx.grad_dtypes,
        )
        dx = dx.view(ctx.input_shape) if ctx.need[0] else None
        return (dx, dw if ctx.need[1] else None, db if ctx.need[2] else None) + (None,) * 13


# ------------------------------------------------------------------------------------ public function


def check_linear_head(input, linear_weight, linear_bias):
    """``input [..., H]``, ``linear_weight (V, H)``, ``linear_bias (V,)`` or None on one device: V."""
    check_tensor(input, "input")
    if input.dim() == 0:
        raise ValueError("input must have at least one dimension (the hidden dimension is the last)")
    check_tensor(linear_weight, "linear_weight", device=input.device)
    if linear_weight.dim() != 2 or linear_weight.shape[1] != input.shape[-1] or linear_weight.shape[0] == 0:
        raise ValueError(
            f"linear_weight has shape {tuple(linear_weight.shape)}, "
            f"expected (V, {input.shape[-1]}) with V > 0"
        )
    vocab = linear_weight.shape[0]
    if linear_bias is not None:
        check_tensor(linear_bias, "linear_bias", device=input.device)
        if linear_bias.shape != (vocab,):
            raise ValueError(f"linear_bias has shape {tuple(linear_bias.shape)}, expected ({vocab},)")
    return vocab


def fused_linear_cross_entropy(
    input,
    linear_weight,
    target,
    *,
    linear_bias=None,
    weight=None,
    ignore_index=-100,
    label_smoothing=0.0,
    reduction="mean",
    z_loss=0.0,
    softcap=None,
    logit_scale=1.0,
):
    """``cross_entropy(input @ linear_weight.T + linear_bias, target, ...)`` without the full logits.

    ``input`` is ``[..., H]``, ``linear_weight`` ``(V, H)``, ``linear_bias`` ``(V,)`` or None,
    ``target`` ``input.shape[:-1]``; ``weight`` (V,) are class weights. Options and their semantics
    are those of :func:`tigon.ops.cross_entropy.cross_entropy` (``reduction="none"`` returns (N,)).
    Gradients flow to input, linear_weight and linear_bias. With ``reduction="sum"`` divided by the
    caller's ``num_items_in_batch`` it gives transformers' gradient-accumulation loss.

    A DTensor ``linear_weight`` is refused: an FSDP2 shard and a tensor-parallel head's rows look the same
    (rows split over a mesh) but need different losses. A head split by classes over ranks that share their
    tokens takes :func:`tigon.ops.vocab_parallel_cross_entropy` (``tigon.patch`` calls it for transformers'
    tensor-parallel heads).
    """
    if isinstance(linear_weight, DTensor):
        raise ValueError(
            f"linear_weight is a DTensor placed {tuple(linear_weight.placements)}: pass the whole weight (FSDP2 "
            "gathers it inside the module's forward), or for a head split by classes over ranks that hold the same "
            "tokens use tigon.ops.vocab_parallel_cross_entropy"
        )
    vocab = check_linear_head(input, linear_weight, linear_bias)
    compute_dtype = head_compute_dtype(input, linear_weight, linear_bias)
    check_loss_options(
        weight, vocab, input.device, ignore_index, label_smoothing, reduction, z_loss, softcap, logit_scale
    )
    check_target(target, input.shape[:-1], input.device)
    weight = None if weight is None else weight.contiguous()  # the class weights are read with unit stride
    scales, bad = REDUCTION_SCALES(target.reshape(-1), weight, int(ignore_index), reduction, vocab)
    check = RangeCheck(bad)
    grad_on = torch.is_grad_enabled()
    loss = FusedLinearCrossEntropyFunction.apply(
        input, linear_weight, linear_bias, target, weight, scales, int(ignore_index), float(label_smoothing),
        reduction, float(z_loss), None if softcap is None else float(softcap), float(logit_scale),
        compute_dtype,
        grad_on and input.requires_grad, grad_on and linear_weight.requires_grad,
        grad_on and linear_bias is not None and linear_bias.requires_grad,
    )
    check.raise_if_bad(vocab, ignore_index)  # after the launches: nothing was written to inputs
    return loss


# ------------------------------------------------------------------------------------------ reference


def fused_linear_cross_entropy_reference(
    input, linear_weight, target, *, linear_bias=None, io_dtype=None, **kwargs
):
    """F.linear then :func:`cross_entropy_reference` (same keyword options).

    With fp64 tensors and ``io_dtype`` set, the logits are rounded to ``io_dtype`` as the op's
    matmul output is: the same roundings, nothing else lost.
    """
    logits = torch.nn.functional.linear(input, linear_weight, linear_bias)
    if io_dtype is not None and logits.dtype == torch.float64:
        logits = logits.to(io_dtype).to(torch.float64)
    return cross_entropy_reference(logits, target, **kwargs)
