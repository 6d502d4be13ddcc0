"""tigon.ops.cross_entropy against the fp64 reference (torch's F.cross_entropy plus softcap, scale, z-loss).

Regimes (the row kernels' launch config, _kernels/cross_entropy_launch.py): a row of
V ≤ max_single_block_v classes is held in registers (read once); a longer one is streamed twice, block
by block (V = max_single_block_v + 1 has a one-element second block, V > 65536 several). Options
switch kernel branches (HAS_WEIGHT, HAS_SMOOTHING, HAS_Z_LOSS, HAS_SOFTCAP), so the fp32 test covers
their full product at a small V and the size test runs every branch at once in both regimes.
"""

import dataclasses
import importlib
import itertools

import pytest
import torch

from tests.helpers import (
    DEVICE,
    DTYPES,
    LOSS_TOLERANCE,
    ON_GPU,
    assert_close,
    fp64_reference,
    noncontiguous,
    randn,
    stride0_like,
)
from tigon._kernels import persistent_programs
from tigon._kernels import softmax_rows as _softmax_rows
from tigon._kernels import vocab_chunks as _vocab_chunks
from tigon._kernels.cross_entropy_launch import CONFIG
from tigon.ops.cross_entropy import cross_entropy, cross_entropy_reference

# The module itself (``tigon.ops.cross_entropy`` the attribute is the function): its launch config.
ce_module = importlib.import_module("tigon._kernels.cross_entropy_launch")  # the row kernels' CONFIG
MAX_SINGLE_BLOCK_V = CONFIG.max_single_block_v
MAX_SINGLE_BLOCK_V_SOFTCAP = CONFIG.max_single_block_v_softcap

TRANSFORMS = {
    "plain": {},
    "z_loss": dict(z_loss=1e-2),
    "softcap": dict(softcap=4.0),
    "scale": dict(logit_scale=0.5),
    "z_loss+softcap": dict(z_loss=1e-2, softcap=4.0),
    "z_loss+scale": dict(z_loss=1e-2, logit_scale=2.0),
    "softcap+scale": dict(softcap=4.0, logit_scale=2.0),
    "softcap+negative scale": dict(softcap=4.0, logit_scale=-1.5),  # the sign of σ folded into κ
    "all": dict(z_loss=1e-2, softcap=4.0, logit_scale=0.5),
}
ALL_OPTIONS = dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0, logit_scale=0.7)


def make_target(shape, vocab, *, ignore_index=-100, ignored=1):
    """Random classes with the first ``ignored`` positions set to ignore_index."""
    target = torch.randint(0, vocab, shape, device=DEVICE)
    target.view(-1)[:ignored] = ignore_index
    return target


def class_weight(vocab):
    return torch.rand(vocab, device=DEVICE) + 0.1


def grad_for(loss, kind="random"):
    """A grad_output for ``loss``: random, exactly one, or (reduction="none") expanded/strided."""
    if kind == "one":
        return torch.ones_like(loss)
    if kind == "stride0":
        return stride0_like(loss)
    if kind == "strided":
        return noncontiguous(randn(*loss.shape, 1)).squeeze(-1) if loss.dim() else randn(1).squeeze()
    return randn(*loss.shape) if loss.dim() else randn(1).squeeze()


def check_cross_entropy(logits, target, grad_output="random", **options):
    """Loss and dlogits against the fp64 reference; returns the loss."""
    dtype = logits.dtype
    loss = cross_entropy(logits, target, **options)
    g = grad_for(loss, grad_output)
    weight = options.pop("weight", None)
    ref, grads = fp64_reference(
        cross_entropy_reference, {"logits": logits, "weight": weight}, g, target=target, **options
    )
    assert loss.dtype == torch.float32
    assert loss.shape == ref.shape
    # Loss math is fp32 from exact inputs whatever the input dtype: the fp32 loss tolerance holds.
    assert_close(loss, ref, torch.float32, "loss", tolerance=LOSS_TOLERANCE)
    if logits.requires_grad:
        (dlogits,) = torch.autograd.grad(loss, logits, g)
        assert dlogits.dtype == dtype and dlogits.shape == logits.shape
        assert_close(dlogits, grads["logits"], dtype, "dlogits")
    return loss


