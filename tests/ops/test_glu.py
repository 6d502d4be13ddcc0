"""tigon.ops.swiglu / geglu against the eager ``act(gate) * up`` in fp64 with eager's roundings.

Regimes of glu.py's launch config: contiguous operands take the flat path (a single element; fewer
elements than one tile; 37×1000, which is not a multiple of the 4096-element tile, so the last
program is partial and straddles rows); any strided operand takes the row/column path (rows shorter
than a column block, and 1500 > max_block_n columns, two column blocks with the second partial).
"""

import pytest
import torch

from tests.helpers import DEVICE, DTYPES, assert_close, fp64_reference, noncontiguous, randn, stride0_like
from tigon.ops.glu import (
    ACTIVATIONS,
    CONFIG,
    geglu,
    glu,
    glu_backward_into,
    glu_backward_stacked_into,
    glu_reference,
    swiglu,
)

SHAPES = ((1, 1), (3, 7), (37, 1000), (2, 3, 50))


def run_glu(gate, up, activation):
    if activation == "silu":
        return swiglu(gate, up)
    return geglu(gate, up, approximate="tanh" if activation == "gelu_tanh" else "none")


def check_glu(gate, up, activation, dh=None):
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    h = run_glu(gate, up, activation)
    assert h.dtype == out_dtype and h.shape == gate.shape
    dh = randn(*h.shape, dtype=out_dtype) if dh is None else dh
    ref, grads = fp64_reference(
        glu_reference, {"gate": gate, "up": up}, dh,
        activation=activation, io_dtype=gate.dtype, out_dtype=out_dtype,
    )
    tol_dtype = gate.dtype if gate.dtype != torch.float32 else up.dtype
    assert_close(h, ref, tol_dtype, "h")
    dgate, dup = torch.autograd.grad(h, (gate, up), dh)
    assert dgate.dtype == gate.dtype and dup.dtype == up.dtype
    assert_close(dgate, grads["gate"], tol_dtype, "dgate")
    assert_close(dup, grads["up"], tol_dtype, "dup")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_glu_sizes(dtype, activation, shape):
    # scale 3: the gelu/silu curvature and the tails (σ ≈ 0, σ ≈ 1) are both exercised
    gate = randn(*shape, dtype=dtype, scale=3.0, requires_grad=True)
    up = randn(*shape, dtype=dtype, requires_grad=True)
    check_glu(gate, up, activation)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_glu_fused_gate_up_slices_and_stride0_grad(dtype, activation):
    """gate and up as halves of one fused gate_up projection (row stride 2N), dh from ``.sum()``."""
    num_cols = CONFIG.max_block_n + 476
    gate_up = randn(5, 2 * num_cols, dtype=dtype, scale=3.0)
    gate = gate_up[:, :num_cols].detach().requires_grad_()
    up = gate_up[:, num_cols:].detach().requires_grad_()
    assert not gate.is_contiguous()
    check_glu(gate, up, activation, dh=stride0_like(gate.detach()))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_glu_noncontiguous_columns(activation):
    gate = noncontiguous(randn(6, 33, dtype=torch.bfloat16, scale=3.0, requires_grad=True))
    up = randn(6, 33, dtype=torch.bfloat16).t().contiguous().t().requires_grad_()
    check_glu(gate, up, activation, dh=noncontiguous(randn(6, 33, dtype=torch.bfloat16)))


def test_glu_flat_tail_program():
    """More than one flat tile, the last one partial."""
    gate = randn(CONFIG.tile_elements + 5, dtype=torch.float16, scale=3.0, requires_grad=True)
    up = randn(CONFIG.tile_elements + 5, dtype=torch.float16, requires_grad=True)
    check_glu(gate, up, "silu")


@pytest.mark.parametrize("dtypes", ((torch.bfloat16, torch.float32), (torch.float32, torch.float16)), ids=str)
def test_glu_mixed_dtypes_promote(dtypes):
    gate_dtype, up_dtype = dtypes
    gate = randn(4, 40, dtype=gate_dtype, scale=3.0, requires_grad=True)
    up = randn(4, 40, dtype=up_dtype, requires_grad=True)
    check_glu(gate, up, "gelu_tanh")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_glu_fp32_matches_eager(activation):
    gate = randn(8, 96, scale=4.0, requires_grad=True)
    up = randn(8, 96, requires_grad=True)
    h = run_glu(gate, up, activation)
    ref = glu_reference(gate, up, activation)
    assert_close(h, ref, torch.float32, "h")
    dh = randn(8, 96)
    got = torch.autograd.grad(h, (gate, up), dh)
    want = torch.autograd.grad(ref, (gate, up), dh)
    for g, w, name in zip(got, want, ("dgate", "dup"), strict=True):
        assert_close(g, w, torch.float32, name)


