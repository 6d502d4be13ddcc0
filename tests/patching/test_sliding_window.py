"""Sliding-window layers attend over their band in row blocks (src/tigon/patching/band_attention.py):
the same outputs and gradients as the dense sdpa call, the guards that keep the dense call, and the
mark that patch and revert set and remove.

The band path engages at ``min_blocks`` blocks of ``block_rows`` queries; the tests shrink the blocks
to a few rows (the frozen config swapped for the test) so that tiny sequences take it.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import transformers
from transformers.masking_utils import or_masks, sdpa_mask, sliding_window_causal_mask_function
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import tigon
from tests.helpers import DEVICE
from tests.patching.tiny import VOCAB, assert_same_grads, rel, tiny_config
from tigon.patching import band_attention

BLOCK = 8


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(band_attention, "CONFIG", band_attention.BandConfig(block_rows=BLOCK, min_blocks=2))


class _Attention(torch.nn.Module):
    """What transformers' sdpa function reads from an attention module."""

    def __init__(self, config, groups):
        super().__init__()
        self.config, self.num_key_value_groups, self.is_causal = config, groups, True


class _Config:
    pass


class _Counting:
    def __init__(self, original):
        self.original, self.calls = original, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.original(*args, **kwargs)


def _qkv(batch, heads, kv_heads, length, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads, length, dim), (batch, kv_heads, length, dim), (batch, kv_heads, length, dim))
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(DEVICE, dtype).requires_grad_() for s in shapes]


def _mask(batch, length, window, padding=None, or_function=None):
    function = sliding_window_causal_mask_function(window)
    if or_function is not None:
        function = or_masks(function, or_function)
    return sdpa_mask(batch_size=batch, q_length=length, kv_length=length, mask_function=function,
                     attention_mask=padding, allow_is_causal_skip=False, local_size=window, device=DEVICE)


@pytest.fixture
def marked():
    config = _Config()
    change = band_attention.MarkConfig(config)
    change.apply()
    yield config
    change.undo()


def _run(function, module, q, k, v, mask, window):
    out, _ = function(module, q, k, v, mask, dropout=0.0, scaling=q.shape[-1] ** -0.5, sliding_window=window)
    return out


@pytest.mark.parametrize("length, window", [(37, 5), (40, 8), (29, 13)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_band_matches_the_dense_call(small_blocks, marked, length, window, dtype):
    """Outputs and the gradients of q, k and v against transformers' sdpa on the dense mask, with
    left padding in one row of the batch, GQA (4 query heads on 2 key/value heads), odd lengths."""
    wrapper = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert getattr(wrapper, "_tigon", False)
    original = _Counting(getattr(wrapper, band_attention._ORIGINAL_KEY))
    module = _Attention(marked, groups=2)
    padding = torch.ones(2, length, dtype=torch.bool, device=DEVICE)
    padding[1, :3] = False
    mask = _mask(2, length, window, padding)
    q, k, v = _qkv(2, 4, 2, length, 8, dtype)
    dense = _run(original, module, q, k, v, mask, window)
    grad = torch.randn(dense.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(dense)
    want = torch.autograd.grad(dense, (q, k, v), grad)
    original.calls = 0
    sliding_window_wrapper = band_attention._wrap(original)
    band = _run(sliding_window_wrapper, module, q, k, v, mask, window)
    got = torch.autograd.grad(band, (q, k, v), grad)
    assert original.calls == -(-length // BLOCK)  # one sdpa call a row block
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    valid = ~torch.isnan(dense)
    assert torch.equal(valid, ~torch.isnan(band))
    assert rel(band[valid], dense[valid]) <= tolerance
    for name, g, w in zip("qkv", got, want, strict=True):
        assert rel(g, w) <= tolerance, name


def test_a_pattern_beyond_the_band_keeps_the_dense_call(small_blocks, marked):
    """An or-mask (a bidirectional block longer than the window) reaches outside the rectangles."""
    length, window = 40, 4
    reach = lambda b, h, q, kv: (q < 20) & (kv < 20)  # noqa: E731
    mask = _mask(1, length, window, or_function=reach)
    original = _Counting(getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], band_attention._ORIGINAL_KEY))
    q, k, v = _qkv(1, 4, 2, length, 8, torch.float64)
    out = _run(band_attention._wrap(original), _Attention(marked, 2), q, k, v, mask, window)
    assert original.calls == 1
    want = _run(original, _Attention(marked, 2), q, k, v, mask, window)
    assert torch.equal(out, want)


@pytest.mark.parametrize("case", ["unmarked", "no window", "short", "dropout", "float mask", "decoding"])
def test_guards_keep_the_dense_call(small_blocks, marked, case):
    length, window = 40, 4
    config = _Config() if case == "unmarked" else marked
    q, k, v = _qkv(1, 4, 2, length, 8, torch.float64)
    mask = _mask(1, length, window)
    kwargs = dict(dropout=0.0, scaling=0.3, sliding_window=window)
    if case == "no window":
        kwargs["sliding_window"] = None
    elif case == "short":
        q, k, v, mask = q[:, :, :12], k[:, :, :12], v[:, :, :12], mask[:, :, :12, :12]
    elif case == "dropout":
        kwargs["dropout"] = 0.1
    elif case == "float mask":
        mask = torch.zeros(mask.shape, dtype=torch.float64, device=DEVICE).masked_fill(~mask, float("-inf"))
    elif case == "decoding":
        q, mask = q[:, :, -1:], mask[:, :, -1:, :]
    calls = []
    band_attention._wrap(lambda *a, **kw: calls.append(a) or (None, None))(
        _Attention(config, 2), q, k, v, mask, **kwargs)
    assert len(calls) == 1 and calls[0][1] is q


def test_the_band_check_is_made_once_per_mask(small_blocks, marked, monkeypatch):
    checks = []
    wrapper = band_attention._wrap(getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], band_attention._ORIGINAL_KEY))
    real_stack = torch.stack
    monkeypatch.setattr(band_attention.torch, "stack", lambda t: checks.append(len(t)) or real_stack(t))
    q, k, v = _qkv(1, 4, 2, 40, 8, torch.float64)
    mask = _mask(1, 40, 4)
    with torch.no_grad():
        for _ in range(3):
            _run(wrapper, _Attention(marked, 2), q, k, v, mask, 4)
        assert len(checks) == 1
        mask[0, 0, 39, 0] = True  # an in-place change (version bump) is checked again, and refused
        _run(wrapper, _Attention(marked, 2), q, k, v, mask, 4)
    assert len(checks) == 2


