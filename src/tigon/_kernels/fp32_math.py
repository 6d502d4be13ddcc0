"""fp32 math helpers of the kernels: a float argument as an fp32 scalar, and transcendentals in few
instructions."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon._interpreter import interpreter_active


@triton.jit
def as_fp32(value):
    """A float kernel argument as an fp32 scalar, first thing in a kernel.

    Triton's launcher passes Python floats as fp32, but Inductor (torch.compile) passes them to
    user-defined kernels as fp64: without this, fp32 loop-carried values mixed with them turn fp64
    (a compile error) and whole tiles are computed in fp64. Adding to an fp32 zero also turns the
    interpreter's plain Python float into a scalar tensor.
    """
    return (tl.zeros((), tl.float32) + value).to(tl.float32)


# ------------------------------------------------------------------ transcendentals in few instructions
# A kernel whose loop evaluates exp or tanh on every element of a streamed row (cross-entropy with
# softcap: three per element and pass) is bound by instruction issue, not by memory, unless each
# costs little more than its one MUFU instruction. Measured on the sm_90 SASS (dev/
# kernel_resources.py): ``tl.exp`` is 5 instructions (ptxas guards the non-ftz ex2 against a
# denormal result: a compare, two predicated multiplies), an fp32 ``/`` is 7 (div.full's range
# guards); the forms below are 1-2 and 1.

LOG2E = tl.constexpr(1.4426950408889634)
SIGN_BIT = tl.constexpr(-(2**31))  # 0x80000000 as an int32
# Inline PTX only where a CUDA compiler reads it: the interpreter (and ROCm) take the plain division.
PTX_MATH = tl.constexpr(not interpreter_active() and torch.version.hip is None)


@triton.jit
def fast_exp(x):
    """e^x as ``ex2.approx.ftz(x·log2 e)``: the MUFU instruction ``tl.exp`` uses (2 ulp), without the
    denormal fix-up. A result below 2^-126 flushes to 0: negligible beside any sum it joins that holds
    a term of at least 1 (a softmax's, shifted by its maximum). Take the difference before calling
    (``fast_exp(z - m)``, not ``exp2(z·log2 e − m·log2 e)``): its absolute error is what the
    exponent carries into a relative error of the result."""
    return tl.exp2(x * LOG2E)


@triton.jit
def fast_reciprocal(x):
    """1/x as one ``rcp.approx.ftz`` (≤ 1 ulp) for x of normal magnitude (no range guards: the caller
    knows x, e.g. in (1, 2]); the interpreter divides."""
    if PTX_MATH:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def reciprocal_1_to_2(x):
    """1/x for x in [1, 2] on the FMA pipe alone: a loop bound by the MUFU pipe (16 results a clock
    per SM against 128 for FFMA) trades its one MUFU.RCP (8 FFMA issues' worth of MUFU time) for 6
    FFMA. Seed: the minimax quadratic 70/33 − 48/33·x + 32/99·x² (relative error ≤ 1/99), then
    two Newton steps r ← r + r·(1 − x·r) square it twice: ≤ 1.2·2^-24 relative in fp32 with fused
    multiply-adds, within rcp.approx's 1 ulp."""
    r = (0.32323232323232326 * x - 1.4545454545454546) * x + 2.121212121212121
    r = r + r * (1.0 - x * r)
    return r + r * (1.0 - x * r)


@triton.jit
def copysign_nonnegative(magnitude, sign):
    """``magnitude`` (≥ 0, its sign bit clear) with the sign of ``sign``: one bitwise instruction."""
    bits = magnitude.to(tl.int32, bitcast=True) | (sign.to(tl.int32, bitcast=True) & SIGN_BIT)
    return bits.to(tl.float32, bitcast=True)
