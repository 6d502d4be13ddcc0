"""The recompute_norms switch: bitwise the gradients of the default patch, fewer saved bytes (by the
amount the module docs derive), off where another saved-tensor scope or torch.compile runs, reverts."""

from __future__ import annotations

import copy

import pytest
import torch

import tigon
from tests.patching.tiny import DEVICE, batch, stock_and_patched, tiny_model
from tigon.bench.saved import measure_model, saved_bytes
from tigon.patching.norm_recompute import _Recipe

PRE_NORM = ["llama", "qwen3", "gemma", "qwen3_moe"]  # plain, q/k norms, offset norms, a MoE with a dense layer


def _default_and_recompute(model_type, **overrides):
    _, default, _ = stock_and_patched(model_type, config_overrides=overrides or None)
    recomputing = copy.deepcopy(default)
    tigon.patch(recomputing, recompute_norms=True)  # on top of the default patch: only the new switch
    return default, recomputing


def _step(model, *, autocast: bool, seed=0, measure=False):
    """Forward and backward of one batch: the loss, the gradients and (``measure``) the saved bytes."""
    ids, labels = batch(seed)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=labels).loss
    saved = saved_bytes(loss, list(model.parameters())).total if measure else None
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, saved


def _assert_bitwise(got, want):
    (loss, grads, _), (want_loss, want_grads, _) = got, want
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert torch.equal(grads[name], g), name


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "fp32"])
@pytest.mark.parametrize("model_type", PRE_NORM)
def test_gradients_are_bitwise_the_default_patchs(model_type, autocast):
    default, recomputing = _default_and_recompute(model_type)
    got, want = _step(recomputing, autocast=autocast, measure=True), _step(default, autocast=autocast, measure=True)
    _assert_bitwise(got, want)
    assert got[2] < want[2]  # the scope was on


def test_saved_bytes_drop_by_the_norm_outputs_and_the_sum():
    """Per layer and token under bf16 autocast: y₁ and y₂ (2·H bytes each) and s (4·H) are no longer
    held; o (2·H) and a copy of each norm's weight (4·H bytes a layer) are: 6·H a token less."""
    hidden, layers = 64, 2
    default, recomputing = _default_and_recompute("llama", hidden_size=hidden, head_dim=16, intermediate_size=128)
    tokens = 4 * 64
    got, _ = measure_model(recomputing, batch=4, seq=64)
    want, _ = measure_model(default, batch=4, seq=64)
    assert want.total - got.total == layers * (tokens * 6 * hidden - 2 * 4 * hidden)


def test_off_under_gradient_checkpointing_and_under_outer_hooks():
    default, recomputing = _default_and_recompute("llama")
    with torch.autograd.graph.save_on_cpu():  # an outer scope (offloading): its hooks see every tensor
        _assert_bitwise(_step(recomputing, autocast=True), _step(default, autocast=True))
    for model in (default, recomputing):
        model.zero_grad(set_to_none=True)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _assert_bitwise(_step(recomputing, autocast=True, seed=1), _step(default, autocast=True, seed=1))


def test_in_place_change_of_an_input_raises_as_autograd_does():
    h = torch.randn(4, 8)
    recipe = _Recipe(lambda: h * 2, (h,))
    assert torch.equal(recipe.value(), h * 2)
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        recipe.value()


def test_revert_removes_the_hooks_and_switch_checks():
    torch.manual_seed(0)
    model = tiny_model("llama").to(DEVICE)
    layer = model.model.layers[0]
    before = (len(layer._forward_hooks), len(layer._forward_pre_hooks), len(layer.mlp._forward_pre_hooks))
    handle = tigon.patch(model, recompute_norms=True)
    assert any("recompute_norms" in line for line in handle.replaced)
    assert len(layer._forward_pre_hooks) == before[1] + 1
    assert tigon.patch(model, recompute_norms=True).replaced == []  # patched already: a no-op
    handle.revert()
    assert (len(layer._forward_hooks), len(layer._forward_pre_hooks), len(layer.mlp._forward_pre_hooks)) == before
    with pytest.raises(ValueError, match="rms_norm"):
        tigon.patch(model, recompute_norms=True, rms_norm=False)
    with pytest.raises(ValueError, match="exclusive"):
        tigon.patch(model, recompute_norms=True, cuda_graphs=True)


def test_saved_walker_counts_each_storage_once():
    x = torch.randn(8, 16, requires_grad=True)
    y = torch.sin(x)
    loss = (y * y).sum() + torch.cos(x).sum()  # x saved by sin and cos, y twice by the product
    result = saved_bytes(loss, [])
    assert result.total == 2 * x.numel() * 4


@pytest.mark.gpu
def test_torch_compile_falls_back_to_inductors_own_plan():
    """Under torch.compile the scope stays off (Inductor decides what to recompute): fullgraph traces
    the hooked layers and the loss matches eager recompute within bf16 rounding."""
    default, recomputing = _default_and_recompute("llama")
    eager_loss, _, _ = _step(default, autocast=True)
    compiled = torch.compile(recomputing, fullgraph=True)
    ids, labels = batch(0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = compiled(input_ids=ids, labels=labels).loss
    loss.backward()
    assert abs(loss.item() - eager_loss.item()) <= 2e-2 * abs(eager_loss.item())


@pytest.mark.parametrize("model_type", ["gemma2", "phi3"])
def test_a_no_op_for_layers_that_are_not_pre_norm(model_type):
    """Sandwich-norm layers (Gemma-2) and fused-MLP families without joins (Phi-3) keep what they save."""
    torch.manual_seed(0)
    model = tiny_model(model_type).to(DEVICE)
    handle = tigon.patch(model, recompute_norms=True)
    assert not any("recompute_norms" in line for line in handle.replaced)
    _step(model, autocast=True)


def test_nothing_outlives_the_step_without_the_garbage_collector(monkeypatch):
    """Once the backward ran and the loss is gone, no layer scope (and so no layer input or attention
    output of that step) is alive, even with the collector off: the memory the switch saves is not
    held over into the next step's forward instead."""
    import gc
    import weakref

    from tigon.patching import norm_recompute

    scopes = []
    init = norm_recompute._LayerScope.__init__

    def tracking(self, layer_input):
        init(self, layer_input)
        scopes.append(weakref.ref(self))

    monkeypatch.setattr(norm_recompute._LayerScope, "__init__", tracking)
    _, patched, _ = stock_and_patched("llama", recompute_norms=True)
    ids, labels = batch()
    gc.collect()
    gc.disable()
    try:
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            loss = patched(input_ids=ids, labels=labels).loss
        loss.backward()
        del loss
        assert len(scopes) == patched.config.num_hidden_layers
        assert all(ref() is None for ref in scopes)
    finally:
        gc.enable()
