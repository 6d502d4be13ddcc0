"""Sweep the norm kernels' launch geometry on a GPU and print the kernel time of each choice.

An experiment kept out of the package (STYLE: llm.c habit): its findings go into
``FWD_TUNING`` / ``BWD_TUNING`` in src/tigon/ops/rms_norm.py, with the numbers in NOTES.md.

    PYTHONPATH=src python3 scripts/tune_norm.py
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch
import triton.testing

import tigon.ops  # noqa: F401  (defines the kernels)
from tigon.ops._common import _direct_launch

rms = sys.modules["tigon.ops.rms_norm"]

SHAPES = ((16384, 896), (16384, 2048), (16384, 4096), (8192, 8192), (4096, 16384), (2048, 32768), (1024, 65536))
BWD_VARIANTS = [
    dict(programs_per_sm=pps, elements_per_warp=epw, max_fused_hidden=mf)
    for pps in (1, 2, 4)
    for epw in (256, 512)
    for mf in (8192, 16384)
]
FWD_VARIANTS = [dict(elements_per_warp=epw, max_fused_hidden=mf) for epw in (256, 512, 1024) for mf in (16384, 65536)]


def bench(fn):
    """GPU time of ``fn`` replayed as a CUDA graph: the kernels alone, without host launch cost."""
    with _direct_launch():
        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def main():
    bw_src = torch.empty(1 << 28, device="cuda")
    bw_dst = torch.empty_like(bw_src)
    copy_ms = bench(lambda: bw_dst.copy_(bw_src))
    bandwidth = 2 * bw_src.numel() * 4 / (copy_ms * 1e-3)
    del bw_src, bw_dst
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    base_fwd, base_bwd = rms.FWD_TUNING, rms.BWD_TUNING
    for rows, hidden in SHAPES:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        tensor = rows * hidden * 2
        fwd_sol = 2 * tensor / bandwidth * 1e3
        bwd_sol = 3 * tensor / bandwidth * 1e3
        results = []
        for v in FWD_VARIANTS:
            rms.FWD_TUNING = dataclasses.replace(base_fwd, **v)
            try:
                ms = bench(lambda: rms._forward(x, None, w, 1e-6, 0.0, "llama"))
                results.append(("fwd", v, ms, 100 * fwd_sol / ms))
            except Exception as exc:
                results.append(("fwd", v, float("nan"), f"{type(exc).__name__}"))
        rms.FWD_TUNING = base_fwd
        _, _, rstd = rms._forward(x, None, w, 1e-6, 0.0, "llama")
        for v in BWD_VARIANTS:
            rms.BWD_TUNING = dataclasses.replace(base_bwd, **v)
            try:
                ms = bench(lambda: rms._backward(dy, x, w, rstd, None, 1e-6, 0.0, "llama"))
                results.append(("bwd", v, ms, 100 * bwd_sol / ms))
            except Exception as exc:
                results.append(("bwd", v, float("nan"), f"{type(exc).__name__}"))
        rms.BWD_TUNING = base_bwd
        for direction in ("fwd", "bwd"):
            rs = sorted((r for r in results if r[0] == direction and r[2] == r[2]), key=lambda r: r[2])
            best = rs[0] if rs else None
            print(f"M={rows} N={hidden} {direction}: best {best[1]} {best[2]:.4f} ms ({best[3]:.0f}% SOL)")
            for r in rs[1:4]:
                print(f"      next {r[1]} {r[2]:.4f} ms ({r[3]:.0f}%)")
        cur_f = bench(lambda: rms._forward(x, None, w, 1e-6, 0.0, "llama"))
        cur_b = bench(lambda: rms._backward(dy, x, w, rstd, None, 1e-6, 0.0, "llama"))
        print(f"      current config: fwd {cur_f:.4f} ms ({100 * fwd_sol / cur_f:.0f}%), bwd {cur_b:.4f} ms ({100 * bwd_sol / cur_b:.0f}%)")

    # CPU cost of one eager forward+backward through the public function, on a tensor so small
    # that the GPU waits on the CPU: this is the per-call overhead a training step pays.
    x = torch.randn(8, 256, device="cuda", requires_grad=True)
    w = torch.randn(256, device="cuda", requires_grad=True)
    g = torch.randn(8, 256, device="cuda")
    for _ in range(20):
        torch.autograd.grad(tigon.ops.rms_norm(x, w), (x, w), g)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        torch.autograd.grad(tigon.ops.rms_norm(x, w), (x, w), g)
    torch.cuda.synchronize()
    print(f"eager rms_norm fwd+bwd host overhead: {(time.perf_counter() - start) / 200 * 1e6:.0f} us per call")
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        torch.autograd.grad(tigon.ops.rms_norm(x, w), (x, w), g)
    torch.cuda.synchronize()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
