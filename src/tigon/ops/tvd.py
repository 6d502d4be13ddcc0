r"""Total variation distance between two log-probability tensors, in Triton.

Per row, with student log-probabilities :math:`s` and teacher log-probabilities :math:`t` over the
last dim (``P_s = exp(s)``, ``P_t = exp(t)``)::

    TVD = ½ Σ_v |P_s − P_t|

The loss is the mean of the row values over the rows, or over the rows whose label is not
``ignore_index`` when ``labels`` are given (a batch with every row ignored gives 0, with zero
gradient). -inf log-probabilities (a masked vocabulary) are probabilities of 0 and are fine.

Backward, to the student only, per element, before the 1/rows scale. ``|x|`` has derivative
``sign(x)`` (0 at 0, as torch's ``abs`` backward), and ``∂P_s/∂s = P_s``::

    ∂TVD/∂s = ½ · sign(P_s − P_t) · P_s

No row reduction is needed, so forward and backward are one elementwise pass each over the
``(rows, V)`` views, reading any strides in place: the JSD's kernels and launchers
(``tigon._kernels.divergence_rows``) in their TVD mode. The forward sums the loss per tile into fp32 partials
added up in a fixed order (deterministic). The loss is fp32.

Bytes (speed of light), R rows of V, element size b::

    forward   read s and t R·V·b each
    backward  read s and t R·V·b each; write ∂s R·V·b

Reference: :func:`tvd_reference` (the formula above in PyTorch, fp32 or fp64).
"""

from __future__ import annotations

import torch

from tigon._kernels import TVD as TVD_MODE
from tigon._kernels import TigonOp, check_int, check_pair, divergence_backward, divergence_forward

# ------------------------------------------------------------------------------- torch ops + autograd


def _tvd_impl(
    student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor | None, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return divergence_forward(student, teacher, labels, TVD_MODE, 0.0, ignore_index)


def _tvd_backward_impl(
    grad: torch.Tensor,
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor | None,
    denominator: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    return divergence_backward(grad, student, teacher, labels, denominator, TVD_MODE, 0.0, ignore_index)


TVD_BACKWARD = TigonOp("tvd_backward", _tvd_backward_impl)


def _setup_tvd(ctx, inputs, output):
    student, teacher, labels, ignore_index = inputs
    _loss, denominator = output
    ctx.save_for_backward(student, teacher, labels, denominator)
    ctx.ignore_index = ignore_index
    ctx.mark_non_differentiable(denominator)


def _tvd_grad(ctx, grad, _ddenominator):
    student, teacher, labels, denominator = ctx.saved_tensors
    dstudent = TVD_BACKWARD(grad, student, teacher, labels, denominator, ctx.ignore_index)
    return dstudent, None, None, None


TVD = TigonOp("tvd", _tvd_impl, setup_context=_setup_tvd, backward=_tvd_grad)


# ------------------------------------------------------------------------------------- public function


def tvd(student_logprobs, teacher_logprobs, *, labels=None, ignore_index=-100):
    """Total variation distance ``½ Σ_v |P_s − P_t|`` of two log-probability tensors ``[..., V]``.

    Mean over rows (over rows whose label is not ``ignore_index`` when ``labels`` ``[...]`` are
    given). The loss is an fp32 scalar; the gradient goes to the student only. See the module
    docstring for the backward.
    """
    check_pair(student_logprobs, teacher_logprobs, labels)
    check_int(ignore_index, "ignore_index")
    loss, _ = TVD(student_logprobs, teacher_logprobs, labels, int(ignore_index))
    return loss


# ------------------------------------------------------------------------------------------ reference


def tvd_reference(student_logprobs, teacher_logprobs, *, labels=None, ignore_index=-100):
    """The module docstring's formula in PyTorch, fp32 (fp64 for fp64 inputs); teacher detached."""
    wide = torch.float64 if student_logprobs.dtype == torch.float64 else torch.float32
    p_s = student_logprobs.to(wide).exp()
    p_t = teacher_logprobs.detach().to(wide).exp()
    rows = 0.5 * (p_s - p_t).abs().sum(-1)
    if labels is None:
        return rows.sum() / max(rows.numel(), 1)
    keep = labels != ignore_index
    return torch.where(keep, rows, 0.0).sum() / keep.sum().clamp(min=1)
