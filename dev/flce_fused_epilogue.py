"""Fused linear CE with the CE work in a Triton matmul's epilogue: a measurement, not shipped code.

    PYTHONPATH=src python3 dev/flce_fused_epilogue.py                            # GPU: timings
    TRITON_INTERPRET=1 PYTHONPATH=src python3 dev/flce_fused_epilogue.py check   # CPU: correctness

An experiment kept out of the package (STYLE: llm.c habit). By classes (fused_linear_cross_entropy.py),
each chunk of logits is written by cuBLAS and then read by tigon's statistics kernel (pass 1) or
overwritten with the gradient (pass 2). Here the matmul X·W_cᵀ is a Triton kernel whose epilogue does
that work instead: per-tile (max, Σ exp) statistics (no logits written), or the gradient
(softmax − onehot)·scale. Plain options only (no bias, weights, smoothing, z-loss or softcap); the
logits are rounded to bf16 before the epilogue, as the cuBLAS path rounds them. At Qwen2.5-0.5B's head
(N = 8192, H = 896, chunks of 4608 classes) it times cuBLAS + tigon's kernels against pointer-based
tiles and persistent TMA tiles with warp specialisation, each launch timed by the harness's
``gpu_time`` (the logged run used a CUDA-event loop with L2 flushed). Findings:
benchmarks/results/2026-11-23/tune_flce_fused.log (the TMA epilogues would save ~2 ms of 16; not
enough to pass torch.compile's 12.9 ms, because by classes needs a fourth matmul).
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

import tigon.ops  # noqa: F401
from tigon._kernels import REDUCTION_SCALES, VOCAB_CHUNK_GRAD, VOCAB_CHUNK_STATS
from tigon.bench.harness import gpu_time

LOG2E = 1.4426950408889634
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _tile(pid, num_m, num_n, GROUP: tl.constexpr):
    per_group = GROUP * num_n
    group = pid // per_group
    first_m = group * GROUP
    size = tl.minimum(num_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % size
    pid_n = (pid % per_group) // size
    return pid_m, pid_n


@triton.jit
def _mm_tile(X, W, sx, sw, rows, cols, H, offs_m, offs_n, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr):
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    a_ptr = X + offs_m[:, None] * sx + offs_k[None, :]
    b_ptr = W + offs_n[:, None] * sw + offs_k[None, :]
    for k in range(0, tl.cdiv(H, BK)):
        kmask = offs_k[None, :] < H - k * BK
        a = tl.load(a_ptr, mask=(offs_m[:, None] < rows) & kmask, other=0.0)
        b = tl.load(b_ptr, mask=(offs_n[:, None] < cols) & kmask, other=0.0)
        if INTERPRET:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptr += BK
        b_ptr += BK
    return acc


@triton.jit
def mm_kernel(X, W, OUT, rows, cols, H, sx, sw, so, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              GROUP: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), tl.cdiv(rows, BM), tl.cdiv(cols, BN), GROUP)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    acc = _mm_tile(X, W, sx, sw, rows, cols, H, offs_m, offs_n, BM, BN, BK)
    mask = (offs_m[:, None] < rows) & (offs_n[None, :] < cols)
    tl.store(OUT + offs_m[:, None] * so + offs_n[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def mm_stats_kernel(X, W, M_OUT, S_OUT, rows, cols, H, sx, sw, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, GROUP: tl.constexpr):
    """Per (row, column tile): max and sum of exp of the bf16-rounded logits."""
    pid_m, pid_n = _tile(tl.program_id(0), tl.cdiv(rows, BM), tl.cdiv(cols, BN), GROUP)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    acc = _mm_tile(X, W, sx, sw, rows, cols, H, offs_m, offs_n, BM, BN, BK)
    z = acc.to(X.dtype.element_ty).to(tl.float32) * 1.4426950408889634
    z = tl.where(offs_n[None, :] < cols, z, float("-inf"))
    m = tl.max(z, 1)
    s = tl.sum(tl.exp2(z - m[:, None]), 1)
    tl.store(M_OUT + pid_n * rows + offs_m, m, mask=offs_m < rows)
    tl.store(S_OUT + pid_n * rows + offs_m, s, mask=offs_m < rows)


@triton.jit
def mm_grad_kernel(X, W, G, LSE, TARGET, SCALE, rows, cols, H, sx, sw, sg, col0, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """G = (softmax - onehot) * scale of the bf16-rounded logits, given the rows' lse (natural log)."""
    pid_m, pid_n = _tile(tl.program_id(0), tl.cdiv(rows, BM), tl.cdiv(cols, BN), GROUP)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    acc = _mm_tile(X, W, sx, sw, rows, cols, H, offs_m, offs_n, BM, BN, BK)
    rmask = offs_m < rows
    lse = tl.load(LSE + offs_m, mask=rmask, other=0.0) * 1.4426950408889634
    tgt = tl.load(TARGET + offs_m, mask=rmask, other=-1) - col0
    scale = tl.load(SCALE + offs_m, mask=rmask, other=0.0)
    z = acc.to(X.dtype.element_ty).to(tl.float32) * 1.4426950408889634
    p = tl.exp2(z - lse[:, None])
    g = (p - tl.where(offs_n[None, :] == tgt[:, None], 1.0, 0.0)) * scale[:, None]
    mask = rmask[:, None] & (offs_n[None, :] < cols)
    tl.store(G + offs_m[:, None] * sg + offs_n[None, :], g.to(G.dtype.element_ty), mask=mask)


