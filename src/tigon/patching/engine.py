"""The one engine: apply a family row (families.py) to a model instance or to a ``model_type``.

Instance patch, ``patch(model, **switches)``: plan every change first, validating the model against
its row (class identity, norm weights and eps, MLP projections and activation, the attention forward's
reference to ``apply_rotary_pos_emb``, a plain ``lm_head``); any mismatch raises ValueError with the
model untouched. Then apply, and undo what was applied if anything fails midway. The changes:

- norms: each RMSNorm/LayerNorm module is swapped for a ``tigon.nn`` module that adopts the *same*
  weight (and bias) ``Parameter``; state-dict keys and optimizer state stay valid.
- decoder layers whose residual joins sit beside norms (pre-norm layers as Llama's, Gemma-2/3's
  sandwich, OLMo-2/3's post-norms), with the norms: each gets, on the instance, a forward that runs
  those joins as fused tigon ops (joins.py). The class forward is checked statement for statement
  first; another one (another transformers version's) keeps running, with a warning. That forward is
  checkpointed as transformers checkpoints the class's (layer_forward.py: since 5.2x, in the class forward
  that an instance forward would otherwise bypass).
- with ``cuda_graphs=True`` (off by default): each decoder layer's forward, whichever it is, runs through
  graphs.py, which replays the layer's training forward and backward as captured CUDA graphs.
- split MLPs: swapped for ``tigon.nn.SwiGLUMLP`` / ``GEGLUMLP`` that adopt the same
  ``gate_proj``/``up_proj``/``down_proj`` child modules (so LoRA-wrapped projections keep working);
  fused ``gate_up_proj`` MLPs (Phi-3, GLM-4) keep their module and get a GLU forward on the instance,
  as do split MLPs whose row names multipliers or an output dropout (Falcon-H1, Seed-OSS: the forward
  runs them as stock does around tigon's GLU, forwards.split_glu_forward).
- rope: each attention module gets, on the instance, a copy of its class's forward whose globals map
  ``apply_rotary_pos_emb`` to tigon's rope (``types.FunctionType`` with a new globals dict); the
  transformers module's globals are never assigned.
- with rope, under autocast: each attention module's ``q_proj``/``k_proj``/``v_proj`` cast their
  common fp32 input once and save one copy instead of three (on the GPU they run as one stacked
  matmul), and its projections (``o_proj`` too)
  cast their weights again in the backward instead of saving bf16 copies (shared_cast.py); bitwise
  the same results (on the GPU, fp32 gradients are written in fp32 by the matmuls, not rounded to bf16).
- with rope: the model's config is marked so that, under torch.compile, sdpa attention runs causal
  without a dense mask wherever eager mode does (causal_mask.py); exactly the same attention.
- loss: the CausalLM instance gets the generic forward of loss.py and ``lm_head`` learns to take a
  target (fused linear cross-entropy), or the instance's ``loss_function`` becomes tigon's
  cross-entropy.

Class patch, ``patch("llama", **switches)``: the family's base model and CausalLM classes get a
``post_init`` (the hook every transformers model runs at the end of ``__init__``) that applies the
instance patch above to each model built afterwards; models built before are left alone. ``revert()``
removes the hooks (models built meanwhile keep their patch).

Every replacement is logged once at INFO and listed in ``Patch.replaced``; ``revert()`` undoes the
changes in reverse order, handing each swapped-out module back the parameters its replacement holds.
Patching what is already patched is a no-op.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import types
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tigon.patching import (
    causal_mask,
    fused_attention,
    graphs,
    joins,
    long_context,
    recompute,
    sliding_window,
    vision_attention,
    vision_language,
    wrappers,
)
from tigon.patching import experts as moe_experts
from tigon.patching import forwards as replacement_forwards
from tigon.patching import loss as loss_path
from tigon.patching.changes import Patch, _apply, _Plan, _SetAttr, _SwapModule
from tigon.patching.families import FAMILIES, Family
from tigon.patching.layer_forward import LayerForward, checkpoint_wrappers, checkpoints_in_class_forward
from tigon.patching.shared_cast import CACHE_ATTR, CastCache, shared_cast_linear

logger = logging.getLogger("tigon.patching")

SWITCHES = {
    "rope": True,
    "rms_norm": True,
    "layer_norm": True,
    "mlp": True,
    "cross_entropy": False,
    "fused_linear_cross_entropy": True,
    "cuda_graphs": False,
    "recompute_norms": False,
    "sliding_window": True,
    "vision_attention": True,
    "fused_attention": True,
    "offload_activations": False,
    "tiled_mlp": False,
}
ROTARY_NAME = "apply_rotary_pos_emb"
QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
OUTPUT_PROJECTION = "o_proj"
VISION_PROJECTIONS = ("qkv", "proj")  # the Qwen-VL vision attention's (its FORWARD_SOURCE calls both)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def supported_models() -> list[str]:
    """The ``model_type`` strings ``tigon.patch`` accepts."""
    return sorted(FAMILIES)


# ----------------------------------------------------------------------------------------- switches


def _check_switches(switches: dict) -> dict:
    unknown = sorted(set(switches) - set(SWITCHES))
    if unknown:
        raise ValueError(f"unknown switch(es) {unknown}; supported: {sorted(SWITCHES)}")
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"switch {name} must be True or False, got {value!r}")
    chosen = {**SWITCHES, **switches}
    # The two losses are exclusive. Asking for cross_entropy turns off the fused linear loss where that
    # is only on by default; both asked for is an error.
    if switches.get("cross_entropy") and "fused_linear_cross_entropy" not in switches:
        chosen["fused_linear_cross_entropy"] = False
    if chosen["cross_entropy"] and chosen["fused_linear_cross_entropy"]:
        raise ValueError(
            "cross_entropy and fused_linear_cross_entropy are exclusive: pass one of them True, not both"
        )
    if chosen["recompute_norms"] and not chosen["rms_norm"]:
        raise ValueError("recompute_norms remakes the outputs of tigon's norms: it needs rms_norm=True")
    if chosen["recompute_norms"] and chosen["cuda_graphs"]:
        raise ValueError("recompute_norms and cuda_graphs are exclusive (a captured layer's backward cannot "
                         "run the recompute's Python)")
    return chosen


def _family_for(model_type) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {supported_models()}")
    return FAMILIES[model_type]


@dataclass(frozen=True)
class _Classes:
    """A row's class names resolved in the installed transformers."""

    module: types.ModuleType
    causal_lm: type
    model: type
    norm: type | None
    layer_norm: type | None
    mlp: type | None
    attention: type | None
    decoder_layer: type | None
    experts: type | None = None
    vision: _Classes | None = None  # a vision-language row's vision side (vision_language.vision_family)


