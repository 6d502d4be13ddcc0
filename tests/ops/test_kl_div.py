"""tigon.ops.kl_div against ``F.kl_div`` in fp64.

Shapes sit on the tiling's regime boundaries (elementwise_tiles.py's elementwise_tile_launch): rows shorter than a tile
(several rows per tile), a row of exactly TILE_ELEMENTS, rows past it (several column tiles, so the
1-D grid's row/column split is exercised), one row, 1-D and 0-D inputs (batchmean's divisor is then
the length, or nothing).
"""

import pytest
import torch

from tests.helpers import (
    DEVICE,
    DTYPES,
    LOSS_TOLERANCE,
    assert_close,
    fp64_reference,
    noncontiguous,
    randn,
    stride0_like,
)
from tigon._kernels.elementwise_tiles import CONFIG as TILE_CONFIG
from tigon.ops.kl_div import REDUCTIONS, kl_div, kl_div_reference

TILE_ELEMENTS = TILE_CONFIG.tile_elements

pytestmark = [
    pytest.mark.filterwarnings("ignore:reduction. 'mean' divides the total loss"),
]


def randn_like_shape(shape, dtype=torch.float32):
    return randn(*shape, dtype=dtype) if shape else randn(1, dtype=dtype).reshape(())

SHAPES = ((1, 7), (37, 300), (3, TILE_ELEMENTS), (2, TILE_ELEMENTS + 5), (2, 3, 100), (1000,), ())


def make_pair(shape, dtype, log_target, *, input_grad=True, target_grad=False):
    """log q from a log_softmax, and p (or log p) from another: real distributions, never zeros."""
    if shape == ():
        x, t = randn(1).log_softmax(-1).reshape(()) - 0.5, randn(1).sigmoid().reshape(())
        t = t.log() if log_target else t
    else:
        x = (randn(*shape) * 2).log_softmax(-1)
        t = (randn(*shape) * 2).log_softmax(-1)
        t = t if log_target else t.exp()
    return x.to(dtype).requires_grad_(input_grad), t.to(dtype).requires_grad_(target_grad)


