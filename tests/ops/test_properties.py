"""Property tests: every public op of ``tigon.ops`` over generated shapes, layouts, dtypes and options.

Each generated case has at most one fault — a refused dtype on the first input, a bad option value,
or a mismatched shape — drawn among mostly valid cases (tests/strategies.py). A faulty case must
raise ValueError or TypeError naming the argument; a valid one must match the op's float64
reference (each op file's ``*_reference``, with the dtype's roundings) in every output and every
gradient, with an upstream gradient that is dense or stride 0. Sizes are tiny (the interpreter runs
the kernels) and include 0 rows, width 1 and odd widths. ``MAX_EXAMPLES`` lists the cases each test
draws; the draws are derandomized, so CI runs the same cases every time.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import tigon.ops
from tests.helpers import DEVICE, LOSS_TOLERANCE, TOLERANCE, fp64_reference
from tests.strategies import (
    bad_dtypes,
    check_outputs,
    expect_error,
    good_dtypes,
    grad_output_like,
    grads_of,
    head_layouts,
    layouts,
    make_tensor,
    property_settings,
    rows,
    widths,
)
from tigon.ops.cross_entropy import cross_entropy_reference
from tigon.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_reference
from tigon.ops.fused_linear_jsd import fused_linear_jsd_reference
from tigon.ops.fused_linear_logprobs import fused_linear_logprobs_reference
from tigon.ops.glu import glu_reference
from tigon.ops.jsd import jsd_reference
from tigon.ops.kl_div import kl_div_reference
from tigon.ops.layer_norm import layer_norm_reference
from tigon.ops.moe_glu import moe_glu_reference
from tigon.ops.mrope import mrope_reference
from tigon.ops.norm_joins import post_norm_join_reference, sandwich_norm_join_reference
from tigon.ops.rms_norm import add_rms_norm_reference, rms_norm_reference
from tigon.ops.rope import rope_reference
from tigon.ops.tvd import tvd_reference

NAN, INF = float("nan"), float("inf")
# What every number option refuses: a str, None, a bool, NaN (each a TypeError or ValueError naming it).
NOT_NUMBERS = ("0.1", None, True, NAN)

# Cases drawn per test (hypothesis max_examples); their sum is what one CI run executes.
MAX_EXAMPLES = {
    "rms_norm": 25, "add_rms_norm": 25, "post_norm_join": 20, "sandwich_norm_join": 20, "layer_norm": 25,
    "swiglu": 20, "geglu": 20, "moe_glu": 25, "rope": 25, "mrope": 25, "cross_entropy": 25,
    "fused_linear_cross_entropy": 25, "kl_div": 25, "jsd": 25, "tvd": 20, "fused_linear_jsd": 25,
    "fused_linear_logprobs": 25, "fused_linear_token_stats": 15,
}
# Option values each op must refuse, naming the option (beyond the shared norm and loss lists below).
INVALID = {
    "layer_norm": {"eps": (*NOT_NUMBERS, -1.0, INF)},
    "sandwich_norm_join": {"next_eps": ("1e-6", True, NAN, -1.0)},
    "geglu": {"approximate": ("exact", None, "sigmoid")},
    "moe_glu": {"layout": ("split", None), "activation": ("relu", None), "alpha": (*NOT_NUMBERS, INF),
                "limit": (*NOT_NUMBERS, -1.0)},
    "rope": {"unsqueeze_dim": (3, True, "1", 1.0)},
    "mrope": {"unsqueeze_dim": (0, True), "interleaved": ("yes", None, 1)},
    "kl_div": {"reduction": ("elementwise_mean", None), "log_target": ("yes", 1, None)},
    "jsd": {"beta": (*NOT_NUMBERS, 1.5, -0.1), "ignore_index": (1.5, "x", None)},
    "tvd": {"ignore_index": (1.5, "x", None)},
    "fused_linear_jsd": {"beta": (*NOT_NUMBERS, 2.0), "temperature": (*NOT_NUMBERS, 0.0, -1.0, INF),
                         "ignore_index": (1.5, None)},
    "fused_linear_logprobs": {"temperature": (*NOT_NUMBERS, 0.0, INF), "softcap": ("2", True, NAN, -1.0),
                              "logit_scale": (*NOT_NUMBERS, -INF), "ignore_index": (1.5, None)},
}
# The faults a case may carry, mostly none.
FAULTS = ("none",) * 5 + ("dtype", "option", "shape")


def draw_case(data, valid: dict, invalid: dict):
    """(fault, dtype, options, name of the option that is bad or None) for one case.

    ``valid``/``invalid`` map each option to the values to draw from. A "dtype" fault draws a refused
    dtype (int32, float64); the others a float dtype.
    """
    torch.manual_seed(data.draw(st.integers(0, 2**16), label="seed"))  # the tensors' values, per example
    fault = data.draw(st.sampled_from(FAULTS), label="fault")
    event(f"fault: {fault}")  # --hypothesis-show-statistics lists how many cases each fault got
    dtype = data.draw(bad_dtypes if fault == "dtype" else good_dtypes, label="dtype")
    options = {name: data.draw(st.sampled_from(values), label=name) for name, values in valid.items()}
    bad = None
    if fault == "option" and invalid:
        bad = data.draw(st.sampled_from(sorted(invalid)), label="bad option")
        options[bad] = data.draw(st.sampled_from(invalid[bad]), label=f"bad {bad}")
    elif fault == "option":
        fault = "none"
    return fault, dtype, options, bad


def run(op, reference, tensors: dict, options: dict, ref_options: dict, dtype, *, out_names, loss=False,
        stride0=False):
    """``op(**tensors, **options)`` against ``reference`` in float64: outputs, then every gradient."""
    out = op(**tensors, **options)
    outs = out if isinstance(out, tuple) else (out,)
    grad_outputs = tuple(None if o is None else grad_output_like(o, stride0) for o in outs)
    ref, ref_grads = fp64_reference(reference, tensors, grad_outputs, **ref_options)
    refs = ref if isinstance(ref, tuple) else (ref,)
    check_outputs(outs, refs, dtype, out_names, LOSS_TOLERANCE if loss else TOLERANCE)
    grads = grads_of(outs, grad_outputs, tensors)
    assert set(grads) == set(ref_grads), f"gradients for {sorted(grads)}, reference {sorted(ref_grads)}"
    check_outputs([grads[n] for n in grads], [ref_grads[n] for n in grads], dtype, [f"d{n}" for n in grads])


def first_dtype(fault, dtype):
    """The first input's dtype, and the float dtype of the others (fp32 where the first is refused)."""
    return dtype, (torch.float32 if fault == "dtype" else dtype)