@triton.jit
def tma_kernel(x_desc, w_desc, OUT, M_OUT, S_OUT, LSE, TARGET, SCALE, rows, cols, H, so, col0,
               MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
               NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    """Persistent TMA matmul of X (rows, H) by W (cols, H)^T with one of three epilogues:
    MODE 0 stores the bf16 logits, 1 the per-tile (max, sum exp) statistics, 2 the gradient."""
    num_m = tl.cdiv(rows, BM)
    num_n = tl.cdiv(cols, BN)
    k_tiles = tl.cdiv(H, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=FLATTEN, warp_specialize=WS,
                         num_stages=STAGES):
        pid_m, pid_n = _tile(tile, num_m, num_n, GROUP)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([pid_m * BM, ki * BK])
            b = w_desc.load([pid_n * BN, ki * BK])
            if INTERPRET:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        rmask = offs_m < rows
        if MODE == 0:
            mask = rmask[:, None] & (offs_n[None, :] < cols)
            tl.store(OUT + offs_m[:, None] * so + offs_n[None, :], acc.to(OUT.dtype.element_ty), mask=mask)
        elif MODE == 1:
            z = acc.to(OUT.dtype.element_ty).to(tl.float32) * 1.4426950408889634
            z = tl.where(offs_n[None, :] < cols, z, float("-inf"))
            m = tl.max(z, 1)
            ssum = tl.sum(tl.exp2(z - m[:, None]), 1)
            tl.store(M_OUT + pid_n * rows + offs_m, m, mask=rmask)
            tl.store(S_OUT + pid_n * rows + offs_m, ssum, mask=rmask)
        else:
            lse = tl.load(LSE + offs_m, mask=rmask, other=0.0) * 1.4426950408889634
            tgt = tl.load(TARGET + offs_m, mask=rmask, other=-1) - col0
            scale = tl.load(SCALE + offs_m, mask=rmask, other=0.0)
            z = acc.to(OUT.dtype.element_ty).to(tl.float32) * 1.4426950408889634
            g = (tl.exp2(z - lse[:, None]) - tl.where(offs_n[None, :] == tgt[:, None], 1.0, 0.0)) * scale[:, None]
            mask = rmask[:, None] & (offs_n[None, :] < cols)
            tl.store(OUT + offs_m[:, None] * so + offs_n[None, :], g.to(OUT.dtype.element_ty), mask=mask)


def tma(mode, x, w, out, cfg, m=None, s=None, lse=None, target=None, scale=None, col0=0):
    from triton.tools.tensor_descriptor import TensorDescriptor
    bm, bn, bk, warps, stages, flatten, ws = cfg
    sms = torch.cuda.get_device_properties(0).multi_processor_count if x.is_cuda else 4
    tiles = triton.cdiv(x.shape[0], bm) * triton.cdiv(w.shape[0], bn)
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w, [bn, bk])
    dummy = out
    tma_kernel[(min(sms, tiles),)](
        xd, wd, out, m if m is not None else dummy, s if s is not None else dummy,
        lse if lse is not None else dummy, target if target is not None else dummy,
        scale if scale is not None else dummy, x.shape[0], w.shape[0], x.shape[1], out.stride(0), col0,
        MODE=mode, BM=bm, BN=bn, BK=bk, GROUP=8, NUM_SMS=min(sms, tiles), FLATTEN=flatten, WS=ws, STAGES=stages,
        num_warps=warps, num_stages=stages)


