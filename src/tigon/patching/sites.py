"""Where a part of a model sits and whether tigon may touch it: the helpers every part's planner shares.

- :func:`sites`: every module of a class under a root, with all the places it sits in the tree.
- :func:`check_plain`: a module runs its class's own forward (no subclass override, nothing on the instance).
- :func:`own_forward` / :func:`is_tigon`: the forward set on an instance, and whether tigon set it.
- :func:`on_meta`, :func:`full_shape`: building tigon's modules that adopt a model's parameters.
- :func:`transformers_version`: for the messages that say a release does not match tigon's table.
"""

from __future__ import annotations

import torch
from torch import nn


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def is_tigon(fn) -> bool:
    """Whether ``fn`` (a function, a bound method or a callable object) is one tigon set."""
    return getattr(getattr(fn, "__func__", fn), "_tigon", False)


def own_forward(module):
    """The forward set on the instance itself (None when it uses its class's)."""
    return vars(module).get("forward")


def check_plain(module, cls, path):
    """``module`` must run ``cls.forward`` unchanged: no subclass override, no forward on the instance."""
    if type(module).forward is not cls.forward:
        raise ValueError(
            f"{path} is a {type(module).__name__} whose forward overrides {cls.__name__}.forward; "
            "tigon patches only transformers' own modules"
        )
    if own_forward(module) is not None:
        raise ValueError(
            f"{path} has a forward set on the instance (a hook wrapper?); patch the model before wrapping it"
        )


def sites(root: nn.Module, cls: type):
    """Every module of class ``cls`` under ``root`` with all the (parent, name) places it sits, and its path."""
    paths = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    found: dict[int, tuple[nn.Module, list]] = {}
    for parent in root.modules():
        for name, child in parent._modules.items():
            if isinstance(child, cls):
                found.setdefault(id(child), (child, []))[1].append((parent, name))
    return [(child, places, paths.get(id(child), "?")) for child, places in found.values()]


def on_meta(build):
    """Construct a tigon module without allocating: its parameters are replaced by the adopted ones."""
    with torch.device("meta"):
        return build()


def full_shape(parameter) -> tuple[int, ...]:
    """A parameter's shape, also when DeepSpeed ZeRO-3 holds it partitioned: a model built under
    ``deepspeed.zero.Init`` (transformers does so under a ZeRO-3 config) is patched while its
    parameters are empty placeholders, their shapes in ``ds_shape``."""
    return tuple(getattr(parameter, "ds_shape", parameter.shape))
