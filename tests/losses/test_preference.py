"""DPO, ORPO, CPO and SimPO against float64 references written from API.md's formulas.

Shapes are tiny and odd (R = 2B rows of T tokens, H and V not powers of two); rows differ in their
counted tokens, so summed and averaged sequence log-probs differ. Every DPO loss type meets every
reference variant: a reference model's hidden states and head (no gradient), per-row ref_logps, none.
"""

import pytest
import torch

from tests.helpers import DEVICE, randn
from tests.losses.common import check_loss, make_batch, reference_model
from tigon.losses import cpo_loss, dpo_loss, orpo_loss, reference, simpo_loss

ROWS, TOKENS, HIDDEN, VOCAB = 6, 9, 24, 37  # B = 3 pairs
DTYPES = (torch.float32, torch.bfloat16)


def with_reference(batch, variant):
    if variant == "model":
        return batch | reference_model(batch)
    if variant == "ref_logps":
        return batch | {"ref_logps": randn(ROWS, scale=3.0) - 10.0}
    return batch


# every loss type × every reference variant in fp32; in bf16 each loss type once, each variant once
DPO_CASES = [(torch.float32, loss_type, variant) for loss_type in ("sigmoid", "hinge", "ipo")
             for variant in ("model", "ref_logps", "none")]
DPO_CASES += [(torch.bfloat16, "sigmoid", "model"), (torch.bfloat16, "hinge", "ref_logps"),
              (torch.bfloat16, "ipo", "none")]


@pytest.mark.parametrize("dtype,loss_type,variant", DPO_CASES, ids=str)
def test_dpo(dtype, loss_type, variant):
    tensors = with_reference(make_batch(ROWS, TOKENS, HIDDEN, VOCAB, dtype=dtype), variant)
    check_loss(dpo_loss, reference.dpo, tensors, dtype=dtype, loss_type=loss_type, beta=0.3)


@pytest.mark.parametrize("variant", ("model", "ref_logps"))
def test_dpo_options(variant):
    """Averaged log-probs (the reference model's averaged the same way), smoothing, NLL term, and the
    head options (temperature, softcap, logit_scale, a custom ignore_index) passed through."""
    tensors = with_reference(make_batch(ROWS, TOKENS, HIDDEN, VOCAB, ignore_index=-1), variant)
    check_loss(
        dpo_loss, reference.dpo, tensors, dtype=torch.float32, beta=0.7, label_smoothing=0.2, nll_weight=0.5,
        average_log_prob=True, temperature=0.7, softcap=3.0, logit_scale=1.3, ignore_index=-1,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_orpo(dtype):
    tensors = make_batch(ROWS, TOKENS, HIDDEN, VOCAB, dtype=dtype)
    check_loss(orpo_loss, reference.orpo, tensors, dtype=dtype, beta=0.25)


@pytest.mark.parametrize("dtype,average_log_prob", [(torch.float32, False), (torch.float32, True),
                                                    (torch.bfloat16, False)], ids=str)
def test_cpo(dtype, average_log_prob):
    tensors = make_batch(ROWS, TOKENS, HIDDEN, VOCAB, dtype=dtype, bias=not average_log_prob)
    check_loss(cpo_loss, reference.cpo, tensors, dtype=dtype, beta=0.2, label_smoothing=0.1, alpha=0.6,
               average_log_prob=average_log_prob)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_simpo(dtype):
    tensors = make_batch(ROWS, TOKENS, HIDDEN, VOCAB, dtype=dtype)
    check_loss(simpo_loss, reference.simpo, tensors, dtype=dtype, beta=2.5, gamma=0.3, label_smoothing=0.15)


def test_defaults_and_head_options():
    """Each loss's defaults (beta, gamma, alpha, loss_type) as API.md gives them, and softcap/temperature."""
    tensors = make_batch(4, 6, 16, 29, bias=False)
    check_loss(dpo_loss, reference.dpo, tensors, dtype=torch.float32)
    check_loss(orpo_loss, reference.orpo, tensors, dtype=torch.float32, softcap=2.0)
    check_loss(cpo_loss, reference.cpo, tensors, dtype=torch.float32, temperature=1.7)
    check_loss(simpo_loss, reference.simpo, tensors, dtype=torch.float32, logit_scale=0.5)


def test_dpo_reference_model_gets_no_gradient_and_matches_its_logps():
    """A reference model's log-probs equal ref_logps computed from the same model, and it gets no gradient."""
    batch = make_batch(ROWS, TOKENS, HIDDEN, VOCAB)
    ref = {k: v.detach().clone().requires_grad_() for k, v in reference_model(batch).items()}
    from_model = dpo_loss(**batch, **ref, average_log_prob=True)
    from_model.loss.backward()
    assert all(t.grad is None for t in ref.values())
    with torch.no_grad():
        lp, mask = reference.token_logps(ref["ref_input"], ref["ref_linear_weight"], batch["target"],
                                         ref["ref_linear_bias"])
        ref_logps = reference.sequence(lp, mask, True)
    given = dpo_loss(**batch, ref_logps=ref_logps, average_log_prob=True)
    torch.testing.assert_close(from_model.loss, given.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(from_model.chosen_rewards, given.chosen_rewards, rtol=1e-6, atol=1e-6)


def test_nll_counts_chosen_rows_only():
    """Changing the rejected rows' targets leaves the NLL unchanged; the chosen rows' changes it."""
    batch = make_batch(ROWS, TOKENS, HIDDEN, VOCAB)
    base = dpo_loss(**batch).nll
    moved = batch | {"target": batch["target"].clone()}
    moved["target"][ROWS // 2:, -1] = 5
    assert torch.equal(dpo_loss(**moved).nll, base)
    moved["target"][0, 4] = (moved["target"][0, 4] + 1) % VOCAB
    assert not torch.equal(dpo_loss(**moved).nll, base)


FUNCTIONS = (dpo_loss, orpo_loss, cpo_loss, simpo_loss)


@pytest.mark.parametrize("function", FUNCTIONS, ids=lambda f: f.__name__)
def test_odd_rows_is_an_error(function):
    batch = make_batch(5, 4, 8, 11)
    with pytest.raises(ValueError, match="rows"):
        function(**batch)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"loss_type": "kto"}, "loss_type"),
        ({"ref_input": torch.zeros(6, 9, 24)}, "ref_linear_weight"),
        ({"ref_linear_weight": torch.zeros(37, 24)}, "ref_input"),
        ({"ref_linear_bias": torch.zeros(37)}, "ref_linear_bias"),
        ({"ref_logps": torch.zeros(5)}, "ref_logps has shape"),
        ({"ref_logps": torch.zeros(6), "ref_input": torch.zeros(6, 9, 24),
          "ref_linear_weight": torch.zeros(37, 24)}, "ref_logps"),
        ({"ref_input": torch.zeros(6, 8, 24), "ref_linear_weight": torch.zeros(37, 24)}, "ref_input has shape"),
        ({"ref_input": torch.zeros(6, 9, 24), "ref_linear_weight": torch.zeros(36, 24)}, "ref_linear_weight has shape"),
        ({"ref_input": torch.zeros(6, 9, 24), "ref_linear_weight": torch.zeros(37, 24),
          "ref_linear_bias": torch.zeros(36)}, "ref_linear_bias has shape"),
        ({"linear_weight": torch.zeros(37, 23)}, "linear_weight"),
        ({"label_smoothing": 1.5}, "label_smoothing"),
        ({"beta": 0.0, "loss_type": "ipo"}, "beta"),
        ({"target": torch.zeros(6, 8, dtype=torch.int64)}, "target has shape"),
        ({"input": torch.zeros(6, 24)}, "input"),
    ],
)
def test_dpo_bad_inputs(options, match):
    batch = make_batch(ROWS, TOKENS, HIDDEN, VOCAB)
    options = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    with pytest.raises(ValueError, match=match):
        dpo_loss(**(batch | options))


