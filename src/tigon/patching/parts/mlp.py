"""The ``mlp`` part: gated MLPs run tigon's GLU.

- split MLPs (``gate_proj``/``up_proj``/``down_proj``) are swapped for ``tigon.nn.SwiGLUMLP`` / ``GEGLUMLP``
  that adopt the same projection modules (so LoRA-wrapped projections keep working);
- split MLPs whose row names multipliers or an output dropout (Falcon-H1, Seed-OSS) keep their module and get
  an instance forward that runs them as stock does around tigon's GLU (:func:`split_glu_forward`);
- fused ``gate_up_proj`` MLPs (Phi-3, GLM-4) keep their module and get a GLU forward on the instance
  (:func:`fused_gate_up_forward`).

The activation is read from each module and must be one tigon fuses (:func:`glu_of`); MoE experts, also under
the ``mlp`` switch, are experts.py's.
"""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import nn

from tigon.nn.lora import adapter_lines, outside_lines
from tigon.patching.instance_methods import InstanceMethod, Recipe
from tigon.patching.parts import Part
from tigon.patching.patch_handle import SetAttr, SwapModule
from tigon.patching.sites import check_plain, is_tigon, on_meta, own_forward, sites

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def fused_gate_up_forward(activation):
    """Forward for a ``gate_up_proj`` MLP (Phi-3): the first half of the projection is the gate, ``activation``
    the GLU's ("silu", "gelu_tanh", "gelu")."""
    from tigon.ops.glu import glu

    def forward(self, hidden_states):
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)  # (..., I) each
        return self.down_proj(glu(gate, up, activation))

    forward._tigon = True
    return forward


def split_glu_forward(activation, gate_multiplier=None, down_multiplier=None, dropout=None):
    """Forward for a split MLP with extras (families.Mlp): transformers' ::

        y = down_proj(act(gate_proj(x) * g) * up_proj(x)) * d;  y = dropout(y, p, training)

    with ``act(·) * up`` as tigon's GLU (``activation``: "silu", "gelu_tanh", "gelu"). g, d and p are
    read from the module at each call (the attribute names given here; None: no such step). The
    multiplies and the dropout are the same torch ops as stock's, in the same order, so they round and
    draw random numbers as stock does. Without a gate multiplier, ``down_proj(act(gate) * up)`` is
    tigon's recomputing node where the projections read exactly (``tigon.nn.mlp.projections_node``, as
    ``tigon.nn.SwiGLUMLP`` runs it).
    """
    from tigon.nn.mlp import projections_node
    from tigon.ops.glu import glu

    def forward(self, x):
        gate_proj, up_proj, down_proj = self.gate_proj, self.up_proj, self.down_proj
        y = None if gate_multiplier is not None else projections_node(x, gate_proj, up_proj, down_proj,
                                                                      activation)  # (..., H)
        if y is None:
            gate = gate_proj(x)  # (..., I)
            if gate_multiplier is not None:
                gate = gate * getattr(self, gate_multiplier)
            y = down_proj(glu(gate, up_proj(x), activation))  # (..., H)
        if down_multiplier is not None:
            y = y * getattr(self, down_multiplier)
        if dropout is not None:
            y = F.dropout(y, p=getattr(self, dropout), training=self.training)
        return y

    forward._tigon = True
    return forward


def glu_of(act):
    """The GLU a gated MLP's activation makes: ("swiglu", {}) or ("geglu", {approximate}), else None."""
    from transformers import activations

    silu_types = tuple(t for t in (nn.SiLU, getattr(activations, "SiLUActivation", None)) if t is not None)
    if type(act) in silu_types:
        return "swiglu", {}
    if type(act) is nn.GELU and act.approximate in ("none", "tanh"):
        return "geglu", {"approximate": act.approximate}
    fn = getattr(act, "act", None)
    if type(act) is getattr(activations, "GELUTanh", None) and isinstance(fn, functools.partial):
        if fn.func is F.gelu and fn.keywords == {"approximate": "tanh"} and not fn.args:
            return "geglu", {"approximate": "tanh"}
    if type(act) is getattr(activations, "GELUActivation", None) and fn is F.gelu:
        return "geglu", {"approximate": "none"}
    return None


def _activation(module, spec, path):
    """(kind, keywords, kernel activation name) of one MLP module's activation."""
    from tigon.ops.glu import gelu_activation_name

    act = getattr(module, spec.act_attr, None)
    glu = glu_of(act)
    if glu is None:
        raise ValueError(
            f"{path}.{spec.act_attr} is {type(act).__name__}: tigon has fused GLUs for silu, gelu and "
            "gelu-tanh only (custom activation); pass mlp=False to patch the rest"
        )
    kind, kwargs = glu
    return kind, kwargs, "silu" if kind == "swiglu" else gelu_activation_name(kwargs["approximate"])


