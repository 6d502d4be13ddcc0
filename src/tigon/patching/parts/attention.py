"""The attention part (the ``rope`` switch, and ``fused_attention`` with it).

- rope: each attention module gets, on the instance, a copy of its class's forward whose globals map
  ``apply_rotary_pos_emb`` to tigon's rope (rotary.py; decorator_chains.with_globals: a copy with a new
  globals dict); the transformers module's globals are never assigned.
- with rope, under autocast: each attention module's ``q_proj``/``k_proj``/``v_proj`` cast their common fp32
  input once and save one copy instead of three (on the GPU they run as one stacked matmul), and its
  projections (``o_proj`` too) cast their weights again in the backward instead of saving bf16 copies
  (``tigon.nn.shared_cast_linear``); bitwise the same results (on the GPU, fp32 gradients are written in fp32
  by the matmuls, not rounded to bf16).
- with rope: the model's config is marked so that, under torch.compile, sdpa attention runs causal without a
  dense mask wherever eager mode does (causal_mask.py); exactly the same attention. It is marked too so that a
  maskless call with grouped key/value heads runs on sdpa's memory-efficient kernel with the heads repeated where
  sdpa would run it on its math kernel, which makes the T × T scores (fp32 on the GPU: band_attention.py,
  "Grouped heads"); the same attention.
- ``fused_attention`` (with rope): where the class forward is transformers' own (fused_attention.SOURCES) with
  the rotate-half rotary, the attention runs as one autograd node (``tigon.nn.attention``) wherever that
  computes what the forward would (fused_attention.py decides, at each call). ``Patch.replaced`` says, at patch
  time, where it runs: not in a model whose attention implementation is not sdpa or whose attention softcaps
  its logits (fused_attention.never_runs; the projections' adapters then run PEFT's forwards), and in a model
  whose sliding layers the band attention takes, in which layers and for which lengths (:func:`node_scope`).
"""

from __future__ import annotations

from torch import nn

from tigon.nn.lora import adapter_lines, outside_lines
from tigon.patching import band_attention, causal_mask, decorator_chains, fused_attention, rotary, vision_language
from tigon.patching.instance_methods import InstanceMethod, Recipe
from tigon.patching.interface_marks import carried
from tigon.patching.parts import Part
from tigon.patching.patch_handle import SetAttr
from tigon.patching.sites import check_plain, is_tigon, own_forward, sites, transformers_version

ROTARY_NAME = "apply_rotary_pos_emb"
QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
OUTPUT_PROJECTION = "o_proj"


def rope_line(classes, family=None):
    line = (f"{classes.attention.__name__}: {ROTARY_NAME} -> tigon.ops.rope; q_proj/k_proj/v_proj share one "
            "autocast copy of their input, and projections save no weight copies (instance forwards); under "
            "torch.compile sdpa runs causal where eager mode would, without a dense mask")
    if family is not None and family.rope_unless_config:
        line += f" (not in models whose config sets {family.rope_unless_config}: their rotary stays stock)"
    return line


def fused_attention_line(classes, node=True):
    """The fused_attention switch's line; with ``node`` False, where a model's attention never runs the node
    (fused_attention.never_runs): its start, to which the reason is added."""
    if not node:
        return (f"{classes.attention.__name__}: its own forward (the line above), not q/k/v, rotary, sdpa and "
                "o_proj as one autograd node (fused_attention.py)")
    return (f"{classes.attention.__name__}: q/k/v, rotary, sdpa and o_proj as one autograd node in eager training "
            "on the GPU, without a mask or a filled key/value cache (fused_attention.py; otherwise the line above)")


def check_rotary(family, classes):
    """A rotary function whose transformers source tigon pins (the vision one) must be that source."""
    source = rotary.ROTARY_SOURCES.get(family.rotary)
    if source is not None and not vision_language.matches_source(getattr(classes.module, family.rotary), source):
        raise ValueError(
            f"{family.model_type}: rope: {classes.module.__name__}.{family.rotary} is not the fp32 rotate-half "
            f"function tigon.ops.rope reproduces in transformers {transformers_version()}; pass rope=False"
        )


def fuses_attention(family, classes, switches) -> bool:
    """The fused_attention switch (with rope): the attention runs as one node where its class forward is
    transformers' own (fused_attention.SOURCES) with the rotate-half rotary."""
    return (switches["fused_attention"] and family.rotary == ROTARY_NAME and not family.rotary_half_angles
            and family.rope_autocast_output and family.qkv_clamp is None
            and fused_attention.variant(classes.attention) is not None)


def rope_attention_forward(attention_cls, rotary_name, half_angles, autocast_output, fused):
    """The attention class's forward calling tigon's rotary in place of ``rotary_name``, and with ``fused`` (the
    class forward's fused_attention.variant) the whole attention as one node where it can run."""
    function = rotary.tigon_rotary(half_angles=half_angles, autocast_output=autocast_output)
    forward = decorator_chains.with_globals(attention_cls.forward, **{rotary_name: function})
    return forward if fused is None else fused_attention.fused_forward(forward, fused)


