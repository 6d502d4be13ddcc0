"""The model families ``tigon.patch`` knows, as data: one row per transformers ``model_type``.

A row names, in the family's transformers modeling module, what the engine may replace and how:

- ``norm``: the RMSNorm class and the tigon casting/offset that reproduces it exactly
  (Llama rounds the normalised value before the weight multiply: casting "llama"; Gemma and OLMo-2
  multiply in fp32 and round once: casting "gemma"; Gemma scales by ``1 + weight``: offset 1.0).
- ``layer_norm``: a LayerNorm class whose forward is ``F.layer_norm`` over the last dim, if any
  (StableLM uses torch's own ``nn.LayerNorm``, named through the modeling module's ``nn``).
- ``mlp``: the gated MLP class and its projection layout ("split": ``gate_proj``/``up_proj``/
  ``down_proj``; "fused": Phi-3's ``gate_up_proj`` whose first half is the gate). The activation is
  read from the module itself (silu -> SwiGLU, gelu/gelu-tanh -> GEGLU) and checked at patch time.
- ``attention``: the attention class whose forward calls the module-level rotate-half
  ``apply_rotary_pos_emb`` (None where the family's rotary is not rotate-half, e.g. GLM-4's
  interleaved pairs, Llama-4's complex multiply: it keeps its own). ``rotary_half_angles``: the
  family's cos/sin hold one angle per rotated pair (GPT-OSS), duplicated for tigon's rope.
  ``rope_unless_config``: a config flag under which the attention calls another rotary function
  (DeepSeek-V3's ``rope_interleave``): such a model's attention is left stock.
- ``projection_norms``: the decoder layer's norms whose output goes only into linear projections
  (attention's q/k/v, the MLP's gate/up), named as attributes of ``<prefix>DecoderLayer``. Under
  autocast those projections cast it to bf16 anyway, so the patched norm writes that copy itself
  (``tigon.nn.RMSNorm.autocast_output``). Pre-norm layers: ``input_layernorm`` and
  ``post_attention_layernorm``; Gemma-2/3's sandwich: ``input_layernorm`` and
  ``pre_feedforward_layernorm`` (their post-norms feed the residual add); OLMo-2/3 normalise the
  sublayers' outputs (none); MoE layers only ``input_layernorm`` (the MoE block's expert matmuls go
  through transformers' experts dispatch, not checked here to treat a bf16 input as they treat fp32).
- ``joined_layer``: the decoder layer's residual joins and the norms beside them, in one of
  patching/residual_joins.py's layouts: "pre_norm" (Llama and the layers written as its: the attention's
  join and the MLP's pre-norm), "sandwich" (Gemma-2/3: pre- and post-norms) or "post_norm"
  (OLMo-2/3). With the norms patched, its forward runs the joins as fused tigon ops (residual_joins.py checks
  the class's forward first, and leaves another one as it is).
- the CausalLM and base model classes, and the loss quirks the generic forward must honour:
  final-logit softcapping (Gemma-2/3), logit scaling (Granite divides by ``logits_scaling``; Cohere-2
  and Falcon-H1 multiply by a number of the model's, ``logit_multiplier``) and the MoE router
  load-balancing loss (Mixtral, Qwen3-MoE: the function's name in the modeling module).

Adding a family is one ``Family(...)`` line here. Everything is checked against the imported classes
when a patch is planned (class names exist, forwards reference what the row says), so a transformers
version that moved things raises ValueError instead of patching half a model.

- ``experts``: the MoE experts class (weights as 3-D tensors behind transformers' experts dispatch,
  ``@use_experts_implementation``: eager loop, ``grouped_mm``, ``batched_mm``), with the layout of its
  packed gate/up projection ("halves": ``chunk(2)``; "interleaved": GPT-OSS's even/odd columns) and its
  activation ("act_fn": read from the module's ``act_fn``, silu / gelu / gelu-tanh; "clamped_swiglu":
  GPT-OSS's, with the module's ``alpha`` and ``limit``). Part of the ``mlp`` switch: every experts
  implementation applies the gate through ``tigon.ops.moe_glu`` (patching/parts/experts.py). ``Experts()``
  names ``<prefix>Experts``.

Checked against transformers 5.17 to 5.25 (``tigon env`` prints each row's status). The MoE rows'
shared experts and dense layers written as a gated MLP class (Qwen2-MoE, GLM-4-MoE, DeepSeek-V3,
Qwen3-Next, Llama-4) get the fused GLU through ``mlp``, as dense models do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Norm:
    """A norm class and the tigon arguments that reproduce its forward."""

    cls: str
    casting: str = "llama"
    offset: float = 0.0


@dataclass(frozen=True)
class Mlp:
    """A gated MLP class: ``down(act(gate(x)) * up(x))``."""

    cls: str
    layout: str = "split"  # "split": gate_proj/up_proj/down_proj; "fused": gate_up_proj/down_proj
    act_attr: str = "act_fn"
    # Split layout only: attributes of the MLP module that its forward reads besides the projections.
    # ``down(act(gate(x) * g) * up(x)) * d`` with g, d the named multipliers (Falcon-H1's muP
    # ``gate_multiplier`` / ``down_multiplier``), then ``dropout(p=<dropout>)`` in training (Seed-OSS's
    # ``residual_dropout``). Such an MLP keeps its module and gets an instance forward that runs the
    # same multiplies and dropout around tigon's GLU.
    gate_multiplier: str | None = None
    down_multiplier: str | None = None
    dropout: str | None = None

    @property
    def extras(self) -> bool:
        return any(a is not None for a in (self.gate_multiplier, self.down_multiplier, self.dropout))


@dataclass(frozen=True)
class Experts:
    """MoE experts behind transformers' experts dispatch: ``_apply_gate`` on the packed gate/up output.

    ``cls=None`` in a ``_family`` row: ``<prefix>Experts``.
    """

    cls: str | None = None
    layout: str = "halves"  # "halves": gate = first half (chunk(2)); "interleaved": gate = even columns
    activation: str = "act_fn"  # "act_fn": the module's act_fn; "clamped_swiglu": GPT-OSS's (alpha, limit)


@dataclass(frozen=True)
class Vision:
    """A vision-language model's vision side (everything of ``<vlm>.model`` but ``language_model``: the
    vision tower and the projector), named in the VLM's modeling module: what tigon replaces there."""

    norm: Norm | None = None
    layer_norm: Norm | None = None
    mlp: Mlp | None = None  # a gated MLP (Qwen2.5-VL's blocks); plain fc1/act/fc2 MLPs have no fused op
    attention: str | None = None  # its forward calls the module-level apply_rotary_pos_emb_vision
    # its forward attends within cu_seqlens' segments, one sdpa call each (parts/vision.py)
    packed_attention: bool = False
    # the tower's block, and its norms whose output goes only to a projection (the attention's qkv, the
    # MLP): under autocast they give it in the autocast dtype, the cast the projection would make
    block: str | None = None
    projection_norms: tuple[str, ...] = ()
    # the block's residual joins and the norms beside them, a layout of patching/residual_joins.py (needs block)
    joined_block: str | None = None


