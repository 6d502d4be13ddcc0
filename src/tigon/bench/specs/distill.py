"""Distillation losses: KL divergence, JSD and TVD on [N, V] log-probabilities, and the fused linear JSD.

KL, JSD and TVD run at N = 8192 rows of the Llama-3 vocabulary (128256): memory-bound, so measured
against the bytes they must move. The fused linear JSD runs a Llama-3-8B-sized head (H = 4096) for
student and teacher at a few token counts; it is matmul-bound (8·N·V·H flops for the two logit
matmuls and the student's two gradient matmuls), so its cases carry flops as well as bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tigon.bench.models import MODELS_BY_NAME
from tigon.bench.spec import Case, Spec
from tigon.ops.fused_linear_jsd import fused_linear_jsd, fused_linear_jsd_reference
from tigon.ops.jsd import jsd, jsd_reference
from tigon.ops.kl_div import kl_div
from tigon.ops.tvd import tvd, tvd_reference

LLAMA = MODELS_BY_NAME["Llama-3-8B"]
ROWS = 8192
FLJSD_TOKENS = (1024, 2048, 4096)
BETA = 0.5
IGNORE_INDEX = -100


def _log_probs(rows, vocab, device, dtype, requires_grad=False):
    logits = torch.randn(rows, vocab, device=device, dtype=torch.float32) * 2
    return logits.log_softmax(-1).to(dtype).requires_grad_(requires_grad)


def _kl_inputs(rows, vocab):
    def make(device, dtype):
        return {
            "input": _log_probs(rows, vocab, device, dtype, requires_grad=True),
            "target": _log_probs(rows, vocab, device, dtype).exp(),
        }

    return make


def _jsd_inputs(rows, vocab):
    def make(device, dtype):
        return {
            "student": _log_probs(rows, vocab, device, dtype, requires_grad=True),
            "teacher": _log_probs(rows, vocab, device, dtype),
        }

    return make


def _elementwise_bytes(rows, vocab, elem, *, backward_reads):
    tensor = rows * vocab * elem
    fwd = 2 * tensor  # read both; the loss is a scalar
    bwd = backward_reads * tensor + tensor  # read what the gradient needs; write it
    return {"fwd": fwd, "bwd": bwd, "full": fwd + bwd}


def _kl_cases():
    rows, vocab = ROWS, LLAMA.vocab
    # the input gradient is −p·γ: the backward reads the target only
    return [Case(f"N={rows} V={vocab}", {"N": rows, "V": vocab}, _kl_inputs(rows, vocab),
                 _elementwise_bytes(rows, vocab, 2, backward_reads=1))]


def _jsd_cases():
    rows, vocab = ROWS, LLAMA.vocab
    return [Case(f"N={rows} V={vocab}", {"N": rows, "V": vocab}, _jsd_inputs(rows, vocab),
                 _elementwise_bytes(rows, vocab, 2, backward_reads=2))]


def _fljsd_inputs(tokens, hidden, vocab):
    def make(device, dtype):
        def randn(*shape, requires_grad=False, scale=1.0):
            t = torch.randn(*shape, device=device, dtype=torch.float32) * scale
            return t.to(dtype).requires_grad_(requires_grad)

        return {
            "student_input": randn(tokens, hidden, requires_grad=True),
            "student_weight": randn(vocab, hidden, requires_grad=True, scale=hidden**-0.5),
            "teacher_input": randn(tokens, hidden),
            "teacher_weight": randn(vocab, hidden, scale=hidden**-0.5),
        }

    return make


def _fljsd_case(tokens, hidden, vocab, elem):
    inputs = tokens * hidden * elem
    weight = vocab * hidden * elem
    # read both inputs and weights; write the student's input and weight gradients
    fwd = 2 * inputs + 2 * weight
    bwd = inputs + weight
    matmul = 2 * tokens * vocab * hidden
    return Case(
        f"N={tokens} H={hidden} V={vocab}",
        {"N": tokens, "H": hidden, "V": vocab},
        _fljsd_inputs(tokens, hidden, vocab),
        {"fwd": fwd, "bwd": bwd, "full": fwd + bwd},
        flops={"fwd": 2 * matmul, "bwd": 2 * matmul, "full": 4 * matmul},
    )


def _liger(name):
    """Liger-Kernel's functional form, with its defaults (what its users get), or None."""
    try:
        from liger_kernel.transformers import functional
    except ImportError:
        return None
    fn = getattr(functional, name)
    if name == "liger_kl_div":
        return lambda input, target: fn(input, target, reduction="batchmean")
    if name == "liger_jsd":
        return lambda student, teacher: fn(student, teacher, None, BETA, IGNORE_INDEX)
    return lambda student_input, student_weight, teacher_input, teacher_weight: fn(
        student_input, student_weight, teacher_input, teacher_weight, None, BETA, IGNORE_INDEX, 1.0
    )


KL_DIV = Spec(
    name="kl_div",
    cases=_kl_cases,
    providers={
        "eager": lambda input, target: F.kl_div(input, target, reduction="batchmean"),
        "tigon": lambda input, target: kl_div(input, target, reduction="batchmean"),
    },
    peers={"liger": lambda: _liger("liger_kl_div")},
    check_case=lambda: Case("check N=13 V=300", {"N": 13, "V": 300}, _kl_inputs(13, 300),
                            _elementwise_bytes(13, 300, 4, backward_reads=1)),
)

JSD = Spec(
    name="jsd",
    cases=_jsd_cases,
    providers={
        "eager": lambda student, teacher: jsd_reference(student, teacher, beta=BETA),
        "tigon": lambda student, teacher: jsd(student, teacher, beta=BETA),
    },
    peers={"liger": lambda: _liger("liger_jsd")},
    check_case=lambda: Case("check N=13 V=300", {"N": 13, "V": 300}, _jsd_inputs(13, 300),
                            _elementwise_bytes(13, 300, 4, backward_reads=2)),
)

TVD = Spec(
    name="tvd",
    cases=_jsd_cases,
    providers={
        "eager": lambda student, teacher: tvd_reference(student, teacher),
        "tigon": lambda student, teacher: tvd(student, teacher),
    },
    check_case=lambda: Case("check N=13 V=300", {"N": 13, "V": 300}, _jsd_inputs(13, 300),
                            _elementwise_bytes(13, 300, 4, backward_reads=2)),
)

FUSED_LINEAR_JSD = Spec(
    name="fused_linear_jsd",
    cases=lambda: [_fljsd_case(tokens, LLAMA.hidden, LLAMA.vocab, 2) for tokens in FLJSD_TOKENS],
    providers={
        "eager": lambda **inputs: fused_linear_jsd_reference(**inputs, beta=BETA),
        "tigon": lambda **inputs: fused_linear_jsd(**inputs, beta=BETA),
    },
    peers={"liger": lambda: _liger("liger_fused_linear_jsd")},
    check_case=lambda: _fljsd_case(9, 64, 500, 4),
)

SPECS = (KL_DIV, JSD, TVD, FUSED_LINEAR_JSD)
