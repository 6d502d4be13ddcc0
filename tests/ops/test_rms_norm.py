"""tigon.ops.rms_norm / add_rms_norm against the fp64 transformers-equivalent reference.

Sizes sit on the kernel's regime boundaries (RMSNorm's launch config, _kernels/norm_launch.py): hidden 1 and 7 (tiles
far wider than the row, many rows per program), 96 and 1000 (non-powers of two), 4096 (one tile,
one row per program), 8193 (backward past MAX_FUSED_HIDDEN_BWD: streamed in chunks) and 16385
(forward streamed too).

The streamed backward's geometry (groups of rows, bands split between programs, pipelined chunk
loops) is tested at small hidden sizes by shrinking the tuning (``use_stream_tuning``): rows of 50-70
elements in 16-column chunks, so that every case (a band's later groups, a last group with padding
rows, a part with no chunks) is reached in a few interpreted programs.
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
    rel_err,
    repeatable_grads,
    stride0_like,
)
from tigon._kernels import RMS_NORM_CONFIG, split_rows_scratch
from tigon.ops import add_rms_norm, rms_norm
from tigon.ops.rms_norm import add_rms_norm_reference, rms_norm_reference

MAX_FUSED_HIDDEN_FWD = RMS_NORM_CONFIG.forward.max_fused_hidden
MAX_FUSED_HIDDEN_BWD = RMS_NORM_CONFIG.backward.max_fused_hidden
HIDDEN_SIZES = (1, 7, 96, 1000, 4096, MAX_FUSED_HIDDEN_BWD + 1, MAX_FUSED_HIDDEN_FWD + 1)
# one row, and rows several to a program; at the widest (both passes streamed) 5 rows: the interpreter
# takes seconds a row there, and 5 rows over its 4 programs still give one program two
SIZE_CASES = [(rows, hidden) for hidden in HIDDEN_SIZES[:-1] for rows in (1, 37)] + [(1, HIDDEN_SIZES[-1]),
                                                                                   (5, HIDDEN_SIZES[-1])]
RMS_MODULE = importlib.import_module("tigon._kernels.norm_launch")  # RMSNorm's CONFIG
STREAM_CHUNK = 16

# (rows, hidden, stream knobs): under the interpreter there are 4·stream_programs_per_sm programs.
STREAM_CASES = {
    # one row: the group shrinks to it; the band is split in two
    "1row-split2": (1, 70, dict(stream_rows=4, stream_split=2, stream_stages=2)),
    # 2 bands × 2 parts, 5 groups of 2 rows a band, the last group half padding; 70 = 4·16 + 6
    "19rows-groups2-split2": (19, 70, dict(stream_rows=2, stream_split=2, stream_stages=3)),
    # one band of 6 groups of 4 rows (the last 3 rows), 4 chunks split 3 ways: 2, 2 and none
    "23rows-groups4-split3": (23, 50, dict(stream_rows=4, stream_split=3, stream_stages=1, stream_evict_first=False)),
}


def set_tuning(monkeypatch, *, forward=None, backward=None):
    """Make the norms launch with these direction settings (RMSNormConfig fields) for the test."""
    config = RMS_MODULE.CONFIG
    monkeypatch.setattr(RMS_MODULE, "CONFIG", dataclasses.replace(
        config, forward=forward or config.forward, backward=backward or config.backward,
    ))


def use_stream_tuning(monkeypatch, **knobs):
    """Make rows longer than 16 take the streamed backward, with the given ``stream_*`` knobs exact."""
    tuning = dataclasses.replace(
        RMS_MODULE.CONFIG.backward, max_fused_hidden=STREAM_CHUNK, chunk=STREAM_CHUNK,
        split_max_hidden=0, **knobs,
    )
    set_tuning(monkeypatch, backward=tuning)


# Split rows under the interpreter: rows over 16 wide cut into 16-wide slices, one program each.
# (rows, hidden): (1, 20) two parts; (7, 40) three (a masked fourth slot); (19, 50)
# four, the last 2 wide. The interpreter runs programs one after another, so a program never sees
# a later partner's sums: the split-row kernels' RECOMPUTE_LATE branch (the only interpreter-only
# code in the GPU kernels) recomputes them from the inputs, and exists so that these tests can run
# the split-row path on a CPU; on a GPU the partners run at once and the branch is compiled out.
SPLIT_CASES = {"1row-2parts": (1, 20), "7rows-3parts": (7, 40), "19rows-4parts": (19, 50)}


def use_split_tuning(monkeypatch, **knobs):
    """Make rows of 17..64 take the split-row forward and backward (16-wide slices)."""
    forward, backward = (
        dataclasses.replace(
            tuning, max_fused_hidden=16, split_max_hidden=64, split_slice=16, split_warps=1, **knobs
        )
        for tuning in (RMS_MODULE.CONFIG.forward, RMS_MODULE.CONFIG.backward)
    )
    set_tuning(monkeypatch, forward=forward, backward=backward)


def check_rms_norm(x, weight, dy, *, eps=1e-6, offset=0.0, casting="llama"):
    dtype = x.dtype
    y = rms_norm(x, weight, eps, offset=offset, casting=casting)
    tensors = {"x": x, "weight": weight}
    ref, ref_grads = fp64_reference(
        rms_norm_reference, tensors, dy, eps=eps, offset=offset, casting=casting, io_dtype=dtype
    )
    expected_dtype = torch.promote_types(dtype, weight.dtype) if (casting == "llama" and weight is not None) else dtype
    assert y.dtype == expected_dtype
    assert_close(y, ref, dtype, "y")
    grads = torch.autograd.grad(y, [t for t in (x, weight) if t is not None and t.requires_grad], dy)
    names = [n for n, t in tensors.items() if t is not None and t.requires_grad]
    for name, grad in zip(names, grads, strict=True):
        assert grad.dtype == tensors[name].dtype
        assert_close(grad, ref_grads[name], dtype, f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden", SIZE_CASES)
def test_rms_norm_sizes(dtype, rows, hidden):
    x = randn(rows, hidden, dtype=dtype, requires_grad=True)
    w = randn(hidden, dtype=dtype, requires_grad=True)
    dy = randn(rows, hidden, dtype=dtype)
    check_rms_norm(x, w, dy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("casting", ("llama", "gemma"))
@pytest.mark.parametrize("offset", (0.0, 1.0))
@pytest.mark.parametrize("weight_kind", ("same", "fp32", "none"))
def test_rms_norm_casting_modes(dtype, casting, offset, weight_kind):
    x = randn(2, 9, 160, dtype=dtype, requires_grad=True)  # 3-D: leading dims flatten into rows
    weight = {
        "same": randn(160, dtype=dtype, requires_grad=True),
        "fp32": randn(160, dtype=torch.float32, requires_grad=True),
        "none": None,
    }[weight_kind]
    out_dtype = torch.promote_types(dtype, weight.dtype) if (weight is not None and casting == "llama") else dtype
    dy = randn(2, 9, 160, dtype=out_dtype)
    check_rms_norm(x, weight, dy, offset=offset if weight is not None else 0.0, casting=casting)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", (96, MAX_FUSED_HIDDEN_BWD + 1))
def test_rms_norm_noncontiguous_input_and_stride0_grad(dtype, hidden):
    x = noncontiguous(randn(5, hidden, dtype=dtype, requires_grad=True))
    w = randn(hidden, dtype=dtype, requires_grad=True)
    check_rms_norm(x, w, stride0_like(x))


def test_rms_norm_sum_backward_uses_expanded_grad():
    x = randn(4, 33, requires_grad=True)
    w = randn(33, requires_grad=True)
    rms_norm(x, w).sum().backward()
    ref, grads = fp64_reference(rms_norm_reference, {"x": x, "weight": w}, torch.ones(4, 33, device=DEVICE))
    assert_close(x.grad, grads["x"], torch.float32, "dx")
    assert_close(w.grad, grads["weight"], torch.float32, "dw")


# (x dtype, weight dtype, out_dtype): autocast's case (fp32 residual stream and weights, bf16 out)
# and a narrowing to fp16.
NARROWING_CASES = (
    (torch.float32, torch.float32, torch.bfloat16),
    (torch.float32, torch.bfloat16, torch.float16),
)


@pytest.mark.parametrize("x_dtype,w_dtype,out_dtype", NARROWING_CASES, ids=str)
@pytest.mark.parametrize("hidden", (96, MAX_FUSED_HIDDEN_BWD + 1))  # fused; streamed backward
@pytest.mark.parametrize("casting,offset", (("llama", 0.0), ("gemma", 1.0)))
def test_rms_norm_out_dtype_is_the_cast_output(x_dtype, w_dtype, out_dtype, hidden, casting, offset):
    """A narrower ``out_dtype`` gives bitwise ``rms_norm(...).to(out_dtype)``, and its gradient
    (taken in out_dtype) the gradients through that cast: the cast's backward widens the same dy
    exactly and the kernel upcasts whatever dy it reads, but on the GPU a kernel compiled for a bf16
    dy may sum its row in another order than one for an fp32 dy (the last bit of an fp32 gradient)."""
    x = randn(3, 7, hidden, dtype=x_dtype, requires_grad=True)
    w = randn(hidden, dtype=w_dtype, requires_grad=True)
    dy = randn(3, 7, hidden, dtype=out_dtype)
    y = rms_norm(x, w, offset=offset, casting=casting, out_dtype=out_dtype)
    want = rms_norm(x, w, offset=offset, casting=casting).to(out_dtype)
    assert y.dtype == out_dtype and torch.equal(y, want)
    got_grads = torch.autograd.grad(y, (x, w), dy)
    want_grads = torch.autograd.grad(want, (x, w), dy)
    for name, g, wg in zip(("dx", "dw"), got_grads, want_grads, strict=True):
        assert g.dtype == wg.dtype
        assert torch.equal(g, wg) if not ON_GPU else rel_err(g, wg) <= 1e-6, name


@pytest.mark.parametrize("casting,offset", (("llama", 0.0), ("gemma", 1.0)))
def test_rms_norm_wider_out_dtype_rounds_once(casting, offset):
    """bf16 in, fp32 out: the reference's own roundings (llama: x̂ to bf16), not the final one."""
    x = randn(5, 300, dtype=torch.bfloat16, requires_grad=True)
    w = randn(300, dtype=torch.bfloat16, requires_grad=True)
    dy = randn(5, 300, dtype=torch.float32)
    y = rms_norm(x, w, offset=offset, casting=casting, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    ref, ref_grads = fp64_reference(
        rms_norm_reference, {"x": x, "weight": w}, dy, offset=offset, casting=casting, io_dtype=torch.bfloat16
    )
    if casting == "gemma":  # the reference rounds its result to bf16; out_dtype=fp32 does not
        ref = ref.float()
    assert_close(y, ref, torch.bfloat16, "y")
    for name, g in zip(("x", "weight"), torch.autograd.grad(y, (x, w), dy), strict=True):
        assert g.dtype == torch.bfloat16
        assert_close(g, ref_grads[name], torch.bfloat16, f"d{name}")


def test_rms_norm_bad_out_dtype():
    x, w = randn(4, 8), randn(8)
    before = x.clone()
    for bad in (torch.int32, torch.float64):
        with pytest.raises(TypeError, match="out_dtype"):
            rms_norm(x, w, out_dtype=bad)
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", (7, 1000, MAX_FUSED_HIDDEN_FWD + 1))
@pytest.mark.parametrize("casting,offset", (("llama", 0.0), ("gemma", 1.0)))
def test_add_rms_norm(dtype, hidden, casting, offset):
    x = randn(3, hidden, dtype=dtype, requires_grad=True)
    residual = randn(3, hidden, dtype=dtype, requires_grad=True)
    w = randn(hidden, dtype=dtype, requires_grad=True)
    dy, ds = randn(3, hidden, dtype=dtype), randn(3, hidden, dtype=dtype)
    y, s = add_rms_norm(x, residual, w, offset=offset, casting=casting)
    (ref_y, ref_s), grads = fp64_reference(
        add_rms_norm_reference, {"x": x, "residual": residual, "weight": w}, (dy, ds),
        offset=offset, casting=casting, io_dtype=dtype,
    )
    assert y.dtype == dtype and s.dtype == dtype
    assert_close(s, ref_s, dtype, "s")
    assert_close(y, ref_y, dtype, "y")
    dx, dres, dw = torch.autograd.grad((y, s), (x, residual, w), (dy, ds))
    assert_close(dx, grads["x"], dtype, "dx")
    assert_close(dres, grads["residual"], dtype, "dresidual")
    assert_close(dw, grads["weight"], dtype, "dw")


MIXED_CASES = (  # (x, residual, weight, out_dtype): autocast's bf16/fp16 sublayer output into an fp32 stream
    (torch.bfloat16, torch.float32, torch.float32, None),
    (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16),
    (torch.float16, torch.float32, torch.float32, torch.float16),
    (torch.float32, torch.bfloat16, torch.bfloat16, None),
    (torch.bfloat16, torch.float16, torch.float32, torch.bfloat16),  # promotes to fp32
)


def use_streamed_tuning(monkeypatch):
    """Make rows longer than 16 take the streamed forward and backward (16-wide chunks, no split rows)."""
    forward, backward = (
        dataclasses.replace(tuning, max_fused_hidden=STREAM_CHUNK, chunk=STREAM_CHUNK, split_max_hidden=0)
        for tuning in (RMS_MODULE.CONFIG.forward, RMS_MODULE.CONFIG.backward)
    )
    set_tuning(monkeypatch, forward=forward, backward=backward)


# add_rms_norm's three regimes at widths the interpreter runs in a fraction of a second: (hidden, tuning). The
# default settings split rows past 32768 (forward) and 8192 (backward) and stream past 131072 and 65536
# (test_add_rms_norm runs the dtypes at 32769); here 50 = 3·16 + 2 in four parts, 70 = 4·16 + 6 in five chunks.
REGIMES = {"fused": (96, None), "split": (50, use_split_tuning), "streamed": (70, use_streamed_tuning)}


@pytest.mark.parametrize("x_dtype,r_dtype,w_dtype,out_dtype", MIXED_CASES, ids=str)
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("casting,offset", (("llama", 0.0), ("gemma", 1.0)))
def test_add_rms_norm_mixed_dtypes(monkeypatch, x_dtype, r_dtype, w_dtype, out_dtype, regime, casting, offset):
    """s in torch's promotion of x and residual, as ``x + residual``; y and the gradients those of
    ``rms_norm(x + residual, out_dtype=...)`` composed by autograd (bitwise off the GPU), and near the
    fp64 reference rounded where those dtypes round; each input's gradient in its own dtype. Rows fused,
    split, and streamed (:data:`REGIMES`)."""
    hidden, tuning = REGIMES[regime]
    if tuning is not None:
        tuning(monkeypatch)
    x = randn(2, 3, hidden, dtype=x_dtype, requires_grad=True)
    residual = randn(2, 3, hidden, dtype=r_dtype, requires_grad=True)
    w = randn(hidden, dtype=w_dtype, requires_grad=True)
    s_dtype = torch.promote_types(x_dtype, r_dtype)
    y_dtype = out_dtype or (torch.promote_types(s_dtype, w_dtype) if casting == "llama" else s_dtype)
    dy, ds = randn(2, 3, hidden, dtype=y_dtype), randn(2, 3, hidden, dtype=s_dtype)
    y, s = add_rms_norm(x, residual, w, offset=offset, casting=casting, out_dtype=out_dtype)
    assert s.dtype == s_dtype and y.dtype == y_dtype
    got = torch.autograd.grad((y, s), (x, residual, w), (dy, ds))
    want_s = x + residual
    want_y = rms_norm(want_s, w, offset=offset, casting=casting, out_dtype=out_dtype)
    want = torch.autograd.grad((want_y, want_s), (x, residual, w), (dy, ds))
    for name, g, wg, t in zip(("dx", "dresidual", "dw"), got, want, (x, residual, w), strict=True):
        assert g.dtype == t.dtype, name
        assert torch.equal(g, wg) if not ON_GPU else rel_err(g, wg) <= 1e-6, name
    assert torch.equal(s, want_s) and (torch.equal(y, want_y) if not ON_GPU else rel_err(y, want_y) <= 1e-6)
    (ref_y, ref_s), ref_grads = fp64_reference(
        add_rms_norm_reference, {"x": x, "residual": residual, "weight": w}, (dy, ds),
        offset=offset, casting=casting, io_dtype=s_dtype,
    )
    narrow = x_dtype if x_dtype != torch.float32 else r_dtype
    assert_close(s, ref_s, s_dtype, "s")
    assert_close(y, ref_y.to(y_dtype), y_dtype if y_dtype != torch.float32 else s_dtype, "y")
    for name, g in zip(("x", "residual", "weight"), got, strict=True):
        assert_close(g, ref_grads[name], narrow, f"d{name}")


def test_add_rms_norm_only_y_used():
    """When the residual output gets no gradient, autograd passes None for it."""
    x, r = randn(4, 64, requires_grad=True), randn(4, 64, requires_grad=True)
    w = randn(64, requires_grad=True)
    y, _ = add_rms_norm(x, r, w)
    y.backward(randn(4, 64))
    ref_y, grads = fp64_reference(
        lambda **kw: add_rms_norm_reference(**kw)[0], {"x": x, "residual": r, "weight": w}, None
    )
    assert torch.equal(x.grad, r.grad)


@pytest.mark.parametrize("case", ("fused", "streamed-groups"))
def test_rms_norm_deterministic(monkeypatch, case):
    rows, hidden = 300, 512
    if case == "streamed-groups":  # several groups of rows per band, bands split between programs
        rows, hidden, knobs = STREAM_CASES["19rows-groups2-split2"]
        use_stream_tuning(monkeypatch, **knobs)
    x = randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = randn(rows, hidden, dtype=torch.bfloat16)
    repeatable_grads(lambda: rms_norm(x, w), (x, w), dy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", STREAM_CASES)
def test_rms_norm_streamed_backward(monkeypatch, dtype, case):
    rows, hidden, knobs = STREAM_CASES[case]
    use_stream_tuning(monkeypatch, **knobs)
    x = randn(rows, hidden, dtype=dtype, requires_grad=True)
    w = randn(hidden, dtype=dtype, requires_grad=True)
    check_rms_norm(x, w, randn(rows, hidden, dtype=dtype))


@pytest.mark.parametrize("weight_kind", ("fp32", "none"))
def test_rms_norm_streamed_backward_gemma(monkeypatch, weight_kind):
    """Gemma casting (dw of the unrounded x̂) with an fp32 weight, and no weight at all."""
    rows, hidden, knobs = STREAM_CASES["19rows-groups2-split2"]
    use_stream_tuning(monkeypatch, **knobs)
    x = randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = randn(hidden, requires_grad=True) if weight_kind == "fp32" else None
    check_rms_norm(x, w, randn(rows, hidden, dtype=torch.bfloat16), offset=1.0, casting="gemma")


def check_add_rms_norm_grads(rows, hidden, dtype):
    """add_rms_norm's three gradients (the residual stream's own gradient joining dx) against fp64."""
    x = randn(rows, hidden, dtype=dtype, requires_grad=True)
    residual = randn(rows, hidden, dtype=dtype, requires_grad=True)
    w = randn(hidden, dtype=dtype, requires_grad=True)
    dy, ds = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype)
    y, s = add_rms_norm(x, residual, w)
    _, grads = fp64_reference(
        add_rms_norm_reference, {"x": x, "residual": residual, "weight": w}, (dy, ds), io_dtype=dtype
    )
    dx, dres, dw = torch.autograd.grad((y, s), (x, residual, w), (dy, ds))
    assert_close(dx, grads["x"], dtype, "dx")
    assert_close(dres, grads["residual"], dtype, "dresidual")
    assert_close(dw, grads["weight"], dtype, "dw")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ("1row-split2", "19rows-groups2-split2"))
