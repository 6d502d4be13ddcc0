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
  interleaved pairs: it keeps its own).
- ``projection_norms``: the decoder layer's norms whose output goes only into linear projections
  (attention's q/k/v, the MLP's gate/up), named as attributes of ``<prefix>DecoderLayer``. Under
  autocast those projections cast it to bf16 anyway, so the patched norm writes that copy itself
  (``tigon.nn.RMSNorm.autocast_output``). Pre-norm layers: ``input_layernorm`` and
  ``post_attention_layernorm``; Gemma-2/3's sandwich: ``input_layernorm`` and
  ``pre_feedforward_layernorm`` (their post-norms feed the residual add); OLMo-2/3 normalise the
  sublayers' outputs (none); MoE layers only ``input_layernorm`` (the MoE block's expert matmuls go
  through transformers' experts dispatch, not checked here to treat a bf16 input as they treat fp32).
- ``joined_layer``: the decoder layer's residual joins and the norms beside them, in one of
  patching/joins.py's layouts: "pre_norm" (Llama and the layers written as its: the attention's
  join and the MLP's pre-norm), "sandwich" (Gemma-2/3: pre- and post-norms) or "post_norm"
  (OLMo-2/3). With the norms patched, its forward runs the joins as fused tigon ops (joins.py checks
  the class's forward first, and leaves another one as it is).
- the CausalLM and base model classes, and the loss quirks the generic forward must honour:
  final-logit softcapping (Gemma-2/3), logit scaling (Granite divides by ``logits_scaling``) and the
  MoE router load-balancing loss (Mixtral, Qwen3-MoE: the function's name in the modeling module).

Adding a family is one ``Family(...)`` line here. Everything is checked against the imported classes
when a patch is planned (class names exist, forwards reference what the row says), so a transformers
version that moved things raises ValueError instead of patching half a model.

Checked against transformers 5.17 to 5.24 (``tigon env`` prints each row's status). MoE experts
(Mixtral, Qwen3-MoE) hold their weights as 3-D tensors behind transformers' experts dispatch (eager
loop / grouped_mm) and apply the activation inside it; there is no module boundary to swap there, so
only Qwen3-MoE's dense ``Qwen3MoeMLP`` layers (``mlp_only_layers``) get the fused GLU.
"""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class Vision:
    """A vision-language model's vision side (everything of ``<vlm>.model`` but ``language_model``: the
    vision tower and the projector), named in the VLM's modeling module: what tigon replaces there."""

    norm: Norm | None = None
    layer_norm: Norm | None = None
    mlp: Mlp | None = None  # a gated MLP (Qwen2.5-VL's blocks); plain fc1/act/fc2 MLPs have no fused op
    attention: str | None = None  # its forward calls the module-level apply_rotary_pos_emb_vision


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
    joined_layer: str | None = None  # "sandwich" / "post_norm": a layout of patching/joins.py
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
            model=None, projection_norms=PRE_NORMS, **quirks):
    """One row with transformers' usual class names (``<prefix>RMSNorm``, ``<prefix>MLP``, ...)."""
    return Family(
        model_type=model_type,
        package=package,
        causal_lm=f"{prefix}ForCausalLM",
        model=model or f"{prefix}Model",
        norm=norm(f"{prefix}RMSNorm") if norm else None,
        mlp=Mlp(f"{prefix}MLP", mlp, act_attr) if mlp else None,
        attention=f"{prefix}Attention" if rope else None,
        decoder_layer=f"{prefix}DecoderLayer" if norm and (projection_norms or quirks.get("joined_layer")) else None,
        projection_norms=projection_norms if norm else (),
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
                projection_norms=MOE_NORMS),
        _family("qwen2", "qwen2", "Qwen2", joined_layer="pre_norm"),
        _family("qwen3", "qwen3", "Qwen3", joined_layer="pre_norm"),
        _family("qwen3_moe", "qwen3_moe", "Qwen3Moe", router_aux_loss="load_balancing_loss_func",
                projection_norms=MOE_NORMS, joined_layer="pre_norm"),
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
        # vision-language families (ForConditionalGeneration models; patching/vision_language.py)
        _vision_language("qwen2_vl", "Qwen2VL", norm=Norm("Qwen2VLRMSNorm"), mlp=Mlp("Qwen2MLP"),
                         attention="Qwen2VLAttention", decoder_layer="Qwen2VLDecoderLayer", joined_layer="pre_norm",
                         vision=Vision(layer_norm=Norm("nn.LayerNorm"), attention="VisionAttention")),
        _vision_language("qwen2_5_vl", "Qwen2_5_VL", norm=Norm("Qwen2_5_VLRMSNorm"), mlp=Mlp("Qwen2MLP"),
                         attention="Qwen2_5_VLAttention", decoder_layer="Qwen2_5_VLDecoderLayer",
                         joined_layer="pre_norm",
                         vision=Vision(norm=Norm("Qwen2_5_VLRMSNorm"), mlp=Mlp("Qwen2_5_VLMLP"),
                                       attention="Qwen2_5_VLVisionAttention")),
        _vision_language("qwen3_vl", "Qwen3VL", norm=Norm("Qwen3VLTextRMSNorm"), mlp=Mlp("Qwen3VLTextMLP"),
                         attention="Qwen3VLTextAttention", decoder_layer="Qwen3VLTextDecoderLayer",
                         vision=Vision(layer_norm=Norm("nn.LayerNorm"), attention="Qwen3VLVisionAttention")),
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
