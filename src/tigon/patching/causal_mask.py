"""Under torch.compile, a patched model's sdpa attention runs causal, not behind a dense mask.

In eager mode transformers hands sdpa ``attn_mask=None, is_causal=True`` whenever nothing is
padded: no mask tensor, and the flash/cuDNN kernels skip the blocks above the diagonal. While
Dynamo traces, transformers 5.17 (and 5.23 with torch < 2.14) cannot ask whether the 2-D padding
mask is all ones, so it never takes that shortcut, even when there is no padding mask at all: it
builds a ``[B, 1, T, T]`` boolean mask and sdpa runs the masked kernel over the whole square. On the
H100 that made attention 2.7x slower in a compiled Llama-1B step (31 ms against 11.5 ms per step,
benchmarks/results/2026-11-23/e2e-llama-qwen2-rope-autocast.md), which is most of what tigon + compile
lost to eager tigon.

The check transformers cannot make while tracing is one it does not need when ``attention_mask`` is
None: then there is no padding, and the eager rule reduces to shapes and offsets, which are Python
numbers at trace time. :func:`sdpa_mask` applies exactly that rule (the one of transformers'
``_ignore_causal_mask_sdpa`` with no padding mask) for the configs of patched models and otherwise
calls transformers' own function, so the compiled model attends exactly as the eager one does:

* no padding mask and ``allow_is_causal_skip`` (transformers turns it off for packed sequences,
  custom mask functions and compiled decoding);
* no sliding window that the keys reach (``local_size`` None or longer than the keys);
* ``q_length == 1`` or ``q_length == kv_length`` or an empty cache (``q_offset == 0`` as a number).

It is registered in place of transformers' ``"sdpa"`` mask function while a patched model is marked,
and changes nothing for a model that was not patched: patches mark their model's config (by
identity, so nothing is written into the config or its saved JSON); ``Patch.revert`` removes the
mark, and with the last mark transformers' own function is registered again.
"""

from __future__ import annotations

import sys
import weakref

import torch

_MARKED: dict[int, weakref.ref] = {}
_ORIGINAL_KEY = "_tigon_original_sdpa_mask"


def marked(config) -> bool:
    ref = _MARKED.get(id(config))
    return ref is not None and ref() is config


def _skip_allowed(q_length, kv_length, q_offset, local_size) -> bool:
    """transformers' ``_ignore_causal_mask_sdpa`` when there is no padding mask (shapes only)."""
    if local_size is not None and kv_length >= local_size:
        return False
    return q_length == 1 or kv_length == q_length or (isinstance(q_offset, int) and q_offset == 0)


def _wrap(original):
    def sdpa_mask(*args, **kwargs):
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

    sdpa_mask._tigon = True
    setattr(sdpa_mask, _ORIGINAL_KEY, original)
    return sdpa_mask


def _install() -> bool:
    """Put :func:`sdpa_mask` in front of transformers' sdpa mask function (once); False if the
    installed transformers has no mask interface (nothing to do then)."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:
        return False
    current = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get("sdpa")
    if current is None:
        return False
    if not getattr(current, "_tigon", False):
        AttentionMaskInterface.register("sdpa", _wrap(current))
    return True


def _uninstall() -> None:
    """Put transformers' own sdpa mask function back once no patched model is marked (if ours is
    still the registered one: a function registered after ours stays). No import: this also runs
    from a weakref callback, possibly while the interpreter shuts down."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        return
    current = masking.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get("sdpa")
    if getattr(current, "_tigon", False):
        masking.AttentionMaskInterface.register("sdpa", getattr(current, _ORIGINAL_KEY))


def _forget(key: int) -> None:
    """A marked config was garbage-collected (its model with it): drop the mark."""
    if _MARKED.pop(key, None) is not None and not _MARKED:
        _uninstall()


class MarkConfig:
    """A patch change (``apply``/``undo``) that lets ``config``'s model skip the compiled dense mask."""

    def __init__(self, config):
        self.config = config

    def apply(self):
        if _install():
            key = id(self.config)
            _MARKED[key] = weakref.ref(self.config, lambda _, key=key: _forget(key))

    def undo(self):
        if marked(self.config):
            del _MARKED[id(self.config)]
            if not _MARKED:
                _uninstall()
