"""The forward tigon sets on a decoder layer instance, run as transformers would run the class's.

A decoder layer gets a forward of its own from two switches: ``rms_norm`` (the fused residual joins of
residual_joins.py) and ``cuda_graphs`` (layer_graphs.py). Setting ``layer.forward`` on the instance must not change
what transformers does around the class's forward, and one thing moved between the versions tigon
supports: gradient checkpointing.

- transformers 5.17 checkpoints in ``GradientCheckpointingLayer.__call__``, around ``self.forward``:
  an instance forward is checkpointed like the class's.
- Later 5.x releases checkpoint in a wrapper of each subclass's ``forward`` (so that FSDP2's hooks in
  ``__call__`` stay outside the recompute). An instance forward bypasses that wrapper: without
  :class:`LayerForward` doing the same, ``model.gradient_checkpointing_enable()`` would silently keep
  every activation of a joined layer.

:class:`LayerForward` checkpoints exactly as that wrapper does (``use_cache`` and the key/value cache
dropped with transformers' own warning, then ``layer._gradient_checkpointing_func``) when the class
forward is the checkpointing one, and is otherwise a plain call. What that wrapper does is read off
the installed transformers, not assumed: 5.24 checkpoints only while gradients are enabled
(:data:`CHECKPOINT_NEEDS_GRAD`), and the cache argument is ``past_key_values`` before 5.24 and ``cache``
from it (:data:`CACHE_KWARGS` holds every name; a call carries only its release's).
"""

from __future__ import annotations

import functools
import inspect
import logging
import types

import torch

# The key/value cache's keyword in a decoder layer's call: ``past_key_values`` to 5.23, ``cache`` from
# 5.24, ``layer_past`` in some families.
CACHE_KWARGS = ("cache", "past_key_values", "layer_past")


def _checkpoint_wrapper_code():
    """The code of the checkpointing wrapper transformers puts around decoder layers' forwards, or None
    where it checkpoints in ``__call__`` (5.17 to 5.22)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers without the class
        return None
    hook = vars(GradientCheckpointingLayer).get("__init_subclass__")
    hook = getattr(hook, "__func__", hook)
    for const in getattr(getattr(hook, "__code__", None), "co_consts", ()):
        if isinstance(const, types.CodeType) and const.co_name == "forward_with_checkpointing":
            return const
    return None


CHECKPOINT_WRAPPER_CODE = _checkpoint_wrapper_code()
# Whether that wrapper checkpoints only while gradients are enabled (5.24: a forward without gradients,
# as generation in training mode runs, keeps its cache).
CHECKPOINT_NEEDS_GRAD = CHECKPOINT_WRAPPER_CODE is not None and "is_grad_enabled" in CHECKPOINT_WRAPPER_CODE.co_names


def checkpoint_wrappers(forward) -> int:
    """How many of ``forward``'s outermost decorators are transformers' checkpointing wrapper (which
    :class:`LayerForward` stands for when it runs another forward on the instance)."""
    count = 0
    while getattr(forward, "__code__", None) is CHECKPOINT_WRAPPER_CODE is not None:
        forward, count = forward.__wrapped__, count + 1
    return count


def checkpoints_in_class_forward() -> bool:
    """Whether this transformers checkpoints in the class's forward (not in ``__call__``)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers without the class: nothing to honour
        return False
    return "__call__" not in vars(GradientCheckpointingLayer)


@functools.cache
def _warn_once(message: str) -> None:
    """transformers' ``logger.warning_once``: each message once a process."""
    logging.getLogger("transformers.modeling_layers").warning(message)


def _checkpointed(layer, forward, args, kwargs):
    """transformers' checkpointing wrapper (5.2x ``forward_with_checkpointing``) around ``forward``."""
    changed = []
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
        changed.append("`use_cache=False`")
    if not getattr(layer, "_can_checkpoint_with_cache", False):
        for name in CACHE_KWARGS:
            if kwargs.get(name) is not None:
                kwargs[name] = None
                changed.append(f"`{name}=None`")
    if changed:
        _warn_once(f"Caching is incompatible with gradient checkpointing in {type(layer).__name__}. "
                   f"Setting {', '.join(changed)}.")
    return layer._gradient_checkpointing_func(functools.partial(forward, **kwargs), *args)


class LayerForward:
    """``layer.forward`` set by tigon: ``inner`` (a forward bound to ``layer``: an
    instance_methods.InstanceMethod, so that the layer pickles), checkpointed where
    transformers would checkpoint the class's forward (``checkpoint``: the class forward is the
    checkpointing one and ``inner`` is not it), and run through ``graphs`` (a layer_graphs.LayerGraphs) when
    the cuda_graphs switch is on."""

    _tigon = True

    def __init__(self, layer, inner, *, checkpoint: bool, graphs=None):
        self.layer, self.inner, self.checkpoint, self.graphs = layer, inner, checkpoint, graphs

    @property
    def __signature__(self):
        """What inspect.signature reports for the layer's forward: the class's, as before the patch."""
        return inspect.signature(types.MethodType(type(self.layer).forward, self.layer))

    def __call__(self, *args, **kwargs):
        layer = self.layer
        if (self.checkpoint and layer.training and getattr(layer, "gradient_checkpointing", False)
                and (torch.is_grad_enabled() or not CHECKPOINT_NEEDS_GRAD)):
            return _checkpointed(layer, self.inner, args, kwargs)
        if self.graphs is not None:
            return self.graphs(self.inner, args, kwargs)
        return self.inner(*args, **kwargs)