# ------------------------------------------------------------------------------------------- norms

NORM_OPTIONS = {"eps": (1e-6, 1e-5, 0.1), "offset": (0.0, 1.0, 0.5), "casting": ("llama", "gemma")}
NORM_INVALID = {"eps": (*NOT_NUMBERS, -1.0, INF), "offset": (*NOT_NUMBERS, INF), "casting": ("t5", None)}


# A norm over one element normalises it to ±1, so a weight gradient (a sum over rows of ±g) cancels to
# rounding noise; width 1 is in the norms' own tests (test_rms_norm.py's HIDDEN_SIZES).
NORM_WIDTHS = st.sampled_from((2, 3, 8, 13))
# LayerNorm's two centred values of a width-2 row are ±1 likewise: its input gradient cancels.
LAYER_NORM_WIDTHS = st.sampled_from((3, 8, 13))


def _norm_inputs(data, fault, dtype, *, residual=False, next_weight=False):
    n, h = data.draw(rows, label="rows"), data.draw(NORM_WIDTHS, label="hidden")
    lead = data.draw(st.sampled_from(((), (2,))), label="leading dims")
    first, other = first_dtype(fault, dtype)
    shape = (*lead, n, h)
    tensors = {"x": make_tensor(shape, first, data.draw(layouts), requires_grad=True)}
    if residual:
        tensors["residual"] = make_tensor(shape, other, data.draw(layouts), requires_grad=True)
    with_weight = data.draw(st.booleans(), label="weight") or fault == "shape"
    width = h + 1 if fault == "shape" else h
    # fp32 scales with half-precision activations, as under autocast (the output dtype then promotes)
    scale_dtype = data.draw(st.sampled_from((other, torch.float32)), label="weight dtype")
    tensors["weight"] = (make_tensor((width,), scale_dtype, data.draw(layouts), requires_grad=True)
                         if with_weight else None)
    if next_weight:
        tensors["next_weight"] = make_tensor((h,), scale_dtype, data.draw(layouts), requires_grad=True)
    return tensors


