r"""The Qwen-VL vision towers' attention over all their images or windows in one sdpa call (the
``vision_attention`` switch): :func:`segment_attention`.

Why. A Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision tower packs the patches of every image of the batch into
one sequence of ``S`` positions and attends within the segments that ``cu_seqlens`` marks: each image
(Qwen2-VL, Qwen3-VL and Qwen2.5-VL's four full-attention blocks) or each window of 8 x 8 patches (Qwen2.5-VL's
other 28 blocks). Under flash attention transformers hands ``cu_seqlens`` to the varlen kernel. Under
sdpa, the default, it splits q, k and v into the segments and calls the attention once a segment: a
392 x 392 image is 16 windows, so each windowed block makes 16 attention calls forward and 16 backward,
~900 a step for one image a sequence. Each call costs the host its Python, dispatch and autograd
node, and the step is the host's: at Qwen2.5-VL-3B's shapes the GPU measured idle for more than half
the step (docs/tuning.md, "Timings quoted in the source", "Whole-model steps").

What. The segments as one batch ``[segments, heads, longest, head_dim]`` and one sdpa call:

- segments of one length (the images of one size; windows where the grid divides into them) are a
  view of the packed sequence, nothing copied;
- segments of several lengths are gathered into rows padded to the longest with a position of their
  own segment, a key mask hides the padding, and the padded query rows are dropped from the output;
- unless padding would cost more than ``CONFIG.pad_limit`` (2) times the segments' own attention work or
  rows (a large image beside small ones): then one call per distinct length, nothing padded.

On a GPU, in fp16/bf16, the segments need no batching at all: PyTorch's own flash attention takes
packed sequences with their cumulative lengths (``aten::_flash_attention_forward`` with ``cum_seq_q``,
the kernel behind ``torch.nn.attention.varlen``), so the whole packed sequence is one call and its
backward one call: no gather, no mask, no padded rows (:class:`_FlashSegments`). Through the padded
batch a windowed block gathered q, k and v, built its mask and put the rows back in order, forward and
backward; here the flash kernels are all its attention launches (the 392 x 392 image's tower: 30 kernels
a block forward before, 17 with this and the block's other fusions; ``dev/vision_host.py``).

The host reads ``cu_seqlens`` once per tensor, not once per block (:func:`segments_of`): each read
waits for the GPU, and the tower hands the same tensor to all its blocks.

Exactness. Row ``i`` of segment ``s`` is ``softmax(q_i K_s^T * scale) V_s`` over the segment's own keys
either way: a masked key's weight is ``exp(-inf) = 0``. So the output is the per-segment one, up to the
rounding of a different kernel. The padding gets no gradient: a dropped query row has zero output
gradient, hence zero ``dP = dO V^T`` and zero ``dQ``; a masked key has zero weight ``P`` in every row,
hence ``dK = dS^T Q`` and ``dV = P^T dO`` are zero there. So the gather's backward adds only zeros to
the positions the padding repeated. The flash call computes the same per-segment softmax directly
(its tiles never cross a segment's bounds).

Where. ``tigon.patching.parts.vision`` gives the vision attention a forward that calls
:func:`segment_attention` in place of its per-segment loop, only where the attention's forward is, statement for
statement, transformers' (5.17 to 5.25), and only under sdpa.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tigon._kernels import function_apply

CACHE_ATTR = "_tigon_segments"  # where segments_of keeps what it read on the cu_seqlens tensor


@dataclass(frozen=True)
class VisionAttentionConfig:
    """How segments of several lengths are batched (:func:`segments_of`)."""

    # One call padded to the longest segment while that costs at most pad_limit times the segments' own
    # attention work (count·longest² against Σ length²) and rows (count·longest against the positions);
    # past it (a large image beside small ones), one call per distinct length, nothing padded.
    pad_limit: float = 2.0
    # fp16/bf16 on a GPU: all segments as one flash-attention call over the packed sequence (where
    # PyTorch has flash attention, sdpa's flash backend is enabled, and the head size suits it).
    flash: bool = True


CONFIG = VisionAttentionConfig()


@dataclass(frozen=True)
class Rows:
    """One sdpa call: ``count`` rows of ``length`` positions, gathered by ``index`` (flat, row after
    row; None: the packed sequence itself, in order), ``valid`` ``[count, length]`` masking the padded
    keys (None: nothing padded)."""

    count: int
    length: int
    index: torch.Tensor | None = None
    valid: torch.Tensor | None = None


@dataclass(frozen=True)
class Segments:
    """The sdpa ``calls`` that cover the segments of a packed sequence of ``total`` positions, and
    ``keep``: the positions of the calls' concatenated outputs that give the sequence back in order
    (None: they are in order already)."""

    total: int
    version: int  # cu_seqlens._version when read: an in-place change makes a cached one stale
    calls: tuple[Rows, ...]
    keep: torch.Tensor | None = None
    # The flash call's operands: the non-empty segments' bounds (int32, on the device) and the longest.
    bounds: torch.Tensor | None = None
    longest: int = 0


def _batched(starts: list[int], lengths: list[int], total: int, config: VisionAttentionConfig):
    """(calls, keep) on the host for non-empty segments (see :class:`Segments`)."""
    count, longest = len(lengths), max(lengths)
    if min(lengths) == longest:  # one length: a view of the packed sequence
        return (Rows(count, longest),), None
    padded_work = count * longest * longest <= config.pad_limit * sum(n * n for n in lengths)
    if padded_work and count * longest <= config.pad_limit * total:
        # Row s holds segment s's positions, then its first position again as padding.
        offsets = torch.arange(longest)
        valid = offsets < torch.tensor(lengths)[:, None]  # [count, longest]
        index = (torch.tensor(starts)[:, None] + torch.where(valid, offsets, 0)).flatten()
        keep = valid.flatten().nonzero().squeeze(1)  # the real positions of the padded rows, in order
        return (Rows(count, longest, index, valid),), keep
    # One call per distinct length; keep is the inverse of the order the calls visit the positions in.
    calls, order = [], []
    for length in sorted(set(lengths), reverse=True):
        first = torch.tensor([a for a, n in zip(starts, lengths, strict=True) if n == length])
        index = (first[:, None] + torch.arange(length)).flatten()
        calls.append(Rows(len(first), length, index))
        order.append(index)
    order = torch.cat(order)
    keep = torch.empty_like(order)
    keep[order] = torch.arange(len(order))
    return tuple(calls), keep


def segments_of(cu_seqlens, total: int, device) -> Segments:
    """The :class:`Segments` of ``cu_seqlens``, read once per tensor.

    A vision tower hands the same ``cu_seqlens`` tensor to each of its blocks (Qwen2.5-VL: one for the
    windowed blocks, one for the full-attention ones), and reading it on the host waits for the GPU to
    finish everything queued before. So the result is kept on the tensor itself (an attribute that goes
    with it) and the next blocks reuse it: one wait per tensor a step rather than one a block.
    """
    # Not kept under torch.compile tracing (which reads the values as the per-segment split does), nor
    # under torch.inference_mode (an inference tensor has no version counter to tell an in-place change,
    # and index tensors made there could not be saved for a backward outside it).
    keep_it = not (torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or cu_seqlens.is_inference())
    if keep_it:
        cached = getattr(cu_seqlens, CACHE_ATTR, None)
        if cached is not None and cached.total == total and cached.version == cu_seqlens._version:
            return cached
    bounds = cu_seqlens.tolist()  # the host needs the lengths, as the per-segment split does
    spans = list(itertools.pairwise(bounds))
    if not bounds or bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in spans):
        raise ValueError(f"cu_seqlens must rise from 0 to the {total} positions, got {bounds}")
    starts = [a for a, b in spans if b > a]
    lengths = [b - a for a, b in spans if b > a]
    calls, keep = _batched(starts, lengths, total, CONFIG) if lengths else ((), None)

    def to_device(t):
        return None if t is None else t.to(device, non_blocking=True)

    calls = tuple(dataclasses.replace(c, index=to_device(c.index), valid=to_device(c.valid)) for c in calls)
    nonempty = to_device(torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32))
    found = Segments(total, cu_seqlens._version if keep_it else -1, calls, to_device(keep), nonempty,
                     max(lengths, default=0))
    if keep_it:
        setattr(cu_seqlens, CACHE_ATTR, found)
    return found


def segment_attention(q, k, v, cu_seqlens, *, scale: float, dropout: float = 0.0):
    """Attention of ``q, k, v`` ``[S, heads, head_dim]`` within the segments ``cu_seqlens`` marks
    (``[segments + 1]``, from 0 to S): fp16/bf16 on a GPU as one flash call (:class:`_FlashSegments`),
    otherwise in as few ``scaled_dot_product_attention`` calls as :func:`segments_of` batches them
    into (one, but where padding would cost more than ``CONFIG.pad_limit`` times the work); returns
    ``[S, heads, head_dim]``. Empty segments are allowed (they hold nothing)."""
    if q.dim() != 3 or k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k, v must be [S, heads, head_dim] alike, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    found = segments_of(cu_seqlens, q.shape[0], q.device)
    if not found.calls:
        return q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    if CONFIG.flash and dropout == 0.0 and _flash_suits(q, k, v):
        return _FLASH_APPLY(q, k, v, found.bounds, found.longest, scale)
    outs = []
    for call in found.calls:
        def rows(t, call=call):  # [count, heads, length, head_dim]
            # index_select, not t[index]: its backward is one index_add (advanced indexing's is
            # index_put with accumulate, a sort and a handful of launches)
            if call.index is not None:
                t = t.index_select(0, call.index)
            return t.unflatten(0, (call.count, call.length)).transpose(1, 2)

        mask = None if call.valid is None else call.valid[:, None, None, :]
        out = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), attn_mask=mask, dropout_p=dropout,
                                             scale=scale)
        outs.append(out.transpose(1, 2).flatten(0, 1))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out if found.keep is None else out.index_select(0, found.keep)


class _FlashSegments(torch.autograd.Function):
    """Attention within the segments ``bounds`` marks (non-empty, int32 cumulative lengths) as one flash
    call over the packed ``[S, heads, head_dim]`` q, k, v, and one call back: aten's flash-attention
    pair with cumulative sequence lengths, what ``torch.nn.attention.varlen.varlen_attn`` runs,
    called directly (its custom op adds a dispatch layer of Python a call, and the step is the host's)."""

    @staticmethod
    def forward(ctx, q, k, v, bounds, longest, scale):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, bounds, bounds, longest, longest, 0.0, False, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, rng_state, unused, bounds)
        ctx.longest, ctx.scale = longest, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, rng_state, unused, bounds = ctx.saved_tensors
        if grad.stride(-1) != 1:  # the kernel reads head_dim contiguously (a stride-0 gradient)
            grad = grad.contiguous()
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad, q, k, v, out, lse, bounds, bounds, ctx.longest, ctx.longest, 0.0, False, rng_state, unused,
            scale=ctx.scale)
        return dq, dk, dv, None, None, None


_FLASH_APPLY = function_apply(_FlashSegments)
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _flash_suits(q, k, v) -> bool:
    """Whether aten's flash attention takes these q, k, v: fp16/bf16 on an sm80+ GPU where PyTorch was
    built with it and sdpa's flash backend is on (a user who switched it off keeps the sdpa calls),
    head_dim a multiple of 8 up to 256, head_dim contiguous; not under torch.compile (which traces the
    sdpa path)."""
    return (q.is_cuda and q.dtype in _FLASH_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and v.shape[-1] == q.shape[-1]
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
            and not torch.compiler.is_compiling() and torch.backends.cuda.flash_sdp_enabled()
            and _flash_built(q.device.index if q.device.index is not None else torch.cuda.current_device()))


@functools.cache
def _flash_built(device_index: int) -> bool:
    return (torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device_index) >= (8, 0))
