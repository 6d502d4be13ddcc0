"""PEFT LoRA on every family whose attention or MLP tigon fuses: one training step of a patched LoRA model
equals stock PEFT's (loss within 1e-5, every adapter gradient within 1e-4; fp32 under the interpreter), and
the adapters run inside tigon's attention node and MLP node where the family has them (``Patch.replaced``
says so, and the nodes are called once a module), in PEFT's forward where it has not.

Rank 5 on every linear layer (PEFT's ``all-linear``), ``init_lora_weights=False`` so that B ≠ 0 and the
adapters change the loss. Sliding windows are wider than the sequence, as a training sequence shorter than
Mistral's 4096 window is: the mask is then causal and the node runs in every layer;
:func:`test_banded_layers_keep_the_projections_forwards` takes a window within the sequence.

Where a family's projections are not those of tigon's nodes (:data:`NODES`), the adapters run in PEFT's own
forward: Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` (its attention is not Llama's layout; its MLP is the
fused-layout instance forward, tigon's GLU between PEFT's ``gate_up_proj`` and ``down_proj``), attentions with
q/k norms (Qwen-3, Gemma-3, OLMo-2/3, ...) or another rotary (GLM-4, Cohere-2, ERNIE-4.5, Llama-4), and MLPs
with muP multipliers or an output dropout (Falcon-H1, Seed-OSS: tigon's GLU between PEFT's projections).
"""

from __future__ import annotations

import copy

import pytest
import torch

import tigon
from tests.patching import tiny
from tests.patching.tiny import SEQ, assert_grads_close, batch, grads, rel, sdpa_config_overrides, tiny_model
from tigon.nn import mlp as nn_mlp
from tigon.patching import fused_attention
from tigon.patching.engine import SWITCHES, resolve
from tigon.patching.families import FAMILIES
from tigon.patching.parts.attention import fuses_attention

peft = pytest.importorskip("peft")

RANK = 5

# model_type -> the nodes its adapters run in ("attention", "MLP") under transformers 5.25 and PEFT 0.21;
# an empty tuple: every adapter runs in PEFT's forward.
NODES = {
    "llama": ("attention", "MLP"),
    "mistral": ("attention", "MLP"),
    "ministral": ("attention", "MLP"),
    "qwen2": ("attention", "MLP"),
    "gemma": ("attention", "MLP"),
    "gemma2": ("attention", "MLP"),
    "granite": ("attention", "MLP"),
    "smollm3": ("attention", "MLP"),
    "qwen2_moe": ("attention", "MLP"),  # the dense layer's MLP and the shared expert
    "mixtral": ("attention",),
    "granitemoe": ("attention",),
    "starcoder2": ("attention",),  # c_fc / c_proj: not a gated MLP
    "seed_oss": ("attention",),  # the MLP's output dropout: tigon's GLU between PEFT's projections
    # q/k norms or another rotary: the attention runs its own forward
    "qwen3": ("MLP",),
    "gemma3_text": ("MLP",),
    "olmo2": ("MLP",),
    "olmo3": ("MLP",),
    "exaone4": ("MLP",),
    "hunyuan_v1_dense": ("MLP",),
    "stablelm": ("MLP",),
    "cohere2": ("MLP",),
    "ernie4_5": ("MLP",),
    "llama4_text": ("MLP",),  # the dense layer's MLP (LLAMA4_TARGETS)
    # PEFT 0.21 converts these MoE rows' targets to transformers 5's experts (target_parameters on the 3-D
    # gate_up_proj / down_proj): their dense MLPs and shared experts get no adapters
    "qwen3_moe": (),
    "glm4_moe": (),
    "deepseek_v3": (),
    "qwen3_next": (),
    # fused qkv_proj / gate_up_proj (Phi-3), gate_up_proj and an interleaved rotary (GLM-4), muP multipliers
    # (Falcon-H1): tigon's GLU between PEFT's projections
    "phi3": (),
    "glm4": (),
    "falcon_h1": (),
}
# Llama-4: PEFT's all-linear takes the router, whose forward returns a tuple (stock PEFT fails on it); the
# attention and the dense layer's MLP (layer 1's MoE block adds its routed output into the shared expert's
# output in place, which the MLP node's output, a view, does not allow)
LLAMA4_TARGETS = r".*\.layers\.\d+\.(self_attn\.[qkvo]_proj|feed_forward\.(gate|up|down)_proj)"


@pytest.fixture(autouse=True)
def _node_in_fp32_on_this_device(monkeypatch):
    monkeypatch.setattr(fused_attention, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fused_attention, "_HALF", (torch.float16, torch.bfloat16, torch.float32))


