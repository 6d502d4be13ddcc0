"""The gated units' activations in a kernel, with their derivatives: SiLU, GELU (tanh approximation)
and GELU (erf), and the stable sigmoid they are built on. glu and moe_glu apply them to their gates.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def stable_sigmoid(x):
    """σ(x) from e = exp(−|x|) ≤ 1: no overflow, and full relative precision for x ≪ 0 (σ ≈ e)."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0, e) / (1.0 + e)


@triton.jit
def gate_activation(g, ACTIVATION: tl.constexpr):
    """act(g) and act'(g) for fp32 g (formulas in tigon.ops.glu's docstring).

    The forward kernel ignores act'(g); the compiler drops what is not used.
    """
    SQRT_2_OVER_PI: tl.constexpr = 0.7978845608028654
    GELU_CUBIC: tl.constexpr = 0.044715
    INV_SQRT_2: tl.constexpr = 0.7071067811865476
    INV_SQRT_2PI: tl.constexpr = 0.3989422804014327
    if ACTIVATION == "silu":
        sig = stable_sigmoid(g)
        act = g * sig
        dact = sig * (1.0 + g * (1.0 - sig))
    elif ACTIVATION == "gelu_tanh":
        v = SQRT_2_OVER_PI * (g + GELU_CUBIC * g * g * g)
        s = stable_sigmoid(2.0 * v)
        act = g * s
        dact = s + 2.0 * g * s * (1.0 - s) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * g * g)
    else:
        cdf = 0.5 * (1.0 + tl.erf(g * INV_SQRT_2))
        act = g * cdf
        dact = cdf + g * tl.exp(-0.5 * g * g) * INV_SQRT_2PI
    return act, dact
