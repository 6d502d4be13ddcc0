"""Inputs and the comparison every loss test runs: value, metrics and the gradients into input,
head weight and bias against the float64 references of reference.py."""

from __future__ import annotations

import torch

from tests.helpers import DEVICE, LOSS_TOLERANCE, TOLERANCE, assert_close, randn
from tigon.losses import LossOutput

GRAD_NAMES = ("input", "linear_weight", "linear_bias")
# fields of LossOutput other than the loss; reference.py's helpers may return extra keys for the tests
METRICS = tuple(f for f in LossOutput._fields if f != "loss")


def make_batch(rows, tokens, hidden, vocab, *, dtype=torch.float32, bias=True, ignore_index=-100, prompt=2):
    """Hidden states, head and targets: the first ``prompt`` positions and a random tail are ignored,
    every row keeps at least one counted token, and rows differ in length."""
    target = torch.randint(0, vocab, (rows, tokens), device=DEVICE)
    target[:, :prompt] = ignore_index
    for i in range(rows):
        pad = (3 * i) % max(tokens - prompt - 1, 1)
        if pad:
            target[i, tokens - pad:] = ignore_index
    return {
        "input": randn(rows, tokens, hidden, dtype=dtype, requires_grad=True),
        "linear_weight": randn(vocab, hidden, dtype=dtype, scale=1.5 * hidden**-0.5, requires_grad=True),
        "linear_bias": randn(vocab, dtype=dtype, scale=0.5, requires_grad=True) if bias else None,
        "target": target,
    }


def reference_model(batch, noise=0.3):
    """A reference head near the policy's, and its own hidden states (no gradient)."""
    with torch.no_grad():
        ref = {
            "ref_input": (batch["input"].float() + noise * torch.randn_like(batch["input"].float()))
            .to(batch["input"].dtype),
            "ref_linear_weight": (batch["linear_weight"].float() * (1 + noise * torch.randn_like(
                batch["linear_weight"].float()))).to(batch["linear_weight"].dtype),
        }
        if batch["linear_bias"] is not None:
            ref["ref_linear_bias"] = batch["linear_bias"].detach() * 0.5
    return ref


def fp64(t):
    return t.detach().double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def check_loss(function, reference, tensors: dict, *, dtype, **options):
    """``function(**tensors, **options)`` against ``reference`` on float64 copies: the loss, every
    metric the reference returns (and None for the others), and gradients into input, weight, bias."""
    out = function(**tensors, **options)
    assert isinstance(out, LossOutput)
    leaves = {k: fp64(v) for k, v in tensors.items()}
    for name in GRAD_NAMES:
        if leaves.get(name) is not None:
            leaves[name].requires_grad_(True)
    ref = reference(**leaves, **{k: fp64(v) for k, v in options.items()})

    assert out.loss.dtype == torch.float32 and out.loss.shape == () and out.loss.requires_grad
    assert_close(out.loss, ref["loss"], dtype, "loss", tolerance=LOSS_TOLERANCE)
    for field in METRICS:
        value = getattr(out, field)
        if field not in ref:
            assert value is None, f"{field} should be None for {function.__name__}"
            continue
        assert value is not None and value.dtype == torch.float32 and not value.requires_grad, field
        assert_close(value, ref[field].detach().reshape(value.shape), dtype, field)

    names = [n for n in GRAD_NAMES if tensors.get(n) is not None]
    grads = torch.autograd.grad(out.loss, [tensors[n] for n in names])
    ref_grads = torch.autograd.grad(ref["loss"], [leaves[n] for n in names])
    for name, grad, ref_grad in zip(names, grads, ref_grads, strict=True):
        assert grad.dtype == tensors[name].dtype
        assert_close(grad, ref_grad, dtype, f"d{name}", tolerance=TOLERANCE)
    return out, ref
