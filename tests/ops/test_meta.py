"""Every public op on meta tensors: outputs of the eager op's shapes and dtypes, on the meta device,
forward and backward, with no kernel launched (the registered ops' Meta kernel is their fake
implementation, ``TigonOp``)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import tigon.ops
from tests.helpers import one_rank_group
from tests.ops.op_cases import CASES, outputs, weighted_sum, with_grad

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="compares with the interpreter's eager run")


def _group(case):
    return one_rank_group("gloo") if case.name == "vocab_parallel_cross_entropy" else contextlib.nullcontext()


def _run(case, tensors):
    tensors = with_grad(tensors)
    out = case.fn(*tensors)
    leaves = [t for t in tensors if t.requires_grad]
    return outputs(out), leaves, torch.autograd.grad(weighted_sum(out), leaves, allow_unused=True)


def test_every_public_op_has_a_case():
    assert {c.name for c in CASES} == set(tigon.ops.__all__)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_meta_inputs_give_meta_outputs_and_gradients(case, dtype):
    inputs = case.make_inputs(dtype)
    with _group(case):
        want, _, want_grads = _run(case, inputs)
        got, leaves, got_grads = _run(case, [t.to("meta") for t in inputs])
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.device.type, g.shape, g.dtype) == ("meta", w.shape, w.dtype)
    for leaf, g, w in zip(leaves, got_grads, want_grads, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            assert (g.device.type, g.shape, g.dtype) == ("meta", leaf.shape, w.dtype)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("rms_norm", "swiglu", "cross_entropy")],
                         ids=lambda c: c.name)
def test_meta_inputs_without_grad(case):
    inputs = case.make_inputs(torch.float32)
    want = outputs(case.fn(*inputs))
    with torch.no_grad():
        got = outputs(case.fn(*[t.to("meta") for t in inputs]))
    assert [(g.device.type, g.shape, g.dtype) for g in got] == [("meta", w.shape, w.dtype) for w in want]


def test_meta_mixed_with_real_tensors_is_an_error_naming_the_argument():
    x = torch.randn(3, 8, device="meta")
    with pytest.raises(ValueError, match="weight"):
        tigon.ops.rms_norm(x, torch.randn(8))


def test_meta_output_dtype_follows_promotion():
    """bf16 x with an fp32 weight (autocast's master weights): rms_norm's output is fp32, as eagerly."""
    x, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(8)
    want = tigon.ops.rms_norm(x, w)
    got = tigon.ops.rms_norm(x.to("meta"), w.to("meta"))
    assert (got.device.type, got.shape, got.dtype) == ("meta", want.shape, want.dtype) and want.dtype == torch.float32
