"""What every post-training loss shares: the returned :class:`LossOutput`, the token and sequence
log-probabilities through the fused head, the reference log-probabilities, and argument checks.

Every loss is a few lines of fp32 torch over the ``[R, T]`` token log-probabilities that
:func:`tigon.ops.fused_linear_logprobs` returns (0 at ignored positions, gradient into ``input``,
``linear_weight`` and ``linear_bias``); the head never holds the ``[R·T, V]`` logits.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from tigon.ops.fused_linear_logprobs import fused_linear_logprobs


class LossOutput(NamedTuple):
    """A loss and its metrics.

    ``loss`` is a float32 scalar that back-propagates into the policy's ``input``,
    ``linear_weight`` and ``linear_bias``; every other field is a detached float32 metric, or None
    where the loss does not define it (API.md lists which loss returns which).
    """

    loss: torch.Tensor
    chosen_logps: torch.Tensor | None = None       # (B,) sequence log-probs of the chosen rows
    rejected_logps: torch.Tensor | None = None     # (B,) sequence log-probs of the rejected rows
    chosen_rewards: torch.Tensor | None = None     # (B,) β(ℓc − ℓc_ref)                       [DPO]
    rejected_rewards: torch.Tensor | None = None   # (B,) β(ℓr − ℓr_ref)                       [DPO]
    nll: torch.Tensor | None = None                # () NLL of the chosen rows          [DPO, ORPO, CPO]
    log_odds_ratio: torch.Tensor | None = None     # () mean logσ(log_odds)                   [ORPO]
    logps: torch.Tensor | None = None              # (R,) sequence [KTO]; (R, T) per token [GRPO]
    rewards: torch.Tensor | None = None            # (R,) β(ℓ − ℓ_ref)                         [KTO]
    clip_ratio: torch.Tensor | None = None         # () share of counted tokens clipped        [GRPO]
    kl: torch.Tensor | None = None                 # () mean per-token KL to the reference     [GRPO]


def metric(t: torch.Tensor) -> torch.Tensor:
    """A metric as returned: detached, float32."""
    return t.detach().to(torch.float32)


# ------------------------------------------------------------------------------------- argument checks


def check_number(value, name: str, *, minimum=None, positive=False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    # not math.isfinite: under torch.compile a float option may be traced, and dynamo does not trace
    # math.isfinite on it (torch 2.11); NaN is the one value unequal to itself
    if value != value or abs(value) == math.inf:
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and not value > 0.0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    if minimum is not None and not value >= minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value!r}")
    return value


def check_flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(value, name: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_policy(input, linear_weight, target) -> tuple[int, int]:
    """``input`` (R, T, H) and ``target`` (R, T) integer ids; returns (R, T). The head checks the rest."""
    for t, name in ((input, "input"), (linear_weight, "linear_weight"), (target, "target")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if input.dim() != 3:
        raise ValueError(f"input must be (R, T, H) hidden states, got shape {tuple(input.shape)}")
    if tuple(target.shape) != tuple(input.shape[:2]):
        raise ValueError(f"target has shape {tuple(target.shape)}, expected input's (R, T) {tuple(input.shape[:2])}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target has dtype {target.dtype}, expected torch.int64 or torch.int32")
    return input.shape[0], input.shape[1]


def check_rows(t, name: str, shape: tuple[int, ...], device) -> None:
    """A float tensor of exactly ``shape`` on ``device`` (per-row or per-token values a caller passes)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} has dtype {t.dtype}, expected a floating dtype")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (input's device)")


def check_paired(num_rows: int) -> int:
    """Chosen rows first, then rejected: R must be even; returns B = R // 2."""
    if num_rows == 0 or num_rows % 2:
        raise ValueError(
            f"input has {num_rows} rows: paired losses take chosen rows then rejected rows (a positive, even R)"
        )
    return num_rows // 2


# --------------------------------------------------------------------------------------- log-probs


