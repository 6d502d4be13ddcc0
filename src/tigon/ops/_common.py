"""What every op shares: input checks that name the argument, row views, launch geometry.

Kept small on purpose. Anything specific to one op (its block sizes, its kernels) lives in that
op's file; this module only holds what several ops would otherwise each write again.
"""

from __future__ import annotations

import inspect
from functools import cache, wraps

import torch
import triton
import triton.language as tl
from torch._library.triton import is_wrap_triton_enabled, set_wrap_triton_enabled
from torch.library import triton_op
from torch.library import wrap_triton as _torch_wrap_triton
from torch.utils._python_dispatch import _get_current_dispatch_mode
from triton import knobs
from triton.runtime.jit import JITFunction

from tigon._interpreter import interpreter_active

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The interpreter runs programs one after another at ~1 ms each: a handful is plenty.
INTERPRETER_PROGRAMS = 4


def _is_jit_kernel(kernel) -> bool:
    """A plain ``@triton.jit`` kernel (not interpreted, not autotuned): the kind FastLaunch runs."""
    return type(kernel) is JITFunction


def wrap_triton(kernel):
    """``torch.library.wrap_triton``, except where nothing traces the launch.

    Ops launch ``wrap_triton(kernel)[grid](...)`` so that torch.compile traces the launch. Where
    nothing traces:

    - under ``TRITON_INTERPRET=1`` ``@triton.jit`` makes an ``InterpretedFunction``, which torch <
      2.13's ``wrap_triton`` refuses ("only works on functions annotated with triton.jit") even in
      eager mode: the kernel is launched as it is;
    - in eager mode a ``@triton.jit`` kernel is launched through :class:`FastLaunch`: where
      ``wrap_triton`` is switched off (``TigonOp``'s direct path, the registered op run eagerly), and
      where nothing traces (a backward run by the autograd engine, which ``TigonOp`` does not wrap:
      there torch's wrapper would dispatch a higher-order op only to launch the kernel).
    """
    if not _is_jit_kernel(kernel):
        return kernel if interpreter_active() else _torch_wrap_triton(kernel)
    if is_wrap_triton_enabled() and tracing_active():
        return _torch_wrap_triton(kernel)
    launcher = _FAST_LAUNCHERS.get(kernel)
    if launcher is None:
        launcher = _FAST_LAUNCHERS[kernel] = FastLaunch(kernel)
    return launcher


class FastLaunch:
    """``kernel[grid](*args, **kwargs)`` for eager launches, without Triton's per-launch argument binding.

    Why: Triton's ``JITFunction.run`` binds and specializes every argument on every launch (about
    100 µs of Python per launch on the H100 machine's host, more for kernels with many arguments),
    and a training step launches ~200 kernels, so in eager mode Qwen2.5-0.5B's step was bound by the
    host, not the GPU (benchmarks/results/host_profile-*.log: ``rope_function`` 375 µs of Python per
    forward call). Here the first launch of each *specialization* goes through Triton's own path,
    which compiles (or finds) the kernel and returns it; the launch after that calls the compiled
    kernel's launcher directly.

    The cache key holds everything Triton's specialization (``native_specialize_impl``) depends on,
    or more, so that a cached kernel is never launched with arguments it was not compiled for:

    - a tensor: its dtype and whether its address is a multiple of 16 (Triton's "divisible by 16"
      pointer attribute);
    - an int: whether it equals 1 (Triton turns such an argument into a constant), whether it is a
      multiple of 16, and whether it fits 32 bits (i32, i64 or u64 type);
    - a float, a bool, None: their kinds (None and bools by value);
    - keyword arguments (constexprs, ``num_warps`` ...) by name and value;
    - the current device.

    Anything else (a tensor subclass, a fake tensor, a callable grid, a launch hook set by a
    profiler such as proton) takes Triton's path unchanged.
    """

    __slots__ = ("kernel", "cache", "constexpr_positions")

    def __init__(self, kernel):
        self.kernel = kernel
        self.cache = {}  # key -> (launcher, function, packed metadata, (name, default) of trailing params)
        # A constexpr passed by position is keyed by its value, as keywords are.
        self.constexpr_positions = tuple(kernel.constexprs)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        key = _specialization_key(args, kwargs, self.constexpr_positions)
        if key is None or type(grid) is not tuple or not _launch_hooks_idle():
            return self.kernel[grid](*args, **kwargs)
        try:
            entry = self.cache.get(key)
        except TypeError:  # an unhashable keyword value
            return self.kernel[grid](*args, **kwargs)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)  # compiles or finds it, and launches
            if compiled is not None and hasattr(compiled, "packed_metadata"):
                self.cache[key] = self._entry(compiled, len(args), kwargs)
            return compiled
        run, function, metadata, tail = entry
        size = len(grid)
        device = key[0]
        run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1,
            torch._C._cuda_getCurrentRawStream(device), function, metadata, None, None, None,
            *args, *[kwargs[name] if name in kwargs else default for name, default in tail])
        return None

    def _entry(self, compiled, num_positional, kwargs):
        """What a cached launch needs: the launcher, and the parameters after the positional
        arguments in signature order, each taken from the keywords or its default (Triton's
        launcher takes every parameter, constexprs included, in signature order)."""
        params = list(self.kernel.signature.parameters.values())[num_positional:]
        tail = tuple((p.name, p.default) for p in params)
        for name, default in tail:
            if name not in kwargs and default is inspect.Parameter.empty:
                raise TypeError(f"{self.kernel.fn.__name__}: argument {name!r} missing")
        return compiled.run, compiled.function, compiled.packed_metadata, tail


