"""tigon's fixes to how Triton's interpreter launches a kernel (tigon._interpreter).

- A kernel calls its ``@triton.jit`` helpers without patching the language again
  (``_helper_calls_reuse_the_launch_patch``): what a launch patches does not grow with its programs and helper
  calls, the kernels compute bitwise what they compute without the fix, and the language is put back when the
  launch ends.
- NumPy's floating-point warnings stay quiet inside a launch (``_quiet_floating_point``), as a GPU computes inf
  and NaN without a word, and outside it NumPy warns as before.
"""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's path (no GPU)")


@triton.jit
def _scaled(x, scale):
    return x * scale + 0.25


@triton.jit
def _helpers_in_a_loop(x_ptr, out_ptr, n, CALLS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n + cols, mask=cols < n, other=0.0).to(tl.float32)
    for _ in tl.static_range(CALLS):
        x = _scaled(x, 0.5)
    # tl.sum is triton.language.standard's: its globals hold triton.language.core, which the launch has not patched
    tl.store(out_ptr + row, tl.sum(tl.where(cols < n, x, 0.0), axis=0))


def _launch(rows, calls=6):
    x = torch.linspace(-2.0, 3.0, rows * 13).reshape(rows, 13)
    out = torch.empty(rows)
    _helpers_in_a_loop[(rows,)](x, out, 13, CALLS=calls, BLOCK=16)
    return out


def _count_builtin_walks(monkeypatch) -> list:
    """A list that gets one entry per ``_patch_builtin`` walk (one module's members) from now on."""
    walks, walk = [], interpreter._patch_builtin

    def counted(pkg, *args):
        walks.append(pkg)
        return walk(pkg, *args)

    monkeypatch.setattr(interpreter, "_patch_builtin", counted)
    return walks


def test_the_fix_is_applied():
    assert getattr(interpreter._patch_lang, "_tigon", False)


def test_a_launch_walks_the_language_once_whatever_its_programs_and_helper_calls(monkeypatch):
    _launch(1)  # the rewritten functions cached
    walks = _count_builtin_walks(monkeypatch)
    _launch(1, calls=1)
    one = len(walks)
    walks.clear()
    _launch(7, calls=6)
    # The launch's own patch (tl, tl.tensor, tl.math, the descriptor base: 4 walks) and tl.sum's first call, whose
    # module holds triton.language.core besides triton.language (6 more); without the fix 4 more for each of the
    # 7 x 6 helper calls.
    assert len(walks) == one <= 10


def test_results_are_bitwise_those_without_the_fix(monkeypatch):
    fixed = _launch(5)
    monkeypatch.setattr(interpreter, "_patch_lang", inspect.unwrap(interpreter._patch_lang))
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", inspect.unwrap(interpreter.GridExecutor.__call__))
    walks = _count_builtin_walks(monkeypatch)
    unfixed = _launch(5)
    assert len(walks) > 5 * 6 * 4  # the fix is off: each helper call walks the language again
    assert torch.equal(fixed, unfixed)
    x = torch.linspace(-2.0, 3.0, 5 * 13, dtype=torch.float64).reshape(5, 13)
    for _ in range(6):
        x = x * 0.5 + 0.25
    torch.testing.assert_close(fixed, x.sum(1).float(), rtol=1e-6, atol=1e-6)


def test_the_language_is_put_back_after_a_launch():
    _launch(3)
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.store) and tl.core.is_builtin(tl.arange)



@triton.jit
def _log_of_masked_lanes(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + cols, mask=cols < n, other=0.0)
    # log(0) = -inf and 0 * -inf = NaN in the padding lanes; tl.where keeps the others
    y = tl.where(cols < n, tl.log(x) * x, 0.0)
    tl.store(out_ptr + cols, y, mask=cols < n)


def test_a_kernel_computes_inf_and_nan_without_numpy_warnings():
    x = torch.rand(5) + 0.5
    out = torch.empty(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _log_of_masked_lanes[(1,)](x, out, 5, BLOCK=8)
    torch.testing.assert_close(out, x.log() * x)
    with pytest.warns(RuntimeWarning, match="divide by zero"):  # NumPy outside a launch: as it was
        np.log(np.zeros(1))