def _norm_test(data, op, reference, ref_extra, *, residual=False, next_weight=False, out_names=("y",),
               extra_valid=None, extra_invalid=None):
    fault, dtype, options, bad = draw_case(
        data, {**NORM_OPTIONS, **(extra_valid or {})}, {**NORM_INVALID, **(extra_invalid or {})}
    )
    tensors = _norm_inputs(data, fault, dtype, residual=residual, next_weight=next_weight)
    eps = options.pop("eps")
    call = lambda: op(*tensors.values(), eps, **options)  # noqa: E731
    if fault != "none":
        expect_error(call, {"dtype": "x", "shape": "weight", "option": bad}[fault])
        return
    run(lambda **t: op(*t.values(), eps, **options), reference, tensors, {}, {**options, "eps": eps,
        **ref_extra(dtype, tensors)}, dtype, out_names=out_names, stride0=data.draw(st.booleans()))


@property_settings(MAX_EXAMPLES["rms_norm"])
@given(st.data())
def test_rms_norm(data):
    _norm_test(data, tigon.ops.rms_norm, lambda x, weight, **kw: rms_norm_reference(x, weight, **kw),
               lambda dtype, t: {"io_dtype": dtype})


@property_settings(MAX_EXAMPLES["add_rms_norm"])
@given(st.data())
def test_add_rms_norm(data):
    _norm_test(data, tigon.ops.add_rms_norm, add_rms_norm_reference, lambda dtype, t: {"io_dtype": dtype},
               residual=True, out_names=("y", "s"))


def _dtypes(dtype, tensors):
    return {"dtypes": {n: (None if t is None else t.dtype) for n, t in tensors.items()}}


@property_settings(MAX_EXAMPLES["post_norm_join"])
@given(st.data())
def test_post_norm_join(data):
    _norm_test(data, tigon.ops.post_norm_join, post_norm_join_reference, _dtypes, residual=True, out_names=("s",))


@property_settings(MAX_EXAMPLES["sandwich_norm_join"])
@given(st.data())
def test_sandwich_norm_join(data):
    _norm_test(data, tigon.ops.sandwich_norm_join, sandwich_norm_join_reference, _dtypes, residual=True,
               next_weight=True, out_names=("y", "s"), extra_valid={"next_eps": (None, 1e-5)},
               extra_invalid=INVALID["sandwich_norm_join"])


@property_settings(MAX_EXAMPLES["layer_norm"])
@given(st.data())
def test_layer_norm(data):
    fault, dtype, options, bad = draw_case(data, {"eps": (1e-5, 1e-3, 0.0)}, INVALID["layer_norm"])
    n, h = data.draw(rows), data.draw(LAYER_NORM_WIDTHS)
    first, other = first_dtype(fault, dtype)
    width = h + 1 if fault == "shape" else h
    tensors = {"x": make_tensor((n, h), first, data.draw(layouts), requires_grad=True)}
    for name in ("weight", "bias"):
        present = data.draw(st.booleans(), label=name) or (fault == "shape" and name == "weight")
        tensors[name] = make_tensor((width,), other, data.draw(layouts), requires_grad=True) if present else None
    call = lambda: tigon.ops.layer_norm(**tensors, **options)  # noqa: E731
    if fault != "none":
        expect_error(call, {"dtype": "x", "shape": "weight", "option": bad}[fault])
        return
    # A constant upstream gradient through a norm whose scale is constant (none, or broadcast) has an
    # input gradient of exactly 0 (the centring removes it), which fp32 gives as rounding noise.
    weight = tensors["weight"]
    varied_scale = weight is not None and weight.stride(-1) != 0
    run(tigon.ops.layer_norm, layer_norm_reference, tensors, options, options, dtype, out_names=("y",),
        stride0=varied_scale and data.draw(st.booleans()))


# --------------------------------------------------------------------------------------- activations


def _glu_test(data, op, valid, invalid, activation_of):
    fault, dtype, options, bad = draw_case(data, valid, invalid)
    n, h = data.draw(rows), data.draw(widths)
    first, other = first_dtype(fault, dtype)
    tensors = {"gate": make_tensor((n, h), first, data.draw(layouts), requires_grad=True, scale=2.0),
               "up": make_tensor((n, h + (fault == "shape")), other, data.draw(layouts), requires_grad=True)}
    call = lambda: op(**tensors, **options)  # noqa: E731
    if fault != "none":
        expect_error(call, {"dtype": "gate", "shape": "up", "option": bad}[fault])
        return
    run(op, glu_reference, tensors, options, {"activation": activation_of(options), "io_dtype": dtype}, dtype,
        out_names=("h",), stride0=data.draw(st.booleans()))


@property_settings(MAX_EXAMPLES["swiglu"])
@given(st.data())
def test_swiglu(data):
    _glu_test(data, tigon.ops.swiglu, {}, {}, lambda options: "silu")