@pytest.fixture
def node_calls(monkeypatch):
    """The attention nodes' and the LoRA MLP nodes' calls, by node."""
    calls = {"attention": 0, "MLP": 0}
    apply, mlp = fused_attention.APPLY_NODE, nn_mlp.lora_gated_mlp

    def attention_node(*args):
        calls["attention"] += 1
        return apply(*args)

    def mlp_node(*args, **kwargs):
        calls["MLP"] += 1
        return mlp(*args, **kwargs)

    monkeypatch.setattr(fused_attention, "APPLY_NODE", attention_node)
    monkeypatch.setattr(nn_mlp, "lora_gated_mlp", mlp_node)
    return calls


def test_every_family_with_a_fused_attention_or_mlp_is_listed():
    """The families whose attention tigon can fuse or whose MLP it patches, from the family table."""
    fused = set()
    for model_type, family in FAMILIES.items():
        if family.is_vision_language:
            continue
        classes = resolve(family)
        if family.mlp is not None or (classes.attention is not None and fuses_attention(family, classes, SWITCHES)):
            fused.add(model_type)
    assert fused == set(NODES) and fused <= set(tiny.CONFIGS)


def lora_config(model_type, **kwargs):
    if model_type == "falcon_h1":  # PEFT refuses the Mamba mixer's out_proj
        targets = {"target_modules": "all-linear", "exclude_modules": ["out_proj"]}
    elif model_type == "llama4_text":
        targets = {"target_modules": LLAMA4_TARGETS}
    else:
        targets = {"target_modules": "all-linear"}
    return peft.LoraConfig(r=RANK, lora_alpha=8, init_lora_weights=False, **targets, **kwargs)


def lora(model, model_type, seed=1):
    torch.manual_seed(seed)  # the adapters' init: the same draw for stock and patched
    return peft.get_peft_model(model, lora_config(model_type))


def base_model(model_type, **overrides):
    torch.manual_seed(0)
    config = tiny.tiny_config(model_type)
    window = {"sliding_window": 2 * SEQ} if getattr(config, "sliding_window", None) else {}
    model = tiny_model(model_type, **{**sdpa_config_overrides(model_type), **window, **overrides})
    model.config._attn_implementation = "sdpa"
    return model


def step(model, seed=0):
    ids, labels = batch(seed)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    out = loss.detach(), grads(model)
    model.zero_grad(set_to_none=True)
    return out


def assert_step_matches(patched, stock, seed=0):
    loss_stock, want = step(stock, seed)
    loss, got = step(patched, seed)
    assert rel(loss, loss_stock) <= 1e-5, (loss.item(), loss_stock.item())
    assert want and all("lora_" in name for name in want)
    assert_grads_close(got, want, 1e-4)


def _with_adapters(model, cls, projection) -> int:
    """How many ``cls`` modules of ``model`` hold a PEFT LoRA layer as ``projection``."""
    if cls is None:
        return 0
    return sum(type(m) is cls and hasattr(m._modules.get(projection), "lora_A") for m in model.modules())


def _line(text, modules):
    return text if modules == 1 else f"{text} ({modules} modules)"


@pytest.mark.parametrize("model_type", sorted(NODES))
def test_lora_step_matches_peft_with_adapters_in_the_nodes(model_type, node_calls):
    base = base_model(model_type)
    classes = resolve(FAMILIES[model_type])
    stock = lora(copy.deepcopy(base), model_type)
    patched = lora(base, model_type)
    nodes = NODES[model_type]
    modules = {"attention": _with_adapters(patched, classes.attention, "q_proj") if "attention" in nodes else 0,
               "MLP": _with_adapters(patched, classes.mlp, "gate_proj") if "MLP" in nodes else 0}
    assert all(modules[node] for node in nodes)
    handle = tigon.patch(patched)
    assert_step_matches(patched, stock)

    expected = []
    if "attention" in nodes:
        expected.append(_line(f"LoRA adapters (r={RANK}) of q_proj/k_proj/v_proj/o_proj run inside the attention "
                              "node", modules["attention"]))
    if "MLP" in nodes:
        expected.append(_line(f"LoRA adapters (r={RANK}) of gate_proj/up_proj/down_proj run inside the MLP node",
                              modules["MLP"]))
    assert sorted(line for line in handle.replaced if line.startswith("LoRA adapters")) == sorted(expected), \
        handle.replaced
    assert node_calls == modules  # once a module


def test_banded_layers_keep_the_projections_forwards(node_calls):
    """A sliding window within the sequence: tigon's band attention runs the sliding layer (its projections
    through PEFT's forward), the full layer runs the node; the step equals stock PEFT's."""
    base = base_model("ministral", sliding_window=SEQ // 2)
    stock = lora(copy.deepcopy(base), "ministral")
    patched = lora(base, "ministral")
    tigon.patch(patched)
    assert_step_matches(patched, stock)
    assert node_calls == {"attention": 1, "MLP": 2}