@dataclass(frozen=True)
class Family:
    model_type: str
    package: str  # transformers.models.<package>.modeling_<package>
    causal_lm: str
    model: str
    norm: Norm | None
    mlp: Mlp | None
    attention: str | None  # its forward calls the rotate-half apply_rotary_pos_emb
    layer_norm: Norm | None = None
    final_logit_softcapping: bool = False
    logits_scaling: bool = False
    router_aux_loss: str | None = None  # name of the load-balancing loss function in the module
    decoder_layer: str | None = None
    projection_norms: tuple[str, ...] = ()
    joined_layer: str | None = None  # "pre_norm" / "sandwich" / "post_norm": a layout of patching/residual_joins.py
    experts: Experts | None = None  # MoE experts behind transformers' experts dispatch
    # The rotary's cos/sin hold one angle per rotated pair, not the rotate-half layout's two copies
    # (GPT-OSS: ``emb = freqs``; its ``_apply_rotary_emb`` rotates the two halves): tigon's rope gets
    # them duplicated, ``cat((cos, cos), -1)``, which is the same rotation.
    rotary_half_angles: bool = False
    # A config attribute that, when true, makes the attention rotate with another function than
    # ``apply_rotary_pos_emb`` (DeepSeek-V3's ``rope_interleave``): the attention is then left stock.
    rope_unless_config: str | None = None
    # A config attribute that, when not None, makes the attention clamp its q/k/v projections' outputs
    # in place (OLMoE's ``clip_qkv``): under autocast they are then three nodes, not one node's views.
    qkv_clamp: str | None = None
    # The CausalLM multiplies its logits by this attribute of the model instance (a dotted path):
    # Cohere-2's ``logit_scale``, Falcon-H1's ``model.lm_head_multiplier``.
    logit_multiplier: str | None = None
    # False where the attention feeds rope's q/k to something other than attention (HunYuan's query/key
    # norms after the rotation): rope then gives transformers' dtypes under autocast (rotary.py).
    rope_autocast_output: bool = True
    # Vision-language rows: ``causal_lm`` is the ``...ForConditionalGeneration`` class and ``model`` its
    # ``.model``; the text parts above are those of ``.model.language_model`` (see vision_language.py).
    vision: Vision | None = None
    text_from_config: bool = False  # the language model is the text family of config.text_config.model_type
    language_model: str = "language_model"  # its attribute on the VLM's base model (SmolVLM: text_model)
    rotary: str = "apply_rotary_pos_emb"  # the module-level function the attention forward calls

    @property
    def is_vision_language(self) -> bool:
        return self.vision is not None

    @property
    def module_name(self) -> str:
        return f"transformers.models.{self.package}.modeling_{self.package}"


