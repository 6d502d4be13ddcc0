"""tigon.ops.layer_norm against the fp64 ``F.layer_norm`` reference.

Sizes sit on the kernel's regime boundaries (the launch config shared with rms_norm.py): hidden 1
and 7 (tiles far wider than the row, many rows per program; at 1 the output is the bias and every
gradient but the bias's is exactly zero), 96 and 1000 (non-powers of two), 4096 (one tile, one row
per program), 8193 (backward past MAX_FUSED_HIDDEN_BWD: streamed in chunks) and 16385 (forward
streamed too, statistics merged chunk by chunk). The streamed backward's geometry is tested at
small hidden sizes with test_rms_norm.py's shrunken tuning (the launch is shared).
"""

import dataclasses

import pytest
import torch

from tests.helpers import (
    DEVICE,
    DTYPES,
    ON_GPU,
    assert_close,
    fp64_reference,
    noncontiguous,
    randn,
    stride0_like,
)
from tests.ops.test_rms_norm import GPU_STREAM_KNOBS, RMS_MODULE, STREAM_CASES, use_stream_tuning
from tigon.ops.layer_norm import layer_norm, layer_norm_reference
from tigon.ops.rms_norm import MAX_FUSED_HIDDEN_BWD, MAX_FUSED_HIDDEN_FWD

HIDDEN_SIZES = (1, 7, 96, 1000, 4096, MAX_FUSED_HIDDEN_BWD + 1, MAX_FUSED_HIDDEN_FWD + 1)
# Below this the fp64 reference is rounding noise around an exact zero (hidden == 1).
EXACT_ZERO = 1e-9