def _check_number(module, attr, path):
    value = getattr(module, attr, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}.{attr} is {type(value).__name__}, not the number the family's row expects")


def _plan_split_mlps_with_extras(plan, root, family, classes):
    """Split MLPs whose forward reads multipliers / a dropout (families.Mlp): an instance forward."""
    spec = family.mlp
    extras = (spec.gate_multiplier, spec.down_multiplier, spec.dropout)
    named = ", ".join(attr for attr in extras if attr is not None)
    for old, _, path in sites(root, classes.mlp):
        if is_tigon(own_forward(old)):
            continue
        check_plain(old, classes.mlp, path)
        kind, _, activation = _activation(old, spec, path)
        if any(old._modules.get(name) is None for name in PROJECTIONS):
            raise ValueError(f"{path} ({type(old).__name__}) lacks gate_proj / up_proj / down_proj")
        for attr in extras:
            if attr is not None:
                _check_number(old, attr, path)
        forward = Recipe(split_glu_forward, (activation, *extras))
        line = f"{classes.mlp.__name__}.forward -> tigon.ops.{kind} with stock {named} (instance forward)"
        plan.add(SetAttr(old, "forward", InstanceMethod(old, forward)), line)
        projections = {name: old._modules[name] for name in PROJECTIONS}
        if spec.gate_multiplier is None:  # the node, with the adapters inside it (split_glu_forward)
            lora_lines = adapter_lines(projections, "MLP", "the MLP fuses only its activation")
        else:
            lora_lines = outside_lines(projections, f"the MLP's {spec.gate_multiplier} scales the gate between "
                                       "its projections; tigon's GLU between them")
        for lora_line in lora_lines:
            plan.note(lora_line)


def _plan_split_mlps(plan, root, family, classes):
    from tigon.nn.mlp import GEGLUMLP, SwiGLUMLP

    spec = family.mlp
    for old, places, path in sites(root, classes.mlp):
        check_plain(old, classes.mlp, path)
        kind, kwargs, _ = _activation(old, spec, path)
        projections = [old._modules.get(name) for name in PROJECTIONS]
        if any(p is None for p in projections):
            raise ValueError(f"{path} ({type(old).__name__}) lacks gate_proj / up_proj / down_proj")
        gate = projections[0]
        hidden, inter = getattr(gate, "in_features", None), getattr(gate, "out_features", None)
        if not (isinstance(hidden, int) and isinstance(inter, int)):
            raise ValueError(f"{path}.gate_proj has no in_features / out_features")
        module_cls = SwiGLUMLP if kind == "swiglu" else GEGLUMLP
        new = on_meta(lambda c=module_cls, h=hidden, i=inter, k=kwargs: c(h, i, **k))
        for name, proj in zip(PROJECTIONS, projections, strict=True):
            setattr(new, name, proj)
        new.train(old.training)
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        line = f"{classes.mlp.__name__} -> tigon.nn.{module_cls.__name__}({args})"
        plan.add(SwapModule(old, new, places), line)
        for lora_line in adapter_lines(dict(zip(PROJECTIONS, projections, strict=True)), "MLP",
                                       "the MLP fuses only its activation"):
            plan.note(lora_line)


def _plan_fused_mlps(plan, root, family, classes):
    spec = family.mlp
    for old, _, path in sites(root, classes.mlp):
        if is_tigon(own_forward(old)):
            continue
        check_plain(old, classes.mlp, path)
        kind, _, activation = _activation(old, spec, path)
        if old._modules.get("gate_up_proj") is None or old._modules.get("down_proj") is None:
            raise ValueError(f"{path} ({type(old).__name__}) lacks gate_up_proj / down_proj")
        forward = Recipe(fused_gate_up_forward, (activation,))
        line = f"{classes.mlp.__name__}.forward -> tigon.ops.{kind} on gate_up_proj (instance forward)"
        plan.add(SetAttr(old, "forward", InstanceMethod(old, forward)), line)
        for lora_line in outside_lines({name: old._modules[name] for name in ("gate_up_proj", "down_proj")},
                                       "a fused gate_up_proj has no LoRA node; tigon's GLU between the projections"):
            plan.note(lora_line)


def plan_mlps(plan, root, family, classes, switches=None):
    if family.mlp.layout == "fused":
        _plan_fused_mlps(plan, root, family, classes)
    elif family.mlp.extras:
        _plan_split_mlps_with_extras(plan, root, family, classes)
    else:
        _plan_split_mlps(plan, root, family, classes)


def mlp_line(classes):
    return f"{classes.mlp.__name__} -> tigon GLU (activation read from each module)"


MLPS = Part("mlp", lambda f, c: c.mlp is not None, plan_mlps, lambda f, c, s: [mlp_line(c)])
