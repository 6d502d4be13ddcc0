"""torch.compile(fullgraph=True) of every public op, forward and backward, on the CPU.

The backend is ``aot_eager``: Dynamo traces the call, and AOTAutograd runs every registered op's
fake implementation on fake tensors, functionalizes the in-place ops and traces the backward; the
graphs then run eagerly, so the compiled results must equal the eager ones exactly. (Inductor adds
code generation for the torch ops around tigon's, which under the interpreter stay opaque calls:
``TigonOp``.) On a GPU the ops' own tests compile them with Inductor (tests marked gpu).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers import one_rank_group
from tests.ops.op_cases import CASES, outputs, weighted_sum, with_grad
from tigon.ops import cross_entropy, rms_norm

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's path; on a GPU the ops' own tests compile them with Inductor"
)


def _compiled_and_eager(fn, inputs, **compile_options):
    """Outputs and input gradients of ``fn`` compiled and run eagerly, on copies of the same inputs."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", **compile_options)
    results = []
    for f in (compiled, fn):
        tensors = with_grad(inputs)
        out = f(*tensors)
        leaves = [t for t in tensors if t.requires_grad]
        grads = torch.autograd.grad(weighted_sum(out), leaves, allow_unused=True)
        results.append((outputs(out), grads))
    return results


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_compiled_op_equals_eager(case):
    inputs = case.make_inputs(torch.float32)
    with one_rank_group("gloo") if case.name == "vocab_parallel_cross_entropy" else contextlib.nullcontext():
        (got, got_grads), (want, want_grads) = _compiled_and_eager(case.fn, inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w)
    assert any(w is not None for w in want_grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g is None) == (w is None)
        assert g is None or torch.equal(g, w)


def test_dynamic_shapes_and_an_in_place_gradient():
    """Symbolic sizes reach the launchers (cache_by_size passes them through), and cross_entropy's
    gradient written into the logits' storage (a mutating op) is functionalized; two row counts run
    through the one dynamic graph."""

    def f(x, w, t):
        logits = x @ w.T
        return cross_entropy(logits, t, inplace_backward=True) + rms_norm(x, w[0]).square().sum()

    for rows in (5, 9):
        inputs = (torch.randn(rows, 8), torch.randn(11, 8), torch.randint(0, 11, (rows,)))
        (got, got_grads), (want, want_grads) = _compiled_and_eager(f, inputs, dynamic=True)
        assert torch.equal(got[0], want[0])
        for g, w in zip(got_grads, want_grads, strict=True):
            assert torch.equal(g, w)


