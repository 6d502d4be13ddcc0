"""The eager host path's shortcuts behave as the calls they replace.

- :func:`function_apply` (the C++ autograd apply with tensors unwrapped as ``Function.apply`` unwraps
  them) gives the same outputs, graph and gradients as ``Function.apply``, unwraps a tensor a finished
  functorch transform left behind, and under a transform is ``Function.apply`` itself.
- :class:`TigonOp`'s eager call makes the same node as its Function's ``apply``.
- FastLaunch reads a non-constexpr parameter passed by keyword at each launch (the constexpr tail is
  taken once per cache entry: tests/ops/test_fast_launch.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_fast_launch import FakeKernel, fake_cuda  # noqa: F401  (fixture)
from tigon._kernels import FastLaunch, TigonOp, function_apply


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, factor):
        ctx.save_for_backward(x, w)
        ctx.factor = factor
        return x * w * factor, (x + w).detach()

    @staticmethod
    def backward(ctx, dy, _dz):
        x, w = ctx.saved_tensors
        return dy * w * ctx.factor, (dy * x * ctx.factor).sum(0), None


def test_function_apply_matches_apply():
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    apply = function_apply(_Scale)
    ours, theirs = apply(x, w, 2.5), _Scale.apply(x, w, 2.5)
    assert type(ours[0].grad_fn) is type(theirs[0].grad_fn)
    assert [t.requires_grad for t in ours] == [t.requires_grad for t in theirs]
    grads = torch.autograd.grad(ours[0].sum(), (x, w))
    expected = torch.autograd.grad(theirs[0].sum(), (x, w))
    for got, want in zip(grads, expected, strict=True):
        assert torch.equal(got, want)


def test_function_apply_unwraps_a_dead_wrapper():
    leaked = []

    def f(x):
        leaked.append(x)
        return x.sum()

    torch.func.grad(f)(torch.randn(3))
    dead = leaked[0]  # a functorch wrapper whose transform has finished
    w = torch.randn(3)
    ours, theirs = function_apply(_Scale)(dead, w, 1.5), _Scale.apply(dead, w, 1.5)
    assert torch.equal(ours[0], theirs[0])


def test_function_apply_under_a_transform_is_apply():
    apply = function_apply(_Scale)
    w = torch.randn(3)

    def through(fn):
        return lambda x: fn(x, w, 2.0)[0].sum()

    # Function.apply refuses a Function without setup_context under functorch; so does this.
    with pytest.raises(RuntimeError, match="setup_context") as theirs:
        torch.func.grad(through(_Scale.apply))(torch.randn(3))
    with pytest.raises(RuntimeError, match="setup_context") as ours:
        torch.func.grad(through(apply))(torch.randn(3))
    assert str(ours.value) == str(theirs.value)


def test_function_apply_refuses_setup_context():
    class WithSetup(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, dy):
            return dy * 2

    with pytest.raises(TypeError, match="setup_context"):
        function_apply(WithSetup)


def _double_impl(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


def _double_setup(ctx, inputs, output):
    ctx.factor = inputs[1]


def _double_grad(ctx, dy):
    return dy * ctx.factor, None


_DOUBLE = TigonOp("test_host_path_scale", _double_impl, setup_context=_double_setup, backward=_double_grad)


def test_tigon_op_eager_call_is_its_function():
    x = torch.randn(5, requires_grad=True)
    y = _DOUBLE(x, 3.0)
    assert type(y.grad_fn).__name__ == type(_DOUBLE.function.apply(x, 3.0).grad_fn).__name__
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(dx, torch.full_like(x, 3.0))
    with torch.no_grad():
        assert _DOUBLE(x, 2.0).grad_fn is None


def test_keyword_parameter_that_is_not_constexpr_is_read_each_launch(fake_cuda):  # noqa: F811
    kernel = FakeKernel()
    launch = FastLaunch(kernel)
    x = torch.randn(8)
    launch[(1,)](x, x, 96, 0.5, flag=True, BLOCK=64)
    launch[(2,)](x, x, 112, 0.25, flag=True, BLOCK=64)
    (call,) = kernel.fast_calls
    assert call[9:] == (x, x, 112, 0.25, True, 64, "a")


def test_shortcuts_trace_under_torch_compile():
    """Dynamo traces Function.apply and the registered op, not the shortcuts' C++ calls: no graph break."""
    apply = function_apply(_Scale)
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)

    def f(x, w):
        return apply(x, w, 2.0)[0].sum() + _DOUBLE(x, 3.0).sum()

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    got, want = compiled(x, w), f(x, w)
    assert torch.equal(got, want)
    for g, r in zip(torch.autograd.grad(got, (x, w)), torch.autograd.grad(want, (x, w)), strict=True):
        assert torch.equal(g, r)
