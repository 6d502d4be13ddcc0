"""tigon.ops.jsd against the fp64 generalised-JSD reference.

beta covers both special-cased ends (0: forward KL, 1: reverse KL) and the mixture between them.
Vocab sizes sit on the tiling's boundaries (elementwise_tiles.py's elementwise_tile_launch, shared with
kl_div): short rows packed several to a tile, and rows past TILE_ELEMENTS split over column tiles.
"""

import pytest
import torch

from tests.helpers import (
    DEVICE,
    DTYPES,
    LOSS_TOLERANCE,
    TOLERANCE,
    assert_close,
    fp64_reference,
    noncontiguous,
    randn,
)
from tigon._kernels.elementwise_tiles import CONFIG as TILE_CONFIG
from tigon.ops.jsd import jsd, jsd_reference

BETAS = (0.0, 0.3, 0.5, 1.0)


def log_probs(*shape, dtype=torch.float32, requires_grad=False):
    return (randn(*shape) * 2).log_softmax(-1).to(dtype).requires_grad_(requires_grad)


def make_labels(shape, ignore_index=-100):
    """Labels with roughly a third of the rows ignored (never all of them)."""
    labels = torch.randint(0, 50, shape, device=DEVICE)
    labels[torch.rand(shape, device=DEVICE) < 1 / 3] = ignore_index
    labels.view(-1)[0] = 3
    return labels


def check_jsd(s, t, *, scale=1.0, **kwargs):
    dtype = s.dtype
    loss = jsd(s, t, **kwargs)
    tensors = {"student_logprobs": s, "teacher_logprobs": t}
    ref, ref_grads = fp64_reference(lambda **kw: jsd_reference(**kw) * scale, tensors, None, **kwargs)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close(loss, ref / scale, dtype, "loss", tolerance=LOSS_TOLERANCE)
    (ds,) = torch.autograd.grad(loss * scale, (s,))
    assert ds.dtype == s.dtype
    assert_close(ds, ref_grads["student_logprobs"], dtype, "dstudent")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("with_labels", (False, True))
def test_jsd(dtype, beta, with_labels):
    s = log_probs(9, 500, dtype=dtype, requires_grad=True)
    t = log_probs(9, 500, dtype=dtype)
    labels = make_labels((9,)) if with_labels else None
    check_jsd(s, t, beta=beta, labels=labels)


