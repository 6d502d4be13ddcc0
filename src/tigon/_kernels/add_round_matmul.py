r"""The last product of a chunked fp32 sum, added and rounded in one matmul: D = round(C + Aᵀ·B).

fused_linear_cross_entropy.py sums a 16-bit weight's gradient over token chunks in an fp32 accumulator
C (V, H), one matmul per chunk (cuBLAS adds its product into C itself), then rounds C to the weight's
dtype. cuBLAS cannot read an fp32 C and write a 16-bit D in one call, so the rounding is a cast kernel
of its own: it reads C (4·V·H bytes) and writes D (2·V·H) after the last chunk's matmul has read and
written C (8·V·H). Here the last chunk's matmul does both: with A = dl_c (K, M) the chunk's logit
gradients (tokens × classes), B = X_c (K, N) its inputs and C the sum of the earlier chunks' products,

    D[m, n] = round( C[m, n] + Σ_k A[k, m]·B[k, n] )           (M, N) = (V, H), K = the chunk's tokens

the product summed in an fp32 accumulator and added to C in fp32 before the one rounding: the same
value as cuBLAS's beta = 1 sum followed by the cast, up to the order of the products' sum (both fp32).
Bytes: A once (the M blocks of A are reused from L2 by the N/BN column tiles that follow each other,
``tile_position`` with GROUP 1), B from L2, C read once (4·M·N) and D written once (2·M·N): the
cast's traffic and the accumulator's write are gone (6·V·H bytes, 0.8 GB at V = 151936, H = 896).

A persistent Triton matmul (TMA loads of A and B, zero-filled past the edges, software-pipelined over
``STAGES`` buffers, loads and MMAs in their own warps with ``WARP_SPECIALIZE``); the epilogue loads C
with plain masked accesses (its rows are unit-stride, 4·BN bytes) after the tile's K loop, and stores D
by TMA where D's rows allow it (``D_TMA``), else with masked stores. C loaded before the K loop instead
(its latency behind the MMAs) held 64 more registers a thread through them: it spilled, and measured
several times slower (dev/tune_sum_round.py; docs/tuning.md, "Timings quoted in the source").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tigon._interpreter import interpreter_active
from tigon._kernels.launch import TigonOp, cdiv, wrap_triton
from tigon._kernels.logprob_tiles import (
    TensorDescriptor,
    tile_position,
    tile_programs,
    tma_operands,
    tma_rows,
)

# The interpreter computes tl.dot of 16-bit tiles in fp32 (numpy has no bf16 matmul): widen them there.
INTERPRET = tl.constexpr(interpreter_active())


@dataclass(frozen=True)
class SumRoundConfig:
    """The kernel's tiling, the fastest of dev/tune_sum_round.py's sweep (docs/tuning.md)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    num_warps: int = 8
    warp_specialize: bool = True
    # D stored by TMA (one bulk store a tile, from shared memory, where D's rows allow it) rather than by
    # masked stores: 4% faster at Qwen2.5-0.5B's head, 8% at Llama-3-8B's (dev/tune_sum_round.py).
    d_tma: bool = True

    def tiling(self) -> tuple:
        return (self.block_m, self.block_n, self.block_k, self.stages, self.num_warps, self.warp_specialize,
                self.d_tma)


DEFAULT_CONFIG = SumRoundConfig()