def _lookup(module, dotted: str, family: Family, part: str):
    obj = module
    for piece in dotted.split("."):
        obj = getattr(obj, piece, None)
        if obj is None:
            raise ValueError(
                f"{family.model_type}: {part}: {module.__name__} has no {dotted} in transformers "
                f"{_transformers_version()}: this version does not match tigon's table"
            )
    return obj


def _resolve(family: Family) -> _Classes:
    try:
        module = importlib.import_module(family.module_name)
    except ImportError as err:
        raise ValueError(f"cannot import {family.module_name} ({family.model_type!r}): {err}") from err

    def get(spec, part):
        return None if spec is None else _lookup(module, spec if isinstance(spec, str) else spec.cls, family, part)

    classes = _Classes(
        module=module,
        causal_lm=get(family.causal_lm, "loss"),
        model=get(family.model, "loss"),
        norm=get(family.norm, "rms_norm"),
        layer_norm=get(family.layer_norm, "layer_norm"),
        mlp=get(family.mlp, "mlp"),
        attention=get(family.attention, "rope"),
        decoder_layer=get(family.decoder_layer, "decoder layer"),
        experts=get(family.experts, "mlp"),
    )
    if classes.attention is not None:
        # The forward's body, through any decorators (5.24 wraps it in @deprecate_kwarg): a wrapper
        # that does not call what it names raises here too.
        try:
            rotary = wrappers.calls_global(classes.attention.forward, family.rotary)
        except wrappers.WrapperMismatch as err:
            raise ValueError(f"{family.model_type}: rope: {classes.attention.__name__}.forward: {err}") from err
        if not rotary:
            raise ValueError(
                f"{family.model_type}: rope: {classes.attention.__name__}.forward does not call the module-level "
                f"{family.rotary} in transformers {_transformers_version()}: this version does not match tigon's table"
            )
    if family.is_vision_language:
        classes = dataclasses.replace(classes, vision=_resolve(vision_language.vision_family(family)))
    # The forwards tigon copies or rewraps must show the body they run, through every decorator.
    for part, cls in (("loss", classes.causal_lm), ("decoder layer", classes.decoder_layer)):
        if cls is not None:
            try:
                wrappers.wrapper_chain(cls.forward)
            except wrappers.WrapperMismatch as err:
                raise ValueError(f"{family.model_type}: {part}: {cls.__name__}.forward: {err}") from err
    if family.router_aux_loss is not None:
        _lookup(module, family.router_aux_loss, family, "loss")
    return classes


# ------------------------------------------------------------------------------------- instance plan


def _is_tigon(fn) -> bool:
    return getattr(getattr(fn, "__func__", fn), "_tigon", False)


def _own_forward(module):
    """The forward set on the instance itself (None when it uses its class's)."""
    return vars(module).get("forward")


def _check_plain(module, cls, path):
    """``module`` must run ``cls.forward`` unchanged: no subclass override, no forward on the instance."""
    if type(module).forward is not cls.forward:
        raise ValueError(
            f"{path} is a {type(module).__name__} whose forward overrides {cls.__name__}.forward; "
            "tigon patches only transformers' own modules"
        )
    if _own_forward(module) is not None:
        raise ValueError(
            f"{path} has a forward set on the instance (a hook wrapper?); patch the model before wrapping it"
        )


def _sites(root: nn.Module, cls: type):
    """Every module of class ``cls`` under ``root`` with all the (parent, name, path) places it sits."""
    paths = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    found: dict[int, tuple[nn.Module, list]] = {}
    for parent in root.modules():
        for name, child in parent._modules.items():
            if isinstance(child, cls):
                found.setdefault(id(child), (child, []))[1].append((parent, name))
    return [(child, sites, paths.get(id(child), "?")) for child, sites in found.values()]


def _on_meta(build):
    """Construct a tigon module without allocating: its parameters are replaced by the adopted ones."""
    with torch.device("meta"):
        return build()


def _norm_eps(module, path):
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    if not isinstance(eps, (float, int)):
        raise ValueError(f"{path} ({type(module).__name__}) has no float eps / variance_epsilon")
    return float(eps)


def _rms_norm_line(family, classes):
    spec = family.norm
    line = f"{classes.norm.__name__} -> tigon.nn.RMSNorm(casting={spec.casting!r}, offset={spec.offset})"
    if family.projection_norms:
        line += f"; {'/'.join(family.projection_norms)} give their output in the autocast dtype under autocast"
    return line


def _feeds_projections(sites, family, classes) -> bool:
    """Whether every place a norm sits is one of the ``projection_norms`` of a decoder layer that runs
    transformers' own forward (a subclass or a wrapper might route the output elsewhere)."""
    layer = classes.decoder_layer
    return layer is not None and all(
        isinstance(parent, layer) and type(parent).forward is layer.forward and _own_forward(parent) is None
        and name in family.projection_norms
        for parent, name in sites
    )


def _joins_line(family, classes):
    layout = joins.LAYOUTS[family.joined_layer]
    return f"{classes.decoder_layer.__name__}.forward -> residual joins as {layout.ops} (instance forward)"