@pytest.mark.parametrize(
    "shape", ((1, 7), (2, 3, 300), (1, TILE_CONFIG.tile_elements), (3, TILE_CONFIG.tile_elements + 3)), ids=str
)
@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
def test_jsd_shapes(shape, beta):
    s = log_probs(*shape, requires_grad=True)
    t = log_probs(*shape)
    check_jsd(s, t, beta=beta, labels=make_labels(shape[:-1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_jsd_noncontiguous_and_upstream_scale(dtype):
    s = noncontiguous(log_probs(6, 333, dtype=dtype, requires_grad=True))
    t = (randn(333, 6) * 2).log_softmax(0).to(dtype).t()  # row stride 1, column stride 6
    check_jsd(s, t, scale=-2.5, beta=0.4)


def test_jsd_mixed_dtypes():
    s = log_probs(5, 128, dtype=torch.bfloat16, requires_grad=True)
    t = log_probs(5, 128, dtype=torch.float32)
    check_jsd(s, t, beta=0.5)


def test_jsd_ignore_index_custom():
    s = log_probs(8, 64, requires_grad=True)
    t = log_probs(8, 64)
    labels = make_labels((8,), ignore_index=7)
    check_jsd(s, t, beta=0.5, labels=labels.to(torch.int32), ignore_index=7)


@pytest.mark.parametrize("beta", BETAS)
def test_jsd_all_rows_ignored(beta):
    s = log_probs(4, 32, requires_grad=True)
    t = log_probs(4, 32)
    loss = jsd(s, t, beta=beta, labels=torch.full((4,), -100, device=DEVICE))
    assert loss.item() == 0.0
    (ds,) = torch.autograd.grad(loss, (s,))
    assert torch.count_nonzero(ds) == 0


def test_jsd_teacher_gets_no_gradient():
    s = log_probs(4, 32, requires_grad=True)
    t = log_probs(4, 32, requires_grad=True)
    jsd(s, t).backward()
    assert s.grad is not None and t.grad is None


@pytest.mark.parametrize("beta", BETAS)
def test_jsd_masked_vocabulary(beta):
    """-inf log-probabilities (a masked vocabulary) contribute 0, with a zero gradient."""
    logits_s, logits_t = randn(3, 40), randn(3, 40)
    logits_s[:, 30:] = float("-inf")
    logits_t[:, 30:] = float("-inf")
    s = logits_s.log_softmax(-1).requires_grad_()
    t = logits_t.log_softmax(-1)
    loss = jsd(s, t, beta=beta)
    ref = jsd_reference(s[:, :30].detach().double(), t[:, :30].double(), beta=beta)
    assert_close(loss, ref, torch.float32, "loss", tolerance=LOSS_TOLERANCE)
    (ds,) = torch.autograd.grad(loss, (s,))
    assert torch.isfinite(ds).all() and torch.count_nonzero(ds[:, 30:]) == 0


def test_jsd_identical_distributions():
    s = log_probs(6, 100, requires_grad=True)
    loss = jsd(s, s.detach(), beta=0.5)
    assert abs(loss.item()) < 1e-6
    (ds,) = torch.autograd.grad(loss, (s,))
    assert ds.abs().max().item() < TOLERANCE[torch.float32]


def test_jsd_deterministic():
    s = log_probs(64, 3000, dtype=torch.bfloat16, requires_grad=True)
    t = log_probs(64, 3000, dtype=torch.bfloat16)
    first = torch.autograd.grad(jsd(s, t), (s,))[0]
    second = torch.autograd.grad(jsd(s, t), (s,))[0]
    assert torch.equal(first, second)
    assert torch.equal(jsd(s, t), jsd(s, t))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"teacher_logprobs": "t"}, TypeError, "teacher_logprobs must be a torch.Tensor"),
        ({"teacher_logprobs": randn(4, 9)}, ValueError, "teacher_logprobs has shape"),
        ({"student_logprobs": torch.arange(32, device=DEVICE).view(4, 8)}, TypeError, "student_logprobs"),
        ({"labels": torch.zeros(5, dtype=torch.int64, device=DEVICE)}, ValueError, "labels has shape"),
        ({"labels": torch.zeros(4, device=DEVICE)}, TypeError, "labels has dtype"),
        ({"beta": 1.5}, ValueError, "beta"),
        ({"beta": -0.1}, ValueError, "beta"),
        ({"beta": "0.5"}, TypeError, "beta"),
        ({"beta": True}, TypeError, "beta"),
        ({"ignore_index": "-100"}, TypeError, "ignore_index"),
        ({"ignore_index": float("inf")}, TypeError, "ignore_index"),
        ({"student_logprobs": torch.tensor(0.0, device=DEVICE)}, ValueError, "at least one dimension"),
    ],
)
def test_jsd_bad_inputs(kwargs, error, match):
    args = {"student_logprobs": log_probs(4, 8), "teacher_logprobs": log_probs(4, 8)} | kwargs
    s, t = args.pop("student_logprobs"), args.pop("teacher_logprobs")
    before = s.clone()
    with pytest.raises(error, match=match):
        jsd(s, t, **args)
    assert torch.equal(s, before)


@pytest.mark.gpu
def test_jsd_torch_compile_fullgraph():
    logits = randn(256, 4096, dtype=torch.bfloat16, requires_grad=True)
    t = log_probs(256, 4096, dtype=torch.bfloat16)
    labels = make_labels((256,))

    def f(logits, t, labels):
        return jsd(logits.float().log_softmax(-1), t, beta=0.3, labels=labels)

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(logits, t, labels)
    (dl,) = torch.autograd.grad(loss, (logits,))
    ref = f(logits, t, labels)
    (ref_dl,) = torch.autograd.grad(ref, (logits,))
    assert_close(loss, ref, torch.float32, "loss", tolerance=LOSS_TOLERANCE)
    assert_close(dl, ref_dl, torch.bfloat16, "dlogits")


@pytest.mark.gpu
@pytest.mark.bigmem
def test_jsd_int64_offsets():
    """More than 2**31 elements: the last rows' gradient is right."""
    vocab = 128256
    rows = 2**31 // vocab + 8
    s = torch.randn(rows, vocab, device=DEVICE, dtype=torch.bfloat16).log_softmax(-1).requires_grad_()
    t = torch.randn(rows, vocab, device=DEVICE, dtype=torch.bfloat16).log_softmax(-1)
    loss = jsd(s, t, beta=0.5)
    (ds,) = torch.autograd.grad(loss, (s,))
    tail = slice(rows - 4, rows)
    st = s[tail].detach().double().requires_grad_()
    ref = jsd_reference(st, t[tail].double(), beta=0.5) * (4 / rows)  # those rows' share of the mean
    (ref_ds,) = torch.autograd.grad(ref, (st,))
    assert_close(ds[tail], ref_ds, torch.bfloat16, "ds tail")
    assert torch.isfinite(loss)
