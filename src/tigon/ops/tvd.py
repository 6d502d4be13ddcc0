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
``(rows, V)`` views, tiled with the KL kernels' :func:`tile_launch` and reading any strides in
place (the tile loader is JSD's). The forward sums the loss per tile into fp32 partials added up in
a fixed order (deterministic). The loss is fp32.

Bytes (speed of light), R rows of V, element size b::

    forward   read s and t R·V·b each
    backward  read s and t R·V·b each; write ∂s R·V·b

Reference: :func:`tvd_reference` (the formula above in PyTorch, fp32 or fp64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon.ops._common import as_rows, check_tensor
from tigon.ops._launch import TigonOp, wrap_triton
from tigon.ops._tiles import tile_indices, tile_launch
from tigon.ops.jsd import _load_log_probs, _rows_counted, check_labels

# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _tvd_terms(s, t):
    """Per element (fp32): (½|P_s − P_t|, ½·sign(P_s − P_t)·P_s). -inf lanes give P = 0, so 0 and 0."""
    p_s = tl.exp(s)
    p_t = tl.exp(t)
    difference = p_s - p_t
    loss = 0.5 * tl.abs(difference)
    sign = tl.where(difference > 0.0, 1.0, tl.where(difference < 0.0, -1.0, 0.0))
    grad = 0.5 * sign * p_s
    return loss, grad


@triton.jit
def tvd_fwd_kernel(
    student_ptr, student_row_stride, student_col_stride,    # (R, V) student log-probs, any strides
    teacher_ptr, teacher_row_stride, teacher_col_stride,    # (R, V) teacher log-probs, any strides
    labels_ptr, labels_stride,                              # (R,) ints                      [HAS_LABELS]
    partial_ptr,                                            # (programs,) out, fp32: Σ loss over the tile
    num_rows, num_cols, col_tiles, ignore_index,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LABELS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows, cols = tile_indices(pid, col_tiles, BLOCK_M, BLOCK_N)
    s, t, _mask = _load_log_probs(
        student_ptr, student_row_stride, student_col_stride,
        teacher_ptr, teacher_row_stride, teacher_col_stride,
        labels_ptr, labels_stride, rows, cols, num_rows, num_cols, ignore_index, HAS_LABELS,
    )
    loss, _grad = _tvd_terms(s, t)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(loss, axis=1), axis=0))


@triton.jit
def tvd_bwd_kernel(
    student_ptr, student_row_stride, student_col_stride,    # (R, V) student log-probs, any strides
    teacher_ptr, teacher_row_stride, teacher_col_stride,    # (R, V) teacher log-probs, any strides
    labels_ptr, labels_stride,                              # (R,) ints                      [HAS_LABELS]
    scale_ptr,                                              # () fp32: upstream gradient / counted rows
    dstudent_ptr,                                           # (R, V) out, contiguous
    num_rows, num_cols, col_tiles, ignore_index,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LABELS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows, cols = tile_indices(pid, col_tiles, BLOCK_M, BLOCK_N)
    s, t, _mask = _load_log_probs(
        student_ptr, student_row_stride, student_col_stride,
        teacher_ptr, teacher_row_stride, teacher_col_stride,
        labels_ptr, labels_stride, rows, cols, num_rows, num_cols, ignore_index, HAS_LABELS,
    )
    _loss, grad = _tvd_terms(s, t)
    grad = grad * tl.load(scale_ptr)
    out_mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    # ignored rows loaded as -inf, so their gradient is 0 and is stored like any other
    tl.store(
        dstudent_ptr + rows[:, None] * num_cols + cols[None, :], grad.to(dstudent_ptr.dtype.element_ty),
        mask=out_mask,
    )


# ------------------------------------------------------------------------------------------ launchers


def _kernel_args(student, teacher, labels):
    s2, t2 = as_rows(student), as_rows(teacher)
    l1 = labels.reshape(-1) if labels is not None else s2
    return s2, t2, l1, (l1.stride(0) if labels is not None else 0)


def _forward(student, teacher, labels, ignore_index):
    s2, t2, l1, l_stride = _kernel_args(student, teacher, labels)
    num_rows, num_cols = s2.shape
    denominator = _rows_counted(labels, num_rows, ignore_index, student.device)
    cfg = tile_launch(num_rows, num_cols)
    programs = cfg.programs if student.numel() > 0 else 0
    partial = torch.empty(programs, dtype=torch.float32, device=student.device)
    if student.numel() > 0:
        wrap_triton(tvd_fwd_kernel)[(cfg.programs,)](
            s2, s2.stride(0), s2.stride(1),
            t2, t2.stride(0), t2.stride(1),
            l1, l_stride,
            partial,
            num_rows, num_cols, cfg.col_tiles, ignore_index,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_LABELS=labels is not None,
            num_warps=cfg.num_warps,
        )
    return partial.sum() / denominator, denominator


def _backward(grad, student, teacher, labels, denominator, ignore_index):
    dstudent = torch.empty(student.shape, dtype=student.dtype, device=student.device)
    if student.numel() == 0:
        return dstudent
    s2, t2, l1, l_stride = _kernel_args(student, teacher, labels)
    num_rows, num_cols = s2.shape
    scale = grad.to(torch.float32) / denominator
    cfg = tile_launch(num_rows, num_cols)
    wrap_triton(tvd_bwd_kernel)[(cfg.programs,)](
        s2, s2.stride(0), s2.stride(1),
        t2, t2.stride(0), t2.stride(1),
        l1, l_stride,
        scale, dstudent,
        num_rows, num_cols, cfg.col_tiles, ignore_index,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_LABELS=labels is not None,
        num_warps=cfg.num_warps,
    )
    return dstudent


# ------------------------------------------------------------------------------- torch ops + autograd


def _tvd_impl(
    student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor | None, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(student, teacher, labels, ignore_index)


def _tvd_backward_impl(
    grad: torch.Tensor,
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor | None,
    denominator: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    return _backward(grad, student, teacher, labels, denominator, ignore_index)


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
