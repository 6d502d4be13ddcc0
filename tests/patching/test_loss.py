"""The generic CausalLM loss path: label handling, gradient accumulation, quirks, logits, hooks."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from tests.patching.tiny import VOCAB, assert_same_grads, batch, rel, stock_and_patched

LOSS_TOLERANCE = 1e-4


def _both(stock, patched, backward=True, **kwargs):
    want = stock(**kwargs)
    got = patched(**kwargs)
    assert rel(got.loss, want.loss) <= LOSS_TOLERANCE, (got.loss, want.loss)
    if backward:
        want.loss.backward()
        got.loss.backward()
        assert_same_grads(patched, stock)
    return got, want


def test_training_with_labels_builds_no_logits_eval_and_no_labels_do():
    stock, patched, _ = stock_and_patched("llama")
    ids, labels = batch(0)
    assert patched(input_ids=ids, labels=labels).logits is None
    assert patched(input_ids=ids).logits is not None
    patched.eval()
    assert patched(input_ids=ids, labels=labels).logits is not None


def test_num_items_in_batch_is_a_sum_over_the_accumulated_batch():
    """Two micro-batches with the whole batch's item count give the full batch's loss and grads."""
    stock, patched, _ = stock_and_patched("llama")
    ids, labels = batch(0, batch_size=4, ignored=7)
    num_items = (labels[:, 1:] != -100).sum()
    total = 0.0
    for part in (slice(0, 1), slice(1, 4)):  # uneven split: a per-micro-batch mean would be wrong
        got, want = _both(stock, patched, backward=False, input_ids=ids[part], labels=labels[part],
                          num_items_in_batch=num_items)
        got.loss.backward()
        want.loss.backward()
        total = total + got.loss.detach()
    assert_same_grads(patched, stock)
    full = patched(input_ids=ids, labels=labels).loss
    assert rel(total, full) <= LOSS_TOLERANCE
    # an int works as well as a tensor
    _both(stock, patched, backward=False, input_ids=ids, labels=labels, num_items_in_batch=int(num_items))


def test_shift_labels_and_ignore_index():
    stock, patched, _ = stock_and_patched("qwen2")
    ids, labels = batch(1)
    shift = torch.roll(labels, -1, dims=1)
    shift[:, -1] = -100
    _both(stock, patched, input_ids=ids, labels=labels, shift_labels=shift)
    stock.zero_grad()
    patched.zero_grad()
    custom = labels.masked_fill(labels == -100, -1)
    custom[0, 5:] = -1
    _both(stock, patched, input_ids=ids, labels=custom, ignore_index=-1)


def test_logits_to_keep_in_training():
    stock, patched, _ = stock_and_patched("mistral")
    ids, labels = batch(2)
    keep = 5
    _both(stock, patched, input_ids=ids, labels=labels[:, -keep:], logits_to_keep=keep)


def test_return_dict_false_gives_a_tuple():
    stock, patched, _ = stock_and_patched("llama")
    ids, labels = batch(3)
    got = patched(input_ids=ids, labels=labels, return_dict=False)
    want = stock(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(got, tuple) and isinstance(want, tuple)
    assert rel(got[0], want[0]) <= LOSS_TOLERANCE
    patched.eval()
    assert isinstance(patched(input_ids=ids, return_dict=False), tuple)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_router_aux_loss(model_type):
    stock, patched, _ = stock_and_patched(model_type)
    ids, labels = batch(4)
    got, want = _both(stock, patched, input_ids=ids, labels=labels)
    assert got.aux_loss is not None and rel(got.aux_loss, want.aux_loss) <= LOSS_TOLERANCE
    assert len(got.router_logits) == len(want.router_logits)
    # switched off per call: the loss is the language-model loss alone
    no_aux, no_aux_stock = _both(stock, patched, backward=False, input_ids=ids, labels=labels,
                                 output_router_logits=False)
    assert no_aux.aux_loss is None
    assert no_aux.loss < got.loss


@pytest.mark.parametrize(("model_type", "switches"), [
    ("llama", dict(cross_entropy=True, fused_linear_cross_entropy=False)),
    ("gemma2", dict(cross_entropy=True, fused_linear_cross_entropy=False)),
    ("granite", dict(cross_entropy=True, fused_linear_cross_entropy=False)),
    ("mixtral", dict(cross_entropy=True, fused_linear_cross_entropy=False)),
    ("llama", dict(cross_entropy=True)),  # the fused linear loss, on by default, gives way
])
def test_cross_entropy_switch(model_type, switches):
    stock, patched, handle = stock_and_patched(model_type, **switches)
    assert "forward" not in vars(patched)
    ids, labels = batch(5)
    got, want = _both(stock, patched, input_ids=ids, labels=labels)
    assert got.logits is not None and rel(got.logits, want.logits) <= 1e-5
    handle.revert()
    assert "_loss_function" not in vars(patched)


def test_forward_keeps_kwargs_for_the_trainer():
    """transformers' Trainer passes num_items_in_batch only to a forward with **kwargs."""
    stock, patched, _ = stock_and_patched("llama")
    parameters = inspect.signature(patched.forward).parameters
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    # The stock names, whichever the release uses for the cache (past_key_values to 5.23, cache from 5.24).
    assert list(parameters) == list(inspect.signature(stock.forward).parameters)
    assert list(parameters)[:3] == ["input_ids", "attention_mask", "position_ids"]


