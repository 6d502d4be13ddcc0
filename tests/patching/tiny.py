"""Tiny random-init configs, one per family: 2 layers, hidden 32, vocab 160, seq 12.

Weights are drawn with ``initializer_range=0.2`` (not transformers' 0.02) so that activations and
logits are of order one: at 0.02 every norm, GLU and softcap sits in its near-linear range, and a
kernel that got one of them wrong could still pass.
"""

from __future__ import annotations

import copy
import importlib

import torch
import transformers

import tigon
from tests.helpers import DEVICE
from tigon.nn.activation_offload import LayerOffload, OffloadConfig, Offloader

VOCAB = 160
SEQ = 12
BATCH = 2

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

def _records_router_logits(package: str, prefix: str) -> bool:
    """Whether the backbone records its routers' logits: transformers 5.17's GraniteMoE does not, and its stock
    forward fails with ``output_router_logits=True`` (the router loss of no logits is the int 0)."""
    module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    return "router_logits" in getattr(module, f"{prefix}PreTrainedModel")._can_record_outputs


# model_type -> (config class, overrides of COMMON). Quirks are set so that they matter: a small
# final-logit softcap, Granite's logits_scaling != 1, router losses on with a visible coefficient,
# Qwen3-MoE with one dense layer (the MLP tigon patches there), Phi-3 with partial rotary.
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 8}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                  "output_router_logits": True, "router_aux_loss_coef": 0.05}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                                     "mlp_only_layers": [0], "output_router_logits": True,
                                     "router_aux_loss_coef": 0.05}),
    "gemma": ("GemmaConfig", {"hidden_act": "gelu_pytorch_tanh"}),
    "gemma2": ("Gemma2Config", {"final_logit_softcapping": 2.0, "attn_logit_softcapping": 5.0,
                                "sliding_window": 8, "query_pre_attn_scalar": 8}),
    "gemma3_text": ("Gemma3TextConfig", {"final_logit_softcapping": 2.0, "sliding_window": 8,
                                         "query_pre_attn_scalar": 8}),
    "phi3": ("Phi3Config", {"partial_rotary_factor": 0.5}),
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", {"sliding_window": 8}),
    "granite": ("GraniteConfig", {"logits_scaling": 4.0, "embedding_multiplier": 2.0,
                                  "residual_multiplier": 0.5, "attention_multiplier": 0.2}),
    "smollm3": ("SmolLM3Config", {}),
    "glm4": ("Glm4Config", {}),
    "stablelm": ("StableLmConfig", {"qk_layernorm": True, "partial_rotary_factor": 0.5}),
    # MoE families: 4 experts, top-2 (Llama-4 top-1, as it is built), a visible router-loss coefficient
    # where the CausalLM adds one; a dense first layer where the family has dense MLP layers (the MLP
    # tigon patches, besides the shared experts).
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                                     "shared_expert_intermediate_size": 40, "mlp_only_layers": [0],
                                     "norm_topk_prob": True, "output_router_logits": True,
                                     "router_aux_loss_coef": 0.05}),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24,
                              "clip_qkv": 1.0, "output_router_logits": True, "router_aux_loss_coef": 0.05}),
    "granitemoe": ("GraniteMoeConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24,
                                        "logits_scaling": 4.0, "embedding_multiplier": 2.0,
                                        "residual_multiplier": 0.5, "attention_multiplier": 0.2,
                                        "output_router_logits": _records_router_logits("granitemoe", "GraniteMoe"),
                                        "router_aux_loss_coef": 0.05}),
    "glm4_moe": ("Glm4MoeConfig", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                                   "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                                   "topk_group": 1, "use_qk_norm": True, "routed_scaling_factor": 1.5,
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5}}),
    "deepseek_v3": ("DeepseekV3Config", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                                         "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
                                         "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                                         "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                                         "num_key_value_heads": 4, "rope_interleave": False,
                                         "routed_scaling_factor": 1.5}),
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24,
                                 "sliding_window": 8, "output_router_logits": True, "router_aux_loss_coef": 0.05,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "qwen3_next": ("Qwen3NextConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                                       "shared_expert_intermediate_size": 40, "mlp_only_layers": [0],
                                       "layer_types": ["linear_attention", "full_attention"],
                                       "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                       "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                       "output_router_logits": True, "router_aux_loss_coef": 0.05,
                                       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.5}}),
    "llama4_text": ("Llama4TextConfig", {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size": 24,
                                         "intermediate_size_mlp": 48, "moe_layers": [1], "no_rope_layers": [1, 0],
                                         "use_qk_norm": True, "attention_chunk_size": 8, "floor_scale": 4,
                                         "attn_scale": 0.5}),
    # dense families added 2026-11-26. Sliding and full layers both present where the family has both
    # (Cohere-2 rotates on its sliding layers only, EXAONE-4 is NoPE on its full ones); biases on where a
    # family has them; logit multipliers != 1; Falcon-H1 with every muP multiplier != 1 and a tiny
    # Mamba-2 mixer; Seed-OSS's dropouts off here (test_dense_families.py trains with them on).
    "ministral": ("MinistralConfig", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
    "starcoder2": ("Starcoder2Config", {"sliding_window": 8, "use_bias": True}),
    "cohere2": ("Cohere2Config", {"logit_scale": 0.5, "sliding_window": 8,
                                  "layer_types": ["sliding_attention", "full_attention"]}),
    "exaone4": ("Exaone4Config", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", {}),
    "ernie4_5": ("Ernie4_5Config", {"use_bias": True}),
    "seed_oss": ("SeedOssConfig", {"attention_bias": True, "attention_dropout": 0.0, "residual_dropout": 0.0}),
    "falcon_h1": ("FalconH1Config", {"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8,
                                     "mamba_chunk_size": 4, "mamba_expand": 1, "mlp_multipliers": [0.5, 2.0],
                                     "lm_head_multiplier": 0.5, "embedding_multiplier": 2.0, "key_multiplier": 0.7,
                                     "attention_in_multiplier": 0.8, "attention_out_multiplier": 1.5,
                                     "ssm_in_multiplier": 0.9, "ssm_out_multiplier": 1.2,
                                     "ssm_multipliers": [1.1, 0.9, 1.2, 0.8, 1.3]}),
}


def tiny_config(model_type: str, **overrides):
    cls_name, extra = CONFIGS[model_type]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"
    return config


def sdpa_config_overrides(model_type: str) -> dict:
    """The config overrides under which ``model_type`` runs sdpa alike on every transformers release: an
    attention-logit softcap (Gemma-2's; its config's default is 50) off. transformers 5.24 and later's sdpa
    raises on a softcap, earlier releases' sdpa drops it silently; without one both compute the same
    attention. Eager attention applies the softcap on every release, so eager tests keep it."""
    config = tiny_config(model_type)
    return {"attn_logit_softcapping": None} if getattr(config, "attn_logit_softcapping", None) is not None else {}


def tiny_model(model_type: str, **overrides):
    """A tiny random model in train mode (fp32, CPU or the test device)."""
    return transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).train()