@property_settings(MAX_EXAMPLES["geglu"])
@given(st.data())
def test_geglu(data):
    _glu_test(data, tigon.ops.geglu, {"approximate": ("tanh", "none")}, INVALID["geglu"],
              lambda options: {"tanh": "gelu_tanh", "none": "gelu"}[options["approximate"]])


@property_settings(MAX_EXAMPLES["moe_glu"])
@given(st.data())
def test_moe_glu(data):
    fault, dtype, options, bad = draw_case(
        data,
        {"layout": ("halves", "interleaved"), "activation": ("silu", "gelu_tanh", "gelu", "clamped_swiglu"),
         "alpha": (1.702, 0.5), "limit": (7.0, 0.5, INF)},
        INVALID["moe_glu"],
    )
    n, h = data.draw(rows), data.draw(widths)
    tensors = {"gate_up": make_tensor((n, 2 * h + (fault == "shape")), dtype, data.draw(layouts),
                                      requires_grad=True, scale=2.0)}
    call = lambda: tigon.ops.moe_glu(**tensors, **options)  # noqa: E731
    if fault != "none":
        expect_error(call, {"dtype": "gate_up", "shape": "gate_up", "option": bad}[fault])
        return
    run(tigon.ops.moe_glu, moe_glu_reference, tensors, options, {**options, "io_dtype": dtype}, dtype,
        out_names=("h",), stride0=data.draw(st.booleans()))


# -------------------------------------------------------------------------------------------- rotary


def _rotary_inputs(data, fault, dtype, unsqueeze_dim, streams=None):
    batch, heads_q, heads_k = data.draw(st.sampled_from(((1, 2, 1), (2, 3, 3), (2, 1, 1))), label="B, Hq, Hk")
    length = data.draw(st.sampled_from((0, 1, 5)), label="T")
    head_dim, rot_dim = data.draw(st.sampled_from(((8, 8), (8, 6), (12, 8), (2, 2))), label="D, Dr")
    first, other = first_dtype(fault, dtype)

    def qk(heads, dtype):
        shape = (batch, heads, length, head_dim) if unsqueeze_dim == 1 else (batch, length, heads, head_dim)
        return make_tensor(shape, dtype, data.draw(layouts), requires_grad=True)

    q, k = qk(heads_q, first), qk(heads_k, other)
    cos_length = length + (fault == "shape")
    lead = (3, batch) if streams else data.draw(st.sampled_from(((), (batch,))), label="cos lead")
    angles = torch.randn(*lead, cos_length, rot_dim, device=DEVICE) * 3
    layout = data.draw(layouts, label="cos/sin layout")
    cos = make_tensor(angles.shape, other, layout, values=angles.cos())
    sin = make_tensor(angles.shape, other, layout, values=angles.sin())
    return {"q": q, "k": k, "cos": cos, "sin": sin}


@property_settings(MAX_EXAMPLES["rope"])
@given(st.data())
def test_rope(data):
    fault, dtype, options, bad = draw_case(data, {"unsqueeze_dim": (1, 2)}, INVALID["rope"])
    unsqueeze_dim = options["unsqueeze_dim"] if bad is None else 1
    tensors = _rotary_inputs(data, fault, dtype, unsqueeze_dim)
    call = lambda: tigon.ops.rope(**tensors, **options)  # noqa: E731
    if fault != "none":
        expect_error(call, {"dtype": "q", "shape": "cos", "option": bad}[fault])
        return
    run(tigon.ops.rope, rope_reference, tensors, options, {**options, "io_dtype": dtype}, dtype,
        out_names=("q_out", "k_out"), stride0=data.draw(st.booleans()))


@property_settings(MAX_EXAMPLES["mrope"])
@given(st.data())
def test_mrope(data):
    fault, dtype, options, bad = draw_case(
        data, {"unsqueeze_dim": (1, 2), "interleaved": (False, True)},
        {**INVALID["mrope"], "mrope_section": ("sum", "type")},
    )
    unsqueeze_dim = options["unsqueeze_dim"] if bad != "unsqueeze_dim" else 1
    tensors = _rotary_inputs(data, fault, dtype, unsqueeze_dim, streams=True)
    half = tensors["cos"].shape[-1] // 2
    section = {1: [1, 0, 0], 3: [1, 1, 1], 4: [2, 1, 1]}[half]
    if bad == "mrope_section":  # three ints that do not sum to Dr / 2, or not ints
        section = [half, 1, 0] if options.pop("mrope_section") == "sum" else [float(n) for n in section]
    call = lambda: tigon.ops.mrope(**tensors, mrope_section=section, **options)  # noqa: E731
    if fault != "none":
        expect_error(call, {"dtype": "q", "shape": "cos", "option": bad}[fault])
        return
    run(lambda **t: tigon.ops.mrope(**t, mrope_section=section, **options), mrope_reference, tensors, {},
        {**options, "mrope_section": section, "io_dtype": dtype}, dtype, out_names=("q_out", "k_out"),
        stride0=data.draw(st.booleans()))