def test_reference_matches_torch_weighted_smoothed_mean():
    """The reference's mean (sum / Σ w_y) is torch's own weighted, label-smoothed mean."""
    logits = randn(9, 13, dtype=torch.float64)
    target = make_target((9,), 13, ignored=2)
    w = class_weight(13).double()
    ours = cross_entropy_reference(logits, target, weight=w, label_smoothing=0.3)
    torch_mean = torch.nn.functional.cross_entropy(logits, target, weight=w, label_smoothing=0.3)
    assert torch.allclose(ours, torch_mean, rtol=1e-12, atol=0)


@pytest.mark.parametrize("ignored", (2, 9), ids=("some_ignored", "all_ignored"))
def test_reference_traces_into_one_graph(ignored):
    """The benchmark compiles the reference as torch.compile's baseline: it must trace without a graph
    break (a data-dependent branch was one, with a device-to-host sync that slowed the baseline), and
    still give 0 with a zero gradient for an all-ignored batch, z-loss included."""
    logits = randn(9, 13, requires_grad=True)
    target = make_target((9,), 13, ignored=ignored)
    fn = lambda x, t: cross_entropy_reference(x, t, z_loss=1e-3, softcap=20.0)
    explained = torch._dynamo.explain(fn)(logits, target)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    loss = fn(logits, target)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    if ignored == 9:
        assert loss.item() == 0.0 and not grad.any()


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
@pytest.mark.parametrize("smoothing", (0.0, 0.2))
@pytest.mark.parametrize("weighted", (False, True), ids=("unweighted", "weighted"))
def test_cross_entropy_options_fp32(weighted, smoothing, reduction, transform):
    vocab = 37
    logits = randn(5, vocab, scale=3.0, requires_grad=True)
    target = make_target((5,), vocab)
    check_cross_entropy(
        logits, target, weight=class_weight(vocab) if weighted else None, label_smoothing=smoothing,
        reduction=reduction, **TRANSFORMS[transform],
    )


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
@pytest.mark.parametrize("weighted,smoothing", ((False, 0.0), (True, 0.0), (False, 0.2), (True, 0.2)))
def test_cross_entropy_options_low_precision(dtype, weighted, smoothing, reduction):
    vocab = 37
    logits = randn(5, vocab, scale=3.0, dtype=dtype, requires_grad=True)
    target = make_target((5,), vocab)
    check_cross_entropy(
        logits, target, weight=class_weight(vocab) if weighted else None, label_smoothing=smoothing,
        reduction=reduction, **TRANSFORMS["all"],
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "vocab", (1, 37, MAX_SINGLE_BLOCK_V_SOFTCAP + 1, MAX_SINGLE_BLOCK_V, MAX_SINGLE_BLOCK_V + 1, 70001)
)
@pytest.mark.parametrize("options", ("plain", "all"))
def test_cross_entropy_sizes(dtype, vocab, options):
    """Both regimes at the shipped knobs, V not a power of two, V > 65536 (few rows: the interpreter
    is slow per element). "all" has a softcap, whose register limit is lower: V = softcap limit + 1
    is streamed with it and held in registers without; V = MAX_SINGLE_BLOCK_V + 1 streams both."""
    rows = 3 if vocab < 65536 else 2
    logits = randn(rows, vocab, scale=2.0, dtype=dtype, requires_grad=True)
    target = make_target((rows,), vocab, ignored=0)
    target[-1] = vocab - 1  # the last class, in the last (partial) block
    kwargs = dict(ALL_OPTIONS, weight=class_weight(vocab)) if options == "all" else {}
    check_cross_entropy(logits, target, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_one_token(dtype):
    logits = randn(1, 50, dtype=dtype, requires_grad=True)
    check_cross_entropy(logits, make_target((1,), 50, ignored=0), reduction="none")
    unbatched = randn(50, dtype=dtype, requires_grad=True)  # (V,) logits with a 0-d target
    loss = check_cross_entropy(unbatched, torch.tensor(7, device=DEVICE))
    assert loss.shape == ()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ("mean", "none"))
def test_cross_entropy_3d(dtype, reduction):
    logits = randn(2, 3, 40, dtype=dtype, requires_grad=True)
    loss = check_cross_entropy(logits, make_target((2, 3), 40, ignored=2), reduction=reduction, **ALL_OPTIONS)
    assert loss.shape == ((6,) if reduction == "none" else ())


@pytest.mark.parametrize("grad_output", ("one", "stride0", "strided"))
@pytest.mark.parametrize("reduction", ("mean", "none"))
def test_cross_entropy_grad_output_layouts(grad_output, reduction):
    logits = randn(6, 33, dtype=torch.bfloat16, requires_grad=True)
    check_cross_entropy(logits, make_target((6,), 33), grad_output, reduction=reduction)


