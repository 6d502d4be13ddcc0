"""Sliding-window attention over its band: sdpa on row blocks of the mask, not on the whole ``[L, L]`` square.

Why. A sliding-window layer (Gemma-2/3, Mistral, Qwen2's, Cohere-2, GPT-OSS ...) lets query i see the
keys i - W < j <= i. Under sdpa, transformers builds the layer's mask as a dense ``[B, 1, L, L]`` bool
tensor, and sdpa runs its masked kernel over the whole square: the kernel turns the bool mask into an
additive bias of the query's dtype (2 bytes an element, made anew by every layer, and kept by each
layer's node for the backward), and computes all L² scores, of which L·W are used. At L = 77,824
tokens and a DPO pair (B = 2), that is 12 GB of bool mask plus 24 GB of bias a layer, and 150× more
attention arithmetic than the band needs: long-context training of these models runs out of memory
on the mask, not on the model.

What. The rows of the mask split into blocks of ``c`` queries ([s, e), e = s + c). A query in the block
sees no key before ``s - W + 1`` and none at or after ``e``, so the block's attention is sdpa on the
block's queries, the keys and values of [s - W + 1, e), and the mask's ``[s:e, s - W + 1:e]``
rectangle: every score that can be unmasked is in the rectangle, every one outside is masked, so each
row's softmax has exactly the terms the full call gives it; only the order in which the kernel sums
them (its key tiles start elsewhere) differs, as between two sdpa kernels. The blocks' outputs are
concatenated. Work: L·(c + W) scores instead of L²; memory: the bias of one rectangle at a time.
The mask itself is the one transformers made (padding, packing, every custom pattern included): the
rows are sliced from it, nothing is rebuilt.

When. The wrapper stands in for transformers' ``"sdpa"`` attention function while a patched model is
marked (for the band path by ``patch(..., sliding_window=True)``, the default; for grouped heads, below,
by the ``rope`` part), and takes the band path only for a model marked for it whose attention passes
``sliding_window`` (transformers' sliding layers do), with a dense bool mask ``[B or 1, 1, L, L]``
(queries and keys of one length: training and prefill, not decoding), no position bias, no dropout, at
least ``min_blocks`` blocks, eagerly (not while torch.compile traces or a CUDA graph is captured), and
only once the mask has been checked to hold no True outside the rectangles (a pattern that reaches
further, such as a bidirectional image block longer than the window, keeps the dense call). The check
reads the mask once (a reduction per block and side, one host sync) and is remembered for that mask
tensor while its version is unchanged: the layers of one forward share one mask, so one check a
forward. Everything else goes to transformers' function as before.

Where transformers asks for its plain sliding-window causal mask (no custom or packed-sequence
pattern; padding allowed), the layers receive no dense mask at all but a
:class:`tigon.patching.causal_mask.BandMask`, which makes each block's rectangle when asked, by
transformers' own function: every True of that mask is within its window, so there is nothing to check,
and a forward at L tokens never holds more of the mask than one rectangle (``c × (c + W - 1)``), not
L² bytes. The rectangles use the mask's own window (transformers' ``local_size``, the config's
``sliding_window``). Otherwise the mask those layers receive is transformers' dense one, built by row
blocks (:func:`tigon.patching.causal_mask.mask_by_rows`, planned by the same switch), so that making it
never holds more than the mask itself and one block's overlays.

Grouped heads. The same wrapper takes one more call, of the models the ``rope`` part marks
(:func:`GroupedHeadsMark`): a layer's call with grouped key/value heads and no mask (causal training without
padding). transformers' sdpa function hands sdpa that call with ``enable_gqa=True`` and ``Hk < Hq`` heads
(where the key's and value's head sizes are one and at most :data:`GQA_HEAD_DIM`). On CUDA, sdpa takes grouped
heads on its flash and cuDNN kernels, which take fp16/bf16 only; its memory-efficient kernel takes fp32 but,
in PyTorch 2.11, no grouped heads (``sdp_utils.cpp``: ``can_use_mem_efficient_attention`` asks for equal
query, key and value heads; on an H200, an fp32 grouped call's choice is math, the same call with k and v
repeated the memory-efficient kernel). Left to sdpa, an fp32 model on the GPU runs that call on its math
kernel, which repeats k and v and makes the ``(B·Hq, T, T)`` scores and their softmax, kept for the backward:
O(T²) memory without any mask (at 64K tokens and 32 heads, 512 GiB of fp32 scores). Where
``torch._fused_sdp_choice`` says so (math for the grouped call, another kernel for the call with k and v
repeated to the query heads), in eager mode (a compiled model's call is traced as transformers makes it), the
wrapper repeats them as transformers' ``repeat_kv`` does, an O(T) copy each, and hands transformers' function
the repeated ones. It still passes ``enable_gqa`` (the head sizes are unchanged); over equal heads the
memory-efficient kernel's check asks only that they are equal, and sdpa runs that kernel. The same attention:
query head h reads key/value head ``h // groups`` either way; only the kernel's order of summation differs, as
between two sdpa backends. The choice is asked at each call, not assumed: the CPU's flash kernel takes grouped
heads in fp32, a GPU in fp16/bf16 runs flash or cuDNN, and a PyTorch whose memory-efficient kernel takes
grouped heads chooses it for the grouped call; none of them is changed.

Kept attention. A model the ``keep_attention`` part marks (:func:`KeptMark`) has its calls made inside a
checkpointed decoder layer's ``tigon.nn.kept_attention.KeptCall`` (the band path aside) computed by
``tigon.nn.kept_sdpa``'s node, where they are one of transformers' two decoder calls that its kernels take: the
same kernels as sdpa, whose outputs the layer's recompute takes back instead of launching them again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

from tigon.nn import kept_attention
from tigon.nn.attention import repeat_heads
from tigon.nn.kept_sdpa import GQA_HEAD_DIM, kept_sdpa, transformers_causal
from tigon.patching.causal_mask import BandMask
from tigon.patching.interface_marks import InterfaceWrapper


@dataclass(frozen=True)
class BandConfig:
    """``block_rows``: queries per sdpa call (c). Larger blocks waste c·(c - 1)/2 masked scores a block
    and launch less; ``min_blocks``: the fewest blocks a sequence must make for the band path (below
    that the square is not much bigger than the rectangles)."""

    block_rows: int = 4096
    min_blocks: int = 2


CONFIG = BandConfig()
_ORIGINAL_KEY = "_tigon_original_sdpa_attention"
# Marks: "" (the band path of sliding-window layers), "grouped" (grouped heads off sdpa's math kernel), "kept"
# (keep_attention: inside a checkpointed layer's KeptCall, the call as tigon.nn.kept_sdpa's node).
GROUPED = "grouped"
KEPT = "kept"
# the id torch._fused_sdp_choice returns for sdpa's math kernel (the one that makes the T × T scores)
MATH = SDPBackend.MATH.value


def marked(config, group: str = "") -> bool:
    return _WRAPPER.marked(config, group)


def has_sliding_layers(config) -> bool:
    """Whether ``config`` gives some layers a sliding window (its ``layer_types``, else
    ``use_sliding_window`` where the config has that flag)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return False
    types = getattr(config, "layer_types", None)
    if types is not None:
        return "sliding_attention" in types
    return bool(getattr(config, "use_sliding_window", True))