def head_keywords(linear_bias, temperature, softcap, logit_scale, ignore_index) -> dict:
    return {
        "linear_bias": linear_bias, "temperature": temperature, "softcap": softcap,
        "logit_scale": logit_scale, "ignore_index": ignore_index,
    }


def token_logps(input, linear_weight, target, head: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p of each target token (R, T) fp32, 0 where ignored; counted-token mask (R, T) bool)."""
    logps, _ = fused_linear_logprobs(input, linear_weight, target, **head)
    return logps, target != head["ignore_index"]


def sequence_logps(logps: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """ℓ_i = Σ_t logp_it over counted tokens (R,), divided by their count when ``average``.

    A row without counted tokens has ℓ = 0 (its count is taken as 1).
    """
    total = logps.sum(-1)  # (R,) the head's log-probs are 0 at ignored positions
    if not average:
        return total
    return total / mask.sum(-1).clamp(min=1).to(torch.float32)


def chosen_nll(logps: torch.Tensor, mask: torch.Tensor, num_chosen: int) -> torch.Tensor:
    """−(Σ logp over the counted tokens of the chosen rows 0..B−1) / (their count)."""
    return -logps[:num_chosen].sum() / mask[:num_chosen].sum().clamp(min=1).to(torch.float32)


def _check_reference_model(ref_input, ref_linear_weight, ref_linear_bias, target, vocab, device) -> None:
    """The reference's hidden states (R, T, H') and head (V, H') (and bias (V,)): the policy's rows,
    tokens and vocabulary, on its device; its hidden size may differ."""
    for t, name in ((ref_input, "ref_input"), (ref_linear_weight, "ref_linear_weight"),
                    (ref_linear_bias, "ref_linear_bias")):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} (input's device)")
    if ref_input.dim() != 3 or ref_input.shape[:2] != target.shape:
        raise ValueError(
            f"ref_input has shape {tuple(ref_input.shape)}, expected (R, T, H) with (R, T) = {tuple(target.shape)}"
        )
    if tuple(ref_linear_weight.shape) != (vocab, ref_input.shape[-1]):
        raise ValueError(
            f"ref_linear_weight has shape {tuple(ref_linear_weight.shape)}, expected ({vocab}, {ref_input.shape[-1]})"
        )
    if ref_linear_bias is not None and tuple(ref_linear_bias.shape) != (vocab,):
        raise ValueError(f"ref_linear_bias has shape {tuple(ref_linear_bias.shape)}, expected ({vocab},)")


def reference_logps(
    target, head: dict, average: bool, *, ref_input, ref_linear_weight, ref_linear_bias, ref_logps, vocab, device,
) -> torch.Tensor | None:
    """The reference's sequence log-probs (R,) fp32, or None when no reference is given.

    From the reference model's hidden states and head: no gradient, the same targets and head
    options, averaged exactly when the policy's are. Or ``ref_logps`` (R,), used as given.
    """
    num_rows = target.shape[0]
    has_model = ref_input is not None or ref_linear_weight is not None
    if ref_linear_bias is not None and not has_model:
        raise ValueError("ref_linear_bias was given without ref_input and ref_linear_weight")
    if has_model and (ref_input is None or ref_linear_weight is None):
        missing = "ref_linear_weight" if ref_input is not None else "ref_input"
        raise ValueError(f"{missing} is missing: the reference model needs both ref_input and ref_linear_weight")
    if has_model and ref_logps is not None:
        raise ValueError("ref_logps was given together with ref_input: pass one reference, not both")
    if ref_logps is not None:
        check_rows(ref_logps, "ref_logps", (num_rows,), device)
        return ref_logps.detach().to(torch.float32)
    if not has_model:
        return None
    _check_reference_model(ref_input, ref_linear_weight, ref_linear_bias, target, vocab, device)
    with torch.no_grad():
        logps, mask = token_logps(ref_input, ref_linear_weight, target, {**head, "linear_bias": ref_linear_bias})
        return sequence_logps(logps, mask, average)
