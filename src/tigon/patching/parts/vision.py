"""A vision-language model's vision side (the vision tower and the projector: everything of ``<vlm>.model`` but its
language model), patched as the row's ``Vision`` says (vision_language.vision_family): its norms, its gated
MLPs, and its attention.

The vision attention (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) gets one instance forward for two switches:

- ``rope``: tigon's rotary (``rotary.apply_rotary_pos_emb_vision``) in place of the module's
  ``apply_rotary_pos_emb_vision``, where that function is transformers' upcasting one;
- ``vision_attention`` (rows with ``Vision.packed_attention``), under sdpa: every segment of the packed patches
  in one call (``tigon.nn.vision_attention.segment_attention``) instead of one call per ``cu_seqlens`` segment
  (:func:`packed_forward`), and ``qkv``/``proj`` as ``tigon.nn.shared_cast_linear``'s autocast linear. Only
  where the class forward is, statement for statement, transformers' (:data:`FORWARD_SOURCE`); for eager,
  flash and the other implementations the module runs the class's forward (with tigon's rotary if ``rope`` is
  on).

Every line it reports starts with ``vision: ``.
"""

from __future__ import annotations

import importlib

from torch import nn

from tigon.patching import decorator_chains, rotary, vision_language
from tigon.patching.instance_methods import InstanceMethod, Recipe
from tigon.patching.parts.attention import check_rotary, plan_shared_cast_linear
from tigon.patching.parts.mlp import mlp_line, plan_mlps
from tigon.patching.parts.norms import (
    layer_norm_line,
    plan_joined_layers,
    plan_layer_norms,
    plan_rms_norms,
    rms_norm_line,
)
from tigon.patching.patch_handle import Plan, SetAttr
from tigon.patching.sites import check_plain, is_tigon, own_forward, sites, transformers_version

PREFIX = "vision: "
PROJECTIONS = ("qkv", "proj")  # the Qwen-VL vision attention's (its FORWARD_SOURCE calls both)
PACKED_IMPLEMENTATION = "sdpa"  # the implementation whose per-segment loop the packed call replaces

# transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision attention forward, 5.17 to 5.24 (the three are
# one text); tigon's forward below computes what it computes.
FORWARD_SOURCE = '''
def forward(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
    seq_length = hidden_states.shape[0]
    query_states, key_states, value_states = (
        self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    )
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb_vision(query_states, key_states, cos, sin)

    query_states = query_states.transpose(0, 1).unsqueeze(0)
    key_states = key_states.transpose(0, 1).unsqueeze(0)
    value_states = value_states.transpose(0, 1).unsqueeze(0)

    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )

    if is_flash_attention_requested(self.config):
        max_seqlen = get_max_seqlen(cu_seqlens, self.config, kwargs={"max_seqlen": max_seqlen})
        attn_output, _ = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask=None,
            scaling=self.scaling,
            dropout=0.0 if not self.training else self.attention_dropout,
            cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens,
            max_length_q=max_seqlen,
            max_length_k=max_seqlen,
            is_causal=False,
            **kwargs,
        )
    else:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        splits = [
            torch.split(tensor, lengths.tolist(), dim=2) for tensor in (query_states, key_states, value_states)
        ]

        attn_outputs = [
            attention_interface(
                self,
                q,
                k,
                v,
                attention_mask=None,
                scaling=self.scaling,
                dropout=0.0 if not self.training else self.attention_dropout,
                is_causal=False,
                **kwargs,
            )[0]
            for q, k, v in zip(*splits)
        ]
        attn_output = torch.cat(attn_outputs, dim=1)

    attn_output = attn_output.reshape(seq_length, -1).contiguous()
    attn_output = self.proj(attn_output)
    return attn_output
'''


