"""tigon.ops.tvd against the fp64 total-variation reference.

Vocab sizes sit on the tiling's boundaries (kl_div.py's tile_launch, shared): short rows packed
several to a tile, and rows past TILE_ELEMENTS split over column tiles. The gradient is checked
against the derivative written out by hand (½·sign(P_s − P_t)·P_s) as well as against autograd.
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
)
from tigon._kernels.elementwise_tiles import CONFIG as TILE_CONFIG
from tigon.ops import tvd as tvd_exported
from tigon.ops.tvd import tvd, tvd_reference

TILE_ELEMENTS = TILE_CONFIG.tile_elements


def log_probs(*shape, dtype=torch.float32, requires_grad=False):
    return (randn(*shape) * 2).log_softmax(-1).to(dtype).requires_grad_(requires_grad)


def make_labels(shape, ignore_index=-100):
    """Labels with roughly a third of the rows ignored (never all of them)."""
    labels = torch.randint(0, 50, shape, device=DEVICE)
    labels[torch.rand(shape, device=DEVICE) < 1 / 3] = ignore_index
    labels.view(-1)[0] = 3
    return labels


def formula(s, t, labels=None, ignore_index=-100):
    """½ Σ|e^s − e^t| per row, mean over (kept) rows, and its hand-written student gradient; fp64."""
    s, t = s.detach().double(), t.detach().double()
    rows = 0.5 * (s.exp() - t.exp()).abs().sum(-1)
    keep = torch.ones_like(rows, dtype=torch.bool) if labels is None else labels != ignore_index
    count = keep.sum().clamp(min=1)
    loss = torch.where(keep, rows, 0.0).sum() / count
    grad = 0.5 * torch.sign(s.exp() - t.exp()) * s.exp() * keep.unsqueeze(-1) / count
    return loss, grad


def check_tvd(s, t, *, scale=1.0, **kwargs):
    dtype = s.dtype
    loss = tvd(s, t, **kwargs)
    tensors = {"student_logprobs": s, "teacher_logprobs": t}
    ref, ref_grads = fp64_reference(lambda **kw: tvd_reference(**kw) * scale, tensors, None, **kwargs)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close(loss, ref / scale, dtype, "loss", tolerance=LOSS_TOLERANCE)
    (ds,) = torch.autograd.grad(loss * scale, (s,))
    assert ds.dtype == s.dtype
    assert_close(ds, ref_grads["student_logprobs"], dtype, "dstudent")
    hand_loss, hand_grad = formula(s, t, kwargs.get("labels"), kwargs.get("ignore_index", -100))
    assert_close(loss, hand_loss, dtype, "loss (formula)", tolerance=LOSS_TOLERANCE)
    assert_close(ds, (hand_grad * scale).reshape(ds.shape), dtype, "dstudent (formula)")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_labels", (False, True))
def test_tvd(dtype, with_labels):
    s = log_probs(9, 500, dtype=dtype, requires_grad=True)
    t = log_probs(9, 500, dtype=dtype)
    labels = make_labels((9,)) if with_labels else None
    check_tvd(s, t, labels=labels)


@pytest.mark.parametrize("shape", ((1, 7), (2, 3, 300), (1, TILE_ELEMENTS), (3, TILE_ELEMENTS + 3)), ids=str)
def test_tvd_shapes(shape):
    s = log_probs(*shape, requires_grad=True)
    t = log_probs(*shape)
    check_tvd(s, t, labels=make_labels(shape[:-1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tvd_noncontiguous_and_upstream_scale(dtype):
    s = noncontiguous(log_probs(6, 333, dtype=dtype, requires_grad=True))
    t = (randn(333, 6) * 2).log_softmax(0).to(dtype).t()  # row stride 1, column stride 6
    check_tvd(s, t, scale=-2.5)


def test_tvd_stride0_grad_output():
    """The upstream gradient of ``loss.expand(4).sum()`` reaches the op as a stride-0 tensor."""
    s = log_probs(5, 77, requires_grad=True)
    t = log_probs(5, 77)
    (ds,) = torch.autograd.grad(tvd(s, t).expand(4).sum(), (s,))
    _, hand_grad = formula(s, t)
    assert_close(ds, 4 * hand_grad, torch.float32, "dstudent")


def test_tvd_mixed_dtypes_and_custom_ignore_index():
    s = log_probs(8, 64, dtype=torch.bfloat16, requires_grad=True)
    t = log_probs(8, 64, dtype=torch.float32)
    labels = make_labels((8,), ignore_index=7).to(torch.int32)
    check_tvd(s, t, labels=labels, ignore_index=7)


def test_tvd_all_rows_ignored_and_teacher_no_grad():
    s = log_probs(4, 32, requires_grad=True)
    t = log_probs(4, 32, requires_grad=True)
    loss = tvd(s, t, labels=torch.full((4,), -100, device=DEVICE))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(s.grad) == 0 and t.grad is None


def test_tvd_masked_vocabulary_and_identical():
    logits_s, logits_t = randn(3, 40), randn(3, 40)
    logits_s[:, 30:] = float("-inf")
    logits_t[:, 30:] = float("-inf")
    s = logits_s.log_softmax(-1).requires_grad_()
    t = logits_t.log_softmax(-1)
    loss = tvd(s, t)
    ref = tvd_reference(s[:, :30].detach().double(), t[:, :30].double())
    assert_close(loss, ref, torch.float32, "loss", tolerance=LOSS_TOLERANCE)
    (ds,) = torch.autograd.grad(loss, (s,))
    assert torch.isfinite(ds).all() and torch.count_nonzero(ds[:, 30:]) == 0
    same = tvd(s, s.detach())
    assert same.item() == 0.0
    assert torch.count_nonzero(torch.autograd.grad(same, (s,))[0]) == 0  # sign(0) = 0


def test_tvd_is_exported_and_deterministic():
    assert tvd_exported is tvd
    s = log_probs(64, 3000, dtype=torch.bfloat16, requires_grad=True)
    t = log_probs(64, 3000, dtype=torch.bfloat16)
    assert torch.equal(torch.autograd.grad(tvd(s, t), (s,))[0], torch.autograd.grad(tvd(s, t), (s,))[0])


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"teacher_logprobs": "t"}, TypeError, "teacher_logprobs must be a torch.Tensor"),
        ({"teacher_logprobs": randn(4, 9)}, ValueError, "teacher_logprobs has shape"),
        ({"student_logprobs": torch.arange(32, device=DEVICE).view(4, 8)}, TypeError, "student_logprobs"),
        ({"labels": torch.zeros(5, dtype=torch.int64, device=DEVICE)}, ValueError, "labels has shape"),
        ({"labels": torch.zeros(4, device=DEVICE)}, TypeError, "labels has dtype"),
        ({"ignore_index": None}, TypeError, "ignore_index"),
        ({"ignore_index": float("nan")}, TypeError, "ignore_index"),
        ({"student_logprobs": torch.tensor(0.0, device=DEVICE)}, ValueError, "at least one dimension"),
    ],
)
def test_tvd_bad_inputs(kwargs, error, match):
    args = {"student_logprobs": log_probs(4, 8), "teacher_logprobs": log_probs(4, 8)} | kwargs
    s, t = args.pop("student_logprobs"), args.pop("teacher_logprobs")
    with pytest.raises(error, match=match):
        tvd(s, t, **args)


@pytest.mark.gpu
def test_tvd_torch_compile_fullgraph():
    logits = randn(256, 4096, dtype=torch.bfloat16, requires_grad=True)
    t = log_probs(256, 4096, dtype=torch.bfloat16)
    labels = make_labels((256,))

    def f(logits, t, labels):
        return tvd(logits.float().log_softmax(-1), t, labels=labels)

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(logits, t, labels)
    (dl,) = torch.autograd.grad(loss, (logits,))
    ref = f(logits, t, labels)
    (ref_dl,) = torch.autograd.grad(ref, (logits,))
    assert_close(loss, ref, torch.float32, "loss", tolerance=LOSS_TOLERANCE)
    assert_close(dl, ref_dl, torch.bfloat16, "dlogits")


@pytest.mark.gpu
@pytest.mark.bigmem
def test_tvd_int64_offsets():
    """More than 2**31 elements: the last rows' gradient is right."""
    vocab = 128256
    rows = 2**31 // vocab + 8
    s = torch.randn(rows, vocab, device=DEVICE, dtype=torch.bfloat16).log_softmax(-1).requires_grad_()
    t = torch.randn(rows, vocab, device=DEVICE, dtype=torch.bfloat16).log_softmax(-1)
    loss = tvd(s, t)
    (ds,) = torch.autograd.grad(loss, (s,))
    tail = slice(rows - 4, rows)
    _, hand_grad = formula(s[tail], t[tail])
    assert_close(ds[tail], hand_grad * (4 / rows), torch.bfloat16, "ds tail")
    assert torch.isfinite(loss)
