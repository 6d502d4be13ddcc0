r"""Fused linear + JSD distillation loss: the student's and teacher's logits never exist whole.

Forward, for student hidden states ``x_s`` ``[N, Hs]`` with head ``W_s`` ``[V, Hs]``, and teacher
``x_t`` ``[N, Ht]``, ``W_t`` ``[V, Ht]``, temperature ``T``::

    z_s = x_s W_sᵀ,  z_t = x_t W_tᵀ                     (torch.matmul, in the io dtype)
    s   = log_softmax(z_s / T),  t = log_softmax(z_t / T)  (fp32)
    loss = jsd(s, t, beta, labels, ignore_index)        (tigon.ops.jsd: mean over counted rows)

Backward, to the student only. With ``g = ∂loss/∂s`` per element (``jsd.py``'s ``jsd_terms``,
already divided by the counted rows) and the log-softmax Jacobian ``∂s_j/∂z_i = (δ_ij − P_s,i)/T``::

    ∂loss/∂z_s = (g − P_s · Σ_v g) / T                  one more row reduction (Σ_v g)
    ∂x_s = ∂z_s W_s,    ∂W_s = Σ_chunks ∂z_sᵀ x_s

Tokens are processed in chunks of ``C`` rows (:func:`chunk_rows`): per chunk the two logit blocks
``[C, V]`` are formed by cuBLAS, one Triton program per row computes its loss and writes ``∂z_s``
over the student block in place, and two more matmuls turn it into this chunk's rows of ``∂x_s`` and
its share of ``∂W_s``. So the gradient is complete when the forward returns; the backward only
multiplies it by the upstream gradient (cross_entropy's lazy row scaling: rows that already hold the
factor, 1 usually, are skipped on the GPU). Peak extra memory:
two ``[C, V]`` blocks, ``∂x_s`` and ``∂W_s``. ``∂W_s`` is accumulated over chunks in the weight's
dtype by ``addmm`` (fp32 accumulation inside each matmul, one rounding per chunk).

The row kernel streams each row three times in ``block_v`` chunks: (1) the two log-sum-exps (an
online max/sum per chunk), (2) the row loss and ``Σ_v g``, (3) ``∂z_s``. Ignored rows skip (1)-(2)
and get a zero gradient.

Bytes (speed of light, besides the matmuls' own traffic), C·V logits per chunk, element size b::

    row kernel   read z_s and z_t 3 × C·V·b each (passes 2-3 mostly miss L2 at V = 128K); write ∂z_s C·V·b

Under ``torch.autocast`` inputs and weights are cast to the autocast dtype first, as ``F.linear``
casts them.

Reference: :func:`fused_linear_jsd_reference` (matmuls, ``log_softmax`` in fp32, ``jsd_reference``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tigon._kernels import (
    TigonOp,
    apply_grad_output,
    as_fp32,
    autocast_dtype,
    beta_mode,
    cdiv,
    check_int,
    check_labels,
    check_real,
    check_tensor,
    jsd_terms,
    next_power_of_2,
    rows_counted,
    wrap_triton,
)
from tigon.ops.jsd import check_beta, jsd_reference

# --------------------------------------------------------------------------------------------- kernel


@triton.jit
def _log_probs(row_ptr, cols, mask, inv_temperature, lse):
    """log_softmax(z/T) for one chunk of a row of logits, fp32 (-inf in padding lanes)."""
    return tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature - lse


@triton.jit
def fused_linear_jsd_row_kernel(
    student_ptr,        # (C, V) student logits in, ∂loss/∂logits out (in place), contiguous
    teacher_ptr,        # (C, V) teacher logits, contiguous
    labels_ptr,         # (C,) ints                                                    [HAS_LABELS]
    scale_ptr,          # () fp32: 1 / counted rows
    loss_ptr,           # (C,) out, fp32: each row's JSD (0 for ignored rows)
    vocab, inv_temperature, beta, ignore_index,
    BLOCK_V: tl.constexpr, BETA_MODE: tl.constexpr, HAS_LABELS: tl.constexpr,
):
    inv_temperature, beta = as_fp32(inv_temperature), as_fp32(beta)
    row = tl.program_id(0).to(tl.int64)
    student_row = student_ptr + row * vocab
    teacher_row = teacher_ptr + row * vocab
    valid = True
    if HAS_LABELS:
        valid = tl.load(labels_ptr + row) != ignore_index
    # an ignored row runs no statistics pass at all
    stats_end = tl.where(valid, vocab, 0)

    # (1) log-sum-exp of z/T for both, one online max/sum per BLOCK_V chunk. The finite start keeps
    # exp(m_old − m_new) defined while a row has seen only -inf.
    max_s = -3.0e38
    sum_s = 0.0
    max_t = -3.0e38
    sum_t = 0.0
    for start in range(0, stats_end, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab
        z_s = _log_probs(student_row, cols, mask, inv_temperature, 0.0)    # z/T
        z_t = _log_probs(teacher_row, cols, mask, inv_temperature, 0.0)
        new_max_s = tl.maximum(max_s, tl.max(z_s, axis=0))
        new_max_t = tl.maximum(max_t, tl.max(z_t, axis=0))
        sum_s = sum_s * tl.exp(max_s - new_max_s) + tl.sum(tl.exp(z_s - new_max_s), axis=0)
        sum_t = sum_t * tl.exp(max_t - new_max_t) + tl.sum(tl.exp(z_t - new_max_t), axis=0)
        max_s = new_max_s
        max_t = new_max_t
    lse_s = max_s + tl.log(sum_s)
    lse_t = max_t + tl.log(sum_t)

    # (2) the row's loss and Σ_v g
    loss_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    grad_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, stats_end, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab
        s = _log_probs(student_row, cols, mask, inv_temperature, lse_s)
        t = _log_probs(teacher_row, cols, mask, inv_temperature, lse_t)
        loss, grad, _p_s = jsd_terms(s, t, beta, BETA_MODE)
        loss_acc += loss
        grad_acc += grad
    grad_sum = tl.sum(grad_acc, axis=0)
    tl.store(loss_ptr + row, tl.where(valid, tl.sum(loss_acc, axis=0), 0.0))

    # (3) ∂z_s = (g − P_s Σ_v g)·scale/T, over the student logits (each element read, then written,
    # by the same thread)
    coef = tl.where(valid, tl.load(scale_ptr) * inv_temperature, 0.0)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab
        s = _log_probs(student_row, cols, mask, inv_temperature, lse_s)
        t = _log_probs(teacher_row, cols, mask, inv_temperature, lse_t)
        _loss, grad, p_s = jsd_terms(s, t, beta, BETA_MODE)
        dz = tl.where(valid, (grad - p_s * grad_sum) * coef, 0.0)
        tl.store(student_row + cols, dz.to(student_ptr.dtype.element_ty), mask=mask)


# -------------------------------------------------------------------------------------- launch config

@dataclass(frozen=True)
class FusedLinearJSDConfig:
    """Chunking and the row kernel's launch settings (docs/tuning.md)."""

    # Logit elements per [C, V] block (each of student and teacher): 2**27 is 256 MiB in bf16, about
    # a thousand tokens at V = 128K. Bigger chunks mean fewer passes of ∂W_s through addmm (each
    # reads and writes V·H) and longer matmuls; smaller ones, less memory.
    logits_chunk_elements: int = 2**27
    # The row kernel streams each row in blocks of block_v over row_warps warps.
    block_v: int = 4096
    row_warps: int = 8


