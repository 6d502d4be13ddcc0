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

The same wrapper builds a sliding-window model's dense mask by row blocks, in eager mode (for the
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


def _skip_allowed(q_length, kv_length, q_offset, local_size) -> bool:
    """transformers' ``_ignore_causal_mask_sdpa`` when there is no padding mask (shapes only)."""
    if local_size is not None and kv_length >= local_size:
        return False
    return q_length == 1 or kv_length == q_length or (isinstance(q_offset, int) and q_offset == 0)


def _wrap(original):
    def sdpa_mask(*args, **kwargs):
        from tigon.patching.band_attention import CONFIG

        if args == () and _by_rows_allowed(kwargs, CONFIG.block_rows):
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
