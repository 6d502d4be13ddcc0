"""The single pass (gradients made with the loss, one matmul of logits) against the head's two passes.

Both paths run the same loss formula; the single pass chunks rows (whole pairs for the paired
losses) and pieces of tokens, which the config forces small here: one group a chunk, several
groups a chunk with a last partial one, pieces of a few tokens. Values, metrics and gradients into
input, weight and bias must agree (fp32 tightly; bf16 within API.md's tolerance, and against the
float64 reference with many bf16 roundings of dW), and grad_output, retain_graph, stride-0 and
no-grad calls behave as for any loss.
"""

import pytest
import torch

from tests.helpers import DEVICE, assert_close, randn
from tests.losses.common import GRAD_NAMES, METRICS, check_loss, make_batch, reference_model
from tigon.losses import cpo_loss, dpo_loss, grpo_loss, kto_loss, orpo_loss, reference, simpo_loss
from tigon.losses._single_pass import SinglePassConfig

ROWS, TOKENS, HIDDEN, VOCAB = 6, 7, 13, 29  # B = 3 pairs, odd sizes
TWO_PASS = SinglePassConfig(enabled=False)
CONFIGS = {
    "group": SinglePassConfig(groups_per_chunk=1, grad_tokens=3),        # a pair (row) a chunk, 3-token pieces
    "groups": SinglePassConfig(groups_per_chunk=2, grad_tokens=4),       # 2 pairs, then 1: a partial last chunk
    "whole": SinglePassConfig(),                                         # everything in one chunk
}


def _inputs(name, batch):
    rows, tokens = batch["target"].shape
    if name == "dpo":
        return dpo_loss, batch | reference_model(batch), {"beta": 0.3, "nll_weight": 0.5, "label_smoothing": 0.1}
    if name == "dpo_avg":
        return dpo_loss, batch | {"ref_logps": randn(rows, scale=0.5) - 2.0}, {
            "beta": 0.7, "loss_type": "ipo", "average_log_prob": True, "softcap": 3.0, "temperature": 0.7}
    if name == "orpo":
        return orpo_loss, batch, {"beta": 0.25, "logit_scale": 1.3}
    if name == "cpo":
        return cpo_loss, batch, {"beta": 0.2, "alpha": 0.7, "label_smoothing": 0.2}
    if name == "simpo":
        return simpo_loss, batch, {"beta": 2.0, "gamma": 0.3}
    if name == "kto":
        labels = torch.arange(rows, device=DEVICE) % 3 == 0
        return kto_loss, batch | reference_model(batch) | {"preference_labels": labels}, {
            "beta": 0.3, "kl": 0.2, "undesirable_weight": 0.5}
    old = (torch.randn(rows, tokens, device=DEVICE) * 0.3 - 3.0)
    grpo = {"advantages": randn(rows), "old_logps": old, "ref_logps": old + 0.1 * randn(rows, tokens)}
    return grpo_loss, batch | grpo, {"beta": 0.05, "epsilon_high": 0.28, "loss_type": "grpo"}


LOSSES = ("dpo", "dpo_avg", "orpo", "cpo", "simpo", "kto", "grpo")


def _run(function, tensors, options, config, scale=1.0):
    out = function(**tensors, **options, config=config)
    names = [n for n in GRAD_NAMES if tensors.get(n) is not None]
    grads = torch.autograd.grad(out.loss * scale, [tensors[n] for n in names])
    return out, dict(zip(names, grads, strict=True))


def _compare(out, grads, base, base_grads, dtype, tolerance):
    assert out.loss.grad_fn is not None and out.loss.dtype == torch.float32 and out.loss.shape == ()
    assert_close(out.loss, base.loss.detach(), dtype, "loss", tolerance=tolerance)
    for field in METRICS:
        value, expected = getattr(out, field), getattr(base, field)
        assert (value is None) == (expected is None), field
        if value is not None:
            assert not value.requires_grad and value.dtype == torch.float32
            assert_close(value, expected, dtype, field, tolerance=tolerance)
    for name, grad in grads.items():
        assert grad.dtype == base_grads[name].dtype
        assert_close(grad, base_grads[name], dtype, f"d{name}", tolerance=tolerance)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("name", LOSSES)
def test_agrees_with_two_passes_fp32(name, config):
    function, tensors, options = _inputs(name, make_batch(ROWS, TOKENS, HIDDEN, VOCAB))
    out, grads = _run(function, tensors, options, CONFIGS[config])
    assert type(out.loss.grad_fn).__name__ == "SavedGradientsFunctionBackward"
    base, base_grads = _run(function, tensors, options, TWO_PASS)
    assert type(base.loss.grad_fn).__name__ != "SavedGradientsFunctionBackward"
    _compare(out, grads, base, base_grads, torch.float32, {torch.float32: 2e-6})


@pytest.mark.parametrize("name", ("dpo", "kto", "grpo"))
def test_agrees_with_two_passes_bf16(name):
    function, tensors, options = _inputs(name, make_batch(ROWS, TOKENS, HIDDEN, VOCAB, dtype=torch.bfloat16))
    out, grads = _run(function, tensors, options, CONFIGS["groups"])
    base, base_grads = _run(function, tensors, options, TWO_PASS)
    _compare(out, grads, base, base_grads, torch.bfloat16, None)


@pytest.mark.parametrize("function,ref", [(dpo_loss, reference.dpo), (grpo_loss, reference.grpo)],
                         ids=("dpo", "grpo"))