def test_cross_entropy_sum_backward():
    """``loss.sum().backward()`` after reduction="none" hands the kernel a stride-0 grad_output."""
    logits = randn(4, 29, requires_grad=True)
    target = make_target((4,), 29)
    cross_entropy(logits, target, reduction="none", z_loss=1e-3).sum().backward()
    _, grads = fp64_reference(cross_entropy_reference, {"logits": logits}, torch.ones(4, dtype=torch.float64),
                              target=target, reduction="none", z_loss=1e-3)
    assert_close(logits.grad, grads["logits"], torch.float32, "dlogits")


@pytest.mark.parametrize("layout", ("noncontiguous", "transposed", "expanded"))
def test_cross_entropy_input_layouts(layout):
    base = randn(5, 31, requires_grad=True)
    if layout == "noncontiguous":
        logits = noncontiguous(base.detach()).requires_grad_()
    elif layout == "transposed":
        logits = base.detach().t().contiguous().t().requires_grad_()
    else:
        logits = base[:1].expand(5, 31)
    check_cross_entropy(logits, make_target((5,), 31), label_smoothing=0.1)


@pytest.mark.parametrize("ignore_index", (-1, 3))
def test_cross_entropy_ignore_index(ignore_index):
    logits = randn(6, 20, requires_grad=True)
    target = make_target((6,), 20, ignore_index=ignore_index, ignored=2)
    target[3] = 5  # an ordinary class next to the ignored ones
    check_cross_entropy(
        logits, target, ignore_index=ignore_index, label_smoothing=0.1, weight=class_weight(20)
    )


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("vocab", (64, MAX_SINGLE_BLOCK_V + 100))
def test_cross_entropy_huge_logits(dtype, vocab):
    logits = (torch.randn(3, vocab, device=DEVICE).sign() * 1e4).to(dtype)
    logits[:, : vocab // 2] = randn(3, vocab // 2, scale=1e4).to(dtype)
    logits.requires_grad_()
    loss = check_cross_entropy(logits, make_target((3,), vocab, ignored=0), reduction="none", z_loss=1e-4)
    assert torch.isfinite(loss).all()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("vocab", (64, MAX_SINGLE_BLOCK_V + 100))
def test_cross_entropy_softcap_saturated(dtype, vocab):
    """Logits far past the softcap (|σ·l/κ| from 0 to ~100): the slope σ·(1 − tanh²u) is tiny but
    not 0 until e^(−2|u|) leaves fp32's range, and the kernel must get it to relative accuracy.
    fp64 autograd cannot be the reference here: its 1 − tanh² cancels to 0 once tanh rounds to ±1
    (|u| > 19). The exact gradient is ∂loss/∂z · σ/cosh²(u), from the reference's ∂loss/∂z."""
    softcap, logit_scale = 30.0, 0.5
    logits = randn(3, vocab, scale=2e3).to(dtype).requires_grad_()
    target = make_target((3,), vocab, ignored=0)
    loss = cross_entropy(logits, target, reduction="none", softcap=softcap, logit_scale=logit_scale)
    g = randn(3)
    (dlogits,) = torch.autograd.grad(loss, logits, g)
    u = logits.detach().double() * (logit_scale / softcap)
    z = (softcap * torch.tanh(u)).requires_grad_()
    ref = cross_entropy_reference(z, target, reduction="none")
    (dz,) = torch.autograd.grad(ref, z, g.double())
    assert_close(loss, ref, torch.float32, "loss", tolerance=LOSS_TOLERANCE)
    assert_close(dlogits, dz * logit_scale / torch.cosh(u).square(), dtype, "dlogits")


@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_cross_entropy_all_ignored(reduction):
    logits = randn(4, 25, requires_grad=True)
    target = torch.full((4,), -100, device=DEVICE)
    loss = cross_entropy(logits, target, reduction=reduction, weight=class_weight(25), label_smoothing=0.1,
                         z_loss=1e-3)
    assert torch.equal(loss, torch.zeros_like(loss))
    (dlogits,) = torch.autograd.grad(loss.sum(), logits)
    assert torch.equal(dlogits, torch.zeros_like(dlogits))


def test_cross_entropy_empty():
    logits = randn(0, 10, requires_grad=True)
    target = torch.zeros(0, dtype=torch.long, device=DEVICE)
    assert cross_entropy(logits, target).item() == 0.0
    assert cross_entropy(logits, target, reduction="none").shape == (0,)


@pytest.mark.parametrize("bad", (25, -1, 10**12))
def test_cross_entropy_out_of_range_target_raises(bad):
    logits = randn(4, 25, requires_grad=True)
    before = logits.detach().clone()
    target = make_target((4,), 25)
    target[2] = bad
    with pytest.raises(ValueError, match=f"class index {bad}, outside"):
        cross_entropy(logits, target, inplace_backward=False)
    assert torch.equal(logits.detach(), before)
    assert logits.grad is None


def test_cross_entropy_inplace_backward():
    x = randn(5, 40, requires_grad=True)
    target = make_target((5,), 40)
    logits = x * 1.5
    loss = cross_entropy(logits, target, inplace_backward=True, label_smoothing=0.1)
    _, grads = fp64_reference(lambda x, **kw: cross_entropy_reference(x * 1.5, target, **kw), {"x": x},
                              torch.tensor(0.5, dtype=torch.float64), label_smoothing=0.1)
    (loss * 0.5).backward()
    assert_close(x.grad, grads["x"], torch.float32, "dx")
    with pytest.raises(ValueError, match="leaf"):
        cross_entropy(x, target, inplace_backward=True)


def test_cross_entropy_backward_twice():
    """retain_graph: each backward with another grad_output gets its own gradient, and the ones
    returned before stay as they were (a backward that keeps the graph hands out a scaled copy)."""
    logits = randn(4, 30, requires_grad=True)
    target = make_target((4,), 30)
    loss = cross_entropy(logits, target, reduction="none")
    returned = []
    for g in (randn(4), randn(4), torch.ones(4, device=DEVICE)):
        (dlogits,) = torch.autograd.grad(loss, logits, g, retain_graph=True)
        _, grads = fp64_reference(
            cross_entropy_reference, {"logits": logits}, g, target=target, reduction="none"
        )
        returned.append((dlogits, grads["logits"]))
    for dlogits, expected in returned:
        assert_close(dlogits, expected, torch.float32, "dlogits")


def test_cross_entropy_backward_twice_accumulates():
    logits = randn(5, 30, requires_grad=True)
    target = make_target((5,), 30)
    loss = cross_entropy(logits, target)
    loss.backward(retain_graph=True)
    (loss * 2.0).backward()
    _, grads = fp64_reference(cross_entropy_reference, {"logits": logits}, None, target=target)
    assert_close(logits.grad, 3.0 * grads["logits"], torch.float32, "dlogits")


def test_cross_entropy_backward_again_after_zero_or_changed_gradient():
    """A backward that keeps the graph hands out a copy: neither a grad_output of 0 (gradcheck's
    one-hot rows) nor changing what it returned affects the backwards after it."""
    logits = randn(4, 30, requires_grad=True)
    target = make_target((4,), 30)
    loss = cross_entropy(logits, target, reduction="none")
    _, grads = fp64_reference(cross_entropy_reference, {"logits": logits}, torch.ones(4, device=DEVICE),
                              target=target, reduction="none")
    one_hot = torch.zeros(4, device=DEVICE)
    one_hot[2] = 1.0
    (first,) = torch.autograd.grad(loss, logits, one_hot, retain_graph=True)
    assert not first[[0, 1, 3]].any()
    assert_close(first[2], grads["logits"][2], torch.float32, "dlogits row 2")
    first.mul_(5.0)
    (zero,) = torch.autograd.grad(loss, logits, torch.zeros(4, device=DEVICE), retain_graph=True)
    assert not zero.any()
    (last,) = torch.autograd.grad(loss, logits, torch.ones(4, device=DEVICE))
    assert_close(last, grads["logits"], torch.float32, "dlogits")
    assert not zero.any()


def test_cross_entropy_no_grad():
    logits = randn(3, 21, requires_grad=True)
    target = make_target((3,), 21)
    with torch.no_grad():
        loss = cross_entropy(logits, target)
    assert not loss.requires_grad
    assert_close(loss, cross_entropy_reference(logits.detach().double(), target), torch.float32, "loss")


def test_cross_entropy_int32_target():
    logits = randn(4, 17, requires_grad=True)
    check_cross_entropy(logits, make_target((4,), 17).to(torch.int32))


def test_cross_entropy_deterministic():
    logits = randn(16, 300, dtype=torch.bfloat16, requires_grad=True)
    target = make_target((16,), 300)
    runs = [torch.autograd.grad(cross_entropy(logits, target, z_loss=1e-3), logits)[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: (torch.ones(4, 8, dtype=torch.int32, device=DEVICE), make_target((4,), 8), {}), TypeError,
         "logits has dtype"),
        (lambda: (randn(4, 8), make_target((4,), 8).float(), {}), TypeError, "target has dtype"),
        (lambda: (randn(4, 8), make_target((5,), 8), {}), ValueError, "target has shape"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"weight": randn(7)}), ValueError, "weight has shape"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"weight": randn(8, dtype=torch.float64)}), TypeError,
         "weight has dtype"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"weight": torch.ones(8, device="meta")}), ValueError,
         "weight is on meta"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"reduction": "avg"}), ValueError, "reduction"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"label_smoothing": 1.5}), ValueError, "smoothing"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"z_loss": -1.0}), ValueError, "z_loss"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"softcap": 0.0}), ValueError, "softcap"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"logit_scale": float("inf")}), ValueError, "scale"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"ignore_index": 1.5}), TypeError, "ignore_index"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"label_smoothing": "0.1"}), TypeError, "label_smoothing"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"inplace_backward": "yes"}), TypeError, "inplace_backward"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"label_smoothing": None}), TypeError, "label_smoothing"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"z_loss": "1e-4"}), TypeError, "z_loss"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"softcap": "30"}), TypeError, "softcap"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"logit_scale": None}), TypeError, "logit_scale"),
        (lambda: (randn(4, 8), make_target((4,), 8), {"logit_scale": float("nan")}), ValueError, "logit_scale"),
        (lambda: (torch.tensor(1.0, device=DEVICE), make_target((), 8), {}), ValueError, "class dimension"),
        (lambda: ([1.0, 2.0], make_target((1,), 2), {}), TypeError, "logits must be a torch.Tensor"),
    ],
)
def test_cross_entropy_bad_inputs(make, error, match):
    logits, target, options = make()
    before = logits.clone() if isinstance(logits, torch.Tensor) else None
    with pytest.raises(error, match=match):
        cross_entropy(logits, target, **options)
    if before is not None:
        assert torch.equal(logits, before)


