"""GRPO against the float64 reference written from API.md.

old_logps are the policy's own log-probs moved by ±0.5 nats, and advantages have both signs, so
the clipping really clips on both sides (checked: tokens below 1 − ε_low with A < 0 and above
1 + ε_high with A > 0 both occur). Every loss type runs with and without old_logps, with β = 0 and
β > 0, and with explicit max_completion_length / num_items_in_batch.
"""

import pytest
import torch

from tests.helpers import DEVICE, randn
from tests.losses.common import check_loss, make_batch
from tigon.losses import grpo_loss, reference

ROWS, TOKENS, HIDDEN, VOCAB = 5, 9, 24, 37
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def policy_logps(batch):
    with torch.no_grad():
        lp, _ = reference.token_logps(*(batch[k].double() for k in ("input", "linear_weight")), batch["target"],
                                      batch["linear_bias"].double())
    return lp.float()


def rl_batch(dtype=torch.float32, *, old=True, ref=True):
    batch = make_batch(ROWS, TOKENS, HIDDEN, VOCAB, dtype=dtype)
    own = policy_logps(batch)
    batch["advantages"] = torch.tensor([1.5, -0.8, 0.6, -1.2, 0.9], device=DEVICE)
    if old:  # ±0.5 nats away from the policy: ρ spans roughly [0.6, 1.65]
        batch["old_logps"] = own + (torch.rand_like(own) - 0.5)
    if ref:
        batch["ref_logps"] = own + 0.3 * randn(ROWS, TOKENS)
    return batch


def test_clipping_clips_on_both_sides():
    batch = rl_batch()
    out, _ = check_loss(grpo_loss, reference.grpo, batch, dtype=torch.float32)
    counted = batch["target"] != -100
    rho = torch.exp(policy_logps(batch) - batch["old_logps"])
    advantage = batch["advantages"].unsqueeze(1)
    low = ((rho < 0.8) & (advantage < 0) & counted).sum().item()
    high = ((rho > 1.2) & (advantage > 0) & counted).sum().item()
    assert low > 0 and high > 0
    assert out.clip_ratio.item() == pytest.approx((low + high) / counted.sum().item())


# every loss type off-policy with the KL term and on-policy without it, in fp32; two in bf16 (the other
# two pairings, off-policy without KL and on-policy with it, also run there)
GRPO_CASES = [(torch.float32, loss_type, old, beta) for loss_type in LOSS_TYPES for old, beta in ((True, 0.04),
                                                                                                 (False, 0.0))]
GRPO_CASES += [(torch.bfloat16, "grpo", True, 0.0), (torch.bfloat16, "dapo", False, 0.04)]


@pytest.mark.parametrize("dtype,loss_type,old,beta", GRPO_CASES, ids=str)
def test_grpo(dtype, loss_type, old, beta):
    tensors = rl_batch(dtype, old=old, ref=beta > 0)
    out, _ = check_loss(grpo_loss, reference.grpo, tensors, dtype=dtype, beta=beta, loss_type=loss_type,
                        epsilon_low=0.2, epsilon_high=0.28)
    if not old:
        assert out.clip_ratio.item() == 0.0  # ρ = 1 exactly
    if beta == 0.0:
        assert out.kl.item() == 0.0


@pytest.mark.parametrize("loss_type,options", [
    ("dr_grpo", {"max_completion_length": 16}),
    ("dapo", {"num_items_in_batch": "tensor"}),
])
def test_grpo_explicit_normalisers(loss_type, options):
    if options.get("num_items_in_batch") == "tensor":
        options = {"num_items_in_batch": torch.tensor(37, device=DEVICE)}
    check_loss(grpo_loss, reference.grpo, rl_batch(), dtype=torch.float32, loss_type=loss_type, beta=0.1,
               temperature=0.9, softcap=5.0, **options)


def test_grpo_defaults_and_ignored_positions_never_read():
    """Values of old_logps / ref_logps where the target is ignored (even -inf) change nothing."""
    batch = rl_batch()
    clean = grpo_loss(**batch, beta=0.1)
    ignored = batch["target"] == -100
    dirty = batch | {k: batch[k].masked_fill(ignored, float("-inf")) for k in ("old_logps", "ref_logps")}
    out = grpo_loss(**dirty, beta=0.1)
    assert torch.equal(out.loss, clean.loss) and torch.equal(out.kl, clean.kl)
    grad = torch.autograd.grad(out.loss, batch["input"])[0]
    assert torch.isfinite(grad).all()
    assert out.logps.shape == (ROWS, TOKENS) and torch.count_nonzero(out.logps[ignored]) == 0
    check_loss(grpo_loss, reference.grpo, rl_batch(old=False, ref=False), dtype=torch.float32)  # defaults


