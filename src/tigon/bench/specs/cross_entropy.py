"""Cross-entropy and fused linear cross-entropy at N = 8192 tokens, the vocabularies of issue 5.

Cross-entropy: V = 32000 (Llama-2 / Mistral), 128256 (Llama-3), 151936 (Qwen2.5), 256000 with
softcap 30 (Gemma-2). Speed of light: one read of the logits and one write of their gradient (the
forward alone: one read). eager is transformers' way: an fp32 upcast, then F.cross_entropy.

Fused linear cross-entropy: the heads of Llama-3-8B (H = 4096, V = 128256), Qwen2.5-0.5B (H = 896,
V = 151936) and Gemma-2 (H = 2304, V = 256000, softcap 30). Compute bound: ``flops`` holds the
three matmuls (2·N·H·V each), no speed-of-light bytes. eager: the matmul, then the fp32 loss.
Peers where installed: Liger-Kernel (``liger``) and Apple's Cut Cross-Entropy (``cce``, its default
gradient filtering; ``cce_exact``, none).
"""

from __future__ import annotations

import torch

from tigon.bench.models import MODELS_BY_NAME
from tigon.bench.spec import Case, Spec
from tigon.ops.cross_entropy import cross_entropy, cross_entropy_reference
from tigon.ops.fused_linear_cross_entropy import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)

TOKENS = 8192
# One token in this many is padding (ignore_index), as in a packed batch with a few short documents.
IGNORED_EVERY = 64
GEMMA_SOFTCAP = MODELS_BY_NAME["Gemma-2-9B"].final_logit_softcap

CE_SHAPES = (
    ("Llama-2", 32000, None),
    ("Llama-3", MODELS_BY_NAME["Llama-3-8B"].vocab, None),
    ("Qwen2.5", MODELS_BY_NAME["Qwen2.5-0.5B"].vocab, None),
    ("Gemma-2", MODELS_BY_NAME["Gemma-2-9B"].vocab, GEMMA_SOFTCAP),
)
FLCE_SHAPES = (
    ("Llama-3-8B", MODELS_BY_NAME["Llama-3-8B"].hidden, MODELS_BY_NAME["Llama-3-8B"].vocab, None),
    ("Qwen2.5-0.5B", MODELS_BY_NAME["Qwen2.5-0.5B"].hidden, MODELS_BY_NAME["Qwen2.5-0.5B"].vocab, None),
    ("Gemma-2-2B", 2304, MODELS_BY_NAME["Gemma-2-9B"].vocab, GEMMA_SOFTCAP),
)


def _target(tokens, vocab, device):
    target = torch.randint(0, vocab, (tokens,), device=device)
    target[::IGNORED_EVERY] = -100
    return target


# ------------------------------------------------------------------------------------- cross-entropy


def _ce_bytes(tokens, vocab, elem):
    logits, small = tokens * vocab * elem, tokens * 8 + 4
    return {"fwd": logits + small, "bwd": 2 * logits + small, "full": 2 * logits + small}


def _ce_make(tokens, vocab, softcap):
    def make(device, dtype):
        return {
            "logits": torch.randn(tokens, vocab, device=device, dtype=dtype, requires_grad=True),
            "target": _target(tokens, vocab, device),
            "softcap": softcap,
        }

    return make


def _ce_case(label, tokens, vocab, softcap, elem):
    cap = f" softcap={softcap:g}" if softcap else ""
    return Case(
        f"{label} N={tokens} V={vocab}{cap}",
        {"N": tokens, "V": vocab, "softcap": softcap},
        _ce_make(tokens, vocab, softcap),
        _ce_bytes(tokens, vocab, elem),
    )


def _ce_cases():
    return [_ce_case(label, TOKENS, vocab, softcap, 2) for label, vocab, softcap in CE_SHAPES]


def _ce_check_case():
    return _ce_case("check", 6, 300, None, 4)


def _liger_ce():
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except ImportError:
        return None
    return lambda logits, target, softcap: liger_cross_entropy(logits, target, softcap=softcap)


CROSS_ENTROPY = Spec(
    name="cross_entropy",
    cases=_ce_cases,
    providers={
        "eager": lambda logits, target, softcap: cross_entropy_reference(logits, target, softcap=softcap),
        "tigon": lambda logits, target, softcap: cross_entropy(logits, target, softcap=softcap),
    },
    peers={"liger": _liger_ce},
    check_case=_ce_check_case,
)


# ------------------------------------------------------------------------- fused linear cross-entropy


def _flce_make(tokens, hidden, vocab, softcap):
    def make(device, dtype):
        weight = torch.randn(vocab, hidden, device=device) * hidden**-0.5  # logits of order 1
        return {
            "input": torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True),
            "linear_weight": weight.to(dtype).requires_grad_(),
            "target": _target(tokens, vocab, device),
            "softcap": softcap,
        }

    return make


def _flce_case(label, tokens, hidden, vocab, softcap):
    matmul = 2 * tokens * hidden * vocab
    cap = f" softcap={softcap:g}" if softcap else ""
    return Case(
        f"{label} N={tokens} H={hidden} V={vocab}{cap}",
        {"N": tokens, "H": hidden, "V": vocab, "softcap": softcap},
        _flce_make(tokens, hidden, vocab, softcap),
        {},
        flops={"fwd": matmul, "bwd": 2 * matmul, "full": 3 * matmul},
    )


def _flce_cases():
    return [_flce_case(label, TOKENS, *shape) for label, *shape in FLCE_SHAPES]


def _flce_check_case():
    return _flce_case("check", 6, 16, 300, None)


def _liger_flce():
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    return lambda input, linear_weight, target, softcap: liger_fused_linear_cross_entropy(
        input, linear_weight, target, softcap=softcap
    )


def _cce_providers():
    """Apple's Cut Cross-Entropy where ``cut_cross_entropy`` imports (it runs on CUDA only): ``cce``
    in its default mode (filter_eps="high": gradient blocks whose softmax is below bf16's
    resolution are skipped), ``cce_exact`` with no filtering. The harness's targets are already
    aligned with the tokens (no shift); its ignore_index is -100, its reduction the mean."""
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError:
        return {}

    def provider(filter_eps):
        def cce(input, linear_weight, target, softcap):
            return linear_cross_entropy(
                input, linear_weight, target, ignore_index=-100, softcap=softcap, reduction="mean",
                shift=False, filter_eps=filter_eps, impl="cce",
            )

        return cce

    return {"cce": provider("high"), "cce_exact": provider(None)}


def _flce_eager(input, linear_weight, target, softcap):
    return fused_linear_cross_entropy_reference(input, linear_weight, target, softcap=softcap)


def _flce_tigon(input, linear_weight, target, softcap):
    return fused_linear_cross_entropy(input, linear_weight, target, softcap=softcap)


FUSED_LINEAR_CROSS_ENTROPY = Spec(
    name="fused_linear_cross_entropy",
    cases=_flce_cases,
    providers={"eager": _flce_eager, "tigon": _flce_tigon, **_cce_providers()},
    peers={"liger": _liger_flce},
    check_case=_flce_check_case,
)

SPECS = (CROSS_ENTROPY, FUSED_LINEAR_CROSS_ENTROPY)