def test_add_rms_norm_streamed_backward(monkeypatch, dtype, case):
    """The residual stream's own gradient (dsum) joins dx in the streamed pass 2."""
    rows, hidden, knobs = STREAM_CASES[case]
    use_stream_tuning(monkeypatch, **knobs)
    check_add_rms_norm_grads(rows, hidden, dtype)


# Every case in every dtype but fp16 at 19 rows (the slowest under the interpreter, 4 programs a row): fp16 differs
# from bf16 only in the dtype its tiles load and store, each load upcast to fp32.
RMS_SPLIT_CASES = [(case, dtype) for case in SPLIT_CASES for dtype in DTYPES
                   if case != "19rows-4parts" or dtype != torch.float16]


@pytest.mark.parametrize("case,dtype", RMS_SPLIT_CASES, ids=[f"{case}-{dtype}" for case, dtype in RMS_SPLIT_CASES])
def test_rms_norm_split_rows(monkeypatch, dtype, case):
    """Rows split over programs that swap their partial sums: under the interpreter the first part
    of each row finds no partner yet and recomputes their sums, the later parts find them published."""
    rows, hidden = SPLIT_CASES[case]
    use_split_tuning(monkeypatch)
    cfg = RMS_MODULE.norm_backward_launch(rows, hidden, torch.device(DEVICE))
    assert cfg.single_pass and cfg.split == -(-hidden // 16) and cfg.parts_block >= cfg.split
    assert RMS_MODULE.rms_norm_forward_launch(rows, hidden)[1] == cfg.split
    x = randn(rows, hidden, dtype=dtype, requires_grad=True)
    w = randn(hidden, dtype=dtype, requires_grad=True)
    check_rms_norm(x, w, randn(rows, hidden, dtype=dtype))
    repeatable_grads(lambda: rms_norm(x, w), (x, w), randn(rows, hidden, dtype=dtype))


@pytest.mark.parametrize("weight_kind", ("fp32-gemma", "none"))
def test_rms_norm_split_rows_weights(monkeypatch, weight_kind):
    rows, hidden = SPLIT_CASES["19rows-4parts"]
    use_split_tuning(monkeypatch)
    x = randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = randn(hidden, requires_grad=True) if weight_kind == "fp32-gemma" else None
    check_rms_norm(x, w, randn(rows, hidden, dtype=torch.bfloat16), offset=1.0, casting="gemma")


@pytest.mark.parametrize("case", ("1row-2parts", "19rows-4parts"))
def test_add_rms_norm_split_rows(monkeypatch, case):
    rows, hidden = SPLIT_CASES[case]
    use_split_tuning(monkeypatch)
    dtype = torch.bfloat16
    check_add_rms_norm_grads(rows, hidden, dtype)


def test_split_rows_need_every_program_at_once():
    """Programs wait for their partners: more than one program per multiprocessor is refused."""
    with pytest.raises(ValueError, match="split_programs_per_sm"):
        dataclasses.replace(RMS_MODULE.CONFIG.backward, split_programs_per_sm=2.0)


def test_norm_backward_launch_geometry(monkeypatch):
    """The streamed grid takes stream_rows rows a group and stream_split programs a band, each capped
    by what there is (rows, chunks, programs); the grid covers every row."""
    tuning = dataclasses.replace(
        RMS_MODULE.CONFIG.backward, max_fused_hidden=1024, chunk=1024, stream_rows=4, stream_split=2,
        stream_programs_per_sm=1.0, split_max_hidden=0,
    )
    cpu = torch.device("cpu")  # 4 programs under the interpreter
    set_tuning(monkeypatch, backward=tuning)

    def launch(num_rows=1000, hidden=8192):
        cfg = RMS_MODULE.norm_backward_launch(num_rows, hidden, cpu)
        assert not cfg.single_pass and cfg.block_n == 1024
        assert cfg.rows_per_band % cfg.block_m == 0
        assert (cfg.bands - 1) * cfg.rows_per_band < num_rows <= cfg.bands * cfg.rows_per_band
        assert cfg.programs == cfg.bands * cfg.split
        return cfg.block_m, cfg.split

    assert launch() == (4, 2)  # the maxima
    assert launch(num_rows=3) == (4, 2)  # a group holds at most the rows there are (padded to 4)
    assert launch(num_rows=1) == (1, 2)
    assert launch(hidden=1500) == (4, 2)  # two chunks: split 2 at most
    set_tuning(monkeypatch, backward=dataclasses.replace(tuning, stream_split=8))
    assert RMS_MODULE.norm_backward_launch(1000, 1500, cpu).split == 2  # capped by the chunks
    with pytest.raises(ValueError, match="stream_rows must be a power of two"):
        dataclasses.replace(tuning, stream_rows=3)
    with pytest.raises(ValueError, match="stream_split"):
        dataclasses.replace(tuning, stream_split=0)


def test_rms_norm_empty_rows():
    x = randn(0, 64, requires_grad=True)
    w = randn(64, requires_grad=True)
    y = rms_norm(x, w)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: (torch.ones(4, 8, dtype=torch.int32, device=DEVICE), randn(8)), TypeError, "x has dtype"),
        (lambda: (randn(4, 8), randn(7)), ValueError, "x's last dim 8 .* does not match weight's size 7"),
        (lambda: (randn(4, 9), randn(8)), ValueError, "x's last dim 9 .* does not match weight's size 8"),
        (lambda: (randn(4, 8), randn(8, 1)), ValueError, r"weight has shape \(8, 1\), expected \(8,\)"),
        (lambda: (randn(4, 8), randn(8, dtype=torch.float64)), TypeError, "weight has dtype"),
        (lambda: (randn(4, 8), torch.ones(8, device="meta")), ValueError, "weight is on meta"),
        (lambda: ([1.0, 2.0], None), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_rms_norm_bad_inputs(make, error, match):
    x, w = make()
    before = x.clone() if isinstance(x, torch.Tensor) else None
    with pytest.raises(error, match=match):
        rms_norm(x, w)
    if before is not None:
        assert torch.equal(x, before)


def test_rms_norm_bad_options():
    x, w = randn(4, 8), randn(8)
    with pytest.raises(ValueError, match="casting"):
        rms_norm(x, w, casting="mistral")
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, -1.0)
    with pytest.raises(TypeError, match="eps"):
        rms_norm(x, w, "1e-6")
    with pytest.raises(TypeError, match="offset"):
        add_rms_norm(x, randn(4, 8), w, offset="a")
    with pytest.raises(TypeError, match="eps"):
        rms_norm(x, w, None)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, float("inf"))
    with pytest.raises(ValueError, match="offset"):
        rms_norm(x, w, offset=float("nan"))
    with pytest.raises(ValueError, match="residual has shape"):
        add_rms_norm(x, randn(4, 9), w)
    with pytest.raises(TypeError, match="residual has dtype"):
        add_rms_norm(x, randn(4, 8).to(torch.int32), w)
    with pytest.raises(TypeError, match="out_dtype"):
        add_rms_norm(x, randn(4, 8), w, out_dtype=torch.float64)