def test_lm_head_weight_is_read_inside_its_own_call():
    """As FSDP2 / ZeRO-3 do: the full weight exists only between lm_head's pre- and post-forward hooks."""
    stock, patched, _ = stock_and_patched("llama")
    head = patched.lm_head
    full = head.weight
    placeholder = nn.Parameter(torch.empty(0, device=full.device))
    calls = []

    def gather(module, args, kwargs):
        calls.append("gather")
        module.weight = full

    def release(module, args, kwargs, output):
        calls.append("release")
        module.weight = placeholder

    head.weight = placeholder
    head.register_forward_pre_hook(gather, with_kwargs=True)
    head.register_forward_hook(release, with_kwargs=True)
    ids, labels = batch(6)
    want = stock(input_ids=ids, labels=labels)
    got = patched(input_ids=ids, labels=labels)
    assert calls == ["gather", "release"]
    assert rel(got.loss, want.loss) <= LOSS_TOLERANCE
    want.loss.backward()
    got.loss.backward()
    assert rel(full.grad, stock.lm_head.weight.grad) <= 1e-4


def test_replaced_lm_head_falls_back_to_the_stock_loss():
    stock, patched, _ = stock_and_patched("llama")
    for model in (stock, patched):
        model.resize_token_embeddings(VOCAB + 8)
    ids, labels = batch(7)
    with pytest.warns(UserWarning, match="lm_head"):
        got = patched(input_ids=ids, labels=labels)
    assert rel(got.loss, stock(input_ids=ids, labels=labels).loss) <= LOSS_TOLERANCE


def test_generate_matches_stock():
    stock, patched, _ = stock_and_patched("qwen3")
    stock.eval()
    patched.eval()
    ids, _ = batch(8, batch_size=1, seq=5)
    with torch.no_grad():
        want = stock.generate(ids, max_new_tokens=4, do_sample=False)
        got = patched.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


def test_gradient_checkpointing():
    stock, patched, _ = stock_and_patched("gemma")
    for model in (stock, patched):
        model.gradient_checkpointing_enable()
    ids, labels = batch(9)
    _both(stock, patched, input_ids=ids, labels=labels)


@pytest.mark.parametrize(("model_type", "switches"), [
    ("llama", {}), ("llama", {"cross_entropy": True}),  # both loss paths
    ("gemma2", {}), ("granite", {}),  # softcapped, scaled logits
])
def test_every_label_ignored_gives_the_stock_loss_and_gradients(model_type, switches):
    """A batch whose labels are all -100: stock's mean over no items is NaN (0/0), and so is a sum divided by
    a zero ``num_items_in_batch`` (as a tensor, as the Trainer passes it, or an int); a non-zero count gives
    0. The gradients are stock's zeros in every case (torch gives an ignored position no gradient)."""
    stock, patched, _ = stock_and_patched(model_type, **switches)
    ids, labels = batch(0)
    labels[:] = -100
    for extra in ({}, {"num_items_in_batch": torch.tensor(0)}, {"num_items_in_batch": 0},
                  {"num_items_in_batch": torch.tensor(5)}):
        stock.zero_grad(set_to_none=True)
        patched.zero_grad(set_to_none=True)
        want = stock(input_ids=ids, labels=labels, **extra).loss
        got = patched(input_ids=ids, labels=labels, **extra).loss
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"{extra}: {got} != {want}")
        want.backward()
        got.backward()
        stock_grads = {name: p.grad for name, p in stock.named_parameters() if p.grad is not None}
        patched_grads = {name: p.grad for name, p in patched.named_parameters() if p.grad is not None}
        assert stock_grads.keys() == patched_grads.keys()
        for name, grad in stock_grads.items():
            assert torch.equal(patched_grads[name], grad), (extra, name)
