"""tigon.ops.fused_linear_cross_entropy against F.linear + the fp64 cross-entropy reference.

Chunkings (chunk_plan in fused_linear_cross_entropy.py): one token chunk (small problems), several
token chunks (dW summed over chunks in its dtype or in an fp32 accumulator, the last chunk
shorter), several class chunks (two passes, dX summed in fp32, the last chunk narrower). Tests
force each plan at small sizes by replacing chunk_plan, and check the plan chosen at the benchmark
shapes. The cross-entropy options are those
of tigon.ops.cross_entropy (whose tests sweep them all); here each reaches the loss through every
chunking, with and without a bias.
"""

import dataclasses
import importlib

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from tests.helpers import DEVICE, DTYPES, LOSS_TOLERANCE, assert_close, fp64_reference, randn, rel_err
from tigon._kernels import matmul_accumulate, sum_round
from tigon._kernels import vocab_chunks as _vocab_chunks
from tigon.ops.fused_linear_cross_entropy import (
    CONFIG,
    ChunkPlan,
    chunk_plan,
    fp32_dw_peak_bytes,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)

# The package exports the function under the module's name, so reach the module itself this way.
flce_module = importlib.import_module("tigon.ops.fused_linear_cross_entropy")
ce_module = importlib.import_module("tigon._kernels.cross_entropy_launch")  # the row kernels' CONFIG

ALL_OPTIONS = dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0, logit_scale=0.7)
# Forced chunkings, each with the launch configs it sets (vocabulary-chunk kernels, cross-entropy
# rows): the class-chunk kernels in several blocks a row (one program a row, one or two blocks
# ahead), and in the persistent streamed grid that chunks wider than row_max_width take.
PLANS = {
    "tokens": (ChunkPlan(True, 4), {}, {}),
    "tokens_fp32_dw": (ChunkPlan(True, 4, fp32_dw=True), {}, {}),
    # chunks of 4, 3 and 3 tokens, the last one's buffer made anew
    "tokens_fp32_dw_last": (ChunkPlan(True, 4, fp32_dw=True, last=3, sum_round=True), {}, {}),
    "classes": (ChunkPlan(False, 128), {}, {}),
    "classes_blocks": (ChunkPlan(False, 128), dict(block_v=32, prefetch=2), {}),
    "classes_persistent": (ChunkPlan(False, 128), dict(row_max_width=0), dict(
        stream_block_v=32, stream_warps=1, stream_softcap_block_v=32, stream_softcap_warps=1,
    )),
}
CHUNKED_PLANS = tuple(PLANS)


def make_target(shape, vocab, *, ignored=1):
    target = torch.randint(0, vocab, shape, device=DEVICE)
    target.view(-1)[:ignored] = -100
    return target


def make_inputs(tokens_shape, hidden, vocab, dtype, *, bias=False):
    x = randn(*tokens_shape, hidden, dtype=dtype, requires_grad=True)
    w = randn(vocab, hidden, scale=hidden**-0.5 * 2, dtype=dtype, requires_grad=True)
    b = randn(vocab, dtype=dtype, requires_grad=True) if bias else None
    return x, w, b


def check_flce(x, w, target, bias=None, *, io_dtype=None, **options):
    """Loss and gradients (to x, w, bias) against the fp64 reference; returns the loss."""
    io_dtype = io_dtype or x.dtype
    loss = fused_linear_cross_entropy(x, w, target, linear_bias=bias, **options)
    g = randn(*loss.shape) if loss.dim() else randn(1).squeeze()
    weight = options.pop("weight", None)
    tensors = {"input": x, "linear_weight": w, "linear_bias": bias, "weight": weight}
    ref, grads = fp64_reference(
        fused_linear_cross_entropy_reference, tensors, g, target=target, io_dtype=io_dtype, **options
    )
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_close(loss, ref, io_dtype, "loss", tolerance=LOSS_TOLERANCE)
    leaves = [(n, t) for n, t in (("input", x), ("linear_weight", w), ("linear_bias", bias))
              if t is not None and t.requires_grad]
    computed = torch.autograd.grad(loss, [t for _, t in leaves], g)
    for (name, t), grad in zip(leaves, computed, strict=True):
        assert grad.dtype == t.dtype and grad.shape == t.shape, name
        assert_close(grad, grads[name], io_dtype, f"d{name}")
    return loss


@pytest.fixture
def plan(request, monkeypatch):
    """Force a chunking: "default" leaves chunk_plan alone (one chunk at these sizes)."""
    if request.param != "default":
        forced, chunk_knobs, row_knobs = PLANS[request.param]
        monkeypatch.setattr(flce_module, "chunk_plan", lambda *args, **kwargs: forced)
        monkeypatch.setattr(_vocab_chunks, "CONFIG", dataclasses.replace(_vocab_chunks.CONFIG, **chunk_knobs))
        monkeypatch.setattr(ce_module, "CONFIG", dataclasses.replace(ce_module.CONFIG, **row_knobs))
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", ("plain", "all"))
@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
@pytest.mark.parametrize("bias", (False, True), ids=("no_bias", "bias"))
def test_flce_options(dtype, bias, reduction, options):
    x, w, b = make_inputs((6,), 16, 37, dtype, bias=bias)
    kwargs = dict(ALL_OPTIONS, weight=torch.rand(37, device=DEVICE) + 0.1) if options == "all" else {}
    check_flce(x, w, make_target((6,), 37), b, reduction=reduction, **kwargs)