# ------------------------------------------------------------------------------------------- losses

CE_VALID = {"reduction": ("mean", "sum", "none"), "label_smoothing": (0.0, 0.1), "z_loss": (0.0, 1e-3),
            "softcap": (None, 3.0), "logit_scale": (1.0, 0.5)}
CE_INVALID = {"reduction": ("avg", None), "label_smoothing": (*NOT_NUMBERS, 1.5, -0.1),
              "z_loss": (*NOT_NUMBERS, -1.0, INF), "softcap": ("3", True, NAN, 0.0, INF),
              "logit_scale": (*NOT_NUMBERS, INF), "ignore_index": (1.5, "-100", None)}


def _targets(data, shape, vocab, fault):
    """Class ids with about a quarter ignored (-100); a "shape" fault gives a wrong shape or, half the
    time, an id outside [0, vocab) (eager mode checks the values)."""
    target = torch.randint(0, vocab, shape, device=DEVICE)
    target[torch.rand(shape, device=DEVICE) < 0.25] = -100
    if fault == "shape":
        if data.draw(st.booleans(), label="out-of-range id") and target.numel():
            target.view(-1)[0] = vocab
        else:
            target = torch.zeros((*shape[:-1], shape[-1] + 1) if shape else (1,), dtype=torch.int64, device=DEVICE)
    return target.to(data.draw(st.sampled_from((torch.int64, torch.int32)), label="target dtype"))


@property_settings(MAX_EXAMPLES["cross_entropy"])
@given(st.data())
def test_cross_entropy(data):
    fault, dtype, options, bad = draw_case(data, CE_VALID, CE_INVALID)
    lead = data.draw(st.sampled_from(((0,), (1,), (5,), (2, 3))), label="leading shape")
    vocab = data.draw(st.sampled_from((1, 3, 13, 37)), label="V")
    logits = make_tensor((*lead, vocab), dtype, data.draw(layouts), requires_grad=True, scale=3.0)
    target = _targets(data, lead, vocab, fault)
    call = lambda: tigon.ops.cross_entropy(logits, target, **options)  # noqa: E731
    if fault != "none":
        expect_error(call, {"dtype": "logits", "shape": "target", "option": bad}[fault])
        return
    run(lambda logits: tigon.ops.cross_entropy(logits, target, **options), cross_entropy_reference,
        {"logits": logits}, {}, {**options, "target": target}, dtype, out_names=("loss",), loss=True,
        stride0=data.draw(st.booleans()))


@property_settings(MAX_EXAMPLES["fused_linear_cross_entropy"])
@given(st.data())
def test_fused_linear_cross_entropy(data):
    fault, dtype, options, bad = draw_case(data, CE_VALID, CE_INVALID)
    n, hidden = data.draw(rows), data.draw(widths)
    vocab = data.draw(st.sampled_from((1, 3, 13, 37)), label="V")
    first, other = first_dtype(fault, dtype)
    tensors = {
        "input": make_tensor((n, hidden), first, data.draw(layouts), requires_grad=True),
        "linear_weight": make_tensor((vocab, hidden + (fault == "shape")), other, data.draw(head_layouts),
                                     requires_grad=True, scale=hidden**-0.5),
        "linear_bias": (make_tensor((vocab,), other, data.draw(layouts), requires_grad=True, scale=0.3)
                        if data.draw(st.booleans(), label="bias") else None),
    }
    target = _targets(data, (n,), vocab, "none")
    call = lambda: tigon.ops.fused_linear_cross_entropy(**tensors, target=target, **options)  # noqa: E731
    if fault != "none":
        expect_error(call, {"dtype": "input", "shape": "linear_weight", "option": bad}[fault])
        return
    run(lambda **t: tigon.ops.fused_linear_cross_entropy(**t, target=target, **options),
        fused_linear_cross_entropy_reference, tensors, {}, {**options, "target": target, "io_dtype": dtype},
        dtype, out_names=("loss",), loss=True, stride0=data.draw(st.booleans()))