def test_glu_extreme_gates_are_finite():
    gate = torch.tensor([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4], device=DEVICE, requires_grad=True)
    up = torch.ones(7, device=DEVICE, requires_grad=True)
    for activation in ACTIVATIONS:
        h = glu(gate, up, activation)
        dgate, dup = torch.autograd.grad(h, (gate, up), torch.ones_like(h))
        ref = glu_reference(gate.double(), up.double(), activation)
        assert torch.isfinite(h).all() and torch.isfinite(dgate).all()
        torch.testing.assert_close(h.double(), ref, rtol=1e-5, atol=1e-30)


def test_glu_backward_into_matches_functional_backward():
    """The in-place variant (dgate over dh, dup into a given buffer) writes the functional op's values,
    through the eager path and through the registered mutating op."""
    gate, up = randn(5, 300, dtype=torch.bfloat16, scale=3.0), randn(5, 300, dtype=torch.bfloat16)
    dh = randn(5, 300, dtype=torch.bfloat16)
    for activation in ACTIVATIONS:
        want_dgate, want_dup = torch.ops.tigon.glu_backward(dh, gate, up, activation)
        for call in (glu_backward_into, torch.ops.tigon.glu_backward_into):
            dgate, dup = dh.clone(), torch.empty_like(up)
            call(dgate, gate, up, dup, activation)
            assert torch.equal(dgate, want_dgate) and torch.equal(dup, want_dup)
    with pytest.raises(ValueError, match="dh must be contiguous"):
        glu_backward_into(dh.t().contiguous().t(), gate, up, torch.empty_like(up), "silu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_glu_backward_recompute_into_writes_h_too(dtype):
    """With ``h``, the same pass also writes the forward's output (the recomputing MLP's backward):
    bitwise the forward op's h, and the same dgate, dup as without it; eager and registered op."""
    gate, up = randn(7, 301, dtype=dtype, scale=3.0), randn(7, 301, dtype=dtype)
    dh = randn(7, 301, dtype=dtype)
    for activation in ACTIVATIONS:
        want_h = torch.ops.tigon.glu(gate, up, activation)
        want_dgate, want_dup = torch.ops.tigon.glu_backward(dh, gate, up, activation)
        for call in (lambda *a: glu_backward_into(*a[:4], a[5], h=a[4]), torch.ops.tigon.glu_backward_recompute_into):
            dgate, dup, h = dh.clone(), torch.empty_like(up), torch.empty_like(want_h)
            call(dgate, gate, up, dup, h, activation)
            assert torch.equal(h, want_h) and torch.equal(dgate, want_dgate) and torch.equal(dup, want_dup)
    with pytest.raises(ValueError, match="h must be contiguous"):
        wrong = torch.empty(7, 301, dtype=torch.float64)
        glu_backward_into(dh.clone(), gate, up, torch.empty_like(up), "silu", h=wrong)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 301), (2, 3, 33), (1, 1)], ids=["rows", "3d", "one"])
def test_glu_backward_stacked_into(dtype, shape):
    """gate and up as the halves of one gate_up buffer (a stacked projection's output): [dgate | dup] is
    written over it and h over dh, bitwise the functional ops' values; eager and registered op; without
    h, dh is left as it was. Bad buffers are refused, nothing written."""
    lead, inter = shape[:-1], shape[-1]
    gate_up = randn(*lead, 2 * inter, dtype=dtype, scale=3.0)
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    dh = randn(*lead, inter, dtype=dtype)
    for activation in ACTIVATIONS:
        want_h = torch.ops.tigon.glu(gate, up, activation)
        want_dgate, want_dup = torch.ops.tigon.glu_backward(dh, gate, up, activation)
        want = torch.cat([want_dgate, want_dup], dim=-1)
        for call in (lambda d, g, a, s: glu_backward_stacked_into(d, g, a, store_h=s),
                     torch.ops.tigon.glu_backward_stacked_into):
            for store_h in (True, False):
                out, h = gate_up.clone(), dh.clone()
                call(h, out, activation, store_h)
                assert torch.equal(out, want)
                assert torch.equal(h, want_h if store_h else dh)
    before = gate_up.clone()
    with pytest.raises(ValueError, match="gate_up must be contiguous"):
        glu_backward_stacked_into(dh.clone(), torch.cat([gate_up, gate_up], dim=-1)[..., ::2], "silu")
    with pytest.raises(ValueError, match="dh must be contiguous"):
        glu_backward_stacked_into(dh.to(torch.float64), gate_up, "silu")
    assert torch.equal(gate_up, before)