@pytest.mark.skipif(ON_GPU, reason="on a GPU, CPU tensors are simply the wrong device")
def test_cross_entropy_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA tensors"):
        cross_entropy(randn(2, 8), make_target((2,), 8))


# ------------------------------------------------------------------------------ kernel variants (knobs)

# Every geometry the launch config can select (dev/tune_ce.py sweeps it on the GPU), shrunk so
# that a vocabulary of 101 classes walks four blocks of 32 (the last one partial): streamed with
# one or two blocks prefetched into registers, with L2 hints and fewer programs per SM, past the
# hinted budget; and held in registers with several warps (values spread over 4 warps), with and
# without each program's next row loaded ahead.
SMALL_STREAM = dict(max_single_block_v=32, max_single_block_v_softcap=32, stream_block_v=32, stream_warps=1)
VARIANTS = {
    "single": dict(single_values_per_thread=1, single_max_warps=4, single_programs_per_sm=2, single_row_prefetch=False),
    "single_row_prefetch": dict(
        single_values_per_thread=1, single_max_warps=4, single_programs_per_sm=2, single_row_prefetch=True
    ),
    "prefetch1": dict(SMALL_STREAM, stream_prefetch=1),
    "prefetch2": dict(SMALL_STREAM, stream_prefetch=2),
    # rows in flight over the hinted budget: stream_wide_prefetch blocks ahead, no L2 hints
    "wide": dict(SMALL_STREAM, stream_hinted_max_bytes=0, stream_wide_prefetch=2),
    "hints_half_grid": dict(SMALL_STREAM, stream_prefetch=2, stream_l2_hints=True, stream_programs_per_sm=0.5),
}
VARIANT_VOCAB = 101


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    """Make one variant's config the module's default for the test (the geometry cache keys on it)."""
    monkeypatch.setattr(ce_module, "CONFIG", dataclasses.replace(CONFIG, **VARIANTS[request.param]))
    return request.param