@pytest.mark.skipif(ON_GPU, reason="on a GPU, CPU tensors are simply the wrong device (checked above)")
def test_rms_norm_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA tensors"):
        rms_norm(randn(2, 8), randn(8))


@pytest.mark.gpu
def test_rms_norm_cpu_tensor_on_gpu_machine_rejected():
    with pytest.raises(ValueError, match="CUDA tensors"):
        rms_norm(torch.randn(2, 8), torch.randn(8))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", (4096, 3 * MAX_FUSED_HIDDEN_BWD // 2 + 5))  # fused; streamed backward
@pytest.mark.parametrize("fn", ("rms_norm", "add_rms_norm"))
def test_rms_norm_torch_compile_fullgraph(fn, hidden):
    x = randn(64, hidden, dtype=torch.bfloat16, requires_grad=True)
    r = randn(64, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = randn(hidden, dtype=torch.float32, requires_grad=True)

    def f(x, r, w):
        if fn == "rms_norm":
            return rms_norm(x + r, w, casting="gemma", offset=1.0).float().square().sum()
        y, s = add_rms_norm(x, r, w)
        return (y.float().square().sum() + s.float().sum())

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(x, r, w)
    grads = torch.autograd.grad(loss, (x, r, w))
    ref_loss = f(x, r, w)
    ref_grads = torch.autograd.grad(ref_loss, (x, r, w))
    assert_close(loss, ref_loss, torch.float32, "loss")
    for g, rg in zip(grads, ref_grads, strict=True):
        assert_close(g, rg, torch.bfloat16, "grad")


# Compiled for real: pipelined chunk loads (cp.async) must not overtake the partial-row stores of the
# group before, and every band must still be summed in the same order.
GPU_STREAM_KNOBS = (
    dict(stream_rows=4, stream_split=2, stream_stages=3, stream_evict_first=True),
    dict(stream_rows=2, stream_split=1, stream_stages=2, stream_evict_first=False),
    dict(stream_rows=1, stream_split=4, stream_stages=1, stream_evict_first=True),
)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", GPU_STREAM_KNOBS, ids=lambda k: "-".join(str(v) for v in k.values()))
@pytest.mark.parametrize("fn", ("rms_norm", "add_rms_norm"))
def test_rms_norm_streamed_backward_gpu(monkeypatch, knobs, fn):
    tuning = dataclasses.replace(RMS_MODULE.CONFIG.backward, split_max_hidden=0, **knobs)
    set_tuning(monkeypatch, backward=tuning)
    rows, hidden = 2048, 5 * 4096 - 93  # several groups per band; the last chunk partly padding
    x = randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = randn(rows, hidden, dtype=torch.bfloat16)
    if fn == "rms_norm":
        check_rms_norm(x, w, dy)
        repeatable_grads(lambda: rms_norm(x, w), (x, w), dy)
    else:
        r, ds = randn(rows, hidden, dtype=torch.bfloat16), randn(rows, hidden, dtype=torch.bfloat16)
        first = repeatable_grads(lambda: add_rms_norm(x, r, w), (x, w), (dy, ds))
        _, grads = fp64_reference(
            add_rms_norm_reference, {"x": x, "residual": r, "weight": w}, (dy, ds), io_dtype=torch.bfloat16
        )
        assert_close(first[0], grads["x"], torch.bfloat16, "dx")
        assert_close(first[1], grads["weight"], torch.bfloat16, "dw")


# Compiled for real: programs that hold slices of the same rows swap their sums through global
# memory while they run (20387 columns: 3 slices of 8192, 5 of 4096 or 10 of 2048, the last partial).
GPU_SPLIT_KNOBS = (
    dict(split_slice=8192, split_warps=16, split_programs_per_sm=1.0),
    dict(split_slice=4096, split_warps=8, split_programs_per_sm=1.0),
    dict(split_slice=2048, split_warps=8, split_programs_per_sm=0.5),
)


def split_grads(fn, inputs, grad_outputs, **knobs):
    """Gradients with rows split (split_max_hidden past any row), under the given knobs."""
    return split_run(fn, inputs, grad_outputs, **knobs)[1]


def split_run(fn, inputs, grad_outputs, **knobs):
    """(outputs, gradients) with rows split in the backward, under the given knobs. The outputs are looked at
    after the backward: what the backward read of them (the saved s of add_rms_norm) is still there."""
    saved = RMS_MODULE.CONFIG
    RMS_MODULE.CONFIG = dataclasses.replace(
        saved, backward=dataclasses.replace(saved.backward, split_max_hidden=1 << 20, **knobs)
    )
    try:
        outputs = fn()
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        grad_outputs = grad_outputs if isinstance(grad_outputs, tuple) else (grad_outputs,)
        grads = torch.autograd.grad(outputs, inputs, grad_outputs)
        return tuple(o.detach() for o in outputs), grads
    finally:
        RMS_MODULE.CONFIG = saved


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", GPU_SPLIT_KNOBS, ids=lambda k: "-".join(str(v) for v in k.values()))
@pytest.mark.parametrize("fn", ("rms_norm", "add_rms_norm"))
def test_rms_norm_split_rows_gpu(knobs, fn):
    """Right against fp64, and bitwise the same on a second run."""
    rows, hidden = 2048, 5 * 4096 - 93
    dtype = torch.bfloat16
    x = randn(rows, hidden, dtype=dtype, requires_grad=True)
    w = randn(hidden, dtype=dtype, requires_grad=True)
    dy = randn(rows, hidden, dtype=dtype)
    if fn == "rms_norm":
        call, inputs, grad_outputs, ref_fn = (lambda: rms_norm(x, w)), (x, w), dy, rms_norm_reference
        tensors = {"x": x, "weight": w}
    else:
        r, ds = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype)
        call, inputs, grad_outputs = (lambda: add_rms_norm(x, r, w)), (x, w), (dy, ds)
        ref_fn, tensors = add_rms_norm_reference, {"x": x, "residual": r, "weight": w}
    first_outputs, first = split_run(call, inputs, grad_outputs, **knobs)
    again_outputs, again = split_run(call, inputs, grad_outputs, **knobs)
    names = ("y", "s", "dx", "dw") if fn == "add_rms_norm" else ("y", "dx", "dw")
    for name, a, b in zip(names, first_outputs + first, again_outputs + again, strict=True):
        assert_bitwise_equal(a, b, name)
    _, grads = fp64_reference(ref_fn, tensors, grad_outputs, io_dtype=dtype)
    assert_close(first[0], grads["x"], dtype, "dx")
    assert_close(first[1], grads["weight"], dtype, "dw")