def _plan_joined_layers(plan, root, family, classes):
    """Part of the ``rms_norm`` switch: the family's decoder layers get joins.py's forward."""
    from tigon.nn.norm import RMSNorm

    layout = joins.LAYOUTS[family.joined_layer]
    layer_cls = classes.decoder_layer
    try:
        variant = joins.matched_variant(layer_cls.forward, layout.source)
    except wrappers.WrapperMismatch as err:
        raise ValueError(f"{family.model_type}: joined layer: {layer_cls.__name__}.forward: {err}") from err
    if variant is None:
        # Another transformers version's layer: its own forward keeps running (with tigon's norms, as
        # any layer does); only the fused joins, which would replace that forward, are left out.
        warnings.warn(
            f"tigon: {layer_cls.__name__}.forward is not the {family.joined_layer} forward tigon knows (transformers "
            f"{_transformers_version()}): its residual joins stay unfused; everything else is patched",
            stacklevel=4,
        )
        return
    # tigon's body under the class forward's own decorators (5.24's @deprecate_kwarg), except the
    # checkpointing wrapper, which LayerForward stands for on the instance.
    forward = wrappers.rewrapped(
        layer_cls.forward, layout.forward_for(layer_cls.forward), skip_outer=checkpoint_wrappers(layer_cls.forward)
    )
    line = _joins_line(family, classes)
    for layer, _, path in _sites(root, layer_cls):
        if _is_tigon(_own_forward(layer)):
            continue
        _check_plain(layer, layer_cls, path)
        norms = [layer._modules.get(name) for name in layout.norms]
        if not all(isinstance(norm, (classes.norm, RMSNorm)) for norm in norms):
            raise ValueError(f"{path}'s {'/'.join(layout.norms)} are not all {classes.norm.__name__} modules")
        instance_forward = LayerForward(
            layer, types.MethodType(forward, layer), checkpoint=checkpoints_in_class_forward()
        )
        plan.add(_SetAttr(layer, "forward", instance_forward), line)


class _GraphLayer:
    """The cuda_graphs switch on one decoder layer: its forward when the patch is applied (joins.py's, or
    the class's) runs through a graphs.LayerGraphs; undo puts that forward back."""

    def __init__(self, layer, state):
        self.layer, self.state = layer, state

    def apply(self):
        layer = self.layer
        inner = _own_forward(layer) or types.MethodType(type(layer).forward, layer)
        runner = graphs.LayerGraphs(layer, self.state)
        self.set = _SetAttr(layer, "forward", LayerForward(layer, inner, checkpoint=False, graphs=runner))
        self.set.apply()

    def undo(self):
        self.set.undo()


def _graphs_line(classes):
    return f"{classes.decoder_layer.__name__} -> forward and backward replayed as CUDA graphs in training (cuda_graphs)"


def _plan_graphs(plan, root, classes):
    """The cuda_graphs switch: every decoder layer of the model, sharing one graphs.GraphState."""
    state = graphs.GraphState(root)
    for layer, _, _ in _sites(root, classes.decoder_layer):
        own = _own_forward(layer)
        if isinstance(own, LayerForward) and own.graphs is not None:
            continue
        plan.add(_GraphLayer(layer, state), _graphs_line(classes))


RECOMPUTE_ATTR = "_tigon_recompute"


def _recompute_line(classes):
    return (f"{classes.decoder_layer.__name__}: norm outputs and the fused join's sum remade in the backward "
            "instead of saved (recompute_norms)")