@pytest.mark.parametrize("plan", CHUNKED_PLANS, indirect=True)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_flce_chunked(plan, dtype, reduction):
    """10 tokens in chunks of 4 (4, 4, 2) or 300 classes in chunks of 128 (128, 128, 44), the class
    chunks' rows in one block or several (4, 4, 2 blocks of 32)."""
    x, w, b = make_inputs((10,), 24, 300, dtype, bias=True)
    target = make_target((10,), 300, ignored=2)
    target[-1] = 299  # the last class: in the last, narrower class chunk
    weight = torch.rand(300, device=DEVICE) + 0.1
    check_flce(x, w, target, b, reduction=reduction, weight=weight, **ALL_OPTIONS)


@pytest.mark.parametrize("plan", CHUNKED_PLANS, indirect=True)
@pytest.mark.parametrize("softcap", (30.0, 60.0), ids=("fixed_shift", "running_max"))
def test_flce_chunked_softcap(plan, softcap):
    """Class chunks carry each row's (max, Σ exp) from chunk to chunk: with softcap ≤
    MAX_SHIFT_SOFTCAP every chunk shifts by κ, past it by the running maximum."""
    x, w, b = make_inputs((10,), 24, 300, torch.float32, bias=True)
    x = x * 4.0  # logits of tens: some tanh saturated
    check_flce(x, w, make_target((10,), 300, ignored=2), b, reduction="sum", softcap=softcap, logit_scale=1.5)


