"""Shapes of real models: the table every benchmark spec takes its sizes from, and the whole
random-init transformers models that ``tigon demo`` trains and ``benchmarks/e2e.py`` times."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    final_logit_softcap: float | None = None


MODELS = (
    ModelShape("Llama-3-8B", 4096, 14336, 32, 8, 128, 128256),
    ModelShape("Llama-3.2-1B", 2048, 8192, 32, 8, 64, 128256),
    ModelShape("Qwen2.5-7B", 3584, 18944, 28, 4, 128, 152064),
    ModelShape("Qwen2.5-0.5B", 896, 4864, 14, 2, 64, 151936),
    ModelShape("Gemma-2-9B", 3584, 14336, 16, 8, 256, 256000, final_logit_softcap=30.0),
)

MODELS_BY_NAME = {m.name: m for m in MODELS}

# Tokens per step used across specs: a batch of 8 × 2048, the size the issues' anchors were taken at.
TOKENS = 16384


# ------------------------------------------------------------------ whole models (demo, e2e benchmark)

# Llama-3.2-1B as published (rope scaling aside, which changes no cost); other families take its
# dimensions when they have no real shape of their own below.
LLAMA_3_2_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)

# model_type -> (label, config keywords): published shapes, random weights.
FULL_SHAPES = {
    "llama": ("Llama-3.2-1B-shaped", LLAMA_3_2_1B),
    "qwen2": ("Qwen2.5-0.5B-shaped", dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )),
    # Gemma-2's attention-logit softcapping is switched off: transformers' sdpa path cannot apply it
    # (it would force eager attention). The final-logit softcap, the part the loss head sees, stays.
    "gemma2": ("Gemma-2-2B-shaped", dict(
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=8192,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=None,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )),
}

# CPU fallback: small enough that a step of the patched model takes seconds under the interpreter.
TINY_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)

# What a family needs beyond the shared keywords to be a sensible model at either size. MoE
# families get 8 (tiny: 4) experts of a quarter of the dense width, top-2 routing; Gemma-2 drops
# its attention-logit softcap (see FULL_SHAPES); the Gemmas' query scale follows the head dim.
FAMILY_EXTRAS = {
    "gemma2": lambda s: dict(attn_logit_softcapping=None, final_logit_softcapping=30.0,
                             query_pre_attn_scalar=s["head_dim"], sliding_window=4096),
    "gemma3_text": lambda s: dict(query_pre_attn_scalar=s["head_dim"], sliding_window=4096),
    "mixtral": lambda s: dict(num_local_experts=_experts(s), num_experts_per_tok=2,
                              intermediate_size=s["intermediate_size"] // 4),
    "qwen3_moe": lambda s: dict(num_experts=_experts(s), num_experts_per_tok=2,
                                moe_intermediate_size=s["intermediate_size"] // 4),
    "qwen2_moe": lambda s: dict(num_experts=_experts(s), num_experts_per_tok=2,
                                moe_intermediate_size=s["intermediate_size"] // 4,
                                shared_expert_intermediate_size=s["intermediate_size"] // 2),
    "olmoe": lambda s: dict(num_experts=_experts(s), num_experts_per_tok=2,
                            intermediate_size=s["intermediate_size"] // 4),
    "granitemoe": lambda s: dict(num_local_experts=_experts(s), num_experts_per_tok=2,
                                 intermediate_size=s["intermediate_size"] // 4),
    "gpt_oss": lambda s: dict(num_local_experts=_experts(s), num_experts_per_tok=2,
                              intermediate_size=s["intermediate_size"] // 4),
    "glm4_moe": lambda s: dict(n_routed_experts=_experts(s), num_experts_per_tok=2, n_shared_experts=1,
                               moe_intermediate_size=s["intermediate_size"] // 4, first_k_dense_replace=1,
                               n_group=1, topk_group=1),
    # DeepSeek-V3's multi-head latent attention at a quarter (low-rank q) and an eighth (kv) of the width
    "deepseek_v3": lambda s: dict(n_routed_experts=_experts(s), num_experts_per_tok=2, n_shared_experts=1,
                                  moe_intermediate_size=s["intermediate_size"] // 4, first_k_dense_replace=1,
                                  n_group=1, topk_group=1, q_lora_rank=s["hidden_size"] // 4,
                                  kv_lora_rank=s["hidden_size"] // 8, qk_rope_head_dim=s["head_dim"] // 2,
                                  qk_nope_head_dim=s["head_dim"], v_head_dim=s["head_dim"]),
    # Qwen3-Next's gated delta-net layers with the attention's head size
    "qwen3_next": lambda s: dict(num_experts=_experts(s), num_experts_per_tok=2,
                                 moe_intermediate_size=s["intermediate_size"] // 4,
                                 shared_expert_intermediate_size=s["intermediate_size"] // 2,
                                 linear_key_head_dim=s["head_dim"], linear_value_head_dim=s["head_dim"],
                                 linear_num_key_heads=s["num_key_value_heads"],
                                 linear_num_value_heads=s["num_attention_heads"]),
    "llama4_text": lambda s: dict(num_local_experts=_experts(s), num_experts_per_tok=1,
                                  intermediate_size=s["intermediate_size"] // 4,
                                  intermediate_size_mlp=s["intermediate_size"]),
    # Falcon-H1's Mamba-2 mixer with the attention's heads and head size, state 16
    "falcon_h1": lambda s: dict(mamba_d_ssm=s["hidden_size"], mamba_n_heads=s["num_attention_heads"],
                                mamba_d_head=s["hidden_size"] // s["num_attention_heads"], mamba_d_state=16,
                                mamba_expand=1),
}


SPECIAL_IDS = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)


def _experts(shape) -> int:
    return 4 if shape["hidden_size"] < 1024 else 8


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    model_type: str
    label: str
    config: object  # a transformers PretrainedConfig


def model_config(model_type: str, *, tiny: bool) -> ModelSpec:
    """A config for ``model_type``: the tiny CPU shape, or the family's published shape (or, for a
    family without one here, the family at Llama-3.2-1B's dimensions)."""
    import transformers

    if tiny:
        label, shape = f"tiny {model_type}", TINY_SHAPE
    elif model_type in FULL_SHAPES:
        label, shape = FULL_SHAPES[model_type]
    else:
        label, shape = f"{model_type} at Llama-3.2-1B dims", LLAMA_3_2_1B
    extras = FAMILY_EXTRAS.get(model_type, lambda s: {})({**TINY_SHAPE, **shape} if tiny else shape)
    # Special ids inside every vocabulary (GLM-4's defaults are not), and no padding row: an
    # embedding's padding_idx would freeze a row the corpus uses.
    keywords = {**shape, **extras, **SPECIAL_IDS}
    if tiny:  # tiny models tie embeddings too, as the small real models do
        keywords["tie_word_embeddings"] = True
    # A deep copy: some configs (Gemma-3) rewrite the rope_parameters dict they are given in place.
    try:
        config = transformers.AutoConfig.for_model(model_type, **copy.deepcopy(keywords))
    except (AttributeError, TypeError, ValueError):
        # Families with per-layer-type rope tables (Gemma-3, OLMo-3) take rope_parameters in a form
        # that changed across transformers 5.x (5.17 rejects the flat dict): their defaults then. The
        # rope base changes no cost, so the benchmark shapes are unaffected.
        keywords.pop("rope_parameters", None)
        config = transformers.AutoConfig.for_model(model_type, **copy.deepcopy(keywords))
    return ModelSpec(model_type, label, config)


