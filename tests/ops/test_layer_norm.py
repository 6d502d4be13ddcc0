"""tigon.ops.layer_norm against the fp64 ``F.layer_norm`` reference.

Sizes sit on the kernel's regime boundaries (RMSNorm's launch config, _kernels/norm_launch.py): hidden 1
and 7 (tiles far wider than the row, many rows per program; at 1 the output is the bias and every
gradient but the bias's is exactly zero), 96 and 1000 (non-powers of two), 4096 (one tile, one row
per program), 8193 (backward past MAX_FUSED_HIDDEN_BWD: streamed in chunks) and 16385 (forward
streamed too, statistics merged chunk by chunk). The streamed backward's geometry is tested at
small hidden sizes with test_rms_norm.py's shrunken tuning (the launch is shared).

The fused regime's own knobs (``CONFIG``, LayerNormConfig) are tested by shrinking the tiles
(``use_fused_tuning``), so that a few interpreted programs reach every geometry they can select:
several rows per tile, a band's last tile part padding, one row per tile, each way of keeping loads
in flight, one or two row reductions, and partial rows summed over several blocks of bands and
columns.
"""

import dataclasses
import importlib

import pytest
import torch

from tests.helpers import (
    DEVICE,
    DTYPES,
    ON_GPU,
    assert_bitwise_equal,
    assert_close,
    fp64_reference,
    noncontiguous,
    randn,
    repeatable_grads,
    stride0_like,
)
from tests.ops.test_rms_norm import (
    GPU_SPLIT_KNOBS,
    GPU_STREAM_KNOBS,
    MAX_FUSED_HIDDEN_BWD,
    MAX_FUSED_HIDDEN_FWD,
    RMS_MODULE,
    SPLIT_CASES,
    STREAM_CASES,
    set_tuning,
    split_grads,
    use_split_tuning,
    use_stream_tuning,
)
from tigon._kernels import next_power_of_2
from tigon.ops.layer_norm import LayerNormConfig, backward_launch, forward_launch, layer_norm, layer_norm_reference

HIDDEN_SIZES = (1, 7, 96, 1000, 4096, MAX_FUSED_HIDDEN_BWD + 1, MAX_FUSED_HIDDEN_FWD + 1)
# one row, and rows several to a program; at the widest (both passes streamed) 5 rows: the interpreter
# takes seconds a row there, and 5 rows over its 4 programs still give one program two
SIZE_CASES = [(rows, hidden) for hidden in HIDDEN_SIZES[:-1] for rows in (1, 37)] + [(1, HIDDEN_SIZES[-1]),
                                                                                   (5, HIDDEN_SIZES[-1])]
# Below this the fp64 reference is rounding noise around an exact zero (hidden == 1).
EXACT_ZERO = 1e-9
LN_MODULE = importlib.import_module("tigon.ops.layer_norm")  # `tigon.ops.layer_norm` is also the function