def test_glu_saves_only_gate_and_up():
    gate, up = randn(4, 64, requires_grad=True), randn(4, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(gate, up)
    assert sorted(t.data_ptr() for t in saved) == sorted((gate.data_ptr(), up.data_ptr()))


def test_glu_empty():
    gate, up = randn(0, 16, requires_grad=True), randn(0, 16, requires_grad=True)
    h = swiglu(gate, up)
    h.sum().backward()
    assert h.shape == (0, 16) and gate.grad.shape == (0, 16)


def test_glu_bad_inputs():
    gate, up = randn(4, 8), randn(4, 8)
    before = (gate.clone(), up.clone())
    with pytest.raises(ValueError, match="up has shape"):
        swiglu(gate, randn(4, 9))
    with pytest.raises(ValueError, match="approximate"):
        geglu(gate, up, approximate="erf")
    with pytest.raises(ValueError, match="activation"):
        glu(gate, up, "relu")
    with pytest.raises(TypeError, match="gate has dtype"):
        swiglu(gate.to(torch.int64), up)
    with pytest.raises(TypeError, match="up has dtype"):
        geglu(gate, up.double())
    with pytest.raises(TypeError, match="up must be a torch.Tensor"):
        swiglu(gate, 1.0)
    with pytest.raises(ValueError, match="up is on meta"):
        swiglu(gate, torch.empty(4, 8, device="meta"))
    with pytest.raises(ValueError, match="at least one dimension"):
        swiglu(randn(()), randn(()))
    assert torch.equal(gate, before[0]) and torch.equal(up, before[1])


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_glu_torch_compile_fullgraph(activation):
    x = randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    w = randn(2 * 1000, 256, dtype=torch.bfloat16, scale=0.1, requires_grad=True)

    def f(x, w):
        gate, up = (x @ w.t()).chunk(2, dim=-1)
        return glu(gate, up, activation).float().square().sum()

    loss = torch.compile(f, fullgraph=True)(x, w)
    grads = torch.autograd.grad(loss, (x, w))
    ref_loss = f(x, w)
    ref_grads = torch.autograd.grad(ref_loss, (x, w))
    assert_close(loss, ref_loss, torch.float32, "loss")
    for g, rg in zip(grads, ref_grads, strict=True):
        assert_close(g, rg, torch.bfloat16, "grad")


@pytest.mark.gpu
def test_swiglu_bf16_forward_matches_eager_bits():
    """The forward rounds silu(gate) where eager does, so on the GPU it gives eager's bits up to the
    last-ulp differences of the two exp implementations (a rounding boundary hit now and then).
    GeGLU is not held to this: its x·σ(2v) form avoids the cancellation in eager's 1 + tanh(v)."""
    gate = randn(512, 4096, dtype=torch.bfloat16, scale=3.0)
    up = randn(512, 4096, dtype=torch.bfloat16)
    mismatch = (swiglu(gate, up) != glu_reference(gate, up, "silu")).float().mean().item()
    assert mismatch < 1e-3, f"{mismatch:.3%} of elements differ from eager"


@pytest.mark.gpu
@pytest.mark.bigmem
def test_glu_int64_offsets():
    """Past 2**31 elements (flat path and strided path): the tail is right."""
    rows, num_cols = 2**31 // 14336 + 8, 14336
    gate = torch.randn(rows, num_cols, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(rows, num_cols, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    tail = slice(rows - 16, rows)
    h = swiglu(gate, up)
    gt, ut = gate[tail].detach().double(), up[tail].detach().double()
    ref = glu_reference(gt, ut, "silu", io_dtype=torch.bfloat16)
    assert_close(h[tail], ref, torch.bfloat16, "h tail")
    dh = stride0_like(h)  # strided path: every dh stride is 0
    dgate, dup = torch.autograd.grad(h, (gate, up), dh)
    gt = gate[tail].detach().double().requires_grad_()
    ut = up[tail].detach().double().requires_grad_()
    ref = glu_reference(gt, ut, "silu", io_dtype=torch.bfloat16)
    ref_dgate, ref_dup = torch.autograd.grad(ref, (gt, ut), dh[tail].double())
    assert_close(dgate[tail], ref_dgate, torch.bfloat16, "dgate tail")
    assert_close(dup[tail], ref_dup, torch.bfloat16, "dup tail")