def _variant_target(rows, vocab, **kw):
    target = make_target((rows,), vocab, **kw)
    target[-1] = vocab - 1  # in the last, partial block
    if rows > 2:
        target[-2] = 0  # in the first block (read last by the streamed pass 2)
    return target


def test_variants_select_their_geometry(variant):
    device = torch.device(DEVICE)
    cfg = ce_module.row_launch(5, VARIANT_VOCAB, device)
    assert cfg.single_block == variant.startswith("single")
    assert cfg.row_prefetch == (variant == "single_row_prefetch")
    if cfg.single_block:
        assert cfg.num_warps == 4
    else:
        assert cfg.block_v == 32 and cfg.num_warps == 1
    if variant == "hints_half_grid":
        assert cfg.first_read_policy == _softmax_rows.EVICT_LAST
        assert cfg.second_read_policy == cfg.store_policy == _softmax_rows.EVICT_FIRST
    if variant == "wide":
        assert cfg.prefetch == 2 and cfg.first_read_policy == cfg.store_policy == _softmax_rows.EVICT_NORMAL
    if variant == "prefetch1":
        assert cfg.prefetch == 1 and cfg.first_read_policy == _softmax_rows.EVICT_LAST  # hinted (shipped hints)
    # the fused linear loss's vocabulary chunks: one program a row (a few on the interpreter) in
    # blocks of the chunk config's block_v, softcap or not, never hinted ...
    chunks = _vocab_chunks.CONFIG
    for softcap in (False, True):
        chunk_cfg = _vocab_chunks.chunk_launch(5, VARIANT_VOCAB, device, softcap=softcap)
        assert not chunk_cfg.single_block and chunk_cfg.num_warps == chunks.num_warps
        assert chunk_cfg.block_v == min(128, chunks.block_v) and chunk_cfg.prefetch == chunks.prefetch
        assert chunk_cfg.programs == (5 if device.type == "cuda" else min(5, persistent_programs(device)))
        assert chunk_cfg.first_read_policy == chunk_cfg.store_policy == _softmax_rows.EVICT_NORMAL
    # ... and wider chunks the persistent grid's wide setting
    wide = _vocab_chunks.chunk_launch(5, chunks.row_max_width + 1, device)
    assert wide.prefetch == ce_module.CONFIG.stream_wide_prefetch
    assert wide.first_read_policy == _softmax_rows.EVICT_NORMAL
    # softcap rows, bound by MUFU rather than load latency, take their own prefetch, streamed or not,
    # and the L2 hints whatever their bytes in flight (not the vocabulary chunks, which never do)
    for streamed in (False, True):
        if streamed:
            softcap_cfg = _vocab_chunks.chunk_launch(5, chunks.row_max_width + 1, device, softcap=True)
        else:
            softcap_cfg = ce_module.row_launch(5, VARIANT_VOCAB, device, softcap=True)
        assert softcap_cfg.single_block or softcap_cfg.prefetch == ce_module.CONFIG.stream_softcap_prefetch
        hinted = not streamed and ce_module.CONFIG.stream_l2_hints and not softcap_cfg.single_block
        assert (softcap_cfg.first_read_policy == _softmax_rows.EVICT_LAST) == hinted


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", ("plain", "all", "softcap_running_max"))
def test_variants_dtypes(variant, dtype, options):
    """Every geometry; "all" takes the softcap's fixed shift (κ = 5 ≤ MAX_SHIFT_SOFTCAP), the last
    option a softcap too large for it (the running maximum, with logits of up to ~100)."""
    logits = randn(5, VARIANT_VOCAB, scale=3.0 if options != "softcap_running_max" else 30.0, dtype=dtype,
                   requires_grad=True)
    target = _variant_target(5, VARIANT_VOCAB)
    kwargs = {}
    if options != "plain":
        kwargs = dict(ALL_OPTIONS, weight=class_weight(VARIANT_VOCAB), reduction="none")
    if options == "softcap_running_max":
        kwargs["softcap"] = _softmax_rows.MAX_SHIFT_SOFTCAP + 20.0
    check_cross_entropy(logits, target, **kwargs)


