"""tigon.patch across transformers releases: decorated forwards, renamed arguments, drop-in fidelity.

transformers 5.24 wraps the attention, decoder-layer and CausalLM forwards in ``@deprecate_kwarg``
(renaming ``past_key_values`` to ``cache``) and 5.23 put a checkpointing wrapper around every decoder
layer's forward. The patch must see through such wrappers, keep them around its own forwards, and
refuse a wrapper that hides the body it claims to wrap. CI runs this file on transformers 5.17 and on
the newest release; the decorators below are added on top of whatever the installed release has.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import pytest
import torch
from transformers.models.llama import modeling_llama

import tigon
from tests.patching.tiny import CONFIGS, assert_same_grads, batch, rel, stock_and_patched, tiny_model
from tigon.patching import decorator_chains
from tigon.patching.families import FAMILIES


def renaming(old: str, new: str):
    """A decorator in the style of transformers' ``deprecate_kwarg``: ``old=`` is taken as ``new=``."""

    def decorator(func):
        @functools.wraps(func)
        def wrapped(*args, **kwargs):
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return func(*args, **kwargs)

        return wrapped

    return decorator


def hiding(func):
    """A wrapper that names ``func`` (``functools.wraps``) but runs another body: the attention it
    stands for would not call ``apply_rotary_pos_emb`` at all."""

    @functools.wraps(func)
    def wrapped(self, hidden_states, *args, **kwargs):
        raise AssertionError("a hidden body ran")

    return wrapped


def _loss_and_grads_match(stock, patched):
    ids, labels = batch(0)
    stock.zero_grad()
    patched.zero_grad()
    want = stock(input_ids=ids, labels=labels).loss
    want.backward()
    got = patched(input_ids=ids, labels=labels).loss
    got.backward()
    assert torch.allclose(got, want, rtol=1e-5, atol=0), (got.item(), want.item())
    assert_same_grads(patched, stock)


# ------------------------------------------------------------------------------------------- wrappers


def test_wrapper_chain_and_rewrapped():
    def body(x, scale=2):
        return x * scale

    outer = renaming("k", "factor")(renaming("factor", "scale")(body))
    chain = decorator_chains.wrapper_chain(outer)
    assert chain[-1] is body and len(chain) == 3
    assert decorator_chains.body(outer) is body

    def other(x, scale=2):
        return x + scale

    copy = decorator_chains.rewrapped(outer, other)
    assert decorator_chains.body(copy) is other
    assert copy(1, k=5) == 6 and outer(1, k=5) == 5  # both renamings still apply around the new body
    assert decorator_chains.rewrapped(outer, other, skip_outer=1)(1, factor=3) == 4


def test_hidden_body_is_a_wrapper_mismatch():
    def body(x):
        return x

    with pytest.raises(decorator_chains.WrapperMismatch, match="does not call it"):
        decorator_chains.wrapper_chain(hiding(body))


def test_bind_is_signature_bind():
    def forward(self, a, b=2, *, c=3, **kwargs):
        return None

    positional, defaults = decorator_chains.named_parameters(forward, skip=1)
    assert positional == ("a", "b") and defaults == {"b": 2, "c": 3}
    assert decorator_chains.bind(positional, defaults, (1,), {"d": 4}) == {"a": 1, "b": 2, "c": 3, "d": 4}
    with pytest.raises(TypeError, match="multiple values"):
        decorator_chains.bind(positional, defaults, (1,), {"a": 1})
    with pytest.raises(TypeError, match="positional"):
        decorator_chains.bind(positional, defaults, (1, 2, 3), {})


# ------------------------------------------------------------------------------ decorated forwards


@pytest.fixture
def decorated_llama(monkeypatch):
    """Llama's attention, decoder layer and CausalLM forwards under one more ``deprecate_kwarg``-style
    decorator each (on top of the installed release's own)."""
    for cls in (modeling_llama.LlamaAttention, modeling_llama.LlamaDecoderLayer, modeling_llama.LlamaForCausalLM):
        monkeypatch.setattr(cls, "forward", renaming("legacy_cache", _cache_name(cls))(cls.forward))


def _cache_name(cls) -> str:
    params = inspect.signature(decorator_chains.body(cls.forward)).parameters
    return "cache" if "cache" in params else "past_key_values"


