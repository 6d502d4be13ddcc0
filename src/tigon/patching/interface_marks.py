"""Marked configs and a wrapper in one of transformers' function interfaces while any mark lives.

Two patch parts stand in for a function transformers looks up by name at every call: the sdpa mask
builder (``masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]``, causal_mask.py) and the sdpa
attention function (``modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"]``, band_attention.py). Each
wrapper acts only for the models a patch marked, and must not outlive them. :class:`InterfaceWrapper`
holds that bookkeeping once for both:

* a mark is the config's identity in a dict of weak references (nothing is written into the config
  or its saved JSON), in a named group (causal_mask.py keeps two: compiled causal masks, and
  sliding-window masks made by row blocks, behind the same wrapper);
* the first mark registers the wrapper in front of whatever function is registered under the name
  (once: a registered function that is already ours is kept); the wrapper keeps that function as
  ``<original_key>`` and carries ``_tigon = True``;
* a mark goes with ``undo`` or when its config is garbage-collected (its model with it), and with
  the last mark of every group the original function is registered again, if ours is still the one
  registered (a function registered after ours stays) — except from a collection in the middle of a
  torch.compile, whose guards read the registered function (then at the next mark or unmark);
* a mark travels with its model (:func:`carried`): the patch also sets it as an attribute of the model it
  marks, so that a copy of the model (``pickle``, ``torch.save``/``torch.load``, ``copy.deepcopy``) marks its
  own config when it is made. A copy's mark goes with the copy's config.
"""

from __future__ import annotations

import importlib
import sys
import weakref

from tigon.patching.patch_handle import SetAttr


class InterfaceWrapper:
    """``wrap(original)`` registered as ``name`` in ``module.mapping`` (an interface class
    ``interface`` with a ``register`` classmethod) while a config of any group is marked."""

    def __init__(self, module: str, mapping: str, interface: str, name: str, wrap, original_key: str,
                 groups=("",), *, home: tuple[str, str]):
        self.module, self.mapping, self.interface, self.name = module, mapping, interface, name
        self.wrap, self.original_key = wrap, original_key
        self.groups: dict[str, dict[int, weakref.ref]] = {group: {} for group in groups}
        self.home = home  # (module, attribute) where tigon keeps this wrapper: how it pickles

    def __reduce__(self):
        return _wrapper_at, self.home

    def marked(self, config, group: str = "") -> bool:
        ref = self.groups[group].get(id(config))
        return ref is not None and ref() is config

    def any_marked(self) -> bool:
        return any(self.groups.values())

    def install(self) -> bool:
        """Register the wrapper in front of the current function (once); False where the installed
        transformers has no such interface or name (nothing to do then)."""
        try:
            module = importlib.import_module(self.module)
        except ImportError:
            return False
        mapping, interface = getattr(module, self.mapping, None), getattr(module, self.interface, None)
        if mapping is None or interface is None:
            return False
        current = mapping._global_mapping.get(self.name)
        if current is None:
            return False
        if not getattr(current, "_tigon", False):
            wrapped = self.wrap(current)
            wrapped._tigon = True
            setattr(wrapped, self.original_key, current)
            interface.register(self.name, wrapped)
        return True

    def uninstall(self) -> None:
        """The original function back, if ours is still the registered one. No import: this also runs
        from a weakref callback, possibly while the interpreter shuts down."""
        module = sys.modules.get(self.module)
        if module is None:
            return
        current = getattr(module, self.mapping)._global_mapping.get(self.name)
        if getattr(current, "_tigon", False):
            getattr(module, self.interface).register(self.name, getattr(current, self.original_key))

    def _forget(self, key: int, group: str) -> None:
        """A marked config was garbage-collected: drop the mark, and with the last one register the original
        function again, unless torch.compile is compiling a frame. The collection can run in the middle of a
        compile, whose guards read the registered function (the wrapper's closure) after tracing through it:
        swapped meanwhile, the guard cannot be built. The wrapper then stays registered, passing every
        unmarked call through, until the next mark or unmark, or the next collected mark outside a compile."""
        if self.groups[group].pop(key, None) is not None and not self.any_marked() and not _compiling():
            self.uninstall()

    def mark(self, config, group: str = "") -> Mark:
        """The patch change (``apply``/``undo``) that marks ``config`` in ``group``."""
        return Mark(self, config, group)


class Mark:
    """A patch change: ``apply`` marks the config (and installs the wrapper), ``undo`` unmarks it. A copy of a
    mark (pickled or deep-copied with its model, :func:`carried`) marks the copy's config."""

    def __init__(self, owner: InterfaceWrapper, config, group: str):
        self.owner, self.config, self.group = owner, config, group

    def __reduce__(self):
        return _marked, (self.owner, self.config, self.group)

    def apply(self):
        owner, group = self.owner, self.group
        if owner.install():
            key = id(self.config)
            owner.groups[group][key] = weakref.ref(self.config, lambda _, key=key: owner._forget(key, group))

    def undo(self):
        owner = self.owner
        if owner.marked(self.config, self.group):
            del owner.groups[self.group][id(self.config)]
        if not owner.any_marked():  # (also a wrapper a collection during a compile left registered)
            owner.uninstall()


def _compiling() -> bool:
    """torch.compile is compiling a frame (tracing it or building its guards)."""
    guards = sys.modules.get("torch._guards")
    return guards is not None and guards.CompileContext.try_get() is not None


def _wrapper_at(module: str, attribute: str) -> InterfaceWrapper:
    return getattr(importlib.import_module(module), attribute)


def _marked(owner: InterfaceWrapper, config, group: str) -> Mark:
    mark = Mark(owner, config, group)
    mark.apply()
    return mark


def carried(root, mark: Mark) -> list:
    """The changes that apply ``mark`` and keep it with ``root`` (the model whose config it marks): the mark,
    and the mark as an attribute of ``root``, which copies of ``root`` carry."""
    group = mark.group or "on"
    return [mark, SetAttr(root, f"_tigon_mark_{mark.owner.home[0].rsplit('.', 1)[-1]}_{group}", mark)]
