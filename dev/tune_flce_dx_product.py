"""The fused linear CE's dX of one token chunk, dX_c = dL_c · W (C, H), K = V: cuBLAS writing it in bf16
against cuBLAS writing its fp32 product into a scratch and a cast into dX's rows, on a GPU.

    PYTHONPATH=src python3 dev/tune_flce_dx_product.py

An experiment kept out of the package (STYLE: llm.c habit). Both round the fp32 sum of the products once;
for these shapes (a small (C, H) output, K = V in the 100,000s) cuBLAS's heuristics pick different kernels
for a bf16 and an fp32 output, and dev/profile_flce.py's separate timings had the fp32 one faster (1.79
against 1.63 ms at Llama-3-8B's chunk of 1280, 1.74 against 1.63 at Gemma-2-2B's of 1024). Timed here one
after the other on the same operands, GPU ms by the harness's ``gpu_time`` (L2 flushed, launches queued
behind a sleeping GPU), the fp32 product and its cast were within ±3.5% of the bf16 output at every shape
but Llama-3-8B's chunk of 1280, where the bf16 output was 10% faster
(benchmarks/results/2026-11-28/tune_flce_dx_product.log): the op keeps writing dX in its dtype.
"""

from __future__ import annotations

import torch

from tigon.bench.harness import gpu_time

SHAPES = (  # label, chunk tokens C, vocab V, hidden H
    ("Llama-3-8B", 1280, 128256, 4096), ("Llama-3-8B", 512, 128256, 4096),
    ("Gemma-2-2B", 1024, 256000, 2304), ("Gemma-2-2B", 768, 256000, 2304),
    ("Qwen2.5-0.5B", 3072, 151936, 896), ("Qwen2.5-0.5B", 2048, 151936, 896),
    ("Llama-3.2-3B", 1024, 128256, 3072), ("Gemma-2-9B", 1152, 256000, 3584),
    ("Qwen2.5-7B", 1024, 152064, 3584), ("Llama-3.2-1B", 2048, 128256, 2048),
)


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for label, chunk, vocab, hidden in SHAPES:
        g = torch.randn(chunk, vocab, device="cuda", dtype=torch.bfloat16) * 1e-3
        w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
        dx = torch.empty(chunk, hidden, device="cuda", dtype=torch.bfloat16)
        scratch = torch.empty(chunk, hidden, device="cuda", dtype=torch.float32)
        flops = 2 * chunk * vocab * hidden

        def bf16_out(g=g, w=w, dx=dx):
            torch.mm(g, w, out=dx)

        def fp32_out(g=g, w=w, scratch=scratch):
            torch.addmm(scratch, g, w, beta=0.0, out_dtype=torch.float32, out=scratch)

        def fp32_out_cast(g=g, w=w, dx=dx, scratch=scratch):
            torch.addmm(scratch, g, w, beta=0.0, out_dtype=torch.float32, out=scratch)
            dx.copy_(scratch)

        bf16_out()
        want = dx.clone()
        fp32_out_cast()
        differ = float((dx != want).float().mean())
        times = {name: gpu_time(fn, 2.0) for name, fn in
                 (("bf16 out", bf16_out), ("fp32 out", fp32_out), ("fp32 out + cast", fp32_out_cast))}
        print(f"{label:13s} C={chunk:5d} V={vocab} H={hidden}: " + "  ".join(
            f"{k} {v:6.3f} ms ({flops / v / 1e9:4.0f} TF/s)" for k, v in times.items())
            + f"  [{differ:.1%} of bf16 values differ]", flush=True)


if __name__ == "__main__":
    main()
