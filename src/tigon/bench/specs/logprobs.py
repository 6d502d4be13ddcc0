"""The fused log-probability head (per-token log p(target) and entropy) at N = 8192 tokens.

Cases: a Llama-3-8B-sized hidden (H = 4096) and Qwen2.5-0.5B's (H = 896), both with Qwen2.5's
vocabulary (V = 151936), bf16, entropy on (both outputs differentiated). Compute bound: ``flops``
holds the matmuls of each mode (2·N·H·V each: 1 forward, 3 backward — the recompute, dX and dW —
so 4 in all), no speed-of-light bytes.

Providers: ``tigon``; ``eager`` (the reference: full fp32 logits, log_softmax; ``compile`` is added
by the harness); ``trl``, TRL's own head (``trl.kernels.ChunkedLogProbFunction``, which
``trl.trainer.utils`` imports as ``_ChunkedLogProbFunction``) called as TRL's fused LM head calls it
(non-ignored rows only, 32768-class tiles), present only where TRL imports; and ``matmul_floor``,
the bf16 cuBLAS matmuls alone (forward: the logits; backward: the recompute, dX and dW), the floor
any exact chunked head sits on.
"""

from __future__ import annotations

import torch

from tigon.bench.models import MODELS_BY_NAME
from tigon.bench.spec import Case, Spec
from tigon.ops.fused_linear_logprobs import fused_linear_logprobs, fused_linear_logprobs_reference

TOKENS = 8192
# One token in this many is ignored (prompt or padding), as in the other loss benchmarks.
IGNORED_EVERY = 64
VOCAB = MODELS_BY_NAME["Qwen2.5-0.5B"].vocab
SHAPES = (
    ("H=4096", MODELS_BY_NAME["Llama-3-8B"].hidden, VOCAB),
    ("Qwen2.5-0.5B", MODELS_BY_NAME["Qwen2.5-0.5B"].hidden, VOCAB),
)
# TRL 1.16's fused LM head (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE).
TRL_CHUNK_CLASSES = 32768


def _make(tokens, hidden, vocab):
    def make(device, dtype):
        weight = torch.randn(vocab, hidden, device=device) * hidden**-0.5  # logits of order 1
        target = torch.randint(0, vocab, (tokens,), device=device)
        target[::IGNORED_EVERY] = -100
        return {
            "input": torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True),
            "linear_weight": weight.to(dtype).requires_grad_(),
            "target": target,
        }

    return make


def _case(label, tokens, hidden, vocab):
    matmul = 2 * tokens * hidden * vocab
    return Case(
        f"{label} N={tokens} H={hidden} V={vocab}",
        {"N": tokens, "H": hidden, "V": vocab},
        _make(tokens, hidden, vocab),
        {},
        flops={"fwd": matmul, "bwd": 3 * matmul, "full": 4 * matmul},
    )


def _cases():
    return [_case(label, TOKENS, hidden, vocab) for label, hidden, vocab in SHAPES]


def _tigon(input, linear_weight, target):
    return fused_linear_logprobs(input, linear_weight, target, entropy=True)


def _eager(input, linear_weight, target):
    return fused_linear_logprobs_reference(input, linear_weight, target, entropy=True)


def _trl():
    """TRL's head as its fused LM head calls it, or None where TRL (with its kernels) is not installed."""
    try:
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer import utils  # noqa: F401  (its backward imports from it)
    except ImportError:
        return None

    def trl_head(input, linear_weight, target):
        mask = target != -100
        return ChunkedLogProbFunction.apply(
            input[mask], linear_weight, None, target[mask], 1.0, TRL_CHUNK_CLASSES, None, 1.0,
            ("log_probs", "entropy"),
        )[:2]

    return trl_head


class _MatmulFloor(torch.autograd.Function):
    """The matmuls of a chunked head and nothing else: logits forward; recompute, dX, dW backward."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        logits = x @ w.t()                                     # (N, V)
        return logits[:, 0].float()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        dlogits = x @ w.t()                                    # the recompute, standing in for dL
        return dlogits @ w, dlogits.t() @ x


def _matmul_floor(input, linear_weight, target):
    return _MatmulFloor.apply(input, linear_weight)


LOGPROBS = Spec(
    name="fused_linear_logprobs",
    cases=_cases,
    providers={"eager": _eager, "tigon": _tigon, "matmul_floor": _matmul_floor},
    peers={"trl": _trl},
    modes=("fwd", "full"),
    check_case=lambda: _case("check", 6, 16, 300),
)

SPECS = (LOGPROBS,)
