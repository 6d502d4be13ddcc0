"""Triton's CPU interpreter, for machines without a GPU: switching it on, and fixes to it.

Triton reads ``TRITON_INTERPRET`` when a kernel is *defined*, so the switch must happen before
anything imports ``tigon.ops`` (Triton's own standard library, imported earlier by another package, is
made interpreted by the fixes below). The fixes below change Triton's interpreter (never the compiled
path) and are applied only by :func:`use_interpreter` / :func:`apply_interpreter_fixes`, which the
test set-up (tests/conftest.py), the ``tigon`` command and the benchmark and test worker processes
call when the interpreter is on. Importing ``tigon.ops`` applies nothing.
"""

from __future__ import annotations

import os


def interpreter_active() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_interpreter_without_gpu() -> bool:
    """Turn on Triton's CPU interpreter when there is no GPU (and fix it); True if it is on.

    Must run before anything imports ``tigon.ops``: Triton reads the variable when a kernel is
    defined, not when it runs.
    """
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    return apply_interpreter_fixes()


def apply_interpreter_fixes() -> bool:
    """Apply the interpreter fixes below when ``TRITON_INTERPRET=1`` is in effect; True if it is."""
    if not interpreter_active():
        return False
    _numpy_compat()
    _bf16_rounding()
    _language_interpreted()
    _helper_calls_reuse_the_launch_patch()
    _quiet_floating_point()
    return True


def _language_interpreted() -> None:
    """Make ``triton.language``'s own ``@triton.jit`` functions (``tl.sum``, ``tl.max``, ``tl.sigmoid``, ...)
    interpreted when ``triton.language`` was imported before the interpreter was switched on.

    ``@triton.jit`` makes an interpreted function or a compiled one by the variable's value when it runs, so a
    script that imports bitsandbytes (PEFT and transformers' quantizers do) before it sets
    ``TRITON_INTERPRET=1`` gets Triton's standard library compiled-only, and every interpreted kernel that calls
    one of its functions fails ("Cannot call @triton.jit'd outside of the scope of a kernel"). Each such
    function is replaced, in every ``triton.language`` module that holds it, by the interpreted function of the
    same Python function: what importing it with the interpreter on makes. Other packages' kernels are left as
    they are (tigon's are defined after the switch). Only under ``TRITON_INTERPRET=1``.
    """
    import sys

    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return
    interpreted = {}  # id of a compiled-only function -> its interpreted twin (one per function)
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if type(value) is JITFunction:
                twin = interpreted.get(id(value))
                if twin is None:
                    twin = interpreted[id(value)] = InterpretedFunction(value.fn)
                setattr(module, attr, twin)


def _numpy_compat() -> None:
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


