"""What every op shares: input checks that name the argument, row views, and the fp32 math helpers
of the kernels.

Launching (FastLaunch, TigonOp, geometry helpers) is in ``_launch``; matmuls into a chosen dtype in
``_matmul``; the interpreter switch and its fixes in ``tigon._interpreter``. Their names stay
importable from here for code written against the former layout.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from tigon._interpreter import interpreter_active
from tigon.ops._launch import (  # noqa: F401  (re-exported for the former layout)
    INTERPRETER_PROGRAMS,
    FastLaunch,
    TigonOp,
    cache_by_size,
    cdiv,
    next_power_of_2,
    persistent_programs,
    tracing_active,
    wrap_triton,
)
from tigon.ops._matmul import (  # noqa: F401  (re-exported for the former layout)
    HAS_MM_OUT_DTYPE,
    cast_all,
    fp32_product_in_place,
    matmul_accumulate,
    matmul_to,
    sum_rows_to,
)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(t, name: str, *, dtypes=FLOAT_DTYPES, device: torch.device | None = None) -> None:
    """Raise TypeError/ValueError naming ``name`` when ``t`` cannot go to a kernel.

    A kernel reads raw pointers, so a wrong device or dtype must be stopped here: past this point it
    would be a CUDA fault or a silently wrong answer rather than an error message.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {allowed}")
    t_device = t.device  # read once: each read makes a torch.device (this runs on every op call)
    if device is not None and t_device != device:
        raise ValueError(f"{name} is on {t_device}, expected {device} (all inputs on one device)")
    device_type = t_device.type
    if device_type == "cuda":
        return
    if device_type == "cpu" and interpreter_active():
        return
    if device_type == "meta":  # shape propagation (torch.compile, fake tensors)
        return
    raise ValueError(
        f"{name} is on {t_device}: tigon kernels need CUDA tensors "
        "(CPU tensors only under the Triton interpreter, TRITON_INTERPRET=1)"
    )


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts matmul operands to on ``device``, or None where it is off
    (or where the device has no autocast: meta tensors)."""
    device_type = device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def autocast_off(device: torch.device):
    """``torch.autocast(device.type, enabled=False)``; nothing on a device without autocast (meta)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


# cuBLAS can write a bf16/fp16 product into an fp32 output (and accumulate into it) directly:
# aten::addmm's out_dtype overload (torch 2.8+, CUDA).


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as ``(rows, last_dim)`` without copying where the strides allow it.

    Kernels take a row stride and a column stride, so a non-contiguous row layout or a stride-0
    (expanded) gradient is read in place; only layouts whose leading dims cannot be merged into one
    stride are copied by ``reshape``.
    """
    return t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t


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


def deprecated_function_alias(function, old_name: str):
    """``function`` under its former public name: the same call, with a DeprecationWarning."""
    import functools
    import warnings

    @functools.wraps(function)
    def alias(*args, **kwargs):
        warnings.warn(f"tigon.ops.{old_name} is deprecated: call tigon.ops.{function.__name__}", DeprecationWarning,
                      stacklevel=2)
        return function(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = old_name
    return alias


def deprecated_module_alias(old_name: str, new_name: str):
    """A module object for ``sys.modules[old_name]`` that forwards every attribute to ``new_name``
    with a DeprecationWarning (for an op module renamed so that its old name is the function's)."""
    import importlib
    import types
    import warnings

    class _Alias(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            warnings.warn(f"{old_name} is deprecated: import {name} from {new_name}", DeprecationWarning,
                          stacklevel=2)
            return getattr(importlib.import_module(new_name), name)

    return _Alias(old_name, f"Deprecated alias of {new_name}.")
