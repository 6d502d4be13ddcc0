"""tigon.nn.RMSNorm and tigon.nn.LayerNorm against the modules they replace.

A drop-in must init like the original, expose the same state_dict keys (checkpoints load
unchanged), and compute what the original computes once a checkpoint is loaded.
"""

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tests.helpers import DEVICE, DTYPES, assert_close, randn
from tigon.nn.norm import LayerNorm, RMSNorm


def _random_params(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module


def _check_same(ours, theirs, x, dtype):
    """Same output and same input/parameter gradients for one random upstream gradient."""
    x_ours = x.detach().clone().requires_grad_()
    x_theirs = x.detach().clone().requires_grad_()
    y, y_ref = ours(x_ours), theirs(x_theirs)
    assert y.dtype == y_ref.dtype
    assert_close(y, y_ref, dtype, "y")
    dy = randn(*y.shape, dtype=y.dtype)
    y.backward(dy)
    y_ref.backward(dy)
    assert_close(x_ours.grad, x_theirs.grad, dtype, "dx")
    for (name, p), (_, p_ref) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert p.grad.dtype == p_ref.grad.dtype
        assert_close(p.grad, p_ref.grad, dtype, f"d{name}")


# --------------------------------------------------------------------------------------------- RMSNorm


def test_rms_norm_init_and_state_dict():
    llama = RMSNorm(48)
    assert torch.equal(llama.weight, torch.ones(48))
    gemma = RMSNorm(48, offset=1.0, casting="gemma")
    assert torch.equal(gemma.weight, torch.zeros(48))
    assert list(llama.state_dict()) == list(LlamaRMSNorm(48).state_dict()) == ["weight"]
    assert list(gemma.state_dict()) == list(GemmaRMSNorm(48).state_dict())
    assert llama.eps == llama.variance_epsilon == 1e-6
    assert RMSNorm(8, 1e-5, dtype=torch.bfloat16).weight.dtype == torch.bfloat16


def test_rms_norm_bad_casting():
    with pytest.raises(ValueError, match="casting"):
        RMSNorm(8, casting="t5")


@pytest.mark.parametrize("module", [RMSNorm, LayerNorm])
def test_input_width_is_named(module):
    """An input of the wrong width is the input's fault: the message names it and hidden_size."""
    with pytest.raises(ValueError, match="hidden_states has last dim 9 .*does not match hidden_size 8"):
        module(8).to(DEVICE)(randn(2, 3, 9))


@pytest.mark.parametrize("module", [RMSNorm, LayerNorm])
def test_bad_constructor_arguments(module):
    with pytest.raises(TypeError, match="hidden_size"):
        module("8")
    with pytest.raises(ValueError, match="hidden_size"):
        module(0)
    with pytest.raises(TypeError, match="eps"):
        module(8, "1e-6")
    with pytest.raises(ValueError, match="eps"):
        module(8, float("nan"))
    if module is RMSNorm:
        with pytest.raises(TypeError, match="offset"):
            module(8, offset="1.0")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_llama(dtype):
    theirs = _random_params(LlamaRMSNorm(160, eps=1e-5)).to(DEVICE, dtype)
    ours = RMSNorm(160, eps=1e-5).to(DEVICE, dtype)
    ours.load_state_dict(theirs.state_dict())
    _check_same(ours, theirs, randn(2, 7, 160, dtype=dtype), dtype)


def test_rms_norm_matches_llama_fp32_weight_bf16_input():
    """Mixed precision as transformers runs it: the fp32 weight promotes the output to fp32."""
    theirs = _random_params(LlamaRMSNorm(96)).to(DEVICE)
    ours = RMSNorm(96).to(DEVICE)
    ours.load_state_dict(theirs.state_dict())
    _check_same(ours, theirs, randn(5, 96, dtype=torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_gemma(dtype):
    theirs = _random_params(GemmaRMSNorm(160)).to(DEVICE, dtype)
    ours = RMSNorm(160, offset=1.0, casting="gemma").to(DEVICE, dtype)
    ours.load_state_dict(theirs.state_dict())
    _check_same(ours, theirs, randn(3, 160, dtype=dtype), dtype)


# ------------------------------------------------------------------------------------------- LayerNorm


@pytest.mark.parametrize("bias", (True, False))
def test_layer_norm_init_and_state_dict(bias):
    ours, theirs = LayerNorm(48, bias=bias), torch.nn.LayerNorm(48, bias=bias)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert torch.equal(ours.weight, theirs.weight)
    if bias:
        assert torch.equal(ours.bias, theirs.bias)
    else:
        assert ours.bias is None
    assert ours.normalized_shape == theirs.normalized_shape and ours.eps == theirs.eps == 1e-5
    assert LayerNorm(8, dtype=torch.float16).weight.dtype == torch.float16


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", (True, False))
def test_layer_norm_matches_torch(dtype, bias):
    theirs = _random_params(torch.nn.LayerNorm(200, eps=1e-6, bias=bias)).to(DEVICE, dtype)
    ours = LayerNorm(200, eps=1e-6, bias=bias).to(DEVICE, dtype)
    ours.load_state_dict(theirs.state_dict())
    _check_same(ours, theirs, randn(2, 5, 200, dtype=dtype), dtype)


@pytest.mark.parametrize("casting,offset", (("llama", 0.0), ("gemma", 1.0)))
def test_rms_norm_autocast_output(casting, offset):
    """With ``autocast_output`` the module gives, under autocast, the autocast copy a linear would
    make of its output (bitwise), and outside autocast exactly what it gives without the flag."""
    norm = RMSNorm(64, 1e-6, offset=offset, casting=casting).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(randn(64))
    flagged = RMSNorm(64, 1e-6, offset=offset, casting=casting).to(DEVICE)
    flagged.load_state_dict(norm.state_dict())
    flagged.autocast_output = True
    x = randn(3, 5, 64)
    assert torch.equal(flagged(x), norm(x)) and flagged(x).dtype == torch.float32
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        got, plain = flagged(x), norm(x)
        assert got.dtype == torch.bfloat16 and plain.dtype == torch.float32
        assert torch.equal(got, plain.to(torch.bfloat16))