def _plan_recompute(plan, root, classes):
    """The recompute_norms switch: each pre-norm decoder layer's saved-tensor scope (recompute.py)."""
    for layer, _, path in _sites(root, classes.decoder_layer):
        if vars(layer).get(RECOMPUTE_ATTR) is not None:
            continue
        if not all(isinstance(getattr(layer, name, None), nn.Module)
                   for name in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")):
            raise ValueError(f"{path} has no input_layernorm/post_attention_layernorm/self_attn/mlp to hook")
        change = recompute.LayerRecompute(layer)
        plan.add(change, _recompute_line(classes))
        plan.add(_SetAttr(layer, RECOMPUTE_ATTR, change))


def _layer_norm_line(classes):
    return f"{classes.layer_norm.__name__} -> tigon.nn.LayerNorm"


def _rope_line(classes, family=None):
    line = (f"{classes.attention.__name__}: {ROTARY_NAME} -> tigon.ops.rope; q_proj/k_proj/v_proj share one "
            "autocast copy of their input, and projections save no weight copies (instance forwards); under "
            "torch.compile sdpa runs causal where eager mode would, without a dense mask")
    if family is not None and family.rope_unless_config:
        line += f" (not in models whose config sets {family.rope_unless_config}: their rotary stays stock)"
    return line


def _fused_attention_line(classes):
    return (f"{classes.attention.__name__}: q/k/v, rotary, sdpa and o_proj as one autograd node in eager training "
            "on the GPU, without a mask or a filled key/value cache (fused_attention.py; otherwise the line above)")


def _loss_lines(classes, switches):
    name = classes.causal_lm.__name__
    if switches["fused_linear_cross_entropy"]:
        return [
            f"{name}.forward -> tigon generic forward (training loss: fused linear cross-entropy, no logits)",
            "lm_head.forward -> nn.Linear, or tigon.ops.fused_linear_cross_entropy when given a target",
        ]
    if switches["cross_entropy"]:
        return [f"{name}.loss_function -> tigon.ops.cross_entropy"]
    return []


def _full_shape(parameter) -> tuple[int, ...]:
    """A parameter's shape, also when DeepSpeed ZeRO-3 holds it partitioned: a model built under
    ``deepspeed.zero.Init`` (transformers does so under a ZeRO-3 config) is patched while its
    parameters are empty placeholders, their shapes in ``ds_shape``."""
    return tuple(getattr(parameter, "ds_shape", parameter.shape))


def _plan_rms_norms(plan, root, family, classes):
    from tigon.nn.norm import RMSNorm

    spec = family.norm
    line = _rms_norm_line(family, classes)
    for old, sites, path in _sites(root, classes.norm):
        _check_plain(old, classes.norm, path)
        weight = old._parameters.get("weight")
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            raise ValueError(f"{path} ({type(old).__name__}) has no 1-D weight Parameter")
        eps = _norm_eps(old, path)
        size = _full_shape(weight)[0]
        new = _on_meta(lambda n=size, e=eps: RMSNorm(n, e, offset=spec.offset, casting=spec.casting))
        new.weight = weight
        if _feeds_projections(sites, family, classes):
            new.autocast_output = True
        new.train(old.training)
        plan.add(_SwapModule(old, new, sites), line)


def _plan_layer_norms(plan, root, family, classes):
    from tigon.nn.norm import LayerNorm

    line = _layer_norm_line(classes)
    for old, sites, path in _sites(root, classes.layer_norm):
        _check_plain(old, classes.layer_norm, path)
        weight, bias = old._parameters.get("weight"), old._parameters.get("bias")
        shape = getattr(old, "normalized_shape", None)
        if weight is None or weight.dim() != 1 or (shape is not None and tuple(shape) != _full_shape(weight)):
            raise ValueError(f"{path} ({type(old).__name__}) is not an affine LayerNorm over the last dim")
        eps = _norm_eps(old, path)
        new = _on_meta(lambda w=weight, e=eps, b=bias: LayerNorm(_full_shape(w)[0], e, bias=b is not None))
        new.weight = weight
        if bias is not None:
            new.bias = bias
        new.train(old.training)
        plan.add(_SwapModule(old, new, sites), line)


def _glu_of(act):
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


def _mlp_activation(module, spec, path):
    act = getattr(module, spec.act_attr, None)
    glu = _glu_of(act)
    if glu is None:
        raise ValueError(
            f"{path}.{spec.act_attr} is {type(act).__name__}: tigon has fused GLUs for silu, gelu and "
            "gelu-tanh only (custom activation); pass mlp=False to patch the rest"
        )
    return glu


def _mlp_number(module, attr, path):
    value = getattr(module, attr, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}.{attr} is {type(value).__name__}, not the number the family's row expects")


def _plan_split_mlps_with_extras(plan, root, family, classes):
    """Split MLPs whose forward reads multipliers / a dropout (families.Mlp): an instance forward."""
    from tigon.ops.glu import gelu_activation_name

    spec = family.mlp
    extras = {"gate_multiplier": spec.gate_multiplier, "down_multiplier": spec.down_multiplier,
              "dropout": spec.dropout}
    named = ", ".join(attr for attr in extras.values() if attr is not None)
    forwards = {}
    for old, _, path in _sites(root, classes.mlp):
        if _is_tigon(_own_forward(old)):
            continue
        _check_plain(old, classes.mlp, path)
        kind, kwargs = _mlp_activation(old, spec, path)
        if any(old._modules.get(name) is None for name in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"{path} ({type(old).__name__}) lacks gate_proj / up_proj / down_proj")
        for attr in extras.values():
            if attr is not None:
                _mlp_number(old, attr, path)
        activation = "silu" if kind == "swiglu" else gelu_activation_name(kwargs["approximate"])
        if activation not in forwards:
            forwards[activation] = replacement_forwards.split_glu_forward(activation, **extras)
        line = f"{classes.mlp.__name__}.forward -> tigon.ops.{kind} with stock {named} (instance forward)"
        plan.add(_SetAttr(old, "forward", types.MethodType(forwards[activation], old)), line)


def _plan_split_mlps(plan, root, family, classes):
    from tigon.nn.mlp import GEGLUMLP, SwiGLUMLP

    spec = family.mlp
    if spec.extras:
        _plan_split_mlps_with_extras(plan, root, family, classes)
        return
    for old, sites, path in _sites(root, classes.mlp):
        _check_plain(old, classes.mlp, path)
        kind, kwargs = _mlp_activation(old, spec, path)
        projections = [old._modules.get(name) for name in ("gate_proj", "up_proj", "down_proj")]
        if any(p is None for p in projections):
            raise ValueError(f"{path} ({type(old).__name__}) lacks gate_proj / up_proj / down_proj")
        gate = projections[0]
        hidden, inter = getattr(gate, "in_features", None), getattr(gate, "out_features", None)
        if not (isinstance(hidden, int) and isinstance(inter, int)):
            raise ValueError(f"{path}.gate_proj has no in_features / out_features")
        module_cls = SwiGLUMLP if kind == "swiglu" else GEGLUMLP
        new = _on_meta(lambda c=module_cls, h=hidden, i=inter, k=kwargs: c(h, i, **k))
        for name, proj in zip(("gate_proj", "up_proj", "down_proj"), projections, strict=True):
            setattr(new, name, proj)
        new.train(old.training)
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        line = f"{classes.mlp.__name__} -> tigon.nn.{module_cls.__name__}({args})"
        plan.add(_SwapModule(old, new, sites), line)


def _plan_fused_mlps(plan, root, family, classes):
    from tigon.ops.glu import geglu, swiglu

    spec = family.mlp
    forwards = {}
    for old, _, path in _sites(root, classes.mlp):
        if _is_tigon(_own_forward(old)):
            continue
        _check_plain(old, classes.mlp, path)
        kind, kwargs = _mlp_activation(old, spec, path)
        if old._modules.get("gate_up_proj") is None or old._modules.get("down_proj") is None:
            raise ValueError(f"{path} ({type(old).__name__}) lacks gate_up_proj / down_proj")
        key = (kind, tuple(kwargs.items()))
        if key not in forwards:
            op = swiglu if kind == "swiglu" else functools.partial(geglu, **kwargs)
            forwards[key] = replacement_forwards.fused_gate_up_forward(op)
        line = f"{classes.mlp.__name__}.forward -> tigon.ops.{kind} on gate_up_proj (instance forward)"
        plan.add(_SetAttr(old, "forward", types.MethodType(forwards[key], old)), line)


def _check_rotary(family, classes):
    """A rotary function whose transformers source tigon pins (the vision one) must be that source."""
    source = replacement_forwards.ROTARY_SOURCES.get(family.rotary)
    if source is not None and not vision_language.matches_source(getattr(classes.module, family.rotary), source):
        raise ValueError(
            f"{family.model_type}: rope: {classes.module.__name__}.{family.rotary} is not the fp32 rotate-half "
            f"function tigon.ops.rope reproduces in transformers {_transformers_version()}; pass rope=False"
        )


def _plan_rope(plan, root, family, classes, *, fused=None):
    """The rope switch on a decoder's attention: tigon's rotary in the class forward (and with ``fused``
    the whole attention as one node where it can run, fused_attention.py; ``fused``: the class forward's
    fused_attention.variant)."""
    _check_rotary(family, classes)
    forward = None
    line = _rope_line(classes, family)
    for old, _, path in _sites(root, classes.attention):
        if _is_tigon(_own_forward(old)):
            continue
        _check_plain(old, classes.attention, path)
        if forward is None:  # a decoder's rotate-half rotary (a vision tower's: _plan_vision_attention)
            rotary = replacement_forwards.tigon_rotary(
                half_angles=family.rotary_half_angles, autocast_output=family.rope_autocast_output
            )
            forward = wrappers.with_globals(classes.attention.forward, **{family.rotary: rotary})
            if fused is not None:
                forward = fused_attention.fused_forward(forward, fused)
        plan.add(_SetAttr(old, "forward", types.MethodType(forward, old)), line)
        if fused is not None:
            plan.note(_fused_attention_line(classes))


def _plan_shared_cast(plan, root, family, classes):
    """Part of the attention patch (the ``rope`` switch), reported under the rope line."""
    # An attention that modifies q, k or v in place (OLMoE's clip_qkv clamps them) cannot take them
    # as one node's views: each projection is then its own node, still sharing the input's cast.
    in_place = family.qkv_clamp is not None and getattr(root.config, family.qkv_clamp, None) is not None
    for attention, _, _ in _sites(root, classes.attention):
        projections = [attention._modules.get(name) for name in QKV_PROJECTIONS]
        # A fused qkv projection has one cast already; a wrapped one (LoRA) keeps its own forward;
        # one patched already is left as it is.
        if any(type(p) is not nn.Linear or _own_forward(p) is not None for p in projections):
            continue
        output = attention._modules.get(OUTPUT_PROJECTION)
        if type(output) is nn.Linear and _own_forward(output) is None:
            projections.append(output)  # its input is in the autocast dtype already: no cast to share
        cache = CastCache(group=None if in_place else tuple(projections[: len(QKV_PROJECTIONS)]))
        for projection in projections:
            _plan_shared_cast_linear(plan, projection, cache)


def _plan_shared_cast_linear(plan, projection, cache):
    """``projection`` (a plain nn.Linear) runs as shared_cast.py's autocast linear, with ``cache``."""
    plan.add(_SetAttr(projection, CACHE_ATTR, cache))
    plan.add(_SetAttr(projection, "forward", types.MethodType(shared_cast_linear, projection)))


def _plan_loss(plan, model, family, classes, switches):
    lines = _loss_lines(classes, switches)
    own_forward = _own_forward(model)
    own_loss = vars(model).get("_loss_function")
    if switches["fused_linear_cross_entropy"]:
        if _is_tigon(own_forward):
            return
        importlib.import_module("tigon.ops.fused_linear_cross_entropy")  # fail here, not at the first step
        if _is_tigon(own_loss):
            raise ValueError("the model is already patched with cross_entropy=True; revert that patch first")
        _check_plain(model, classes.causal_lm, "the model")
        lm_head = getattr(model, "lm_head", None)
        # A tensor-parallel head (transformers' colwise plans): its weight a DTensor split by classes,
        # and on the instance the forward that gathers its logits, kept for the logits path.
        parallel_head = type(lm_head) is nn.Linear and loss_path.vocab_parallel_head(lm_head)
        if (type(lm_head) is nn.Linear and isinstance(lm_head.weight, loss_path.DTensor) and not parallel_head
                and _own_forward(lm_head) is not None):
            raise ValueError(
                f"lm_head's weight is a DTensor placed {tuple(lm_head.weight.placements)} over a "
                f"{lm_head.weight.device_mesh.ndim}-D mesh; the fused loss takes a head split by classes over a 1-D "
                "mesh (tensor parallel) or a whole one: pass fused_linear_cross_entropy=False for this model"
            )
        if type(lm_head) is not nn.Linear or (_own_forward(lm_head) is not None and not parallel_head):
            raise ValueError(
                f"lm_head is {type(lm_head).__name__}, not a plain nn.Linear (LoRA on lm_head?); "
                "pass fused_linear_cross_entropy=False (and cross_entropy=True) for this model"
            )
        if not isinstance(getattr(model, "model", None), classes.model):
            raise ValueError(f"the model's .model is not a {classes.model.__name__}")
        if family.logit_multiplier is not None:
            multiplier = loss_path.logit_multiplier(model, family.logit_multiplier)
            if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)):
                raise ValueError(
                    f"{family.model_type}: loss: the model's {family.logit_multiplier} is "
                    f"{type(multiplier).__name__}, not the number the family's row expects"
                )
        forward = loss_path.causal_lm_forward(
            family, classes.module, classes.causal_lm.forward, classes.model.forward
        )
        plan.add(_SetAttr(model, "forward", types.MethodType(forward, model)), lines[0])
        head_forward = types.MethodType(loss_path.linear_or_fused_loss, lm_head)
        if parallel_head and _own_forward(lm_head) is not None:
            plan.add(_SetAttr(lm_head, loss_path.LOGITS_FORWARD, _own_forward(lm_head)))
        plan.add(_SetAttr(lm_head, "forward", head_forward), lines[1])
        plan.add(_SetAttr(lm_head, loss_path.TAKES_TARGET, True))
    elif switches["cross_entropy"]:
        if _is_tigon(own_loss):
            return
        importlib.import_module("tigon.ops.cross_entropy")
        if _is_tigon(own_forward):
            raise ValueError(
                "the model is already patched with fused_linear_cross_entropy=True; revert that patch first"
            )
        if own_loss is not None:
            raise ValueError("the model has its own loss_function set; tigon will not replace it")
        plan.add(_SetAttr(model, "_loss_function", loss_path.causal_lm_cross_entropy), lines[0])


