"""Under torch.compile a patched model's sdpa attention runs causal without a dense mask exactly where
eager mode does (src/tigon/patching/causal_mask.py): the rule, its guards, the mark that patch and
revert set and remove, and a compiled patched model that attends causally with the eager loss.

Compilation uses the ``eager`` backend, so the CPU runs it: the decision is made while Dynamo traces,
before any backend sees the graph.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import tigon
from tests.helpers import DEVICE
from tests.patching.tiny import SEQ, VOCAB, tiny_config, tiny_model
from tigon.bench.models import build_model
from tigon.patching import causal_mask


class _Spy:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return "dense mask"


class _Config:
    pass


def _kwargs(config, **over):
    kwargs = dict(batch_size=2, q_length=SEQ, kv_length=SEQ, q_offset=0, kv_offset=0, attention_mask=None,
                  allow_is_causal_skip=True, local_size=None, config=config)
    kwargs.update(over)
    return kwargs


@pytest.fixture
def marked_config():
    config = _Config()
    change = causal_mask.MarkConfig(config)
    change.apply()
    yield config
    change.undo()


@pytest.mark.parametrize(
    "over, skipped",
    [
        ({}, True),
        ({"q_length": 1, "kv_length": 40, "q_offset": 39}, True),  # one query, a cache: not causal
        ({"q_length": 4, "kv_length": 40, "q_offset": 0}, True),  # empty cache: upper-left causal
        ({"local_size": SEQ + 1}, True),  # a sliding window longer than the keys
        ({"local_size": SEQ}, False),  # the window cuts the keys: the mask has a band
        ({"attention_mask": torch.ones(2, SEQ, dtype=torch.bool)}, False),  # padding not checkable
        ({"allow_is_causal_skip": False}, False),  # packed sequences, custom masks, compiled decoding
        ({"q_length": 4, "kv_length": 40, "q_offset": 36}, False),  # chunked prefill into a cache
        ({"q_length": 4, "kv_length": 40, "q_offset": torch.tensor(0)}, False),  # static cache offset
    ],
)
def test_rule_under_compile(monkeypatch, marked_config, over, skipped):
    spy = _Spy()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = causal_mask._wrap(spy)(**_kwargs(marked_config, **over))
    assert (got is None, spy.calls) == ((True, 0) if skipped else (False, 1))


def test_transformers_decides_outside_compile_and_for_unmarked_configs(monkeypatch, marked_config):
    spy = _Spy()
    wrapped = causal_mask._wrap(spy)
    assert wrapped(**_kwargs(marked_config)) == "dense mask"  # eager: transformers' own rule
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert wrapped(**_kwargs(_Config())) == "dense mask"  # not a patched model
    assert wrapped(2, SEQ, SEQ, config=marked_config) == "dense mask"  # positional call: not ours to read
    assert spy.calls == 3


def test_patch_marks_and_revert_unmarks_without_touching_the_config():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    gc.collect()  # models of earlier tests, patched and dropped, unmark their configs
    stock_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    stock_mask = getattr(stock_mask, causal_mask._ORIGINAL_KEY, stock_mask)
    model = tiny_model("llama")
    before = model.config.to_dict()
    patch = tigon.patch(model)
    assert getattr(ALL_MASK_ATTENTION_FUNCTIONS["sdpa"], "_tigon", False)
    assert causal_mask.marked(model.config)
    assert model.config.to_dict() == before  # nothing written into the config (or its saved JSON)
    again = tigon.patch(model)  # already patched: a no-op that must not take the mark on revert
    again.revert()
    assert causal_mask.marked(model.config)
    patch.revert()
    assert not causal_mask.marked(model.config)
    assert not causal_mask.marked(tiny_model("llama").config)
    if not causal_mask._MARKED:  # no other patched model alive: revert restores exactly what was there
        assert ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is stock_mask


def test_rope_switch_off_leaves_the_mask_alone():
    model = tiny_model("llama")
    with tigon.patch(model, rope=False):
        assert not causal_mask.marked(model.config)


def test_class_patch_marks_models_built_afterwards():
    with tigon.patch("llama"):
        model = tiny_model("llama")
        assert causal_mask.marked(model.config)


def _sdpa_model(model_type):
    """The tiny model with sdpa attention (the tiny configs default to eager); Gemma-2 without its
    attention-logit softcap, which transformers' sdpa path cannot apply (as in the e2e benchmark)."""
    overrides = {"attn_logit_softcapping": None} if model_type == "gemma2" else {}
    return build_model(tiny_config(model_type, **overrides), device=DEVICE)


def _compiled_attention_calls(monkeypatch, model, ids, backend):
    """Loss of a compiled forward, and (mask is None, is_causal) of each sdpa call Dynamo traced."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(*args, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal))
        return sdpa(*args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    torch._dynamo.reset()
    try:
        loss = torch.compile(model, backend=backend, fullgraph=True)(input_ids=ids, labels=ids).loss
    finally:
        torch._dynamo.reset()
    return loss, calls


def _expected_calls(model):
    """Causal sdpa without a mask on every layer, except sliding layers whose window (8) is shorter
    than the 12 tokens: those keep their banded mask, as in eager mode."""
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    return [(False, False) if t == "sliding_attention" else (True, True) for t in types]


@pytest.mark.parametrize("model_type", ("llama", "gemma2"))
def test_compiled_marked_model_runs_causal_sdpa(monkeypatch, model_type):
    """The mask decision alone (the model otherwise stock: tigon's kernels need a GPU to compile)."""
    torch.manual_seed(0)
    model = _sdpa_model(model_type)
    ids = torch.randint(3, VOCAB, (2, SEQ), device=DEVICE)
    eager_loss = model(input_ids=ids, labels=ids).loss
    change = causal_mask.MarkConfig(model.config)
    change.apply()
    try:
        assert causal_mask.marked(model.config)
        loss, calls = _compiled_attention_calls(monkeypatch, model, ids, "eager")
    finally:
        change.undo()
    assert calls == _expected_calls(model)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ("llama", "qwen2", "gemma2"))
def test_compiled_patched_model_runs_causal_sdpa(monkeypatch, model_type):
    """The whole patch under torch.compile (inductor), bf16 autocast: causal sdpa, the eager loss."""
    torch.manual_seed(0)
    model = _sdpa_model(model_type)
    tigon.patch(model)
    ids = torch.randint(3, VOCAB, (2, SEQ), device=DEVICE)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager_loss = model(input_ids=ids, labels=ids).loss
        loss, calls = _compiled_attention_calls(monkeypatch, model, ids, "inductor")
    assert calls == _expected_calls(model)
    torch.testing.assert_close(loss, eager_loss, rtol=2e-2, atol=2e-2)