def test_grpo_on_policy_gradient_is_the_policy_gradient():
    """old_logps=None: ρ = 1 with gradient, so ∂loss/∂logp_t = −A·m_t/Σm for bnpo."""
    batch = rl_batch(old=False, ref=False)
    out = grpo_loss(**batch, loss_type="bnpo")
    assert out.loss.item() == pytest.approx(
        -(batch["advantages"].unsqueeze(1) * (batch["target"] != -100)).sum().item()
        / (batch["target"] != -100).sum().item(), rel=1e-6)


@pytest.mark.parametrize(
    "options,error,match",
    [
        ({"beta": 0.1, "ref_logps": None}, ValueError, "ref_logps"),
        ({"ref_logps": torch.zeros(ROWS)}, ValueError, "ref_logps has shape"),
        ({"old_logps": torch.zeros(ROWS, TOKENS + 1)}, ValueError, "old_logps has shape"),
        ({"advantages": torch.zeros(ROWS, 1)}, ValueError, "advantages has shape"),
        ({"advantages": torch.zeros(ROWS, dtype=torch.int64)}, TypeError, "advantages"),
        ({"loss_type": "ppo"}, ValueError, "loss_type"),
        ({"max_completion_length": 0}, ValueError, "max_completion_length"),
        ({"num_items_in_batch": 0}, ValueError, "num_items_in_batch"),
        ({"num_items_in_batch": torch.tensor(0.0)}, ValueError, "num_items_in_batch"),
        ({"num_items_in_batch": torch.tensor(0)}, ValueError, "num_items_in_batch"),
        ({"num_items_in_batch": torch.tensor([-4.0])}, ValueError, "num_items_in_batch"),
        ({"num_items_in_batch": torch.tensor(float("nan"))}, ValueError, "num_items_in_batch"),
        ({"num_items_in_batch": torch.tensor(float("inf"))}, ValueError, "num_items_in_batch"),
        ({"num_items_in_batch": "12"}, TypeError, "num_items_in_batch"),
        ({"epsilon_high": None}, TypeError, "epsilon_high"),
        ({"epsilon_low": -0.1}, ValueError, "epsilon_low"),
        ({"target": torch.zeros(ROWS, TOKENS - 1, dtype=torch.int64)}, ValueError, "target has shape"),
    ],
)
def test_grpo_bad_inputs(options, error, match):
    batch = rl_batch()
    options = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    with pytest.raises(error, match=match):
        grpo_loss(**(batch | options))


def test_grpo_takes_no_reference_model():
    with pytest.raises(TypeError):
        grpo_loss(**rl_batch(), ref_input=torch.zeros(ROWS, TOKENS, HIDDEN, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_torch_compile_fullgraph(loss_type):
    batch = make_batch(16, 64, 256, 1000, dtype=torch.bfloat16)
    own = policy_logps(batch)
    extra = {"advantages": randn(16), "old_logps": own + 0.1 * randn(16, 64), "ref_logps": own + 0.1 * randn(16, 64)}
    out = torch.compile(grpo_loss, fullgraph=True)(**batch, **extra, beta=0.04, loss_type=loss_type)
    eager = grpo_loss(**batch, **extra, beta=0.04, loss_type=loss_type)
    torch.testing.assert_close(out.loss, eager.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.clip_ratio, eager.clip_ratio)
    g = torch.autograd.grad(out.loss, batch["input"])[0]
    e = torch.autograd.grad(eager.loss, batch["input"])[0]
    torch.testing.assert_close(g, e, rtol=2e-2, atol=1e-3)


@pytest.mark.gpu
def test_grpo_torch_compile_fullgraph_with_an_item_count_tensor():
    """The eager check of a num_items_in_batch tensor (a device-to-host read) stays out of a compiled
    graph: fullgraph compiles, and the loss is the eager one."""
    batch = make_batch(16, 64, 256, 1000, dtype=torch.bfloat16)
    extra = {"advantages": randn(16), "num_items_in_batch": torch.tensor(700.0, device=DEVICE)}
    out = torch.compile(grpo_loss, fullgraph=True)(**batch, **extra, loss_type="dapo")
    eager = grpo_loss(**batch, **extra, loss_type="dapo")
    torch.testing.assert_close(out.loss, eager.loss, rtol=1e-5, atol=1e-5)
