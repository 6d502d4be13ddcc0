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
from tigon.patching import forwards

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
    got = forwards.apply_rotary_pos_emb_half_angles(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
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