def grid(rows, cols, bm, bn):
    return (triton.cdiv(rows, bm) * triton.cdiv(cols, bn),)


def mm(x, w, out, cfg):
    bm, bn, bk, warps, stages = cfg
    mm_kernel[grid(x.shape[0], w.shape[0], bm, bn)](
        x, w, out, x.shape[0], w.shape[0], x.shape[1], x.stride(0), w.stride(0), out.stride(0),
        BM=bm, BN=bn, BK=bk, GROUP=8, num_warps=warps, num_stages=stages)


def mm_stats(x, w, m_out, s_out, cfg):
    bm, bn, bk, warps, stages = cfg
    mm_stats_kernel[grid(x.shape[0], w.shape[0], bm, bn)](
        x, w, m_out, s_out, x.shape[0], w.shape[0], x.shape[1], x.stride(0), w.stride(0),
        BM=bm, BN=bn, BK=bk, GROUP=8, num_warps=warps, num_stages=stages)


def mm_grad(x, w, g, lse, target, scale, col0, cfg):
    bm, bn, bk, warps, stages = cfg
    mm_grad_kernel[grid(x.shape[0], w.shape[0], bm, bn)](
        x, w, g, lse, target, scale, x.shape[0], w.shape[0], x.shape[1], x.stride(0), w.stride(0), g.stride(0),
        col0, BM=bm, BN=bn, BK=bk, GROUP=8, num_warps=warps, num_stages=stages)


def lse_of(m, s):
    """Combine per-tile (max, sum) in log2 units into natural-log lse per row."""
    top = m.max(0).values
    return (top + torch.log2((s * torch.exp2(m - top)).sum(0))) / LOG2E


def check():
    torch.manual_seed(0)
    n, h, c = 37, 40, 300
    x = torch.randn(n, h, dtype=torch.bfloat16)
    w = torch.randn(c, h, dtype=torch.bfloat16) * 0.3
    target = torch.randint(0, c, (n,))
    cfg = (32, 64, 16, 4, 2)
    tiles = triton.cdiv(c, cfg[1])
    m = torch.empty(tiles, n)
    s = torch.empty(tiles, n)
    mm_stats(x, w, m, s, cfg)
    logits = (x.double() @ w.double().t()).to(torch.bfloat16).double()
    ref_lse = torch.logsumexp(logits, 1)
    lse = lse_of(m, s)
    print("lse err", ((lse.double() - ref_lse).abs().max() / ref_lse.abs().max()).item())
    out = torch.empty(n, c, dtype=torch.bfloat16)
    mm(x, w, out, cfg)
    print("mm err", ((out.double() - logits).norm() / logits.norm()).item())
    g = torch.empty(n, c, dtype=torch.bfloat16)
    scale = torch.full((n,), 1.0 / n)
    mm_grad(x, w, g, ref_lse.float(), target, scale, 0, cfg)
    ref_g = (torch.softmax(logits, 1) - torch.nn.functional.one_hot(target, c)) / n
    print("grad err", ((g.double() - ref_g).norm() / ref_g.norm()).item())
    tcfg = (32, 64, 16, 4, 2, False, False)
    out2 = torch.empty(n, c, dtype=torch.bfloat16)
    tma(0, x, w, out2, tcfg)
    print("tma mm err", ((out2.double() - logits).norm() / logits.norm()).item())
    tma(1, x, w, out2, tcfg, m=m, s=s)
    print("tma lse err", ((lse_of(m, s).double() - ref_lse).abs().max()).item())
    tma(2, x, w, out2, tcfg, lse=ref_lse.float(), target=target, scale=scale)
    print("tma grad err", ((out2.double() - ref_g).norm() / ref_g.norm()).item())


