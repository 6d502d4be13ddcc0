r"""Group relative policy optimisation: the clipped token-level policy-gradient loss (API.md).

From one pass of the fused head, the policy's token log-probs ``logp`` (R, T) over the completion
tokens that count (``m``: target ≠ ignore_index), and per token, with ``A = advantages[i]``::

    ρ  = exp(logp − old)                      old = old_logps, or logp detached (ρ = 1, with gradient)
    l  = −min(ρ·A, clamp(ρ, 1 − ε_low, 1 + ε_high)·A)
    l += β·(e^(ref − logp) − (ref − logp) − 1)          when β > 0 (the k3 estimator of KL(π ‖ π_ref))

then one of four normalisations of the masked sum::

    "grpo"     mean over rows of Σ_t l·m / Σ_t m
    "bnpo"     Σ l·m / Σ m
    "dr_grpo"  Σ l·m / (R · max_completion_length)        (T when None)
    "dapo"     Σ l·m / num_items_in_batch                 (Σ m when None)

Metrics: ``logps`` (R, T) (0 where not counted), ``clip_ratio`` — the share of counted tokens
where the clipped term is the smaller one (``ρ < 1 − ε_low`` with ``A < 0``, or ``ρ > 1 + ε_high``
with ``A > 0``) — and ``kl``, the mean of the per-token KL over counted tokens (0 when β = 0).

``old_logps`` and ``ref_logps`` are per token (R, T); values at positions that do not count are
never read (they may be anything, -inf included). References: Shao et al. 2024 (GRPO), Liu et al.
2025 (Dr. GRPO), Yu et al. 2025 (DAPO), as TRL's GRPO trainer computes them.
"""

from __future__ import annotations

import math
import numbers
from functools import partial

import torch

from tigon.losses._output import (
    LossOutput,
    check_choice,
    check_number,
    check_policy,
    check_rows,
    head_keywords,
    metric,
)
from tigon.losses._single_pass import evaluate

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def grpo_options(beta, epsilon_low, epsilon_high, loss_type, max_completion_length) -> tuple:
    """grpo_loss's options, checked (also by GRPOLoss when it is built): (β, ε_low, ε_high)."""
    beta = check_number(beta, "beta", minimum=0.0)
    epsilon_low = check_number(epsilon_low, "epsilon_low", minimum=0.0)
    epsilon_high = check_number(epsilon_high, "epsilon_high", minimum=0.0)
    check_choice(loss_type, "loss_type", GRPO_LOSS_TYPES)
    if max_completion_length is not None and (
        isinstance(max_completion_length, bool)
        or not isinstance(max_completion_length, numbers.Integral)
        or max_completion_length <= 0
    ):
        raise ValueError(f"max_completion_length must be a positive int or None, got {max_completion_length!r}")
    return beta, epsilon_low, epsilon_high


def _items_divisor(num_items_in_batch, device):
    """The "dapo" divisor: a positive finite number, or a one-element tensor holding one (Trainer
    passes a tensor). Eager mode reads a tensor's value (one device-to-host sync); under
    torch.compile a data-dependent check cannot raise, and the value is used as given."""
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must be a number or a one-element tensor, "
                             f"got shape {tuple(num_items_in_batch.shape)}")
        if num_items_in_batch.dtype == torch.bool or num_items_in_batch.is_complex():
            raise TypeError(f"num_items_in_batch has dtype {num_items_in_batch.dtype}, expected a real number")
        if not torch.compiler.is_compiling():
            value = num_items_in_batch.item()
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"num_items_in_batch must be a finite number > 0, got {value}")
        return num_items_in_batch.detach().reshape(()).to(device=device, dtype=torch.float32)
    return check_number(num_items_in_batch, "num_items_in_batch", positive=True)