@pytest.mark.parametrize("option", ("beta", "label_smoothing", "nll_weight"))
@pytest.mark.parametrize("value", ("big", None))
def test_dpo_non_number_option_is_a_type_error(option, value):
    with pytest.raises(TypeError, match=option):
        dpo_loss(**make_batch(ROWS, TOKENS, HIDDEN, VOCAB), **{option: value})


@pytest.mark.gpu
@pytest.mark.parametrize("function", FUNCTIONS, ids=lambda f: f.__name__)
def test_torch_compile_fullgraph(function):
    batch = make_batch(8, 64, 256, 1000, dtype=torch.bfloat16)
    compiled = torch.compile(function, fullgraph=True)
    out = compiled(**batch)
    eager = function(**batch)
    torch.testing.assert_close(out.loss, eager.loss, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.loss, [batch["input"], batch["linear_weight"]])
    eager_grads = torch.autograd.grad(eager.loss, [batch["input"], batch["linear_weight"]])
    for g, e in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=2e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.bigmem
def test_dpo_large_against_materialised_logits():
    """A Llama-sized vocabulary: the fused head against logits held whole, in float64."""
    batch = make_batch(4, 256, 512, 128256, dtype=torch.bfloat16)
    check_loss(dpo_loss, reference.dpo, batch | reference_model(batch), dtype=torch.bfloat16)


def test_dpo_reference_model_of_another_width():
    """The reference model's hidden size may differ from the policy's (a smaller reference)."""
    batch = make_batch(ROWS, TOKENS, HIDDEN, VOCAB)
    ref = {"ref_input": randn(ROWS, TOKENS, 10), "ref_linear_weight": randn(VOCAB, 10, scale=0.5)}
    check_loss(dpo_loss, reference.dpo, batch | ref, dtype=torch.float32, average_log_prob=True)


def test_autocast_casts_like_f_linear():
    """Under autocast the head runs on bf16 copies of input and weight; the loss math stays fp32."""
    batch = make_batch(ROWS, TOKENS, HIDDEN, VOCAB, bias=False)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = dpo_loss(**batch)
    plain = dpo_loss(**(batch | {k: batch[k].detach().bfloat16() for k in ("input", "linear_weight")}))
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, plain.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.chosen_logps, plain.chosen_logps, rtol=1e-6, atol=1e-6)