POINTER_CONFIGS = ((128, 256, 64, 8, 3), (256, 128, 64, 8, 3))  # BM, BN, BK, warps, stages
TMA_CONFIGS = (  # BM, BN, BK, warps, stages, flatten, warp_specialize
    (128, 256, 64, 8, 3, False, False), (128, 256, 64, 8, 3, True, False), (128, 256, 64, 8, 4, True, False),
    (128, 128, 64, 8, 4, True, False), (256, 128, 64, 8, 3, True, False), (128, 128, 64, 4, 4, True, False),
    (128, 256, 64, 8, 3, True, True), (128, 128, 64, 4, 4, True, True), (128, 128, 64, 8, 4, True, True),
)


def time_config(label, cfg, launch, x, wc, chunk, lse_t, target, scale_rows, flops):
    """The three epilogues of one tiling: logits, statistics (checked against lse_t), gradient."""
    n = x.shape[0]
    tiles = triton.cdiv(wc.shape[0], cfg[1])
    m = torch.empty(tiles, n, device=x.device)
    s = torch.empty(tiles, n, device=x.device)
    try:
        t1 = gpu_time(lambda: launch(0, x, wc, chunk, cfg), 0.15)
        t2 = gpu_time(lambda: launch(1, x, wc, chunk, cfg, m=m, s=s), 0.15)
        t3 = gpu_time(lambda: launch(2, x, wc, chunk, cfg, lse=lse_t, target=target, scale=scale_rows), 0.15)
    except Exception as e:  # noqa: BLE001  (a tiling this Triton cannot compile: say so, go on)
        print(f"  {label} cfg {cfg}: {type(e).__name__} {str(e)[:160]}", flush=True)
        return
    err = (lse_of(m, s) - lse_t).abs().max().item()
    print(f"  {label} cfg {cfg}: mm {t1:.3f} ({flops / t1 / 1e9:.0f} TF/s), mm+stats {t2:.3f}, "
          f"mm+grad {t3:.3f}  (lse err {err:.1e})", flush=True)


def pointer_launch(mode, x, w, out, cfg, m=None, s=None, lse=None, target=None, scale=None):
    if mode == 0:
        mm(x, w, out, cfg)
    elif mode == 1:
        mm_stats(x, w, m, s, cfg)
    else:
        mm_grad(x, w, out, lse, target, scale, 0, cfg)


def bench():
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    n, h, vocab, c = 8192, 896, 151936, 4608
    x = torch.randn(n, h, device=dev, dtype=bf)
    w = (torch.randn(vocab, h, device=dev) * h**-0.5).to(bf)
    target = torch.randint(0, vocab, (n,), device=dev)
    scales, _ = REDUCTION_SCALES(target, None, -100, "mean", vocab)
    opts = (-100, 0.0, 0.0, None, 1.0)
    wc = w[:c]
    flops = 2 * n * h * c
    chunk = torch.empty(n, c, device=dev, dtype=bf)
    state = torch.empty(4, n, device=dev)
    start_state = torch.tensor([[-1e4], [1.0], [0.0], [0.0]], device=dev).expand_as(state)
    lse_t = torch.logsumexp((x.float() @ wc.float().t()), 1).contiguous()
    scale_rows = torch.full((n,), 1.0 / n, device=dev)

    def cublas_mm():
        torch.mm(x, wc.t(), out=chunk)

    def cublas_stats():
        torch.mm(x, wc.t(), out=chunk)
        state.copy_(start_state)
        VOCAB_CHUNK_STATS(chunk, target, None, scales, state, torch.empty(n, device=dev), torch.empty(n, device=dev),
                    0, vocab, False, *opts)

    def cublas_grad():
        torch.mm(x, wc.t(), out=chunk)
        VOCAB_CHUNK_GRAD(chunk, target, None, scales, None, lse_t, 0, vocab, *opts)

    t_mm = gpu_time(cublas_mm, 0.1)
    print(f"\nchunk {c}: cuBLAS mm {t_mm:.3f} ms ({flops / t_mm / 1e9:.0f} TF/s); + stats kernel "
          f"{gpu_time(cublas_stats, 0.15):.3f}; + grad kernel {gpu_time(cublas_grad, 0.15):.3f}", flush=True)
    for cfg in POINTER_CONFIGS:
        time_config("triton", cfg, pointer_launch, x, wc, chunk, lse_t, target, scale_rows, flops)
    for cfg in TMA_CONFIGS:
        time_config("tma", cfg, tma, x, wc, chunk, lse_t, target, scale_rows, flops)

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "check" or os.environ.get("TRITON_INTERPRET") == "1":
        check()
    else:
        bench()
