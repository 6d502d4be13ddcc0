"""Vision-language rows: a patched tiny VLM computes what the stock one does, with an image in every
sequence (tiny_vlm.py lays the image tokens and pixel values out as each processor does).

fp32, random init. Every row: one training step's loss and every parameter gradient (vision tower,
projector, language model, head) within 1e-4 relative, ``logits=None`` in training with labels, stock
logits in eval mode and without labels, and a revert that restores every module and forward. A 10-step
AdamW run whose per-step losses agree within 1e-4, for every row. The class patch
(``tigon.patch("qwen2_5_vl")``), the switches, the vision rotary against transformers', and the ``gpu``
tests of two VLMs under bf16 autocast.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import tigon
from tests.helpers import DEVICE, ON_GPU
from tests.patching.tiny import grads, rel
from tests.patching.tiny_vlm import (
    CONFIGS,
    assert_vlm_grads_close,
    stock_and_patched_vlm,
    tiny_vlm,
    vlm_batch,
)
from tigon.patching import rotary
from tigon.patching.families import FAMILIES

VLM_TYPES = sorted(CONFIGS)
STEPS = int(os.environ.get("TIGON_FAMILY_STEPS", "10"))  # CI's pass on the oldest transformers: fewer
LOSS_TOLERANCE = 1e-4


def test_every_vision_language_row_is_tested():
    assert VLM_TYPES == sorted(t for t, f in FAMILIES.items() if f.is_vision_language)


def _train(model, model_type, steps, *, lr=1e-2):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = model(**vlm_batch(model_type, model.config, seed=step, batch_size=RUN_BATCH)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# One sequence a batch under the interpreter (~4 s a row for the ten steps of both models), two on the
# GPU (as the one-step test has everywhere).
RUN_BATCH = 2 if ON_GPU else 1


@pytest.mark.parametrize("model_type", VLM_TYPES)
def test_adamw_run_matches_stock(model_type):
    """Ten AdamW steps on fresh image batches: every step's loss within 1e-4."""
    stock, patched, _ = stock_and_patched_vlm(model_type)
    want = _train(stock, model_type, STEPS)
    got = _train(patched, model_type, STEPS)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        err = abs(g - w) / abs(w)
        assert err <= LOSS_TOLERANCE, f"step {step}: loss {g} vs stock {w} ({err:.2e})"


@pytest.mark.parametrize("model_type", VLM_TYPES)
def test_step_logits_and_revert_match_stock(model_type):
    """One training step with an image: the loss, ``logits=None``, every parameter's gradient (vision
    tower, projector, language model, head). Without labels and in eval: stock logits (and loss).
    Revert: every module and forward as before, bitwise the stock outputs."""
    stock, patched, handle = stock_and_patched_vlm(model_type)
    assert any(line.startswith("vision: ") for line in handle.replaced)
    types_before = [type(m) for m in stock.modules()]
    params_before = dict(patched.named_parameters())
    assert list(patched.state_dict()) == list(stock.state_dict())
    assert all(p is params_before[name] for name, p in patched.named_parameters())

    inputs = vlm_batch(model_type, stock.config, seed=3)
    want, got = stock(**inputs), patched(**inputs)
    assert got.logits is None
    assert rel(got.loss, want.loss) <= LOSS_TOLERANCE
    want.loss.backward()
    got.loss.backward()
    got_grads = grads(patched)
    assert any(".vision" in name or ".visual." in name for name in got_grads)
    assert_vlm_grads_close(got_grads, grads(stock))

    unlabelled = {k: v for k, v in inputs.items() if k != "labels"}
    with torch.no_grad():
        assert rel(patched(**unlabelled).logits, stock(**unlabelled).logits) <= 1e-5
        stock.eval()
        patched.eval()
        want, got = stock(**inputs), patched(**inputs)
    assert got.logits is not None
    assert rel(got.logits, want.logits) <= 1e-5
    assert rel(got.loss, want.loss) <= LOSS_TOLERANCE

    handle.revert()
    assert [type(m) for m in patched.modules()] == types_before
    assert not any("forward" in vars(m) for m in patched.modules())
    assert all(p is params_before[name] for name, p in patched.named_parameters())
    with torch.no_grad():
        again = patched(**inputs)
    assert torch.equal(again.logits, want.logits) and torch.equal(again.loss, want.loss)
    handle.revert()  # twice: a no-op


def test_class_patch_patches_models_built_afterwards():
    model_type = "qwen2_5_vl"
    handle = tigon.patch(model_type)
    try:
        assert any(line.startswith("vision: ") for line in handle.replaced)
        torch.manual_seed(0)
        patched = tiny_vlm(model_type).to(DEVICE)
    finally:
        handle.revert()
    torch.manual_seed(0)
    stock = tiny_vlm(model_type).to(DEVICE)
    assert "forward" in vars(patched) and "forward" not in vars(stock)
    assert not any(type(m).__name__ == "Qwen2_5_VLRMSNorm" for m in patched.modules())
    inputs = vlm_batch(model_type, stock.config)
    want, got = stock(**inputs), patched(**inputs)
    assert got.logits is None and rel(got.loss, want.loss) <= LOSS_TOLERANCE
    want.loss.backward()
    got.loss.backward()
    assert_vlm_grads_close(grads(patched), grads(stock))


