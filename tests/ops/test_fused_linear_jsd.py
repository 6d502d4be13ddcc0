"""tigon.ops.fused_linear_jsd against the fp64 full-logits reference.

The reference rounds the logits to the io dtype as the matmul in that dtype does (and its backward
rounds their gradient the same way), then runs log_softmax and the JSD in fp64. Chunking is forced
by shrinking logits_chunk_elements, so the ∂W accumulation over chunks (and an uneven split) is
exercised at test sizes; vocab sizes cover one BLOCK_V chunk per row and several.
"""

import dataclasses
import importlib

import pytest
import torch

from tests.helpers import DEVICE, DTYPES, LOSS_TOLERANCE, assert_close, fp64_reference, randn
from tigon.ops.fused_linear_jsd import CONFIG, fused_linear_jsd, fused_linear_jsd_reference

BLOCK_V = CONFIG.block_v

# the module itself: tigon.ops re-exports the function under the module's name
fljsd_module = importlib.import_module("tigon.ops.fused_linear_jsd")


def make_inputs(rows, h_student, h_teacher, vocab, dtype, *, lead=None):
    lead = lead or (rows,)
    return {
        "student_input": randn(*lead, h_student, dtype=dtype, requires_grad=True),
        "student_weight": randn(vocab, h_student, dtype=dtype, scale=h_student**-0.5 * 2, requires_grad=True),
        "teacher_input": randn(*lead, h_teacher, dtype=dtype),
        "teacher_weight": randn(vocab, h_teacher, dtype=dtype, scale=h_teacher**-0.5 * 2),
    }


def make_labels(shape, ignore_index=-100):
    labels = torch.randint(0, 50, shape, device=DEVICE)
    labels[torch.rand(shape, device=DEVICE) < 1 / 3] = ignore_index
    labels.view(-1)[0] = 3
    return labels


def check_fljsd(tensors, *, scale=1.0, **kwargs):
    dtype = tensors["student_input"].dtype
    loss = fused_linear_jsd(**tensors, **kwargs)
    ref, ref_grads = fp64_reference(
        lambda **kw: fused_linear_jsd_reference(**kw, io_dtype=dtype) * scale, tensors, None, **kwargs
    )
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close(loss, ref / scale, dtype, "loss", tolerance=LOSS_TOLERANCE)
    names = [n for n, t in tensors.items() if t.requires_grad and n.startswith("student")]
    grads = torch.autograd.grad(loss * scale, [tensors[n] for n in names])
    for name, grad in zip(names, grads, strict=True):
        assert grad.dtype == tensors[name].dtype
        assert_close(grad, ref_grads[name], dtype, f"d{name}")


@pytest.fixture
def small_chunks(monkeypatch):
    """About 3 rows per chunk at vocab 300: a 7-row batch runs as 3 chunks (3, 2, 2 rows)."""
    monkeypatch.setattr(fljsd_module, "CONFIG", dataclasses.replace(CONFIG, logits_chunk_elements=1000))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
