"""A decoder layer's checkpoint function, and the wrappers tigon puts around it.

transformers' decoder layers checkpoint through a function each layer holds, ``_gradient_checkpointing_func``
(``gradient_checkpointing_enable()`` sets it on every layer: ``functools.partial`` of
``torch.utils.checkpoint.checkpoint`` with the user's keyword arguments), called as ``func(function, *args)``
with the layer's forward as ``function``: in ``GradientCheckpointingLayer.__call__`` around ``Module.__call__``
(transformers 5.17–5.22), inside ``forward`` (5.23 on). Two switches act around that call:

- ``offload_activations`` enters its scope around it (:class:`tigon.nn.activation_offload.ScopedCheckpoint`),
  where the call is outside the layer's hooks;
- ``keep_attention`` hands the checkpoint a function that keeps the attention kernel's outputs from the forward
  for the recompute (:class:`tigon.nn.kept_attention.KeepingCheckpoint`).

Each is a :class:`CheckpointWrapper` that names the change that made it (``owner``), so the wrappers form a
chain in whichever order the switches came: :func:`wrap` adds an owner's wrapper unless the chain holds it
already, :func:`unwrap` takes it out wherever it sits and leaves the others. ``gradient_checkpointing_enable()``
after the patch sets a new function on each layer: a :class:`CheckpointWrap` change wraps it again before the
next forward (a forward pre-hook on the module whose forward calls the layers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

CHECKPOINT_ATTR = "_gradient_checkpointing_func"  # transformers' checkpoint function, on each layer


class CheckpointWrapper(ABC):
    """A checkpoint function that acts around ``inner``, the function it wraps; ``owner``: the change that made it.
    Subclasses say what it does around the call."""

    def __init__(self, owner, inner):
        self.owner, self.inner = owner, inner

    @abstractmethod
    def __call__(self, function, *args, **kwargs):
        """``inner(function, *args, **kwargs)``, with what the wrapper does around it."""


def wrap(layer: torch.nn.Module, owner, make) -> None:
    """Wrap ``layer``'s checkpoint function in ``make(function)`` unless ``owner``'s wrapper is in its chain (or the
    layer has none: checkpointing never enabled). Not while torch.compile traces (the switches stay off there)."""
    if torch.compiler.is_compiling():
        return
    function = vars(layer).get(CHECKPOINT_ATTR)
    wrapped = function
    while isinstance(wrapped, CheckpointWrapper):
        if wrapped.owner is owner:
            return
        wrapped = wrapped.inner
    if function is not None:
        vars(layer)[CHECKPOINT_ATTR] = make(function)


def unwrap(layer: torch.nn.Module, owner) -> None:
    """Take ``owner``'s wrapper out of ``layer``'s chain, wherever it sits."""
    outer, wrapped = None, vars(layer).get(CHECKPOINT_ATTR)
    while isinstance(wrapped, CheckpointWrapper):
        if wrapped.owner is owner:
            if outer is None:
                vars(layer)[CHECKPOINT_ATTR] = wrapped.inner
            else:
                outer.inner = wrapped.inner
            return
        outer, wrapped = wrapped, wrapped.inner


class CheckpointWrap(ABC):
    """A change that keeps its wrapper (:meth:`wrapper`) around ``layer``'s checkpoint function: wrapped when
    applied, and again before each forward of ``caller`` (the module whose forward calls the layer; None: now
    only) where ``gradient_checkpointing_enable()`` has set a new function since. ``undo`` removes the hook and
    takes the wrapper out. Subclasses say what the wrapper does and may add hooks of their own to ``handles``."""

    def __init__(self, layer: torch.nn.Module, caller: torch.nn.Module | None = None):
        self.layer, self.caller, self.handles = layer, caller, []

    @abstractmethod
    def wrapper(self, function) -> CheckpointWrapper:
        """This change's wrapper around ``function``."""

    def apply(self):
        if self.caller is not None:
            self.handles.append(self.caller.register_forward_pre_hook(self.wrap_checkpoint))
        self.wrap_checkpoint()

    def wrap_checkpoint(self, *_hook_args):
        wrap(self.layer, self, self.wrapper)

    def undo(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        unwrap(self.layer, self)
