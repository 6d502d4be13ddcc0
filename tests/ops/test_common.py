"""Shared launcher helpers."""

import pytest
import torch
import triton
import triton.language as tl

from tests.helpers import DEVICE, ON_GPU, randn
from tigon._kernels import (
    cache_by_size,
    cast_all,
    copysign_nonnegative,
    fast_exp,
    fast_reciprocal,
    matmul_to,
    reciprocal_1_to_2,
    sum_rows_to,
)


class _SymbolicSize(int):
    """Stands in for a SymInt: an int that cannot be hashed."""

    __hash__ = None


def test_cache_by_size_caches_ints_and_passes_symbolic_sizes_through():
    calls = []

    @cache_by_size
    def geometry(n, *, backward=False):
        calls.append(n)
        return n * 2 + backward

    assert geometry(3) == geometry(3) == 6 and calls == [3]
    assert geometry(3, backward=True) == 7 and calls == [3, 3]
    assert geometry(_SymbolicSize(5)) == geometry(_SymbolicSize(5)) == 10 and calls == [3, 3, 5, 5]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
def test_matmul_to_returns_the_product_in_the_dtype_asked(dtype):
    """A weight gradient (aᵀ·b, a transposed view) in the weight's dtype. Off the GPU, and for the
    operands' own dtype, it is the plain product (cast): bitwise what ``(a @ b).to(dtype)`` gives."""
    a, b = randn(24, 40, dtype=torch.bfloat16).t(), randn(24, 12, dtype=torch.bfloat16)
    got = matmul_to(a, b, dtype)
    assert got.dtype == dtype and got.shape == (40, 12)
    if dtype == torch.bfloat16 or not ON_GPU:
        assert torch.equal(got, (a @ b).to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_matmul_to_fp32_is_the_unrounded_product_on_the_gpu(dtype):
    """On the GPU the bf16 (fp16) matmul writes its fp32 accumulator: nearer the exact product than
    the product rounded to bf16 (fp16) and cast to fp32."""
    a, b = randn(4096, 512, dtype=dtype).t(), randn(4096, 256, dtype=dtype)
    exact = a.double() @ b.double()
    got = matmul_to(a, b, torch.float32)
    rounded = (a @ b).float()
    err = ((got.double() - exact).norm() / exact.norm()).item()
    err_rounded = ((rounded.double() - exact).norm() / exact.norm()).item()
    assert got.dtype == torch.float32 and err < 1e-5 < err_rounded, (err, err_rounded)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_cast_all_is_bitwise_the_separate_casts(dtype):
    """Each output is what ``.to(dtype)`` gives (values, sizes, strides); None stays None, a tensor
    already in the dtype comes back as itself, and the sources are untouched."""
    weight, transposed, bias = randn(33, 17), randn(9, 33).t(), randn(33)
    same = randn(5, dtype=dtype)
    tensors = (weight, None, transposed, bias, same)
    before = [t.clone() if t is not None else None for t in tensors]
    got = cast_all(tensors, dtype)
    assert got[1] is None and got[4] is same
    for t, g in zip((weight, transposed, bias), (got[0], got[2], got[3]), strict=True):
        want = t.to(dtype)
        assert g.dtype == dtype and g.stride() == want.stride() and torch.equal(g, want)
    for t, b in zip(tensors, before, strict=True):
        assert t is None or torch.equal(t, b)
    assert cast_all((weight,), dtype)[0].dtype == dtype and cast_all((None, None), dtype) == [None, None]


@pytest.mark.gpu
def test_cast_all_is_one_kernel_on_the_gpu():
    tensors = [randn(64, 48), randn(64), randn(48, 64)]
    cast_all(tensors, torch.bfloat16)  # warm up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        cast_all(tensors, torch.bfloat16)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, [e.name for e in kernels]


def test_sum_rows_to_is_the_bias_gradient():
    """Off the GPU (and for the operand's own dtype) bitwise the stock's sum then cast; on the GPU
    the fp32 sum is not rounded to bf16 first."""
    t = randn(300, 24, dtype=torch.bfloat16)
    assert torch.equal(sum_rows_to(t, torch.bfloat16), t.sum(0))
    got = sum_rows_to(t, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (24,)
    if ON_GPU:
        exact = t.double().sum(0)
        assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    else:
        assert torch.equal(got, t.sum(0).float())


@triton.jit
def _transcendentals_kernel(x_ptr, exp_ptr, rcp_ptr, sign_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=1.0)
    tl.store(exp_ptr + offsets, fast_exp(x), mask=mask)
    tl.store(rcp_ptr + offsets, fast_reciprocal(x), mask=mask)
    tl.store(sign_ptr + offsets, copysign_nonnegative(tl.abs(x * 3.0), x), mask=mask)


def test_fast_transcendentals_match_fp64():
    """fast_exp within the ex2 approximation's few ulp (relative 2^-21 plus what the argument's
    rounding carries: |x|·2^-24), flushing to 0 only below 2^-126; fast_reciprocal within 1 ulp
    (PTX rcp.approx.ftz on the GPU, a division in the interpreter); copysign exact, -0 included."""
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 80.0, -80.0, -87.0, -88.0, -104.0, -120.0],
                           device=DEVICE)
    x = torch.cat([special, randn(1000, scale=20.0)])
    got_exp, got_rcp, got_sign = (torch.empty_like(x) for _ in range(3))
    _transcendentals_kernel[(triton.cdiv(x.numel(), 256),)](x, got_exp, got_rcp, got_sign, x.numel(), BLOCK=256)
    x64 = x.double()
    exact_exp = x64.exp()
    normal = exact_exp >= 2.0**-126
    exp_err = ((got_exp.double() - exact_exp).abs() / exact_exp)[normal]
    assert (exp_err <= 2.0**-21 + x64.abs()[normal] * 2.0**-24 * 1.5).all(), exp_err.max()
    assert (got_exp[~normal] <= 2.0**-126).all()
    nonzero = x != 0
    exact_rcp = 1.0 / x64[nonzero]
    assert ((got_rcp.double()[nonzero] - exact_rcp).abs() <= exact_rcp.abs() * 2.0**-23).all()
    expected_sign = torch.copysign((x * 3.0).abs(), x)
    assert torch.equal(got_sign.view(torch.int32), expected_sign.view(torch.int32))


@triton.jit
def _reciprocal_1_to_2_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, reciprocal_1_to_2(tl.load(x_ptr + offsets, mask=mask, other=1.0)), mask=mask)


def test_reciprocal_1_to_2_within_rcp_accuracy():
    """The FMA-only reciprocal over all of [1, 2] (ends included): within one ulp (2^-23 relative for
    results in [0.5, 1]), as rcp.approx is (~1.2·2^-24 with fused multiply-adds, ~1.5·2^-24 in the
    interpreter, which rounds each product)."""
    x = torch.cat([torch.tensor([1.0, 2.0, 1.5, 1.0 + 2.0**-23, 2.0 - 2.0**-23], device=DEVICE),
                   torch.rand(4096, device=DEVICE) + 1.0])
    got = torch.empty_like(x)
    _reciprocal_1_to_2_kernel[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), BLOCK=1024)
    exact = 1.0 / x.double()
    assert ((got.double() - exact).abs() / exact).max() <= 2.0**-23