# (rows, hidden, knobs, expected backward (BLOCK_M, bands, rows_per_band)): under the interpreter
# the persistent grid has 4 programs whatever bwd_programs_per_sm says.
FUSED_CASES = {
    # tiles of 4 rows of 128 lanes (100 used); bands of 12, 12, 12 and 1 rows: the last band's only
    # tile is 3/4 padding; registers prefetch; 2 bands a block and 16 columns a program in the sum
    "rows4-prefetch": (
        37, 100,
        dict(fwd_tile_elements=512, fwd_elements_per_warp=128, bwd_tile_elements=512, bwd_elements_per_warp=128,
             bwd_stages=0, reduce_bands=2, reduce_cols=16),
        (4, 4, 12),
    ),
    # the same tiles through Triton's pipeliner (3 stages), one row reduction each for c1 and c2
    "rows4-pipelined3-unpaired": (
        37, 100,
        dict(fwd_tile_elements=256, bwd_tile_elements=512, bwd_elements_per_warp=64, bwd_max_warps=4,
             bwd_stages=3, bwd_paired_sums=False),
        (4, 4, 12),
    ),
    # 8 rows of 33 (64 lanes) a tile: 3 bands of 8, 8 and 5 rows; no prefetch (1 stage); the sum's
    # block of bands wider than the bands
    "rows8-stages1": (
        21, 33,
        dict(fwd_tile_elements=128, bwd_tile_elements=512, bwd_stages=1, reduce_bands=64, reduce_cols=32),
        (8, 3, 8),
    ),
    # tiles narrower than the row: one row per tile, bands of 3, 3, 3 and 1; pipelined (2 stages)
    "1row-pipelined2": (
        10, 77,
        dict(fwd_tile_elements=64, bwd_tile_elements=64, bwd_stages=2, reduce_cols=128),
        (1, 4, 3),
    ),
    # a single row: the tile of 4 rows shrinks to it (one band, one tile)
    "1row-only": (1, 50, dict(bwd_tile_elements=256, bwd_stages=0), (1, 1, 1)),
    # 3 rows: one band of one tile of 4, a quarter padding
    "3rows-of-4": (3, 50, dict(bwd_tile_elements=256, bwd_stages=2), (4, 1, 4)),
}


def use_fused_tuning(monkeypatch, **knobs):
    monkeypatch.setattr(LN_MODULE, "CONFIG", dataclasses.replace(LN_MODULE.CONFIG, **knobs))


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


