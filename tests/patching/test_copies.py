"""A patched model is an ordinary module to pickle, torch.save/torch.load and copy.deepcopy: each copy is
patched as the original is and trains exactly as it does (API.md).

The copy runs the very functions the original runs (each instance forward is rebuilt from its recipe, and a
recipe is built once a process), its config carries the original's marks (causal masks, sliding-window
band), and the original's ``Patch`` still reverts the original alone.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from tests.patching.tiny import assert_grads_close, rel, stock_and_patched, train
from tests.patching.tiny_vlm import assert_vlm_grads_close, stock_and_patched_vlm, vlm_batch
from tigon.patching import band_attention as sliding_window
from tigon.patching import causal_mask
from tigon.patching.instance_methods import InstanceMethod
from tigon.patching.layer_forward import LayerForward


def _pickled(model):
    return pickle.loads(pickle.dumps(model))


def _saved(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUND_TRIPS = {"pickle": _pickled, "torch.save": _saved, "deepcopy": copy.deepcopy}
TIGON_ATTRIBUTES = ("forward", "_apply_gate", "_loss_function")


def _functions(value):
    """What an instance attribute of tigon's runs: the bound function(s), through tigon's layer wrappers."""
    if isinstance(value, LayerForward):
        return ("layer", value.checkpoint, value.graphs is not None, *_functions(value.inner))
    if isinstance(value, InstanceMethod):
        return (value.__func__,)
    return (value,)


def _layout(model):
    """Per module: its class, and what each of tigon's instance attributes runs."""
    return [
        (name, type(module).__name__,
         sorted((attr, _functions(value)) for attr, value in vars(module).items()
                if attr in TIGON_ATTRIBUTES or attr.startswith("_tigon")
                and not isinstance(value, (bool, torch.Tensor)) and attr != "_tigon_cast_cache"))
        for name, module in model.named_modules()
    ]


def _same_tigon_attributes(copied, original):
    got, want = _layout(copied), _layout(original)
    assert [entry[:2] for entry in got] == [entry[:2] for entry in want]
    for (name, _, attributes), (_, _, wanted) in zip(got, want, strict=True):
        assert [a for a, _ in attributes] == [a for a, _ in wanted], name
        for (attr, functions), (_, wanted_functions) in zip(attributes, wanted, strict=True):
            if attr == "forward" or attr == "_apply_gate":
                assert functions == wanted_functions, (name, attr)


# Every kind of change tigon makes, each round trip covered by several of them.
CASES = [
    ("llama", {}, "pickle"),  # norms, joined layers, MLP swap, rope + shared-cast projections, loss + lm_head
    ("llama", {"recompute_norms": True}, "torch.save"),
    ("llama", {"cross_entropy": True}, "deepcopy"),
    ("llama", {"cuda_graphs": True}, "pickle"),  # the graphs' layer wrapper (eager on the CPU)
    ("mistral", {}, "deepcopy"),  # sliding-window and causal-mask marks
    ("phi3", {}, "torch.save"),  # fused gate_up MLP forward
    ("seed_oss", {}, "pickle"),  # split MLP with extras: instance forward
    ("qwen3_moe", {}, "deepcopy"),  # MoE experts: fused gate and forward
]


@pytest.mark.parametrize(("model_type", "switches", "how"), CASES)
def test_a_copy_of_a_patched_model_trains_exactly_as_the_original(model_type, switches, how):
    stock, patched, handle = stock_and_patched(model_type, **switches)
    copied = ROUND_TRIPS[how](patched)
    _same_tigon_attributes(copied, patched)
    for marked in (causal_mask.marked, sliding_window.marked):
        assert marked(copied.config) == marked(patched.config)
    want_losses, want_grads = train(stock, 2)
    got_losses, got_grads = train(patched, 2)
    copy_losses, copy_grads = train(copied, 2)
    assert copy_losses == got_losses
    assert copy_grads.keys() == got_grads.keys()
    assert all(torch.equal(copy_grads[name], grad) for name, grad in got_grads.items())
    assert all(rel(torch.tensor(g), torch.tensor(w)) <= 1e-4 for g, w in zip(got_losses, want_losses, strict=True))
    assert_grads_close(got_grads, want_grads)


def test_every_round_trip_and_the_original_patch_reverts_the_original_alone():
    _, patched, handle = stock_and_patched("mistral")
    copies = [round_trip(patched) for round_trip in ROUND_TRIPS.values()]
    handle.revert()
    assert "forward" not in vars(patched) and not sliding_window.marked(patched.config)
    for copied in copies:
        assert isinstance(vars(copied)["forward"], InstanceMethod)
        assert sliding_window.marked(copied.config) and causal_mask.marked(copied.config)
        _same_tigon_attributes(copied, copies[0])


def test_a_copy_of_a_patched_vision_language_model_trains_as_the_original():
    """Vision attention (tigon's rotary, packed segments), vision joins and projections, the text side and
    the ForConditionalGeneration's loss."""
    stock, patched, _ = stock_and_patched_vlm("qwen2_5_vl")
    copied = _saved(patched)
    _same_tigon_attributes(copied, patched)
    inputs = vlm_batch("qwen2_5_vl", stock.config)
    results = []
    for model in (stock, patched, copied):
        loss = model(**inputs).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (want, want_grads), (got, got_grads), (again, copy_grads) = results
    assert torch.equal(again, got)
    assert all(torch.equal(copy_grads[name], grad) for name, grad in got_grads.items())
    assert rel(got, want) <= 1e-4
    assert_vlm_grads_close(got_grads, want_grads)