# ------------------------------------------------------------------------------------------- parts


def _plan_norms(plan, model, family, classes, switches):
    _plan_rms_norms(plan, model, family, classes)
    if family.joined_layer:
        _plan_joined_layers(plan, model, family, classes)


def _plan_mlps(plan, model, family, classes, switches):
    if family.mlp.layout == "split":
        _plan_split_mlps(plan, model, family, classes)
    else:
        _plan_fused_mlps(plan, model, family, classes)


def _plan_experts(plan, model, family, classes, switches):
    """Part of the ``mlp`` switch: MoE experts get the fused gate (patching/experts.py)."""
    moe_experts.plan(plan, _sites(model, classes.experts), family, classes.experts,
                     glu_of=_glu_of, check_plain=_check_plain, is_tigon=_is_tigon)


def _experts_lines(family, classes):
    try:
        kind = moe_experts.eager_kind(classes.experts)
    except ValueError:
        kind = None
    return [moe_experts.line(family, classes.experts, kind)]


def _rope_off_by_config(family, config) -> bool:
    """The row's ``rope_unless_config`` is set on this model's config: its attention rotates with
    another function than ``apply_rotary_pos_emb`` (DeepSeek-V3's interleaved pairs) and stays stock."""
    return family.rope_unless_config is not None and bool(getattr(config, family.rope_unless_config, False))


