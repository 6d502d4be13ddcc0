r"""Divergences between two log-probability tensors, one elementwise pass each way (jsd, tvd).

Both losses are, per row of student log-probabilities ``s`` and teacher log-probabilities ``t``,
a sum over the vocabulary of a per-element term, and their gradients to the student are per-element
too (no row reduction). So one pair of kernels serves both, specialised at compile time by ``MODE``:

    FORWARD_KL  P_t·(t − s)                 ∂/∂s = −P_t                       (jsd, β = 0)
    REVERSE_KL  P_s·(s − t)                 ∂/∂s = P_s·(s − t + 1)            (jsd, β = 1)
    MIXED       β·P_t(t − log M) + (1−β)·P_s(s − log M)                       (jsd, 0 < β < 1)
                                            ∂/∂s = (1 − β)·P_s·(s − log M)
    TVD         ½|P_s − P_t|                ∂/∂s = ½·sign(P_s − P_t)·P_s

(jsd.py and tvd.py derive each line.) A term whose probability is exactly 0 contributes 0, so -inf
log-probabilities (a masked vocabulary) and padding lanes loaded as -inf give 0, never 0·inf.

The kernels tile the ``(rows, V)`` views with :func:`elementwise_tile_launch` (``elementwise_tiles``),
read any strides in place, and treat a row whose label is ``ignore_index`` as all -inf (loss 0, gradient 0). The forward
sums the loss per tile into fp32 partials added up in a fixed order (deterministic); the mean's
denominator is the number of counted rows (at least 1, so a batch with every row ignored gives 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon._kernels.elementwise_tiles import elementwise_tile_launch, tile_indices
from tigon._kernels.fp32_math import as_fp32
from tigon._kernels.inputs import as_rows, check_tensor
from tigon._kernels.launch import wrap_triton

INDEX_DTYPES = (torch.int64, torch.int32)

# MODE: which formula the kernels specialise to (compile-time variants: the ends of the JSD are
# different functions, not just different numbers).
FORWARD_KL, REVERSE_KL, MIXED, TVD = 0, 1, 2, 3


def beta_mode(beta: float) -> int:
    """The JSD's mode for ``beta``."""
    return FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else MIXED


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def jsd_terms(s, t, beta, BETA_MODE: tl.constexpr):
    """Per element (fp32): (loss term, ∂loss/∂s, P_s) of the JSD for log-probabilities s, t.

    Values a caller does not use are removed by the compiler (fused_linear_jsd uses P_s).
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
def _terms(s, t, beta, MODE: tl.constexpr):
    """Per element (fp32): (loss term, ∂loss/∂s) of the divergence ``MODE``."""
    if MODE == 3:
        p_s = tl.exp(s)
        difference = p_s - tl.exp(t)
        loss = 0.5 * tl.abs(difference)
        # |x|' = sign(x), 0 at 0 as torch's abs backward
        sign = tl.where(difference > 0.0, 1.0, tl.where(difference < 0.0, -1.0, 0.0))
        grad = 0.5 * sign * p_s
    else:
        loss, grad, _p_s = jsd_terms(s, t, beta, MODE)
    return loss, grad


@triton.jit
def _load_log_probs(
    student_ptr, student_row_stride, student_col_stride, teacher_ptr, teacher_row_stride, teacher_col_stride,
    labels_ptr, labels_stride, rows, cols, num_rows, num_cols, ignore_index,
    HAS_LABELS: tl.constexpr,
):
    """One tile of s and t (fp32, -inf in padding and ignored rows)."""
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
    return s, t


@triton.jit
def divergence_fwd_kernel(
    student_ptr, student_row_stride, student_col_stride,    # (R, V) student log-probs, any strides
    teacher_ptr, teacher_row_stride, teacher_col_stride,    # (R, V) teacher log-probs, any strides
    labels_ptr, labels_stride,                              # (R,) ints                      [HAS_LABELS]
    partial_ptr,                                            # (programs,) out, fp32: Σ loss over the tile
    num_rows, num_cols, col_tiles, beta, ignore_index,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, HAS_LABELS: tl.constexpr,
):
    beta = as_fp32(beta)
    pid = tl.program_id(0)
    rows, cols = tile_indices(pid, col_tiles, BLOCK_M, BLOCK_N)
    s, t = _load_log_probs(
        student_ptr, student_row_stride, student_col_stride,
        teacher_ptr, teacher_row_stride, teacher_col_stride,
        labels_ptr, labels_stride, rows, cols, num_rows, num_cols, ignore_index, HAS_LABELS,
    )
    loss, _grad = _terms(s, t, beta, MODE)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(loss, axis=1), axis=0))


@triton.jit
def divergence_bwd_kernel(
    student_ptr, student_row_stride, student_col_stride,    # (R, V) student log-probs, any strides
    teacher_ptr, teacher_row_stride, teacher_col_stride,    # (R, V) teacher log-probs, any strides
    labels_ptr, labels_stride,                              # (R,) ints                      [HAS_LABELS]
    scale_ptr,                                              # () fp32: upstream gradient / counted rows
    dstudent_ptr,                                           # (R, V) out, contiguous
    num_rows, num_cols, col_tiles, beta, ignore_index,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, HAS_LABELS: tl.constexpr,
):
    beta = as_fp32(beta)
    pid = tl.program_id(0)
    rows, cols = tile_indices(pid, col_tiles, BLOCK_M, BLOCK_N)
    s, t = _load_log_probs(
        student_ptr, student_row_stride, student_col_stride,
        teacher_ptr, teacher_row_stride, teacher_col_stride,
        labels_ptr, labels_stride, rows, cols, num_rows, num_cols, ignore_index, HAS_LABELS,
    )
    _loss, grad = _terms(s, t, beta, MODE)
    grad = grad * tl.load(scale_ptr)
    out_mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    # ignored rows loaded as -inf, so their gradient is 0 and is stored like any other
    tl.store(
        dstudent_ptr + rows[:, None] * num_cols + cols[None, :], grad.to(dstudent_ptr.dtype.element_ty),
        mask=out_mask,
    )


# ------------------------------------------------------------------------------------------ launchers


def rows_counted(labels, num_rows, ignore_index, device):
    """The mean's denominator as an fp32 device scalar: non-ignored rows (at least 1, so 0/1 = 0)."""
    if labels is None:
        return torch.full((), float(max(num_rows, 1)), dtype=torch.float32, device=device)
    return (labels != ignore_index).sum().clamp(min=1).to(torch.float32)