def layer_window(attention) -> int | None:
    """The sliding window of ``attention``'s layer (its config's ``sliding_window``) where :func:`has_sliding_layers`
    and the config's ``layer_types`` make it a sliding layer (every layer where the config has no
    ``layer_types``: Mistral, Mixtral, Starcoder2), else None. For ``Patch.replaced``: a masked call of such a
    layer in a marked model comes to the band wrapper, never to the fused attention node."""
    config = getattr(attention, "config", None)
    if config is None or not has_sliding_layers(config):
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        index = getattr(attention, "layer_idx", None)
        if not isinstance(index, int) or not 0 <= index < len(types) or types[index] != "sliding_attention":
            return None
    return config.sliding_window


def _blocks(length: int, window: int, rows: int):
    """(s, e, first key) of each row block."""
    return [(s, min(s + rows, length), max(0, s - window + 1)) for s in range(0, length, rows)]


class _BandChecks:
    """Whether a mask holds no True outside its blocks' rectangles, remembered per mask tensor (by
    identity and version, dropped with the tensor)."""

    def __init__(self):
        self.results: dict[int, tuple] = {}

    def banded(self, attention_mask: torch.Tensor, length: int, window: int, rows: int) -> bool:
        """For the mask's first ``length`` keys (the layers of a forward pass the same mask object)."""
        key = id(attention_mask)
        entry = self.results.get(key)
        signature = (attention_mask._version, length, window, rows, attention_mask.shape)
        if entry is not None and entry[0]() is attention_mask and entry[1] == signature:
            return entry[2]
        mask = attention_mask[..., :length]
        outside = []
        for s, e, first in _blocks(length, window, rows):
            if first > 0:
                outside.append(mask[..., s:e, :first].any())
            if e < length:
                outside.append(mask[..., s:e, e:].any())
        result = not bool(torch.stack(outside).any()) if outside else True
        ref = weakref.ref(attention_mask, lambda _, key=key: self.results.pop(key, None))
        self.results[key] = (ref, signature, result)
        return result


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@torch.compiler.disable
def _dense(mask: BandMask) -> torch.Tensor:
    """The dense mask of a BandMask, made eagerly: in a compiled layer (its mask made outside, eagerly) the
    layer's graph takes the plain tensor rather than tracing the mask's making (``BandMask.__torch_dispatch__``)."""
    return mask.dense()


def _sdpa_choice(query, key, value, dropout, causal, scale):
    """The kernel sdpa chooses for a maskless call with ``enable_gqa`` (an id of ``SDPBackend``), or None where it
    has none (every allowed kernel refuses the call: sdpa raises the same; a device without the choice)."""
    try:
        return torch._fused_sdp_choice(query, key, value, None, dropout, causal, scale=scale, enable_gqa=True)
    except RuntimeError:
        return None