def packed_forward(fallback, rotary):
    """The vision attention's forward (:data:`FORWARD_SOURCE`) with ``segment_attention`` in place of
    its per-segment loop under sdpa. ``fallback`` is the forward for every other implementation;
    ``rotary(q, k, cos, sin)`` is the rotary the forward applies (tigon's, or the module's own)."""

    def forward(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
        from tigon.nn import vision_attention

        if self.config._attn_implementation != PACKED_IMPLEMENTATION:
            return fallback(self, hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
        seq_length = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = position_embeddings
        q, k = rotary(q, k, cos, sin)
        out = vision_attention.segment_attention(q, k, v, cu_seqlens, scale=self.scaling,
                                dropout=self.attention_dropout if self.training else 0.0)
        return self.proj(out.reshape(seq_length, -1))

    forward._tigon = True
    return forward


def vision_attention_forward(attention_cls, rotary_name, rope, packed):
    """The vision attention class's forward with tigon's rotary in place of ``rotary_name`` (``rope``) and with
    all its segments in one sdpa call (``packed``)."""
    if rope:
        function = rotary.ROTARIES[rotary_name]
        forward = decorator_chains.with_globals(attention_cls.forward, **{rotary_name: function})
    else:
        forward = attention_cls.forward
        module = importlib.import_module(attention_cls.__module__)

        def function(q, k, cos, sin):  # the module's own, looked up at the call as the class's forward does
            return getattr(module, rotary_name)(q, k, cos, sin)

    return packed_forward(forward, function) if packed else forward


def rope_line(classes):
    rotary_name = vision_language.VISION_ROTARY
    return f"{classes.attention.__name__}: {rotary_name} -> tigon.ops.rope (fp32 math, q's and k's dtypes)"


def packed_line(classes):
    return (f"{classes.attention.__name__}: sdpa once a cu_seqlens segment -> one call over every image or "
            "window (flash attention in fp16/bf16 on a GPU, else sdpa; tigon.nn.vision_attention), qkv/proj as "
            "one autocast node each")


def packs_attention(family, switches):
    return switches["vision_attention"] and family.vision.packed_attention


def _plan_projections(plan, attention):
    """Part of the ``vision_attention`` switch: the packed attention's ``qkv`` and ``proj`` run as
    ``tigon.nn.shared_cast_linear``'s autocast linear (each weight and bias cast by one launch, the gradients of
    the fp32 parameters written by the matmul and the sum, one autograd node a projection instead of three).
    A projection that is not a plain nn.Linear (LoRA) keeps its own forward."""
    from tigon.nn.shared_cast_linear import CastCache

    for name in PROJECTIONS:
        projection = attention._modules.get(name)
        if type(projection) is nn.Linear and own_forward(projection) is None:
            plan_shared_cast_linear(plan, projection, CastCache())


def _plan_attention(plan, root, family, classes, switches):
    """The vision attention's forward: tigon's rotary (``rope``) and all its segments in one sdpa call
    (``vision_attention``), in one instance forward."""
    vision = vision_language.vision_family(family)
    rope, packed = switches["rope"], packs_attention(family, switches)
    if not (rope or packed):
        return
    if packed and not vision_language.matches_source(classes.attention.forward, FORWARD_SOURCE):
        raise ValueError(
            f"{family.model_type}: vision_attention: {classes.attention.__name__}.forward is not the one tigon's "
            f"packed attention reproduces in transformers {transformers_version()}; pass vision_attention=False"
        )
    if rope:
        check_rotary(vision, classes)
    forward = Recipe(vision_attention_forward, (classes.attention, vision.rotary, rope, packed))
    lines = [rope_line(classes)] * rope + [packed_line(classes)] * packed
    for old, _, path in sites(root, classes.attention):
        if is_tigon(own_forward(old)):
            continue
        check_plain(old, classes.attention, path)
        plan.add(SetAttr(old, "forward", InstanceMethod(old, forward)), lines[0])
        for line in lines[1:]:
            plan.note(line)
        if packed:
            _plan_projections(plan, old)


def plan_vision_side(plan, root, family, classes, switches):
    """The vision tower's and projector's parts under ``root`` (a vision_language.Subtrees), ``classes`` the
    row's vision classes, reported with :data:`PREFIX`."""
    vision = vision_language.vision_family(family)
    sub = Plan()
    if switches["rms_norm"] and classes.norm is not None:
        plan_rms_norms(sub, root, vision, classes)
        if vision.joined_layer:
            plan_joined_layers(sub, root, vision, classes)
    if switches["layer_norm"] and classes.layer_norm is not None:
        plan_layer_norms(sub, root, vision, classes)
    if switches["mlp"] and classes.mlp is not None:
        plan_mlps(sub, root, vision, classes)
    if classes.attention is not None:
        _plan_attention(sub, root, family, classes, switches)
    plan.changes.extend(sub.changes)
    for line, count in sub.counts.items():
        plan.counts[PREFIX + line] += count


def vision_lines(family, classes, switches):
    """What the vision side of a class patch's models will have replaced, for ``Patch.replaced``."""
    vision, lines = vision_language.vision_family(family), []
    if switches["rms_norm"] and classes.norm is not None:
        lines.append(rms_norm_line(vision, classes))
    if switches["layer_norm"] and classes.layer_norm is not None:
        lines.append(layer_norm_line(classes))
    if switches["mlp"] and classes.mlp is not None:
        lines.append(mlp_line(classes))
    if switches["rope"] and classes.attention is not None:
        lines.append(rope_line(classes))
    if packs_attention(family, switches) and classes.attention is not None:
        lines.append(packed_line(classes))
    return [PREFIX + line for line in lines]