@pytest.mark.parametrize("model_type", ["gemma3_text", "mistral"])
def test_patched_model_matches_stock(small_blocks, model_type):
    """A tiny sliding-window model with sdpa and a padded batch: loss and every gradient as stock's
    (fp32), with the band path taken in the sliding layers; revert puts transformers' function back."""
    overrides = {"sliding_window": 5, "max_position_embeddings": 128}
    if model_type == "gemma3_text":
        overrides.update(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    config = tiny_config(model_type, **overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(config).train().to(DEVICE)
    patched = copy.deepcopy(stock)
    handle = tigon.patch(patched)
    assert any("row blocks of the band" in line for line in handle.replaced)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 41), generator=gen).to(DEVICE)
    padding = torch.ones(ids.shape, dtype=torch.long, device=DEVICE)
    padding[0, :4] = 0
    labels = ids.masked_fill(padding == 0, -100)
    installed = ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"]
    original = _Counting(getattr(installed, band_attention._ORIGINAL_KEY))
    ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = band_attention._wrap(original)  # the same, counting
    try:
        loss = patched(input_ids=ids, attention_mask=padding, labels=labels).loss
    finally:
        ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = installed
    sliding = sum(1 for t in getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
                  if t == "sliding_attention")
    full = config.num_hidden_layers - sliding
    assert original.calls == sliding * -(-41 // BLOCK) + full
    loss.backward()
    want = stock(input_ids=ids, attention_mask=padding, labels=labels).loss
    want.backward()
    assert rel(loss, want) <= 1e-5
    assert_same_grads(patched, stock, 1e-5)
    handle.revert()
    # models other tests patched and dropped without a revert keep their marks until they are collected
    gc.collect()
    assert not getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "_tigon", False)


def test_switch_off_and_models_without_sliding_layers_are_not_marked():
    config = tiny_config("gemma3_text", sliding_window=5)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config)
    handle = tigon.patch(model, sliding_window=False)
    assert not band_attention.marked(model.config)
    handle.revert()
    llama = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    handle = tigon.patch(llama)
    assert not band_attention.marked(llama.config)
    assert not any("band" in line for line in handle.replaced)
    handle.revert()


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("length, window", [(37, 5), (16, 3)])
def test_mask_by_rows_is_transformers_mask(small_blocks, padded, length, window):
    """The row-block mask of a marked config: the same values (and the same batch-shared layout
    without padding) as transformers' sdpa_mask; an unmarked config gets transformers' call. The causal
    skip is not allowed here, as transformers asks for a custom or packed pattern (the plain sliding mask,
    skip allowed, is a BandMask: test_linear_memory.py)."""
    from tigon.patching import causal_mask

    config = _Config()
    padding = None
    if padded:
        padding = torch.ones(3, length, dtype=torch.bool, device=DEVICE)
        padding[1, :4] = False
    kwargs = dict(batch_size=3, q_length=length, kv_length=length, q_offset=0, kv_offset=0,
                  mask_function=sliding_window_causal_mask_function(window), attention_mask=padding,
                  allow_is_causal_skip=False, local_size=window, config=config, device=DEVICE)
    want = sdpa_mask(**kwargs)
    calls = []
    counting = lambda **kw: calls.append(kw["q_length"]) or sdpa_mask(**kw)  # noqa: E731
    assert torch.equal(causal_mask._wrap(counting)(**kwargs), want) and calls == [length]
    change = causal_mask.by_rows_mark(config)
    change.apply()
    try:
        calls.clear()
        got = causal_mask._wrap(counting)(**kwargs)
    finally:
        change.undo()
    assert calls == [min(BLOCK, length - s) for s in range(0, length, BLOCK)]
    assert got.shape == want.shape and torch.equal(got, want)
    assert (got.stride(0) == 0) == (want.stride(0) == 0)


def test_a_model_collected_during_a_compile_leaves_the_wrapper_until_the_next_unmark():
    """torch.compile's guards read the registered sdpa function after tracing through it: a patched model
    collected in the middle of a compile must not swap the function back then (the guard on the wrapper's
    closure could not be built); the next unmark outside a compile registers the original again."""
    from torch._guards import CompileContext, CompileId, compile_context

    def sliding_model():
        config = tiny_config("gemma3_text", sliding_window=5)
        config._attn_implementation = "sdpa"
        return transformers.AutoModelForCausalLM.from_config(config)  # (the model holds this config)

    gc.collect()
    dropped = tigon.patch(sliding_model())  # the handle holds the model, the model its marked config
    assert getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "_tigon", False)
    with compile_context(CompileContext(CompileId(frame_id=0, frame_compile_id=0))):
        del dropped
        gc.collect()  # the model and its config go: the last mark
        assert not band_attention._WRAPPER.any_marked() and getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "_tigon", False)
    other = tigon.patch(sliding_model())
    other.revert()
    assert not getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "_tigon", False)