@pytest.mark.parametrize("plan", ("tokens_fp32_dw",), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_flce_fp32_dw(plan, dtype, reduction, monkeypatch):
    """Token chunks with dW summed in an fp32 accumulator: every gradient in its own dtype, with
    every option; the accumulator is fp32 (the matmul's ``out``) whatever the weight's dtype."""
    sums = []

    def recording(out, a, b, *, first):
        sums.append(out.dtype)
        return matmul_accumulate(out, a, b, first=first)

    monkeypatch.setattr(flce_module, "matmul_accumulate", recording)
    x, w, b = make_inputs((10,), 24, 300, dtype, bias=True)
    target = make_target((10,), 300, ignored=2)
    weight = torch.rand(300, device=DEVICE) + 0.1
    check_flce(x, w, target, b, reduction=reduction, weight=weight, **ALL_OPTIONS)
    assert sums == [torch.float32] * 3  # chunks of 4, 4 and 2 tokens


@pytest.mark.parametrize("plan", ("tokens_fp32_dw",), indirect=True)
def test_flce_fp32_dw_autocast_bf16_weight(plan):
    """fp32 input and bias, bf16 weight under autocast: dX and db in fp32, dW accumulated in fp32 and
    returned in bf16."""
    x, _, b = make_inputs((10,), 16, 260, torch.float32, bias=True)
    w = randn(260, 16, scale=0.5, dtype=torch.bfloat16, requires_grad=True)
    target = make_target((10,), 260)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(x, w, target, linear_bias=b, z_loss=1e-3, reduction="sum")
    dx, dw, db = torch.autograd.grad(loss, (x, w, b))
    assert (dx.dtype, dw.dtype, db.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    rounded = {"input": x, "linear_weight": w, "linear_bias": b}
    rounded = {k: v.detach().to(torch.bfloat16).requires_grad_() for k, v in rounded.items()}
    ref, grads = fp64_reference(
        fused_linear_cross_entropy_reference, rounded, None, target=target, io_dtype=torch.bfloat16,
        z_loss=1e-3, reduction="sum",
    )
    assert_close(loss, ref, torch.bfloat16, "loss", tolerance=LOSS_TOLERANCE)
    for name, grad in (("input", dx), ("linear_weight", dw), ("linear_bias", db)):
        assert_close(grad, grads[name], torch.bfloat16, f"d{name}")


@pytest.mark.parametrize("plan", ("tokens_fp32_dw_last",), indirect=True)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("reduction", ("mean", "none"))
def test_flce_fp32_dw_sum_round(plan, dtype, reduction, monkeypatch):
    """The last chunk's dW by the add-and-round matmul (_kernels/add_round_matmul.py), forced here (on a GPU the
    default): the first two chunks summed in the fp32 accumulator, the last one added and the sum rounded
    to dW's dtype by one kernel; every gradient against fp64. V = 296: rows of dL 16-byte aligned, as
    TMA needs (V = 300 in the other tests keeps cuBLAS's sum and the cast)."""
    monkeypatch.setattr(flce_module, "CONFIG", dataclasses.replace(CONFIG, sum_round=True))
    calls = []

    def recording_sum(out, a, b, *, first):
        calls.append(("accumulate", out.dtype, a.shape[1]))
        return matmul_accumulate(out, a, b, first=first)

    def recording_round(a, b, c, out):
        calls.append(("sum_round", out.dtype, a.shape[0]))
        return sum_round(a, b, c, out)

    monkeypatch.setattr(flce_module, "matmul_accumulate", recording_sum)
    monkeypatch.setattr(flce_module, "sum_round", recording_round)
    x, w, b = make_inputs((10,), 24, 296, dtype, bias=True)
    target = make_target((10,), 296, ignored=2)
    target[-1] = 295
    check_flce(x, w, target, b, reduction=reduction, **ALL_OPTIONS)
    assert calls == [("accumulate", torch.float32, 4), ("accumulate", torch.float32, 3), ("sum_round", dtype, 3)]


def test_token_chunks():
    assert ChunkPlan(True, 4).token_chunks(10) == [(0, 4), (4, 8), (8, 10)]
    assert ChunkPlan(True, 4, fp32_dw=True, last=3).token_chunks(10) == [(0, 4), (4, 7), (7, 10)]
    assert ChunkPlan(True, 3072, fp32_dw=True, last=2048).token_chunks(8192) == [
        (0, 3072), (3072, 6144), (6144, 8192)]
    assert ChunkPlan(True, 4, last=6).token_chunks(5) == [(0, 4), (4, 5)]  # last ≥ the tokens: ignored
    assert ChunkPlan(True, 4).token_chunks(0) == []


def test_flce_fp32_dw_sums_more_exactly(monkeypatch):
    """128 tokens in 64 chunks of 2, bf16: dW summed in fp32 and rounded once is nearer the fp64 dW
    than the sum of bf16 partials (each addition rounded). Both share the rounding of dL to bf16
    (and here of each chunk's product: off the GPU the matmul cannot accumulate into fp32 itself),
    so the gain is less than the one rounding against 64: the errors' ratio is 0.48-0.55 over seeds."""
    x, w, _ = make_inputs((128,), 16, 96, torch.bfloat16)
    target = make_target((128,), 96, ignored=0)
    _, grads = fp64_reference(
        fused_linear_cross_entropy_reference, {"input": x, "linear_weight": w}, None, target=target,
        io_dtype=torch.bfloat16, reduction="sum",
    )
    errors = {}
    for fp32_dw in (False, True):
        monkeypatch.setattr(flce_module, "chunk_plan", lambda *a, f=fp32_dw, **k: ChunkPlan(True, 2, fp32_dw=f))
        loss = fused_linear_cross_entropy(x, w, target, reduction="sum")
        (dw,) = torch.autograd.grad(loss, (w,))
        errors[fp32_dw] = rel_err(dw, grads["linear_weight"])
    assert errors[True] < 0.75 * errors[False], errors


@pytest.mark.parametrize("plan", ("default", "tokens", "classes", "tokens_fp32_dw", "tokens_fp32_dw_last"),
                         indirect=True)
def test_flce_3d_input(plan):
    x, w, _ = make_inputs((2, 3), 16, 260, torch.bfloat16)
    loss = check_flce(x, w, make_target((2, 3), 260), reduction="none")
    assert loss.shape == (6,)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flce_one_token(dtype):
    x, w, b = make_inputs((1,), 8, 50, dtype, bias=True)
    check_flce(x, w, make_target((1,), 50, ignored=0), b)


@pytest.mark.parametrize("plan", ("default", "tokens", "classes", "tokens_fp32_dw"), indirect=True)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_flce_num_items_in_batch(plan, dtype):
    """transformers' gradient accumulation: sum / num_items_in_batch equals the stock loss and grads."""
    x, w, _ = make_inputs((2, 5), 16, 260, dtype)
    labels = make_target((2, 5), 260, ignored=0)
    labels[0, 1] = -100
    num_items = torch.tensor(7, device=DEVICE)  # as the Trainer counts over the whole accumulated batch

    stock = ForCausalLMLoss(torch.nn.functional.linear(x, w), labels, 260, num_items_in_batch=num_items)
    stock_grads = torch.autograd.grad(stock, (x, w))

    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    ours = fused_linear_cross_entropy(x, w, shifted, reduction="sum") / num_items
    our_grads = torch.autograd.grad(ours, (x, w))

    assert_close(ours, stock, dtype, "loss", tolerance=LOSS_TOLERANCE)
    assert_close(our_grads[0], stock_grads[0], dtype, "dx")
    assert_close(our_grads[1], stock_grads[1], dtype, "dw")


@pytest.mark.parametrize("plan", ("default", "tokens", "classes", "tokens_fp32_dw"), indirect=True)
def test_flce_autocast(plan):
    """fp32 input and weight under autocast: the matmul in bf16 as F.linear's, gradients in fp32."""
    x, w, b = make_inputs((9,), 16, 260, torch.float32, bias=True)
    target = make_target((9,), 260)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(x, w, target, linear_bias=b, label_smoothing=0.1)
        assert torch.nn.functional.linear(x, w, b).dtype == torch.bfloat16  # what autocast does to F.linear
    dx, dw, db = torch.autograd.grad(loss, (x, w, b))
    assert loss.dtype == dx.dtype == dw.dtype == db.dtype == torch.float32
    rounded = {"input": x, "linear_weight": w, "linear_bias": b}
    rounded = {k: v.detach().to(torch.bfloat16).requires_grad_() for k, v in rounded.items()}
    ref, grads = fp64_reference(
        fused_linear_cross_entropy_reference, rounded, None, target=target, io_dtype=torch.bfloat16,
        label_smoothing=0.1,
    )
    assert_close(loss, ref, torch.bfloat16, "loss", tolerance=LOSS_TOLERANCE)
    for name, grad in (("input", dx), ("linear_weight", dw), ("linear_bias", db)):
        assert_close(grad, grads[name], torch.bfloat16, f"d{name}")


@pytest.mark.parametrize("shape", [(0,), (2, 0)], ids=str)
@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_flce_no_tokens(shape, reduction):
    """No tokens: cross_entropy's empty loss (0 for mean and sum, an empty one for none), zero gradients."""
    x, w, b = make_inputs(shape, 16, 37, torch.float32, bias=True)
    target = torch.zeros(shape, dtype=torch.long, device=DEVICE)
    loss = fused_linear_cross_entropy(x, w, target, linear_bias=b, reduction=reduction)
    assert loss.shape == ((0,) if reduction == "none" else ())
    assert torch.equal(loss, torch.zeros_like(loss))
    grads = torch.autograd.grad(loss.sum(), (x, w, b), allow_unused=True)
    assert grads[0].shape == x.shape
    for grad in grads[1:]:
        assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("plan", ("default", "classes", "tokens_fp32_dw"), indirect=True)
@pytest.mark.parametrize("which", ("input", "weight", "bias"))
def test_flce_gradient_to_one_argument(plan, which):
    x, w, b = make_inputs((5,), 16, 260, torch.float32, bias=True)
    for name, t in (("input", x), ("weight", w), ("bias", b)):
        t.requires_grad_(name == which)
    check_flce(x, w, make_target((5,), 260), b, label_smoothing=0.2)


@pytest.mark.parametrize("plan", ("default", "tokens", "classes", "tokens_fp32_dw"), indirect=True)
def test_flce_no_grad(plan):
    x, w, b = make_inputs((5,), 16, 260, torch.float32, bias=True)
    target = make_target((5,), 260)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(x, w, target, linear_bias=b, reduction="none")
    assert not loss.requires_grad
    ref = fused_linear_cross_entropy_reference(
        x.double(), w.double(), target, linear_bias=b.double(), reduction="none"
    )
    assert_close(loss, ref, torch.float32, "loss", tolerance=LOSS_TOLERANCE)


@pytest.mark.parametrize("plan", ("default", "tokens", "classes", "tokens_fp32_dw"), indirect=True)
@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_flce_all_ignored(plan, reduction):
    x, w, b = make_inputs((6,), 16, 260, torch.float32, bias=True)
    target = torch.full((6,), -100, device=DEVICE)
    loss = fused_linear_cross_entropy(x, w, target, linear_bias=b, reduction=reduction, z_loss=1e-3)
    assert torch.equal(loss, torch.zeros_like(loss))
    for grad in torch.autograd.grad(loss.sum(), (x, w, b)):
        assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("plan", ("default", "classes", "tokens_fp32_dw"), indirect=True)
def test_flce_backward_twice(plan):
    """retain_graph with different grad_outputs, both reductions' backward paths."""
    x, w, _ = make_inputs((5,), 16, 260, torch.float32)
    target = make_target((5,), 260)
    for reduction, shape in (("mean", ()), ("none", (5,))):
        loss = fused_linear_cross_entropy(x, w, target, reduction=reduction)
        returned = []
        for _ in range(3):
            g = randn(*shape) if shape else randn(1).squeeze()
            dx, dw = torch.autograd.grad(loss, (x, w), g, retain_graph=True)
            _, grads = fp64_reference(
                fused_linear_cross_entropy_reference, {"input": x, "linear_weight": w}, g, target=target,
                reduction=reduction,
            )
            returned.append((dx, dw, grads))
        for dx, dw, grads in returned:  # the earlier gradients were not rescaled by the later backwards
            assert_close(dx, grads["input"], torch.float32, "dx")
            assert_close(dw, grads["linear_weight"], torch.float32, "dw")
    loss = fused_linear_cross_entropy(x, w, target)
    zero_dx, zero_dw = torch.autograd.grad(loss * 0.0, (x, w), retain_graph=True)
    assert not zero_dx.any() and not zero_dw.any()
    dx, dw = torch.autograd.grad(loss, (x, w))  # the zero above did not erase the saved gradients
    _, grads = fp64_reference(fused_linear_cross_entropy_reference, {"input": x, "linear_weight": w}, None,
                              target=target)
    assert_close(dx, grads["input"], torch.float32, "dx")
    assert_close(dw, grads["linear_weight"], torch.float32, "dw")


def test_flce_out_of_range_target_raises():
    x, w, _ = make_inputs((4,), 8, 30, torch.float32)
    target = make_target((4,), 30)
    target[1] = 30
    with pytest.raises(ValueError, match="class index 30, outside"):
        fused_linear_cross_entropy(x, w, target)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda x, w, t: (x, randn(30, 9), t, {}), ValueError, "linear_weight has shape"),
        (lambda x, w, t: (x, randn(30), t, {}), ValueError, "linear_weight has shape"),
        (lambda x, w, t: (x, w.detach().double(), t, {}), TypeError, "linear_weight has dtype"),
        (lambda x, w, t: (x, w.detach().half(), t, {}), TypeError, "linear_weight has dtype"),
        (lambda x, w, t: (x, w, t, {"linear_bias": randn(29)}), ValueError, "linear_bias has shape"),
        (lambda x, w, t: (x, w, t, {"linear_bias": randn(30).half()}), TypeError, "linear_bias has dtype"),
        (lambda x, w, t: (x, w, t[:3], {}), ValueError, "target has shape"),
        (lambda x, w, t: (x, w, t, {"weight": randn(31)}), ValueError, "weight has shape"),
        (lambda x, w, t: (x, w, t, {"reduction": "batchmean"}), ValueError, "reduction"),
        (lambda x, w, t: (x, w, t, {"softcap": -1.0}), ValueError, "softcap"),
        (lambda x, w, t: (x.detach().int(), w, t, {}), TypeError, "input has dtype"),
    ],
)
def test_flce_bad_inputs(make, error, match):
    x, w, _ = make_inputs((4,), 8, 30, torch.float32)
    x_, w_, t_, options = make(x, w, make_target((4,), 30))
    before = (x.detach().clone(), w.detach().clone())
    with pytest.raises(error, match=match):
        fused_linear_cross_entropy(x_, w_, t_, **options)
    assert torch.equal(x.detach(), before[0]) and torch.equal(w.detach(), before[1])