PRE_NORMS = ("input_layernorm", "post_attention_layernorm")
SANDWICH_NORMS = ("input_layernorm", "pre_feedforward_layernorm")
MOE_NORMS = ("input_layernorm",)


def _family(model_type, package, prefix, *, norm=Norm, mlp="split", act_attr="act_fn", rope=True,
            model=None, projection_norms=PRE_NORMS, experts=None, **quirks):
    """One row with transformers' usual class names (``<prefix>RMSNorm``, ``<prefix>MLP``, ...)."""
    return Family(
        model_type=model_type,
        package=package,
        causal_lm=f"{prefix}ForCausalLM",
        model=model or f"{prefix}Model",
        norm=norm(f"{prefix}RMSNorm") if norm else None,
        mlp=mlp if isinstance(mlp, Mlp) else Mlp(f"{prefix}MLP", mlp, act_attr) if mlp else None,
        attention=f"{prefix}Attention" if rope else None,
        decoder_layer=f"{prefix}DecoderLayer" if norm and (projection_norms or quirks.get("joined_layer")) else None,
        projection_norms=projection_norms if norm else (),
        experts=replace(experts, cls=experts.cls or f"{prefix}Experts") if experts else None,
        **quirks,
    )


def _vision_language(model_type, prefix, *, norm=None, projection_norms=PRE_NORMS, **parts):
    """A vision-language row: ``<prefix>ForConditionalGeneration`` over ``<prefix>Model``. Without a
    ``norm``, the language model is built from ``config.text_config`` (``AutoModel``) and its parts are
    those of that text family's row."""
    return Family(
        model_type=model_type,
        package=model_type,
        causal_lm=f"{prefix}ForConditionalGeneration",
        model=f"{prefix}Model",
        norm=norm,
        mlp=parts.pop("mlp", None),
        attention=parts.pop("attention", None),
        projection_norms=projection_norms if norm else (),
        text_from_config=norm is None,
        **parts,
    )


def _gemma_norm(cls):
    return Norm(cls, casting="gemma", offset=1.0)


