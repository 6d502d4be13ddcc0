r"""Paired preference losses: DPO, ORPO, CPO, SimPO (API.md, ``tigon.losses``).

The batch holds ``R = 2B`` rows, chosen first: rows ``0..B−1`` are the chosen completions and
``B..2B−1`` the rejected ones, pair ``i`` being rows ``i`` and ``B + i``. From the policy's hidden
states, one pass of the fused head gives the token log-probs ``logp`` (R, T); then, per row, the
sequence log-prob ``ℓ_i = Σ_t logp_it`` over counted tokens (÷ their count when averaged), and

    ℓc, ℓr = ℓ[:B], ℓ[B:]                                       (B,) each
    NLL    = −Σ logp[:B] / (counted tokens of the chosen rows)  ()

Each loss below is then a mean over pairs of a function of ``ℓc − ℓr`` (and, for DPO, of the
reference's ``ℓ_ref``), plus a weighted NLL. With ``σ`` the sigmoid and ``ε`` the label smoothing,
the smoothed sigmoid loss of a margin ``x`` is ``−(1−ε)·logσ(x) − ε·logσ(−x)``.

Each loss is one formula of the token log-probs (``_dpo_formula`` …), a handful of fp32 torch ops
on (B,) vectors; :func:`tigon.losses._single_pass.evaluate` runs it. In eager mode with gradients
that is the single pass (pairs chunked together; loss and gradient from one ``[R·T, H] × [H, V]``
product of logits, three in all), else the head's two passes (four products); never the
``[R·T, V]`` logits whole.

References: DPO (Rafailov et al. 2023; ``hinge`` from SLiC, ``ipo`` from Azar et al. 2023), ORPO
(Hong et al. 2024), CPO (Xu et al. 2024), SimPO (Meng et al. 2024); the formulas as TRL writes
them, and as API.md states them.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from tigon.losses._output import (
    LossOutput,
    check_choice,
    check_flag,
    check_number,
    check_paired,
    check_policy,
    chosen_nll,
    head_keywords,
    metric,
    reference_logps,
    sequence_logps,
)
from tigon.losses._single_pass import evaluate

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")


def smoothed_sigmoid_loss(margin: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """−(1−ε)·logσ(x) − ε·logσ(−x), per element."""
    return -(1.0 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)


def _check_smoothing(label_smoothing) -> float:
    value = check_number(label_smoothing, "label_smoothing", minimum=0.0)
    if value > 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    return value


def dpo_options(beta, loss_type, label_smoothing, nll_weight, average_log_prob) -> tuple:
    """dpo_loss's options, checked (also by DPOLoss when it is built): (β, ε, nll_weight)."""
    beta = check_number(beta, "beta")
    check_choice(loss_type, "loss_type", DPO_LOSS_TYPES)
    if loss_type == "ipo" and beta == 0.0:
        raise ValueError("beta must be positive for loss_type='ipo' (its target margin is 1/(2·beta))")
    check_flag(average_log_prob, "average_log_prob")
    return beta, _check_smoothing(label_smoothing), check_number(nll_weight, "nll_weight")


def orpo_options(beta) -> float:
    """orpo_loss's options, checked: β."""
    return check_number(beta, "beta")


def cpo_options(beta, label_smoothing, alpha, average_log_prob) -> tuple:
    """cpo_loss's options, checked: (β, ε, alpha)."""
    check_flag(average_log_prob, "average_log_prob")
    return check_number(beta, "beta"), _check_smoothing(label_smoothing), check_number(alpha, "alpha")


def simpo_options(beta, gamma, label_smoothing) -> tuple:
    """simpo_loss's options, checked: (β, γ, ε)."""
    return check_number(beta, "beta"), check_number(gamma, "gamma"), _check_smoothing(label_smoothing)


def _sequences(logps, mask, average, num_pairs):
    """(ℓ (R,), ℓc (B,), ℓr (B,)) from the token log-probs."""
    seq = sequence_logps(logps, mask, average)
    return seq, seq[:num_pairs], seq[num_pairs:]


