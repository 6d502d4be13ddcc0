"""How close can anything get to RoPE's speed of light at Qwen2.5-0.5B's shape under the harness?

    PYTHONPATH=src python3 dev/rope_floor.py      # on the GPU; Liger-Kernel's rope too if importable

A plain device copy of the same bytes in the same number of launches (one for the forward, one for
the backward), against tigon's and Liger-Kernel's rope, forward + backward, each timed twice with the
harness's GPU time (queued behind a sleeping GPU, L2 flushed first). An experiment kept out of the
package (STYLE: llm.c habit); its log is benchmarks/results/rope_floor-*.log. At this size (34 MB
read and 34 MB written per launch) a launch's ramp and tail weigh: the copy itself reaches ~86%.
"""

from __future__ import annotations

import torch

from tigon.bench.harness import copy_bandwidth, gpu_time
from tigon.ops import rope

B, T, HQ, HK, D = 8, 2048, 14, 2, 64  # Qwen2.5-0.5B's heads, the benchmark's tokens
ROPE_THETA = 500000.0
REPEATS = 2


def main() -> None:
    bandwidth = copy_bandwidth()
    device, dtype = "cuda", torch.bfloat16
    moved = 2 * B * T * (HQ + HK) * D * dtype.itemsize  # q and k read and written, one launch
    sol_ms = 2 * moved / bandwidth * 1e3  # forward + backward
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; SOL of forward + backward {sol_ms * 1e3:.1f} us")

    def leaf(heads):  # the transpose of a [B, T, H, D] projection, as a model hands it over
        x = torch.randn(B, T, heads, D, device=device, dtype=dtype).transpose(1, 2)
        return x.detach().requires_grad_()

    q, k = leaf(HQ), leaf(HK)
    positions = torch.arange(T, device=device, dtype=torch.float32)
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)
    angles = torch.cat([positions[:, None] * inv_freq[None]] * 2, -1).expand(B, T, D)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def full(fn):
        grads = [torch.randn_like(o) for o in fn(q, k, cos, sin)]
        return lambda: torch.autograd.grad(fn(q, k, cos, sin), (q, k), grads)

    source = torch.randn(B * T * (HQ + HK) * D, device=device, dtype=dtype)
    grad_source = torch.randn_like(source)

    def copy_step():  # the same bytes in two launches, into new buffers as rope's outputs are
        torch.empty_like(source).copy_(source)
        torch.empty_like(grad_source).copy_(grad_source)

    cases = {"copy (same bytes, 2 launches)": copy_step, "tigon": full(rope)}
    try:
        from liger_kernel.transformers.functional import liger_rope

        cases["liger"] = full(liger_rope)
    except ImportError as exc:
        print(f"Liger-Kernel not importable ({exc})")
    for _ in range(REPEATS):
        for name, step in cases.items():
            step()
            torch.cuda.synchronize()
            ms = gpu_time(step, sol_ms)
            print(f"{name}: {ms * 1e3:.1f} us ({100 * sol_ms / ms:.1f}% SOL)", flush=True)


if __name__ == "__main__":
    main()