def _kernel_args(student, teacher, labels):
    s2, t2 = as_rows(student), as_rows(teacher)
    l1 = labels.reshape(-1) if labels is not None else s2
    return (s2, s2.stride(0), s2.stride(1), t2, t2.stride(0), t2.stride(1), l1,
            l1.stride(0) if labels is not None else 0), s2.shape


def divergence_forward(student, teacher, labels, mode, beta, ignore_index):
    """(mean loss, denominator), both fp32 device scalars."""
    args, (num_rows, num_cols) = _kernel_args(student, teacher, labels)
    denominator = rows_counted(labels, num_rows, ignore_index, student.device)
    cfg = elementwise_tile_launch(num_rows, num_cols)
    programs = cfg.programs if student.numel() > 0 else 0
    partial = torch.empty(programs, dtype=torch.float32, device=student.device)
    if student.numel() > 0:
        wrap_triton(divergence_fwd_kernel)[(cfg.programs,)](
            *args, partial, num_rows, num_cols, cfg.col_tiles, beta, ignore_index,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MODE=mode, HAS_LABELS=labels is not None,
            num_warps=cfg.num_warps,
        )
    return partial.sum() / denominator, denominator


def divergence_backward(grad, student, teacher, labels, denominator, mode, beta, ignore_index):
    """∂loss/∂student (student's dtype, contiguous) for the upstream gradient ``grad``."""
    dstudent = torch.empty(student.shape, dtype=student.dtype, device=student.device)
    if student.numel() == 0:
        return dstudent
    args, (num_rows, num_cols) = _kernel_args(student, teacher, labels)
    scale = grad.to(torch.float32) / denominator
    cfg = elementwise_tile_launch(num_rows, num_cols)
    wrap_triton(divergence_bwd_kernel)[(cfg.programs,)](
        *args, scale, dstudent, num_rows, num_cols, cfg.col_tiles, beta, ignore_index,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MODE=mode, HAS_LABELS=labels is not None,
        num_warps=cfg.num_warps,
    )
    return dstudent


# ---------------------------------------------------------------------------------------------- checks


def check_pair(student, teacher, labels):
    """Student and teacher log-probabilities ``[..., V]`` of one shape and device, and their labels."""
    check_tensor(student, "student_logprobs")
    check_tensor(teacher, "teacher_logprobs", device=student.device)
    if student.dim() == 0:
        raise ValueError("student_logprobs must have at least one dimension (the vocabulary is the last)")
    if teacher.shape != student.shape:
        raise ValueError(
            f"teacher_logprobs has shape {tuple(teacher.shape)}, expected student_logprobs' {tuple(student.shape)}"
        )
    check_labels(labels, student.shape[:-1], student.device)


def check_labels(labels, leading_shape, device, name="labels"):
    """Labels, when given, must be integer row labels shaped like the inputs' leading dims."""
    if labels is None:
        return
    check_tensor(labels, name, dtypes=INDEX_DTYPES, device=device)
    if tuple(labels.shape) != tuple(leading_shape):
        raise ValueError(f"{name} has shape {tuple(labels.shape)}, expected {tuple(leading_shape)}")