def batch(seed: int = 0, *, batch_size: int = BATCH, seq: int = SEQ, ignored: int = 3, device=None):
    """Random token ids and labels (ids shifted by the model itself), a few labels set to -100."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch_size, seq), generator=gen)
    labels = ids.clone()
    flat = labels.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:ignored]] = -100
    return ids.to(device or DEVICE), labels.to(device or DEVICE)


def stock_and_patched(model_type: str, *, config_overrides=None, **switches):
    """A tiny model and a deep copy of it patched with ``switches``: same weights, same names."""
    torch.manual_seed(0)
    stock = tiny_model(model_type, **(config_overrides or {})).to(DEVICE)
    patched = copy.deepcopy(stock)
    handle = tigon.patch(patched, **switches)
    return stock, patched, handle


def rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def grads(model) -> dict:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict, want: dict, tolerance=1e-4):
    assert got.keys() == want.keys(), f"parameters with gradients differ: {got.keys() ^ want.keys()}"
    for name, g in want.items():
        err = rel(got[name], g)
        assert err <= tolerance, f"grad of {name}: relative error {err:.2e} > {tolerance:.0e}"


def assert_same_grads(patched, stock, tolerance=1e-4):
    assert_grads_close(grads(patched), grads(stock), tolerance)


def train(model, steps: int, *, lr: float = 1e-2, seed: int = 0):
    """AdamW on a fresh batch per step; returns the per-step losses and the first step's gradients
    (taken before the optimizer moved anything)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, first_grads = [], None
    for step in range(steps):
        ids, labels = batch(seed + step)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if step == 0:
            first_grads = grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first_grads


class PromptMaskedSamples(torch.utils.data.Dataset):
    """Token ids with a prompt of 1..6 positions per sequence left out of the loss (so the number of
    trained tokens differs from sequence to sequence, as gradient accumulation's item count must see)."""

    def __init__(self, count: int):
        gen = torch.Generator().manual_seed(7)
        self.ids = torch.randint(3, VOCAB, (count, SEQ), generator=gen)
        self.prompt = torch.randint(1, 7, (count,), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[: self.prompt[i]] = -100
        return {"input_ids": self.ids[i], "labels": labels}


# The offload's hooks told to take every saved tensor, of any size, on the CPU as on the GPU.
EVERYTHING = OffloadConfig(device_types=("cpu", "cuda"), min_bytes=0, bucket_bytes=1)


def forced_offload(model, config=EVERYTHING) -> Offloader:
    """The offload's scope on every decoder layer of ``model`` (the hooks the switch installs on CUDA models; with
    the default config CPU tensors count as offloadable too; ``model.model`` calls the layers)."""
    offloader = Offloader(config)
    for layer in model.model.layers:
        LayerOffload(layer, offloader, model.model).apply()
    return offloader

