"""Where a part of a model sits and whether tigon may touch it: the helpers every part's planner shares.

- :func:`sites`: every module of a class under a root, with all the places it sits in the tree.
- :func:`check_plain`: a module runs its class's own forward (no subclass override, nothing on the instance but
  a Hugging Face Hub kernel where tigon's module takes the module's place).
- :func:`hub_kernel`: the Hub kernel that transformers' ``use_kernels`` set on a module, if any.
- :func:`own_forward` / :func:`is_tigon`: the forward set on an instance, and whether tigon set it.
- :func:`on_meta`, :func:`full_shape`: building tigon's modules that adopt a model's parameters.
- :func:`transformers_version`: for the messages that say a release does not match tigon's table.
"""

from __future__ import annotations

import types

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


def hub_kernel(module):
    """The Hugging Face Hub kernel whose forward runs on ``module`` in place of its class's, or None.

    From transformers 5.25, ``from_pretrained`` calls the ``kernels`` library's ``kernelize`` by default
    (``use_kernels``; off with ``USE_HUB_KERNELS=0``), and ``model.train()`` / ``model.eval()`` call it again. For
    each module whose class transformers marked with ``use_kernel_forward_from_hub`` (its RMSNorm classes, the
    activations) that has a kernel mapped for the model's device, kernelize binds the Hub layer's forward on the
    instance and records the repository in the instance's ``_kernel_repo`` (on CUDA: Liger-Kernel's RMSNorm from
    kernels-community/liger-kernels). Returns that repository; a forward set on the instance by anything else
    (a hook wrapper) is not one."""
    forward, repo = own_forward(module), vars(module).get("_kernel_repo")
    if repo is not None and isinstance(forward, types.MethodType) and forward.__self__ is module:
        return repo
    return None


def check_plain(module, cls, path, *, replaced_whole=False):
    """``module`` must run ``cls.forward`` unchanged: no subclass override, no forward on the instance.

    ``replaced_whole``: tigon's module takes this module's place in the tree (the norms), so a Hub kernel's forward
    on the instance (:func:`hub_kernel`) goes with it: both compute the class's function, and tigon's module, whose
    class the ``kernels`` library does not know, keeps its own forward when ``model.train()`` kernelizes again.
    ``Patch.revert()`` puts the module back with the Hub kernel still on it."""
    if type(module).forward is not cls.forward:
        raise ValueError(
            f"{path} is a {type(module).__name__} whose forward overrides {cls.__name__}.forward; "
            "tigon patches only transformers' own modules"
        )
    if own_forward(module) is None:
        return
    repo = hub_kernel(module)
    if repo is not None and replaced_whole:
        return
    if repo is not None:
        raise ValueError(
            f"{path} runs the Hub kernel {repo} that transformers' use_kernels set on it, which tigon "
            "would replace on the instance only for the next model.train() to put back: load the model with "
            "use_kernels=False (or set USE_HUB_KERNELS=0) to patch it"
        )
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
