"""The gated MLP's stacked gate/up product against the split one (tigon.nn.mlp.STACKED_DEVICES), per
model shape: GPU time and host time of a bf16-autocast forward + backward with fp32 weights.

    PYTHONPATH=src python dev/ab_stacked_mlp.py [--profile]   # --profile: each path's op table too
"""

from __future__ import annotations

import sys
import time

import torch
import triton

from tigon.nn import mlp
from tigon.nn.mlp import SwiGLUMLP

# (label, tokens, hidden, intermediate, bias)
SHAPES = (
    ("Qwen2.5-0.5B 4x2048", 8192, 896, 4864, False),
    ("Llama-3.2-1B 4x2048", 8192, 2048, 8192, False),
    ("Gemma-2-2B 2x2048", 4096, 2304, 9216, False),
    ("Qwen2.5-VL-3B text 1x2048", 2048, 2048, 11008, False),
    ("Qwen2.5-VL-3B vision 784", 784, 1280, 3420, True),
)


def main() -> None:
    torch.manual_seed(0)
    for label, tokens, hidden, inter, bias in SHAPES:
        module = SwiGLUMLP(hidden, inter, bias=bias, device="cuda")
        x = torch.randn(tokens, hidden, device="cuda", requires_grad=True)
        dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)

        def step(module=module, x=x, dy=dy):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = module(x)
            y.backward(dy)

        row = []
        for devices in (("cuda",), ()):
            mlp.STACKED_DEVICES = devices
            for _ in range(3):
                step()
            gpu_ms = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(20):
                step()
            host_ms = (time.perf_counter() - start) / 20 * 1e3  # issue rate (bounded by the GPU when slower)
            torch.cuda.synchronize()
            row.append(f"{'stacked' if devices else 'split'} GPU {gpu_ms:.3f} ms, issue {host_ms:.3f} ms")
            if "--profile" in sys.argv:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        step()
                    torch.cuda.synchronize()
                print(label, "stacked" if devices else "split")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                                max_name_column_width=70))
        print(f"{label:>28}: " + " | ".join(row))
    mlp.STACKED_DEVICES = ("cuda",)


if __name__ == "__main__":
    main()
