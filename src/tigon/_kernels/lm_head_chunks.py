"""The LM head's logits made a chunk at a time, as the fused linear losses make them
(fused_linear_cross_entropy, vocab_parallel_cross_entropy, the log-prob head, tigon.losses): the
operands in the compute dtype, the chunks of classes, the buffer every chunk reuses, the chunk's
matmul, and the cross-entropy options the chunk kernels take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tigon._kernels.inputs import autocast_dtype


def head_compute_dtype(input, linear_weight, linear_bias):
    """The dtype the head's matmul runs in: autocast's where it is on (as F.linear casts), else the
    input's, which the weight and bias must share (TypeError naming the one that does not)."""
    autocast = autocast_dtype(input.device)
    if autocast is not None:
        return autocast
    for name, t in (("linear_weight", linear_weight), ("linear_bias", linear_bias)):
        if t is not None and t.dtype != input.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype}, expected input's {input.dtype} (or run under torch.autocast)"
            )
    return input.dtype


def compute_operands(input, linear_weight, linear_bias, compute_dtype):
    """(x (N, H), w, b) in the compute dtype: the autocast dtype if any, else the inputs' own."""
    x = input.reshape(-1, input.shape[-1]).to(compute_dtype)
    w = linear_weight.to(compute_dtype)
    b = linear_bias.to(compute_dtype) if linear_bias is not None else None
    return x, w, b


def class_chunks(vocab, chunk):
    """(start, end) of each chunk of ``chunk`` classes (the last one what remains)."""
    return [(c0, min(vocab, c0 + chunk)) for c0 in range(0, vocab, chunk)]


def chunk_buffer(numel, dtype, device):
    """A buffer every chunk reuses in eager mode; None under torch.compile, which plans its own."""
    if torch.compiler.is_compiling():
        return None
    return torch.empty(numel, dtype=dtype, device=device)


def chunk_view(buffer, rows, cols):
    """The first rows·cols elements of ``buffer`` as a (rows, cols) chunk (None without a buffer)."""
    return None if buffer is None else buffer[: rows * cols].view(rows, cols)


def linear_into(x, w, b, out):
    """x·wᵀ + b, into ``out`` (a reused chunk buffer) in eager mode; under torch.compile a plain
    matmul whose buffer inductor plans itself."""
    if torch.compiler.is_compiling() or out is None:
        return torch.addmm(b, x, w.t()) if b is not None else x @ w.t()
    if b is not None:
        return torch.addmm(b, x, w.t(), out=out)
    return torch.mm(x, w.t(), out=out)


@dataclass(frozen=True)
class LossOptions:
    """cross_entropy's options as the vocabulary-chunk kernels take them (``args()``, in their order)."""

    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float | None
    logit_scale: float

    def args(self):
        return (self.ignore_index, self.label_smoothing, self.z_loss, self.softcap, self.logit_scale)
