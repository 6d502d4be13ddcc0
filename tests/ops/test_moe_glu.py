"""tigon.ops.moe_glu against the eager ``_apply_gate`` in fp64 with eager's roundings.

Regimes of the launch (glu.py's strided tiles): rows shorter than a column block (several rows per
program), I = max_block_n + 5 (two column blocks, the second partial), one token; operands contiguous,
column-strided (a transposed view: column stride = row count), and a stride-0 gradient from ``.sum()``.
GPT-OSS's clamps are exercised by values past ±limit on both g and u (scale 4 against limit 3), and by
values exactly at the limit, where autograd's clamp passes the gradient.
"""

import pytest
import torch

from tests.helpers import DEVICE, DTYPES, assert_close, fp64_reference, randn, stride0_like
from tigon.ops.moe_glu import ACTIVATIONS, CLAMPED_SWIGLU, CONFIG, LAYOUTS, moe_glu, moe_glu_reference

# a small limit so that the clamps bite at scale 4 (GPT-OSS's 7.0 with its α 1.702)
OPTIONS = {"alpha": 1.702, "limit": 3.0}


def check(x, layout, activation, dh=None, **options):
    options = {**OPTIONS, **options}
    h = moe_glu(x, layout=layout, activation=activation, **options)
    assert h.dtype == x.dtype and h.shape == (*x.shape[:-1], x.shape[-1] // 2)
    assert h.is_contiguous()
    dh = randn(*h.shape, dtype=x.dtype) if dh is None else dh
    ref, grads = fp64_reference(
        moe_glu_reference, {"gate_up": x}, dh, layout=layout, activation=activation, io_dtype=x.dtype, **options
    )
    assert_close(h, ref, x.dtype, "h")
    (dx,) = torch.autograd.grad(h, x, dh)
    assert dx.dtype == x.dtype and dx.shape == x.shape
    assert_close(dx, grads["gate_up"], x.dtype, "dgate_up")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_glu_layouts_and_activations(dtype, activation, layout):
    x = randn(37, 2 * 40, dtype=dtype, scale=4.0, requires_grad=True)
    check(x, layout, activation)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", ((1, 2), (3, 2 * (CONFIG.max_block_n + 5)), (2, 3, 2 * 24)), ids=str)
def test_moe_glu_tile_regimes(layout, shape):
    x = randn(*shape, dtype=torch.bfloat16, scale=4.0, requires_grad=True)
    check(x, layout, "silu")
    check(x, layout, CLAMPED_SWIGLU)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation", ("silu", CLAMPED_SWIGLU))
def test_moe_glu_strided_input_and_stride0_grad(layout, activation):
    """x as a transposed view (column stride = rows), and dh with every stride 0."""
    x = randn(2 * 30, 9, dtype=torch.float16, scale=4.0).t().requires_grad_()
    assert x.stride() == (1, 9)
    h_shape = (9, 30)
    check(x, layout, activation, dh=stride0_like(torch.empty(h_shape, dtype=x.dtype, device=DEVICE)))


def test_moe_glu_clamp_boundaries_pass_the_gradient():
    """g and u exactly at ±limit: torch's clamp passes the gradient there, and so does the kernel."""
    limit = 2.0
    gate = torch.tensor([[limit, -limit, limit + 1, 0.5]], device=DEVICE)
    up = torch.tensor([[limit, -limit, -limit - 1, limit + 1]], device=DEVICE)
    x = torch.cat([gate, up], dim=-1).requires_grad_()
    h = moe_glu(x, activation=CLAMPED_SWIGLU, alpha=1.5, limit=limit)
    ref_x = x.detach().double().requires_grad_()
    ref = moe_glu_reference(ref_x, activation=CLAMPED_SWIGLU, alpha=1.5, limit=limit)
    (dx,) = torch.autograd.grad(h, x, torch.ones_like(h))
    (ref_dx,) = torch.autograd.grad(ref, ref_x, torch.ones_like(ref))
    torch.testing.assert_close(h.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx.double(), ref_dx, rtol=1e-5, atol=1e-6)
    assert (dx[0, 2] == 0) and (dx[0, 6] == 0) and (dx[0, 7] == 0)  # clamped: no gradient
    assert (dx[0, :2] != 0).all() and (dx[0, 4:6] != 0).all()  # at the limit: gradient


def test_moe_glu_matches_the_split_glu():
    """halves + silu is swiglu on the two halves (tigon.ops.glu's kernel math, bit for bit)."""
    from tigon.ops.glu import swiglu

    x = randn(11, 2 * 50, dtype=torch.bfloat16, scale=3.0)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(moe_glu(x), swiglu(gate, up))


def test_moe_glu_matches_gpt_oss_apply_gate():
    """GPT-OSS's own ``_apply_gate`` (transformers' code, in fp32) on an interleaved projection."""
    transformers_gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

    class Gate:
        alpha, limit = 1.702, 7.0

    x = randn(6, 2 * 20, scale=8.0, requires_grad=True)
    want = transformers_gpt_oss.GptOssExperts._apply_gate(Gate, x)
    got = moe_glu(x, layout="interleaved", activation=CLAMPED_SWIGLU, alpha=1.702, limit=7.0)
    assert_close(got, want, torch.float32, "h")
    dh = randn(*got.shape)
    assert_close(torch.autograd.grad(got, x, dh)[0], torch.autograd.grad(want, x, dh)[0], torch.float32, "dx")


def test_moe_glu_saves_only_its_input():
    x = randn(4, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        moe_glu(x)
    assert [t.data_ptr() for t in saved] == [x.data_ptr()]


def test_moe_glu_empty():
    x = randn(0, 16, requires_grad=True)
    h = moe_glu(x)
    h.sum().backward()
    assert h.shape == (0, 8) and x.grad.shape == (0, 16)


def test_moe_glu_bad_inputs():
    x = randn(4, 8)
    with pytest.raises(ValueError, match="layout"):
        moe_glu(x, layout="split")
    with pytest.raises(ValueError, match="activation"):
        moe_glu(x, activation="relu")
    with pytest.raises(ValueError, match="last dim must be even"):
        moe_glu(randn(4, 7))
    with pytest.raises(TypeError, match="limit"):
        moe_glu(x, activation=CLAMPED_SWIGLU, limit=None)
    with pytest.raises(TypeError, match="alpha"):
        moe_glu(x, alpha="1.702")  # checked whatever the activation: a str must not reach float()
    with pytest.raises(ValueError, match="alpha"):
        moe_glu(x, activation=CLAMPED_SWIGLU, alpha=float("nan"))
    with pytest.raises(ValueError, match="limit must be"):
        moe_glu(x, activation=CLAMPED_SWIGLU, limit=-1.0)
    with pytest.raises(TypeError, match="gate_up has dtype"):
        moe_glu(x.double())
    with pytest.raises(TypeError, match="gate_up must be a torch.Tensor"):
        moe_glu([1.0, 2.0])


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ("silu", CLAMPED_SWIGLU))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_glu_torch_compile_fullgraph(layout, activation):
    x = randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    w = randn(2 * 1000, 256, dtype=torch.bfloat16, scale=0.1, requires_grad=True)

    def f(x, w):
        return moe_glu(x @ w.t(), layout=layout, activation=activation).float().square().sum()

    loss = torch.compile(f, fullgraph=True)(x, w)
    grads = torch.autograd.grad(loss, (x, w))
    ref_loss = f(x, w)
    ref_grads = torch.autograd.grad(ref_loss, (x, w))
    assert_close(loss, ref_loss, torch.float32, "loss")
    for g, rg in zip(grads, ref_grads, strict=True):
        assert_close(g, rg, torch.bfloat16, "grad")


@pytest.mark.gpu
@pytest.mark.bigmem
@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_glu_int64_offsets(layout):
    """Past 2**31 elements of gate_up (and of h): the tail rows are right, forward and backward."""
    num_cols = 2880  # GPT-OSS's intermediate size
    rows = 2**31 // (2 * num_cols) + 8
    x = torch.randn(rows, 2 * num_cols, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    h = moe_glu(x, layout=layout, activation=CLAMPED_SWIGLU, limit=7.0)
    tail = slice(rows - 16, rows)
    xt = x[tail].detach().double().requires_grad_()
    ref = moe_glu_reference(xt, layout, CLAMPED_SWIGLU, limit=7.0, io_dtype=torch.bfloat16)
    assert_close(h[tail], ref, torch.bfloat16, "h tail")
    dh = stride0_like(h)
    (dx,) = torch.autograd.grad(h, x, dh)
    (ref_dx,) = torch.autograd.grad(ref, xt, dh[tail].double())
    assert_close(dx[tail], ref_dx, torch.bfloat16, "dx tail")