def test_switches_off_leave_their_parts():
    """rope=False keeps both rotaries (text and vision), rms_norm/layer_norm=False every norm,
    vision_attention=False the vision attention's forward, and the model still trains as stock does."""
    stock, patched, handle = stock_and_patched_vlm("qwen2_vl", rope=False, layer_norm=False, vision_attention=False)
    assert not any("apply_rotary_pos_emb" in line for line in handle.replaced)
    assert any(type(m) is torch.nn.LayerNorm for m in patched.modules())
    assert not any("forward" in vars(m) for m in patched.modules() if type(m).__name__.endswith("Attention"))
    inputs = vlm_batch("qwen2_vl", stock.config)
    assert rel(patched(**inputs).loss, stock(**inputs).loss) <= LOSS_TOLERANCE


def test_vision_rotary_matches_transformers_in_fp32_and_bf16():
    """tigon's apply_rotary_pos_emb_vision against transformers' (fp32 math, cast back to q's dtype)."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(20, 4, 8, generator=gen).to(DEVICE, dtype).requires_grad_()
        k = torch.randn(20, 4, 8, generator=gen).to(DEVICE, dtype).requires_grad_()
        angles = torch.randn(20, 4, generator=gen).to(DEVICE)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        want = qwen.apply_rotary_pos_emb_vision(q, k, cos, sin)
        got = rotary.apply_rotary_pos_emb_vision(q, k, cos, sin)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype == dtype and g.shape == w.shape
            assert rel(g, w) <= (1e-6 if dtype == torch.float32 else 8e-3)
        grad = [torch.randn(20, 4, 8, generator=gen).to(DEVICE, dtype) for _ in range(2)]
        want_g = torch.autograd.grad(want, (q, k), grad)
        got_g = torch.autograd.grad(got, (q, k), grad)
        for g, w in zip(got_g, want_g, strict=True):
            assert rel(g, w) <= (1e-6 if dtype == torch.float32 else 8e-3)


def test_a_vision_rotary_that_differs_is_not_patched(monkeypatch):
    """A release whose apply_rotary_pos_emb_vision is not the fp32 one raises, the model untouched."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return (q * cos) + (qwen.rotate_half(q) * sin), (k * cos) + (qwen.rotate_half(k) * sin)

    monkeypatch.setattr(qwen, "apply_rotary_pos_emb_vision", apply_rotary_pos_emb_vision)
    torch.manual_seed(0)
    model = tiny_vlm("qwen2_vl")
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="apply_rotary_pos_emb_vision"):
        tigon.patch(model)
    assert [type(m) for m in model.modules()] == before
    assert tigon.patch(model, rope=False).replaced  # the rest still patches


def test_language_model_of_another_family_is_refused():
    """LLaVA builds its decoder from config.text_config: a text type tigon has no row for raises, and
    the model is left untouched."""
    torch.manual_seed(0)
    model = tiny_vlm("llava")
    model.model.language_model.config.model_type = "not_a_family"
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="not_a_family"):
        tigon.patch(model)
    assert [type(m) for m in model.modules()] == before and "forward" not in vars(model)


# ------------------------------------------------------------------------------------------------ gpu

BF16_TOLERANCE = 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_bf16_autocast_training_matches_stock(model_type):
    """bf16 autocast, fp32 master weights: 10 AdamW steps whose losses stay within bf16's tolerance."""
    stock, patched, _ = stock_and_patched_vlm(model_type)

    def run(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(STEPS):
            inputs = vlm_batch(model_type, model.config, seed=step)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**inputs).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    for step, (g, w) in enumerate(zip(run(patched), run(copy.deepcopy(stock)), strict=True)):
        assert abs(g - w) / abs(w) <= BF16_TOLERANCE, f"step {step}: {g} vs stock {w}"


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_compiled_patched_model_matches_eager(model_type):
    """``torch.compile`` of a patched VLM (Inductor; graph breaks allowed where stock transformers has
    them, around the image tokens' placement): one fp32 training step's loss and every gradient as the
    eager patched model's."""
    _, patched, _ = stock_and_patched_vlm(model_type)
    compiled_copy = copy.deepcopy(patched)
    inputs = vlm_batch(model_type, patched.config, seed=0)
    loss = patched(**inputs).loss
    loss.backward()
    torch._dynamo.reset()
    compiled = torch.compile(compiled_copy)
    got = compiled(**inputs).loss
    got.backward()
    assert rel(got, loss) <= LOSS_TOLERANCE
    assert_vlm_grads_close(grads(compiled_copy), grads(patched), LOSS_TOLERANCE)


def _bf16_autocast_step(model, inputs):
    """One bf16-autocast training step's loss and every parameter gradient."""
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), grads(model)


