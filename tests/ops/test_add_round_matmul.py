"""The add-and-round matmul of _kernels/add_round_matmul.py: D = round(C + Aᵀ·B), against float64.

The product is summed in fp32 and added to C in fp32 before the one rounding, so each output is within
half a unit in the last place of the exact value plus the fp32 sum's error (assert_rounded_once).
Sizes: K not a multiple of the K block (TMA zero-fills past the edge), M and N not multiples of the tile
(masked or TMA-clipped epilogue), several tiles per program of the persistent loop.
"""

import dataclasses

import pytest
import torch

from tests.helpers import DEVICE, randn
from tigon._kernels import SumRoundConfig, sum_round, sum_round_available, sum_round_reference

TILE_DTYPES = (torch.bfloat16, torch.float16)
SMALL = SumRoundConfig(block_m=32, block_n=32, block_k=16, stages=2, num_warps=4)
MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11}


def assert_rounded_once(out: torch.Tensor, a, b, c) -> None:
    """Each output within half a unit in the last place of its exact value plus the fp32 sum's error
    bound, (K + 2)·2^-24·(|c| + Σ_k |a|·|b|): where C and the product nearly cancel, fp32's error is
    many ulps of the small result. (fp16's subnormals have the fixed spacing smallest normal × eps.)"""
    exact = c.double() + a.double().t() @ b.double()
    info = torch.finfo(out.dtype)
    exponent = torch.frexp(exact.abs().clamp_min(1e-30))[1]
    ulp = torch.ldexp(torch.ones_like(exact), exponent - MANTISSA_BITS[out.dtype]).clamp_min(
        info.smallest_normal * info.eps)
    fp32_error = (a.shape[0] + 2) * 2.0**-24 * (c.double().abs() + a.double().abs().t() @ b.double().abs())
    excess = (out.double() - exact).abs() - (0.5 * ulp + fp32_error)
    assert excess.max().item() <= 0, f"{int((excess > 0).sum())} outputs beyond one rounding"


def operands(k, m, n, dtype):
    a = randn(k, m, dtype=dtype, scale=0.3)
    b = randn(k, n, dtype=dtype)
    c = randn(m, n, scale=4.0)
    return a, b, c


@pytest.mark.parametrize("dtype", TILE_DTYPES)
@pytest.mark.parametrize("size", [(57, 104, 40), (16, 32, 32), (130, 72, 96)])
def test_sum_round_matches_fp64(dtype, size):
    k, m, n = size
    a, b, c = operands(k, m, n, dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    sum_round(a, b, c, out, SMALL)
    assert_rounded_once(out, a, b, c)
    assert torch.equal(sum_round_reference(a, b, c), (c.double() + a.double().t() @ b.double()).to(dtype))


@pytest.mark.parametrize("dtype", TILE_DTYPES)
@pytest.mark.parametrize("d_tma", [True, False])
@pytest.mark.parametrize("out_extra", [8, 3])
def test_sum_round_strided_operands(dtype, d_tma, out_extra):
    """A and B column slices of wider matrices (row strides > width), C and D rows of wider ones; D's
    rows 16-byte aligned (stored by TMA when asked) or not (masked stores whatever is asked)."""
    k, m, n = 45, 64, 48
    a_wide, b_wide, c_wide = operands(k, m + 24, n + 16, dtype)
    a, b, c = a_wide[:, 8:8 + m], b_wide[:, 8:8 + n], c_wide[:m, 16:16 + n]
    out_wide = torch.full((m, n + out_extra), float("nan"), dtype=dtype, device=DEVICE)
    out = out_wide[:, :n]
    assert sum_round_available(a, b, True)
    sum_round(a, b, c, out, dataclasses.replace(SMALL, d_tma=d_tma))
    assert_rounded_once(out, a, b, c)
    assert torch.isnan(out_wide[:, n:]).all()  # nothing written past the output's columns


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", TILE_DTYPES)
def test_sum_round_default_tiling(dtype):
    """The shipped tiling on a chunk the shape of the benchmark's (several hundred tiles, K 1000)."""
    k, m, n = 1000, 4104, 904
    a, b, c = operands(k, m, n, dtype)
    out = torch.empty(m, n, dtype=dtype, device=DEVICE)
    sum_round(a, b, c, out)
    assert_rounded_once(out, a, b, c)


def test_sum_round_availability():
    a, b, _ = operands(16, 32, 32, torch.bfloat16)
    assert sum_round_available(a, b, True)
    assert not sum_round_available(a, b, False)
    assert not sum_round_available(a.float(), b.float(), True)            # fp32: cuBLAS's IEEE product
    assert not sum_round_available(a, b.half(), True)                      # mixed dtypes
    assert not sum_round_available(a[:, 1:], b, True)                      # address not 16-byte aligned
    odd = randn(16, 33, dtype=torch.bfloat16)[:, :32]
    assert not sum_round_available(odd, b, True)                           # row stride 66 bytes
    assert not sum_round_available(a.t().contiguous().t(), b, True)        # not unit stride along M
    if DEVICE.type != "cuda":
        assert not sum_round_available(a, b, None)                         # only a GPU decides for it


def test_sum_round_bad_inputs():
    a, b, c = operands(16, 32, 32, torch.bfloat16)
    out = torch.zeros(32, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="fp32"):
        sum_round(a, b, c.bfloat16(), out, SMALL)
    with pytest.raises(ValueError, match="a's dtype"):
        sum_round(a, b, c, out.half(), SMALL)
    with pytest.raises(ValueError, match="do not match"):
        sum_round(a, b[:8], c, out, SMALL)
    with pytest.raises(ValueError, match="do not match"):
        sum_round(a, b, c[:16], out, SMALL)
    assert torch.equal(out, torch.zeros_like(out))  # nothing written