def _launch_hooks_idle() -> bool:
    """No launch hook is installed (Triton >= 3.5 keeps an empty ``HookChain`` there by default,
    older versions None); a profiler's hook needs Triton's own launch, which calls it."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


_FAST_LAUNCHERS: dict = {}
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # not subclasses (fake, functional, DTensor ...)
_I32 = (-(2**31), 2**31 - 1)
_U64 = 2**63


_INT_KEYS: dict = {}  # int -> its specialization; ints are sizes and strides, a few hundred values
_INT_KEYS_MAX = 4096


def _int_key(a: int):
    key = (a == 1, a & 15 == 0, 0 if _I32[0] <= a <= _I32[1] else 1 if a < _U64 else 2)
    if len(_INT_KEYS) < _INT_KEYS_MAX:
        _INT_KEYS[a] = key
    return key


def _specialization_key(args, kwargs, constexpr_positions=()):
    """The key :class:`FastLaunch` caches a compiled kernel under, or None to take Triton's path.

    This runs on every eager launch (a few hundred a training step), so it is kept lean: one entry
    per tensor, ints' specializations looked up rather than recomputed.
    """
    key = [_current_device()]
    append = key.append
    for i in constexpr_positions:
        if i < len(args):
            append(("constexpr", i, args[i]))
    int_keys = _INT_KEYS
    for a in args:
        t = type(a)
        if t is _TENSOR or t is _PARAMETER:
            # flat, not a pair: two entries cost less than a tuple; a dtype object only comes from here
            append(a.dtype)
            append(a.data_ptr() & 15)
        elif t is int:
            append(int_keys.get(a) or _int_key(a))
        elif t is float:
            append(float)
        elif t is bool or a is None:
            append((t, a))
        else:
            return None
    key += kwargs.items()
    return tuple(key)


_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter


# torch.cuda.current_device() without its Python wrapper (lazy init check, device-index conversion):
# FastLaunch only runs after a kernel has run through Triton on this process's GPU.
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


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
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all inputs on one device)")
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and interpreter_active():
        return
    if t.device.type == "meta":  # shape propagation (torch.compile, fake tensors)
        return
    raise ValueError(
        f"{name} is on {t.device}: tigon kernels need CUDA tensors "
        "(CPU tensors only under the Triton interpreter, TRITON_INTERPRET=1)"
    )


# cuBLAS can write a bf16/fp16 product into an fp32 output (and accumulate into it) directly:
# aten::addmm's out_dtype overload (torch 2.8+, CUDA).
HAS_MM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def fp32_product_in_place(a: torch.Tensor) -> bool:
    """Whether a matmul of ``a`` (bf16/fp16) can write or accumulate an fp32 result itself."""
    return HAS_MM_OUT_DTYPE and a.is_cuda and a.dtype != torch.float32 and not torch.compiler.is_compiling()


def matmul_to(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` returned in ``dtype``: the gradient of a tensor (an fp32 master weight, an fp32
    input) that autocast cast to the operands' dtype.

    Stock autograd makes it the bf16 product cast to fp32: the matmul rounds its fp32 accumulator
    to bf16, then a cast kernel reads that and writes fp32. On the GPU the matmul writes its fp32
    accumulator itself instead: no cast kernel (2 bytes read and 2 written less per element, one
    launch less) and no rounding to bf16 on the way, so the gradient is nearer the exact product.
    """
    if dtype == a.dtype:
        return a @ b
    if dtype == torch.float32 and fp32_product_in_place(a):
        out = torch.empty((a.shape[0], b.shape[1]), dtype=dtype, device=a.device)
        return torch.addmm(out, a, b, beta=0.0, out_dtype=dtype, out=out)
    return (a @ b).to(dtype)


