"""The one engine: resolve a family row (families.py) in the installed transformers and walk its parts over a
model instance, or over a ``model_type``'s classes.

Instance patch, ``patch(model, **switches)``:

1. the switches are checked (:func:`check_switches`) and the model's family row resolved (:func:`resolve`: its
   classes exist and their forwards show the bodies tigon relies on);
2. every part in :data:`PARTS` whose switch is on and which the family has plans its changes (parts/: norms,
   MLP, MoE experts, attention, the loss head, CUDA graphs, the sliding-window band, norm recompute), checking
   the model against the row as it goes; any mismatch raises ValueError with the model untouched. A
   vision-language model walks the decoder's parts over its language model, then its vision side
   (parts/vision.py), then the loss;
3. the plan is applied (patch_handle.py), undone if anything fails midway, each replacement logged once, and
   the ``Patch`` that reverts it returned.

Class patch, ``patch("llama", **switches)``: the family's base model and CausalLM classes get a ``post_init``
(the hook every transformers model runs at the end of ``__init__``) that applies the instance patch to each
model built afterwards; models built before are left alone. ``revert()`` removes the hooks (models built
meanwhile keep their patch). Patching what is already patched is a no-op.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import types
import warnings
from dataclasses import dataclass

from torch import nn

from tigon._interpreter import interpreter_active
from tigon._kernels import prehash_triton_key
from tigon.patching import decorator_chains, loss_forward, peft_unload, vision_language
from tigon.patching.families import FAMILIES, Family
from tigon.patching.parts import vision
from tigon.patching.parts.attention import ATTENTION
from tigon.patching.parts.experts import EXPERTS
from tigon.patching.parts.graphs import GRAPHS
from tigon.patching.parts.long_context import KEEP_ATTENTION, OFFLOAD, TILED_MLP
from tigon.patching.parts.loss_head import LOSS_HEAD, loss_lines, plan_loss
from tigon.patching.parts.mlp import MLPS
from tigon.patching.parts.norms import LAYER_NORMS, RMS_NORMS
from tigon.patching.parts.recompute import RECOMPUTE
from tigon.patching.parts.sliding_window import SLIDING_WINDOW
from tigon.patching.patch_handle import Patch, Plan, SetAttr, apply_plan
from tigon.patching.sites import is_tigon, own_forward, transformers_version

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
    "keep_attention": False,
    "prehash": True,
}

# The parts, in the order they are planned: recompute after the norms (its hooks go on the tigon norms that
# part swaps in), graphs after the joined layers (they replay the joined forward).
PARTS = (RMS_NORMS, LAYER_NORMS, MLPS, EXPERTS, ATTENTION, LOSS_HEAD, GRAPHS, SLIDING_WINDOW, RECOMPUTE, OFFLOAD,
         TILED_MLP, KEEP_ATTENTION)
# The switches of the parts a decoder has (the loss is the ForConditionalGeneration's). cuda_graphs replays the
# language model's decoder layers; the vision tower stays eager (its attention reads cu_seqlens on the host,
# which a captured graph cannot).
DECODER_SWITCHES = ("rms_norm", "layer_norm", "mlp", "rope", "sliding_window", "cuda_graphs", "fused_attention",
                    "offload_activations", "tiled_mlp", "keep_attention")


def supported_models() -> list[str]:
    """The ``model_type`` strings ``tigon.patch`` accepts."""
    return sorted(FAMILIES)


# -------------------------------------------------------------------------------------- switches and rows


def check_switches(switches: dict) -> dict:
    """Every switch, the defaults filled in; raises on an unknown name, a non-bool or an exclusive pair."""
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


def family_for(model_type) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {supported_models()}")
    return FAMILIES[model_type]


@dataclass(frozen=True)
class Classes:
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
    vision: Classes | None = None  # a vision-language row's vision side (vision_language.vision_family)


def _lookup(module, dotted: str, family: Family, part: str):
    obj = module
    for piece in dotted.split("."):
        obj = getattr(obj, piece, None)
        if obj is None:
            raise ValueError(
                f"{family.model_type}: {part}: {module.__name__} has no {dotted} in transformers "
                f"{transformers_version()}: this version does not match tigon's table"
            )
    return obj


def _check_forwards(family: Family, classes: Classes) -> None:
    """The forwards tigon copies or rewraps show the body they run, through every decorator (5.24 wraps them in
    @deprecate_kwarg): a wrapper that does not call what it names raises; the attention's body calls the row's
    module-level rotary."""
    if classes.attention is not None:
        try:
            rotary = decorator_chains.calls_global(classes.attention.forward, family.rotary)
        except decorator_chains.WrapperMismatch as err:
            raise ValueError(f"{family.model_type}: rope: {classes.attention.__name__}.forward: {err}") from err
        if not rotary:
            raise ValueError(
                f"{family.model_type}: rope: {classes.attention.__name__}.forward does not call the module-level "
                f"{family.rotary} in transformers {transformers_version()}: this version does not match tigon's table"
            )
    for part, cls in (("loss", classes.causal_lm), ("decoder layer", classes.decoder_layer)):
        if cls is not None:
            try:
                decorator_chains.wrapper_chain(cls.forward)
            except decorator_chains.WrapperMismatch as err:
                raise ValueError(f"{family.model_type}: {part}: {cls.__name__}.forward: {err}") from err


def resolve(family: Family) -> Classes:
    """The row's classes in the installed transformers, checked (ValueError naming the family and the part)."""
    try:
        module = importlib.import_module(family.module_name)
    except ImportError as err:
        raise ValueError(f"cannot import {family.module_name} ({family.model_type!r}): {err}") from err

    def get(spec, part):
        return None if spec is None else _lookup(module, spec if isinstance(spec, str) else spec.cls, family, part)

    classes = Classes(
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
    _check_forwards(family, classes)
    if family.is_vision_language:
        classes = dataclasses.replace(classes, vision=resolve(vision_language.vision_family(family)))
    if family.router_aux_loss is not None:
        _lookup(module, family.router_aux_loss, family, "loss")
    return classes


# ------------------------------------------------------------------------------------------ instance patch


TENSOR_PARALLEL_LINE = (
    "tensor parallel (split projections): they run their own forwards, so the MLP fuses only its activation "
    "and the attention is not one node; a head split by classes computes the fused loss over each rank's "
    "classes (tigon.ops.vocab_parallel_cross_entropy)"
)


def _tensor_parallel(model) -> bool:
    """Whether transformers' tensor parallelism split the model: a linear layer holding a DTensor weight
    and, on the instance, the forward that redistributes its input and output."""
    return any(isinstance(m, nn.Linear) and own_forward(m) is not None and isinstance(m.weight, loss_forward.DTensor)
               for m in model.modules())


def _unwrap(obj):
    """The transformers model inside a PEFT wrapper (``get_base_model``), or ``obj`` itself."""
    from transformers import PreTrainedModel

    seen = 0
    while not isinstance(obj, PreTrainedModel) and hasattr(obj, "get_base_model") and seen < 4:
        obj, seen = obj.get_base_model(), seen + 1
    return obj


def _text_side(family, decoder):
    """The row and classes of a VLM's language model: the row's own, or the text family's."""
    if not family.text_from_config:
        return family, None
    text_type = getattr(getattr(decoder, "config", None), "model_type", None)
    text_family = family_for(text_type)
    if text_family.is_vision_language:
        raise ValueError(f"{family.model_type}: the language model's model_type {text_type!r} is not a text family")
    text_classes = resolve(text_family)
    if not isinstance(decoder, text_classes.model):
        raise ValueError(
            f"{family.model_type}: the language model is a {type(decoder).__name__}, not {text_family.model_type}'s "
            f"{text_classes.model.__name__}"
        )
    return text_family, text_classes


def _plan_vision_language(plan, model, family, classes, switches):
    """A VLM instance (its ForConditionalGeneration or its base model): the language model as its text
    row says, the vision side as the row's Vision says, the ForConditionalGeneration's loss."""
    base, decoder = vision_language.language_model(model, family, classes.model)
    text_family, text_classes = _text_side(family, decoder)
    text_classes = text_classes or classes
    for part in PARTS:
        if part.switch in DECODER_SWITCHES and part.on(text_family, text_classes, switches):
            part.plan(plan, decoder, text_family, text_classes, switches)
    vision.plan_vision_side(plan, vision_language.Subtrees(base, decoder), family, classes.vision, switches)
    if isinstance(model, classes.causal_lm):
        plan_loss(plan, model, family, classes, switches)


def _warn_off_the_gpu(model, target):
    """A model patched on the CPU (or on the meta device) trains only once it is on a GPU, or through Triton's
    interpreter. Patching first and moving the model after is a common order, so this is a warning, not an
    error; the kernels themselves refuse CPU tensors at the first forward."""
    parameter = next(model.parameters(), None)
    if parameter is not None and parameter.device.type in ("cpu", "meta") and not interpreter_active():
        warnings.warn(
            f"tigon: the patched {target} is on the {parameter.device.type} device and Triton's interpreter is off: "
            "tigon's kernels need a CUDA device. Move the model to the GPU before training (model.to('cuda')), or "
            "set TRITON_INTERPRET=1 before importing tigon to run them on the CPU through Triton's interpreter",
            stacklevel=4,
        )


def _patch_instance(obj, switches, *, log_level=logging.INFO) -> Patch:
    model = _unwrap(obj)
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"expected a transformers model (or a model_type string), got {type(obj).__name__}")
    family = family_for(getattr(model.config, "model_type", None))
    classes = resolve(family)
    own_module = type(model).__module__ == family.module_name
    if not (own_module or isinstance(model, (classes.causal_lm, classes.model))):
        raise ValueError(
            f"{type(model).__module__}.{type(model).__name__} is not transformers' {family.model_type} "
            f"implementation ({family.module_name}): remote code is not patched"
        )
    plan = Plan()
    if family.is_vision_language:
        _plan_vision_language(plan, model, family, classes, switches)
    else:
        for part in PARTS:
            if part.on(family, classes, switches) and (part.switch is not None or isinstance(model, classes.causal_lm)):
                part.plan(plan, model, family, classes, switches)
    if plan.changes and _tensor_parallel(model):
        plan.note(TENSOR_PARALLEL_LINE)
    # a PEFT model's merge_and_unload / unload revert this patch after PEFT's (peft_unload.py)
    holder = peft_unload.plan_unloads(plan, obj) if plan.changes and obj is not model else None
    target = f"{type(model).__name__} instance"
    if not plan.changes:
        logger.log(log_level, "tigon: %s: nothing to replace (already patched?)", target)
    else:
        _warn_off_the_gpu(model, target)
    patch = apply_plan(plan, target, log_level)
    parameter = next(model.parameters(), None)
    if plan.changes and switches["prehash"] and parameter is not None:
        prehash_triton_key(parameter.device)  # on a CUDA model only (_kernels/triton_key.py)
    if holder is not None:
        holder.patch = patch
    return patch


