"""tigon.nn.tiled_mlp: the MLP over chunks of tokens gives the untiled values and gradients, saves only
its input, reaches every parameter's gradient through autograd, and replays the forward's random draws."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP

from tests.helpers import TOLERANCE, noncontiguous, stride0_like
from tests.patching.tiny import rel
from tigon.nn.tiled_mlp import TiledForward, TiledMLPConfig, tiled

HIDDEN, INTERMEDIATE = 24, 40  # odd-ish sizes; 3 x 11 = 33 tokens in chunks of 7: the last chunk is short


def _mlp(bias=False):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, mlp_bias=bias,
                         num_attention_heads=4, num_key_value_heads=2)
    mlp = LlamaMLP(config)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.2)
    return mlp


def _run(mlp, x, grad_out, fn):
    x = x.detach().clone().requires_grad_()
    mlp.zero_grad(set_to_none=True)
    y = fn(mlp, x)
    y.backward(grad_out)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in mlp.named_parameters()}


def _assert_close(got, want, tolerance=1e-6):
    (y, dx, dp), (want_y, want_dx, want_dp) = got, want
    assert rel(y, want_y) <= tolerance
    assert rel(dx, want_dx) <= tolerance
    assert dp.keys() == want_dp.keys()
    for name in want_dp:
        assert rel(dp[name], want_dp[name]) <= tolerance, name


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "noncontiguous", "stride0_grad"])
def test_values_and_gradients_match_the_untiled_mlp(bias, layout):
    mlp = _mlp(bias)
    x = torch.randn(3, 11, HIDDEN)
    grad_out = torch.randn(3, 11, HIDDEN)
    if layout == "noncontiguous":
        x = noncontiguous(x)
    if layout == "stride0_grad":
        grad_out = stride0_like(grad_out)
    want = _run(mlp, x, grad_out, lambda m, t: m(t))
    got = _run(mlp, x, grad_out, lambda m, t: tiled(m, t, 7))
    _assert_close(got, want)


def test_only_the_input_is_saved():
    mlp, x = _mlp(), torch.randn(33, HIDDEN, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        tiled(mlp, x, 7)
    assert saved == [x.shape]


def test_parameter_gradients_reach_autograd_grad_and_hooks():
    """The parameters' gradients are the node's outputs: torch.autograd.grad returns them (no .grad write),
    and a gradient hook on a parameter sees one summed gradient."""
    mlp, x = _mlp(), torch.randn(33, HIDDEN)
    seen = []
    mlp.up_proj.weight.register_hook(lambda g: seen.append(g.shape))
    weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    got = torch.autograd.grad(tiled(mlp, x, 7).square().sum(), weights)
    want = torch.autograd.grad(mlp(x).square().sum(), weights)
    assert all(p.grad is None for p in weights)
    for g, w in zip(got, want, strict=True):
        assert rel(g, w) <= 1e-6
    assert seen == [mlp.up_proj.weight.shape] * 2  # once each call: the tiled node passes on one sum


def test_input_without_gradient_still_trains_the_parameters():
    """A frozen input (LoRA on the MLP only, in the first layer): the parameters are the node's inputs."""
    mlp, x = _mlp(), torch.randn(33, HIDDEN)
    tiled(mlp, x, 7).sum().backward()
    got = {n: p.grad.clone() for n, p in mlp.named_parameters()}
    mlp.zero_grad(set_to_none=True)
    mlp(x).sum().backward()
    for name, p in mlp.named_parameters():
        assert rel(got[name], p.grad) <= 1e-6


class _DropoutMLP(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp, self.dropout = mlp, nn.Dropout(0.3)

    def forward(self, x):
        return self.dropout(self.mlp(x))


def test_the_backward_replays_the_forwards_random_draws():
    module, x = _DropoutMLP(_mlp()), torch.randn(33, HIDDEN)
    grad_out = torch.randn(33, HIDDEN)
    torch.manual_seed(5)
    want = _run(module, x, grad_out, lambda m, t: torch.cat([m(t[i : i + 7]) for i in range(0, 33, 7)]))
    torch.manual_seed(5)
    got = _run(module, x, grad_out, lambda m, t: tiled(m, t, 7))
    _assert_close(got, want)
    assert (got[0] == 0).any()  # the dropout was on


def test_autocast_state_of_the_forward_is_the_backwards():
    mlp, x = _mlp(), torch.randn(33, HIDDEN)
    grad_out = torch.randn(33, HIDDEN)

    def under_autocast(fn):
        def run(m, t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(m, t).float()
        return run

    want = _run(mlp, x, grad_out, under_autocast(lambda m, t: torch.cat([m(t[i : i + 7]) for i in range(0, 33, 7)])))
    got = _run(mlp, x, grad_out, under_autocast(lambda m, t: tiled(m, t, 7)))
    # The chunks recomputed under the forward's bf16 autocast: the same bf16 products, bit for bit.
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # The weights' gradients: one bf16 product a chunk, summed in fp32 (the stock graph sums the chunks'
    # products in bf16 at its one cached cast of each weight): within bf16's rounding.
    _assert_close(got, want, tolerance=TOLERANCE[torch.bfloat16])


def test_tiled_forward_runs_short_inputs_whole_and_long_ones_tiled():
    mlp = _mlp()
    forward = TiledForward(mlp, mlp.forward, HIDDEN, TiledMLPConfig(tokens_per_hidden=0.5, min_tokens=5))
    assert forward.chunk_tokens == 12
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        forward(torch.randn(12, HIDDEN, requires_grad=True))  # one chunk: the module as it is
        whole = len(saved)
        forward(torch.randn(13, HIDDEN, requires_grad=True))
    assert whole > 1 and saved[whole:] == [torch.Size([13, HIDDEN])]


@pytest.mark.parametrize("field, value", [("tokens_per_hidden", 0), ("tokens_per_hidden", True),
                                          ("min_tokens", 0), ("min_tokens", 2.5)])
def test_config_checks_its_fields(field, value):
    with pytest.raises(ValueError, match=field):
        TiledMLPConfig(**{field: value})


def test_bad_arguments_raise():
    mlp = _mlp()
    with pytest.raises(ValueError, match="chunk_tokens"):
        tiled(mlp, torch.randn(4, HIDDEN), 0)
    with pytest.raises(TypeError, match="x"):
        tiled(mlp, torch.tensor(1.0), 2)