def matmul_accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool) -> None:
    """out = a @ b (``first``) or out += a @ b, summed in ``out``'s dtype, in place.

    In the operands' dtype the matmul adds its product to ``out`` itself (beta = 1): each sum is
    rounded once and no product is written on its own. An fp32 ``out`` (the gradient of an fp32
    tensor) is summed in fp32: on the GPU by the matmul itself (``out_dtype``); elsewhere as autograd
    sums the products of separate nodes, each rounded to the operands' dtype and widened.
    """
    beta = 0.0 if first else 1.0
    if out.dtype == a.dtype:
        out.addmm_(a, b, beta=beta)
    elif out.dtype == torch.float32 and fp32_product_in_place(a):
        torch.addmm(out, a, b, beta=beta, out_dtype=out.dtype, out=out)
    elif first:
        out.copy_(a @ b)
    else:
        out += a @ b


def cast_all(tensors, dtype: torch.dtype) -> list:
    """``[t.to(dtype) for t in tensors]`` (None stays None), the casts made by one launch.

    Why: a node that casts its fp32 weights (and biases) to the autocast dtype, as ``nn.Linear``
    under autocast does, made one cast kernel each, and in eager mode each ``.to`` costs ~20 µs of
    the host's dispatch, allocation and launch on the H100 machine: 17 of them a Qwen2.5-0.5B layer,
    forward and backward, 400 a step that was bound by its host. Here the outputs are allocated as
    ``.to`` allocates them (``empty_like``: same sizes and strides) and filled by one
    ``torch._foreach_copy_``, which converts the dtype in one multi-tensor kernel on the GPU (and
    copies one by one elsewhere): the same values, bit for bit, as the separate casts. Under
    torch.compile the plain casts are left to Inductor, which fuses them itself.
    """
    out = list(tensors)
    todo = [i for i, t in enumerate(tensors) if t is not None and t.dtype != dtype]
    if len(todo) < 2 or torch.compiler.is_compiling():
        for i in todo:
            out[i] = tensors[i].to(dtype)
        return out
    sources = [tensors[i] for i in todo]
    casts = [torch.empty_like(t, dtype=dtype) for t in sources]
    torch._foreach_copy_(casts, sources)
    for i, cast in zip(todo, casts, strict=True):
        out[i] = cast
    return out


def sum_rows_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.sum(0)`` returned in ``dtype``: the gradient of a bias that autocast cast to ``t``'s dtype.

    Stock autograd rounds the (fp32-accumulated) sum to ``t``'s dtype and casts it back; on the GPU
    the reduction writes its fp32 accumulator in ``dtype`` itself (one kernel less, and no rounding
    on the way, as :func:`matmul_to` does for the weights). Elsewhere it is the stock's, bit for bit.
    """
    if dtype == torch.float32 and t.dtype != dtype and t.is_cuda and not torch.compiler.is_compiling():
        return t.sum(0, dtype=dtype)
    return t.sum(0).to(dtype)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as ``(rows, last_dim)`` without copying where the strides allow it.

    Kernels take a row stride and a column stride, so a non-contiguous row layout or a stride-0
    (expanded) gradient is read in place; only layouts whose leading dims cannot be merged into one
    stride are copied by ``reshape``.
    """
    return t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t


