"""Under torch.compile, a patched model's sdpa attention runs causal, not behind a dense mask.

In eager mode transformers hands sdpa ``attn_mask=None, is_causal=True`` whenever nothing is
padded: no mask tensor, and the flash/cuDNN kernels skip the blocks above the diagonal. While
Dynamo traces, transformers 5.17 (and 5.23 with torch < 2.14) cannot ask whether the 2-D padding
mask is all ones, so it never takes that shortcut, even when there is no padding mask at all: it
builds a ``[B, 1, T, T]`` boolean mask and sdpa runs the masked kernel over the whole square. That
measured attention several times slower in a compiled Llama-1B step (docs/tuning.md, "Timings quoted in the source",
"Whole-model steps"), which is most of what tigon + compile lost to eager tigon.

The check transformers cannot make while tracing is one it does not need when ``attention_mask`` is
None: then there is no padding, and the eager rule reduces to shapes and offsets, which are Python
numbers at trace time. :func:`sdpa_mask` applies exactly that rule (the one of transformers'
``_ignore_causal_mask_sdpa`` with no padding mask) for the configs of patched models and otherwise
calls transformers' own function, so the compiled model attends exactly as the eager one does:

* no padding mask and ``allow_is_causal_skip`` (transformers turns it off for packed sequences,
  custom mask functions and compiled decoding);
* no sliding window that the keys reach (``local_size`` None or longer than the keys);
* ``q_length == 1`` or ``q_length == kv_length`` or an empty cache (``q_offset == 0`` as a number).

The same wrapper does not build a sliding-window model's ``[L, L]`` mask at all where the band path can
take it (eager mode, the models the ``sliding_window`` switch marks, at least two row blocks of queries,
queries and keys of one length): transformers asks for the plain sliding-window causal mask, with or
without a padding mask (it allows the causal skip there, which it turns off for packed sequences, custom
mask functions and compiled decoding), and every True of that mask lies within ``local_size`` keys
before its query, so the band path reads only the rectangles of :func:`tigon.patching.band_attention`'s
row blocks. :class:`BandMask` stands for that mask: a ``[B, 1, L, L]`` bool tensor without storage whose
rectangles (:meth:`BandMask.rectangle`) transformers' own function makes on demand (``q_offset`` and
``kv_offset`` moved to the rectangle: the same mask function at the same indices, padding included), so
that at L tokens the mask costs a rectangle of ``c × (c + W - 1)`` at a time, not L² bytes (64 GiB at
256K tokens). Anything else that reads it (an op on it: the attention's guards decline the band path,
a user's hook) gets the dense mask, built once by row blocks (below), and reads the same values.

Elsewhere the same wrapper builds a sliding-window model's dense mask by row blocks, in eager mode (for the
models the ``sliding_window`` switch marks, :func:`mask_by_rows`): transformers evaluates the mask
function on the whole ``[L, L]`` grid at once, each overlay (causal, window, padding) an ``[L, L]``
bool tensor of its own and each ``&`` another, about five times the mask's own size at once; at a
100K-token DPO pair that transient, not the model, is the step's peak. Row blocks of
``band_attention.CONFIG.block_rows`` queries are made by transformers' own function (``q_offset``
moved to the block) and copied into one ``[B or 1, 1, L, L]`` mask: the same values, with only a
block's overlays alive at a time.

It is registered in place of transformers' ``"sdpa"`` mask function while a patched model is marked,
and changes nothing for a model that was not patched: patches mark their model's config (by
identity, so nothing is written into the config or its saved JSON); ``Patch.revert`` removes the
mark, and with the last mark transformers' own function is registered again.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from tigon.patching.interface_marks import InterfaceWrapper

_ORIGINAL_KEY = "_tigon_original_sdpa_mask"
# Marks: "compiled" (the compiled dense mask skipped), "by_rows" (sliding-window masks by row blocks).
COMPILED, BY_ROWS = "compiled", "by_rows"


def marked(config, group: str = COMPILED) -> bool:
    return _WRAPPER.marked(config, group)


def _by_rows_allowed(kwargs, rows: int) -> bool:
    """An eager sliding-window mask (its window shorter than the keys, so never skipped) of a marked
    model, built by broadcasting (not vmap), at least two row blocks long."""
    local_size, q_offset = kwargs.get("local_size"), kwargs.get("q_offset", 0)
    return (marked(kwargs.get("config"), BY_ROWS) and not torch.compiler.is_compiling()
            and local_size is not None and kwargs["kv_length"] >= local_size
            and not kwargs.get("use_vmap", False) and not kwargs.get("allow_is_bidirectional_skip", False)
            and isinstance(q_offset, int) and kwargs["q_length"] >= 2 * rows)


def mask_by_rows(original, kwargs, rows: int):
    """transformers' mask, made ``rows`` queries at a time by ``original`` and copied into one tensor.

    A block's mask is ``original`` with ``q_length`` the block's and ``q_offset`` moved to its first
    query: each element is the mask function at the same (batch, query, key) indices. Where the mask
    does not depend on the batch (no padding mask), transformers returns one ``[1, 1, L, L]`` mask
    expanded over the batch, and so does this."""
    length, offset = kwargs["q_length"], kwargs.get("q_offset", 0)
    out = shared = None
    for s in range(0, length, rows):
        block = original(**{**kwargs, "q_length": min(rows, length - s), "q_offset": offset + s,
                            "allow_is_causal_skip": False})
        if out is None:
            shared = block.shape[0] > 1 and block.stride(0) == 0
            out = torch.empty((1 if shared else block.shape[0], 1, length, block.shape[-1]), dtype=block.dtype,
                              device=block.device)
        out[:, :, s:s + block.shape[2]] = block[:1] if shared else block
        del block
    return out.expand(kwargs["batch_size"], -1, -1, -1) if shared else out


def _band_allowed(kwargs) -> bool:
    """The mask asked for is transformers' plain sliding-window causal one (the causal skip allowed: no
    custom or packed-sequence mask function; a padding mask may be there), over queries and keys of
    one length, offsets that are numbers: what :class:`BandMask` stands for."""
    return (kwargs.get("allow_is_causal_skip", True) and kwargs["q_length"] == kwargs["kv_length"]
            and isinstance(kwargs.get("kv_offset", 0), int))


class BandMask(torch.Tensor):
    """transformers' sliding-window mask ``[B, 1, L, L]`` (bool) without its L² elements (module docs).

    ``make`` is transformers' mask function and ``arguments`` the call it was asked; ``window`` its
    ``local_size`` W: query i sees no key at or before i - W. :meth:`rectangle` makes any block of it;
    every other op on it reads :meth:`dense`, made once (by row blocks) and kept with this tensor."""

    @staticmethod
    def __new__(cls, make, arguments):
        shape = (arguments["batch_size"], 1, arguments["q_length"], arguments["kv_length"])
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.bool,
                                                   device=torch.device(arguments.get("device", "cpu")))

    def __init__(self, make, arguments):
        self.make, self.arguments, self.window = make, arguments, arguments["local_size"]
        self.materialised = None

    def rectangle(self, start: int, end: int, first: int, last: int) -> torch.Tensor:
        """The mask's queries ``[start, end)`` and keys ``[first, last)``: ``[B or 1 expanded to B, 1, end -
        start, last - first]``, made by transformers' function with its offsets moved there."""
        arguments = self.arguments
        return self.make(**{**arguments, "q_length": end - start, "q_offset": arguments.get("q_offset", 0) + start,
                            "kv_length": last - first, "kv_offset": arguments.get("kv_offset", 0) + first,
                            "allow_is_causal_skip": False})

    def dense(self) -> torch.Tensor:
        if self.materialised is None:
            from tigon.patching.band_attention import CONFIG

            self.materialised = mask_by_rows(self.make, self.arguments, CONFIG.block_rows)
        return self.materialised

    __torch_function__ = torch._C._disabled_torch_function_impl  # ops reach __torch_dispatch__, results plain

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):  # checkpointing's detach
            return BandMask(args[0].make, args[0].arguments)
        dense = tree_map(lambda t: t.dense() if isinstance(t, BandMask) else t, (args, kwargs or {}))
        return func(*dense[0], **dense[1])

    def __repr__(self):
        return f"BandMask(shape={tuple(self.shape)}, window={self.window})"


