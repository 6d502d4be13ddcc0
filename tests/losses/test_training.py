"""Twenty optimiser steps of a tiny model per loss: the tigon loss against the plain-torch one
(reference.py in float32, logits held whole), from the same initial weights on the same batch.

The model is an embedding, one tanh layer and an LM head with bias; the reference log-probs (and
GRPO's old_logps) are the initial policy's, as a trainer holding a frozen reference would pass them.
Both runs must lower the loss, and their loss curves must agree step by step.
"""

import pytest
import torch

from tests.helpers import DEVICE
from tigon.losses import cpo_loss, dpo_loss, grpo_loss, kto_loss, orpo_loss, reference, simpo_loss

ROWS, TOKENS, HIDDEN, VOCAB = 4, 6, 8, 16
STEPS, LR = 20, 0.5
# fp32 sums in a different order drift apart slowly over the steps; the losses start O(1)
CURVE_TOLERANCE = 1e-3


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layer = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def hidden(self, ids):
        return torch.tanh(self.layer(self.embed(ids)))  # (R, T, H)


def make_problem():
    ids = torch.randint(0, VOCAB, (ROWS, TOKENS), device=DEVICE)
    target = torch.roll(ids, -1, dims=1)
    target[:, :2] = -100  # the prompt
    target[1, -1] = target[3, -2:] = -100  # padding
    return ids, target


def initial_logps(model, ids, target):
    with torch.no_grad():
        lp, mask = reference.token_logps(model.hidden(ids), model.head.weight, target, model.head.bias)
    return lp, mask


LOSSES = {
    # name: (tigon function, reference function, extra tensors from the initial policy, options)
    "dpo": (dpo_loss, reference.dpo, lambda lp, m: {"ref_logps": reference.sequence(lp, m, False)},
            {"beta": 0.5, "nll_weight": 0.1}),
    "orpo": (orpo_loss, reference.orpo, lambda lp, m: {}, {"beta": 0.5}),
    "cpo": (cpo_loss, reference.cpo, lambda lp, m: {}, {"beta": 0.5, "alpha": 0.5}),
    "simpo": (simpo_loss, reference.simpo, lambda lp, m: {}, {}),
    "kto": (kto_loss, reference.kto,
            lambda lp, m: {"ref_logps": reference.sequence(lp, m, False),
                           "preference_labels": torch.tensor([True, False, True, False], device=DEVICE)},
            {"beta": 0.5, "kl": 0.1}),
    "grpo": (grpo_loss, reference.grpo,
             lambda lp, m: {"advantages": torch.tensor([1.0, -0.5, 0.7, -1.2], device=DEVICE),
                            "old_logps": lp.clone(), "ref_logps": lp.clone()},
             {"beta": 0.04, "loss_type": "bnpo", "epsilon_high": 0.28}),
}


def train(function, model, ids, target, extra, options, *, unpack):
    optimiser = torch.optim.SGD(model.parameters(), lr=LR)
    curve = []
    for _ in range(STEPS):
        optimiser.zero_grad()
        out = function(model.hidden(ids), model.head.weight, target, linear_bias=model.head.bias,
                       **extra, **options)
        loss = unpack(out)
        loss.backward()
        optimiser.step()
        curve.append(loss.item())
    return torch.tensor(curve, dtype=torch.float64)


@pytest.mark.parametrize("name", LOSSES)
def test_training_matches_plain_torch(name):
    function, ref_function, make_extra, options = LOSSES[name]
    ids, target = make_problem()
    model = TinyLM().to(DEVICE)
    twin = TinyLM().to(DEVICE)
    twin.load_state_dict(model.state_dict())
    extra = make_extra(*initial_logps(model, ids, target))

    fused = train(function, model, ids, target, extra, options, unpack=lambda out: out.loss)
    plain = train(lambda input, linear_weight, target, **kw: ref_function(input, linear_weight, target, **kw),
                  twin, ids, target, extra, options, unpack=lambda out: out["loss"])
    assert fused[-1] < fused[0] and plain[-1] < plain[0], (fused, plain)
    scale = plain.abs().max()
    assert ((fused - plain).abs().max() / scale).item() <= CURVE_TOLERANCE, (fused, plain)