def check_layer_norm(x, weight, bias, dy, *, eps=1e-5):
    dtype = x.dtype
    y = layer_norm(x, weight, bias, eps)
    tensors = {"x": x, "weight": weight, "bias": bias}
    ref, ref_grads = fp64_reference(layer_norm_reference, tensors, dy, eps=eps)
    expected_dtype = dtype
    for param in (weight, bias):
        if param is not None:
            expected_dtype = torch.promote_types(expected_dtype, param.dtype)
    assert y.dtype == expected_dtype
    assert_close(y, ref, dtype, "y")
    names = [n for n, t in tensors.items() if t is not None and t.requires_grad]
    grads = torch.autograd.grad(y, [tensors[n] for n in names], dy)
    for name, grad in zip(names, grads, strict=True):
        assert grad.dtype == tensors[name].dtype
        if ref_grads[name].norm() < EXACT_ZERO:
            assert torch.count_nonzero(grad) == 0, f"d{name} should be exactly zero"
        else:
            assert_close(grad, ref_grads[name], dtype, f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("rows", (1, 37))
def test_layer_norm_sizes(dtype, hidden, rows):
    # an offset mean: the variance must be taken around the mean, not as E[x²] − mean²
    x = (randn(rows, hidden) * 2 + 3).to(dtype).requires_grad_()
    w = randn(hidden, dtype=dtype, requires_grad=True)
    b = randn(hidden, dtype=dtype, requires_grad=True)
    dy = randn(rows, hidden, dtype=dtype)
    check_layer_norm(x, w, b, dy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("params", ("both", "weight", "bias", "none"))
@pytest.mark.parametrize("hidden", (160, MAX_FUSED_HIDDEN_BWD + 1))
def test_layer_norm_optional_params(dtype, params, hidden):
    x = randn(2, 3, hidden, dtype=dtype, requires_grad=True)  # 3-D: leading dims flatten into rows
    w = randn(hidden, dtype=dtype, requires_grad=True) if params in ("both", "weight") else None
    b = randn(hidden, dtype=dtype, requires_grad=True) if params in ("both", "bias") else None
    check_layer_norm(x, w, b, randn(2, 3, hidden, dtype=dtype))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("params", ("both", "weight"))
def test_layer_norm_fp32_params_promote(dtype, params):
    """fp32 weight/bias with half x: fp32 out, computed as F.layer_norm does under autocast."""
    x = randn(9, 200, dtype=dtype, requires_grad=True)
    w = randn(200, requires_grad=True)
    b = randn(200, requires_grad=True) if params == "both" else None
    dy = randn(9, 200)
    check_layer_norm(x, w, b, dy)
    y = layer_norm(x, w, b)
    assert y.dtype == torch.float32
    assert_close(y, torch.nn.functional.layer_norm(x.float(), (200,), w, b), torch.float32, "y vs fp32")


@pytest.mark.gpu
def test_layer_norm_matches_autocast():
    """Under autocast F.layer_norm runs in fp32: bf16 activations with fp32 params give fp32."""
    x = randn(64, 1024, dtype=torch.bfloat16)
    w, b = randn(1024), randn(1024)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = torch.nn.functional.layer_norm(x, (1024,), w, b)
        y = layer_norm(x, w, b)
    assert y.dtype == ref.dtype == torch.float32
    assert_close(y, ref, torch.float32, "y")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", (96, MAX_FUSED_HIDDEN_FWD + 1))
def test_layer_norm_noncontiguous_input_and_stride0_grad(dtype, hidden):
    x = noncontiguous(randn(5, hidden, dtype=dtype, requires_grad=True))
    w = randn(hidden, dtype=dtype, requires_grad=True)
    b = randn(hidden, dtype=dtype, requires_grad=True)
    check_layer_norm(x, w, b, stride0_like(x))


def test_layer_norm_transposed_input():
    """Leading dims that cannot merge into one stride: reshaped by as_rows, still right."""
    x = randn(6, 4, 33).transpose(0, 1).requires_grad_()
    w, b = randn(33, requires_grad=True), randn(33, requires_grad=True)
    check_layer_norm(x, w, b, randn(4, 6, 33))


def test_layer_norm_sum_backward_uses_expanded_grad():
    x = randn(4, 33, requires_grad=True)
    w, b = randn(33, requires_grad=True), randn(33, requires_grad=True)
    layer_norm(x, w, b).sum().backward()
    _, grads = fp64_reference(layer_norm_reference, {"x": x, "weight": w, "bias": b}, torch.ones(4, 33))
    assert_close(x.grad, grads["x"], torch.float32, "dx")
    assert_close(w.grad, grads["weight"], torch.float32, "dw")
    assert_close(b.grad, grads["bias"], torch.float32, "db")


def test_layer_norm_eps():
    x = randn(3, 50, scale=1e-2, requires_grad=True)
    w, b = randn(50, requires_grad=True), randn(50, requires_grad=True)
    check_layer_norm(x, w, b, randn(3, 50), eps=1e-2)


@pytest.mark.parametrize("hidden", (512, MAX_FUSED_HIDDEN_BWD + 1, "streamed-groups"))
def test_layer_norm_deterministic(monkeypatch, hidden):
    if hidden == "streamed-groups":  # several groups of rows per band, bands split between programs
        rows, hidden, knobs = STREAM_CASES["19rows-groups2-split2"]
        use_stream_tuning(monkeypatch, **knobs)
    else:
        rows = 300 if hidden == 512 else 9
    x = randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    b = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = randn(rows, hidden, dtype=torch.bfloat16)
    first = torch.autograd.grad(layer_norm(x, w, b), (x, w, b), dy)
    second = torch.autograd.grad(layer_norm(x, w, b), (x, w, b), dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("params", ("both", "weight", "bias", "none"))
@pytest.mark.parametrize("case", ("1row-split2", "19rows-groups2-split2", "23rows-groups4-split3"))
def test_layer_norm_streamed_backward(monkeypatch, dtype, params, case):
    rows, hidden, knobs = STREAM_CASES[case]
    use_stream_tuning(monkeypatch, **knobs)
    x = (randn(rows, hidden) * 2 + 3).to(dtype).requires_grad_()
    w = randn(hidden, dtype=dtype, requires_grad=True) if params in ("both", "weight") else None
    b = randn(hidden, dtype=dtype, requires_grad=True) if params in ("both", "bias") else None
    check_layer_norm(x, w, b, randn(rows, hidden, dtype=dtype))


def test_layer_norm_empty_rows():
    x = randn(0, 64, requires_grad=True)
    w, b = randn(64, requires_grad=True), randn(64, requires_grad=True)
    y = layer_norm(x, w, b)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: (torch.ones(4, 8, dtype=torch.int32, device=DEVICE), None, None), TypeError, "x has dtype"),
        (lambda: (randn(4, 8), randn(7), None), ValueError, "weight has shape"),
        (lambda: (randn(4, 8), None, randn(8, 1)), ValueError, "bias has shape"),
        (lambda: (randn(4, 8), randn(8, dtype=torch.float64), None), TypeError, "weight has dtype"),
        (lambda: (randn(4, 8), None, torch.arange(8, device=DEVICE)), TypeError, "bias has dtype"),
        (lambda: (randn(4, 8), None, torch.ones(8, device="meta")), ValueError, "bias is on meta"),
        (lambda: (torch.tensor(1.0, device=DEVICE), None, None), ValueError, "at least one dimension"),
        (lambda: ([1.0, 2.0], None, None), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_layer_norm_bad_inputs(make, error, match):
    x, w, b = make()
    before = x.clone() if isinstance(x, torch.Tensor) else None
    with pytest.raises(error, match=match):
        layer_norm(x, w, b)
    if before is not None:
        assert torch.equal(x, before)


def test_layer_norm_bad_eps():
    with pytest.raises(ValueError, match="eps"):
        layer_norm(randn(4, 8), randn(8), randn(8), -1.0)


@pytest.mark.skipif(ON_GPU, reason="on a GPU, CPU tensors are simply the wrong device (checked below)")
def test_layer_norm_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA tensors"):
        layer_norm(randn(2, 8), randn(8), None)


@pytest.mark.gpu
def test_layer_norm_cpu_tensor_on_gpu_machine_rejected():
    with pytest.raises(ValueError, match="CUDA tensors"):
        layer_norm(torch.randn(2, 8), torch.randn(8), torch.randn(8))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", (4096, 3 * MAX_FUSED_HIDDEN_FWD + 5))
def test_layer_norm_deterministic_gpu_many_rows(hidden):
    """Every program of the persistent grid busy: two runs still bitwise equal."""
    rows = 2**24 // hidden
    x = randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    b = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = randn(rows, hidden, dtype=torch.bfloat16)
    first = torch.autograd.grad(layer_norm(x, w, b), (x, w, b), dy)
    second = torch.autograd.grad(layer_norm(x, w, b), (x, w, b), dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    check_layer_norm(x, w, b, dy)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", GPU_STREAM_KNOBS, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_layer_norm_streamed_backward_gpu(monkeypatch, knobs):
    """Compiled for real (pipelined loads, two partial rows): right, and bitwise the same twice."""
    tuning = dataclasses.replace(RMS_MODULE.BWD_TUNING, stream_l2_bytes=None, **knobs)
    monkeypatch.setattr(RMS_MODULE, "BWD_TUNING", tuning)
    rows, hidden = 2048, 5 * 4096 - 93
    x = (randn(rows, hidden) * 2 + 3).to(torch.bfloat16).requires_grad_()
    w = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    b = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = randn(rows, hidden, dtype=torch.bfloat16)
    check_layer_norm(x, w, b, dy)
    first = torch.autograd.grad(layer_norm(x, w, b), (x, w, b), dy)
    second = torch.autograd.grad(layer_norm(x, w, b), (x, w, b), dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", (4096, 3 * MAX_FUSED_HIDDEN_BWD // 2 + 5))  # fused; streamed backward
def test_layer_norm_torch_compile_fullgraph(hidden):
    x = randn(64, hidden, dtype=torch.bfloat16, requires_grad=True)
    r = randn(64, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    b = randn(hidden, dtype=torch.bfloat16, requires_grad=True)

    def f(x, r, w, b):
        return layer_norm(x + r, w, b).float().square().sum() + layer_norm(x, None, b).float().sum()

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(x, r, w, b)
    grads = torch.autograd.grad(loss, (x, r, w, b))
    ref_loss = f(x, r, w, b)
    ref_grads = torch.autograd.grad(ref_loss, (x, r, w, b))
    assert_close(loss, ref_loss, torch.float32, "loss")
    for g, rg in zip(grads, ref_grads, strict=True):
        assert_close(g, rg, torch.bfloat16, "grad")


@pytest.mark.gpu
def test_layer_norm_int64_offsets():
    """More than 2**31 elements: offsets computed in 64 bit, so the last rows are right."""
    hidden = 4096
    rows = (2**31 // hidden) + 64
    x = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    y = layer_norm(x, w, b)
    tail = slice(rows - 128, rows)
    wd, bd = w.detach().double(), b.detach().double()
    ref = layer_norm_reference(x[tail].detach().double(), wd, bd)
    assert_close(y[tail], ref, torch.bfloat16, "y tail")
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, (x,), dy)
    xt = x[tail].detach().double().requires_grad_()
    (ref_dx,) = torch.autograd.grad(layer_norm_reference(xt, wd, bd), (xt,), dy[tail].double())
    assert_close(dx[tail], ref_dx, torch.bfloat16, "dx tail")
