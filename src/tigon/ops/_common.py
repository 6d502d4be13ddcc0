"""What every op shares: input checks that name the argument, row views, launch geometry.

Kept small on purpose. Anything specific to one op (its block sizes, its kernels) lives in that
op's file; this module only holds what several ops would otherwise each write again.
"""

from __future__ import annotations

import os
from functools import cache, wraps

import torch
import triton
import triton.language as tl
from torch._library.triton import set_wrap_triton_enabled
from torch.library import triton_op
from torch.library import wrap_triton as _torch_wrap_triton
from torch.utils._python_dispatch import _get_current_dispatch_mode

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The interpreter runs programs one after another at ~1 ms each: a handful is plenty.
INTERPRETER_PROGRAMS = 4


def interpreter_active() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreter_numpy_compat() -> None:
    """Let Triton 3.6's interpreter run loops with runtime bounds under NumPy >= 2.4.

    The interpreter holds a scalar kernel argument as a 1-element array and gives Python its index
    with ``int(array)``, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to
    Python scalars"): every ``for start in range(0, n, BLOCK)`` fails. Triton 3.9 squeezes the array
    first; this installs the same ``__index__`` after the interpreter patches ``tl.tensor``, on any
    version (the same result where it was already right). Only under ``TRITON_INTERPRET=1``.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_tigon", False):
        return

    def patch_lang_tensor(tensor, scope, *args, **kwargs):
        patch(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._tigon = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if interpreter_active():
    _interpreter_numpy_compat()


def wrap_triton(kernel):
    """``torch.library.wrap_triton``, except under the interpreter, where the kernel is launched as is.

    Ops launch ``wrap_triton(kernel)[grid](...)`` so that torch.compile traces the launch. Under
    ``TRITON_INTERPRET=1`` ``@triton.jit`` makes an ``InterpretedFunction``, which torch < 2.13's
    ``wrap_triton`` refuses ("only works on functions annotated with triton.jit") even in eager mode;
    nothing traces interpreted kernels, so they need no wrapper.
    """
    if interpreter_active():
        return kernel
    return _torch_wrap_triton(kernel)


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

    In eager mode ``wrap_triton`` is also switched off around ``impl``, as ``triton_op`` itself does
    when it runs eagerly: otherwise every launch goes through the higher-order-op dispatch that
    tracing needs, ~1 ms of host time per kernel (measured on the H100 host: 1.2 ms per RMSNorm
    forward+backward, against ~0.1 ms of GPU work at 16K tokens).

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
        with _direct_launch():
            if self.function is not None and torch.is_grad_enabled():
                return self.function.apply(*args)
            return self.impl(*args)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _tracing(args) -> bool:
    """True when the call is being traced rather than run: Dynamo (torch.compile's front end), or
    AOTAutograd / make_fx tracing a backward, which is not Dynamo but runs under a dispatch mode
    with fake or functional tensors. Those need the registered op; real tensors take the direct path.
    """
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return True
    return any(isinstance(a, torch.Tensor) and type(a) not in _PLAIN_TENSORS for a in args)


def _direct_launch():
    """Launch ``wrap_triton`` kernels directly (no tracing dispatch) inside this context."""
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