def _dpo_formula(logps, mask, *, ref, num_pairs, beta, loss_type, label_smoothing, nll_weight, average):
    """DPO from the token log-probs (R, T): the one formula of both paths (module docstring)."""
    seq, chosen, rejected = _sequences(logps, mask, average, num_pairs)
    if ref is None:
        ref = torch.zeros_like(seq)
    chosen_ratio = chosen - ref[:num_pairs]        # (B,) ℓc − ℓc_ref
    rejected_ratio = rejected - ref[num_pairs:]    # (B,) ℓr − ℓr_ref
    delta = chosen_ratio - rejected_ratio          # (B,) Δ
    if loss_type == "sigmoid":
        per_pair = smoothed_sigmoid_loss(beta * delta, label_smoothing)
    elif loss_type == "hinge":
        per_pair = torch.relu(1.0 - beta * delta)
    else:
        per_pair = (delta - 1.0 / (2.0 * beta)) ** 2
    nll = chosen_nll(logps, mask, num_pairs)
    return LossOutput(
        loss=per_pair.mean() + nll_weight * nll,
        chosen_logps=metric(chosen),
        rejected_logps=metric(rejected),
        chosen_rewards=metric(beta * chosen_ratio),
        rejected_rewards=metric(beta * rejected_ratio),
        nll=metric(nll),
    )


def _orpo_formula(logps, mask, *, num_pairs, beta):
    _, chosen, rejected = _sequences(logps, mask, True, num_pairs)
    log_odds = (chosen - rejected) - (torch.log1p(-chosen.exp()) - torch.log1p(-rejected.exp()))  # (B,)
    log_odds_ratio = F.logsigmoid(log_odds).mean()
    nll = chosen_nll(logps, mask, num_pairs)
    return LossOutput(
        loss=nll - beta * log_odds_ratio,
        chosen_logps=metric(chosen),
        rejected_logps=metric(rejected),
        nll=metric(nll),
        log_odds_ratio=metric(log_odds_ratio),
    )


def _cpo_formula(logps, mask, *, num_pairs, beta, label_smoothing, alpha, average):
    _, chosen, rejected = _sequences(logps, mask, average, num_pairs)
    nll = chosen_nll(logps, mask, num_pairs)
    loss = smoothed_sigmoid_loss(beta * (chosen - rejected), label_smoothing).mean() + alpha * nll
    return LossOutput(loss=loss, chosen_logps=metric(chosen), rejected_logps=metric(rejected), nll=metric(nll))


def _simpo_formula(logps, mask, *, num_pairs, beta, gamma, label_smoothing):
    _, chosen, rejected = _sequences(logps, mask, True, num_pairs)
    loss = smoothed_sigmoid_loss(beta * (chosen - rejected) - gamma, label_smoothing).mean()
    return LossOutput(loss=loss, chosen_logps=metric(chosen), rejected_logps=metric(rejected))


def dpo_loss(
    input, linear_weight, target, *,
    beta=0.1, loss_type="sigmoid", label_smoothing=0.0, nll_weight=0.0, average_log_prob=False,
    ref_input=None, ref_linear_weight=None, ref_linear_bias=None, ref_logps=None,
    linear_bias=None, ignore_index=-100, temperature=1.0, softcap=None, logit_scale=1.0, config=None,
) -> LossOutput:
    """Direct preference optimisation over ``R = 2B`` rows, chosen first.

    ``Δ = (ℓc − ℓc_ref) − (ℓr − ℓr_ref)`` per pair; ``"sigmoid"``: ``−(1−ε)logσ(βΔ) − ε logσ(−βΔ)``,
    ``"hinge"``: ``relu(1 − βΔ)``, ``"ipo"``: ``(Δ − 1/(2β))²``; mean over pairs, plus
    ``nll_weight · NLL``. The reference comes from ``ref_input``/``ref_linear_weight``/
    ``ref_linear_bias`` (no gradient, same head options, averaged like the policy), or from per-row
    ``ref_logps`` (R,) as given; with neither it is 0. ``config``: a
    :class:`~tigon.losses._single_pass.SinglePassConfig` (None: the default).

    Returns ``LossOutput(loss, chosen_logps, rejected_logps, chosen_rewards, rejected_rewards, nll)``.
    """
    beta, label_smoothing, nll_weight = dpo_options(beta, loss_type, label_smoothing, nll_weight, average_log_prob)
    head = head_keywords(linear_bias, temperature, softcap, logit_scale, ignore_index)
    num_pairs = check_paired(check_policy(input, linear_weight, target)[0])  # before the reference's pass
    ref = reference_logps(
        target, head, average_log_prob, ref_input=ref_input, ref_linear_weight=ref_linear_weight,
        ref_linear_bias=ref_linear_bias, ref_logps=ref_logps, vocab=linear_weight.shape[0], device=input.device,
    )
    formula = partial(_dpo_formula, ref=ref, num_pairs=num_pairs, beta=beta, loss_type=loss_type,
                      label_smoothing=label_smoothing, nll_weight=nll_weight, average=average_log_prob)
    return evaluate(input, linear_weight, target, head, formula, paired=True, config=config)