# --------------------------------------------------------------------------------------------- class patch


def _class_lines(family, classes, switches):
    """What the hooks will replace in each model, for ``Patch.replaced`` of a class patch."""
    if not family.is_vision_language:
        return [line for part in PARTS if part.on(family, classes, switches)
                for line in part.lines(family, classes, switches)]
    if family.text_from_config:
        lines = ["language model: the parts of the row of its config.text_config.model_type"]
    else:
        lines = [line for part in PARTS if part.switch in DECODER_SWITCHES and part.on(family, classes, switches)
                 for line in part.lines(family, classes, switches)]
    return lines + vision.vision_lines(family, classes.vision, switches) + loss_lines(classes, switches)


def _patching_post_init(original, switches):
    def post_init(self):
        original(self)
        _patch_instance(self, switches, log_level=logging.DEBUG)

    post_init._tigon = True
    post_init._tigon_switches = switches
    return post_init


def _patch_classes(model_type, switches) -> Patch:
    family = family_for(model_type)
    classes = resolve(family)
    plan = Plan()
    for cls in (classes.model, classes.causal_lm):
        current = vars(cls).get("post_init")
        if is_tigon(current):
            if current._tigon_switches != switches:
                raise ValueError(
                    f"{cls.__name__} is patched with {current._tigon_switches} already; revert that first"
                )
            continue
        plan.add(SetAttr(cls, "post_init", _patching_post_init(cls.post_init, switches)),
                 f"{cls.__name__}.post_init -> patch every {cls.__name__} built from now on")
    if plan.changes:
        for line in _class_lines(family, classes, switches):
            plan.counts[line] = 1
    return apply_plan(plan, f"model_type {model_type!r}", logging.INFO)