def _skip_allowed(q_length, kv_length, q_offset, local_size) -> bool:
    """transformers' ``_ignore_causal_mask_sdpa`` when there is no padding mask (shapes only)."""
    if local_size is not None and kv_length >= local_size:
        return False
    return q_length == 1 or kv_length == q_length or (isinstance(q_offset, int) and q_offset == 0)


def _wrap(original):
    def sdpa_mask(*args, **kwargs):
        from tigon.patching.band_attention import CONFIG

        if args == () and _by_rows_allowed(kwargs, CONFIG.block_rows):
            if _band_allowed(kwargs):
                return BandMask(original, kwargs)
            return mask_by_rows(original, kwargs, CONFIG.block_rows)
        if (
            args == ()
            and kwargs.get("attention_mask") is None
            and kwargs.get("allow_is_causal_skip", True)
            and torch.compiler.is_compiling()
            and marked(kwargs.get("config"))
            and _skip_allowed(kwargs["q_length"], kwargs["kv_length"], kwargs.get("q_offset", 0),
                              kwargs.get("local_size"))
        ):
            return None
        return original(*args, **kwargs)

    return sdpa_mask


_WRAPPER = InterfaceWrapper("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS", "AttentionMaskInterface",
                            "sdpa", _wrap, _ORIGINAL_KEY, groups=(COMPILED, BY_ROWS), home=(__name__, "_WRAPPER"))
_MARKED = _WRAPPER.groups[COMPILED]


def MarkConfig(config):  # noqa: N802  (a patch change, built like a class)
    """The patch change (``apply``/``undo``) that lets ``config``'s model skip the compiled dense mask."""
    return _WRAPPER.mark(config, COMPILED)


def by_rows_mark(config):
    """The change that has ``config``'s sliding-window masks built by row blocks."""
    return _WRAPPER.mark(config, BY_ROWS)
