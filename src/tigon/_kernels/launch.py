"""Launching kernels: eager launches without Triton's per-launch binding, the registered torch op
every kernel launcher becomes, and the launch-geometry helpers every op's config uses.

- :func:`wrap_triton` / :class:`FastLaunch`: ``wrap_triton(kernel)[grid](...)`` traces under
  torch.compile and launches directly (cheaply) in eager mode.
- :class:`TigonOp`: a launcher registered as ``tigon::<name>`` (``torch.library.triton_op``; a plain
  ``custom_op`` under the interpreter), called without the dispatcher in eager mode, with a fake
  implementation that allocates the outputs and launches nothing (fake tensors under
  torch.compile, meta tensors).
- :func:`cache_by_size`, :func:`cdiv`, :func:`next_power_of_2`, :func:`persistent_programs`.
"""

from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager
from functools import cache, wraps

import torch
from torch._C import _len_torch_dispatch_stack
from torch._library.triton import is_wrap_triton_enabled, set_wrap_triton_enabled
from torch.library import custom_op, triton_op
from torch.library import wrap_triton as _torch_wrap_triton
from triton import knobs
from triton.runtime.jit import JITFunction

from tigon._interpreter import interpreter_active
from tigon._kernels.triton_key import wait_for_triton_key

# The interpreter runs programs one after another, each slowly (docs/tuning.md, "Timings quoted in the
# source"): a handful is plenty.
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

    Inside a fake implementation (:func:`shapes_only`) nothing is launched: the tensors there (fake
    or meta) have shapes and dtypes but no data.
    """
    if _SHAPES_ONLY.depth:
        return _NO_LAUNCH
    if not _is_jit_kernel(kernel):
        return kernel if interpreter_active() else _torch_wrap_triton(kernel)
    if tracing_active() and is_wrap_triton_enabled():  # (tracing first: in eager mode it decides)
        return _torch_wrap_triton(kernel)
    # Keyed by id: a JITFunction hashes through its ``cache_key`` property (Python, on every launch).
    # The launcher holds its kernel, so the id is never reused while the entry exists.
    launcher = _FAST_LAUNCHERS.get(id(kernel))
    if launcher is None:
        launcher = _FAST_LAUNCHERS[id(kernel)] = FastLaunch(kernel)
    return launcher


class _NoLaunch:
    """``kernel[grid](...)`` that launches nothing: what a kernel does in a fake implementation."""

    __slots__ = ()

    def __getitem__(self, grid):
        return _launch_nothing


def _launch_nothing(*args, **kwargs):
    return None


_NO_LAUNCH = _NoLaunch()


class _ShapesOnly(threading.local):
    depth = 0


_SHAPES_ONLY = _ShapesOnly()


@contextmanager
def shapes_only():
    """Run a launcher for its outputs' shapes, dtypes and devices only: no kernel launches inside
    (:func:`wrap_triton`), and :func:`tracing_active` is true, so nothing made here is cached for real
    calls. A launcher's fake implementation (torch.compile's fake tensors, meta tensors) is the
    launcher run so; everything a launcher does besides launching kernels (allocating outputs,
    views, torch ops) reads no data."""
    _SHAPES_ONLY.depth += 1
    try:
        yield
    finally:
        _SHAPES_ONLY.depth -= 1


class FastLaunch:
    """``kernel[grid](*args, **kwargs)`` for eager launches, without Triton's per-launch argument binding.

    Why: Triton's ``JITFunction.run`` binds and specializes every argument on every launch (Python
    that measured longer than many of the kernels it launches, more for kernels with many arguments),
    and a training step launches ~200 kernels, so in eager mode Qwen2.5-0.5B's step was bound by the
    host, not the GPU (docs/tuning.md, "Timings quoted in the source", "Host time of launches and autograd nodes").
    Here the first launch of each *specialization* goes through Triton's own path,
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
        # key -> (launcher, function, packed metadata, values of the trailing params or None, their
        # (name, default))
        self.cache = {}
        # A constexpr passed by position is keyed by its value, as keywords are (ascending: the key
        # stops at the first one past the positional arguments).
        self.constexpr_positions = tuple(sorted(kernel.constexprs))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        key = _specialization_key(args, kwargs, self.constexpr_positions)
        if key is None or type(grid) is not tuple or not _launch_hooks_idle():
            return self._through_triton(grid, args, kwargs)
        try:
            entry = self.cache.get(key)
        except TypeError:  # an unhashable keyword value
            return self._through_triton(grid, args, kwargs)
        if entry is None:
            compiled = self._through_triton(grid, args, kwargs)  # compiles or finds it, and launches
            if compiled is not None and hasattr(compiled, "packed_metadata"):
                self.cache[key] = self._entry(compiled, len(args), kwargs)
            return compiled
        run, function, metadata, values, tail = entry
        if values is None:
            values = [kwargs[name] if name in kwargs else default for name, default in tail]
        run(*grid, *_GRID_PADDING[len(grid)], torch._C._cuda_getCurrentRawStream(key[0]), function, metadata,
            None, None, None, *args, *values)
        return None

    def _through_triton(self, grid, args, kwargs):
        """Triton's own launch, which looks the kernel up (and compiles it on a miss). The first lookup of
        the process needs Triton's compiler key: this waits for the thread that may be hashing it already
        (triton_key.py) rather than hash it a second time alongside."""
        wait_for_triton_key()
        return self.kernel[grid](*args, **kwargs)

    def _entry(self, compiled, num_positional, kwargs):
        """What a cached launch needs: the launcher, and the parameters after the positional
        arguments in signature order, each taken from the keywords or its default (Triton's
        launcher takes every parameter, constexprs included, in signature order).

        When every one of those is a constexpr, their values are taken once, here: the key holds
        each keyword's name and value, so a launch that finds this entry passes the same ones (and
        a compiled kernel has its constexprs built in: the launcher skips them)."""
        names = list(self.kernel.signature.parameters)
        params = list(self.kernel.signature.parameters.values())[num_positional:]
        tail = tuple((p.name, p.default) for p in params)
        for name, default in tail:
            if name not in kwargs and default is inspect.Parameter.empty:
                raise TypeError(f"{self.kernel.fn.__name__}: argument {name!r} missing")
        constexprs = {names[i] for i in self.constexpr_positions}
        values = None
        if all(name in constexprs for name, _ in tail):
            values = tuple(kwargs[name] if name in kwargs else default for name, default in tail)
        return compiled.run, compiled.function, compiled.packed_metadata, values, tail


