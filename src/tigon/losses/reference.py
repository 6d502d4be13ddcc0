"""Plain-torch references of the post-training losses, written from API.md's formulas.

They share no code with the fused implementations: they hold the ``[R, T, V]`` logits whole
(``F.linear``, then ``log_softmax``) and write each formula out as API.md states it. Tests call
them on float64 copies of the inputs (exactness), the tiny training runs and the benchmarks'
``eager`` provider in the inputs' own dtype. Logits come from ``F.linear`` in the inputs' dtype and
are upcast to fp32 (fp64 for fp64 inputs) before the softmax, as a plain PyTorch trainer computes
them: for bf16 inputs that rounds the logits once, which the fused head does not (so tests compare
on float64 inputs). Each returns a dict: ``loss`` and the metrics API.md names for that loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_logps(input, weight, target, bias=None, *, temperature=1.0, softcap=None, logit_scale=1.0,
                ignore_index=-100):
    """log_softmax(z)[target] per token (0 where ignored) and the counted-token mask; fp32 (fp64 for fp64)."""
    wide = torch.float64 if input.dtype == torch.float64 else torch.float32
    z = F.linear(input, weight, bias).to(wide)  # (R, T, V)
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    mask = target != ignore_index
    picked = torch.log_softmax(z, -1).gather(-1, torch.where(mask, target, 0).unsqueeze(-1)).squeeze(-1)
    return picked * mask, mask


def sequence(logps, mask, average):
    """ℓ_i: the sum over counted tokens, ÷ their count (at least 1) when averaged."""
    total = (logps * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


def nll(logps, mask, num_chosen):
    """−(Σ logp over the counted tokens of the chosen rows) / (their count)."""
    return -(logps[:num_chosen] * mask[:num_chosen]).sum() / mask[:num_chosen].sum().clamp(min=1)


def _head(kwargs):
    return {k: kwargs[k] for k in ("temperature", "softcap", "logit_scale", "ignore_index") if k in kwargs}


def _reference_sequence(target, average, ref_input, ref_linear_weight, ref_linear_bias, ref_logps, head, like):
    if ref_logps is not None:
        return ref_logps.to(like.dtype)
    if ref_input is None:
        return torch.zeros_like(like)
    with torch.no_grad():
        lp, mask = token_logps(ref_input, ref_linear_weight, target, ref_linear_bias, **head)
        return sequence(lp, mask, average)


def smoothed(x, eps):
    return -(1 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x)


def dpo(input, linear_weight, target, *, linear_bias=None, beta=0.1, loss_type="sigmoid", label_smoothing=0.0,
        nll_weight=0.0, average_log_prob=False, ref_input=None, ref_linear_weight=None, ref_linear_bias=None,
        ref_logps=None, **head):
    head = _head(head)
    lp, mask = token_logps(input, linear_weight, target, linear_bias, **head)
    seq = sequence(lp, mask, average_log_prob)
    ref = _reference_sequence(target, average_log_prob, ref_input, ref_linear_weight, ref_linear_bias, ref_logps,
                              head, seq)
    b = seq.shape[0] // 2
    chosen, rejected = seq[:b] - ref[:b], seq[b:] - ref[b:]
    delta = chosen - rejected
    if loss_type == "sigmoid":
        per_pair = smoothed(beta * delta, label_smoothing)
    elif loss_type == "hinge":
        per_pair = torch.relu(1 - beta * delta)
    else:
        per_pair = (delta - 1 / (2 * beta)) ** 2
    n = nll(lp, mask, b)
    return {"loss": per_pair.mean() + nll_weight * n, "chosen_logps": seq[:b], "rejected_logps": seq[b:],
            "chosen_rewards": beta * chosen, "rejected_rewards": beta * rejected, "nll": n}


def orpo(input, linear_weight, target, *, linear_bias=None, beta=0.1, **head):
    lp, mask = token_logps(input, linear_weight, target, linear_bias, **_head(head))
    seq = sequence(lp, mask, True)
    b = seq.shape[0] // 2
    c, r = seq[:b], seq[b:]
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    ratio = F.logsigmoid(log_odds).mean()
    n = nll(lp, mask, b)
    return {"loss": n - beta * ratio, "chosen_logps": c, "rejected_logps": r, "log_odds_ratio": ratio, "nll": n}


def cpo(input, linear_weight, target, *, linear_bias=None, beta=0.1, label_smoothing=0.0, alpha=1.0,
        average_log_prob=False, **head):
    lp, mask = token_logps(input, linear_weight, target, linear_bias, **_head(head))
    seq = sequence(lp, mask, average_log_prob)
    b = seq.shape[0] // 2
    c, r = seq[:b], seq[b:]
    n = nll(lp, mask, b)
    return {"loss": smoothed(beta * (c - r), label_smoothing).mean() + alpha * n,
            "chosen_logps": c, "rejected_logps": r, "nll": n}


def simpo(input, linear_weight, target, *, linear_bias=None, beta=2.0, gamma=0.5, label_smoothing=0.0, **head):
    lp, mask = token_logps(input, linear_weight, target, linear_bias, **_head(head))
    seq = sequence(lp, mask, True)
    b = seq.shape[0] // 2
    c, r = seq[:b], seq[b:]
    return {"loss": smoothed(beta * (c - r) - gamma, label_smoothing).mean(), "chosen_logps": c, "rejected_logps": r}


def kto(input, linear_weight, target, preference_labels, *, linear_bias=None, beta=0.1, kl=0.0,
        desirable_weight=1.0, undesirable_weight=1.0, average_log_prob=False, ref_input=None,
        ref_linear_weight=None, ref_linear_bias=None, ref_logps=None, **head):
    head = _head(head)
    lp, mask = token_logps(input, linear_weight, target, linear_bias, **head)
    seq = sequence(lp, mask, average_log_prob)
    ref = _reference_sequence(target, average_log_prob, ref_input, ref_linear_weight, ref_linear_bias, ref_logps,
                              head, seq)
    u = seq - ref
    kl = kl.to(seq.dtype) if isinstance(kl, torch.Tensor) else kl
    desirable = preference_labels.bool()
    rows = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (u - kl))),
                       undesirable_weight * (1 - torch.sigmoid(beta * (kl - u))))
    return {"loss": rows.mean(), "logps": seq, "rewards": beta * u}


def grpo(input, linear_weight, target, advantages, *, linear_bias=None, old_logps=None, ref_logps=None, beta=0.0,
         epsilon_low=0.2, epsilon_high=0.2, loss_type="grpo", max_completion_length=None, num_items_in_batch=None,
         **head):
    lp, mask = token_logps(input, linear_weight, target, linear_bias, **_head(head))
    m = mask.to(lp.dtype)
    old = lp.detach() if old_logps is None else old_logps.to(lp.dtype)
    a = advantages.to(lp.dtype).unsqueeze(1)
    rho = torch.exp(lp - old)
    per_token = -torch.min(rho * a, torch.clamp(rho, 1 - epsilon_low, 1 + epsilon_high) * a)
    if beta > 0:
        d = ref_logps.to(lp.dtype) - lp
        kl_tok = torch.exp(d) - d - 1
        per_token = per_token + beta * kl_tok
        kl = (kl_tok * m).sum() / m.sum()
    else:
        kl = torch.zeros((), dtype=lp.dtype)
    r, t = lp.shape
    if loss_type == "grpo":
        loss = ((per_token * m).sum(1) / m.sum(1)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * m).sum() / m.sum()
    elif loss_type == "dr_grpo":
        loss = (per_token * m).sum() / (r * (max_completion_length or t))
    else:
        loss = (per_token * m).sum() / (m.sum() if num_items_in_batch is None else num_items_in_batch)
    clipped = ((rho < 1 - epsilon_low) & (a < 0)) | ((rho > 1 + epsilon_high) & (a > 0))
    clip_ratio = (clipped & mask).sum() / mask.sum()
    return {"loss": loss, "logps": lp, "clip_ratio": clip_ratio.to(lp.dtype), "kl": kl}
