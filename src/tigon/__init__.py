"""tigon: exact, fused Triton kernels for LLM training.

Three levels of use (see README.md): ``tigon.patch(model)`` for transformers models, ``tigon.nn``
modules, and ``tigon.ops`` functions. Submodules load on first use, so that ``import tigon`` (and
the ``tigon`` command) can still decide on the Triton interpreter before any kernel is defined.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "ops": ("tigon.ops", None),
    "nn": ("tigon.nn", None),
    "losses": ("tigon.losses", None),
    "patching": ("tigon.patching", None),
    "patch": ("tigon.patching", "patch"),
    "Patch": ("tigon.patching", "Patch"),
    "supported_models": ("tigon.patching", "supported_models"),
    "AutoModelForCausalLM": ("tigon.patching", "AutoModelForCausalLM"),
    "patch_trl": ("tigon.patching.trl", "patch_trl"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tigon' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