@pytest.mark.parametrize("with_labels", (False, True))
def test_fused_linear_jsd(dtype, beta, with_labels):
    tensors = make_inputs(7, 32, 48, 300, dtype)
    labels = make_labels((7,)) if with_labels else None
    check_fljsd(tensors, beta=beta, labels=labels, temperature=2.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("beta", (0.0, 0.3, 1.0))
def test_fused_linear_jsd_chunked(dtype, beta, small_chunks):
    assert fljsd_module.chunk_rows(7, 300) == 3
    tensors = make_inputs(7, 32, 16, 300, dtype)
    check_fljsd(tensors, beta=beta, labels=make_labels((7,)))


@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
def test_fused_linear_jsd_vocab_past_one_block(beta):
    """Each row streamed in several BLOCK_V chunks, with a partial last one."""
    tensors = make_inputs(3, 16, 16, 2 * BLOCK_V + 77, torch.float32)
    check_fljsd(tensors, beta=beta, temperature=0.7)


def test_fused_linear_jsd_3d_inputs_and_upstream_scale(small_chunks):
    tensors = make_inputs(0, 24, 40, 300, torch.bfloat16, lead=(2, 5))
    check_fljsd(tensors, scale=-1.5, beta=0.5, labels=make_labels((2, 5)))


def test_fused_linear_jsd_backward_repeated_upstream_factors(small_chunks):
    """retain_graph with upstream factors 1, −2, 0.5: each backward hands out a copy scaled on the GPU
    (no host read of the factor), and the ones returned before keep their own factor."""
    tensors = make_inputs(7, 12, 20, 300, torch.float32)
    loss = fused_linear_jsd(**tensors, beta=0.5)
    _, ref_grads = fp64_reference(lambda **kw: fused_linear_jsd_reference(**kw, beta=0.5), tensors, None)
    student = [tensors["student_input"], tensors["student_weight"]]
    returned = []
    for factor in (1.0, -2.0, 0.5):
        grads = torch.autograd.grad(loss, student, torch.tensor(factor, device=DEVICE), retain_graph=True)
        returned.append((factor, grads))
    for factor, grads in returned:  # each kept its own factor: later backwards made new tensors
        for name, grad in zip(("student_input", "student_weight"), grads, strict=True):
            assert_close(grad, ref_grads[name] * factor, torch.float32, f"d{name} x {factor}")


def test_fused_linear_jsd_frozen_weight_or_input():
    """Only the gradients that are asked for are computed (a frozen lm_head is common)."""
    tensors = make_inputs(5, 16, 16, 200, torch.float32)
    tensors["student_weight"].requires_grad_(False)
    check_fljsd(tensors, beta=0.5)
    tensors["student_weight"].requires_grad_(True)
    tensors["student_input"].requires_grad_(False)
    check_fljsd(tensors, beta=0.5)


def test_fused_linear_jsd_teacher_gets_no_gradient():
    tensors = make_inputs(4, 16, 16, 100, torch.float32)
    tensors["teacher_input"].requires_grad_(True)
    tensors["teacher_weight"].requires_grad_(True)
    fused_linear_jsd(**tensors).backward()
    assert tensors["student_input"].grad is not None and tensors["student_weight"].grad is not None
    assert tensors["teacher_input"].grad is None and tensors["teacher_weight"].grad is None


def test_fused_linear_jsd_all_rows_ignored():
    tensors = make_inputs(4, 16, 16, 100, torch.float32)
    loss = fused_linear_jsd(**tensors, labels=torch.full((4,), -100, device=DEVICE))
    assert loss.item() == 0.0
    for grad in torch.autograd.grad(loss, (tensors["student_input"], tensors["student_weight"])):
        assert torch.count_nonzero(grad) == 0


def test_fused_linear_jsd_custom_ignore_index():
    tensors = make_inputs(6, 16, 16, 100, torch.float32)
    check_fljsd(tensors, labels=make_labels((6,), ignore_index=0).to(torch.int32), ignore_index=0)


def test_fused_linear_jsd_autocast():
    """fp32 inputs and weights under autocast: matmuls in the autocast dtype, as F.linear's."""
    tensors = make_inputs(5, 32, 32, 300, torch.float32)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        loss = fused_linear_jsd(**tensors, beta=0.5)
    assert loss.dtype == torch.float32
    grads = torch.autograd.grad(loss, (tensors["student_input"], tensors["student_weight"]))
    assert all(g.dtype == torch.float32 for g in grads)
    ref = fused_linear_jsd_reference(
        *(t.detach().double() for t in tensors.values()), beta=0.5, io_dtype=torch.bfloat16
    )
    assert_close(loss, ref, torch.bfloat16, "loss", tolerance=LOSS_TOLERANCE)


def test_fused_linear_jsd_deterministic(small_chunks):
    tensors = make_inputs(7, 32, 32, 300, torch.bfloat16)
    targets = (tensors["student_input"], tensors["student_weight"])
    first = torch.autograd.grad(fused_linear_jsd(**tensors), targets)
    second = torch.autograd.grad(fused_linear_jsd(**tensors), targets)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"student_weight": randn(300, 31)}, ValueError, "student_weight has shape"),
        ({"teacher_weight": randn(299, 48)}, ValueError, "teacher_weight has vocab size"),
        ({"teacher_input": randn(6, 48)}, ValueError, "teacher_input has leading shape"),
        ({"student_weight": randn(300, 32, dtype=torch.bfloat16)}, TypeError, "student_weight has dtype"),
        ({"teacher_input": torch.ones(7, 48, device=DEVICE).long()}, TypeError, "teacher_input has dtype"),
        ({"student_weight": torch.ones(300, 32, device="meta")}, ValueError, "student_weight is on meta"),
        ({"labels": torch.zeros(6, dtype=torch.int64, device=DEVICE)}, ValueError, "labels has shape"),
        ({"beta": 2.0}, ValueError, "beta"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"temperature": "1.0"}, TypeError, "temperature"),
        ({"temperature": float("inf")}, ValueError, "temperature"),
        ({"beta": None}, TypeError, "beta"),
        ({"ignore_index": -100.0}, TypeError, "ignore_index"),
    ],
)
def test_fused_linear_jsd_bad_inputs(change, error, match):
    args = make_inputs(7, 32, 48, 300, torch.float32) | change
    before = {k: v.detach().clone() for k, v in args.items() if isinstance(v, torch.Tensor) and not v.is_meta}
    with pytest.raises(error, match=match):
        fused_linear_jsd(**args)
    for k, v in before.items():
        assert torch.equal(args[k], v)


@pytest.mark.gpu
def test_fused_linear_jsd_torch_compile_fullgraph():
    tensors = make_inputs(512, 256, 384, 32000, torch.bfloat16)
    labels = make_labels((512,))

    def f(student_input, student_weight, teacher_input, teacher_weight):
        return fused_linear_jsd(
            student_input, student_weight, teacher_input, teacher_weight,
            labels=labels, beta=0.3, temperature=2.0,
        )

    targets = (tensors["student_input"], tensors["student_weight"])
    loss = torch.compile(f, fullgraph=True)(**tensors)
    grads = torch.autograd.grad(loss, targets)
    ref = f(**tensors)
    ref_grads = torch.autograd.grad(ref, targets)
    assert_close(loss, ref, torch.float32, "loss", tolerance=LOSS_TOLERANCE)
    for g, rg in zip(grads, ref_grads, strict=True):
        assert_close(g, rg, torch.bfloat16, "grad")


@pytest.mark.gpu
@pytest.mark.parametrize("beta", (0.0, 0.5))
def test_fused_linear_jsd_llama_vocab(beta):
    """A real vocabulary (128256, 31 BLOCK_V chunks a row) over several token chunks."""
    tensors = make_inputs(1100, 512, 768, 128256, torch.bfloat16)
    check_fljsd(tensors, beta=beta, labels=make_labels((1100,)))
