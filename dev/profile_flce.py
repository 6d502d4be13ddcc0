"""Where the fused linear CE's time goes, kernel by kernel, against torch.compile's (GPU only).

    PYTHONPATH=src python3 dev/profile_flce.py [Llama-3-8B Qwen2.5-0.5B Gemma-2-2B]

An experiment kept out of the package (STYLE: llm.c habit). At the two benchmark heads where tigon
is slower than torch.compile, or was (Llama-3-8B's H = 4096, V = 128256; Qwen2.5-0.5B's H = 896,
V = 151936; Gemma-2-2B's H = 2304, V = 256000 with softcap 30; N = 8192, bf16), it prints:

1. one forward + backward of tigon and of the compiled reference under torch.profiler, each
   kernel's count and total GPU time, largest first;
2. each matmul of the plan alone at its chunk shape, and the three whole-problem matmuls that
   compile runs, with their rates.

Times are the harness's ``gpu_time`` (L2 flushed, launches queued behind a sleeping GPU). The
log in benchmarks/results/ from 2026-11 was taken with a plain CUDA-event loop, before this script
used ``gpu_time``.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import tigon.ops  # noqa: F401
from tigon.bench.harness import gpu_time
from tigon.bench.specs.cross_entropy import _target

flce = sys.modules["tigon.ops.fused_linear_cross_entropy"]
DEVICE = "cuda"
N = 8192
SHAPES = (("Llama-3-8B", 4096, 128256, None), ("Qwen2.5-0.5B", 896, 151936, None),
          ("Gemma-2-2B", 2304, 256000, 30.0))


def kernel_table(label, step) -> None:
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [(e.device_time_total / 1000, e.count, e.key) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"  {label}: {total:.2f} ms of kernels")
    for ms, count, name in rows[:14]:
        print(f"    {ms:8.3f} ms  x{count:<4d} {name[:110]}")


def gemm(label, flops, fn) -> None:
    ms = gpu_time(fn, flops / 600e9)
    print(f"    {label:58s} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TF/s")


def profile_shape(name, hidden, vocab, softcap) -> None:
    bf = torch.bfloat16
    x = torch.randn(N, hidden, device=DEVICE, dtype=bf, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=DEVICE) * hidden**-0.5).to(bf).requires_grad_()
    target = _target(N, vocab, DEVICE)
    plan = flce.chunk_plan(N, vocab, hidden, 2, dx_size=2, dw_size=2)
    print(f"\n{name} N={N} H={hidden} V={vocab} softcap={softcap}: {plan}", flush=True)

    def tigon_step():
        flce.fused_linear_cross_entropy(x, w, target, softcap=softcap).backward()
        x.grad = w.grad = None

    compiled = torch.compile(
        lambda a, b, t: flce.fused_linear_cross_entropy_reference(a, b, t, softcap=softcap), dynamic=False)

    def compile_step():
        compiled(x, w, target).backward()
        x.grad = w.grad = None

    print(f"  whole step: tigon {gpu_time(tigon_step, 16.0):.3f} ms, compile {gpu_time(compile_step, 16.0):.3f} ms")
    kernel_table("tigon", tigon_step)
    kernel_table("compile", compile_step)

    mm = 2 * N * hidden * vocab
    with torch.no_grad():
        xd, wd = x.detach(), w.detach()
        print("  whole-problem matmuls (compile's):")
        logits = torch.empty(N, vocab, device=DEVICE, dtype=bf)
        gemm("logits = X Wt  (N, V), K = H", mm, lambda: torch.mm(xd, wd.t(), out=logits))
        gemm("dX = G W       (N, H), K = V", mm, lambda: torch.mm(logits, wd))
        gemm("dW = Gt X      (V, H), K = N", mm, lambda: torch.mm(logits.t(), xd))
        if plan.by_tokens:
            c = plan.size
            chunks = -(-N // c)
            g = torch.randn(c, vocab, device=DEVICE, dtype=bf)
            dw = torch.randn(vocab, hidden, device=DEVICE, dtype=bf)
            f = 2 * c * hidden * vocab
            print(f"  by tokens: {chunks} chunks of {c} (x{chunks} below)")
            gemm(f"logits_c = X_c Wt  ({c}, V)", f, lambda: torch.mm(xd[:c], wd.t(), out=g))
            gemm(f"dX_c = G_c W       ({c}, H), K = V", f, lambda: torch.mm(g, wd))
            gemm(f"dX_c fp32 out      ({c}, H), K = V", f, lambda: torch.mm(g, wd, out_dtype=torch.float32))
            gemm(f"dW += G_ct X_c     (V, H), K = {c}, beta 1", f, lambda: dw.addmm_(g.t(), xd[:c]))
            gemm(f"dW = G_ct X_c      (V, H), K = {c}, beta 0", f, lambda: torch.mm(g.t(), xd[:c], out=dw))
            half = vocab // 2
            gemm("dX_c in two V halves, fp32", f, lambda: torch.addmm(
                torch.mm(g[:, :half], wd[:half], out_dtype=torch.float32), g[:, half:], wd[half:],
                out_dtype=torch.float32))
        else:
            c = plan.size
            chunks = -(-vocab // c)
            g = torch.randn(N, c, device=DEVICE, dtype=bf)
            dw = torch.empty(c, hidden, device=DEVICE, dtype=bf)
            dx32 = torch.randn(N, hidden, device=DEVICE)
            f = 2 * N * hidden * c
            print(f"  by classes: {chunks} chunks of {c} (x{chunks} below; logits twice)")
            gemm(f"logits_c = X Wt_c  (N, {c}), K = H", f, lambda: torch.mm(xd, wd[:c].t(), out=g))
            gemm(f"dW_c = G_ct X      ({c}, H), K = N", f, lambda: torch.mm(g.t(), xd, out=dw))
            gemm(f"dX += G_c W_c fp32 (N, H), K = {c}, beta 1", f,
                 lambda: torch.addmm(dx32, g, wd[:c], out_dtype=torch.float32, out=dx32))
            gemm(f"dX_c = G_c W_c bf16 (N, H), K = {c}", f, lambda: torch.mm(g, wd[:c]))


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    names = sys.argv[1:]
    for shape in SHAPES:
        if names and shape[0] not in names:
            continue
        profile_shape(*shape)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
