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
