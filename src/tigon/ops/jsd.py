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
the ``(rows, V)`` views with the KL kernels' :func:`tile_launch` (``_tiles``), read any strides in place, and sum
the loss per tile into fp32 partials added up in a fixed order (deterministic). The loss is fp32.

:func:`_jsd_terms` (the per-element loss and gradient) is shared with ``fused_linear_jsd``.

Bytes (speed of light), R rows of V, element size b::

    forward   read s and t R·V·b each
    backward  read s and t R·V·b each; write ∂s R·V·b

Reference: :func:`jsd_reference` (the formula above in PyTorch, fp32 or fp64).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tigon.ops._common import as_fp32, as_rows, check_tensor
from tigon.ops._launch import TigonOp, wrap_triton
from tigon.ops._tiles import tile_indices, tile_launch

INDEX_DTYPES = (torch.int64, torch.int32)

# BETA_MODE: which formula the kernels specialise to (the ends are different functions, not just
# different numbers, so they are compile-time variants).
FORWARD_KL, REVERSE_KL, MIXED = 0, 1, 2


def beta_mode(beta: float) -> int:
    return FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else MIXED


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _jsd_terms(s, t, beta, BETA_MODE: tl.constexpr):
    """Per element (fp32): (loss term, ∂loss/∂s, P_s) for student/teacher log-probabilities s, t.

    A term with probability 0 is 0 (so -inf log-probabilities and padding lanes loaded as -inf give
    0, never 0·inf). Values a caller does not use are removed by the compiler.
    """
    p_s = tl.exp(s)
    p_t = tl.exp(t)
    if BETA_MODE == 0:
        loss = tl.where(p_t > 0.0, p_t * (t - s), 0.0)
        grad = -p_t
    elif BETA_MODE == 1:
        loss = tl.where(p_s > 0.0, p_s * (s - t), 0.0)
        grad = tl.where(p_s > 0.0, p_s * (s - t + 1.0), 0.0)
    else:
        log_m = tl.log(beta * p_t + (1.0 - beta) * p_s)
        student_term = tl.where(p_s > 0.0, p_s * (s - log_m), 0.0)
        teacher_term = tl.where(p_t > 0.0, p_t * (t - log_m), 0.0)
        loss = beta * teacher_term + (1.0 - beta) * student_term
        grad = (1.0 - beta) * student_term
    return loss, grad, p_s


@triton.jit
def _load_log_probs(
    student_ptr, student_row_stride, student_col_stride, teacher_ptr, teacher_row_stride, teacher_col_stride,
    labels_ptr, labels_stride, rows, cols, num_rows, num_cols, ignore_index,
    HAS_LABELS: tl.constexpr,
):
    """One tile of s and t (fp32, -inf in padding and ignored rows) and the rows' validity."""
    valid = rows < num_rows
    if HAS_LABELS:
        labels = tl.load(labels_ptr + rows * labels_stride, mask=valid, other=ignore_index)
        valid = valid & (labels != ignore_index)
    mask = valid[:, None] & (cols < num_cols)[None, :]
    s = tl.load(
        student_ptr + rows[:, None] * student_row_stride + cols[None, :] * student_col_stride,
        mask=mask, other=float("-inf"),
    ).to(tl.float32)
    t = tl.load(
        teacher_ptr + rows[:, None] * teacher_row_stride + cols[None, :] * teacher_col_stride,
        mask=mask, other=float("-inf"),
    ).to(tl.float32)
    return s, t, mask


@triton.jit
def jsd_fwd_kernel(
    student_ptr, student_row_stride, student_col_stride,    # (R, V) student log-probs, any strides
    teacher_ptr, teacher_row_stride, teacher_col_stride,    # (R, V) teacher log-probs, any strides
    labels_ptr, labels_stride,                              # (R,) ints                      [HAS_LABELS]
    partial_ptr,                                            # (programs,) out, fp32: Σ loss over the tile
    num_rows, num_cols, col_tiles, beta, ignore_index,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BETA_MODE: tl.constexpr, HAS_LABELS: tl.constexpr,
):
    beta = as_fp32(beta)
    pid = tl.program_id(0)
    rows, cols = tile_indices(pid, col_tiles, BLOCK_M, BLOCK_N)
    s, t, _mask = _load_log_probs(
        student_ptr, student_row_stride, student_col_stride,
        teacher_ptr, teacher_row_stride, teacher_col_stride,
        labels_ptr, labels_stride, rows, cols, num_rows, num_cols, ignore_index, HAS_LABELS,
    )
    loss, _grad, _p_s = _jsd_terms(s, t, beta, BETA_MODE)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(loss, axis=1), axis=0))


@triton.jit
def jsd_bwd_kernel(
    student_ptr, student_row_stride, student_col_stride,    # (R, V) student log-probs, any strides
    teacher_ptr, teacher_row_stride, teacher_col_stride,    # (R, V) teacher log-probs, any strides
    labels_ptr, labels_stride,                              # (R,) ints                      [HAS_LABELS]
    scale_ptr,                                              # () fp32: upstream gradient / counted rows
    dstudent_ptr,                                           # (R, V) out, contiguous
    num_rows, num_cols, col_tiles, beta, ignore_index,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BETA_MODE: tl.constexpr, HAS_LABELS: tl.constexpr,
):
    beta = as_fp32(beta)
    pid = tl.program_id(0)
    rows, cols = tile_indices(pid, col_tiles, BLOCK_M, BLOCK_N)
    s, t, mask = _load_log_probs(
        student_ptr, student_row_stride, student_col_stride,
        teacher_ptr, teacher_row_stride, teacher_col_stride,
        labels_ptr, labels_stride, rows, cols, num_rows, num_cols, ignore_index, HAS_LABELS,
    )
    _loss, grad, _p_s = _jsd_terms(s, t, beta, BETA_MODE)
    grad = grad * tl.load(scale_ptr)
    out_mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    # ignored rows loaded as -inf, so their gradient is 0 and is stored like any other
    tl.store(
        dstudent_ptr + rows[:, None] * num_cols + cols[None, :], grad.to(dstudent_ptr.dtype.element_ty),
        mask=out_mask,
    )