def orpo_loss(
    input, linear_weight, target, *,
    beta=0.1, linear_bias=None, ignore_index=-100, temperature=1.0, softcap=None, logit_scale=1.0, config=None,
) -> LossOutput:
    """Odds-ratio preference optimisation over ``R = 2B`` rows, chosen first; ℓ averaged per token.

    ``log_odds = (ℓc − ℓr) − (log1p(−e^ℓc) − log1p(−e^ℓr))`` per pair; loss
    ``NLL − β · mean logσ(log_odds)``.

    Returns ``LossOutput(loss, chosen_logps, rejected_logps, nll, log_odds_ratio)`` with
    ``log_odds_ratio`` = mean logσ(log_odds).
    """
    beta = orpo_options(beta)
    head = head_keywords(linear_bias, temperature, softcap, logit_scale, ignore_index)
    num_pairs = check_paired(check_policy(input, linear_weight, target)[0])
    formula = partial(_orpo_formula, num_pairs=num_pairs, beta=beta)
    return evaluate(input, linear_weight, target, head, formula, paired=True, config=config)


def cpo_loss(
    input, linear_weight, target, *,
    beta=0.1, label_smoothing=0.0, alpha=1.0, average_log_prob=False,
    linear_bias=None, ignore_index=-100, temperature=1.0, softcap=None, logit_scale=1.0, config=None,
) -> LossOutput:
    """Contrastive preference optimisation over ``R = 2B`` rows, chosen first (no reference model).

    ``−(1−ε)logσ(β(ℓc−ℓr)) − ε logσ(−β(ℓc−ℓr))``, mean over pairs, plus ``alpha · NLL``.

    Returns ``LossOutput(loss, chosen_logps, rejected_logps, nll)``.
    """
    beta, label_smoothing, alpha = cpo_options(beta, label_smoothing, alpha, average_log_prob)
    head = head_keywords(linear_bias, temperature, softcap, logit_scale, ignore_index)
    num_pairs = check_paired(check_policy(input, linear_weight, target)[0])
    formula = partial(_cpo_formula, num_pairs=num_pairs, beta=beta, label_smoothing=label_smoothing, alpha=alpha,
                      average=average_log_prob)
    return evaluate(input, linear_weight, target, head, formula, paired=True, config=config)


def simpo_loss(
    input, linear_weight, target, *,
    beta=2.0, gamma=0.5, label_smoothing=0.0,
    linear_bias=None, ignore_index=-100, temperature=1.0, softcap=None, logit_scale=1.0, config=None,
) -> LossOutput:
    """Simple preference optimisation over ``R = 2B`` rows, chosen first; ℓ averaged per token.

    ``z = β(ℓc − ℓr) − γ``; ``−(1−ε)logσ(z) − ε logσ(−z)``, mean over pairs.

    Returns ``LossOutput(loss, chosen_logps, rejected_logps)``.
    """
    beta, gamma, label_smoothing = simpo_options(beta, gamma, label_smoothing)
    head = head_keywords(linear_bias, temperature, softcap, logit_scale, ignore_index)
    num_pairs = check_paired(check_policy(input, linear_weight, target)[0])
    formula = partial(_simpo_formula, num_pairs=num_pairs, beta=beta, gamma=gamma, label_smoothing=label_smoothing)
    return evaluate(input, linear_weight, target, head, formula, paired=True, config=config)
