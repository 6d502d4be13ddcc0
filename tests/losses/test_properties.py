"""Property tests: every loss of ``tigon.losses``, function and class form, over generated cases.

As tests/ops/test_properties.py: each case carries at most one fault (a refused dtype of ``input``,
a bad option, a bad shape or row count, bad preference labels or item count) among mostly valid
cases over dtypes, layouts (strided, transposed, broadcast ``input``; strided or transposed heads),
sizes and options. A faulty case must raise ValueError or TypeError naming the argument; a valid one
must match reference.py in float64 (tests/losses/common.py's ``check_loss``: loss, every metric, and
the gradients into input, linear_weight, linear_bias). ``MAX_EXAMPLES`` lists the cases per test.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from tests.helpers import DEVICE
from tests.losses.common import check_loss
from tests.strategies import (
    bad_dtypes,
    expect_error,
    good_dtypes,
    head_layouts,
    layouts,
    make_tensor,
    property_settings,
)
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
    reference,
    simpo_loss,
)

NAN, INF = float("nan"), float("inf")
PER_BATCH = ("kl", "num_items_in_batch")
NOT_NUMBERS = ("0.1", None, True, NAN)

# Cases drawn per test (hypothesis max_examples); their sum is what one CI run executes.
MAX_EXAMPLES = {"dpo": 25, "orpo": 15, "cpo": 15, "simpo": 15, "kto": 25, "grpo": 25}
FAULTS = ("none",) * 4 + ("dtype", "option", "shape")
# Option values each loss must refuse, naming the option (the head's keywords are HEAD_INVALID).
INVALID = {
    "dpo": {"beta": (*NOT_NUMBERS, INF), "loss_type": ("nope", None), "label_smoothing": ("0.1", 1.5),
            "nll_weight": (None, NAN), "average_log_prob": ("yes", 1)},
    "orpo": {"beta": (*NOT_NUMBERS, -INF)},
    "cpo": {"beta": NOT_NUMBERS, "label_smoothing": (-0.1, None), "alpha": ("1", INF), "average_log_prob": (None,)},
    "simpo": {"beta": NOT_NUMBERS, "gamma": (None, NAN), "label_smoothing": (2.0, "0")},
    "kto": {"beta": NOT_NUMBERS, "kl": ("0.3", None, NAN), "desirable_weight": (-1.0, "1"),
            "undesirable_weight": (None, INF)},
    "grpo": {"beta": (*NOT_NUMBERS, -1.0), "epsilon_low": ("0.2", -0.1), "epsilon_high": (None, INF),
             "loss_type": ("ppo", None), "max_completion_length": (0, 1.5)},
}

HEAD_VALID = {"temperature": (1.0, 0.8), "softcap": (None, 5.0), "logit_scale": (1.0, 0.5)}
HEAD_INVALID = {"temperature": (*NOT_NUMBERS, 0.0), "softcap": ("5", -1.0), "logit_scale": (None, INF),
                "ignore_index": (1.5, None)}


def _batch(data, fault, dtype, *, paired):
    """input (R, T, H), head (V, H), bias, target (R, T): every row keeps a counted token. A "shape"
    fault is an odd or zero R (paired), zero R, or a target of the wrong length, each named."""
    num_rows = data.draw(st.sampled_from((2, 4) if paired else (1, 3)), label="R")
    tokens, hidden = data.draw(st.sampled_from((1, 4)), label="T"), data.draw(st.sampled_from((1, 3, 8)), label="H")
    vocab = data.draw(st.sampled_from((3, 13)), label="V")
    bad_shape = None
    if fault == "shape":
        bad_shape = data.draw(st.sampled_from(("rows", "target")), label="bad shape")
        if bad_shape == "rows":
            num_rows = data.draw(st.sampled_from((0, 3) if paired else (0,)), label="bad R")
    other = torch.float32 if fault == "dtype" else dtype
    target = torch.randint(0, vocab, (num_rows, tokens), device=DEVICE)
    ignored = torch.rand(num_rows, tokens, device=DEVICE) < 0.3
    ignored[:, -1] = False
    target[ignored] = -100
    if bad_shape == "target":
        target = target[:, :-1]
    batch = {
        "input": make_tensor((num_rows, tokens, hidden), dtype, data.draw(layouts), requires_grad=True),
        "linear_weight": make_tensor((vocab, hidden), other, data.draw(head_layouts), requires_grad=True,
                                     scale=1.5 * hidden**-0.5),
        "linear_bias": (make_tensor((vocab,), other, data.draw(layouts), requires_grad=True, scale=0.5)
                        if data.draw(st.booleans(), label="bias") else None),
        "target": target,
    }
    return batch, {"rows": "input", "target": "target", None: None}[bad_shape]


def _draw(data, valid, invalid):
    torch.manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    fault = data.draw(st.sampled_from(FAULTS), label="fault")
    event(f"fault: {fault}")  # --hypothesis-show-statistics lists how many cases each fault got
    dtype = data.draw(bad_dtypes if fault == "dtype" else good_dtypes, label="dtype")
    valid, invalid = {**HEAD_VALID, **valid}, {**HEAD_INVALID, **invalid}
    options = {name: data.draw(st.sampled_from(values), label=name) for name, values in valid.items()}
    bad = None
    if fault == "option":
        bad = data.draw(st.sampled_from(sorted(invalid)), label="bad option")
        options[bad] = data.draw(st.sampled_from(invalid[bad]), label=f"bad {bad}")
    return fault, dtype, options, bad


def _class_call(cls):
    """A call of ``cls``: the options to the constructor, the tensors to the built loss."""

    def call(**arguments):
        # Tensors and per-batch values (kl, num_items_in_batch) go to the call, except a per-batch None:
        # in the call that means "the constructor's value", so it is the constructor's to refuse.
        to_call = {k for k, v in arguments.items() if k in cls.call_order and not (k in PER_BATCH and v is None)}
        built = {k: v for k, v in arguments.items() if k not in to_call}
        return cls(**built)(**{k: v for k, v in arguments.items() if k in to_call})

    return call


def _form(data, function, cls):
    """The loss as the function or as its class."""
    return _class_call(cls) if data.draw(st.booleans(), label="class form") else function


def _reference_of(data, batch):
    """No reference, per-row ref_logps, or a reference model near the policy."""
    kind = data.draw(st.sampled_from(("none", "ref_logps", "model")), label="reference")
    num_rows = batch["target"].shape[0]
    if kind == "ref_logps":
        return {"ref_logps": torch.randn(num_rows, device=DEVICE) - 5.0}
    if kind == "model":
        noise = lambda t: (t.detach().float() * (1 + 0.3 * torch.randn_like(t.detach().float()))).to(t.dtype)  # noqa: E731
        return {"ref_input": noise(batch["input"]), "ref_linear_weight": noise(batch["linear_weight"])}
    return {}


def _run(data, function, cls, ref_function, fault, dtype, batch, options, bad, bad_shape, dtype_name="input"):
    loss = _form(data, function, cls)
    if fault != "none":
        expect_error(lambda: loss(**batch, **options), {"dtype": dtype_name, "option": bad,
                                                         "shape": bad_shape}[fault])
        return
    check_loss(loss, ref_function, batch, dtype=dtype, **options)


def _paired_test(data, function, cls, ref_function, valid, invalid, *, with_reference=False):
    fault, dtype, options, bad = _draw(data, valid, invalid)
    batch, bad_shape = _batch(data, fault, dtype, paired=True)
    if with_reference:
        options.update(_reference_of(data, batch))
    _run(data, function, cls, ref_function, fault, dtype, batch, options, bad, bad_shape)


@property_settings(MAX_EXAMPLES["dpo"])
@given(st.data())
def test_dpo(data):
    _paired_test(
        data, dpo_loss, DPOLoss, reference.dpo,
        {"beta": (0.1, 0.5), "loss_type": ("sigmoid", "hinge", "ipo"), "label_smoothing": (0.0, 0.1),
         "nll_weight": (0.0, 0.5), "average_log_prob": (False, True)},
        INVALID["dpo"],
        with_reference=True,
    )


@property_settings(MAX_EXAMPLES["orpo"])
@given(st.data())
def test_orpo(data):
    _paired_test(data, orpo_loss, ORPOLoss, reference.orpo, {"beta": (0.1, 1.0)}, INVALID["orpo"])


@property_settings(MAX_EXAMPLES["cpo"])
@given(st.data())
def test_cpo(data):
    _paired_test(
        data, cpo_loss, CPOLoss, reference.cpo,
        {"beta": (0.1, 0.5), "label_smoothing": (0.0, 0.2), "alpha": (1.0, 0.0), "average_log_prob": (False, True)},
        INVALID["cpo"],
    )


@property_settings(MAX_EXAMPLES["simpo"])
@given(st.data())
def test_simpo(data):
    _paired_test(
        data, simpo_loss, SimPOLoss, reference.simpo,
        {"beta": (2.0, 1.0), "gamma": (0.5, 0.0), "label_smoothing": (0.0, 0.1)},
        INVALID["simpo"],
    )


@property_settings(MAX_EXAMPLES["kto"])
@given(st.data())
def test_kto(data):
    fault, dtype, options, bad = _draw(
        data,
        {"beta": (0.1, 0.5), "kl": (0.0, 0.3, "tensor"), "desirable_weight": (1.0, 1.3),
         "undesirable_weight": (1.0, 0.7), "average_log_prob": (False, True)},
        {**INVALID["kto"], "preference_labels": ("twos", "halves", "length", "list")},
    )
    batch, bad_shape = _batch(data, fault, dtype, paired=False)
    num_rows = batch["target"].shape[0]
    if options.get("kl") == "tensor":
        options["kl"] = torch.tensor(0.2, device=DEVICE)
    labels = torch.rand(num_rows, device=DEVICE) < 0.6
    labels = labels.to(data.draw(st.sampled_from((torch.bool, torch.int64, torch.int32)), label="labels dtype"))
    faulty_labels = options.pop("preference_labels", None)
    if faulty_labels == "twos":
        labels = torch.full((num_rows,), 2, device=DEVICE)
    elif faulty_labels == "halves":
        labels = torch.full((num_rows,), 0.5, device=DEVICE)
    elif faulty_labels == "length":
        labels = torch.ones(num_rows + 1, dtype=torch.bool, device=DEVICE)
    elif faulty_labels == "list":
        labels = [True] * num_rows
    batch["preference_labels"] = labels
    options.update(_reference_of(data, batch))
    _run(data, kto_loss, KTOLoss, reference.kto, fault, dtype, batch, options, bad, bad_shape)


@property_settings(MAX_EXAMPLES["grpo"])
@given(st.data())
def test_grpo(data):
    fault, dtype, options, bad = _draw(
        data,
        {"beta": (0.0, 0.04), "epsilon_low": (0.2, 0.1), "epsilon_high": (0.2, 0.3),
         "loss_type": ("grpo", "bnpo", "dr_grpo", "dapo"), "max_completion_length": (None, 6),
         "num_items_in_batch": (None, 7, "tensor")},
        {**INVALID["grpo"], "num_items_in_batch": (0, "3", "zero tensor", "negative tensor", "nan tensor")},
    )
    batch, bad_shape = _batch(data, fault, dtype, paired=False)
    num_rows = batch["target"].shape[0]
    items = options.get("num_items_in_batch")
    if isinstance(items, str) and items.endswith("tensor"):
        value = {"tensor": 5.0, "zero tensor": 0.0, "negative tensor": -2.0, "nan tensor": NAN}[items]
        options["num_items_in_batch"] = torch.tensor(value, device=DEVICE)
    batch["advantages"] = torch.randn(num_rows, device=DEVICE)
    if num_rows and fault != "shape":
        with torch.no_grad():
            own, _ = reference.token_logps(*(batch[k].detach().double() for k in ("input", "linear_weight")),
                                           batch["target"], None if batch["linear_bias"] is None
                                           else batch["linear_bias"].detach().double())
        own = own.float()
        if data.draw(st.booleans(), label="old_logps"):
            options["old_logps"] = own + (torch.rand_like(own) - 0.5)
        if options["beta"] != 0.0 or data.draw(st.booleans(), label="ref_logps"):
            options["ref_logps"] = own + 0.3 * torch.randn_like(own)
    elif options["beta"] != 0.0 and fault != "option":
        options["beta"] = 0.0
    _run(data, grpo_loss, GRPOLoss, reference.grpo, fault, dtype, batch, options, bad, bad_shape)


LOSSES = {"dpo": (dpo_loss, DPOLoss), "orpo": (orpo_loss, ORPOLoss), "cpo": (cpo_loss, CPOLoss),
          "simpo": (simpo_loss, SimPOLoss), "kto": (kto_loss, KTOLoss), "grpo": (grpo_loss, GRPOLoss)}
INVALID_CASES = [(loss, form, option, value) for loss, invalid in INVALID.items() for form in ("function", "class")
                 for option, values in {**invalid, **HEAD_INVALID}.items() for value in values]


@pytest.mark.parametrize(("loss", "form", "option", "value"), INVALID_CASES,
                         ids=[f"{loss}-{form}-{option}={value!r}" for loss, form, option, value in INVALID_CASES])
def test_every_invalid_option_is_named(loss, form, option, value):
    """Each refused value of each option, one at a time on a valid batch, in either form: TypeError
    or ValueError naming the option (the class raises when built, or at the call for kl)."""
    # input wants a gradient: the single pass (eager, with gradients) checks the head's options itself
    batch = {"input": torch.randn(2, 3, 8, device=DEVICE, requires_grad=True),
             "linear_weight": torch.randn(5, 8, device=DEVICE),
             "target": torch.tensor([[-100, 1, 4], [2, 0, -100]], device=DEVICE)}
    if loss == "kto":
        batch["preference_labels"] = torch.tensor([True, False], device=DEVICE)
    if loss == "grpo":
        batch["advantages"] = torch.tensor([0.5, -1.0], device=DEVICE)
        batch["ref_logps"] = torch.full((2, 3), -2.0, device=DEVICE)
    function, cls = LOSSES[loss]
    call = function if form == "function" else _class_call(cls)
    expect_error(lambda: call(**batch, **{option: value}), option)
