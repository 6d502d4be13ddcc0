"""The MoE rows' own quirks, beyond what test_families.py checks for every row.

- DeepSeek-V3 with ``rope_interleave`` (its default, and its checkpoints'): the attention rotates
  interleaved pairs with its own function, so it is left stock and ``Patch.replaced`` does not claim it.
- GPT-OSS's rotary passes one angle per rotated pair: tigon's replacement duplicates them, and computes
  what GPT-OSS's ``apply_rotary_pos_emb`` computes.
- Backbones that return ``router_logits`` keep returning them through the generic CausalLM forward
  (DeepSeek-V3, GLM-4-MoE, Llama-4 have no router loss but the stock forward hands the logits on).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import tigon
from tests.helpers import DEVICE
from tests.patching.tiny import assert_same_grads, batch, rel, stock_and_patched
from tigon.patching import rotary
from tigon.patching.engine import SWITCHES

LOSS_TOLERANCE = 1e-4


def _step(model, **kwargs):
    ids, labels = batch(0)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out


def test_deepseek_v3_interleaved_rope_stays_stock():
    stock, patched, handle = stock_and_patched("deepseek_v3", config_overrides={"rope_interleave": True})
    attention = [m for m in patched.modules() if type(m).__name__ == "DeepseekV3Attention"]
    assert attention and not any("forward" in vars(m) for m in attention)
    assert not any("apply_rotary_pos_emb" in line for line in handle.replaced)
    assert any("DeepseekV3RMSNorm" in line for line in handle.replaced)  # the rest is patched
    want, got = _step(stock), _step(patched)
    assert rel(got.loss, want.loss) <= LOSS_TOLERANCE
    assert_same_grads(patched, stock)
    handle.revert()


def test_deepseek_v3_class_patch_says_where_rope_stays_stock():
    handle = tigon.patch("deepseek_v3")
    try:
        rope = [line for line in handle.replaced if "apply_rotary_pos_emb" in line]
        assert rope and "rope_interleave" in rope[0]
    finally:
        handle.revert()


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_gpt_oss_half_angle_rotary_is_its_rotary(unsqueeze_dim):
    modeling = importlib.import_module("transformers.models.gpt_oss.modeling_gpt_oss")
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hk, T, D = 2, 4, 2, 5, 8
    shape_q = (B, Hq, T, D) if unsqueeze_dim == 1 else (B, T, Hq, D)
    shape_k = (B, Hk, T, D) if unsqueeze_dim == 1 else (B, T, Hk, D)
    q = torch.randn(shape_q, generator=gen).to(DEVICE).requires_grad_()
    k = torch.randn(shape_k, generator=gen).to(DEVICE).requires_grad_()
    angles = torch.randn(B, T, D // 2, generator=gen).to(DEVICE)
    cos, sin = angles.cos(), angles.sin()
    want = modeling.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    got = rotary.apply_rotary_pos_emb_half_angles(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and rel(g, w) <= 1e-5
    grads = [torch.randn(t.shape, generator=gen).to(DEVICE) for t in want]
    want_grads = torch.autograd.grad(want, (q, k), grads)
    got_grads = torch.autograd.grad(got, (q, k), grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert rel(g, w) <= 1e-5


@pytest.mark.parametrize("model_type", ["deepseek_v3", "llama4_text"])
def test_router_logits_are_handed_on(model_type):
    """The generic forward returns the stock output class, and with ``output_router_logits`` the
    backbone's router logits, also for a family whose CausalLM adds no router loss."""
    stock, patched, handle = stock_and_patched(model_type)
    want, got = _step(stock, output_router_logits=True), _step(patched, output_router_logits=True)
    assert type(got) is type(want)
    assert got.logits is None and rel(got.loss, want.loss) <= LOSS_TOLERANCE
    want_router = getattr(want, "router_logits", None)
    if want_router is not None:  # transformers >= 5.2x hands them on
        assert len(got.router_logits) == len(want_router)
        for g, w in zip(got.router_logits, want_router, strict=True):
            assert rel(g, w) <= 1e-4
    handle.revert()