def _plan_attention(plan, model, family, classes, switches):
    if _rope_off_by_config(family, model.config):
        return
    fused = fused_attention.variant(classes.attention) if _fuses_attention(family, classes, switches) else None
    _plan_rope(plan, model, family, classes, fused=fused)
    _plan_shared_cast(plan, model, family, classes)
    if not causal_mask.marked(model.config):
        plan.add(causal_mask.MarkConfig(model.config))


def _fuses_attention(family, classes, switches) -> bool:
    """The fused_attention switch (with rope): the attention runs as one node where its class forward is
    transformers' own (fused_attention.SOURCES) with the rotate-half rotary."""
    return (switches["fused_attention"] and family.rotary == ROTARY_NAME and not family.rotary_half_angles
            and family.rope_autocast_output and family.qkv_clamp is None
            and fused_attention.variant(classes.attention) is not None)


def _plan_sliding_window(plan, model):
    if sliding_window.has_sliding_layers(model.config) and not sliding_window.marked(model.config):
        plan.add(sliding_window.MarkConfig(model.config),
                 "sdpa attention of sliding-window layers -> row blocks of the band, their masks built by row "
                 "blocks (sliding_window.py)")
        plan.add(causal_mask.by_rows_mark(model.config))


@dataclass(frozen=True)
class _Part:
    """One part of a family that a switch turns on: where the family has it, how to plan it on a model
    instance, and the lines a class patch reports for it. Instance and class patching both read PARTS."""

    switch: str | None  # None: the loss, which two switches choose between
    present: object  # (family, classes) -> bool
    plan: object  # (plan, model, family, classes, switches) -> None
    lines: object  # (family, classes, switches) -> list[str]

    def on(self, family, classes, switches) -> bool:
        return (self.switch is None or switches[self.switch]) and self.present(family, classes)


PARTS = (
    _Part("rms_norm", lambda f, c: c.norm is not None, _plan_norms,
          lambda f, c, s: [_rms_norm_line(f, c)] + ([_joins_line(f, c)] if f.joined_layer else [])),
    _Part("layer_norm", lambda f, c: c.layer_norm is not None,
          lambda plan, m, f, c, s: _plan_layer_norms(plan, m, f, c), lambda f, c, s: [_layer_norm_line(c)]),
    _Part("mlp", lambda f, c: c.mlp is not None, _plan_mlps,
          lambda f, c, s: [f"{c.mlp.__name__} -> tigon GLU (activation read from each module)"]),
    _Part("mlp", lambda f, c: c.experts is not None, _plan_experts, lambda f, c, s: _experts_lines(f, c)),
    _Part("rope", lambda f, c: c.attention is not None, _plan_attention,
          lambda f, c, s: [_rope_line(c, f)] + ([_fused_attention_line(c)] if _fuses_attention(f, c, s) else [])),
    _Part(None, lambda f, c: True, _plan_loss, lambda f, c, s: _loss_lines(c, s)),
    _Part("cuda_graphs", lambda f, c: c.decoder_layer is not None,
          lambda plan, m, f, c, s: _plan_graphs(plan, m, c), lambda f, c, s: [_graphs_line(c)]),
    # a class patch cannot tell whether its models' configs have sliding layers: each model's own
    # patch (at post_init) reports it
    _Part("sliding_window", lambda f, c: c.attention is not None,
          lambda plan, m, f, c, s: _plan_sliding_window(plan, m), lambda f, c, s: []),
    # after rms_norm's: the hooks go on the tigon norms that part swaps in
    _Part("recompute_norms", lambda f, c: f.joined_layer == "pre_norm" and c.decoder_layer is not None,
          lambda plan, m, f, c, s: _plan_recompute(plan, m, c), lambda f, c, s: [_recompute_line(c)]),
    _Part("offload_activations", lambda f, c: c.decoder_layer is not None,
          long_context.plan_offload, long_context.offload_lines),
    _Part("tiled_mlp", lambda f, c: c.mlp is not None, long_context.plan_tiled_mlp, long_context.tiled_mlp_lines),
)