def fp32_dw_budget(tokens, vocab, elem=2):
    """The fp32 dW plan's budget: logits_fraction of the whole logits' bytes, at most fp32_dw_max_bytes."""
    return min(CONFIG.logits_fraction * tokens * vocab * elem, CONFIG.fp32_dw_max_bytes)


# bf16, 8192 tokens: (hidden, vocab) -> the plan (by tokens in dW's dtype, by tokens with an fp32 dW
# accumulator, by classes). Llama-3-8B's and Gemma-2-2B's accumulators alone (4·V·H: 2.1 and 2.4 GB)
# pass 0.6 of their logits' bytes (1.26 GB) and the 1.5 GiB cap; Qwen2.5-0.5B's (0.54 GB) leaves
# room for 3 chunks of 2816 tokens under its 1.49 GB; Llama-3.2-1B's (H = 2048: 1.05 GB, and 0.53 GB
# of dW rounded from it) does not fit its 1.26 GB.
BENCHMARK_PLANS = {(4096, 128256): "tokens", (2304, 256000): "tokens", (896, 151936): "fp32_dw",
                   (2048, 128256): "classes"}


@pytest.mark.parametrize("hidden,vocab", tuple(BENCHMARK_PLANS))
def test_chunk_plan_at_benchmark_shapes(hidden, vocab):
    """Token chunks in dW's dtype when dW needs at most MAX_TOKEN_CHUNKS partial sums and one chunk of
    logits fits 1.33× the gradients (≤ 1.5 GB at H=4096); with an fp32 dW accumulator when it and a
    chunk of ≥ 1024 tokens fit 0.6 of the whole logits' bytes (≤ 1.5 GiB); else class chunks in 1.33× the
    gradients."""
    tokens, elem = 8192, 2
    plan = chunk_plan(tokens, vocab, hidden, elem)
    gradient_bytes = (tokens + vocab) * hidden * elem
    logits_budget = fp32_dw_budget(tokens, vocab, elem)
    kind = "classes" if not plan.by_tokens else "fp32_dw" if plan.fp32_dw else "tokens"
    assert kind == BENCHMARK_PLANS[hidden, vocab]
    if kind == "fp32_dw":
        assert plan.size % CONFIG.token_align == 0 and plan.size >= 1024
        last = plan.token_chunks(tokens)[-1]
        last = last[1] - last[0]
        dx_bytes, accumulator = tokens * hidden * elem, vocab * hidden * 4
        making = dx_bytes + accumulator + plan.size * vocab * elem + tokens * 8
        rounding = dx_bytes + accumulator + last * vocab * elem + tokens * 8 + vocab * hidden * elem
        peak = max(making, rounding)
        assert peak == fp32_dw_peak_bytes(tokens, vocab, hidden, elem, plan.size, dx_size=2, dw_size=2, last=last)
        assert peak <= logits_budget
        if hidden == 896:
            # even chunks of 2816 would leave 2560 tokens, 1.61 GB with dW rounded beside them
            assert (plan.size, plan.last) == (3072, 2048) and peak <= 1.494e9
        return
    # No room for the fp32 accumulator: dX, it and dW rounded from it pass the logits budget.
    assert (tokens * hidden * elem + vocab * hidden * (4 + elem)) > logits_budget
    if plan.by_tokens:
        assert -(-tokens // plan.size) <= CONFIG.max_token_chunks
        workspace = plan.size * vocab * elem
        if hidden == 2304:  # the budget gives 768 tokens; chunks of min_token_chunk fit 1.45×
            assert plan.size == CONFIG.min_token_chunk == 1024
            assert workspace > CONFIG.workspace_fraction * gradient_bytes
            assert gradient_bytes + workspace <= (1 + CONFIG.max_workspace_fraction) * gradient_bytes
            return
    else:
        # While chunks are made: dW, one chunk and the fp32 dX accumulator; dX in its own dtype is
        # made after the chunk buffer is freed.
        dx_bytes, dx32_bytes = tokens * hidden * elem, tokens * hidden * 4
        making = gradient_bytes - dx_bytes + tokens * plan.size * elem + dx32_bytes
        workspace = max(making, gradient_bytes + dx32_bytes) - gradient_bytes
    assert gradient_bytes + workspace <= 1.33 * gradient_bytes
    if hidden == 4096:
        assert gradient_bytes + workspace <= 1.45e9


@pytest.mark.parametrize("hidden,vocab", tuple(BENCHMARK_PLANS))
def test_chunk_plan_small_problems(hidden, vocab):
    """Few tokens: one chunk (dW one matmul, rounded once), never an fp32 accumulator."""
    for tokens in (1, 100, 256):
        assert chunk_plan(tokens, vocab, hidden, 2) == ChunkPlan(True, tokens)
    assert chunk_plan(100, 1000, 64, 2) == ChunkPlan(True, 100)


def test_chunk_plan_min_token_chunk():
    """By tokens in dW's 16-bit dtype, chunks of fewer than min_token_chunk tokens are raised to it where
    that fits max_workspace_fraction of the gradients (as many chunks as min_token_chunk tokens take,
    evened out), else left to the budget; fp32 dW keeps its own rule."""
    raised = kept = 0
    align = CONFIG.token_align
    for tokens in (1500, 4096, 8192, 16384):
        for hidden in (1024, 2304, 3072, 4096):
            for vocab in (128256, 256000, 262144):
                gradient_bytes = (tokens + vocab) * hidden * 2
                plan = chunk_plan(tokens, vocab, hidden, 2)
                if not plan.by_tokens or plan.fp32_dw or plan.size >= tokens:
                    continue
                budget_tokens = int(CONFIG.workspace_fraction * gradient_bytes // (vocab * 2)) // align * align
                fits_wider = CONFIG.min_token_chunk * vocab * 2 <= CONFIG.max_workspace_fraction * gradient_bytes
                chunks = len(plan.token_chunks(tokens))
                if budget_tokens < CONFIG.min_token_chunk and fits_wider:
                    raised += 1
                    assert chunks == -(-tokens // CONFIG.min_token_chunk) <= -(-tokens // budget_tokens)
                    assert plan.size <= CONFIG.min_token_chunk
                else:
                    kept += 1
                    assert chunks == -(-tokens // budget_tokens) and plan.size <= budget_tokens
                fp32_plan = chunk_plan(tokens, vocab, hidden, 2, dx_size=4, dw_size=4)
                assert fp32_plan.size >= min(tokens, CONFIG.fp32_token_chunk)
    assert raised and kept


def test_chunk_plan_fp32_dw_within_budget():
    """Wherever the fp32 dW plan is chosen (16-bit weight, more than one token chunk in its dtype),
    its peak stays within logits_fraction of the logits' bytes and fp32_dw_max_bytes, with the
    fewest chunks that allows;
    never for an fp32 weight (already summed in fp32)."""
    seen = 0
    for tokens in (1024, 4096, 8192, 16384, 65536):
        for hidden in (512, 896, 1024, 1536, 2048):
            for vocab in (32000, 151936, 262144):
                for dx_size in (2, 4):
                    plan = chunk_plan(tokens, vocab, hidden, 2, dx_size=dx_size)
                    assert not chunk_plan(tokens, vocab, hidden, 2, dx_size=4, dw_size=4).fp32_dw
                    if not plan.fp32_dw:
                        continue
                    seen += 1
                    assert plan.by_tokens and CONFIG.fp32_dw_min_token_chunk <= plan.size < tokens
                    assert plan.size % CONFIG.token_align == 0
                    budget = fp32_dw_budget(tokens, vocab)
                    chunks = plan.token_chunks(tokens)
                    assert chunks[0] == (0, plan.size) and chunks[-1][1] == tokens
                    last = chunks[-1][1] - chunks[-1][0]
                    assert 0 < last <= plan.size and all(c1 - c0 <= plan.size for c0, c1 in chunks)

                    def peak(chunk, last, dx_size=dx_size, tokens=tokens, hidden=hidden, vocab=vocab):
                        return fp32_dw_peak_bytes(tokens, vocab, hidden, 2, chunk, dx_size=dx_size, dw_size=2,
                                                  last=last)

                    assert peak(plan.size, last if plan.sum_round else None) <= budget
                    # one chunk fewer would not fit: the largest aligned chunks (and, with sum_round,
                    # last chunk) that fit, each alone, cover fewer tokens
                    align = CONFIG.token_align
                    sizes = range(align, tokens + align, align)
                    most = max(c for c in sizes if peak(c, None) <= budget)
                    if plan.sum_round:
                        most_last = max(c for c in sizes if peak(align, c) <= budget)
                        assert (len(chunks) - 2) * most + most_last < tokens
                    else:  # the cast: no last chunk fits beside dW, or only with a chunk more
                        assert (len(chunks) - 1) * most < tokens
                        if peak(align, align) <= budget:
                            most_last = max(c for c in sizes if peak(align, c) <= budget)
                            assert (len(chunks) - 1) * most + most_last < tokens
    assert seen > 5


@pytest.mark.parametrize("hidden,vocab", ((896, 151936), (2048, 128256), (2304, 256000), (4096, 128256)))
def test_chunk_plan_fp32_master_weight(hidden, vocab):
    """Mixed precision (bf16 logits, fp32 input and weight gradients, as the e2e benchmark trains):
    dW is summed in fp32, so token chunks are used past MAX_TOKEN_CHUNKS, each of FP32_TOKEN_CHUNK
    tokens at least (fewer chunks: each reads and writes the fp32 dW), and the chunk of logits stays
    within the budget or that many tokens of logits."""
    for tokens in (8192, 4096, 1500):
        plan = chunk_plan(tokens, vocab, hidden, 2, dx_size=4, dw_size=4)
        gradient_bytes = (tokens + vocab) * hidden * 4
        assert plan.by_tokens and plan.size >= min(tokens, CONFIG.fp32_token_chunk)
        budget = max(CONFIG.workspace_fraction * gradient_bytes, CONFIG.fp32_token_chunk * vocab * 2)
        assert plan.size * vocab * 2 <= budget
    # bf16 weights (the benchmark's): the budget alone, as before
    assert chunk_plan(8192, 151936, 896, 2) == chunk_plan(8192, 151936, 896, 2, dw_size=2)


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_flce_sum_round_matches_cublas_sum_and_cast(dtype, monkeypatch):
    """On the GPU the fp32 dW plan's last chunk is added and rounded by one Triton matmul (the default):
    its dW is cuBLAS's fp32 sum and cast but for the order of fp32 sums, so at most one unit in the
    last place apart where that order moves a value across a rounding boundary, and rarely; dX and
    the loss are the same computation."""
    x, w, _ = make_inputs((1000,), 256, 4104, dtype)
    target = make_target((1000,), 4104, ignored=7)
    monkeypatch.setattr(flce_module, "chunk_plan", lambda *a, **k: ChunkPlan(True, 384, fp32_dw=True, last=232,
                                                                                 sum_round=True))
    results = {}
    for sum_round_on in (True, False):
        monkeypatch.setattr(flce_module, "CONFIG", dataclasses.replace(CONFIG, sum_round=sum_round_on))
        loss = fused_linear_cross_entropy(x, w, target)
        results[sum_round_on] = (loss, *torch.autograd.grad(loss, (x, w)))
    (loss, dx, dw), (loss0, dx0, dw0) = results[True], results[False]
    assert torch.equal(loss, loss0) and torch.equal(dx, dx0)
    ulp = torch.finfo(dtype).eps * dw0.float().abs().clamp_min(torch.finfo(dtype).smallest_normal)
    assert ((dw.float() - dw0.float()).abs() <= ulp).all()
    assert (dw != dw0).float().mean() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ("mean", "none"))
def test_flce_torch_compile_fullgraph(reduction):
    x, w, b = make_inputs((4, 256), 512, 32000, torch.bfloat16, bias=True)
    target = make_target((4, 256), 32000, ignored=9)

    def f(x, w, b, t):
        loss = fused_linear_cross_entropy(x * 1.0, w, t, linear_bias=b, reduction=reduction, **ALL_OPTIONS)
        return loss.sum() if reduction == "none" else loss

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(x, w, b, target)
    grads = torch.autograd.grad(loss, (x, w, b))
    ref = f(x, w, b, target)
    ref_grads = torch.autograd.grad(ref, (x, w, b))
    assert_close(loss, ref, torch.float32, "loss")
    for name, g, rg in zip(("dx", "dw", "db"), grads, ref_grads, strict=True):
        assert_close(g, rg, torch.bfloat16, name)


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ("mean", "none"))
def test_flce_fp32_dw_torch_compile_fullgraph(reduction, monkeypatch):
    """The fp32 dW accumulator in eager mode and under torch.compile (the chunk loop one opaque op, run as
    in eager mode: the matmul adding into fp32 itself): 4 chunks of 256 tokens, against the fp64 reference."""
    monkeypatch.setattr(flce_module, "chunk_plan", lambda *a, **k: ChunkPlan(True, 256, fp32_dw=True))
    x, w, b = make_inputs((4, 256), 512, 32000, torch.bfloat16, bias=True)
    target = make_target((4, 256), 32000, ignored=9)

    def f(x, w, b, t):
        loss = fused_linear_cross_entropy(x * 1.0, w, t, linear_bias=b, reduction=reduction, softcap=30.0)
        return loss.sum() if reduction == "none" else loss

    _, ref_grads = fp64_reference(
        lambda **kw: fused_linear_cross_entropy_reference(**kw).sum(),
        {"input": x, "linear_weight": w, "linear_bias": b}, None, target=target, io_dtype=torch.bfloat16,
        reduction=reduction, softcap=30.0,
    )
    for fn in (f, torch.compile(f, fullgraph=True)):
        grads = torch.autograd.grad(fn(x, w, b, target), (x, w, b))
        assert grads[1].dtype == torch.bfloat16
        for name, g in zip(("input", "linear_weight", "linear_bias"), grads, strict=True):
            assert_close(g, ref_grads[name], torch.bfloat16, f"d{name}")


@pytest.mark.gpu
def test_flce_inductor_one_graph_for_every_length_with_eager_gradients_and_memory():
    """Inductor with dynamic shapes: one graph for 3 lengths; each length's gradients are the eager ones
    bit for bit (the chunk loop is one opaque op, run as in eager mode) and its peak memory the eager peak
    (the eager plan's chunk buffer, not one Inductor plans for the traced chunks)."""
    from torch._dynamo.utils import counters

    hidden, vocab = 1024, 65536
    w = (torch.randn(vocab, hidden, device=DEVICE) * hidden**-0.5).to(torch.bfloat16).requires_grad_()

    def f(x, w, t):
        return fused_linear_cross_entropy(x, w, t)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for tokens in (3000, 4500, 6100):
        x = (torch.randn(tokens, hidden, device=DEVICE) * 0.5).to(torch.bfloat16).requires_grad_()
        target = make_target((tokens,), vocab, ignored=50)
        results = []
        for fn in (f, compiled, f, compiled):  # the second of each pair is measured (cuBLAS, kernels warm)
            x.grad = w.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            loss = fn(x, w, target)
            loss.backward()
            torch.cuda.synchronize()
            results.append((loss.detach(), x.grad, w.grad, torch.cuda.max_memory_allocated() - start))
        (loss_e, dx_e, dw_e, peak_e), (loss_c, dx_c, dw_c, peak_c) = results[2:]
        assert_close(loss_c, loss_e, torch.float32, "loss")
        assert torch.equal(dx_c, dx_e) and torch.equal(dw_c, dw_e)
        assert peak_c <= peak_e * 1.02 + (16 << 20), f"{tokens} tokens: compiled peak {peak_c} > eager {peak_e}"
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.gpu
def test_flce_out_of_range_target_is_nan_under_compile():
    x, w, _ = make_inputs((64,), 256, 1000, torch.bfloat16)
    target = make_target((64,), 1000, ignored=0)
    target[7] = 5000
    loss = torch.compile(lambda x, w, t: fused_linear_cross_entropy(x, w, t), fullgraph=True)(x, w, target)
    assert torch.isnan(loss)


def _dw_reference_fp64(x, w, target, chunk=1024):
    """dW of the mean loss in fp64 (logits rounded to bf16 as the op's matmul does), chunk by chunk."""
    xd, wd = x.detach().double(), w.detach().double()
    valid = target != -100
    dw = torch.zeros_like(wd)
    for c0 in range(0, x.shape[0], chunk):
        logits = (xd[c0:c0 + chunk] @ wd.t()).to(torch.bfloat16).double()
        grad = torch.softmax(logits, dim=-1)
        t = target[c0:c0 + chunk]
        rows = torch.arange(t.shape[0], device=t.device)
        grad[rows, t.clamp(min=0)] -= 1.0
        grad *= valid[c0:c0 + chunk, None]
        dw += grad.t() @ xd[c0:c0 + chunk]
    return dw / valid.sum()


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,vocab", ((4096, 128256), (896, 151936), (2304, 256000)))
def test_flce_benchmark_shapes_accuracy_and_memory(hidden, vocab):
    """dW within 5e-3 of fp64 with bf16 inputs (2.5e-3, one rounding, with the fp32 accumulator),
    and peak memory within the plan's budget (at Gemma-2-2B's head the wider one of min_token_chunk)."""
    tokens = 8192
    x = (torch.randn(tokens, hidden, device=DEVICE) * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device=DEVICE) * hidden**-0.5).to(torch.bfloat16).requires_grad_()
    target = make_target((tokens,), vocab, ignored=100)
    fused_linear_cross_entropy(x, w, target).backward()  # warm-up: cuBLAS workspaces, kernel compiles
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss = fused_linear_cross_entropy(x, w, target)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    gradient_bytes = (x.numel() + w.numel()) * 2
    plan = chunk_plan(tokens, vocab, hidden, 2)
    reference = _dw_reference_fp64(x, w, target)
    err = rel_err(w.grad, reference)
    # The unfused loss in bf16 (the logits whole, one dW matmul rounded once), as eager and
    # torch.compile run it: the error the fp32 accumulator must match.
    x.grad = w.grad = None
    torch.nn.functional.cross_entropy(x @ w.t(), target, ignore_index=-100).backward()
    unfused = rel_err(w.grad, reference)
    if plan.fp32_dw:  # the plan's budget; dW rounded once, as the unfused loss's
        limit, dw_limit = fp32_dw_budget(tokens, vocab), 1.1 * unfused
    else:  # the workspace budget (+2% of the gradients for per-token state), or the wider one where the
        # plan raised the chunks to min_token_chunk tokens (Gemma-2-2B's head)
        raised = plan.size * vocab * 2 > CONFIG.workspace_fraction * gradient_bytes
        fraction = CONFIG.max_workspace_fraction if raised else CONFIG.workspace_fraction
        limit, dw_limit = (1.5e9 if hidden == 4096 else (1.02 + fraction) * gradient_bytes), 5e-3
    assert peak <= limit, f"peak {peak / 1e9:.3f} GB > {limit / 1e9:.3f} GB"
    assert err <= dw_limit, f"dW relative error {err:.2e} (unfused bf16 loss: {unfused:.2e})"


@pytest.mark.parametrize("layout", ("stride 2", "stride 0"))
def test_strided_class_weight_reads_its_strides(layout):
    """Class weights with stride 2 or 0 give what their contiguous copy gives (stride 2 gave NaN)."""
    x, w = randn(6, 16, requires_grad=True), randn(29, 16, scale=0.25)
    target = torch.randint(0, 29, (6,), device=DEVICE)
    class_weight = torch.rand(29, device=DEVICE) + 0.5
    wide = torch.zeros(58, device=DEVICE)
    weight = wide[::2].copy_(class_weight) if layout == "stride 2" else class_weight[:1].expand(29)
    got = fused_linear_cross_entropy(x, w, target, weight=weight)
    want = fused_linear_cross_entropy(x, w, target, weight=weight.contiguous())
    assert torch.equal(got, want)
    assert torch.equal(*(torch.autograd.grad(out, (x,))[0] for out in (got, want)))