def test_vision_projection_norms_give_autocast_output():
    """Qwen2.5-VL's vision blocks: norm1 (into the attention's qkv) and norm2 (into the MLP) give bf16
    under autocast, the merger's ln_q (reshaped first) does not. A bf16-autocast step: the loss bitwise
    that of the same patch with those norms giving fp32 (the bf16 output is the cast the projections
    made), the gradients within bf16 rounding."""
    stock, patched, handle = stock_and_patched_vlm("qwen2_5_vl")
    assert any("norm1/norm2 give their output in the autocast dtype" in line for line in handle.replaced)
    flagged = {name for name, m in patched.model.visual.named_modules() if getattr(m, "autocast_output", False)}
    blocks = len(patched.model.visual.blocks)
    assert flagged == {f"blocks.{i}.{n}" for i in range(blocks) for n in ("norm1", "norm2")}
    unflagged = copy.deepcopy(patched)
    for m in unflagged.modules():
        if getattr(m, "autocast_output", False):
            m.autocast_output = False
    inputs = vlm_batch("qwen2_5_vl", stock.config, seed=4)
    (loss, got), (want_loss, want) = (_bf16_autocast_step(m, inputs) for m in (patched, unflagged))
    assert torch.equal(loss, want_loss)
    for name, g in got.items():
        assert rel(g, want[name]) <= 2e-2, name


def test_qwen2_5_vl_vision_blocks_join_and_project_as_one_node():
    """Qwen2.5-VL's vision blocks: the attention's output joins the stream with norm2 as one
    add_rms_norm (``rms_norm``), and the attention's qkv and proj are one autocast node each, with no
    cast node before their fp32 weights and biases (``vision_attention``). A bf16-autocast step within
    bf16 rounding of stock's; each switch off leaves its part."""
    from tigon.nn.shared_cast_linear import shared_cast_linear

    stock, patched, handle = stock_and_patched_vlm("qwen2_5_vl")
    assert any(line.startswith("vision: Qwen2_5_VLVisionBlock.forward -> residual joins as tigon.ops.add_rms_norm")
               for line in handle.replaced)
    blocks = patched.model.visual.blocks
    assert all("forward" in vars(block) for block in blocks)
    assert all(p.forward.__func__ is shared_cast_linear for b in blocks for p in (b.attn.qkv, b.attn.proj))
    nodes = []
    # the node as the forward made it (read there: the backward frees the graph)
    blocks[0].attn.qkv.register_forward_hook(lambda m, a, out: nodes.append(
        (type(out.grad_fn).__name__, [type(f).__name__ for f, _ in out.grad_fn.next_functions])))
    inputs = vlm_batch("qwen2_5_vl", stock.config, seed=5)
    (want_loss, want), (loss, got) = (_bf16_autocast_step(m, inputs) for m in (stock, patched))
    ((node, inputs_of_node),) = nodes
    assert node == "_AutocastLinearBackward"
    assert inputs_of_node[2:4] == ["AccumulateGrad"] * 2  # weight, bias
    assert rel(loss, want_loss) <= 1e-2
    assert_vlm_grads_close(got, want, 3e-2)

    _, unjoined, handle = stock_and_patched_vlm("qwen2_5_vl", rms_norm=False)
    assert not any("VisionBlock" in line for line in handle.replaced)
    assert not any("forward" in vars(b) for b in unjoined.model.visual.blocks)
    _, unpacked, _ = stock_and_patched_vlm("qwen2_5_vl", vision_attention=False)
    assert not any("forward" in vars(b.attn.qkv) or "forward" in vars(b.attn.proj)
                   for b in unpacked.model.visual.blocks)


def test_a_vision_block_that_differs_keeps_its_forward(monkeypatch):
    """A transformers version whose vision block differs (here: one statement added) keeps that forward:
    the patch warns, leaves the joins out, patches the rest, and trains as stock."""
    stock = tiny_vlm("qwen2_5_vl").to(DEVICE)
    model = copy.deepcopy(stock)
    block_cls = type(model.model.visual.blocks[0])
    stock_forward = block_cls.forward

    def forward(self, hidden_states, *args, **kwargs):
        hidden_states = hidden_states * 1.0
        return stock_forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(block_cls, "forward", forward)
    with pytest.warns(UserWarning, match="not the vision_pre_norm forward tigon knows"):
        handle = tigon.patch(model)
    assert not any("VisionBlock" in line for line in handle.replaced)
    assert any(line.startswith("vision: ") and "RMSNorm" in line for line in handle.replaced)
    assert not any("forward" in vars(b) for b in model.model.visual.blocks)
    inputs = vlm_batch("qwen2_5_vl", stock.config, seed=6)
    losses = []
    for m in (stock, model):
        loss = m(**inputs).loss
        loss.backward()
        losses.append(loss.detach())
    assert rel(losses[1], losses[0]) <= LOSS_TOLERANCE
    assert_vlm_grads_close(grads(model), grads(stock))