TENSOR_PARALLEL_LINE = (
    "tensor parallel (split projections): they run their own forwards, so the MLP fuses only its activation "
    "and the attention is not one node; a head split by classes computes the fused loss over each rank's "
    "classes (tigon.ops.vocab_parallel_cross_entropy)"
)


def _tensor_parallel(model) -> bool:
    """Whether transformers' tensor parallelism split the model: a linear layer holding a DTensor weight
    and, on the instance, the forward that redistributes its input and output."""
    return any(isinstance(m, nn.Linear) and _own_forward(m) is not None and isinstance(m.weight, loss_path.DTensor)
               for m in model.modules())


def _unwrap(obj):
    """The transformers model inside a PEFT wrapper (``get_base_model``), or ``obj`` itself."""
    from transformers import PreTrainedModel

    seen = 0
    while not isinstance(obj, PreTrainedModel) and hasattr(obj, "get_base_model") and seen < 4:
        obj, seen = obj.get_base_model(), seen + 1
    return obj


def _patch_instance(obj, switches, *, log_level=logging.INFO) -> Patch:
    model = _unwrap(obj)
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"expected a transformers model (or a model_type string), got {type(obj).__name__}")
    family = _family_for(getattr(model.config, "model_type", None))
    classes = _resolve(family)
    own_module = type(model).__module__ == family.module_name
    if not (own_module or isinstance(model, (classes.causal_lm, classes.model))):
        raise ValueError(
            f"{type(model).__module__}.{type(model).__name__} is not transformers' {family.model_type} "
            f"implementation ({family.module_name}): remote code is not patched"
        )
    plan = _Plan()
    if family.is_vision_language:
        _plan_vision_language(plan, model, family, classes, switches)
    else:
        for part in PARTS:
            if part.on(family, classes, switches) and (part.switch is not None or isinstance(model, classes.causal_lm)):
                part.plan(plan, model, family, classes, switches)
    if plan.changes and _tensor_parallel(model):
        plan.note(TENSOR_PARALLEL_LINE)
    target = f"{type(model).__name__} instance"
    if not plan.changes:
        logger.log(log_level, "tigon: %s: nothing to replace (already patched?)", target)
    return _apply(plan, target, log_level)


# ------------------------------------------------------------------------------ vision-language plan

# The switches of the parts a decoder has (the loss is the ForConditionalGeneration's). cuda_graphs
# replays the language model's decoder layers; the vision tower stays eager (its attention reads
# cu_seqlens on the host, which a captured graph cannot).
DECODER_SWITCHES = ("rms_norm", "layer_norm", "mlp", "rope", "sliding_window", "cuda_graphs", "fused_attention",
                    "offload_activations", "tiled_mlp")
VISION_PREFIX = "vision: "


def _text_side(family, decoder):
    """The row and classes of a VLM's language model: the row's own, or the text family's."""
    if not family.text_from_config:
        return family, None
    text_type = getattr(getattr(decoder, "config", None), "model_type", None)
    text_family = _family_for(text_type)
    if text_family.is_vision_language:
        raise ValueError(f"{family.model_type}: the language model's model_type {text_type!r} is not a text family")
    text_classes = _resolve(text_family)
    if not isinstance(decoder, text_classes.model):
        raise ValueError(
            f"{family.model_type}: the language model is a {type(decoder).__name__}, not {text_family.model_type}'s "
            f"{text_classes.model.__name__}"
        )
    return text_family, text_classes


def _plan_vision_side(plan, root, family, classes, switches):
    """The vision tower's and projector's parts (vision_language.vision_family), reported as such."""
    vision = vision_language.vision_family(family)
    sub = _Plan()
    if switches["rms_norm"] and classes.norm is not None:
        _plan_rms_norms(sub, root, vision, classes)
        if vision.joined_layer:
            _plan_joined_layers(sub, root, vision, classes)
    if switches["layer_norm"] and classes.layer_norm is not None:
        _plan_layer_norms(sub, root, vision, classes)
    if switches["mlp"] and classes.mlp is not None:
        _plan_mlps(sub, root, vision, classes, switches)
    if classes.attention is not None:
        _plan_vision_attention(sub, root, family, classes, switches)
    plan.changes.extend(sub.changes)
    for line, count in sub.counts.items():
        plan.counts[VISION_PREFIX + line] += count


def _vision_rope_line(classes):
    rotary = vision_language.VISION_ROTARY
    return f"{classes.attention.__name__}: {rotary} -> tigon.ops.rope (fp32 math, q's and k's dtypes)"


def _vision_packed_line(classes):
    return (f"{classes.attention.__name__}: sdpa once a cu_seqlens segment -> one call over every image or "
            "window (flash attention in fp16/bf16 on a GPU, else sdpa; vision_attention.py), qkv/proj as one "
            "autocast node each")


def _packs_vision_attention(family, switches):
    return switches["vision_attention"] and family.vision.packed_attention