@pytest.mark.parametrize(
    "model_type, switch, changed",
    [
        ("gpt_oss", "rope", ["GptOssAttention: apply_rotary_pos_emb -> tigon.ops.rope"]),  # half-width angles
        ("llama4_text", "rope", []),  # complex-multiply rotary on interleaved pairs: kept
        ("olmoe", "mlp", ["OlmoeExperts._apply_gate -> tigon.ops.moe_glu"]),  # routed experts only
        ("llama4_text", "mlp", ["Llama4TextMLP -> tigon.nn.SwiGLUMLP()"]),  # shared expert and dense layer
    ],
)
def test_each_switch_alone(model_type, switch, changed):
    off = {name: False for name in SWITCHES}
    stock, patched, handle = stock_and_patched(model_type, **{**off, switch: True})
    assert len(handle.replaced) == len(changed), handle.replaced
    for line, expected in zip(handle.replaced, changed, strict=True):
        assert line.startswith(expected), (line, expected)
    want, got = _step(stock), _step(patched)
    assert rel(got.loss, want.loss) <= LOSS_TOLERANCE
    assert_same_grads(patched, stock)


# ---------------------------------------------------------------------------------------------- GPU

MOE_TYPES = ["qwen2_moe", "olmoe", "granitemoe", "glm4_moe", "deepseek_v3", "gpt_oss", "qwen3_next", "llama4_text"]
BF16_TOLERANCE = 2e-2
GPU_SIZES = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=4096,
                 max_position_embeddings=256)


def _gpu_sizes(model_type):
    if model_type == "deepseek_v3":  # MLA expands its latent keys to every head: as many kv heads as heads
        return {**GPU_SIZES, "num_key_value_heads": GPU_SIZES["num_attention_heads"], "qk_rope_head_dim": 32,
                "qk_nope_head_dim": 32, "v_head_dim": 32, "q_lora_rank": 64, "kv_lora_rank": 64}
    return GPU_SIZES


def _gpu_batch(step, vocab=GPU_SIZES["vocab_size"], batch_size=4, seq=128):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(3, vocab, (batch_size, seq), generator=gen)
    labels = ids.clone()
    labels[:, :7] = -100
    return ids.to(DEVICE), labels.to(DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_bf16_autocast_training_matches_stock(model_type):
    """20 AdamW steps under bf16 autocast, larger than the CPU configs: per-step losses within bf16's
    tolerance of the stock model's (routing may differ for a token whose top-k scores tie in bf16)."""
    stock, patched, _ = stock_and_patched(model_type, config_overrides=_gpu_sizes(model_type))
    losses = []
    for model in (stock, patched):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses.append([])
        for step in range(20):
            ids, labels = _gpu_batch(step)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[-1].append(loss.item())
    for step, (g, w) in enumerate(zip(losses[1], losses[0], strict=True)):
        assert abs(g - w) / abs(w) <= BF16_TOLERANCE, f"step {step}: {g} vs stock {w}"


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3", "gpt_oss",
                                        # Inductor compiles the gated delta-net's chunked loops, stock and patched,
                                        # forward and backward: ~90 s for the stock model alone on two CPU cores
                                        pytest.param("qwen3_next", marks=pytest.mark.timeout(480))])
def test_torch_compile_of_a_patched_moe_model(model_type):
    """Compiled (not fullgraph: transformers' eager experts loop breaks the graph on its own), the
    patched model computes the compiled stock model's loss and gradients in fp32. (Against eager stock,
    Qwen3-Next's gated delta-net layers alone differ by ~1e-4 once Inductor reorders their fp32 sums.)"""
    stock, patched, _ = stock_and_patched(model_type, config_overrides=_gpu_sizes(model_type))
    torch._dynamo.reset()
    compiled = torch.compile(patched)
    ids, labels = _gpu_batch(0)
    want = torch.compile(stock)(input_ids=ids, labels=labels).loss
    got = compiled(input_ids=ids, labels=labels).loss
    assert rel(got, want) <= LOSS_TOLERANCE
    want.backward()
    got.backward()
    assert_same_grads(patched, stock)
