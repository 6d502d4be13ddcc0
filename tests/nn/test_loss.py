"""tigon.nn.CrossEntropyLoss and FusedLinearCrossEntropyLoss against torch's module and the functions.

The modules hold options only (and the class weights as a ``weight`` buffer, as torch's
CrossEntropyLoss does, so its state_dict loads unchanged); the math is tested in tests/ops.
"""

import pytest
import torch

from tests.helpers import DEVICE, LOSS_TOLERANCE, assert_close, randn
from tigon.nn.loss import CrossEntropyLoss, FusedLinearCrossEntropyLoss
from tigon.ops.cross_entropy import cross_entropy
from tigon.ops.fused_linear_cross_entropy import fused_linear_cross_entropy


def _target(shape, vocab):
    target = torch.randint(0, vocab, shape, device=DEVICE)
    target.view(-1)[0] = -100
    return target


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("weighted", (False, True), ids=("unweighted", "weighted"))
def test_cross_entropy_loss_matches_torch_module(dtype, weighted):
    weight = torch.rand(40, device=DEVICE) + 0.1 if weighted else None
    ours = CrossEntropyLoss(weight=weight, label_smoothing=0.1)
    theirs = torch.nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    logits = randn(6, 40, dtype=dtype, requires_grad=True)
    target = _target((6,), 40)
    loss = ours(logits, target)
    ref = theirs(logits.float(), target)
    assert_close(loss, ref, torch.float32, "loss", tolerance=LOSS_TOLERANCE)
    (grad,) = torch.autograd.grad(loss, logits)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    assert_close(grad, ref_grad, dtype, "dlogits")


def test_cross_entropy_loss_state_dict_round_trip():
    weight = torch.rand(12, device=DEVICE)
    source = torch.nn.CrossEntropyLoss(weight=weight)
    ours = CrossEntropyLoss(weight=torch.zeros(12, device=DEVICE))
    ours.load_state_dict(source.state_dict())
    assert torch.equal(ours.weight, weight)


def test_cross_entropy_loss_options_pass_through():
    options = dict(ignore_index=3, label_smoothing=0.2, reduction="none", z_loss=1e-3, softcap=5.0,
                   logit_scale=0.5)
    module = CrossEntropyLoss(**options)
    logits = randn(2, 3, 20, requires_grad=True)
    target = torch.randint(0, 20, (2, 3), device=DEVICE)
    target[0, 0] = 3
    assert torch.equal(module(logits, target), cross_entropy(logits, target, **options))
    assert "softcap=5.0" in repr(module)


def test_fused_linear_cross_entropy_loss():
    weight = torch.rand(50, device=DEVICE) + 0.1
    options = dict(weight=weight, label_smoothing=0.1, reduction="sum", z_loss=1e-3, softcap=5.0)
    module = FusedLinearCrossEntropyLoss(**options)
    x = randn(2, 4, 16, requires_grad=True)
    w = randn(50, 16, requires_grad=True)
    b = randn(50, requires_grad=True)
    target = _target((2, 4), 50)
    loss = module(x, w, target, b)
    assert torch.equal(loss, fused_linear_cross_entropy(x, w, target, linear_bias=b, **options))
    grads = torch.autograd.grad(loss, (x, w, b))
    assert [g.shape for g in grads] == [x.shape, w.shape, b.shape]
    assert list(module.state_dict()) == ["weight"]
    assert list(FusedLinearCrossEntropyLoss().state_dict()) == []


@pytest.mark.parametrize("cls", (CrossEntropyLoss, FusedLinearCrossEntropyLoss))
def test_loss_module_bad_options(cls):
    with pytest.raises(ValueError, match="reduction"):
        cls(reduction="elementwise")
    with pytest.raises(ValueError, match="label_smoothing"):
        cls(label_smoothing=-0.1)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        cls(weight=[1.0, 2.0])
    for name, value in (("label_smoothing", "0.1"), ("z_loss", None), ("softcap", "30"), ("logit_scale", True)):
        with pytest.raises(TypeError, match=name):
            cls(**{name: value})
    if cls is CrossEntropyLoss:
        with pytest.raises(TypeError, match="inplace_backward"):
            cls(inplace_backward="yes")
    module = cls(weight=torch.ones(7, device=DEVICE))
    x = randn(3, 8)
    with pytest.raises(ValueError, match="weight has shape"):
        module(x, _target((3,), 8)) if cls is CrossEntropyLoss else module(x, randn(8, 8), _target((3,), 8))
