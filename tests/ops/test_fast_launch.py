"""FastLaunch: eager launches of a cached compiled kernel, keyed by everything Triton specializes on.

On the CPU the kernel and its compiled form are stand-ins that record how they were called (the
interpreter has no compiled kernels); on the GPU a real kernel is launched through it with arguments
that change each specialization (pointer alignment, an int equal to 1 or a multiple of 16), and
every result is checked.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensorMode
from triton import knobs

from tigon._kernels import FastLaunch, wrap_triton
from tigon._kernels import launch as _launch
from tigon._kernels.launch import _direct_launch


def _signature(x_ptr, y_ptr, n, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = "a"):
    pass


class FakeCompiled:
    def __init__(self, kernel):
        self.kernel = kernel
        self.function = object()
        self.packed_metadata = object()
        self.run = self._run

    def _run(self, *args):
        self.kernel.fast_calls.append(args)


class FakeKernel:
    """What FastLaunch uses of a JITFunction: signature, constexprs, fn, kernel[grid](...)."""

    def __init__(self):
        self.signature = inspect.signature(_signature)
        self.constexprs = [5, 6]
        self.fn = _signature
        self.slow_calls = []
        self.fast_calls = []
        self.compiled = FakeCompiled(self)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.slow_calls.append((grid, args, kwargs))
            return self.compiled

        return launch


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)


def _args(x, y, n=96, scale=0.5, flag=True):
    return (x, y, n, scale, flag)


def test_second_launch_of_a_specialization_is_direct(fake_cuda):
    kernel = FakeKernel()
    launch = FastLaunch(kernel)
    x, y = torch.randn(8), torch.randn(8)
    launch[(3,)](*_args(x, y), BLOCK=64, num_warps=4)
    assert len(kernel.slow_calls) == 1 and not kernel.fast_calls
    launch[(3, 2)](*_args(x, y, n=112, scale=2.0), BLOCK=64, num_warps=4)
    assert len(kernel.slow_calls) == 1
    (call,) = kernel.fast_calls
    # grid padded to 3 dims, the stream, the compiled function and metadata, no hooks, then every
    # parameter in signature order: positional ones, BLOCK from the keywords, MODE's default.
    assert call[:9] == (3, 2, 1, 1234, kernel.compiled.function, kernel.compiled.packed_metadata, None, None, None)
    assert call[9:11] == (x, y) and call[11:] == (112, 2.0, True, 64, "a")


@pytest.mark.parametrize(
    "change",
    [
        dict(n=1),                      # Triton makes an int equal to 1 a constant
        dict(n=97),                     # no longer a multiple of 16
        dict(n=2**31),                  # i64 instead of i32
        dict(n=2**63),                  # u64
        dict(flag=False),               # bools by value
        dict(scale=None),               # None is a constant
        dict(dtype=torch.float64),      # another pointer type
        dict(misaligned=True),          # address not a multiple of 16
        dict(BLOCK=128),                # another constexpr
        dict(MODE="b"),                 # a constexpr that was left at its default
        dict(num_warps=8),              # another launch option
    ],
)
def test_every_specialization_change_compiles_its_own(fake_cuda, change):
    kernel = FakeKernel()
    launch = FastLaunch(kernel)
    base = torch.randn(64)
    launch[(1,)](*_args(base[:8], base[8:16]), BLOCK=64, num_warps=4)
    change = dict(change)
    x = base[1:9] if change.pop("misaligned", False) else base[:8]
    x = x.to(change.pop("dtype")) if "dtype" in change else x
    kwargs = dict(BLOCK=change.pop("BLOCK", 64), num_warps=change.pop("num_warps", 4))
    if "MODE" in change:
        kwargs["MODE"] = change.pop("MODE")
    launch[(1,)](*_args(x, base[8:16], **change), **kwargs)
    assert len(kernel.slow_calls) == 2 and not kernel.fast_calls
    assert len(launch.cache) == 2


def test_same_specialization_other_values_hit(fake_cuda):
    kernel = FakeKernel()
    launch = FastLaunch(kernel)
    base = torch.randn(256)
    launch[(1,)](*_args(base[:8], base[8:16], n=17), BLOCK=64)
    launch[(5,)](*_args(base[32:40], base[64:72], n=33, scale=-1.0), BLOCK=64)  # 16-float offsets: aligned
    assert len(kernel.slow_calls) == 1 and len(kernel.fast_calls) == 1


def test_positional_constexpr_is_keyed_by_value(fake_cuda):
    kernel = FakeKernel()
    launch = FastLaunch(kernel)
    x = torch.randn(8)
    launch[(1,)](x, x, 96, 0.5, True, 64)
    launch[(1,)](x, x, 96, 0.5, True, 128)
    assert len(kernel.slow_calls) == 2


def test_unknown_argument_types_and_callable_grids_take_tritons_path(fake_cuda):
    kernel = FakeKernel()
    launch = FastLaunch(kernel)

    class Sub(torch.Tensor):
        pass

    x = torch.randn(8)
    for _ in range(2):
        launch[(1,)](x.as_subclass(Sub), x, 96, 0.5, True, BLOCK=64)
        launch[lambda meta: (1,)](x, x, 96, 0.5, True, BLOCK=64)
        launch[(1,)](x, x, 96, 0.5, True, BLOCK=[64])           # an unhashable keyword value
    assert len(kernel.slow_calls) == 6 and not kernel.fast_calls and not launch.cache


def test_launch_hooks_take_tritons_path(fake_cuda, monkeypatch):
    kernel = FakeKernel()
    launch = FastLaunch(kernel)
    x = torch.randn(8)
    launch[(1,)](x, x, 96, 0.5, True, BLOCK=64)
    hooks = knobs.HookChain()
    hooks.add(lambda metadata: None)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hooks)
    launch[(1,)](x, x, 96, 0.5, True, BLOCK=64)
    assert len(kernel.slow_calls) == 2 and not kernel.fast_calls


def test_tritons_path_waits_for_the_compiler_key_and_a_direct_launch_does_not(fake_cuda, monkeypatch):
    # Triton's lookup needs the key the prehash thread may be hashing (tigon/_kernels/triton_key.py)
    kernel = FakeKernel()
    launch = FastLaunch(kernel)
    waits = []
    monkeypatch.setattr(_launch, "wait_for_triton_key", lambda: waits.append(len(kernel.slow_calls)))
    x = torch.randn(8)
    launch[(1,)](x, x, 96, 0.5, True, BLOCK=64)                  # a miss: Triton's path
    launch[(1,)](x, x, 96, 0.5, True, BLOCK=64)                  # a hit: direct
    launch[lambda meta: (1,)](x, x, 96, 0.5, True, BLOCK=64)     # not keyed: Triton's path
    assert waits == [0, 1] and len(kernel.fast_calls) == 1       # each wait before Triton's launch


def test_missing_argument_is_a_clear_error(fake_cuda):
    class Compiles(FakeKernel):
        pass

    kernel = Compiles()
    launch = FastLaunch(kernel)
    x = torch.randn(8)
    with pytest.raises(TypeError, match="BLOCK"):
        launch[(1,)](x, x, 96, 0.5, True)


def test_wrap_triton_picks_the_path(monkeypatch):
    kernel = FakeKernel()
    monkeypatch.setattr(_launch, "_is_jit_kernel", lambda k: k is kernel)
    monkeypatch.setattr(_launch, "_torch_wrap_triton", lambda k: ("traceable", k))
    with FakeTensorMode():                                      # a dispatch mode: something traces
        assert wrap_triton(kernel) == ("traceable", kernel)
    with _direct_launch(), FakeTensorMode():                    # the registered op's eager run
        assert type(wrap_triton(kernel)) is FastLaunch
    first = wrap_triton(kernel)                                 # nothing traces (a backward, say)
    assert type(first) is FastLaunch and wrap_triton(kernel) is first   # one launcher per kernel
    other = object()
    if _launch.interpreter_active():
        assert wrap_triton(other) is other                      # interpreted kernels launch as they are


# ------------------------------------------------------------------------------------------------ GPU


@triton.jit
def _axpb_kernel(x_ptr, y_ptr, n, a, b, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(y_ptr + offsets, (a * x + b).to(y_ptr.dtype.element_ty), mask=mask)


@pytest.mark.gpu
def test_real_kernel_through_every_specialization():
    base = torch.randn(4096, device="cuda")
    out = torch.zeros(4096, device="cuda")
    with _direct_launch():
        launcher = wrap_triton(_axpb_kernel)
        assert type(launcher) is FastLaunch
        cases = [(0, 1024), (0, 1000), (1, 1000), (1, 1), (3, 17), (0, 1024), (1, 1000), (16, 2048), (5, 1)]
        for offset, n in cases * 2:
            x, y = base[offset:offset + n], out[offset:offset + n]
            y.zero_()
            launcher[(triton.cdiv(n, 256),)](x, y, n, 1.5, -0.25, BLOCK=256)
            torch.testing.assert_close(y, 1.5 * x - 0.25, rtol=1e-6, atol=1e-6)
    assert 1 < len(launcher.cache) <= len(cases)


def test_shapes_only_launches_nothing_and_counts_as_tracing():
    """A fake implementation runs its launcher so: nothing launched, nothing cached for real calls."""
    kernel = FakeKernel()
    assert not _launch.tracing_active()
    with _launch.shapes_only():
        assert _launch.tracing_active()
        assert wrap_triton(kernel)[(4,)](torch.randn(3), 7, BLOCK=16) is None
    assert not _launch.tracing_active()
    assert kernel.slow_calls == [] and kernel.fast_calls == []