def _bf16_rounding() -> None:
    """Make the interpreter round fp32 to bf16 to nearest-even, as the GPU's ``cvt.rn.bf16.f32`` does.

    The interpreter converts by cutting the mantissa (its "round to nearest" branch adds the cut bit
    without carrying into the exponent and without ties to even), so every bf16 value a kernel stores
    could be one ulp off the GPU's, and a kernel output could never be bitwise the cast that a
    reference makes. This converts through torch instead, which rounds as the GPU does.
    """
    try:
        import numpy as np
        import torch
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    cast = getattr(builder, "cast_impl", None)
    if cast is None or getattr(cast, "_tigon", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            wide = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            data = wide.to(torch.bfloat16).view(torch.uint16).numpy().reshape(src.data.shape)
            return interpreter.TensorHandle(data, dst_type.scalar)
        return cast(self, src, dst_type)

    cast_impl._tigon = True
    builder.cast_impl = cast_impl
    # the builder's create_fp_trunc & co. are lambdas that look cast_impl up on the instance


def _helper_calls_reuse_the_launch_patch() -> None:
    """Let a kernel call its ``@triton.jit`` helpers without the interpreter patching the language again.

    When the interpreter launches a kernel (``GridExecutor.__call__``) it replaces the builtins of the
    ``triton.language`` modules the kernel's globals hold (``tl.load``, ``tl.sum``'s ``reduce``, ...) by their
    NumPy versions (``_patch_lang``), and puts the originals back when the launch ends. A call of a
    ``@triton.jit`` helper inside the kernel (``InterpretedFunction.__call__``) runs ``_patch_lang`` again, for
    every call in every program: where the helper's modules are patched already it finds no builtin left to
    replace, but it walks ``inspect.getmembers`` of four modules (about 150 classes and functions each) to find
    that out, and sets the same two dozen replacements again. tigon's kernels call helpers inside their loops:
    under Triton 3.9 that walk takes a third of the interpreter's time in the norm tests.

    Here each launch remembers which language modules it has patched; a helper call whose modules are all among
    them skips ``_patch_lang``, and one that brings a module not yet patched (``triton.language.standard``'s
    functions, whose globals hold ``triton.language.core``) runs it as before. What a skipped call would have
    done leaves every builtin as it is (replaced already) and sets replacements that compute the same, so the
    kernels compute exactly what they did. Only under ``TRITON_INTERPRET=1``; a Triton without these functions is
    left alone.
    """
    import threading
    import weakref

    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or executor is None or getattr(patch_lang, "_tigon", False):
        return
    run_launch = executor.__call__
    languages = (tl, tl.core)

    class Launch(threading.local):
        patched: set | None = None  # ids of the modules patched by the running launch; None outside one

    launch = Launch()
    # function -> (the size of its globals, ids of the language modules they hold): a kernel module's globals are
    # a few hundred names, and its helpers are called in inner loops; the size notices a name added.
    held_by_function: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def language_modules(fn) -> frozenset:
        names = fn.__globals__
        size, held = held_by_function.get(fn, (-1, frozenset()))
        if size != len(names):
            held = frozenset(id(value) for value in names.values() if any(value is lang for lang in languages))
            held_by_function[fn] = (len(names), held)
        return held

    class Unchanged:
        def restore(self) -> None:
            pass

    def reused_patch_lang(fn):
        patched = launch.patched
        if patched is None:  # not inside a launch: as Triton does it
            return patch_lang(fn)
        held = language_modules(fn)
        if patched and held <= patched:
            return Unchanged()
        patched |= held
        return patch_lang(fn)

    def call(self, *args, **kwargs):
        outer, launch.patched = launch.patched, set()
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            launch.patched = outer

    reused_patch_lang._tigon = True
    reused_patch_lang.__wrapped__ = patch_lang  # Triton's own, for a test that runs without the fix
    call.__wrapped__ = run_launch
    interpreter._patch_lang = reused_patch_lang
    executor.__call__ = call


def _quiet_floating_point() -> None:
    """Run interpreted kernels without NumPy's floating-point warnings, as a GPU runs them without traps.

    The interpreter computes every lane of a block in NumPy, padding lanes and both sides of a ``tl.where``
    included, so a kernel that is right on the GPU makes NumPy warn ("divide by zero encountered in log",
    "invalid value encountered in multiply") about values it then masks or discards, and ``tigon check`` on a CPU
    would print such warnings. A GPU computes IEEE results (inf, NaN) without a word, and so do the kernels here
    (``numpy.errstate(all="ignore")`` around each launch); what reaches a kernel's output is what the tests
    compare. Only under ``TRITON_INTERPRET=1``.
    """
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    executor = getattr(interpreter, "GridExecutor", None)
    if executor is None or getattr(executor.__call__, "_tigon_quiet", False):
        return
    run_launch = executor.__call__

    def call(self, *args, **kwargs):
        with np.errstate(all="ignore"):
            return run_launch(self, *args, **kwargs)

    call._tigon_quiet = True
    call.__wrapped__ = run_launch
    executor.__call__ = call