CONFIG = FusedLinearJSDConfig()


def chunk_rows(num_rows: int, vocab: int) -> int:
    """Rows per chunk: as many as the budget allows, split evenly (no small tail chunk)."""
    most = max(1, CONFIG.logits_chunk_elements // max(vocab, 1))
    chunks = max(cdiv(num_rows, most), 1)
    return max(cdiv(num_rows, chunks), 1)


# ------------------------------------------------------------------------------------------ launcher


def _jsd_rows_impl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None,
    scale: torch.Tensor,
    inv_temperature: float,
    beta: float,
    ignore_index: int,
) -> torch.Tensor:
    """Row losses of one chunk; overwrites ``student_logits`` with ∂loss/∂logits."""
    rows, vocab = student_logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=student_logits.device)
    if rows > 0:
        wrap_triton(fused_linear_jsd_row_kernel)[(rows,)](
            student_logits, teacher_logits,
            labels if labels is not None else loss,
            scale, loss,
            vocab, inv_temperature, beta, ignore_index,
            BLOCK_V=min(CONFIG.block_v, next_power_of_2(vocab)), BETA_MODE=beta_mode(beta),
            HAS_LABELS=labels is not None,
            num_warps=CONFIG.row_warps,
        )
    return loss


# Mutating (the gradient is written over the student logits), so it has no backward of its own:
# _FusedLinearJSD below is the autograd node.
JSD_ROWS = TigonOp("fused_linear_jsd_rows", _jsd_rows_impl, mutates_args=("student_logits",))