def _olmo_norm(cls):
    return Norm(cls, casting="gemma", offset=0.0)


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        _family("llama", "llama", "Llama", joined_layer="pre_norm"),
        _family("mistral", "mistral", "Mistral", joined_layer="pre_norm"),
        _family("mixtral", "mixtral", "Mixtral", mlp=None, router_aux_loss="load_balancing_loss_func",
                projection_norms=MOE_NORMS, experts=Experts()),
        _family("qwen2", "qwen2", "Qwen2", joined_layer="pre_norm"),
        _family("qwen3", "qwen3", "Qwen3", joined_layer="pre_norm"),
        _family("qwen3_moe", "qwen3_moe", "Qwen3Moe", router_aux_loss="load_balancing_loss_func",
                projection_norms=MOE_NORMS, joined_layer="pre_norm", experts=Experts()),
        _family("gemma", "gemma", "Gemma", norm=_gemma_norm, joined_layer="pre_norm"),
        _family("gemma2", "gemma2", "Gemma2", norm=_gemma_norm, final_logit_softcapping=True,
                projection_norms=SANDWICH_NORMS, joined_layer="sandwich"),
        _family("gemma3_text", "gemma3", "Gemma3", norm=_gemma_norm, model="Gemma3TextModel",
                final_logit_softcapping=True, projection_norms=SANDWICH_NORMS, joined_layer="sandwich"),
        _family("phi3", "phi3", "Phi3", mlp="fused", act_attr="activation_fn"),
        _family("olmo2", "olmo2", "Olmo2", norm=_olmo_norm, projection_norms=(), joined_layer="post_norm"),
        _family("olmo3", "olmo3", "Olmo3", norm=_olmo_norm, projection_norms=(), joined_layer="post_norm"),
        _family("granite", "granite", "Granite", logits_scaling=True),
        _family("smollm3", "smollm3", "SmolLM3", joined_layer="pre_norm"),
        _family("glm4", "glm4", "Glm4", mlp="fused", act_attr="activation_fn", rope=False),
        _family("stablelm", "stablelm", "StableLm", norm=None, layer_norm=Norm("nn.LayerNorm")),
        # MoE families: routed experts through transformers' experts dispatch (``experts``), shared experts
        # and dense layers as gated MLPs (``mlp``)
        _family("qwen2_moe", "qwen2_moe", "Qwen2Moe", router_aux_loss="load_balancing_loss_func",
                projection_norms=MOE_NORMS, joined_layer="pre_norm", experts=Experts()),
        _family("olmoe", "olmoe", "Olmoe", mlp=None, router_aux_loss="load_balancing_loss_func",
                projection_norms=MOE_NORMS, joined_layer="pre_norm", experts=Experts(), qkv_clamp="clip_qkv"),
        _family("granitemoe", "granitemoe", "GraniteMoe", mlp=None, logits_scaling=True,
                router_aux_loss="load_balancing_loss_func", projection_norms=MOE_NORMS, experts=Experts()),
        _family("glm4_moe", "glm4_moe", "Glm4Moe", projection_norms=MOE_NORMS, joined_layer="pre_norm",
                experts=Experts()),
        _family("deepseek_v3", "deepseek_v3", "DeepseekV3", projection_norms=MOE_NORMS, joined_layer="pre_norm",
                rope_unless_config="rope_interleave", experts=Experts()),
        _family("gpt_oss", "gpt_oss", "GptOss", norm=_olmo_norm, mlp=None, rotary_half_angles=True,
                router_aux_loss="load_balancing_loss_func", projection_norms=MOE_NORMS,
                experts=Experts(layout="interleaved", activation="clamped_swiglu")),
        _family("qwen3_next", "qwen3_next", "Qwen3Next", norm=_gemma_norm, router_aux_loss="load_balancing_loss_func",
                projection_norms=MOE_NORMS, experts=Experts()),
        dataclasses.replace(
            _family("llama4_text", "llama4", "Llama4Text", act_attr="activation_fn", rope=False,
                    projection_norms=MOE_NORMS),
            causal_lm="Llama4ForCausalLM",
        ),
        # dense families added 2026-11-26
        _family("ministral", "ministral", "Ministral", joined_layer="pre_norm"),
        _family("starcoder2", "starcoder2", "Starcoder2", norm=None, layer_norm=Norm("nn.LayerNorm"), mlp=None),
        _family("cohere2", "cohere2", "Cohere2", norm=None, layer_norm=Norm("Cohere2LayerNorm"), rope=False,
                logit_multiplier="logit_scale"),
        _family("exaone4", "exaone4", "Exaone4", projection_norms=(), joined_layer="post_norm"),
        _family("hunyuan_v1_dense", "hunyuan_v1_dense", "HunYuanDenseV1", joined_layer="pre_norm",
                rope_autocast_output=False),
        _family("ernie4_5", "ernie4_5", "Ernie4_5", rope=False, joined_layer="pre_norm"),
        _family("seed_oss", "seed_oss", "SeedOss", mlp=Mlp("SeedOssMLP", dropout="residual_dropout"),
                joined_layer="pre_norm"),
        _family("falcon_h1", "falcon_h1", "FalconH1",
                mlp=Mlp("FalconH1MLP", gate_multiplier="gate_multiplier", down_multiplier="down_multiplier"),
                projection_norms=("pre_ff_layernorm",), logit_multiplier="model.lm_head_multiplier"),
        # vision-language families (ForConditionalGeneration models; patching/vision_language.py)
        _vision_language("qwen2_vl", "Qwen2VL", norm=Norm("Qwen2VLRMSNorm"), mlp=Mlp("Qwen2MLP"),
                         attention="Qwen2VLAttention", decoder_layer="Qwen2VLDecoderLayer", joined_layer="pre_norm",
                         vision=Vision(layer_norm=Norm("nn.LayerNorm"), attention="VisionAttention",
                                       packed_attention=True)),
        _vision_language("qwen2_5_vl", "Qwen2_5_VL", norm=Norm("Qwen2_5_VLRMSNorm"), mlp=Mlp("Qwen2MLP"),
                         attention="Qwen2_5_VLAttention", decoder_layer="Qwen2_5_VLDecoderLayer",
                         joined_layer="pre_norm",
                         vision=Vision(norm=Norm("Qwen2_5_VLRMSNorm"), mlp=Mlp("Qwen2_5_VLMLP"),
                                       attention="Qwen2_5_VLVisionAttention", packed_attention=True,
                                       block="Qwen2_5_VLVisionBlock", projection_norms=("norm1", "norm2"),
                                       joined_block="vision_pre_norm")),
        _vision_language("qwen3_vl", "Qwen3VL", norm=Norm("Qwen3VLTextRMSNorm"), mlp=Mlp("Qwen3VLTextMLP"),
                         attention="Qwen3VLTextAttention", decoder_layer="Qwen3VLTextDecoderLayer",
                         joined_layer="pre_norm",
                         vision=Vision(layer_norm=Norm("nn.LayerNorm"), attention="Qwen3VLVisionAttention",
                                       packed_attention=True)),
        _vision_language("gemma3", "Gemma3", norm=_gemma_norm("Gemma3RMSNorm"), mlp=Mlp("Gemma3MLP"),
                         attention="Gemma3Attention", decoder_layer="Gemma3DecoderLayer", joined_layer="sandwich",
                         projection_norms=SANDWICH_NORMS,
                         vision=Vision(norm=_gemma_norm("Gemma3RMSNorm"), layer_norm=Norm("nn.LayerNorm"))),
        _vision_language("mllama", "Mllama", norm=Norm("MllamaTextRMSNorm"), mlp=Mlp("MllamaTextMLP"),
                         attention="MllamaTextSelfAttention", decoder_layer="MllamaSelfAttentionDecoderLayer",
                         vision=Vision(layer_norm=Norm("nn.LayerNorm"))),
        _vision_language("llava", "Llava", vision=Vision(layer_norm=Norm("nn.LayerNorm"))),
        _vision_language("paligemma", "PaliGemma", final_logit_softcapping=True,
                         vision=Vision(layer_norm=Norm("nn.LayerNorm"))),
        _vision_language("smolvlm", "SmolVLM", language_model="text_model",
                         vision=Vision(layer_norm=Norm("nn.LayerNorm"))),
        _vision_language("internvl", "InternVL",
                         vision=Vision(norm=Norm("InternVLVisionRMSNorm"), layer_norm=Norm("nn.LayerNorm"))),
    )
}