def _log_probs(data, shape, dtype, *, requires_grad, layout=None):
    values = torch.log_softmax(torch.randn(shape, device=DEVICE) * 2, dim=-1) if shape[-1] else torch.zeros(shape)
    return make_tensor(shape, dtype, layout or data.draw(layouts), requires_grad=requires_grad, values=values)


@property_settings(MAX_EXAMPLES["kl_div"])
@given(st.data())
def test_kl_div(data):
    fault, dtype, options, bad = draw_case(
        data, {"reduction": ("batchmean", "sum", "mean", "none"), "log_target": (False, True)},
        INVALID["kl_div"],
    )
    lead = data.draw(st.sampled_from(((0,), (1,), (5,), (2, 3))), label="leading shape")
    vocab = data.draw(widths, label="V")
    first, other = first_dtype(fault, dtype)
    log_target = options["log_target"] is True
    tensors = {"input": _log_probs(data, (*lead, vocab), first, requires_grad=True)}
    target = _log_probs(data, (*lead, vocab + (fault == "shape")), other, requires_grad=True)
    tensors["target"] = target if log_target else make_tensor(
        target.shape, other, data.draw(layouts), requires_grad=True, values=target.detach().float().exp())
    call = lambda: tigon.ops.kl_div(**tensors, **options)  # noqa: E731
    if fault != "none":
        expect_error(call, {"dtype": "input", "shape": "target", "option": bad}[fault])
        return
    run(tigon.ops.kl_div, kl_div_reference, tensors, options, options, dtype, out_names=("loss",), loss=True,
        stride0=data.draw(st.booleans()))


# One class makes every log-probability 0 and the JSD exactly 0, which its fp64 reference computes as
# rounding noise through logaddexp(log β, log(1 − β)): no relative tolerance measures that.
DIVERGENCE_VOCABS = st.sampled_from((2, 3, 8, 13))


def _divergence_test(data, op, reference, valid, invalid):
    fault, dtype, options, bad = draw_case(data, valid, invalid)
    lead = data.draw(st.sampled_from(((0,), (1,), (5,), (2, 3))), label="leading shape")
    vocab = data.draw(DIVERGENCE_VOCABS, label="V")
    first, other = first_dtype(fault, dtype)
    tensors = {"student_logprobs": _log_probs(data, (*lead, vocab), first, requires_grad=True),
               "teacher_logprobs": _log_probs(data, (*lead, vocab + (fault == "shape")), other,
                                              requires_grad=False)}
    if data.draw(st.booleans(), label="labels"):
        options["labels"] = _targets(data, lead, max(vocab, 1), "none")
    call = lambda: op(**tensors, **options)  # noqa: E731
    if fault != "none":
        expect_error(call, {"dtype": "student_logprobs", "shape": "teacher_logprobs", "option": bad}[fault])
        return
    run(op, reference, tensors, options, options, dtype, out_names=("loss",), loss=True)


@property_settings(MAX_EXAMPLES["jsd"])
@given(st.data())
def test_jsd(data):
    _divergence_test(data, tigon.ops.jsd, jsd_reference, {"beta": (0.5, 0.0, 1.0, 0.2)}, INVALID["jsd"])


@property_settings(MAX_EXAMPLES["tvd"])
@given(st.data())
def test_tvd(data):
    _divergence_test(data, tigon.ops.tvd, tvd_reference, {}, INVALID["tvd"])


@property_settings(MAX_EXAMPLES["fused_linear_jsd"])
@given(st.data())
def test_fused_linear_jsd(data):
    fault, dtype, options, bad = draw_case(
        data, {"beta": (0.5, 0.0, 1.0), "temperature": (1.0, 0.7)},
        INVALID["fused_linear_jsd"],
    )
    n, hidden, teacher_hidden = data.draw(rows), data.draw(widths), data.draw(widths)
    vocab = data.draw(DIVERGENCE_VOCABS, label="V")
    first, other = first_dtype(fault, dtype)
    tensors = {
        "student_input": make_tensor((n, hidden), first, data.draw(layouts), requires_grad=True),
        "student_weight": make_tensor((vocab, hidden), other, data.draw(head_layouts), requires_grad=True,
                                      scale=hidden**-0.5),
        "teacher_input": make_tensor((n, teacher_hidden), other, data.draw(layouts)),
        "teacher_weight": make_tensor((vocab + (fault == "shape"), teacher_hidden), other, data.draw(head_layouts),
                                      scale=teacher_hidden**-0.5),
    }
    if data.draw(st.booleans(), label="labels"):
        options["labels"] = _targets(data, (n,), vocab, "none")
    call = lambda: tigon.ops.fused_linear_jsd(**tensors, **options)  # noqa: E731
    if fault != "none":
        expect_error(call, {"dtype": "student_input", "shape": "teacher_weight", "option": bad}[fault])
        return
    run(tigon.ops.fused_linear_jsd, fused_linear_jsd_reference, tensors, options, {**options, "io_dtype": dtype},
        dtype, out_names=("loss",), loss=True)


