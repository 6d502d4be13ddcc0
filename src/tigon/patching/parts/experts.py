"""The experts part (the ``mlp`` switch on a MoE family): each experts module behind transformers' experts dispatch
gets tigon's fused gate and forward (experts_forwards.py says what they run and why).

Checked at patch time, the model untouched on a mismatch (ValueError): the class's ``forward`` is
``use_experts_implementation``'s dispatch; the module gates (``has_gate``), has no post-expert norm, and packs
gate/up in the row's layout (``is_concatenated``); its ``_apply_gate`` is the decorator's default with a silu /
gelu / gelu-tanh ``act_fn``, or (GPT-OSS's activation) computes what ``moe_glu`` computes on a probe. An eager
loop that neither calls ``_apply_gate`` nor is the known loop keeps running as it is, with a warning (the
matmul implementations are still fused).
"""

from __future__ import annotations

import warnings

import torch

from tigon.patching.experts_forwards import (
    ACT_FN,
    CLAMPED_SWIGLU,
    GATE_ATTR,
    KERNEL_ACTIVATIONS,
    check_class,
    eager_kind,
    experts_forward,
    fused_gate,
)
from tigon.patching.instance_methods import InstanceMethod, Recipe
from tigon.patching.parts import Part
from tigon.patching.parts.mlp import glu_of
from tigon.patching.patch_handle import SetAttr
from tigon.patching.sites import check_plain, is_tigon, sites


def _activation(module, spec, path):
    """(kernel activation name, alpha, limit) of one experts module."""
    if spec.activation == CLAMPED_SWIGLU:
        alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, limit)):
            raise ValueError(f"{path} has no numeric alpha / limit for GPT-OSS's clamped swiglu")
        return CLAMPED_SWIGLU, float(alpha), float(limit)
    act = getattr(module, ACT_FN, None)
    glu = glu_of(act)
    if glu is None:
        raise ValueError(
            f"{path}.{ACT_FN} is {type(act).__name__}: tigon fuses silu, gelu and gelu-tanh experts only "
            "(custom activation); pass mlp=False to patch the rest"
        )
    kind, kwargs = glu
    return KERNEL_ACTIVATIONS[(kind, kwargs.get("approximate"))], 0.0, 0.0


def _probe_gate(module, spec, path, activation, alpha, limit):
    """The class's ``_apply_gate`` must compute what moe_glu computes: fp64 values across the
    activation's range (past ±limit for the clamps) on the CPU."""
    from tigon.ops.moe_glu import moe_glu_reference

    span = 1.5 * limit if activation == CLAMPED_SWIGLU else 8.0
    probe = torch.linspace(-span, span, 2 * 8 * 3, dtype=torch.float64).reshape(8, 6)
    probe = probe[torch.randperm(8, generator=torch.Generator().manual_seed(0))]
    try:
        got = type(module)._apply_gate(module, probe)
    except Exception as err:  # noqa: BLE001 (any failure means "not what the row says")
        raise ValueError(f"{path}.{GATE_ATTR} cannot be checked on a probe ({err})") from err
    want = moe_glu_reference(probe, spec.layout, activation, alpha=alpha, limit=limit)
    same = isinstance(got, torch.Tensor) and got.shape == want.shape
    if not (same and torch.allclose(got, want, rtol=1e-9, atol=1e-12)):
        raise ValueError(
            f"{path}.{GATE_ATTR} does not compute {activation} on the {spec.layout} layout (custom gate); "
            "pass mlp=False to patch the rest"
        )


def experts_line(family, cls, kind) -> str:
    spec = family.experts
    activation = ("activation read from each module's act_fn" if spec.activation == ACT_FN
                  else f"{spec.activation} with each module's alpha and limit")
    text = (f"{cls.__name__}.{GATE_ATTR} -> tigon.ops.moe_glu ({spec.layout} layout, {activation}) in every "
            "experts implementation")
    if kind == "inline":
        text += "; eager loop -> the same loop through it"
    elif kind is None:
        text += "; the eager loop (not the one tigon knows) stays stock"
    return text + "; under autocast the experts' weights in the autocast dtype (instance attributes)"


def plan_experts(plan, model, family, classes, switches=None):
    """The experts of one model: every module of the row's experts class under ``model``."""
    spec, cls = family.experts, classes.experts
    kind = check_class(family, cls)
    if kind is None:
        warnings.warn(
            f"tigon: {cls.__name__}'s eager loop is not the one tigon knows: under the 'eager' experts "
            "implementation its gate stays unfused; grouped_mm and batched_mm are fused",
            stacklevel=4,
        )
    text = experts_line(family, cls, kind)
    forward = Recipe(experts_forward, (cls, kind == "inline"))
    for module, _, path in sites(model, cls):
        if is_tigon(vars(module).get(GATE_ATTR)):
            continue
        check_plain(module, cls, path)
        if GATE_ATTR in vars(module):
            raise ValueError(f"{path} has its own {GATE_ATTR} set on the instance; tigon will not replace it")
        if not getattr(module, "has_gate", False) or getattr(module, "has_post_expert_norm", False):
            raise ValueError(f"{path} is not a gated experts module without post-expert norm")
        if bool(getattr(module, "is_concatenated", True)) != (spec.layout == "halves"):
            raise ValueError(f"{path}.is_concatenated does not match the {spec.layout} layout of tigon's table")
        activation, alpha, limit = _activation(module, spec, path)
        _probe_gate(module, spec, path, activation, alpha, limit)
        gate = InstanceMethod(module, Recipe(fused_gate, (spec.layout, activation)))
        plan.add(SetAttr(module, GATE_ATTR, gate), text)
        plan.add(SetAttr(module, "forward", InstanceMethod(module, forward)))


def _lines(family, classes):
    try:
        kind = eager_kind(classes.experts)
    except ValueError:
        kind = None
    return [experts_line(family, classes.experts, kind)]


EXPERTS = Part("mlp", lambda f, c: c.experts is not None, plan_experts, lambda f, c, s: _lines(f, c))