def _forward(student_input, student_weight, teacher_input, teacher_weight, labels, beta, temperature,
             ignore_index, input_grad, weight_grad):
    """Loss (fp32 scalar) and the unscaled gradients (None where not wanted), chunk by chunk."""
    x_s = student_input.reshape(-1, student_input.shape[-1])     # (N, Hs)
    x_t = teacher_input.reshape(-1, teacher_input.shape[-1])     # (N, Ht)
    labels_1d = labels.reshape(-1) if labels is not None else None
    num_rows, vocab = x_s.shape[0], student_weight.shape[0]
    scale = 1.0 / rows_counted(labels_1d, num_rows, ignore_index, x_s.device)
    grad_input = torch.empty_like(x_s) if input_grad else None
    grad_weight = None
    row_losses = []
    step = chunk_rows(num_rows, vocab)
    for start in range(0, num_rows, step):
        end = min(start + step, num_rows)
        xs_chunk = x_s[start:end]
        logits_s = torch.matmul(xs_chunk, student_weight.t())               # (C, V)
        logits_t = torch.matmul(x_t[start:end], teacher_weight.t())         # (C, V)
        chunk_labels = labels_1d[start:end] if labels_1d is not None else None
        row_losses.append(
            JSD_ROWS(logits_s, logits_t, chunk_labels, scale, 1.0 / temperature, beta, ignore_index)
        )
        dlogits = logits_s                                                   # (C, V), overwritten in place
        if input_grad:
            grad_input[start:end] = torch.matmul(dlogits, student_weight)    # (C, Hs)
        if weight_grad:
            if grad_weight is None:
                grad_weight = torch.matmul(dlogits.t(), xs_chunk)            # (V, Hs)
            else:
                grad_weight.addmm_(dlogits.t(), xs_chunk)
    loss = torch.cat(row_losses).sum() * scale if row_losses else torch.zeros((), device=x_s.device)
    if weight_grad and grad_weight is None:
        grad_weight = torch.zeros_like(student_weight)
    if input_grad:
        grad_input = grad_input.reshape(student_input.shape)
    return loss, grad_input, grad_weight


class _FusedLinearJSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_input, student_weight, teacher_input, teacher_weight, labels, beta, temperature,
                ignore_index):
        input_grad, weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, grad_input, grad_weight = _forward(
            student_input, student_weight, teacher_input, teacher_weight, labels, beta, temperature,
            ignore_index, input_grad, weight_grad,
        )
        # The factor each gradient row holds (1: the forward computed them for grad_output = 1).
        applied = [torch.ones(math.prod(g.shape[:-1]), dtype=torch.float32, device=g.device) if g is not None
                   else None for g in (grad_input, grad_weight)]
        ctx.save_for_backward(grad_input, grad_weight, *applied)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, applied_input, applied_weight = ctx.saved_tensors
        # The loss is usually the graph's root (grad_output = 1). The row-scaling kernel compares the
        # factor with each row's applied one on the GPU and skips the rows that already hold it: no
        # pass over V·H then, and no host read of grad_output (an ``.item()`` here stalled the GPU
        # until the whole forward had run, every step), eager or compiled alike. A backward that keeps
        # the graph scales copies instead (apply_grad_output).
        grad_input, grad_weight = apply_grad_output(
            ctx, grad_output, [(grad_input, applied_input), (grad_weight, applied_weight)]
        )
        return grad_input, grad_weight, None, None, None, None, None, None


