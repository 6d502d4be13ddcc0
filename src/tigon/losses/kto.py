r"""Kahneman-Tversky optimisation: unpaired rows, each desirable or undesirable (API.md).

From one pass of the fused head, each row's sequence log-prob ``ℓ_i`` (summed over counted tokens,
or averaged with ``average_log_prob=True``) and its implicit reward against the reference::

    u_i = ℓ_i − ℓ_ref_i
    desirable   (preference_labels[i] True):   w_d · (1 − σ(β(u_i − kl)))
    undesirable (preference_labels[i] False):  w_u · (1 − σ(β(kl − u_i)))

mean over rows. ``kl`` is the batch's reference-point estimate of KL(π ‖ π_ref) (a number or a
0-dim tensor, no gradient); TRL computes it from mismatched prompt/completion pairs and passes it in.

Reference: Ethayarajh et al. 2024, as TRL's KTO trainer computes it.
"""

from __future__ import annotations

from functools import partial

import torch

from tigon.losses._output import (
    LossOutput,
    check_flag,
    check_number,
    check_policy,
    head_keywords,
    metric,
    reference_logps,
    sequence_logps,
)
from tigon.losses._single_pass import evaluate


def kto_options(beta, desirable_weight, undesirable_weight, average_log_prob) -> tuple:
    """kto_loss's options, checked (also by KTOLoss when it is built): (β, w_d, w_u)."""
    check_flag(average_log_prob, "average_log_prob")
    return (check_number(beta, "beta"), check_number(desirable_weight, "desirable_weight", minimum=0.0),
            check_number(undesirable_weight, "undesirable_weight", minimum=0.0))


def _check_kl(kl, device) -> torch.Tensor | float:
    if isinstance(kl, torch.Tensor):
        if kl.numel() != 1 or not kl.is_floating_point():
            raise ValueError(f"kl must be a number or a one-element float tensor, got shape {tuple(kl.shape)}")
        return kl.detach().reshape(()).to(device=device, dtype=torch.float32)
    return check_number(kl, "kl")


def _check_labels(preference_labels, num_rows, device) -> torch.Tensor:
    """(R,) bool, or 0/1 integers: any other value (a 2, a 0.5) would silently pick a side."""
    if not isinstance(preference_labels, torch.Tensor):
        raise TypeError(f"preference_labels must be a torch.Tensor, got {type(preference_labels).__name__}")
    if preference_labels.is_floating_point() or preference_labels.is_complex():
        raise ValueError(f"preference_labels has dtype {preference_labels.dtype}, expected torch.bool (or 0/1 ints)")
    if tuple(preference_labels.shape) != (num_rows,):
        raise ValueError(f"preference_labels has shape {tuple(preference_labels.shape)}, expected ({num_rows},)")
    if preference_labels.device != device:
        raise ValueError(f"preference_labels is on {preference_labels.device}, expected {device} (input's device)")
    # Eager mode reads the values back (one device-to-host sync, as the target check makes); under
    # torch.compile a data-dependent check cannot raise, and a nonzero label counts as desirable.
    if preference_labels.dtype != torch.bool and not torch.compiler.is_compiling():
        outside = (preference_labels != 0) & (preference_labels != 1)
        if outside.any().item():
            value = preference_labels[outside][0].item()
            raise ValueError(f"preference_labels holds {value}: labels are bool, or 0/1 integers")
    return preference_labels.bool()


def _kto_formula(logps, mask, *, ref, desirable, beta, kl, desirable_weight, undesirable_weight, average):
    """KTO from the token log-probs (R, T): the one formula of both paths."""
    seq = sequence_logps(logps, mask, average)  # (R,) ℓ
    log_ratio = seq if ref is None else seq - ref  # (R,) u
    per_row = torch.where(
        desirable,
        desirable_weight * (1.0 - torch.sigmoid(beta * (log_ratio - kl))),
        undesirable_weight * (1.0 - torch.sigmoid(beta * (kl - log_ratio))),
    )
    return LossOutput(loss=per_row.mean(), logps=metric(seq), rewards=metric(beta * log_ratio))


def kto_loss(
    input, linear_weight, target, preference_labels, *,
    beta=0.1, kl=0.0, desirable_weight=1.0, undesirable_weight=1.0, average_log_prob=False,
    ref_input=None, ref_linear_weight=None, ref_linear_bias=None, ref_logps=None,
    linear_bias=None, ignore_index=-100, temperature=1.0, softcap=None, logit_scale=1.0, config=None,
) -> LossOutput:
    """KTO over ``R`` unpaired rows; ``preference_labels`` (R,) says which are desirable.

    The reference comes from ``ref_input``/``ref_linear_weight``/``ref_linear_bias`` (no gradient,
    same head options, averaged like the policy), or from per-row ``ref_logps`` (R,) as given; with
    neither it is 0. Returns ``LossOutput(loss, logps, rewards)``: ``logps`` = ℓ (R,), ``rewards`` = β·u (R,).
    """
    beta, desirable_weight, undesirable_weight = kto_options(beta, desirable_weight, undesirable_weight,
                                                             average_log_prob)
    num_rows, _ = check_policy(input, linear_weight, target)
    if num_rows == 0:
        raise ValueError("input has 0 rows")
    desirable = _check_labels(preference_labels, num_rows, input.device)
    kl = _check_kl(kl, input.device)
    head = head_keywords(linear_bias, temperature, softcap, logit_scale, ignore_index)
    ref = reference_logps(
        target, head, average_log_prob, ref_input=ref_input, ref_linear_weight=ref_linear_weight,
        ref_linear_bias=ref_linear_bias, ref_logps=ref_logps, vocab=linear_weight.shape[0], device=input.device,
    )
    formula = partial(_kto_formula, ref=ref, desirable=desirable, beta=beta, kl=kl,
                      desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                      average=average_log_prob)
    return evaluate(input, linear_weight, target, head, formula, paired=False, config=config)
