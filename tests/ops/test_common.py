"""Shared launcher helpers."""

import pytest
import torch

from tests.helpers import ON_GPU, randn
from tigon.ops._common import cache_by_size, matmul_to


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