def cache_by_size(fn):
    """``functools.cache`` for a launch-geometry function of sizes (a few µs of Python saved per
    call, on every call of an op), bypassed when a size is symbolic: torch.compile with dynamic
    shapes passes SymInts, which cannot be hashed."""
    cached = cache(fn)

    @wraps(fn)
    def geometry(*args, **kwargs):
        try:
            return cached(*args, **kwargs)
        except TypeError:  # an unhashable (symbolic) size
            return fn(*args, **kwargs)

    return geometry


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for launch geometry. Not ``triton.cdiv``: since Triton 3.5 that is a constexpr function,
    whose call unwraps its arguments (~3 µs a call on a CPU, against 0.1 µs), and launchers call it on
    every launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(device: torch.device, per_sm: int = 2) -> int:
    """How many programs a persistent (grid-stride) kernel launches on ``device``: ``per_sm`` per
    multiprocessor on a GPU, a handful under the interpreter."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return per_sm * _multiprocessors(index)


class TigonOp:
    """A kernel launcher registered as a torch op, and called without the dispatcher in eager mode.

    ``impl(*args)`` launches the kernels and returns tensors. It is registered as ``tigon::<name>``
    with ``torch.library.triton_op``, so ``torch.compile(fullgraph=True)`` traces into it (the fake
    implementation is derived from ``impl`` run on fake tensors). With ``backward`` and
    ``setup_context`` (the functions ``register_autograd`` takes) the op is differentiable.

    Why two paths: a call through the dispatcher and the custom-op autograd wrapper costs ~80 µs of
    Python per op on a CPU, more than the kernels themselves at many training sizes. In eager mode
    the same ``impl``, ``setup_context`` and ``backward`` run inside a plain autograd.Function instead;
    under ``torch.compile`` the registered op is used.

    In eager mode the kernels inside ``impl`` (and inside ``backward``, which the autograd engine
    runs) launch through :class:`FastLaunch`, because nothing traces them (:func:`wrap_triton`): the
    higher-order-op dispatch that tracing needs costs ~1 ms of host time per kernel (measured on the
    H100 host: 1.2 ms per RMSNorm forward+backward, against ~0.1 ms of GPU work at 16K tokens).

    ``mutates_args`` names the arguments ``impl`` writes in place (e.g. a gradient written into the
    logits' storage); such an op has no ``backward`` of its own.
    """

    def __init__(self, name, impl, *, setup_context=None, backward=None, mutates_args=()):
        if mutates_args and backward is not None:
            # register_autograd refuses mutating ops: differentiate them through an
            # autograd.Function that calls this op (as cross_entropy does).
            raise ValueError(f"tigon::{name} mutates {mutates_args}: it cannot take a backward")
        self.impl = impl
        self.op = triton_op(f"tigon::{name}", impl, mutates_args=set(mutates_args))
        self.function = None
        if backward is not None:
            self.op.register_autograd(backward, setup_context=setup_context)
            self.function = _eager_function(name, impl, setup_context, backward)

    def __call__(self, *args):
        if _tracing(args):
            return self.op(*args)
        if self.function is not None and torch.is_grad_enabled():
            return self.function.apply(*args)
        return self.impl(*args)



def _tracing(args) -> bool:
    """True when the call is being traced rather than run: Dynamo (torch.compile's front end), or
    AOTAutograd / make_fx tracing a backward, which is not Dynamo but runs under a dispatch mode
    with fake or functional tensors. Those need the registered op; real tensors take the direct path.
    """
    if tracing_active():
        return True
    for a in args:  # a loop, not any(<generator>): this runs on every op call
        if type(a) not in _PLAIN_TENSORS and isinstance(a, torch.Tensor):
            return True
    return False


def tracing_active() -> bool:
    """Dynamo is tracing, or a dispatch mode (fake tensors, make_fx, functionalization) is on.

    Launchers that cache a tensor check it: a tensor made while tracing is a fake one, and must never
    be cached for real calls."""
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def _direct_launch():
    """Launch ``wrap_triton`` kernels directly (no tracing dispatch) inside this context, even under
    a dispatch mode (the registered op's eager run does the same; tests and tuning scripts use it)."""
    return set_wrap_triton_enabled(False)


def _eager_function(name, impl, setup_context, backward):
    def forward(ctx, *args):
        out = impl(*args)
        setup_context(ctx, args, out)
        return out

    return type(
        f"{name}_function",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )


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
# costs little more than its one MUFU instruction. Measured on the sm_90 SASS (scripts/
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