def check_kl_div(x, t, reduction, log_target, grad=None):
    dtype = x.dtype
    out = kl_div(x, t, reduction=reduction, log_target=log_target)
    ref, ref_grads = fp64_reference(
        kl_div_reference, {"input": x, "target": t}, grad, reduction=reduction, log_target=log_target
    )
    assert out.dtype == torch.promote_types(x.dtype, t.dtype)
    assert out.shape == ref.shape
    assert_close(out, ref, dtype, "loss", tolerance=LOSS_TOLERANCE if reduction != "none" else None)
    names = [n for n, v in (("input", x), ("target", t)) if v.requires_grad]
    grads = torch.autograd.grad(out, [{"input": x, "target": t}[n] for n in names], grad)
    for name, g in zip(names, grads, strict=True):
        assert g.dtype == {"input": x, "target": t}[name].dtype
        assert_close(g, ref_grads[name], dtype, f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("log_target", (False, True))
def test_kl_div_reductions(dtype, reduction, log_target):
    x, t = make_pair((37, 300), dtype, log_target)
    grad = randn(37, 300, dtype=dtype) if reduction == "none" else None
    check_kl_div(x, t, reduction, log_target, grad)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("reduction", ("none", "batchmean"))
@pytest.mark.parametrize("log_target", (False, True))
def test_kl_div_shapes(shape, reduction, log_target):
    x, t = make_pair(shape, torch.float32, log_target)
    grad = randn_like_shape(shape) if reduction == "none" else None
    check_kl_div(x, t, reduction, log_target, grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("log_target", (False, True))
@pytest.mark.parametrize("reduction", ("none", "sum"))
def test_kl_div_target_gradient(dtype, log_target, reduction):
    """torch differentiates the target too; so does this op when the target asks for it."""
    x, t = make_pair((5, 130), dtype, log_target, input_grad=False, target_grad=True)
    check_kl_div(x, t, reduction, log_target, randn(5, 130, dtype=dtype) if reduction == "none" else None)
    x.requires_grad_()
    check_kl_div(x, t, reduction, log_target, randn(5, 130, dtype=dtype) if reduction == "none" else None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ("none", "mean"))
def test_kl_div_noncontiguous_and_stride0_grad(dtype, reduction):
    x, _ = make_pair((6, 700), dtype, False)
    x = noncontiguous(x.detach().requires_grad_())
    t = (randn(6, 1400) * 2).softmax(-1).to(dtype)[:, ::2]  # column stride 2 as well
    grad = stride0_like(x) if reduction == "none" else None
    check_kl_div(x, t, reduction, False, grad)


def test_kl_div_transposed_target():
    x, _ = make_pair((40, 30), torch.float32, False)
    t = (randn(30, 40) * 2).softmax(0).t()  # column stride 40, row stride 1
    check_kl_div(x, t, "batchmean", False)


@pytest.mark.parametrize("reduction", ("none", "sum"))
def test_kl_div_mixed_dtypes(reduction):
    """bf16 log q with fp32 targets: torch promotes the result (and "none" output) to fp32."""
    x, t = make_pair((9, 200), torch.bfloat16, False)
    t = t.float()
    check_kl_div(x, t, reduction, False, randn(9, 200) if reduction == "none" else None)


def test_kl_div_zero_target_entries():
    """p = 0 contributes 0 (xlogy), and its input gradient is 0."""
    x, t = make_pair((4, 50), torch.float32, False)
    t = t.detach().clone()
    t[:, ::3] = 0.0
    out = kl_div(x, t)
    ref = kl_div_reference(x.detach().double(), t.double())
    assert_close(out, ref, torch.float32, "loss", tolerance=LOSS_TOLERANCE)
    (dx,) = torch.autograd.grad(out, (x,))
    assert torch.count_nonzero(dx[:, ::3]) == 0


def _special_pair(log_target):
    """log q and p with the values where torch's definitions decide: p = 0 (with finite, -inf and 0
    log q), p = 1, p < 0, p NaN, log q = ±inf; with ``log_target`` the log of that p (-inf at p = 0)."""
    x = torch.log_softmax(randn(3, 9), dim=-1)
    t = torch.rand(3, 9, device=DEVICE) * 0.9 + 0.05
    inf = float("inf")
    t[0, 0] = 0.0
    t[0, 1], x[0, 1] = 0.0, -inf
    t[0, 2], x[0, 2] = 0.0, 0.0
    x[0, 3] = -inf
    x[0, 4] = inf
    t[1, 0] = 1.0
    t[1, 1] = -0.5
    t[1, 2] = float("nan")
    t[2, :] = 0.0  # a whole row of p = 0
    return x, (t.log() if log_target else t)


def _same_values(out, ref, what):
    """Equal NaN and ±inf positions, the finite values within fp32's loss tolerance."""
    assert torch.equal(out.isnan(), ref.isnan()), f"{what}: NaN at {out.isnan()} vs torch's {ref.isnan()}"
    assert torch.equal(out.isinf(), ref.isinf()) and torch.equal(out[out.isinf()], ref[ref.isinf()]), what
    finite = ref.isfinite()
    torch.testing.assert_close(out[finite].double(), ref[finite], rtol=1e-5, atol=1e-6, msg=what)


@pytest.mark.parametrize("log_target", (False, True))
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_kl_div_matches_torch_at_zero_targets_and_infinities(reduction, log_target):
    """Where p = 0 (or log p = -inf) and where log q is infinite, the loss and both gradients are
    torch's, NaN and ±inf included: xlogy(0, 0) = 0 in the loss; torch's derivative of xlogy(p, p)
    in p is NaN at p = 0, and the input gradient there is −p·γ = 0."""
    x, t = _special_pair(log_target)
    grad = randn(3, 9) if reduction == "none" else torch.tensor(1.3, device=DEVICE)
    if reduction == "none":
        grad[1, 3] = 0.0
    results = []
    for fn in (kl_div, torch.nn.functional.kl_div):
        xs, ts = x.clone().requires_grad_(), t.clone().requires_grad_()
        xs64, ts64 = (xs.double(), ts.double()) if fn is not kl_div else (xs, ts)
        out = fn(xs64, ts64, reduction=reduction, log_target=log_target)
        dx, dt = torch.autograd.grad(out, (xs, ts), grad.to(out.dtype))
        results.append((out.detach(), dx, dt))
    for what, ours, theirs in zip(("loss", "input grad", "target grad"), *results, strict=True):
        _same_values(ours, theirs.double(), f"{what} ({reduction}, log_target={log_target})")


def test_kl_div_default_is_batchmean():
    x, t = make_pair((8, 16), torch.float32, False)
    assert torch.equal(kl_div(x, t), kl_div(x, t, reduction="batchmean"))
    expected = kl_div(x, t, reduction="sum") / 8
    assert_close(kl_div(x, t), expected, torch.float32, "batchmean", tolerance=LOSS_TOLERANCE)


def test_kl_div_deterministic():
    x, t = make_pair((64, 3000), torch.bfloat16, True)
    first = kl_div(x, t, log_target=True)
    second = kl_div(x, t, log_target=True)
    assert torch.equal(first, second)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: (randn(4, 8), randn(4, 9)), ValueError, "target has shape"),
        (lambda: (randn(4, 8), torch.arange(32, device=DEVICE).view(4, 8)), TypeError, "target has dtype"),
        (lambda: (randn(4, 8, dtype=torch.float64), randn(4, 8)), TypeError, "input has dtype"),
        (lambda: (randn(4, 8), torch.ones(4, 8, device="meta")), ValueError, "target is on meta"),
        (lambda: ("input", randn(4, 8)), TypeError, "input must be a torch.Tensor"),
    ],
)
def test_kl_div_bad_inputs(make, error, match):
    x, t = make()
    before = t.clone() if t.device.type != "meta" else None
    with pytest.raises(error, match=match):
        kl_div(x, t)
    if before is not None:
        assert torch.equal(t, before)