# ------------------------------------------------------------------------------------------ launchers


def _rows_counted(labels, num_rows, ignore_index, device):
    """The mean's denominator as an fp32 device scalar: non-ignored rows (at least 1, so 0/1 = 0)."""
    if labels is None:
        return torch.full((), float(max(num_rows, 1)), dtype=torch.float32, device=device)
    return (labels != ignore_index).sum().clamp(min=1).to(torch.float32)


def _kernel_args(student, teacher, labels):
    s2, t2 = as_rows(student), as_rows(teacher)
    l1 = labels.reshape(-1) if labels is not None else s2
    return s2, t2, l1, (l1.stride(0) if labels is not None else 0)


def _forward(student, teacher, labels, beta, ignore_index):
    s2, t2, l1, l_stride = _kernel_args(student, teacher, labels)
    num_rows, num_cols = s2.shape
    denominator = _rows_counted(labels, num_rows, ignore_index, student.device)
    cfg = tile_launch(num_rows, num_cols)
    programs = cfg.programs if student.numel() > 0 else 0
    partial = torch.empty(programs, dtype=torch.float32, device=student.device)
    if student.numel() > 0:
        wrap_triton(jsd_fwd_kernel)[(cfg.programs,)](
            s2, s2.stride(0), s2.stride(1),
            t2, t2.stride(0), t2.stride(1),
            l1, l_stride,
            partial,
            num_rows, num_cols, cfg.col_tiles, beta, ignore_index,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BETA_MODE=beta_mode(beta),
            HAS_LABELS=labels is not None,
            num_warps=cfg.num_warps,
        )
    return partial.sum() / denominator, denominator


def _backward(grad, student, teacher, labels, denominator, beta, ignore_index):
    dstudent = torch.empty(student.shape, dtype=student.dtype, device=student.device)
    if student.numel() == 0:
        return dstudent
    s2, t2, l1, l_stride = _kernel_args(student, teacher, labels)
    num_rows, num_cols = s2.shape
    scale = grad.to(torch.float32) / denominator
    cfg = tile_launch(num_rows, num_cols)
    wrap_triton(jsd_bwd_kernel)[(cfg.programs,)](
        s2, s2.stride(0), s2.stride(1),
        t2, t2.stride(0), t2.stride(1),
        l1, l_stride,
        scale, dstudent,
        num_rows, num_cols, cfg.col_tiles, beta, ignore_index,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BETA_MODE=beta_mode(beta), HAS_LABELS=labels is not None,
        num_warps=cfg.num_warps,
    )
    return dstudent


# ------------------------------------------------------------------------------- torch ops + autograd


def _jsd_impl(
    student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor | None, beta: float, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(student, teacher, labels, beta, ignore_index)


def _jsd_backward_impl(
    grad: torch.Tensor,
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor | None,
    denominator: torch.Tensor,
    beta: float,
    ignore_index: int,
) -> torch.Tensor:
    return _backward(grad, student, teacher, labels, denominator, beta, ignore_index)


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


def check_labels(labels, leading_shape, device, name="labels"):
    """Labels, when given, must be integer row labels shaped like the inputs' leading dims."""
    if labels is None:
        return
    check_tensor(labels, name, dtypes=INDEX_DTYPES, device=device)
    if tuple(labels.shape) != tuple(leading_shape):
        raise ValueError(f"{name} has shape {tuple(labels.shape)}, expected {tuple(leading_shape)}")


def check_beta(beta):
    if not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
        raise ValueError(f"beta must be a number in [0, 1], got {beta!r}")


def jsd(student_logprobs, teacher_logprobs, *, beta=0.5, labels=None, ignore_index=-100):
    """Generalised JSD of two log-probability tensors ``[..., V]``; see the module docstring.

    Mean over rows (over rows whose label is not ``ignore_index`` when ``labels`` ``[...]`` are
    given). ``beta=0`` is KL(teacher ‖ student), ``beta=1`` KL(student ‖ teacher). The loss is an
    fp32 scalar; the gradient goes to the student only.
    """
    check_tensor(student_logprobs, "student_logprobs")
    check_tensor(teacher_logprobs, "teacher_logprobs", device=student_logprobs.device)
    if student_logprobs.dim() == 0:
        raise ValueError("student_logprobs must have at least one dimension (the vocabulary is the last)")
    if teacher_logprobs.shape != student_logprobs.shape:
        raise ValueError(
            f"teacher_logprobs has shape {tuple(teacher_logprobs.shape)}, "
            f"expected student_logprobs' {tuple(student_logprobs.shape)}"
        )
    check_labels(labels, student_logprobs.shape[:-1], student_logprobs.device)
    check_beta(beta)
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