def check_right_and_deterministic(rows, hidden):
    """bf16 LayerNorm with weight and bias against fp64, and two backward runs bitwise equal."""
    x = (randn(rows, hidden) * 2 + 3).to(torch.bfloat16).requires_grad_()
    w = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    b = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = randn(rows, hidden, dtype=torch.bfloat16)
    check_layer_norm(x, w, b, dy)
    repeatable_grads(lambda: layer_norm(x, w, b), (x, w, b), dy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden", SIZE_CASES)
def test_layer_norm_sizes(dtype, rows, hidden):
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
    repeatable_grads(lambda: layer_norm(x, w, b), (x, w, b), dy)


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


# (case, params, dtype): every combination, but at 19 rows (the slowest under the interpreter: 4 programs a row)
# both parameters in bf16 and fp32 (fp16 differs from bf16 only in the dtype its tiles load and store), weight-only
# and no parameters in bf16 alone
LAYER_SPLIT_CASES = [(case, params, dtype) for case in SPLIT_CASES for params in ("both", "weight", "none")
                     for dtype in DTYPES if case != "19rows-4parts" or dtype == torch.bfloat16
                     or (params == "both" and dtype == torch.float32)]


@pytest.mark.parametrize("case,params,dtype", LAYER_SPLIT_CASES,
                         ids=[f"{case}-{params}-{dtype}" for case, params, dtype in LAYER_SPLIT_CASES])
def test_layer_norm_split_rows(monkeypatch, dtype, params, case):
    """Rows split over programs that swap both row sums (see test_rms_norm_split_rows)."""
    rows, hidden = SPLIT_CASES[case]
    use_split_tuning(monkeypatch)
    x = (randn(rows, hidden) * 2 + 3).to(dtype).requires_grad_()
    w = randn(hidden, dtype=dtype, requires_grad=True) if params in ("both", "weight") else None
    b = randn(hidden, dtype=dtype, requires_grad=True) if params == "both" else None
    dy = randn(rows, hidden, dtype=dtype)
    check_layer_norm(x, w, b, dy)
    inputs = tuple(t for t in (x, w, b) if t is not None)
    repeatable_grads(lambda: layer_norm(x, w, b), inputs, dy)


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
        (lambda: (randn(4, 8), randn(7), None), ValueError, "x's last dim 8 .* does not match weight's size 7"),
        (lambda: (randn(4, 9), randn(8), randn(8)), ValueError, "x's last dim 9 .* does not match weight's size 8"),
        (lambda: (randn(4, 9), None, randn(8)), ValueError, "x's last dim 9 .* does not match bias's size 8"),
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
@pytest.mark.parametrize("knobs", GPU_SPLIT_KNOBS, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_layer_norm_split_rows_gpu(knobs):
    """Split rows compiled for real: right, and bitwise the same twice."""
    rows, hidden = 2048, 5 * 4096 - 93
    x = (randn(rows, hidden) * 2 + 3).to(torch.bfloat16).requires_grad_()
    w = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    b = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = randn(rows, hidden, dtype=torch.bfloat16)
    first = split_grads(lambda: layer_norm(x, w, b), (x, w, b), dy, **knobs)
    again = split_grads(lambda: layer_norm(x, w, b), (x, w, b), dy, **knobs)
    for name, a, b_ in zip(("dx", "dw", "db"), first, again, strict=True):
        assert_bitwise_equal(a, b_, name)
    _, grads = fp64_reference(layer_norm_reference, {"x": x, "weight": w, "bias": b}, dy)
    for got, name in zip(first, ("x", "weight", "bias"), strict=True):
        assert_close(got, grads[name], torch.bfloat16, "d" + name)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", (4096, 3 * MAX_FUSED_HIDDEN_FWD + 5))
def test_layer_norm_deterministic_gpu_many_rows(hidden):
    """Every program of the persistent grid busy: two runs still bitwise equal."""
    rows = 2**24 // hidden
    x = randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    b = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = randn(rows, hidden, dtype=torch.bfloat16)
    repeatable_grads(lambda: layer_norm(x, w, b), (x, w, b), dy)
    check_layer_norm(x, w, b, dy)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", GPU_STREAM_KNOBS, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_layer_norm_streamed_backward_gpu(monkeypatch, knobs):
    """Compiled for real (pipelined loads, two partial rows): right, and bitwise the same twice."""
    tuning = dataclasses.replace(RMS_MODULE.CONFIG.backward, split_max_hidden=0, **knobs)
    set_tuning(monkeypatch, backward=tuning)
    check_right_and_deterministic(2048, 5 * 4096 - 93)


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
@pytest.mark.bigmem
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


@pytest.mark.parametrize("case", FUSED_CASES)
def test_layer_norm_fused_geometry(monkeypatch, case):
    """The shrunken tunings select the geometries FUSED_CASES says (and the forward's tiles too)."""
    rows, hidden, knobs, (block_m, bands, rows_per_band) = FUSED_CASES[case]
    use_fused_tuning(monkeypatch, **knobs)
    cfg = backward_launch(rows, hidden, DEVICE)
    assert cfg.single_pass and cfg.split == 1
    assert cfg.block_m == block_m
    assert cfg.bands * cfg.rows_per_band >= rows > (cfg.bands - 1) * cfg.rows_per_band  # every row, no empty band
    if DEVICE.type != "cuda":  # the band split FUSED_CASES gives is for the interpreter's program count
        assert (cfg.bands, cfg.rows_per_band) == (bands, rows_per_band)
    assert cfg.stages == LN_MODULE.CONFIG.bwd_stages
    fwd = forward_launch(rows, hidden)
    fwd_rows = LN_MODULE.CONFIG.fwd_tile_elements // fwd.block_n
    assert fwd.single_pass and fwd.block_m == max(1, min(fwd_rows, next_power_of_2(rows)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("params", ("both", "weight", "bias", "none"))
@pytest.mark.parametrize("case", FUSED_CASES)
def test_layer_norm_fused_knobs(monkeypatch, dtype, params, case):
    rows, hidden, knobs, _ = FUSED_CASES[case]
    use_fused_tuning(monkeypatch, **knobs)
    x = (randn(rows, hidden) * 2 + 3).to(dtype).requires_grad_()
    w = randn(hidden, dtype=dtype, requires_grad=True) if params in ("both", "weight") else None
    b = randn(hidden, dtype=dtype, requires_grad=True) if params in ("both", "bias") else None
    check_layer_norm(x, w, b, randn(rows, hidden, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ("rows4-pipelined3-unpaired", "1row-pipelined2"))
def test_layer_norm_fused_knobs_noncontiguous_and_stride0(monkeypatch, dtype, case):
    rows, hidden, knobs, _ = FUSED_CASES[case]
    use_fused_tuning(monkeypatch, **knobs)
    x = noncontiguous(randn(rows, hidden, dtype=dtype, requires_grad=True))
    w = randn(hidden, dtype=dtype, requires_grad=True)
    b = randn(hidden, dtype=dtype, requires_grad=True)
    check_layer_norm(x, w, b, stride0_like(x))
    # a grad broadcast along the rows only (row stride 0, column stride 1)
    check_layer_norm(x, w, b, randn(1, hidden, dtype=dtype).expand(rows, hidden))


@pytest.mark.parametrize("case", ("rows4-prefetch", "rows8-stages1"))
def test_layer_norm_fused_knobs_deterministic(monkeypatch, case):
    rows, hidden, knobs, _ = FUSED_CASES[case]
    use_fused_tuning(monkeypatch, **knobs)
    x = randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    b = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = randn(rows, hidden, dtype=torch.bfloat16)
    repeatable_grads(lambda: layer_norm(x, w, b), (x, w, b), dy)


@pytest.mark.parametrize(
    "knobs",
    (dict(fwd_tile_elements=1000), dict(reduce_cols=48), dict(bwd_stages=-1), dict(bwd_programs_per_sm=0)),
)
def test_layer_norm_tuning_rejects_bad_knobs(knobs):
    with pytest.raises(ValueError, match="LayerNormConfig"):
        LayerNormConfig(**knobs)


# What the fused sweep (dev/tune_norm.py fused-ln) may pick, compiled for real.
GPU_FUSED_KNOBS = (
    dict(bwd_stages=0, bwd_paired_sums=True),
    dict(bwd_stages=1, bwd_paired_sums=False, bwd_programs_per_sm=1),
    dict(bwd_stages=3, bwd_tile_elements=8192, bwd_elements_per_warp=256, bwd_programs_per_sm=4),
    dict(bwd_stages=2, bwd_tile_elements=1024, bwd_programs_per_sm=1.5, reduce_cols=128, reduce_bands=16),
    dict(fwd_tile_elements=16384, fwd_elements_per_warp=1024, fwd_max_warps=8, bwd_max_warps=8),
)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", GPU_FUSED_KNOBS, ids=lambda k: "-".join(f"{v}" for v in k.values()))
@pytest.mark.parametrize("hidden", (896, 1000, 4096, 8192))
def test_layer_norm_fused_knobs_gpu(monkeypatch, knobs, hidden):
    """Compiled for real (pipelined loads, paired sums, 2-D accumulators): right, and bitwise the same twice."""
    use_fused_tuning(monkeypatch, **knobs)
    check_right_and_deterministic(2**23 // hidden + 3, hidden)


def test_strided_weight_and_bias_read_their_strides():
    """weight and bias with stride 2 or 0 give what their contiguous copies give, gradients included."""
    x, w, b = randn(5, 24, requires_grad=True), randn(24, requires_grad=True), randn(24, requires_grad=True)

    def run(weight, bias):
        out = layer_norm(x, weight, bias)
        return (out, *torch.autograd.grad(out, (x, weight, bias), torch.full((), 0.7, device=DEVICE).expand_as(out)))

    for weight, bias in ((noncontiguous(w), noncontiguous(b)), (w[:1].expand(24), b[:1].expand(24))):
        got = run(weight, bias)
        want = run(weight.detach().contiguous().requires_grad_(), bias.detach().contiguous().requires_grad_())
        assert all(torch.equal(g, h) for g, h in zip(got, want, strict=True))