# ------------------------------------------------------------------------------------- public function


def fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, *, labels=None, beta=0.5,
                     temperature=1.0, ignore_index=-100):
    """``jsd(log_softmax(x_s W_sᵀ / T), log_softmax(x_t W_tᵀ / T), beta, labels, ignore_index)``.

    ``student_input`` ``[..., Hs]``, ``student_weight`` ``[V, Hs]``, ``teacher_input`` ``[..., Ht]``
    (the same leading dims), ``teacher_weight`` ``[V, Ht]``, ``labels`` ``[...]``. Gradients go to
    the student's input and weight; the teacher gets none. The loss is an fp32 scalar.
    """
    check_tensor(student_input, "student_input")
    device = student_input.device
    check_tensor(student_weight, "student_weight", device=device)
    check_tensor(teacher_input, "teacher_input", device=device)
    check_tensor(teacher_weight, "teacher_weight", device=device)
    pairs = (("student", student_input, student_weight), ("teacher", teacher_input, teacher_weight))
    for prefix, x, w in pairs:
        if x.dim() == 0:
            raise ValueError(f"{prefix}_input must have at least one dimension (the hidden dim is the last)")
        if w.dim() != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(
                f"{prefix}_weight has shape {tuple(w.shape)}, expected (vocab, {x.shape[-1]}) "
                f"to match {prefix}_input's last dim"
            )
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(
            f"teacher_weight has vocab size {teacher_weight.shape[0]}, "
            f"student_weight has {student_weight.shape[0]}"
        )
    if teacher_input.shape[:-1] != student_input.shape[:-1]:
        raise ValueError(
            f"teacher_input has leading shape {tuple(teacher_input.shape[:-1])}, "
            f"expected student_input's {tuple(student_input.shape[:-1])}"
        )
    check_labels(labels, student_input.shape[:-1], device)
    check_beta(beta)
    check_real(temperature, "temperature", positive=True)
    check_int(ignore_index, "ignore_index")
    dtype = autocast_dtype(device)
    if dtype is not None:
        student_input, student_weight = student_input.to(dtype), student_weight.to(dtype)
        teacher_input, teacher_weight = teacher_input.to(dtype), teacher_weight.to(dtype)
    pairs = (("student", student_input, student_weight), ("teacher", teacher_input, teacher_weight))
    for prefix, x, w in pairs:
        if w.dtype != x.dtype:
            raise TypeError(f"{prefix}_weight has dtype {w.dtype}, expected {prefix}_input's {x.dtype}")
    return _FusedLinearJSD.apply(
        student_input, student_weight, teacher_input, teacher_weight, labels, float(beta), float(temperature),
        int(ignore_index),
    )


# ------------------------------------------------------------------------------------------ reference


def fused_linear_jsd_reference(student_input, student_weight, teacher_input, teacher_weight, *, labels=None,
                               beta=0.5, temperature=1.0, ignore_index=-100, io_dtype=None):
    """Full logits, then ``log_softmax`` in fp32 (fp64 for fp64 inputs) and :func:`jsd_reference`.

    ``io_dtype``: with fp64 tensors, round the logits to this dtype as the matmul in that dtype
    would (the rounding's backward rounds the logits' gradient the same way).
    """
    wide = torch.float64 if student_input.dtype == torch.float64 else torch.float32
    logits_s = student_input @ student_weight.t()
    logits_t = (teacher_input @ teacher_weight.t()).detach()
    if io_dtype is not None:
        logits_s = logits_s.to(io_dtype).to(wide)
        logits_t = logits_t.to(io_dtype).to(wide)
    s = torch.log_softmax(logits_s.to(wide) / temperature, dim=-1)
    t = torch.log_softmax(logits_t.to(wide) / temperature, dim=-1)
    return jsd_reference(s, t, beta=beta, labels=labels, ignore_index=ignore_index)