@pytest.mark.gpu
@pytest.mark.bigmem
def test_rms_norm_int64_offsets():
    """More than 2**31 elements: offsets computed in 64 bit, so the last rows are right."""
    hidden = 4096
    rows = (2**31 // hidden) + 64
    x = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    y = rms_norm(x, w)
    tail = slice(rows - 128, rows)
    ref = rms_norm_reference(x[tail].detach().double(), w.detach().double(), io_dtype=torch.bfloat16)
    assert_close(y[tail], ref, torch.bfloat16, "y tail")
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, (x,), dy)
    xt = x[tail].detach().double().requires_grad_()
    ref_t = rms_norm_reference(xt, w.detach().double(), io_dtype=torch.bfloat16)
    (ref_dx,) = torch.autograd.grad(ref_t, (xt,), dy[tail].double())
    assert_close(dx[tail], ref_dx, torch.bfloat16, "dx tail")


# Fused-regime knobs (RMS_NORM_CONFIG.forward / RMS_NORM_CONFIG.backward tile_elements, elements_per_warp, max_warps) as
# dev/tune_norm.py's fused sweep moves them, shrunk to interpreter sizes: (rows, hidden, knobs).
FUSED_CASES = {
    # 4 rows of 100 (128 lanes) a tile, 37 rows: bands of 12, 12, 12 and 1, the last tile 3/4 padding
    "rows4": (37, 100, dict(tile_elements=512, elements_per_warp=128, max_warps=2)),
    # one row per tile (tile narrower than the row), one warp
    "1row": (9, 77, dict(tile_elements=64, elements_per_warp=1024)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FUSED_CASES)
@pytest.mark.parametrize("fn", ("rms_norm", "add_rms_norm"))
def test_rms_norm_fused_knobs(monkeypatch, dtype, case, fn):
    rows, hidden, knobs = FUSED_CASES[case]
    set_tuning(monkeypatch, forward=dataclasses.replace(RMS_MODULE.CONFIG.forward, **knobs),
               backward=dataclasses.replace(RMS_MODULE.CONFIG.backward, **knobs))
    x = noncontiguous(randn(rows, hidden, dtype=dtype, requires_grad=True))
    w = randn(hidden, dtype=dtype, requires_grad=True)
    dy = randn(rows, hidden, dtype=dtype)
    if fn == "rms_norm":
        check_rms_norm(x, w, dy)
        check_rms_norm(x, w, stride0_like(x))
        return
    r = randn(rows, hidden, dtype=dtype, requires_grad=True)
    ds = stride0_like(x)
    y, s = add_rms_norm(x, r, w)
    (ref_y, ref_s), grads = fp64_reference(
        add_rms_norm_reference, {"x": x, "residual": r, "weight": w}, (dy, ds), io_dtype=dtype
    )
    assert_close(s, ref_s, dtype, "s")
    assert_close(y, ref_y, dtype, "y")
    dx, dw = torch.autograd.grad((y, s), (x, w), (dy, ds))
    assert_close(dx, grads["x"], dtype, "dx")
    assert_close(dw, grads["weight"], dtype, "dw")


@pytest.mark.gpu
@pytest.mark.parametrize("programs_per_sm", (0.5, 1.5, 3))
@pytest.mark.parametrize("fn", ("rms_norm", "add_rms_norm"))
def test_rms_norm_fused_programs_per_sm_gpu(monkeypatch, programs_per_sm, fn):
    """Fractional persistent grids (the fused sweep tries them): right, and bitwise the same twice."""
    tuning = dataclasses.replace(RMS_MODULE.CONFIG.backward, programs_per_sm=programs_per_sm)
    set_tuning(monkeypatch, backward=tuning)
    rows, hidden = 9001, 896
    x = randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = randn(hidden, dtype=torch.bfloat16, requires_grad=True)
    dy = randn(rows, hidden, dtype=torch.bfloat16)
    if fn == "rms_norm":
        check_rms_norm(x, w, dy)
        repeatable_grads(lambda: rms_norm(x, w), (x, w), dy)
    else:
        r = randn(rows, hidden, dtype=torch.bfloat16)
        repeatable_grads(lambda: add_rms_norm(x, r, w)[0], (x, w), dy)


@pytest.mark.gpu
def test_rms_norm_out_dtype_torch_compile_fullgraph():
    """The fp32 residual stream normalised straight into bf16, traced whole by torch.compile."""
    x = randn(64, 2048, dtype=torch.float32, requires_grad=True)
    w = randn(2048, dtype=torch.float32, requires_grad=True)

    def f(x, w):
        return rms_norm(x, w, out_dtype=torch.bfloat16).float().square().sum()

    loss = torch.compile(f, fullgraph=True)(x, w)
    grads = torch.autograd.grad(loss, (x, w))
    ref_loss = f(x, w)
    ref_grads = torch.autograd.grad(ref_loss, (x, w))
    assert_close(loss, ref_loss, torch.float32, "loss")  # Inductor sums the squares in its own order
    for g, rg in zip(grads, ref_grads, strict=True):
        assert_close(g, rg, torch.bfloat16, "grad")


def test_stand_in_scratch_never_crosses_fake_and_real():
    """An unsplit launch's stand-in scratch is cached per device for real calls only. torch.compile
    traces the launchers with fake tensors: a stand-in made then and cached broke every later real
    call (and the first real one cached must not be handed to a trace either)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    device = torch.device(DEVICE)
    with FakeTensorMode():
        traced, traced2, _, _ = split_rows_scratch(1, 4, 1, device)
        assert isinstance(traced, FakeTensor) and traced2 is traced
    real, _, _, _ = split_rows_scratch(1, 4, 1, device)
    assert not isinstance(real, FakeTensor)
    assert split_rows_scratch(1, 4, 1, device)[0] is real  # cached
    with FakeTensorMode():
        assert isinstance(split_rows_scratch(1, 4, 1, device)[0], FakeTensor)
    x = randn(3, 40, requires_grad=True)
    (dx,) = torch.autograd.grad(rms_norm(x, None, eps=1e-6).sum(), x)  # eager, after the traces
    assert torch.isfinite(dx).all()


def _strided_scales(t):
    """``t``'s values with stride 2, and with stride 0 (its first value broadcast)."""
    return noncontiguous(t), t[:1].expand_as(t)


@pytest.mark.parametrize("op", ("rms_norm", "add_rms_norm"))
def test_strided_weight_reads_its_strides(op):
    """A weight with stride 2 or 0 gives what its contiguous copy gives, gradients included."""
    x, w = randn(5, 24, requires_grad=True), randn(24, requires_grad=True)
    residual = randn(5, 24)

    def run(weight):
        out = rms_norm(x, weight) if op == "rms_norm" else add_rms_norm(x, residual, weight)[0]
        return (out, *torch.autograd.grad(out, (x, weight), torch.full((), 0.7, device=DEVICE).expand_as(out)))

    for weight in _strided_scales(w):
        got, want = run(weight), run(weight.detach().contiguous().requires_grad_())
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