@triton.jit
def sum_round_tiles_kernel(
    a_desc, b_desc,                         # TMA: A (K, M) in (BK, BM) blocks; B (K, N) in (BK, BN) blocks
    c_ptr, c_row_stride,                    # (M, N) fp32: the sum so far
    d_ptr, d_row_stride,                    # (M, N) out, 16-bit or fp32 (may be C itself): C + Aᵀ·B
    d_desc,                                 # TMA: D in (BM, BN) blocks   [D_TMA]
    size_m, size_n, size_k,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, D_TMA: tl.constexpr,
):
    """D = round(C + Aᵀ·B) one (BM, BN) tile at a time (module docs)."""
    num_m = tl.cdiv(size_m, BM)
    num_n = tl.cdiv(size_n, BN)
    k_tiles = tl.cdiv(size_k, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE, num_stages=STAGES):
        pid_m, pid_n = tile_position(tile, num_m, num_n, 1)
        rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        cols = pid_n * BN + tl.arange(0, BN)
        inside = (rows[:, None] < size_m) & (cols[None, :] < size_n)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(k_tiles):
            a = a_desc.load([k * BK, pid_m * BM])          # (BK, BM)
            b = b_desc.load([k * BK, pid_n * BN])          # (BK, BN)
            if INTERPRET:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a.T, b, acc)                      # (BM, BN) fp32
        c = tl.load(c_ptr + rows[:, None] * c_row_stride + cols[None, :], mask=inside, other=0.0)
        d = (acc + c.to(tl.float32)).to(d_ptr.dtype.element_ty)
        if D_TMA:
            d_desc.store([pid_m * BM, pid_n * BN], d)
        else:
            tl.store(d_ptr + rows[:, None] * d_row_stride + cols[None, :], d, mask=inside)


def sum_round_available(a: torch.Tensor, b: torch.Tensor, wanted: bool | None) -> bool:
    """Whether the kernel can add A's product: the TMA operand rules of the log-prob head's tile kernel
    (``_logprob_tiles.tma_operands``: ``wanted`` None decides by the device, sm_90 or newer in eager mode;
    True wherever plain bf16/fp16 operands of one dtype, unit stride along their last dim, rows and
    addresses 16-byte aligned, allow it; False never)."""
    return tma_operands(a, b, wanted)


def _sum_round_impl(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor, block_m: int, block_n: int, block_k: int,
    stages: int, num_warps: int, warp_specialize: bool, d_tma: bool,
) -> None:
    """d = round(c + aᵀ·b): a (K, M), b (K, N), c (M, N) fp32, d (M, N) in a's dtype or fp32."""
    size_k, size_m = a.shape
    size_n = b.shape[1]
    tiles = cdiv(size_m, block_m) * cdiv(size_n, block_n)
    if tiles == 0:
        return
    programs = tile_programs(a.device)
    d_tma = d_tma and tma_rows(d)                   # else masked stores: any row stride
    wrap_triton(sum_round_tiles_kernel)[(min(programs, tiles),)](
        TensorDescriptor.from_tensor(a, [block_k, block_m]), TensorDescriptor.from_tensor(b, [block_k, block_n]),
        c, c.stride(0), d, d.stride(0), TensorDescriptor.from_tensor(d, [block_m, block_n]) if d_tma else None,
        size_m, size_n, size_k, BM=block_m, BN=block_n, BK=block_k, NUM_PROGRAMS=programs, STAGES=stages,
        WARP_SPECIALIZE=warp_specialize and a.is_cuda, D_TMA=d_tma, num_warps=num_warps,
    )


SUM_ROUND = TigonOp("sum_round_tiles_", _sum_round_impl, mutates_args={"d"})


def sum_round(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, out: torch.Tensor,
              config: SumRoundConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """``out`` = round(c + aᵀ·b) in out's dtype (a's): a (K, M), b (K, N), c (M, N) fp32 with unit
    stride along N. Callers check :func:`sum_round_available` first."""
    if c.dtype != torch.float32 or c.stride(-1) != 1 or out.stride(-1) != 1 or out.dtype != a.dtype:
        raise ValueError("sum_round: c must be fp32 and c, out unit-stride along their last dim, out in a's dtype")
    if a.shape[0] != b.shape[0] or c.shape != (a.shape[1], b.shape[1]) or out.shape != c.shape:
        raise ValueError(f"sum_round: shapes a {tuple(a.shape)}, b {tuple(b.shape)}, c {tuple(c.shape)}, "
                         f"out {tuple(out.shape)} do not match (K, M), (K, N), (M, N)")
    SUM_ROUND(a, b, c, out, *config.tiling())
    return out


def sum_round_reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """round(c + aᵀ·b), the product and the sum in fp64."""
    return (c.double() + a.double().t() @ b.double()).to(a.dtype)
