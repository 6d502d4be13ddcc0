"""``Patch.revert()`` restores what tigon replaced and leaves what others installed after the patch; where that
cannot be done (something installed since wraps tigon's) it raises ValueError and changes nothing (API.md)."""

from __future__ import annotations

import functools

import pytest
from torch import nn

import tigon
from tests.patching.tiny import batch, rel, stock_and_patched
from tigon.nn.norm import RMSNorm


def _tigon_parts(model):
    """What a patch put in the model: the instance forwards and attributes, and the classes of the modules."""
    return [(name, type(module), dict(vars(module).get("_forward_hooks", {})),
             {k: v for k, v in vars(module).items() if k in ("forward", "_apply_gate") or k.startswith("_tigon")})
            for name, module in model.named_modules()]


def test_trl_fused_head_added_after_the_patch_blocks_revert_and_nothing_changes():
    from trl.trainer.utils import add_fused_lm_head

    stock, patched, handle = stock_and_patched("llama")
    add_fused_lm_head(patched)
    before = _tigon_parts(patched)
    with pytest.raises(ValueError, match="add_fused_lm_head.*nothing was reverted"):
        handle.revert()
    assert _tigon_parts(patched) == before and handle.active
    ids, labels = batch(0)
    got = patched(input_ids=ids, labels=labels, fused_lm_head=True)
    want = stock(input_ids=ids, labels=labels)
    assert rel(got.loss, want.loss) <= 1e-4  # TRL's head over tigon's model computes stock's loss
    assert patched(input_ids=ids, labels=labels).logits is None  # tigon's forward runs beneath TRL's


def test_a_wrapper_of_tigons_forward_blocks_revert_until_it_is_removed():
    _, patched, handle = stock_and_patched("llama")
    tigon_forward = patched.forward

    def wrapper(inner, *args, **kwargs):
        return inner(*args, **kwargs)

    patched.forward = functools.partial(wrapper, tigon_forward)
    with pytest.raises(ValueError, match="LlamaForCausalLM.forward was replaced after the patch"):
        handle.revert()
    assert isinstance(patched.model.norm, RMSNorm)  # nothing was undone
    patched.forward = tigon_forward
    handle.revert()
    assert "forward" not in vars(patched) and not isinstance(patched.model.norm, RMSNorm)


def test_what_others_installed_after_the_patch_stays():
    """A forward that does not call tigon's and hooks (on the model, on modules tigon swapped) stay and run after
    revert; what tigon replaced is stock again."""
    stock, patched, handle = stock_and_patched("llama")
    calls = []
    patched.model.layers[0].input_layernorm.register_forward_pre_hook(lambda m, args: calls.append("pre-hook"))
    patched.model.norm.register_forward_hook(lambda m, args, out: calls.append("norm"))
    patched.register_forward_hook(lambda m, args, out: calls.append("model"))

    def own_forward(hidden_states):  # nn.Linear's forward, not tigon's
        calls.append("own forward")
        return nn.Linear.forward(patched.lm_head, hidden_states)

    patched.lm_head.forward = own_forward
    handle.revert()
    assert patched.lm_head.forward is own_forward and "forward" not in vars(patched)
    ids, labels = batch(0)
    got = patched(input_ids=ids, labels=labels)
    assert calls == ["pre-hook", "norm", "own forward", "model"]
    assert rel(got.loss, stock(input_ids=ids, labels=labels).loss) == 0.0


def test_a_hook_registered_before_the_patch_runs_on_tigons_module():
    _, patched, handle = stock_and_patched("llama", rms_norm=False)
    norm = patched.model.norm
    calls = []
    norm.register_forward_hook(lambda m, args, out: calls.append(type(m).__name__))
    later = tigon.patch(patched)
    patched(input_ids=batch(0)[0])
    later.revert()
    handle.revert()
    patched(input_ids=batch(0)[0])
    assert calls == ["RMSNorm", "LlamaRMSNorm"]


def test_a_later_patch_that_wraps_an_earlier_one_is_reverted_first():
    _, patched, first = stock_and_patched("llama")
    second = tigon.patch(patched, cuda_graphs=True)  # wraps the joined layers' forwards
    with pytest.raises(ValueError, match="revert the later patch"):
        first.revert()
    second.revert()
    first.revert()
    assert all("forward" not in vars(m) for m in patched.modules())


def test_a_module_wrapping_tigons_module_blocks_revert():
    _, patched, handle = stock_and_patched("llama")

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    patched.model.norm = Wrapper(patched.model.norm)
    with pytest.raises(ValueError, match="LlamaModel.norm was replaced after the patch by a Wrapper"):
        handle.revert()
    assert isinstance(patched.model.layers[0].input_layernorm, RMSNorm)