@property_settings(MAX_EXAMPLES["fused_linear_logprobs"])
@given(st.data())
def test_fused_linear_logprobs(data):
    fault, dtype, options, bad = draw_case(
        data, {"temperature": (1.0, 0.7), "softcap": (None, 2.0), "logit_scale": (1.0, 0.5),
               "entropy": (False, True)},
        INVALID["fused_linear_logprobs"],
    )
    lead = data.draw(st.sampled_from(((0,), (1,), (5,), (2, 3))), label="leading shape")
    hidden = data.draw(widths)
    vocab = data.draw(st.sampled_from((1, 3, 13, 37)), label="V")
    first, other = first_dtype(fault, dtype)
    tensors = {
        "input": make_tensor((*lead, hidden), first, data.draw(layouts), requires_grad=True),
        "linear_weight": make_tensor((vocab, hidden), other, data.draw(head_layouts), requires_grad=True,
                                     scale=hidden**-0.5),
        "linear_bias": (make_tensor((vocab,), other, data.draw(layouts), requires_grad=True, scale=0.3)
                        if data.draw(st.booleans(), label="bias") else None),
    }
    target = _targets(data, lead, vocab, fault)
    call = lambda: tigon.ops.fused_linear_logprobs(**tensors, target=target, **options)  # noqa: E731
    if fault != "none":
        expect_error(call, {"dtype": "input", "shape": "target", "option": bad}[fault])
        return
    run(lambda **t: tigon.ops.fused_linear_logprobs(**t, target=target, **options),
        fused_linear_logprobs_reference, tensors, {}, {**options, "target": target}, dtype,
        out_names=("logprobs", "entropy"), stride0=data.draw(st.booleans()))


def _token_stats_reference(input, linear_weight, target, *, linear_bias=None, temperature=1.0, softcap=None,
                           logit_scale=1.0, ignore_index=-100, entropy=False):
    """fused_linear_token_stats' docstring in float64: the head's reference, then log Σ p², the mean of
    the scaled logits z and whether the target is argmax z (detached; 0 / False where ignored)."""
    logprobs, ent = fused_linear_logprobs_reference(
        input, linear_weight, target, linear_bias=linear_bias, temperature=temperature, softcap=softcap,
        logit_scale=logit_scale, ignore_index=ignore_index, entropy=entropy)
    with torch.no_grad():
        z = torch.nn.functional.linear(input, linear_weight, linear_bias) * logit_scale
        z = (z if softcap is None else softcap * torch.tanh(z / softcap)) / temperature
        valid = target != ignore_index
        log_sum_sq = torch.logsumexp(2 * torch.log_softmax(z, dim=-1), dim=-1) * valid
        top1 = (z.argmax(-1) == target) & valid
    return logprobs, ent, log_sum_sq, z.mean(-1) * valid, top1


@property_settings(MAX_EXAMPLES["fused_linear_token_stats"])
@given(st.data())
def test_fused_linear_token_stats(data):
    fault, dtype, options, bad = draw_case(
        data, {"temperature": (1.0, 0.7), "softcap": (None, 2.0), "logit_scale": (1.0, 0.5),
               "entropy": (False, True)},
        {**INVALID["fused_linear_logprobs"], "entropy": ("yes", None), "extras": (1, None)},
    )
    lead = data.draw(st.sampled_from(((0,), (1,), (5,), (2, 3))), label="leading shape")
    hidden = data.draw(widths)
    vocab = data.draw(st.sampled_from((2, 3, 13, 37)), label="V")
    first, other = first_dtype(fault, dtype)
    tensors = {
        # fp32 operands: is_top1 compares an fp32 argmax with the fp64 one, which near-ties of rounded
        # half-precision products could flip (test_fused_linear_logprobs.py covers those dtypes)
        "input": make_tensor((*lead, hidden), first if fault == "dtype" else torch.float32, data.draw(layouts),
                             requires_grad=True),
        "linear_weight": make_tensor((vocab, hidden), torch.float32, data.draw(head_layouts), requires_grad=True,
                                     scale=hidden**-0.5),
    }
    target = _targets(data, lead, vocab, fault)
    extras = options.pop("extras", True)
    call = lambda: tigon.ops.fused_linear_token_stats(**tensors, target=target, extras=extras, **options)  # noqa: E731
    if fault != "none":
        expect_error(call, {"dtype": "input", "shape": "target", "option": bad}[fault])
        return
    run(lambda **t: tuple(tigon.ops.fused_linear_token_stats(**t, target=target, extras=True, **options)),
        _token_stats_reference, tensors, {}, {**options, "target": target}, torch.float32,
        out_names=("logprobs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"))


