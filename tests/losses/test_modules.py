"""Class forms compute what the functions compute; the package shows every loss."""

import pytest
import torch

import tigon.losses
import tigon.ops
from tests.helpers import DEVICE, randn
from tests.losses.common import make_batch, reference_model
from tigon.losses import (
    CPOLoss,
    DPOLoss,
    GRPOLoss,
    KTOLoss,
    ORPOLoss,
    SimPOLoss,
    cpo_loss,
    dpo_loss,
    grpo_loss,
    kto_loss,
    orpo_loss,
    simpo_loss,
)


def positional(batch):
    return batch["input"], batch["linear_weight"], batch["target"]


def assert_same(a, b):
    for field, x, y in zip(a._fields, a, b, strict=True):
        assert (x is None and y is None) or torch.equal(x, y), field


CASES = {
    "dpo": (DPOLoss, dpo_loss, {"beta": 0.3, "loss_type": "ipo", "average_log_prob": True, "softcap": 5.0}, "model"),
    "orpo": (ORPOLoss, orpo_loss, {"beta": 0.2, "temperature": 0.8}, None),
    "cpo": (CPOLoss, cpo_loss, {"alpha": 0.3, "label_smoothing": 0.1}, None),
    "simpo": (SimPOLoss, simpo_loss, {"gamma": 0.1, "logit_scale": 0.7}, None),
    "kto": (KTOLoss, kto_loss, {"beta": 0.2, "undesirable_weight": 2.0, "kl": 0.3}, "ref_logps"),
    "grpo": (GRPOLoss, grpo_loss, {"loss_type": "dapo", "beta": 0.1, "epsilon_high": 0.3}, "grpo"),
}


@pytest.mark.parametrize("name", CASES)
def test_class_form_equals_function(name):
    cls, function, options, reference = CASES[name]
    batch = make_batch(4, 6, 16, 29)
    args = list(positional(batch))
    tensors = {"linear_bias": batch["linear_bias"]}
    if reference == "model":
        tensors |= reference_model(batch)
    elif reference == "ref_logps":
        tensors["ref_logps"] = randn(4) - 10
    if name == "kto":
        args.append(torch.tensor([True, False, False, True], device=DEVICE))
    if name == "grpo":
        args.append(randn(4))
        tensors |= {"old_logps": randn(4, 6) - 3, "ref_logps": randn(4, 6) - 3}
    module = cls(**options)
    assert list(module.parameters()) == [] and name in repr(module).lower()
    assert_same(module(*args, **tensors), function(*args, **options, **tensors))


def test_per_batch_values_in_the_call_win():
    batch = make_batch(4, 6, 16, 29)
    labels = torch.tensor([True, False, False, True], device=DEVICE)
    loss = KTOLoss(kl=0.3)
    assert_same(loss(*positional(batch), labels, kl=0.9), kto_loss(*positional(batch), labels, kl=0.9))
    assert_same(loss(*positional(batch), labels, kl=None), kto_loss(*positional(batch), labels, kl=0.3))
    advantages = randn(4)
    grpo = GRPOLoss(loss_type="dapo", num_items_in_batch=40)
    assert_same(grpo(*positional(batch), advantages, num_items_in_batch=11),
                grpo_loss(*positional(batch), advantages, loss_type="dapo", num_items_in_batch=11))


def test_call_takes_bias_and_reference_by_position_too():
    batch = make_batch(4, 6, 16, 29)
    ref = reference_model(batch)
    by_position = DPOLoss(beta=0.2)(*positional(batch), batch["linear_bias"], ref["ref_input"],
                                    ref["ref_linear_weight"], ref["ref_linear_bias"])
    assert_same(by_position, dpo_loss(**batch, **ref, beta=0.2))
    with pytest.raises(TypeError, match="both by position and by name"):
        DPOLoss()(*positional(batch), batch["linear_bias"], linear_bias=batch["linear_bias"])


def test_options_and_tensors_go_where_they_belong():
    with pytest.raises(TypeError, match="unknown option"):
        DPOLoss(betta=0.1)
    with pytest.raises(TypeError, match="unknown option"):
        DPOLoss(ref_logps=torch.zeros(4))
    with pytest.raises(TypeError, match="unknown option"):
        GRPOLoss(average_log_prob=True)
    batch = make_batch(4, 6, 16, 29)
    with pytest.raises(TypeError, match="unexpected keyword"):
        DPOLoss()(*positional(batch), beta=0.2)


BAD_OPTIONS = [
    (DPOLoss, {"loss_type": "nope"}, ValueError, "loss_type"),
    (DPOLoss, {"loss_type": "ipo", "beta": 0.0}, ValueError, "beta"),
    (DPOLoss, {"label_smoothing": 1.5}, ValueError, "label_smoothing"),
    (DPOLoss, {"average_log_prob": "yes"}, TypeError, "average_log_prob"),
    (ORPOLoss, {"beta": "x"}, TypeError, "beta"),
    (CPOLoss, {"temperature": 0.0}, ValueError, "temperature"),
    (CPOLoss, {"alpha": float("nan")}, ValueError, "alpha"),
    (SimPOLoss, {"gamma": None}, TypeError, "gamma"),
    (SimPOLoss, {"softcap": -1.0}, ValueError, "softcap"),
    (KTOLoss, {"desirable_weight": -1.0}, ValueError, "desirable_weight"),
    (KTOLoss, {"ignore_index": 1.5}, TypeError, "ignore_index"),
    (GRPOLoss, {"loss_type": "nope"}, ValueError, "loss_type"),
    (GRPOLoss, {"beta": -1.0}, ValueError, "beta"),
    (GRPOLoss, {"max_completion_length": 0}, ValueError, "max_completion_length"),
    (GRPOLoss, {"logit_scale": float("inf")}, ValueError, "logit_scale"),
]


@pytest.mark.parametrize(("cls", "options", "error", "name"), BAD_OPTIONS,
                         ids=[f"{c.__name__}-{next(iter(o))}" for c, o, _, _ in BAD_OPTIONS])
def test_bad_options_raise_when_built(cls, options, error, name):
    """The function's own option checks run in the constructor: the error names the option."""
    with pytest.raises(error, match=name):
        cls(**options)


def test_bad_per_batch_values_raise_in_the_call():
    """KTO's labels and GRPO's item count are checked whichever form is called."""
    batch = make_batch(4, 6, 16, 29)
    with pytest.raises(ValueError, match="preference_labels"):
        KTOLoss()(*positional(batch), torch.tensor([1, 0, 2, 1], device=DEVICE))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], device=DEVICE)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        GRPOLoss(loss_type="dapo")(*positional(batch), advantages, num_items_in_batch=torch.tensor(0.0, device=DEVICE))
    with pytest.raises(ValueError, match="num_items_in_batch"):
        GRPOLoss(loss_type="dapo", num_items_in_batch=torch.tensor(-2))(*positional(batch), advantages)


def test_bad_options_raise_in_the_call_too():
    batch = make_batch(4, 6, 16, 29)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(*positional(batch), loss_type="nope")


def test_package_shows_every_loss():
    for name in ("kl_div", "jsd", "fused_linear_jsd", "tvd"):
        assert getattr(tigon.losses, name) is getattr(tigon.ops, name)
        assert getattr(tigon.losses.distillation, name) is getattr(tigon.ops, name)
        assert name in tigon.losses.__doc__
    for name in tigon.losses.__all__:
        assert name in tigon.losses.__doc__ or name == "distillation"