def _grpo_formula(logps, mask, *, advantages, old_logps, ref_logps, beta, epsilon_low, epsilon_high, loss_type,
                  max_completion_length, divisor):
    """GRPO from the token log-probs (R, T): the one formula of both paths (module docstring)."""
    num_rows, num_tokens = logps.shape
    device = logps.device
    own = logps.detach()
    # where a token does not count, the policy's own value: ρ = 1 and KL = 0 there, whatever was passed
    old = own if old_logps is None else torch.where(mask, old_logps.detach().to(torch.float32), own)
    advantage = advantages.detach().to(torch.float32).unsqueeze(1)  # (R, 1)

    ratio = torch.exp(logps - old)  # (R, T) ρ
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * advantage
    per_token = -torch.minimum(unclipped, clipped)
    counted = mask.sum().clamp(min=1).to(torch.float32)
    if beta > 0.0:
        ref = torch.where(mask, ref_logps.detach().to(torch.float32), own)
        log_ratio_ref = ref - logps
        per_token_kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1.0
        per_token = per_token + beta * per_token_kl
        kl = torch.where(mask, per_token_kl, 0.0).sum() / counted
    else:
        kl = torch.zeros((), dtype=torch.float32, device=device)
    per_token = torch.where(mask, per_token, 0.0)

    if loss_type == "grpo":
        loss = (per_token.sum(-1) / mask.sum(-1).clamp(min=1).to(torch.float32)).mean()
    elif loss_type == "bnpo":
        loss = per_token.sum() / counted
    elif loss_type == "dr_grpo":
        length = num_tokens if max_completion_length is None else max_completion_length
        loss = per_token.sum() / (num_rows * length)
    else:
        loss = per_token.sum() / (counted if divisor is None else divisor)

    is_clipped = ((ratio < 1.0 - epsilon_low) & (advantage < 0)) | ((ratio > 1.0 + epsilon_high) & (advantage > 0))
    clip_ratio = (is_clipped & mask).sum().to(torch.float32) / counted
    return LossOutput(loss=loss, logps=metric(logps), clip_ratio=metric(clip_ratio), kl=metric(kl))


def grpo_loss(
    input, linear_weight, target, advantages, *,
    old_logps=None, ref_logps=None, beta=0.0, epsilon_low=0.2, epsilon_high=0.2, loss_type="grpo",
    max_completion_length=None, num_items_in_batch=None,
    linear_bias=None, ignore_index=-100, temperature=1.0, softcap=None, logit_scale=1.0, config=None,
) -> LossOutput:
    """GRPO over ``R`` completions ``[R, T]``; ``advantages`` (R,), one per completion.

    ``old_logps`` (R, T): the sampling policy's token log-probs (None: on-policy, ρ = 1).
    ``ref_logps`` (R, T): the reference's token log-probs, required when ``beta > 0``.
    Returns ``LossOutput(loss, logps, clip_ratio, kl)``; see the module docstring.
    """
    beta, epsilon_low, epsilon_high = grpo_options(beta, epsilon_low, epsilon_high, loss_type, max_completion_length)
    num_rows, num_tokens = check_policy(input, linear_weight, target)
    if num_rows == 0:
        raise ValueError("input has 0 rows")
    device = input.device
    check_rows(advantages, "advantages", (num_rows,), device)
    if beta > 0.0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps, the reference's per-token log-probs (R, T)")
    if old_logps is not None:
        check_rows(old_logps, "old_logps", (num_rows, num_tokens), device)
    if ref_logps is not None:
        check_rows(ref_logps, "ref_logps", (num_rows, num_tokens), device)
    divisor = None if num_items_in_batch is None else _items_divisor(num_items_in_batch, device)

    head = head_keywords(linear_bias, temperature, softcap, logit_scale, ignore_index)
    formula = partial(
        _grpo_formula, advantages=advantages, old_logps=old_logps, ref_logps=ref_logps, beta=beta,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, loss_type=loss_type,
        max_completion_length=max_completion_length, divisor=divisor,
    )
    return evaluate(input, linear_weight, target, head, formula, paired=False, config=config)