def test_every_public_op_has_a_property_test():
    """A new op in ``tigon.ops.__all__`` needs its property test (or a reason here not to have one)."""
    without = {
        "vocab_parallel_cross_entropy": "needs a process group; tests/patching/test_tensor_parallel.py",
    }
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    assert set(tigon.ops.__all__) - set(without) <= tested
    assert set(MAX_EXAMPLES) <= tested


def _small_call(name):
    """A valid fp32 call of op ``name`` on tiny inputs, taking the options as keywords."""
    x, r, w = torch.randn(3, 8, device=DEVICE), torch.randn(3, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    lp = torch.log_softmax(torch.randn(3, 5, device=DEVICE), dim=-1)
    target = torch.tensor([0, 4, -100], device=DEVICE)
    head_w = torch.randn(5, 8, device=DEVICE)
    q, cos, streams = (torch.randn(1, 2, 3, 8, device=DEVICE), torch.randn(3, 8, device=DEVICE),
                       torch.randn(3, 1, 3, 8, device=DEVICE))
    ops = tigon.ops
    return {
        "rms_norm": lambda **o: ops.rms_norm(x, w, **o),
        "add_rms_norm": lambda **o: ops.add_rms_norm(x, r, w, **o),
        "post_norm_join": lambda **o: ops.post_norm_join(x, r, w, **o),
        "sandwich_norm_join": lambda **o: ops.sandwich_norm_join(x, r, w, w, **o),
        "layer_norm": lambda **o: ops.layer_norm(x, w, w, **o),
        "geglu": lambda **o: ops.geglu(x, r, **o),
        "moe_glu": lambda **o: ops.moe_glu(x, **o),
        "rope": lambda **o: ops.rope(q, q, cos, cos, **o),
        "mrope": lambda **o: ops.mrope(q, q, streams, streams, [2, 1, 1], **o),
        "cross_entropy": lambda **o: ops.cross_entropy(lp, target, **o),
        "fused_linear_cross_entropy": lambda **o: ops.fused_linear_cross_entropy(x, head_w, target, **o),
        "kl_div": lambda **o: ops.kl_div(lp, lp.exp(), **o),
        "jsd": lambda **o: ops.jsd(lp, lp.flip(0), **o),
        "tvd": lambda **o: ops.tvd(lp, lp.flip(0), **o),
        "fused_linear_jsd": lambda **o: ops.fused_linear_jsd(x, head_w, r, head_w, **o),
        "fused_linear_logprobs": lambda **o: ops.fused_linear_logprobs(x, head_w, target, **o),
        # every check runs before the first collective: no process group is needed to be refused
        "vocab_parallel_cross_entropy": lambda **o: ops.vocab_parallel_cross_entropy(
            x, head_w, target, **{"vocab_start": 0, "vocab_size": 5, **o}),
    }[name]


EVERY_INVALID = {
    **{name: {**NORM_INVALID, **INVALID.get(name, {})}
       for name in ("rms_norm", "add_rms_norm", "post_norm_join", "sandwich_norm_join")},
    "cross_entropy": CE_INVALID, "fused_linear_cross_entropy": CE_INVALID,
    "vocab_parallel_cross_entropy": {**CE_INVALID, "vocab_start": ("0", 1.0, None), "vocab_size": (5.0, True)},
    **{name: invalid for name, invalid in INVALID.items() if name != "sandwich_norm_join"},
}
INVALID_CASES = [(op, option, value) for op, invalid in EVERY_INVALID.items()
                 for option, values in invalid.items() for value in values]


@pytest.mark.parametrize(("op", "option", "value"), INVALID_CASES,
                         ids=[f"{op}-{option}={value!r}" for op, option, value in INVALID_CASES])
def test_every_invalid_option_is_named(op, option, value):
    """Each refused value of each option, one at a time on a valid call: TypeError (not a number, not
    an int, not a bool) or ValueError (out of range, unknown choice), naming the option."""
    expect_error(lambda: _small_call(op)(**{option: value}), option)
