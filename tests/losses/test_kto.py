"""KTO against the float64 reference written from API.md: mixed desirable and undesirable rows,
each reference variant, kl as a number and as a tensor, weights, summed and averaged log-probs."""

import pytest
import torch

from tests.helpers import DEVICE, randn
from tests.losses.common import check_loss, make_batch, reference_model
from tigon.losses import kto_loss, reference

ROWS, TOKENS, HIDDEN, VOCAB = 7, 8, 24, 37  # odd R: KTO's rows are unpaired


def labels(rows=ROWS):
    return torch.tensor([i % 3 != 1 for i in range(rows)], device=DEVICE)  # mixed, more desirable


def with_reference(batch, variant):
    if variant == "model":
        return batch | reference_model(batch)
    if variant == "ref_logps":
        return batch | {"ref_logps": randn(ROWS, scale=3.0) - 10.0}
    return batch


@pytest.mark.parametrize("dtype,variant", [(torch.float32, "model"), (torch.float32, "ref_logps"),
                                           (torch.float32, "none"), (torch.bfloat16, "model")], ids=str)
def test_kto(dtype, variant):
    tensors = with_reference(make_batch(ROWS, TOKENS, HIDDEN, VOCAB, dtype=dtype), variant)
    tensors["preference_labels"] = labels()
    check_loss(kto_loss, reference.kto, tensors, dtype=dtype, beta=0.05, kl=0.4, desirable_weight=1.3,
               undesirable_weight=0.7)


@pytest.mark.parametrize("kl", (0.0, "tensor"))
def test_kto_options(kl):
    tensors = make_batch(ROWS, TOKENS, HIDDEN, VOCAB) | reference_model(make_batch(ROWS, TOKENS, HIDDEN, VOCAB))
    tensors["preference_labels"] = labels().to(torch.int64)  # 0/1 ints are accepted as labels
    kl = torch.tensor(0.25, device=DEVICE) if kl == "tensor" else kl
    check_loss(kto_loss, reference.kto, tensors, dtype=torch.float32, kl=kl, average_log_prob=True,
               temperature=0.8, softcap=4.0)


def test_kto_defaults_all_desirable_and_all_undesirable():
    batch = make_batch(4, 6, 16, 29, bias=False)
    for value in (True, False):
        tensors = batch | {"preference_labels": torch.full((4,), value, device=DEVICE)}
        check_loss(kto_loss, reference.kto, tensors, dtype=torch.float32)


@pytest.mark.parametrize(
    "options,error,match",
    [
        ({"preference_labels": torch.ones(6, dtype=torch.bool)}, ValueError, "preference_labels has shape"),
        ({"preference_labels": torch.ones(7)}, ValueError, "preference_labels has dtype"),
        ({"preference_labels": torch.full((7,), 0.5)}, ValueError, "preference_labels has dtype"),
        ({"preference_labels": torch.tensor([1, 0, 2, 1, 0, 1, 1])}, ValueError, "preference_labels holds 2"),
        ({"preference_labels": torch.tensor([1, 0, -1, 1, 0, 1, 1], dtype=torch.int8)}, ValueError,
         "preference_labels holds -1"),
        ({"preference_labels": torch.ones(7, 1, dtype=torch.bool)}, ValueError, "preference_labels has shape"),
        ({"preference_labels": torch.ones(8, dtype=torch.int64)}, ValueError, "preference_labels has shape"),
        ({"beta": "0.1"}, TypeError, "beta"),
        ({"kl": None}, TypeError, "kl"),
        ({"preference_labels": [True] * 7}, TypeError, "preference_labels"),
        ({"ref_input": torch.zeros(7, 8, 24)}, ValueError, "ref_linear_weight"),
        ({"ref_logps": torch.zeros(7, 8)}, ValueError, "ref_logps has shape"),
        ({"kl": torch.zeros(3)}, ValueError, "kl"),
        ({"desirable_weight": -1.0}, ValueError, "desirable_weight"),
    ],
)
def test_kto_bad_inputs(options, error, match):
    batch = make_batch(ROWS, TOKENS, HIDDEN, VOCAB) | {"preference_labels": labels()}
    options = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    with pytest.raises(error, match=match):
        kto_loss(**(batch | options))


@pytest.mark.gpu
def test_kto_torch_compile_fullgraph():
    batch = make_batch(8, 64, 256, 1000, dtype=torch.bfloat16) | {"preference_labels": labels(8)}
    ref_logps = randn(8) - 30.0
    out = torch.compile(kto_loss, fullgraph=True)(**batch, ref_logps=ref_logps, kl=0.1)
    eager = kto_loss(**batch, ref_logps=ref_logps, kl=0.1)
    torch.testing.assert_close(out.loss, eager.loss, rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(out.loss, batch["input"])[0]
    e = torch.autograd.grad(eager.loss, batch["input"])[0]
    torch.testing.assert_close(g, e, rtol=2e-2, atol=1e-3)


@pytest.mark.gpu
def test_kto_torch_compile_fullgraph_with_integer_labels():
    """The eager check of 0/1 integer labels (a device-to-host read) stays out of a compiled graph."""
    batch = make_batch(8, 64, 256, 1000, dtype=torch.bfloat16) | {"preference_labels": labels(8).to(torch.int64)}
    out = torch.compile(kto_loss, fullgraph=True)(**batch, kl=0.1)
    eager = kto_loss(**batch, kl=0.1)
    torch.testing.assert_close(out.loss, eager.loss, rtol=1e-5, atol=1e-5)