def _plan_vision_attention(plan, root, family, classes, switches):
    """The vision attention's forward: tigon's rotary (``rope``) and all its segments in one sdpa call
    (``vision_attention``, the rows with ``Vision.packed_attention``), in one instance forward."""
    vision = vision_language.vision_family(family)
    rope, packed = switches["rope"], _packs_vision_attention(family, switches)
    if not (rope or packed):
        return
    if packed and not vision_language.matches_source(classes.attention.forward, vision_attention.FORWARD_SOURCE):
        raise ValueError(
            f"{family.model_type}: vision_attention: {classes.attention.__name__}.forward is not the one tigon's "
            f"packed attention reproduces in transformers {_transformers_version()}; pass vision_attention=False"
        )
    if rope:
        _check_rotary(vision, classes)
        rotary = replacement_forwards.ROTARIES[vision.rotary]
        forward = wrappers.with_globals(classes.attention.forward, **{vision.rotary: rotary})
    else:
        forward = classes.attention.forward
        module = classes.module

        def rotary(q, k, cos, sin):  # the module's own, looked up at the call as the class's forward does
            return getattr(module, vision.rotary)(q, k, cos, sin)

    if packed:
        forward = vision_attention.packed_forward(forward, rotary)
    lines = [_vision_rope_line(classes)] * rope + [_vision_packed_line(classes)] * packed
    for old, _, path in _sites(root, classes.attention):
        if _is_tigon(_own_forward(old)):
            continue
        _check_plain(old, classes.attention, path)
        plan.add(_SetAttr(old, "forward", types.MethodType(forward, old)), lines[0])
        for line in lines[1:]:
            plan.counts[line] += 1
        if packed:
            _plan_vision_projections(plan, old)


def _plan_vision_projections(plan, attention):
    """Part of the ``vision_attention`` switch: the packed attention's ``qkv`` and ``proj`` run as
    shared_cast.py's autocast linear (each weight and bias cast by one launch, the gradients of the fp32
    parameters written by the matmul and the sum, one autograd node a projection instead of three).
    A projection that is not a plain nn.Linear (LoRA) keeps its own forward."""
    for name in VISION_PROJECTIONS:
        projection = attention._modules.get(name)
        if type(projection) is nn.Linear and _own_forward(projection) is None:
            _plan_shared_cast_linear(plan, projection, CastCache())


def _plan_vision_language(plan, model, family, classes, switches):
    """A VLM instance (its ForConditionalGeneration or its base model): the language model as its text
    row says, the vision side as the row's Vision says, the ForConditionalGeneration's loss."""
    base, decoder = vision_language.language_model(model, family, classes.model)
    text_family, text_classes = _text_side(family, decoder)
    text_classes = text_classes or classes
    for part in PARTS:
        if part.switch in DECODER_SWITCHES and part.on(text_family, text_classes, switches):
            part.plan(plan, decoder, text_family, text_classes, switches)
    _plan_vision_side(plan, vision_language.Subtrees(base, decoder), family, classes.vision, switches)
    if isinstance(model, classes.causal_lm):
        _plan_loss(plan, model, family, classes, switches)


def _vision_language_lines(family, classes, switches):
    """What the hooks of a VLM class patch will replace, for ``Patch.replaced``."""
    if family.text_from_config:
        lines = ["language model: the parts of the row of its config.text_config.model_type"]
    else:
        lines = [line for part in PARTS if part.switch in DECODER_SWITCHES and part.on(family, classes, switches)
                 for line in part.lines(family, classes, switches)]
    vision, v = vision_language.vision_family(family), classes.vision
    if switches["rms_norm"] and v.norm is not None:
        lines.append(VISION_PREFIX + _rms_norm_line(vision, v))
    if switches["layer_norm"] and v.layer_norm is not None:
        lines.append(VISION_PREFIX + _layer_norm_line(v))
    if switches["mlp"] and v.mlp is not None:
        lines.append(VISION_PREFIX + f"{v.mlp.__name__} -> tigon GLU (activation read from each module)")
    if switches["rope"] and v.attention is not None:
        lines.append(VISION_PREFIX + _vision_rope_line(v))
    if _packs_vision_attention(family, switches) and v.attention is not None:
        lines.append(VISION_PREFIX + _vision_packed_line(v))
    return lines + _loss_lines(classes, switches)


# ---------------------------------------------------------------------------------------- class plan


def _patch_classes(model_type, switches) -> Patch:
    family = _family_for(model_type)
    classes = _resolve(family)
    plan = _Plan()
    for cls in (classes.model, classes.causal_lm):
        current = vars(cls).get("post_init")
        if _is_tigon(current):
            if current._tigon_switches != switches:
                raise ValueError(
                    f"{cls.__name__} is patched with {current._tigon_switches} already; revert that first"
                )
            continue
        plan.add(_SetAttr(cls, "post_init", _patching_post_init(cls.post_init, switches)),
                 f"{cls.__name__}.post_init -> patch every {cls.__name__} built from now on")
    if plan.changes:
        for line in _class_parts(family, classes, switches):
            plan.counts[line] = 1
    return _apply(plan, f"model_type {model_type!r}", logging.INFO)


def _patching_post_init(original, switches):
    def post_init(self):
        original(self)
        _patch_instance(self, switches, log_level=logging.DEBUG)

    post_init._tigon = True
    post_init._tigon_switches = switches
    return post_init


def _class_parts(family, classes, switches):
    """What the hooks will replace in each model, for ``Patch.replaced`` of a class patch."""
    if family.is_vision_language:
        return _vision_language_lines(family, classes, switches)
    on = [part for part in PARTS if part.on(family, classes, switches)]
    return [line for part in on for line in part.lines(family, classes, switches)]


# ------------------------------------------------------------------------------------------- entry


def patch(target, **switches) -> Patch:
    """Patch a transformers model instance, or the classes of a ``model_type``; returns a ``Patch``.

    Switches (defaults): ``rope=True, rms_norm=True, layer_norm=True, mlp=True, cross_entropy=False,
    fused_linear_cross_entropy=True, cuda_graphs=False, recompute_norms=False``. A switch is a no-op where
    the family has no such part. ``recompute_norms`` remakes each pre-norm decoder layer's norm outputs
    and residual sum in the backward instead of saving them (patching/recompute.py): 12 KB a token a
    layer less at Llama-3.2-1B, bitwise the same gradients. ``cuda_graphs`` replays each decoder layer's
    training forward and backward as CUDA graphs (patching/graphs.py): for models small enough that the
    host's launches, not the GPU, bound the step.
    """
    chosen = _check_switches(switches)
    if isinstance(target, str):
        return _patch_classes(target, chosen)
    return _patch_instance(target, chosen)
