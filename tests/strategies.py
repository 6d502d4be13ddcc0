"""Hypothesis strategies and the one check every property test makes (tests/ops/test_properties.py,
tests/losses/test_properties.py).

A case draws a dtype (fp32/fp16/bf16, or one the ops refuse), a layout for every input tensor
(contiguous, last dim strided, last two dims stored transposed, or a row broadcast with stride 0), a
size (0 rows and odd widths included) and option values, valid or not. :func:`expect_error` runs the
op on a case that must be refused: a ValueError or TypeError whose message names the argument, and
nothing else. :func:`check_outputs` compares a valid case with the op's float64 reference: equal
NaN / ±inf positions (the reference's ``"mean"`` over nothing, say) and the API.md tolerances on the
finite values.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from tests.helpers import DEVICE, DTYPES, TOLERANCE, assert_close

# Deterministic: derandomize draws the same examples on every run, so CI sees a fixed set of cases.
# The interpreter is slow; each op's test runs its own max_examples (tests count the sum).
HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def property_settings(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, suppress_health_check=HEALTH,
                    database=None, print_blob=False, phases=(Phase.explicit, Phase.generate, Phase.shrink))


# The kernels' dtypes, and two they refuse (an integer one, and float64, which no kernel reads).
BAD_DTYPES = (torch.int32, torch.float64)
good_dtypes = st.sampled_from(DTYPES)
bad_dtypes = st.sampled_from(BAD_DTYPES)
LAYOUTS = ("contiguous", "strided", "transposed", "broadcast")
layouts = st.sampled_from(LAYOUTS)
# An LM head's rows broadcast from one would make every logit equal: the gradients cancel to rounding
# noise, which no relative tolerance measures. Heads take the other layouts.
head_layouts = st.sampled_from(LAYOUTS[:-1])
rows = st.sampled_from((0, 1, 3, 5))
widths = st.sampled_from((1, 3, 8, 13))


def make_tensor(shape, dtype, layout="contiguous", *, requires_grad=False, scale=1.0, values=None):
    """A tensor of ``shape`` and ``dtype`` in ``layout``, as a view of a leaf (gradients reach it).

    ``values`` (an fp32 tensor of ``shape``) gives the values; else normal draws times ``scale``.
    ``"broadcast"`` repeats the first row of the leading dim with stride 0 (when it has more than one
    row), ``"transposed"`` stores the last two dims swapped, ``"strided"`` steps the last dim by 2.
    Integer dtypes hold small integers.
    """
    shape = tuple(shape)
    base = values if values is not None else torch.randn(shape, device=DEVICE) * scale
    if not dtype.is_floating_point:
        base = base.round()
    if layout == "broadcast" and len(shape) >= 1 and shape[0] > 1:
        row = base[:1].to(dtype).detach().requires_grad_(requires_grad and dtype.is_floating_point)
        return row.expand(shape)
    leaf = base.to(dtype).detach()
    if layout == "transposed" and len(shape) >= 2:
        leaf = leaf.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif layout == "strided" and len(shape) >= 1:
        wide = torch.zeros((*shape[:-1], 2 * shape[-1]), dtype=dtype, device=leaf.device)
        leaf = wide[..., ::2].copy_(leaf)
    leaf = leaf.detach().requires_grad_(requires_grad and dtype.is_floating_point)
    # a view of the leaf, so every layout is a non-leaf tensor whose gradient autograd.grad returns
    return leaf[...] if leaf.requires_grad else leaf


def expect_error(call, name: str, error=(TypeError, ValueError)):
    """``call()`` must raise ValueError or TypeError whose message names ``name``; nothing else."""
    with pytest.raises(error) as info:
        call()
    assert name in str(info.value), f"the error does not name {name!r}: {info.value}"


def _finite_close(out, ref, dtype, what, tolerance):
    out, ref = out.detach(), ref.detach()
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    ref_rounded = ref.to(out.dtype) if out.is_floating_point() else ref
    bad_out, bad_ref = ~torch.isfinite(out), ~torch.isfinite(ref_rounded)
    assert torch.equal(bad_out, bad_ref), f"{what}: non-finite at other positions than the reference's"
    assert torch.equal(out[bad_out].isnan(), ref_rounded[bad_ref].isnan()), f"{what}: NaN against ±inf"
    keep = ~bad_ref
    assert_close(out[keep], ref[keep], dtype, what, tolerance=tolerance)


def check_outputs(outs, refs, dtype, names, tolerance=None):
    """Each output against its reference (same order), within ``tolerance[dtype]`` (TOLERANCE)."""
    tolerance = tolerance or TOLERANCE
    for out, ref, what in zip(outs, refs, names, strict=True):
        if out is None and ref is None:
            continue
        _finite_close(out, ref, dtype, what, tolerance)


def grads_of(outputs, grad_outputs, inputs: dict):
    """Gradients of ``outputs`` (with ``grad_outputs``) for the inputs that require grad, by name."""
    names = [n for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o is not None and o.requires_grad]
    if not names or not pairs:
        return {}
    got = torch.autograd.grad([o for o, _ in pairs], [inputs[n] for n in names], [g for _, g in pairs],
                              allow_unused=True)
    return {n: g for n, g in zip(names, got, strict=True) if g is not None}


def grad_output_like(t: torch.Tensor, stride0: bool) -> torch.Tensor:
    """A random upstream gradient for ``t``: stride 0 everywhere (as ``.sum()`` gives) or dense."""
    if stride0 or t.dim() == 0:
        return torch.randn((), device=t.device).to(t.dtype).expand_as(t)
    return torch.randn(t.shape, device=t.device).to(t.dtype)