def _repeated_heads(module, query, key, value, attention_mask, kwargs):
    """``(key, value)`` with each head repeated to the query heads it serves, where a marked model's maskless call
    with grouped heads would run on sdpa's math kernel and the repeated one would not (module docs, "Grouped
    heads"); else None."""
    groups = getattr(module, "num_key_value_groups", 1)
    length = query.shape[2]
    if (attention_mask is not None or not isinstance(groups, int) or groups < 2
            or not marked(getattr(module, "config", None), GROUPED)
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or key.shape[1] * groups != query.shape[1] or value.shape[1] != key.shape[1]
            or key.shape[2] != length or length < 2
            or not key.shape[-1] == value.shape[-1] <= GQA_HEAD_DIM):
        return None
    causal = transformers_causal(module, kwargs)
    dropout, scale = kwargs.get("dropout", 0.0), kwargs.get("scaling")
    if _sdpa_choice(query, key, value, dropout, causal, scale) != MATH:
        return None
    key, value = repeat_heads(key, groups), repeat_heads(value, groups)           # (B, Hq, T, D) each
    if _sdpa_choice(query, key, value, dropout, causal, scale) in (None, MATH):
        return None
    return key, value


def _wrap(original):
    checks = _BandChecks()

    def sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
        config = CONFIG  # read at each call: a tuning run or a test swaps the frozen config
        window = kwargs.get("sliding_window")
        length = query.shape[2]
        if (
            not torch.compiler.is_compiling() and not _capturing()   # first: nothing before it is traced
            and type(attention_mask) is BandMask and args == ()
            and attention_mask.shape[0] in (1, query.shape[0]) and attention_mask.shape[2] == length == key.shape[2]
            and kwargs.get("position_bias") is None and not kwargs.get("dropout")
            and not kwargs.get("output_attentions", False)
        ):
            outputs = [
                original(module, query[:, :, s:e], key[:, :, first:e], value[:, :, first:e],
                         attention_mask.rectangle(s, e, first, e), **kwargs)[0]          # (B, e - s, H, D)
                for s, e, first in _blocks(length, attention_mask.window, config.block_rows)
            ]
            return torch.cat(outputs, dim=1), None
        if (
            not torch.compiler.is_compiling() and not _capturing()
            and args == ()
            and isinstance(window, int) and not isinstance(window, bool) and window > 0
            and isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
            and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
            and attention_mask.shape[0] in (1, query.shape[0])
            and attention_mask.shape[2] == length == key.shape[2] and attention_mask.shape[3] >= length
            and kwargs.get("position_bias") is None and not kwargs.get("dropout")
            and not kwargs.get("output_attentions", False)
            and length >= config.min_blocks * config.block_rows
            and marked(getattr(module, "config", None))
        ):
            if checks.banded(attention_mask, length, window, config.block_rows):
                mask = attention_mask[..., :length]  # the keys this call has (transformers slices alike)
                outputs = [
                    original(module, query[:, :, s:e], key[:, :, first:e], value[:, :, first:e],
                             mask[:, :, s:e, first:e], **kwargs)[0]       # (B, e - s, H, D)
                    for s, e, first in _blocks(length, window, config.block_rows)
                ]
                return torch.cat(outputs, dim=1), None
        if type(attention_mask) is BandMask:  # a guard declined the band path: the dense mask, once
            attention_mask = _dense(attention_mask)
        if (not torch.compiler.is_compiling() and args == () and kept_attention.current() is not None
                and marked(getattr(module, "config", None), KEPT)):
            out = kept_sdpa(module, query, key, value, attention_mask, kwargs)
            if out is not None:
                return out, None
        if not torch.compiler.is_compiling() and args == ():
            repeated = _repeated_heads(module, query, key, value, attention_mask, kwargs)
            if repeated is not None:
                return original(module, query, *repeated, attention_mask, **kwargs)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    return sdpa_attention_forward


_WRAPPER = InterfaceWrapper("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS", "AttentionInterface", "sdpa",
                            _wrap, _ORIGINAL_KEY, groups=("", GROUPED, KEPT), home=(__name__, "_WRAPPER"))
_MARKED = _WRAPPER.groups[""]


def unwrapped(function):
    """The attention function behind the band wrapper (``function`` itself when it is not the wrapper): what
    the wrapper calls for an attention without a mask."""
    return getattr(function, _ORIGINAL_KEY, function)


def MarkConfig(config):  # noqa: N802  (a patch change, built like a class)
    """The patch change (``apply``/``undo``): the attention of ``config``'s model takes the band path."""
    return _WRAPPER.mark(config)


def GroupedHeadsMark(config):  # noqa: N802  (a patch change, built like a class)
    """The patch change (``apply``/``undo``): a maskless call with grouped heads of ``config``'s model leaves sdpa's
    math kernel where another takes it with the heads repeated (module docs, "Grouped heads")."""
    return _WRAPPER.mark(config, GROUPED)


def KeptMark(config):  # noqa: N802  (a patch change, built like a class)
    """The patch change (``apply``/``undo``): inside a checkpointed layer under ``keep_attention``, a call of
    ``config``'s model goes to tigon.nn.kept_sdpa's node, whose kernel outputs the recompute takes back."""
    return _WRAPPER.mark(config, KEPT)
