"""tigon's functions bound to one module as its instance attributes (``forward``, ``_apply_gate``), in a form
that pickles, deep-copies and loads with the module.

A bound method (``types.MethodType``) pickles as ``getattr(module, function.__name__)``: that finds nothing for a
function that is not an attribute of the module, which is what tigon's forwards are (copies of a class forward
with other globals, closures over a family's row, rewrapped decorator chains). An :class:`InstanceMethod` is the
bound method's stand-in: called, it calls ``function(module, ...)``; pickled (``pickle``, ``torch.save``,
``copy.deepcopy``), it is the module and the function's :class:`Recipe`, a module-level maker named by reference
and its arguments (classes, family rows, names), and the copy builds its function from that recipe again. So a
copy of a patched model runs exactly the functions the original runs, made by the same code from the same
installed transformers. Each recipe is built once a process: the modules of a model, and its copies, share the
function.

``__func__`` and ``__self__`` are the bound method's: code that reads them (tests, accelerate's autocast
wrapping) sees what it would see of a bound method; ``inspect.signature`` gives the bound function's.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    """``make(*args)``: a function of tigon's. ``make`` is a module-level function (pickled by reference),
    ``args`` hashable values that pickle (classes by reference, family rows and names by value)."""

    make: object
    args: tuple = ()

    def build(self):
        return _built(self)


@functools.cache
def _built(recipe: Recipe):
    return recipe.make(*recipe.args)


def _by_reference(function) -> bool:
    """Whether pickle finds ``function`` again by its module and qualified name."""
    found = sys.modules.get(getattr(function, "__module__", None) or "")
    for name in getattr(function, "__qualname__", "<locals>").split("."):
        found = getattr(found, name, None)
    return found is function


class InstanceMethod:
    """``source`` (a module-level function, or a :class:`Recipe` of one) bound to ``module``."""

    _tigon = True

    def __init__(self, module, source):
        if isinstance(source, Recipe):
            function = source.build()
        elif _by_reference(source):
            function = source
        else:
            raise TypeError(f"{source!r} is not a module-level function: bind it through a Recipe")
        self.__self__, self.__func__, self.source = module, function, source

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self):
        return type(self), (self.__self__, self.source)

    @property
    def __signature__(self):
        return inspect.signature(types.MethodType(self.__func__, self.__self__))

    def __repr__(self):
        name = getattr(self.__func__, "__qualname__", self.__func__)
        return f"<tigon method {name} of {type(self.__self__).__name__}>"


def class_forward(cls):
    """``cls.forward``: the recipe of a module's own class forward, for a wrapper that runs it."""
    return cls.forward