def node_scope(attention, banded: bool) -> str:
    """What follows "inside the attention node" in ``attention``'s adapter line (tigon.nn.lora.adapter_lines):
    nothing where ``banded`` is off (a model without sliding layers, or with the ``sliding_window`` switch off:
    the node takes a sliding layer's mask); else which layers run the node. transformers hands a sliding layer
    no mask for a sequence shorter than its window (the mask is causal then), and a mask from the window's
    length on; in a banded model such a masked call is the band attention's (fused_attention's guards), so the
    attention's own forward runs, and its projections their own (PEFT's) forwards: per call, by length."""
    if not banded:
        return ""
    window = band_attention.layer_window(attention)
    if window is None:
        return " in full-attention layers"
    return (f" in sliding-window layers (window {window}) for sequences shorter than {window} tokens; from {window} "
            "tokens on these layers run their own attention forward under tigon's band attention "
            "(band_attention.py), with q_proj/k_proj/v_proj/o_proj in {forwards} forwards")


def _plan_rope(plan, root, family, classes, *, fused=None, banded=False):
    """The rope switch on a decoder's attention (a vision tower's: vision.py). ``banded``: :func:`node_scope`'s."""
    check_rotary(family, classes)
    forward = Recipe(rope_attention_forward, (classes.attention, family.rotary, family.rotary_half_angles,
                                              family.rope_autocast_output, fused))
    line = rope_line(classes, family)
    for old, _, path in sites(root, classes.attention):
        if is_tigon(own_forward(old)):
            continue
        check_plain(old, classes.attention, path)
        plan.add(SetAttr(old, "forward", InstanceMethod(old, forward)), line)
        if fused is not None:
            projections = {name: old._modules.get(name) for name in fused_attention.PROJECTIONS}
            off = fused_attention.never_runs(old)
            if off is None:
                plan.note(fused_attention_line(classes))
                lora_lines = adapter_lines(projections, "attention", "the attention runs its own forward",
                                           node_scope(old, banded))
            else:
                plan.note(f"{fused_attention_line(classes, node=False)}: {off}")
                lora_lines = outside_lines(projections, "the attention runs its own forward, the line above",
                                           joined=True)
            for lora_line in lora_lines:
                plan.note(lora_line)


def plan_shared_cast_linear(plan, projection, cache):
    """``projection`` (a plain nn.Linear) runs as ``tigon.nn.shared_cast_linear``'s autocast linear, with
    ``cache``."""
    from tigon.nn.shared_cast_linear import CACHE_ATTR, shared_cast_linear

    plan.add(SetAttr(projection, CACHE_ATTR, cache))
    plan.add(SetAttr(projection, "forward", InstanceMethod(projection, shared_cast_linear)))


def _plan_shared_cast(plan, root, family, classes):
    """Part of the attention patch (the ``rope`` switch), reported under the rope line."""
    from tigon.nn.shared_cast_linear import CastCache

    # An attention that modifies q, k or v in place (OLMoE's clip_qkv clamps them) cannot take them
    # as one node's views: each projection is then its own node, still sharing the input's cast.
    in_place = family.qkv_clamp is not None and getattr(root.config, family.qkv_clamp, None) is not None
    for attention, _, _ in sites(root, classes.attention):
        projections = [attention._modules.get(name) for name in QKV_PROJECTIONS]
        # A fused qkv projection has one cast already; a wrapped one (LoRA) keeps its own forward;
        # one patched already is left as it is.
        if any(type(p) is not nn.Linear or own_forward(p) is not None for p in projections):
            continue
        output = attention._modules.get(OUTPUT_PROJECTION)
        if type(output) is nn.Linear and own_forward(output) is None:
            projections.append(output)  # its input is in the autocast dtype already: no cast to share
        cache = CastCache(group=None if in_place else tuple(projections[: len(QKV_PROJECTIONS)]))
        for projection in projections:
            plan_shared_cast_linear(plan, projection, cache)


def _rope_off_by_config(family, config) -> bool:
    """The row's ``rope_unless_config`` is set on this model's config: its attention rotates with
    another function than ``apply_rotary_pos_emb`` (DeepSeek-V3's interleaved pairs) and stays stock."""
    return family.rope_unless_config is not None and bool(getattr(config, family.rope_unless_config, False))


def plan_attention(plan, model, family, classes, switches):
    if _rope_off_by_config(family, model.config):
        return
    fused = fused_attention.variant(classes.attention) if fuses_attention(family, classes, switches) else None
    # sliding layers whose masked calls the band attention takes (the sliding_window part marks the model)
    banded = band_attention.has_sliding_layers(model.config) and (
        switches["sliding_window"] or band_attention.marked(model.config))
    _plan_rope(plan, model, family, classes, fused=fused, banded=banded)
    _plan_shared_cast(plan, model, family, classes)
    if not causal_mask.marked(model.config):
        for change in carried(model, causal_mask.MarkConfig(model.config)):
            plan.add(change)
    if not band_attention.marked(model.config, band_attention.GROUPED):
        for change in carried(model, band_attention.GroupedHeadsMark(model.config)):
            plan.add(change)


ATTENTION = Part(
    "rope", lambda f, c: c.attention is not None, plan_attention,
    lambda f, c, s: [rope_line(c, f)] + ([fused_attention_line(c)] if fuses_attention(f, c, s) else []),
)