# ------------------------------------------------------------------------------------------------- entry


def patch(target, **switches) -> Patch:
    """Patch a transformers model instance, or the classes of a ``model_type``; returns a ``Patch``.

    Switches (defaults): ``rope=True, rms_norm=True, layer_norm=True, mlp=True, cross_entropy=False,
    fused_linear_cross_entropy=True, cuda_graphs=False, recompute_norms=False, sliding_window=True,
    vision_attention=True, fused_attention=True, offload_activations=False, tiled_mlp=False, keep_attention=False,
    prehash=True``. A switch is a no-op where the family has no such part.

    - ``rope``: the attention's rotary as ``tigon.ops.rope``, its projections sharing one autocast cast.
    - ``rms_norm`` / ``layer_norm``: norms as ``tigon.nn`` modules adopting the same parameters, and the
      decoder layer's residual joins fused with the norms beside them.
    - ``mlp``: gated MLPs (and MoE experts' gates) through tigon's GLU.
    - ``fused_linear_cross_entropy`` / ``cross_entropy`` (exclusive): the training loss without logits, or
      tigon's cross-entropy over the stock logits.
    - ``cuda_graphs``: each decoder layer's training forward and backward replayed as CUDA graphs
      (patching/layer_graphs.py), for models small enough that the host's launches bound the step.
    - ``recompute_norms``: each pre-norm decoder layer remakes its norm outputs and residual sum in the
      backward instead of saving them (patching/norm_recompute.py): 12 KB a token a layer less at
      Llama-3.2-1B, bitwise the same gradients.
    - ``sliding_window``: sdpa over the band of sliding-window layers in row blocks (patching/band_attention.py).
    - ``vision_attention``: a Qwen-VL vision tower's segments in one attention call (parts/vision.py).
    - ``fused_attention``: with ``rope``, the attention as one autograd node in eager GPU training
      (patching/fused_attention.py).
    - ``offload_activations``: what each decoder layer saves for its backward (with gradient checkpointing:
      its input) waits in pinned host memory, back a layer ahead in the backward (parts/long_context.py).
    - ``tiled_mlp``: the MLP forward and backward over chunks of tokens, so its (tokens, intermediate)
      activations never exist whole (parts/long_context.py).
    - ``keep_attention``: under non-reentrant gradient checkpointing, the attention node's kernel output and
      log-sum-exp are kept from the forward, and the recompute in the backward takes them back instead of running
      the T² kernel again (tigon.nn.kept_attention: in tigon's attention node, or transformers' sdpa function);
      with ``offload_activations`` the kept outputs wait in pinned host memory beside each layer's input.
    - ``prehash``: replaces nothing; on a CUDA model, Triton's compiler key (a hash of its own installation,
      which the first kernel lookup of a process computes) is hashed on a background thread from here, so
      that the first forward finds it done (_kernels/triton_key.py).
    """
    chosen = check_switches(switches)
    if isinstance(target, str):
        return _patch_classes(target, chosen)
    return _patch_instance(target, chosen)