def test_decorated_forwards_patch_exactly(decorated_llama):
    stock, patched, handle = stock_and_patched("llama")
    assert any("DecoderLayer" in line for line in handle.replaced)  # the joins too, not only the norms
    _loss_and_grads_match(stock, patched)
    # The decorators still stand around tigon's forwards: the old keyword reaches the cache argument.
    ids, labels = batch(1)
    with torch.no_grad():
        patched.eval()
        stock.eval()
        got = patched(input_ids=ids, legacy_cache=None).logits
        want = stock(input_ids=ids, legacy_cache=None).logits
    assert rel(got, want) <= 1e-5
    handle.revert()


@pytest.mark.parametrize("cls_name, part", [
    ("LlamaAttention", "rope"), ("LlamaDecoderLayer", "decoder layer"), ("LlamaForCausalLM", "loss"),
])
def test_wrapper_hiding_a_changed_body_is_refused(monkeypatch, cls_name, part):
    cls = getattr(modeling_llama, cls_name)
    model = tiny_model("llama")  # built before the wrapper: the check is on the class, at patch time
    monkeypatch.setattr(cls, "forward", hiding(cls.forward))
    before = {name: id(m) for name, m in model.named_modules()}
    with pytest.raises(ValueError, match=rf"llama: {part}: .*does not call it"):
        tigon.patch(model)
    assert {name: id(m) for name, m in model.named_modules()} == before
    assert not any("forward" in vars(m) for m in model.modules())


def test_attention_without_the_rotary_call_is_refused(monkeypatch):
    def forward(self, hidden_states, *args, **kwargs):  # a release that inlined the rotation, say
        return hidden_states, None

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", forward)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"llama: rope: LlamaAttention\.forward does not call .* in transformers 5\."):
        tigon.patch(model)
    assert not any("forward" in vars(m) for m in model.modules())


# --------------------------------------------------------------------------------- drop-in fidelity


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_signatures_are_the_stock_ones(model_type):
    """Tools read ``inspect.signature(model.forward)`` to decide which keywords a model takes."""
    stock, patched, handle = stock_and_patched(model_type)
    assert inspect.signature(patched.forward) == inspect.signature(stock.forward)
    for mine, theirs in zip(patched.model.layers, stock.model.layers, strict=True):
        assert inspect.signature(mine.forward) == inspect.signature(theirs.forward)
        if hasattr(theirs, "self_attn"):  # Qwen3-Next's linear-attention layers have none
            assert inspect.signature(mine.self_attn.forward) == inspect.signature(theirs.self_attn.forward)
    handle.revert()


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_replaced_modules_keep_their_attributes(model_type):
    """Every plain attribute of a module tigon swaps reads the same on its replacement, and an epsilon
    written on it changes the computation as it changes the stock module's."""
    stock, patched, handle = stock_and_patched(model_type)
    stock_modules, patched_modules = dict(stock.named_modules()), dict(patched.named_modules())
    swapped = [name for name, m in patched_modules.items() if type(m) is not type(stock_modules[name])]
    assert swapped, "nothing was swapped"
    for name in swapped:
        for attr, value in vars(stock_modules[name]).items():
            if attr.startswith("_") or attr == "training":
                continue
            assert getattr(patched_modules[name], attr) == value, f"{name}.{attr}"
    # Change every norm's epsilon on both models, through whatever name the stock module uses.
    changed = 0
    for name in swapped:
        for attr in ("eps", "variance_epsilon"):
            if isinstance(vars(stock_modules[name]).get(attr), float):
                setattr(stock_modules[name], attr, 0.5)
                setattr(patched_modules[name], attr, 0.5)
                changed += 1
    if FAMILIES[model_type].norm is not None or FAMILIES[model_type].layer_norm is not None:
        assert changed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _loss_and_grads_match(stock, patched)
    handle.revert()


def test_gemma2_norm_eps_is_writable():
    """``tigon.nn.RMSNorm.eps`` was read-only; Gemma-2's own norm stores a plain ``eps``."""
    _, patched, handle = stock_and_patched("gemma2")
    patched.model.norm.eps = 1e-5
    assert patched.model.norm.eps == patched.model.norm.variance_epsilon == 1e-5
    handle.revert()