# A grid of 1, 2 or 3 dimensions, padded to the launcher's three.
_GRID_PADDING = ((1, 1, 1), (1, 1), (1,), ())


def _launch_hooks_idle() -> bool:
    """No launch hook is installed (Triton >= 3.5 keeps an empty ``HookChain`` there by default,
    older versions None); a profiler's hook needs Triton's own launch, which calls it."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


_FAST_LAUNCHERS: dict = {}
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # not subclasses (fake, functional, DTensor ...)
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
    num_args = len(args)
    for i in constexpr_positions:  # ascending; usually the first is past the positional arguments
        if i >= num_args:
            break
        append(("constexpr", i, args[i]))
    int_keys = _INT_KEYS
    for a in args:
        t = type(a)
        if t is int:  # first: most arguments are sizes and strides
            append(int_keys.get(a) or _int_key(a))
        elif t is _TENSOR or t is _PARAMETER:
            # flat, not a pair: two entries cost less than a tuple; a dtype object only comes from here
            append(a.dtype)
            append(a.data_ptr() & 15)
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
    whose call unwraps its arguments (tens of times the cost of integer arithmetic: docs/tuning.md),
    and launchers call it on every launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def pow2_at_most(n: int, cap: int) -> int:
    """``min(cap, next_power_of_2(n))``, found by comparisons only: for a symbolic size (torch.compile's
    dynamic shapes) each comparison is a range guard, so one compiled graph serves every size from
    ``cap`` on, and one every size between two powers of two below it, where ``next_power_of_2`` would
    read the size as a number and specialise the graph to it."""
    if n >= cap:
        return cap
    power = 1 if n >= 1 else 2  # next_power_of_2(0) is 2
    while power < n:
        power *= 2
    return min(cap, power)


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
    with ``torch.library.triton_op``, so ``torch.compile(fullgraph=True)`` traces into it and Inductor
    sees its kernels. Its fake implementation is ``impl`` run under :func:`shapes_only`: the outputs
    are allocated (fake tensors under torch.compile, meta tensors outside it) and no kernel is
    launched, since neither kind has data. With ``backward`` and ``setup_context`` (the functions
    ``register_autograd`` takes) the op is differentiable.

    Under the interpreter the op is a plain ``torch.library.custom_op``: torch's ``wrap_triton``
    leaves an interpreted kernel as it is, so a decomposed triton_op would launch it on the
    functional tensors AOTAutograd traces with; as one opaque node the op runs ``impl`` on real
    tensors when the compiled graph runs, which is also all Inductor can do with an interpreted kernel.

    Why two paths: a call through the dispatcher and the custom-op autograd wrapper costs more
    Python per op than the kernels' GPU time at many training sizes (docs/tuning.md). In eager mode
    the same ``impl``, ``setup_context`` and ``backward`` run inside a plain autograd.Function instead;
    under ``torch.compile`` the registered op is used.

    In eager mode the kernels inside ``impl`` (and inside ``backward``, which the autograd engine
    runs) launch through :class:`FastLaunch`, because nothing traces them (:func:`wrap_triton`): the
    higher-order-op dispatch that tracing needs measured many times the GPU work of an RMSNorm
    forward + backward at 16K tokens (docs/tuning.md, "Timings quoted in the source", "Host time of launches and
    autograd nodes").

    ``mutates_args`` names the arguments ``impl`` writes in place (e.g. a gradient written into the
    logits' storage); such an op has no ``backward`` of its own.
    """

    def __init__(self, name, impl, *, setup_context=None, backward=None, mutates_args=()):
        if mutates_args and backward is not None:
            # register_autograd refuses mutating ops: differentiate them through an
            # autograd.Function that calls this op (as cross_entropy does).
            raise ValueError(f"tigon::{name} mutates {mutates_args}: it cannot take a backward")
        self.impl = impl
        # (interpreted kernels cannot be traced: an opaque op there, class docs)
        register = custom_op if interpreter_active() else triton_op
        self.op = register(f"tigon::{name}", impl, mutates_args=set(mutates_args))
        self.op.register_fake(_fake_implementation(impl))
        self.function = self.apply = None
        if backward is not None:
            self.op.register_autograd(backward, setup_context=setup_context)
            self.function = _eager_function(name, impl, setup_context, backward)
            self.apply = _FUNCTION_APPLY.__get__(None, self.function)

    def __call__(self, *args):
        # The registered op where the call is traced rather than run: Dynamo (torch.compile's front
        # end), or AOTAutograd / make_fx tracing a backward, which is not Dynamo but runs under a
        # dispatch mode with fake or functional tensors (a tensor that is not a plain Tensor or
        # Parameter). Real tensors take the direct path. Written out, without helper calls: this runs
        # on every op call, and each Python layer costs (class docs).
        if tracing_active():
            return self.op(*args)
        # A meta tensor (no data) also takes the registered op, whose Meta kernel is the fake
        # implementation.
        differentiable = self.function is not None and torch.is_grad_enabled()
        if not differentiable or _functorch_transforms_active():
            for a in args:
                if type(a) in PLAIN_TENSORS:
                    if a.is_meta:
                        return self.op(*args)
                elif isinstance(a, torch.Tensor):
                    return self.op(*args)
            return self.function.apply(*args) if differentiable else self.impl(*args)
        # What autograd.Function.apply does outside functorch transforms, for a Function without
        # setup_context (no argument binding): unwrap tensors that a finished transform left wrapped,
        # then the C++ apply.
        eager = []
        for a in args:
            t = type(a)
            if t is _TENSOR or t is _PARAMETER:
                if a.is_meta:
                    return self.op(*args)
                a = _unwrap_if_dead(a)
            elif isinstance(a, torch.Tensor):
                return self.op(*args)
            eager.append(a)
        return self.apply(*eager)