def build_model(config, *, device, attention: str = "sdpa"):
    """A random-init CausalLM (fp32 weights) built directly on ``device``, in train mode.

    Gemma-2's class declares no sdpa support because of its attention-logit softcap; with that
    softcap off (as our configs have it) sdpa computes the same thing, so the model is built eager
    and switched to sdpa.
    """
    import transformers

    with torch.device(device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
        except ValueError:
            if getattr(config, "attn_logit_softcapping", None) is not None:
                raise
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
            model.config._attn_implementation = attention
    return model.train()


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


GPU_BATCH_OVERRIDES = {"gemma2": 2}  # Gemma-2-2B-shaped at batch 4 x 2048 does not fit stock in 80 GB


# ------------------------------------------------------------------------------------- LoRA and QLoRA


def decoder_linears(model):
    """``(parent, name, linear)`` for every plain ``nn.Linear`` of ``model`` but its LM head: what PEFT's
    ``target_modules="all-linear"`` adapts and transformers' 4-bit loading quantizes."""
    head = model.get_output_embeddings()
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is torch.nn.Linear and child is not head]


def quantize_4bit(model, device, compute_dtype=torch.bfloat16, *, prepare: bool = True) -> None:
    """QLoRA's base: each decoder projection of ``model`` a bitsandbytes ``Linear4bit`` (nf4, double quant,
    ``compute_dtype``) quantized on ``device`` from the projection's weight, and the model marked as
    transformers marks a 4-bit model (PEFT then wraps them in its ``Linear4bit``) — what ``from_pretrained(
    quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype))`` makes of the same weights; then
    ``peft.prepare_model_for_kbit_training`` without its checkpointing (fp32 norms, embeddings and head), as
    TRL's trainers prepare a 4-bit model. ``prepare=False`` leaves the rest of the model in its dtype, as
    Unsloth's 4-bit loader does (its embeddings and head bf16: about 3 GiB less at Llama-3.1-8B's vocabulary)."""
    import bitsandbytes as bnb
    import peft

    for parent, name, linear in decoder_linears(model):
        quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                      compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                                      device="meta")
        quantized.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4",
                                             compress_statistics=True, module=quantized)
        if linear.bias is not None:
            quantized.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
        setattr(parent, name, quantized.to(device))  # quantizes
    model.is_loaded_in_4bit = True
    if prepare:
        peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