@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_variants_reductions(variant, reduction):
    """Weights, smoothing, z-loss, softcap and scale at once; ignore_index other than -100; a
    random grad_output (≠ 1, per row for none)."""
    logits = randn(6, VARIANT_VOCAB, scale=3.0, requires_grad=True)
    target = _variant_target(6, VARIANT_VOCAB, ignore_index=7, ignored=2)
    check_cross_entropy(
        logits, target, ignore_index=7, weight=class_weight(VARIANT_VOCAB), reduction=reduction,
        label_smoothing=0.2, z_loss=1e-2, softcap=6.0, logit_scale=1.3,
    )


@pytest.mark.parametrize("vocab", (VARIANT_VOCAB, 33))
def test_variants_one_row(variant, vocab):
    """One token; V = 33 is one full block and a one-class block when streamed."""
    logits = randn(1, vocab, dtype=torch.bfloat16, requires_grad=True)
    check_cross_entropy(logits, _variant_target(1, vocab, ignored=0), reduction="sum", z_loss=1e-3)


def test_variants_inplace(variant):
    x = randn(5, VARIANT_VOCAB, dtype=torch.bfloat16, requires_grad=True)
    target = _variant_target(5, VARIANT_VOCAB)
    options = dict(label_smoothing=0.1, softcap=8.0, weight=class_weight(VARIANT_VOCAB))
    loss = cross_entropy(x * 1.5, target, inplace_backward=True, **options)
    _, grads = fp64_reference(lambda x, **kw: cross_entropy_reference(x * 1.5, target, **kw), {"x": x},
                              torch.tensor(0.5, dtype=torch.float64), **options)
    (loss * 0.5).backward()
    assert_close(x.grad, grads["x"], torch.bfloat16, "dx")