def test_kl_div_bad_options():
    x, t = make_pair((4, 8), torch.float32, False)
    with pytest.raises(ValueError, match="reduction"):
        kl_div(x, t, reduction="elementwise_mean")
    with pytest.raises(TypeError, match="log_target"):
        kl_div(x, t, log_target="yes")


@pytest.mark.gpu
def test_kl_div_torch_compile_fullgraph():
    x, t = make_pair((64, 4096), torch.bfloat16, True)

    def f(x, t):
        return kl_div(x.float().log_softmax(-1), t, log_target=True) + kl_div(x, t.exp(), reduction="sum")

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(x, t)
    (dx,) = torch.autograd.grad(loss, (x,))
    ref = f(x, t)
    (ref_dx,) = torch.autograd.grad(ref, (x,))
    assert_close(loss, ref, torch.bfloat16, "loss", tolerance=LOSS_TOLERANCE)
    assert_close(dx, ref_dx, torch.bfloat16, "dx")


@pytest.mark.gpu
@pytest.mark.bigmem
def test_kl_div_int64_offsets():
    """More than 2**31 elements: the last rows' loss and gradient are right."""
    vocab = 128256
    rows = 2**31 // vocab + 8
    x = torch.randn(rows, vocab, device=DEVICE, dtype=torch.bfloat16).log_softmax(-1).requires_grad_()
    t = torch.randn(rows, vocab, device=DEVICE, dtype=torch.bfloat16).log_softmax(-1)
    out = kl_div(x, t, reduction="none", log_target=True)
    tail = slice(rows - 4, rows)
    ref = kl_div_reference(x[tail].detach().double(), t[tail].double(), reduction="none", log_target=True)
    assert_close(out[tail], ref, torch.bfloat16, "loss tail")
    loss = kl_div(x, t, log_target=True)
    (dx,) = torch.autograd.grad(loss, (x,))
    assert_close(dx[tail], -t[tail].double().exp() / rows, torch.bfloat16, "dx tail")
