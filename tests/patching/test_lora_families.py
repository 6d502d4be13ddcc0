"""PEFT LoRA on every family whose attention or MLP tigon fuses: one training step of a patched LoRA model
equals stock PEFT's (loss within 1e-5, every adapter gradient within 1e-4; fp32 under the interpreter), and
the adapters run inside tigon's attention node and MLP node where the family has them (``Patch.replaced``
says so, and the nodes are called once a module), in PEFT's forward where it has not.

Rank 5 on every linear layer (PEFT's ``all-linear``), ``init_lora_weights=False`` so that B ≠ 0 and the
adapters change the loss. Sliding windows are wider than the sequence, as a training sequence shorter than
Mistral's 4096 window is: the mask is then causal and the node runs in every layer;
:func:`test_banded_layers_keep_the_projections_forwards` takes a window within the sequence. Where the model has
sliding layers (which tigon's band attention takes), ``Patch.replaced`` names the full layers and the sliding
ones apart: the latter run the node only on sequences shorter than their window.

Where a family's projections are not those of tigon's nodes (:data:`NODES`), the adapters run in PEFT's own
forward: Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` (its attention is not Llama's layout; its MLP is the
fused-layout instance forward, tigon's GLU between PEFT's ``gate_up_proj`` and ``down_proj``), attentions with
q/k norms (Qwen-3, Gemma-3, OLMo-2/3, ...) or another rotary (GLM-4, Cohere-2, ERNIE-4.5, Llama-4), and MLPs
with muP multipliers (Falcon-H1: tigon's GLU between PEFT's projections); ``Patch.replaced`` names each such
projection. Seed-OSS's MLP (an output dropout after it) takes its adapters inside the node.
MoE rows: the attention's adapters, and the dense layers' and shared experts' MLPs' where PEFT puts adapters
on them; the routed experts' weights are PEFT's ``target_parameters`` where PEFT targets them, and run as
PEFT wraps them.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest

import tigon
from tests.helpers import DEVICE
from tests.patching import tiny
from tests.patching.tiny import SEQ
from tests.patching.tiny_lora import RANK, assert_step_matches, base_model, count_node_calls, lora, node_in_fp32_here
from tigon.patching import band_attention, causal_mask
from tigon.patching.engine import SWITCHES, resolve
from tigon.patching.families import FAMILIES
from tigon.patching.parts.attention import fuses_attention

pytest.importorskip("peft")

# model_type -> the nodes its adapters run in ("attention", "MLP"), as transformers 5.17-5.25 write the family's
# modules; an empty tuple: every adapter runs in PEFT's forward.
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
    "seed_oss": ("attention", "MLP"),  # the MLP node, then stock's output dropout
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
    "llama4_text": ("MLP",),  # the dense layer's MLP (tiny_lora.LLAMA4_TARGETS)
    "qwen3_moe": ("MLP",),
    "glm4_moe": ("MLP",),
    "deepseek_v3": ("MLP",),
    "qwen3_next": ("MLP",),
    # fused qkv_proj / gate_up_proj (Phi-3), gate_up_proj and an interleaved rotary (GLM-4), muP multipliers
    # (Falcon-H1): tigon's GLU between PEFT's projections
    "phi3": (),
    "glm4": (),
    "falcon_h1": (),
}


@pytest.fixture(autouse=True)
def _node_in_fp32_here(monkeypatch):
    node_in_fp32_here(monkeypatch)


@pytest.fixture
def node_calls(monkeypatch):
    return count_node_calls(monkeypatch)


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


def _with_adapters(model, cls, projection) -> int:
    """How many ``cls`` modules of ``model`` hold a PEFT LoRA layer as ``projection``."""
    if cls is None:
        return 0
    return sum(type(m) is cls and hasattr(m._modules.get(projection), "lora_A") for m in model.modules())


def _line(text, modules):
    return text if modules == 1 else f"{text} ({modules} modules)"


def sliding_line(window):
    return (f"LoRA adapters (r={RANK}) of q_proj/k_proj/v_proj/o_proj run inside the attention node in sliding-window "
            f"layers (window {window}) for sequences shorter than {window} tokens; from {window} tokens on these "
            "layers run their own attention forward under tigon's band attention (band_attention.py), with "
            "q_proj/k_proj/v_proj/o_proj in PEFT's forwards")


FULL_LINE = (f"LoRA adapters (r={RANK}) of q_proj/k_proj/v_proj/o_proj run inside the attention node in "
             "full-attention layers")


def attention_lines(model, cls):
    """The attention's adapter lines: one for all its layers, or in a model with sliding layers (which the band
    attention takes) one for the sliding ones (their window wider than the sequence here: the node runs them) and
    one for the full ones."""
    line = f"LoRA adapters (r={RANK}) of q_proj/k_proj/v_proj/o_proj run inside the attention node"
    attentions = [m for m in model.modules() if type(m) is cls and hasattr(m._modules.get("q_proj"), "lora_A")]
    if not band_attention.has_sliding_layers(model.config):
        return [_line(line, len(attentions))]
    windows = Counter(band_attention.layer_window(m) for m in attentions)
    return [_line(FULL_LINE if window is None else sliding_line(window), n) for window, n in windows.items()]


@pytest.mark.parametrize("model_type", sorted(NODES))
def test_lora_step_matches_peft_with_adapters_in_the_nodes(model_type, node_calls):
    base = base_model(model_type)
    classes = resolve(FAMILIES[model_type])
    stock = lora(copy.deepcopy(base), model_type)
    patched = lora(base, model_type)
    nodes = NODES[model_type]
    modules = {"attention": _with_adapters(patched, classes.attention, "q_proj") if "attention" in nodes else 0,
               "MLP": _with_adapters(patched, classes.mlp, "gate_proj") if "MLP" in nodes else 0}
    # PEFT 0.21 turns a MoE model's gate_proj / up_proj / down_proj targets into the routed experts' 3-D
    # parameters where transformers' conversion mapping names the family (Qwen3-MoE, GLM-4-MoE, DeepSeek-V3,
    # Qwen3-Next in 5.25): their dense MLPs and shared experts then hold no adapters
    moe_mlps = FAMILIES[model_type].experts is not None
    assert all(modules[node] for node in nodes if not (node == "MLP" and moe_mlps))
    handle = tigon.patch(patched)
    assert_step_matches(patched, stock)

    expected = []
    if modules["attention"]:
        expected += attention_lines(patched, classes.attention)
    if modules["MLP"]:
        expected.append(_line(f"LoRA adapters (r={RANK}) of gate_proj/up_proj/down_proj run inside the MLP node",
                              modules["MLP"]))
    assert sorted(line for line in handle.replaced if line.startswith("LoRA adapters")) == sorted(expected), \
        handle.replaced
    assert node_calls == modules  # once a module


@pytest.mark.parametrize(("window", "sliding_calls", "block_rows"),
                         [(SEQ // 2, 0, None), (SEQ // 2, 0, SEQ // 4), (SEQ, 0, None), (SEQ + 1, 1, None)])
def test_banded_layers_keep_the_projections_forwards(window, sliding_calls, block_rows, node_calls, monkeypatch):
    """A sliding window within the sequence (or as long: transformers masks a sequence of the window's length):
    tigon's band attention runs the sliding layer (its projections through PEFT's forward; with ``block_rows``
    set, sdpa over the band's row blocks), the full layer runs the node; a window longer than the sequence
    leaves the sliding layer's call maskless, and the node runs it. The step equals stock PEFT's either way,
    and ``Patch.replaced`` says which layers run the node when."""
    rectangles = []
    if block_rows is not None:
        monkeypatch.setattr(band_attention, "CONFIG", band_attention.BandConfig(block_rows=block_rows, min_blocks=2))
        rectangle = causal_mask.BandMask.rectangle
        monkeypatch.setattr(causal_mask.BandMask, "rectangle",
                            lambda mask, *bounds: rectangles.append(bounds) or rectangle(mask, *bounds))
    base = base_model("ministral", sliding_window=window)
    assert base.config.layer_types == ["sliding_attention", "full_attention"]
    stock = lora(copy.deepcopy(base), "ministral")
    patched = lora(base, "ministral")
    handle = tigon.patch(patched)
    assert [line for line in handle.replaced if line.startswith("LoRA adapters") and "attention" in line] == \
        [sliding_line(window), FULL_LINE], handle.replaced
    assert_step_matches(patched, stock)
    assert node_calls == {"attention": 1 + sliding_calls, "MLP": 2}
    assert len(rectangles) == (0 if block_rows is None else SEQ // block_rows)  # the sliding layer's row blocks


def test_banded_lines_follow_the_switch_and_the_layers(node_calls):
    """Mistral gives every layer the window (no ``layer_types``); with the sliding_window switch off the node
    takes the sliding layer's mask itself (it runs both layers), and the line is the plain one."""
    handle = tigon.patch(lora(base_model("mistral", sliding_window=SEQ // 2), "mistral"))
    assert f"{sliding_line(SEQ // 2)} (2 modules)" in handle.replaced, handle.replaced
    base = base_model("ministral", sliding_window=SEQ // 2)
    stock = lora(copy.deepcopy(base), "ministral")
    patched = lora(base, "ministral")
    handle = tigon.patch(patched, sliding_window=False)
    assert f"LoRA adapters (r={RANK}) of q_proj/k_proj/v_proj/o_proj run inside the attention node (2 modules)" \
        in handle.replaced, handle.replaced
    assert_step_matches(patched, stock)
    assert node_calls == {"attention": 2, "MLP": 2}


def test_attention_that_never_runs_the_node_says_so(node_calls):
    """An attention the node runs no call of as the model stands: eager attention (the node computes sdpa's),
    Gemma-2's logit softcap. ``Patch.replaced`` says the attention runs its own forward and q/k/v/o PEFT's;
    the eager model's step is stock PEFT's, the node not called."""
    own = ("LlamaAttention: its own forward (the line above), not q/k/v, rotary, sdpa and o_proj as one autograd "
           "node (fused_attention.py): the model's attention implementation is 'eager'; the node computes sdpa's "
           "(2 modules)")
    outside = "q_proj/k_proj/v_proj/o_proj: PEFT's forwards (the attention runs its own forward, the line above) " \
              "(2 modules)"
    base = tiny.tiny_model("llama").to(DEVICE)  # where batch() puts the tokens
    stock = lora(copy.deepcopy(base))
    patched = lora(base)
    handle = tigon.patch(patched)
    assert own in handle.replaced and outside in handle.replaced, handle.replaced
    assert not any("inside the attention node" in line for line in handle.replaced), handle.replaced
    assert_step_matches(patched, stock)
    assert node_calls == {"attention": 0, "MLP": 2}
    handle = tigon.patch(lora(base_model("gemma2", attn_logit_softcapping=50.0), "gemma2"))
    assert ("Gemma2Attention: its own forward (the line above), not q/k/v, rotary, sdpa and o_proj as one autograd "
            "node (fused_attention.py): a softcap on its attention logits (attn_logit_softcapping), which the node "
            "does not apply (2 modules)") in handle.replaced, handle.replaced
    assert outside in handle.replaced and not any("inside the attention node" in line for line in handle.replaced)


def test_llama4_shared_expert_adapters_in_the_mlp_node(node_calls):
    """Llama-4's MoE block adds its routed experts' output into its shared expert's output in place: the MLP
    node's output, with the shared expert's adapters inside, is no view another tensor shares."""
    import peft
    import torch

    base = base_model("llama4_text")
    config = dict(r=RANK, lora_alpha=8, init_lora_weights=False, target_modules=["gate_proj", "up_proj", "down_proj"])
    torch.manual_seed(1)
    stock = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**config))
    torch.manual_seed(1)
    patched = peft.get_peft_model(base, peft.LoraConfig(**config))
    handle = tigon.patch(patched)
    assert f"LoRA adapters (r={RANK}) of gate_proj/up_proj/down_proj run inside the MLP node (2 modules)" \
        in handle.replaced, handle.replaced
    assert_step_matches(patched, stock)
    assert node_calls == {"attention": 0, "MLP": 2}


@pytest.mark.parametrize(("model_type", "projections"), [("phi3", ("gate_up_proj", "down_proj")),
                                                         ("glm4", ("gate_up_proj", "down_proj")),
                                                         ("falcon_h1", ("gate_proj", "up_proj", "down_proj"))])
def test_mlp_adapters_outside_the_node_say_why(model_type, projections):
    handle = tigon.patch(lora(base_model(model_type), model_type))
    for projection in projections:
        assert any(line.startswith(f"{projection}: PEFT's forward (") for line in handle.replaced), handle.replaced
