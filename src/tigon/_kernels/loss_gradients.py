r"""What the losses that compute their gradient in the forward share: applying ``grad_output``
lazily in the backward, and the eager out-of-range target check.

A loss like ``cross_entropy`` computes ∂loss/∂input during its forward, for grad_output = 1, and
saves it. The backward then only has to multiply it by grad_output; :func:`apply_grad_output` does
that with a row-scaling kernel that skips every row whose factor is already applied, so with
grad_output == 1 (the usual case) the backward is one launch and no traffic. Each saved gradient
is viewed as (R, C) rows with an fp32 ``applied`` (R,) that holds the factor the row carries now.

:class:`RangeCheck` is the one device-to-host read per call that eager mode makes to raise on a
target outside [0, V), made so that it leaves the GPU no idle gap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon._kernels.inputs import autocast_off
from tigon._kernels.launch import TigonOp, pow2_at_most, wrap_triton

# The row-scaling kernel: one program per row, this many elements per load round.
SCALE_ROWS_BLOCK = 4096
SCALE_ROWS_WARPS = 8


@triton.jit
def scale_rows_kernel(
    rows_ptr, row_stride, col_stride,       # (R, C) in/out: a gradient computed for grad_output = applied
    grad_output_ptr, grad_output_stride,    # (R,) the factor each row should carry (stride 0: one scalar)
    applied_ptr,                            # (R,) fp32 in/out: the factor each row carries now (starts at 1)
    num_cols,
    BLOCK: tl.constexpr,
):
    """Row r becomes rows[r]·g/applied (applied: the factor the row carries; see apply_grad_output).

    A row whose factor is already applied is left alone: with grad_output == 1 the kernel reads two
    scalars per row and writes nothing. A row zeroed by an earlier g = 0 cannot be rescaled; it
    becomes NaN rather than a finite wrong value (apply_grad_output never scales in place a gradient
    that a later backward will read).
    """
    row = tl.program_id(0).to(tl.int64)
    g = tl.load(grad_output_ptr + row * grad_output_stride).to(tl.float32)
    applied = tl.load(applied_ptr + row)
    if g != applied:
        factor = tl.where(applied == 0.0, float("nan"), g / applied)
        row_ptr = rows_ptr + row * row_stride
        for start in range(0, num_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < num_cols
            x = tl.load(row_ptr + cols * col_stride, mask=mask, other=0.0).to(tl.float32)
            tl.store(row_ptr + cols * col_stride, (x * factor).to(rows_ptr.dtype.element_ty), mask=mask)
        tl.store(applied_ptr + row, g)


def launch_scale_rows(rows, grad_output, applied):
    num_rows, num_cols = rows.shape
    if num_rows == 0 or num_cols == 0:
        return
    # by comparisons: under torch.compile with dynamic shapes a loss's backward is traced with the gradient's
    # width (the hidden size) symbolic, and reading it as a number here would specialise it (pow2_at_most)
    block = pow2_at_most(num_cols, SCALE_ROWS_BLOCK)
    wrap_triton(scale_rows_kernel)[(num_rows,)](
        rows, rows.stride(0), rows.stride(1),
        grad_output, grad_output.stride(0),
        applied, num_cols,
        BLOCK=block, num_warps=max(1, min(SCALE_ROWS_WARPS, block // 512)),
    )


def _scale_rows_impl(rows: torch.Tensor, grad_output: torch.Tensor, applied: torch.Tensor) -> None:
    launch_scale_rows(rows, grad_output, applied)



SCALE_ROWS = TigonOp("scale_rows_", _scale_rows_impl, mutates_args={"rows", "applied"})


def scale_lazily(grad: torch.Tensor, grad_output: torch.Tensor, applied: torch.Tensor) -> torch.Tensor:
    """Bring a gradient saved for grad_output = ``applied`` to ``grad_output``, in place; returns it.

    ``grad`` is viewed as (R, C) rows with ``applied`` (R,); ``grad_output`` is a scalar (one factor
    for every row) or (R,) per row, any stride.
    """
    rows = grad.reshape(applied.shape[0], -1) if grad.dim() != 2 else grad
    factor = grad_output.reshape(-1).expand(applied.shape[0]) if grad_output.numel() == 1 else grad_output
    SCALE_ROWS(rows, factor, applied)
    return grad


def apply_grad_output(ctx, grad_output: torch.Tensor, saved: list) -> list:
    """The gradients saved by a loss's forward (for grad_output = 1), brought to ``grad_output``.

    ``saved`` holds (gradient, applied) pairs, or None for a gradient not computed. A backward that
    frees the graph (the usual one) is the last to read them: they are scaled in place and handed
    out as they are, with no copy, and with grad_output == 1 with no pass over them
    (:func:`scale_lazily`). A backward that keeps the graph (``retain_graph=True``, which gradcheck,
    jacobians and ``autograd.grad`` before ``backward`` use) hands out scaled copies and leaves the
    saved gradients untouched. So every later backward starts from them again, and whatever the
    caller does with what it got (hold it, change it) changes nothing here. A grad_output of 0 in an
    earlier backward is no exception. Under torch.compile the traced backward keeps the in-place path.
    """
    # is_compiling first: Dynamo must not meet the C accessor while it traces.
    if torch.compiler.is_compiling() or not (_KEEP_GRAPH is None or _KEEP_GRAPH()):
        return [scale_lazily(g, grad_output, a) if g is not None else None for g, a in saved]
    return [scale_lazily(g.clone(), grad_output, a.clone()) if g is not None else None for g, a in saved]


# Whether the running backward keeps the graph (torch's own AOTAutograd asks the same); if a torch
# lacks it, every backward is taken as keeping it (copies: right, at the cost of memory).
_KEEP_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


class SavedGradientsFunction(torch.autograd.Function):
    """The loss made with its gradients (the single-pass losses, vocab_parallel_cross_entropy); the
    backward brings them to grad_output."""

    @staticmethod
    def forward(ctx, loss, input, linear_weight, linear_bias, dx, dw, db):
        ctx.input_shape = input.shape
        applied = [torch.ones(n, dtype=torch.float32, device=loss.device) if g is not None else None
                   for g, n in ((dx, dx.shape[0] if dx is not None else 0),
                                (dw, dw.shape[0] if dw is not None else 0), (db, 1))]
        ctx.save_for_backward(dx, dw, db, *applied)
        return loss.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        dx, dw, db, applied_x, applied_w, applied_b = ctx.saved_tensors
        with autocast_off(grad_loss.device):
            dx, dw, db = apply_grad_output(ctx, grad_loss, [(dx, applied_x), (dw, applied_w), (db, applied_b)])
        dx = dx.view(ctx.input_shape) if dx is not None else None
        return None, dx, dw, db, None, None, None


class RangeCheck:
    """Eager mode's out-of-range target check: the one device-to-host read per call, made early.

    ``RangeCheck(bad)`` right after the reduction kernel: on a GPU it queues a copy of the kernel's
    2-element flag into pinned host memory and an event after it. ``raise_if_bad`` waits on that
    event only, not on the loss kernels queued after it: the GPU goes on with them while the host
    reads the flag and queues what follows (the backward), so the check leaves no idle gap on the
    GPU. Reading the flag with ``.tolist()`` after the loss kernels instead left the GPU idle from
    the read to the host's next launch, which measured longer than the loss itself at speed of light
    (dev/tune_ce.py; docs/tuning.md, "Timings quoted in the source", "cross_entropy").

    Under torch.compile a data-dependent check cannot raise, so it is skipped: the kernels turn an
    out-of-range target into a NaN loss without reading out of bounds.
    """

    def __init__(self, bad: torch.Tensor):
        self.flag = self.event = None
        if torch.compiler.is_compiling() or bad.is_meta:  # (meta: no data to check)
            return
        if bad.device.type == "cuda":
            self.flag = torch.empty(bad.shape, dtype=bad.dtype, pin_memory=True)
            self.flag.copy_(bad, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.flag = bad

    def raise_if_bad(self, vocab: int, ignore_index: int) -> None:
        if self.flag is None:
            return
        if self.event is not None:
            self.event.synchronize()
        any_bad, value = self.flag.tolist()
        if any_bad:
            raise ValueError(
                f"target holds class index {value}, outside [0, {vocab}) and not ignore_index={ignore_index}"
            )