class OpaqueOp:
    """A host-side pipeline registered as one opaque torch op ``tigon::<name>``: its Python (a loop over
    chunks whose count and bounds follow from the sizes, cuBLAS matmuls, kernel launches) runs on real
    tensors only, never under tracing.

    Traced op by op, such a loop bakes its chunk bounds into the graph: torch.compile guards on every
    size the loop read and compiles the graph again for each new one (each sequence length of a loss
    head). As one op, the graph holds a single call whose outputs' shapes ``fake`` gives from the
    symbolic sizes without reading them as numbers, so one graph serves every size; when the compiled
    graph runs, ``impl`` runs as in eager mode (the same chunks, buffers and roundings: compiled
    results equal eager ones exactly). ``impl`` mutates none of its arguments and returns new tensors
    (one of shape ``(0,)`` where an output is not wanted: an op returns no None).

    In eager mode ``impl`` is called directly, without the dispatcher (:class:`TigonOp`'s reason); where
    the call is traced (Dynamo, AOTAutograd, fake or meta tensors) the registered op is, whose Meta
    kernel is ``fake``.
    """

    def __init__(self, name, impl, fake):
        self.impl = impl
        self.op = custom_op(f"tigon::{name}", impl, mutates_args=())
        self.op.register_fake(fake)

    def __call__(self, *args):
        if tracing_active():
            return self.op(*args)
        for a in args:
            if isinstance(a, torch.Tensor) and (type(a) not in PLAIN_TENSORS or a.is_meta):
                return self.op(*args)
        return self.impl(*args)