def test_variants_deterministic(variant):
    logits = randn(5, VARIANT_VOCAB, dtype=torch.bfloat16, requires_grad=True)
    target = _variant_target(5, VARIANT_VOCAB)
    runs = []
    for _ in range(2):
        loss = cross_entropy(logits, target, z_loss=1e-3, label_smoothing=0.1)
        runs.append((loss, torch.autograd.grad(loss, logits)[0]))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_variants_all_ignored(variant):
    logits = randn(3, VARIANT_VOCAB, requires_grad=True)
    target = torch.full((3,), -100, device=DEVICE)
    loss = cross_entropy(logits, target, z_loss=1e-3)
    (dlogits,) = torch.autograd.grad(loss, logits)
    assert loss.item() == 0.0 and torch.equal(dlogits, torch.zeros_like(dlogits))


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_cross_entropy_cpu_tensor_on_gpu_machine_rejected():
    with pytest.raises(ValueError, match="CUDA tensors"):
        cross_entropy(torch.randn(2, 8), torch.zeros(2, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_cross_entropy_torch_compile_fullgraph(reduction):
    logits = randn(64, 32000, dtype=torch.bfloat16, requires_grad=True)
    target = make_target((64,), 32000, ignored=5)
    w = class_weight(32000)

    def f(logits, target):
        loss = cross_entropy(logits * 1.0, target, weight=w, reduction=reduction, **ALL_OPTIONS)
        return loss.sum() * 0.5 if reduction == "none" else loss * 0.5

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(logits, target)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_loss = f(logits, target)
    (ref_grad,) = torch.autograd.grad(ref_loss, logits)
    assert_close(loss, ref_loss, torch.float32, "loss")
    assert_close(grad, ref_grad, torch.bfloat16, "dlogits")


@pytest.mark.gpu
def test_cross_entropy_out_of_range_target_is_nan_under_compile():
    logits = randn(8, 1000, dtype=torch.bfloat16, requires_grad=True)
    target = make_target((8,), 1000, ignored=0)
    target[3] = 1000
    target[5] = -7
    compiled = torch.compile(lambda x, t: cross_entropy(x, t, reduction="none"), fullgraph=True)
    loss = compiled(logits, target)
    torch.cuda.synchronize()
    assert torch.isnan(loss[3]) and torch.isnan(loss[5])
    assert torch.isfinite(loss[[0, 1, 2, 4, 6, 7]]).all()
    mean = torch.compile(lambda x, t: cross_entropy(x, t), fullgraph=True)(logits, target)
    assert torch.isnan(mean)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab,softcap", ((32000, None), (128256, None), (151936, None), (256000, 30.0)))
def test_cross_entropy_benchmark_vocabularies(vocab, softcap):
    logits = randn(64, vocab, scale=3.0, dtype=torch.bfloat16, requires_grad=True)
    check_cross_entropy(logits, make_target((64,), vocab, ignored=3), softcap=softcap, label_smoothing=0.05)


@pytest.mark.gpu
@pytest.mark.bigmem
def test_cross_entropy_int64_offsets():
    """More than 2**31 logits: row offsets are 64-bit, so the last rows are right."""
    vocab = 256000
    rows = 2**31 // vocab + 16
    logits = torch.randn(rows, vocab, device=DEVICE, dtype=torch.bfloat16).requires_grad_()
    target = make_target((rows,), vocab, ignored=0)
    loss = cross_entropy(logits, target, reduction="none")
    (dlogits,) = torch.autograd.grad(loss.sum(), logits)
    tail = slice(rows - 8, rows)
    x_tail = logits[tail].detach().double().requires_grad_()
    ref = cross_entropy_reference(x_tail, target[tail], reduction="none")
    (ref_grad,) = torch.autograd.grad(ref.sum(), x_tail)
    assert_close(loss[tail], ref, torch.float32, "loss tail", tolerance=LOSS_TOLERANCE)
    assert_close(dlogits[tail], ref_grad, torch.bfloat16, "dlogits tail")


@pytest.mark.gpu
def test_cross_entropy_memory():
    """Extra memory in logits' worth: the gradient buffer (none in place) and the upstream gradient."""
    logits_src = randn(1024, 32000, dtype=torch.bfloat16, requires_grad=True)
    target = make_target((1024,), 32000)
    extra = {}
    for inplace in (False, True):
        logits = logits_src * 1.0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        cross_entropy(logits, target, inplace_backward=inplace).backward()
        extra[inplace] = (torch.cuda.max_memory_allocated() - start) / logits.numel() / logits.element_size()
        logits_src.grad = None
        del logits
    assert extra[False] <= 2.05, extra
    assert extra[True] <= 1.05, extra


def _all_option_sets():
    """Every combination of the boolean-ish options, for the interpreter-free GPU sweep."""
    yield from itertools.product((False, True), (0.0, 0.1), ("mean", "sum", "none"), TRANSFORMS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_all_options_streaming(dtype):
    vocab = 3 * MAX_SINGLE_BLOCK_V + 5
    for weighted, smoothing, reduction, transform in _all_option_sets():
        logits = randn(16, vocab, scale=3.0, dtype=dtype, requires_grad=True)
        check_cross_entropy(
            logits, make_target((16,), vocab), weight=class_weight(vocab) if weighted else None,
            label_smoothing=smoothing, reduction=reduction, **TRANSFORMS[transform],
        )


# Full-size geometries the tuner can pick, for the GPU (the interpreter ignores pipelining and hints).
GPU_VARIANTS = {
    "shipped": {},
    "single16warps": dict(single_max_warps=16, single_programs_per_sm=1),
    "single_row_prefetch": dict(single_row_prefetch=not CONFIG.single_row_prefetch),
    "stream8192_prefetch1": dict(stream_block_v=8192, stream_warps=16, stream_prefetch=1),
    "stream8192_prefetch2_2per_sm": dict(stream_block_v=8192, stream_warps=16, stream_prefetch=2,
                                         stream_programs_per_sm=2.0),
    "stream_prefetch2_no_hints": dict(stream_prefetch=2, stream_l2_hints=False),
    "hints_half_grid": dict(stream_l2_hints=True, stream_programs_per_sm=0.5),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_VARIANTS)
def test_cross_entropy_gpu_variants(name, monkeypatch):
    monkeypatch.setattr(ce_module, "CONFIG", dataclasses.replace(CONFIG, **GPU_VARIANTS[name]))
    for vocab, softcap in ((32000, None), (128256, None), (256000, 30.0)):
        logits = randn(48, vocab, scale=3.0, dtype=torch.bfloat16, requires_grad=True)
        target = make_target((48,), vocab, ignored=3)
        check_cross_entropy(logits, target, softcap=softcap, label_smoothing=0.05, weight=class_weight(vocab),
                            z_loss=1e-4, reduction="none")
        x = randn(48, vocab, dtype=torch.bfloat16, requires_grad=True)
        loss = cross_entropy(x * 1.0, target, softcap=softcap, inplace_backward=True)
        (dx,) = torch.autograd.grad(loss, x)
        _, grads = fp64_reference(cross_entropy_reference, {"logits": x}, None, target=target, softcap=softcap)
        assert_close(dx, grads["logits"], torch.bfloat16, "dlogits in place")


@pytest.mark.parametrize("layout", ("stride 2", "stride 0"))
def test_strided_class_weight_reads_its_strides(layout):
    """Class weights with stride 2 or 0 give what their contiguous copy gives."""
    logits, target = randn(6, 11, requires_grad=True), make_target((6,), 11)
    w = torch.rand(11, device=DEVICE) + 0.5
    weight = noncontiguous(w) if layout == "stride 2" else w[:1].expand(11)
    for options in ({"reduction": "mean"}, {"reduction": "none", "label_smoothing": 0.1}):
        got = cross_entropy(logits, target, weight=weight, **options)
        want = cross_entropy(logits, target, weight=weight.contiguous(), **options)
        assert torch.equal(got, want)
        assert torch.equal(*(torch.autograd.grad(out.sum(), (logits,))[0] for out in (got, want)))
