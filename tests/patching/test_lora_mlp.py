"""tigon.patch on a PEFT LoRA model: the MLPs run their adapters inside tigon's node, and training equals
stock PEFT's (losses, adapter gradients), patched before or after ``get_peft_model``; a trained, patched
model merges (``merge_and_unload``) into a transformers model whose forward is the PEFT model's."""

import copy

import pytest
import torch
from torch import nn

import tigon
from tests.helpers import DEVICE, node_names
from tests.patching.tiny import assert_grads_close, batch, rel, tiny_model, train
from tigon.nn import SwiGLUMLP

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora(model, **kwargs):
    torch.manual_seed(1)  # the adapters' init: the same draw for stock and patched
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, **kwargs)
    return peft.get_peft_model(model, config)


def mlps(model):
    return [m for m in model.modules() if isinstance(m, SwiGLUMLP)]


@pytest.mark.parametrize("order", ["patch_after_wrap", "patch_before_wrap"])
def test_lora_training_matches_peft(order):
    """Three AdamW steps on the adapters: losses and the first step's adapter gradients equal stock PEFT's,
    the MLPs' adapters inside tigon's node."""
    torch.manual_seed(0)
    base = tiny_model("llama").to(DEVICE)
    stock = lora(copy.deepcopy(base))
    if order == "patch_after_wrap":
        patched = lora(base)
        handle = tigon.patch(patched)
    else:
        handle = tigon.patch(base)
        patched = lora(base)
    assert len(mlps(patched)) == 2 and all(m.unfused_reason() is None for m in mlps(patched))
    assert all(type(m.gate_proj).__name__ == "Linear" and hasattr(m.gate_proj, "lora_A") for m in mlps(patched))
    ids, labels = batch(9)
    assert "_LoraGatedMLPFunctionBackward" in node_names(patched(input_ids=ids, labels=labels).loss)

    losses_stock, grads_stock = train(stock, 3)
    losses, grads = train(patched, 3)
    assert grads.keys() == grads_stock.keys() and all("lora_" in n for n in grads)
    assert_grads_close(grads, grads_stock)
    for got, want in zip(losses, losses_stock, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    handle.revert()
    assert not mlps(patched)


def test_merge_and_unload_of_patched_trained_model():
    """``merge_and_unload()`` of the patched, trained PeftModel is the transformers model (LlamaForCausalLM)
    with the adapters merged into its base weights, a stock checkpoint's state_dict keys, and forward equal
    to the PEFT model's: nothing of tigon or PEFT is left in it (merging reverts the patch of a patched
    PeftModel, handing the merged projections back to transformers' modules); reverting the handle after
    that changes nothing."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    patched = lora(tiny_model("llama").to(DEVICE))
    handle = tigon.patch(patched)
    train(patched, 2)
    patched.eval()
    ids, _ = batch(4)
    with torch.no_grad():
        want = patched(input_ids=ids).logits
    merged = patched.merge_and_unload()
    assert type(merged) is LlamaForCausalLM
    assert all(type(m.gate_proj) is nn.Linear for m in mlps(merged))
    assert merged.state_dict().keys() == tiny_model("llama").state_dict().keys()  # a stock checkpoint's keys
    with torch.no_grad():
        assert rel(merged(input_ids=ids).logits, want) <= 1e-5
    modules = {type(m).__module__.split(".")[0] for m in merged.modules()}
    assert modules == {"transformers", "torch"}
    handle.revert()
    assert modules == {"transformers", "torch"}
    with torch.no_grad():
        assert rel(merged(input_ids=ids).logits, want) <= 1e-5


def test_lora_with_dropout_keeps_peft_forward():
    """Adapters with dropout keep PEFT's forward in training (the MLP says why) and match stock PEFT from
    one seed; in eval mode (dropout off) the node runs them."""
    torch.manual_seed(0)
    base = tiny_model("llama").to(DEVICE)
    stock = lora(copy.deepcopy(base), lora_dropout=0.1)
    patched = lora(base, lora_dropout=0.1)
    tigon.patch(patched)
    assert {m.unfused_reason() for m in mlps(patched)} == {"gate_proj: dropout 0.1"}
    torch.manual_seed(7)
    losses_stock, grads_stock = train(stock, 1)
    torch.manual_seed(7)
    losses, grads = train(patched, 1)
    assert abs(losses[0] - losses_stock[0]) <= 1e-5 * abs(losses_stock[0])
    assert_grads_close(grads, grads_stock)
    patched.eval()
    assert {m.unfused_reason() for m in mlps(patched)} == {None}