def test_bf16_many_weight_roundings_against_float64(function, ref):
    """dW summed in bf16 over many pieces (a rounding each) stays within API.md's bf16 tolerance."""
    rows, tokens = 8, 24
    batch = make_batch(rows, tokens, 32, 61, dtype=torch.bfloat16)
    config = SinglePassConfig(groups_per_chunk=1, grad_tokens=2)  # ~96 bf16 roundings of dW
    if function is dpo_loss:
        tensors = batch | reference_model(batch)
    else:
        tensors = batch | {"advantages": randn(rows)}
    check_loss(lambda **kw: function(**kw, config=config), ref, tensors, dtype=torch.bfloat16)


def test_grad_output_retain_graph_and_stride0():
    """loss·3, two backwards of one graph (retain_graph), a stride-0 grad_output via .sum()."""
    function, tensors, options = _inputs("dpo", make_batch(ROWS, TOKENS, HIDDEN, VOCAB))
    leaves = [tensors[n] for n in GRAD_NAMES]
    base, base_grads = _run(function, tensors, options, TWO_PASS)
    out = function(**tensors, **options, config=CONFIGS["groups"])
    tripled = torch.autograd.grad(out.loss * 3, leaves, retain_graph=True)
    handed = torch.autograd.grad(out.loss, leaves, retain_graph=True)
    for name, g, h in zip(GRAD_NAMES, tripled, handed, strict=True):
        assert_close(g, 3 * base_grads[name], torch.float32, name, tolerance={torch.float32: 2e-6})
        assert_close(h, base_grads[name], torch.float32, name, tolerance={torch.float32: 2e-6})
        h.zero_()  # what the caller does with a handed-out gradient changes nothing saved
    for leaf in leaves:
        leaf.grad = None
    out.loss.sum().backward(retain_graph=True)
    out.loss.expand(4).sum().mul(0.5).backward()  # stride-0 grad_output of 0.5 per element: 2 in all
    for name, leaf in zip(GRAD_NAMES, leaves, strict=True):
        assert_close(leaf.grad, 3 * base_grads[name], torch.float32, name, tolerance={torch.float32: 2e-6})


def test_no_grad_and_frozen_weight():
    """Without gradients the head's path runs; with only input requiring one, only dX is made."""
    function, tensors, options = _inputs("grpo", make_batch(ROWS, TOKENS, HIDDEN, VOCAB))
    with torch.no_grad():
        plain = function(**tensors, **options, config=CONFIGS["group"])
    assert not plain.loss.requires_grad
    frozen = tensors | {"linear_weight": tensors["linear_weight"].detach(), "linear_bias": None}
    out = function(**frozen, **options, config=CONFIGS["group"])
    assert type(out.loss.grad_fn).__name__ == "SavedGradientsFunctionBackward"
    (dx,) = torch.autograd.grad(out.loss, [tensors["input"]])
    base = function(**frozen, **options, config=TWO_PASS)
    (base_dx,) = torch.autograd.grad(base.loss, [tensors["input"]])
    assert_close(dx, base_dx, torch.float32, "dinput", tolerance={torch.float32: 2e-6})
    with_bias = function(**tensors, **options, config=TWO_PASS)
    assert_close(plain.loss, with_bias.loss.detach(), torch.float32, "loss", tolerance={torch.float32: 2e-6})


def test_out_of_range_target_raises():
    batch = make_batch(ROWS, TOKENS, HIDDEN, VOCAB)
    batch["target"][1, 4] = VOCAB
    with pytest.raises(ValueError, match="outside"):
        dpo_loss(**batch, config=CONFIGS["group"])


@pytest.mark.gpu
@pytest.mark.parametrize("name", LOSSES)
def test_agrees_with_two_passes_gpu_bf16(name):
    """A realistic chunking on the GPU: 4 pairs (8 rows) of 512 tokens, V = 32000, a 64 MiB workspace."""
    function, tensors, options = _inputs(name, make_batch(8, 512, 256, 32000, dtype=torch.bfloat16))
    config = SinglePassConfig(workspace_bytes=64 << 20, grad_bytes=16 << 20)
    out, grads = _run(function, tensors, options, config)
    base, base_grads = _run(function, tensors, options, TWO_PASS)
    _compare(out, grads, base, base_grads, torch.bfloat16, None)


@pytest.mark.gpu
@pytest.mark.bigmem
def test_dpo_benchmark_shape_memory():
    """The benchmark's DPO (8 pairs of 1024 tokens, H = 4096, V = 128256, bf16, a reference model):
    forward + backward peak beyond the inputs within Liger-Kernel's 2665 MB (one pair's fp32 logits,
    one 1024-token piece of dl, dW and dX), and the gradients agree with the two passes."""
    batch = make_batch(16, 1024, 4096, 128256, dtype=torch.bfloat16, bias=False)
    tensors = batch | reference_model(batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = dpo_loss(**tensors)
    out.loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= 2665 * 10**6, f"peak {peak / 1e6:.0f} MB"
    grads = [batch["input"].grad, batch["linear_weight"].grad]
    two = dpo_loss(**tensors, config=TWO_PASS)
    expected = torch.autograd.grad(two.loss, [batch["input"], batch["linear_weight"]])
    for name, g, e in zip(("input", "linear_weight"), grads, expected, strict=True):
        assert_close(g, e, torch.bfloat16, f"d{name}")



@pytest.mark.parametrize("name", LOSSES)
def test_rows_without_tokens(name):
    """T = 0 with gradients on: the formula on empty log-probs (as the two passes give it), zero gradients."""
    function, tensors, options = _inputs(name, make_batch(ROWS, 0, HIDDEN, VOCAB))
    out, grads = _run(function, tensors, options, None)
    base, _ = _run(function, tensors, options, TWO_PASS)
    assert out.loss.grad_fn is not None
    torch.testing.assert_close(out.loss, base.loss, equal_nan=True)  # ORPO's log1p(−e⁰) is −inf by its formula
    for name_, grad in grads.items():
        assert torch.equal(grad, torch.zeros_like(grad)), name_
