r"""Generalised Jensen-Shannon divergence between two log-probability tensors, in Triton.

Per row, with student log-probabilities :math:`s` and teacher log-probabilities :math:`t` over the
last dim (``P_s = exp(s)``, ``P_t = exp(t)``), for ``0 < β < 1``::

    M     = β·P_t + (1 − β)·P_s
    JSD   = β·KL(P_t ‖ M) + (1 − β)·KL(P_s ‖ M)
          = Σ_v β·P_t·(t − log M) + (1 − β)·P_s·(s − log M)

The formula vanishes at the ends, so these are special-cased, as the API promises::

    β = 0    KL(P_t ‖ P_s) = Σ_v P_t·(t − s)          (forward KL)
    β = 1    KL(P_s ‖ P_t) = Σ_v P_s·(s − t)          (reverse KL)

The loss is the mean of the row values over the rows, or over the rows whose label is not
``ignore_index`` when ``labels`` are given (a batch with every row ignored gives 0, with zero
gradient). Terms whose probability is exactly 0 contribute 0 (so -inf log-probabilities, a masked
vocabulary, are fine).

Backward, to the student only (``s`` taken as free log-probabilities, as autograd does through the
formula), per element, before the 1/rows scale::

    0 < β < 1   ∂/∂s = (1 − β)·P_s·(s − log M)        (the ∂M/∂s terms cancel: Σ (β P_t + (1−β) P_s)/M = 1)
    β = 0       ∂/∂s = −P_t
    β = 1       ∂/∂s = P_s·(s − t + 1)

No row reduction is needed, so the backward is one elementwise pass, like the forward; both tile
the ``(rows, V)`` views with the KL kernels' :func:`elementwise_tile_launch` (``tigon._kernels``), read
any strides in place, and sum the loss per tile into fp32 partials added up in a fixed order
(deterministic). The loss is fp32.

:func:`tigon._kernels.jsd_terms` (the per-element loss and gradient) is shared with
``fused_linear_jsd``; the kernels and launchers with ``tvd`` (``tigon._kernels.divergence_rows``).

Bytes (speed of light), R rows of V, element size b::

    forward   read s and t R·V·b each
    backward  read s and t R·V·b each; write ∂s R·V·b

Reference: :func:`jsd_reference` (the formula above in PyTorch, fp32 or fp64).
"""

from __future__ import annotations

import math

import torch

from tigon._kernels import (
    TigonOp,
    beta_mode,
    check_int,
    check_pair,
    check_real,
    divergence_backward,
    divergence_forward,
)

# ------------------------------------------------------------------------------- torch ops + autograd


def _jsd_impl(
    student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor | None, beta: float, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return divergence_forward(student, teacher, labels, beta_mode(beta), beta, ignore_index)


def _jsd_backward_impl(
    grad: torch.Tensor,
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor | None,
    denominator: torch.Tensor,
    beta: float,
    ignore_index: int,
) -> torch.Tensor:
    return divergence_backward(grad, student, teacher, labels, denominator, beta_mode(beta), beta, ignore_index)


JSD_BACKWARD = TigonOp("jsd_backward", _jsd_backward_impl)


def _setup_jsd(ctx, inputs, output):
    student, teacher, labels, beta, ignore_index = inputs
    _loss, denominator = output
    ctx.save_for_backward(student, teacher, labels, denominator)
    ctx.beta, ctx.ignore_index = beta, ignore_index
    ctx.mark_non_differentiable(denominator)


def _jsd_grad(ctx, grad, _ddenominator):
    student, teacher, labels, denominator = ctx.saved_tensors
    dstudent = JSD_BACKWARD(grad, student, teacher, labels, denominator, ctx.beta, ctx.ignore_index)
    return dstudent, None, None, None, None


JSD = TigonOp("jsd", _jsd_impl, setup_context=_setup_jsd, backward=_jsd_grad)


# ------------------------------------------------------------------------------------- public function


def check_beta(beta):
    check_real(beta, "beta", minimum=0.0, maximum=1.0)


def jsd(student_logprobs, teacher_logprobs, *, beta=0.5, labels=None, ignore_index=-100):
    """Generalised JSD of two log-probability tensors ``[..., V]``; see the module docstring.

    Mean over rows (over rows whose label is not ``ignore_index`` when ``labels`` ``[...]`` are
    given). ``beta=0`` is KL(teacher ‖ student), ``beta=1`` KL(student ‖ teacher). The loss is an
    fp32 scalar; the gradient goes to the student only.
    """
    check_pair(student_logprobs, teacher_logprobs, labels)
    check_beta(beta)
    check_int(ignore_index, "ignore_index")
    loss, _ = JSD(student_logprobs, teacher_logprobs, labels, float(beta), int(ignore_index))
    return loss


# ------------------------------------------------------------------------------------------ reference


def jsd_reference(student_logprobs, teacher_logprobs, *, beta=0.5, labels=None, ignore_index=-100):
    """The module docstring's formula in PyTorch, fp32 (fp64 for fp64 inputs); teacher detached."""
    wide = torch.float64 if student_logprobs.dtype == torch.float64 else torch.float32
    s = student_logprobs.to(wide)
    t = teacher_logprobs.detach().to(wide)
    p_s, p_t = s.exp(), t.exp()
    if beta == 0.0:
        rows = torch.where(p_t > 0, p_t * (t - s), 0.0).sum(-1)
    elif beta == 1.0:
        rows = torch.where(p_s > 0, p_s * (s - t), 0.0).sum(-1)
    else:
        log_m = torch.logaddexp(t + math.log(beta), s + math.log(1.0 - beta))
        rows = (
            beta * torch.where(p_t > 0, p_t * (t - log_m), 0.0)
            + (1.0 - beta) * torch.where(p_s > 0, p_s * (s - log_m), 0.0)
        ).sum(-1)
    if labels is None:
        return rows.sum() / max(rows.numel(), 1)
    keep = labels != ignore_index
    return torch.where(keep, rows, 0.0).sum() / keep.sum().clamp(min=1)