def _fake_implementation(impl):
    """The op's fake (and Meta) kernel: ``impl`` run without launching (:func:`shapes_only`)."""

    @wraps(impl)
    def fake(*args):
        with shapes_only():
            return impl(*args)

    return fake


# autograd.Function.apply's C++ part (torch._C._FunctionBase.apply), and the two functorch calls its
# Python part makes before it.
_FUNCTION_APPLY = torch._C._FunctionBase.__dict__["apply"]
_functorch_transforms_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def function_apply(function):
    """``function.apply`` for an ``autograd.Function`` without ``setup_context`` (forward(ctx, ...)),
    with less Python per call.

    Outside functorch transforms, ``Function.apply`` binds nothing for such a Function: it unwraps
    tensors that a finished transform left wrapped and calls the C++ apply, after building a closure,
    comparing ``setup_context`` and making a ``super()`` object (host time a decoder layer pays for
    each of its handful of nodes). This does the unwrapping and the C++ call; under a functorch
    transform, and under torch.compile (Dynamo traces ``Function.apply``, not the C++ one), it is
    ``function.apply`` itself.
    """
    if function.setup_context is not torch.autograd.Function.setup_context:
        raise TypeError(f"{function.__name__} defines setup_context: use its own apply")
    c_apply = _FUNCTION_APPLY.__get__(None, function)

    def apply(*args):
        # Dynamo traces Function.apply itself (as it does the registered ops): compiling first
        if torch.compiler.is_compiling() or _functorch_transforms_active():
            return function.apply(*args)
        return c_apply(*[_unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a for a in args])

    return apply


def tracing_active() -> bool:
    """Dynamo is tracing, a dispatch mode (fake tensors, make_fx, functionalization) is on, or a fake
    implementation runs (:func:`shapes_only`).

    Launchers that cache a tensor check it: a tensor made while tracing is a fake one, and must never
    be cached for real calls."""
    # the dispatch-mode stack's length, not _get_current_dispatch_mode(): the same answer (the stack
    # holds modes, never None) without a Python call (this runs a few times per op call)
    return torch.compiler.is_compiling() or _len_torch_dispatch_stack() > 0 or _SHAPES_ONLY.depth > 0


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
