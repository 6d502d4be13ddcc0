"""One small call of every public op in ``tigon.ops``, for the tests that run them all the same way
(torch.compile, meta tensors).

Each case is a function of tensors only (the options are fixed inside it), so that a test can move
every input to another device, compile the call, or mark what needs a gradient. Sizes are tiny and
odd: what these tests check is the op's plumbing (registration, fake implementation, autograd), which
the sizes do not change; the kernels' numbers are the op tests' business.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import tigon.ops as ops

ROWS, HIDDEN, VOCAB = 5, 8, 11


@dataclass(frozen=True)
class OpCase:
    name: str
    fn: Callable  # tensors -> a tensor or a tuple of tensors (None where an output is off)
    make_inputs: Callable  # dtype -> the tensors (floating ones in dtype, on the CPU)


def _randn(*shape, dtype):
    return torch.randn(*shape).to(dtype)


def _log_probs(*shape, dtype):
    return torch.log_softmax(torch.randn(*shape), -1).to(dtype)


def _target(rows=ROWS, vocab=VOCAB):
    t = torch.randint(0, vocab, (rows,))
    t[1] = -100  # an ignored row
    return t


def _norm_inputs(count):
    return lambda dtype: (*(_randn(3, HIDDEN, dtype=dtype) for _ in range(count)),
                          *(_randn(HIDDEN, dtype=dtype) for _ in range(4 - count)))


def _rope_inputs(tables):
    return lambda dtype: (_randn(1, 2, 3, 8, dtype=dtype), _randn(1, 1, 3, 8, dtype=dtype),
                          _randn(*tables, dtype=dtype), _randn(*tables, dtype=dtype))


def _head_inputs(dtype):
    return _randn(ROWS, HIDDEN, dtype=dtype), _randn(VOCAB, HIDDEN, dtype=dtype), _target()


def _rows(dtype):
    return _log_probs(4, 7, dtype=dtype), _log_probs(4, 7, dtype=dtype)


CASES = (
    OpCase("rms_norm", lambda x, _r, w, _w2: ops.rms_norm(x, w), _norm_inputs(2)),
    OpCase("add_rms_norm", lambda x, r, w, _w2: ops.add_rms_norm(x, r, w), _norm_inputs(2)),
    OpCase("layer_norm", lambda x, _r, w, b: ops.layer_norm(x, w, b), _norm_inputs(2)),
    OpCase("post_norm_join", lambda x, r, w, _w2: ops.post_norm_join(x, r, w), _norm_inputs(2)),
    OpCase("sandwich_norm_join", lambda x, r, w, w2: ops.sandwich_norm_join(x, r, w, w2), _norm_inputs(2)),
    OpCase("rope", lambda q, k, cos, sin: ops.rope(q, k, cos, sin), _rope_inputs((1, 3, 8))),
    OpCase("mrope", lambda q, k, cos, sin: ops.mrope(q, k, cos, sin, [2, 1, 1]), _rope_inputs((3, 1, 3, 8))),
    OpCase("swiglu", ops.swiglu, lambda dtype: (_randn(3, 6, dtype=dtype), _randn(3, 6, dtype=dtype))),
    OpCase("geglu", lambda g, u: ops.geglu(g, u, approximate="none"),
           lambda dtype: (_randn(3, 6, dtype=dtype), _randn(3, 6, dtype=dtype))),
    OpCase("moe_glu", lambda gate_up: ops.moe_glu(gate_up, layout="interleaved"),
           lambda dtype: (_randn(3, 12, dtype=dtype),)),
    OpCase("cross_entropy", lambda z, t: ops.cross_entropy(z, t, label_smoothing=0.1, z_loss=1e-3),
           lambda dtype: (_randn(ROWS, VOCAB, dtype=dtype), _target())),
    OpCase("fused_linear_cross_entropy", lambda x, w, t: ops.fused_linear_cross_entropy(x, w, t, softcap=5.0),
           _head_inputs),
    OpCase("vocab_parallel_cross_entropy",  # a one-rank group: the test sets it up
           lambda x, w, t: ops.vocab_parallel_cross_entropy(x, w, t, vocab_start=0, vocab_size=VOCAB),
           _head_inputs),
    OpCase("fused_linear_logprobs", lambda x, w, t: ops.fused_linear_logprobs(x, w, t, entropy=True),
           _head_inputs),
    OpCase("fused_linear_token_stats",
           lambda x, w, t: tuple(ops.fused_linear_token_stats(x, w, t, entropy=True, extras=True)), _head_inputs),
    OpCase("fused_linear_jsd", lambda x, w, xt, wt: ops.fused_linear_jsd(x, w, xt, wt, beta=0.3),
           lambda dtype: (*_head_inputs(dtype)[:2], *_head_inputs(dtype)[:2])),
    OpCase("kl_div", lambda a, b: ops.kl_div(a, b, log_target=True), _rows),
    OpCase("jsd", ops.jsd, _rows),
    OpCase("tvd", ops.tvd, _rows),
)
# (tests/ops/test_meta.py checks that every name in tigon.ops.__all__ has a case)


def outputs(out) -> list[torch.Tensor]:
    """The tensors an op returned (None where an output is off)."""
    return [out] if isinstance(out, torch.Tensor) else [o for o in out if o is not None]


def with_grad(tensors):
    """Floating-point tensors require grad (leaves), index tensors stay as they are."""
    return [t.detach().requires_grad_() if t.dtype.is_floating_point else t for t in tensors]


def weighted_sum(out) -> torch.Tensor:
    """A scalar of every differentiable output, each weighted unevenly so every gradient element
    differs (a gradient with a broadcast or a transposed index would not pass as right)."""
    total = 0
    for o in outputs(out):
        if o.requires_grad:
            total = total + (o.float() * torch.linspace(0.5, 1.5, o.numel(), device=o.device).view(o.shape)).sum()
    return total