def test_norm_rope_and_glu_compile_once_for_every_length_from_their_tile():
    """With dynamic shapes, a length at least the launch's row tile reads as a range (``pow2_at_most``), not a
    number: one graph serves every such length, and each length's result is the eager one."""
    from torch._dynamo.utils import counters

    from tigon.ops import rope, swiglu

    def layer(x, weight, cos, sin, gate):
        h = rms_norm(x, weight, 1e-6)                                    # (B, T, H)
        q = h.view(*h.shape[:2], 2, -1).transpose(1, 2)                   # (B, heads, T, d)
        q, k = rope(q, q, cos, sin)
        return swiglu((q + k).transpose(1, 2).reshape(h.shape), gate)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    gen = torch.Generator().manual_seed(0)
    weight = torch.rand(32, generator=gen) + 0.5
    for length in (520, 648, 776):
        x, gate = (torch.randn(1, length, 32, generator=gen) for _ in range(2))
        angles = torch.rand(1, length, 8, generator=gen) * 6
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        assert torch.equal(compiled(x, weight, cos, sin, gate), layer(x, weight, cos, sin, gate))
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("reduction", ("mean", "none"))
@pytest.mark.parametrize("plan", ("one chunk", "by tokens", "by classes"))
def test_loss_head_compiles_once_for_every_length(plan, reduction, monkeypatch):
    """fused_linear_cross_entropy's chunk loop is one opaque op: with dynamic shapes one graph serves every
    number of tokens, and each length runs the chunks eager mode runs (equal loss and gradients), whether
    the loop goes by tokens, by classes or takes one chunk."""
    from torch._dynamo.utils import counters

    from tigon.ops import fused_linear_cross_entropy
    from tigon.ops import fused_linear_cross_entropy as flce_function

    flce_module = __import__("importlib").import_module(flce_function.__module__)
    forced = {"by tokens": flce_module.ChunkPlan(True, 4), "by classes": flce_module.ChunkPlan(False, 4)}.get(plan)
    if forced is not None:
        monkeypatch.setattr(flce_module, "chunk_plan", lambda *args, **kwargs: forced)

    def loss(x, w, b, t, class_weight, token_weight):
        out = fused_linear_cross_entropy(x, w, t, linear_bias=b, weight=class_weight, label_smoothing=0.1,
                                         z_loss=1e-3, reduction=reduction)
        return out * token_weight if reduction == "none" else out  # "none": each token its own grad_output

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager", dynamic=True)
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(11, 8, generator=gen), torch.randn(11, generator=gen)
    class_weight = torch.rand(11, generator=gen) + 0.5
    for tokens in (5, 9, 14):
        x = torch.randn(tokens, 8, generator=gen)
        t = torch.randint(0, 11, (tokens,), generator=gen)
        t[1] = -100
        token_weight = torch.rand(tokens, generator=gen) + 0.5
        results = []
        for f in (compiled, loss):
            leaves = [x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
            out = f(*leaves, t, class_weight, token_weight)
            results.append((out.detach(), torch.autograd.grad(out.sum(), leaves)))
        (got, got_grads), (want, want_grads) = results
        assert torch.equal(got, want)
        for g, w_ in zip(got_grads, want_grads, strict=True):
            assert torch.equal(g, w_)
    assert counters["stats"]["unique_graphs"] == 1


def test_loss_head_ops_pass_opcheck():
    """The loss head's opaque ops: schema, fake implementation (shapes from symbolic sizes), no aliasing."""
    from tigon.ops import fused_linear_cross_entropy as flce_function

    flce_module = __import__("importlib").import_module(flce_function.__module__)
    gen = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(7, 8, generator=gen), torch.randn(11, 8, generator=gen), torch.randn(11, generator=gen)
    t = torch.randint(0, 11, (7,), generator=gen)
    scales = torch.full((7,), 1 / 7)
    options = (-100, 0.0, 0.0, None, 1.0)
    dtypes = (torch.float32, torch.float32, torch.float32)
    for now, keep_lse in (((True, True, True), False), ((False, False, False), True), ((True, False, False), False)):
        torch.library.opcheck(flce_module.FLCE_PASSES.op, (x, w, b, t, None, scales, *options, *now, keep_lse, *dtypes))
    lse = torch.randn(7, generator=gen)
    torch.library.opcheck(
        flce_module.FLCE_REGRAD.op, (x, w, None, t, None, scales, torch.rand(7, generator=gen), lse, *options,
                                      True, True, False, torch.float32, torch.float32, None),
    )


def test_loss_head_keeps_the_hidden_size_symbolic():
    """With dynamic shapes the hidden size stays a symbol through the loss head's backward (its row-scaling launch
    reads the gradient's width by comparisons, ``pow2_at_most``): one graph serves widths between two powers of
    two. Read as a number there, the width was specialised while Dynamo traced the autograd.Function's backward,
    after its forward had handed the width on as a symbol: a graph per width here, and torch 2.11's Dynamo
    refused the Function (an AssertionError in ``overwrite_tensor_vt_proxy``)."""
    from torch._dynamo.utils import counters

    from tigon.ops import fused_linear_cross_entropy

    def loss(x, w, t):
        return fused_linear_cross_entropy(x, w, t)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager", dynamic=True)
    gen = torch.Generator().manual_seed(0)
    for tokens, hidden in ((30, 40), (45, 48), (20, 56)):
        w = torch.randn(96, hidden, generator=gen)
        x = torch.randn(tokens, hidden, generator=gen)
        t = torch.randint(0, 96, (tokens,), generator=gen)
        results = []
        for f in (compiled, loss):
            leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
            out = f(*leaves, t)
            results.append((out.detach(), torch.autograd.grad(out, leaves)))
        (got, got_grads), (want, want_grads) = results
        assert torch.equal(got, want)
        assert all(torch.equal(g, w_) for g, w_ in zip(got_grads, want_grads, strict=True))
    assert counters["stats"]["unique_graphs"] == 1
