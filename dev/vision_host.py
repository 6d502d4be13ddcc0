"""Host time of a VLM's vision tower, block by block: where an eager step of the tower spends its launches.

    PYTHONPATH=src:. python dev/vision_host.py [--providers stock tigon] [--images 1] [--grid 28]

The e2e benchmark's Qwen2.5-VL-3B vision tower (32 blocks of 1280, windowed attention; a two-layer
text model beside it, only there so that ``tigon.patch`` sees a whole model) under bf16 autocast with
fp32 weights, fed ``--images`` images of ``--grid`` x ``--grid`` patches. At one 392 x 392 image (784
patches) every kernel of a block is a few µs of GPU work, so the tower runs at the host's pace; this
prints, per provider:

- the tower's forward and backward host time (no synchronisation inside) and its GPU time (the same
  step with a synchronisation at the end);
- one block's forward, split by the modules it calls (the time between a module's pre- and post-hook);
- the launches (torch.profiler CUDA kernel count) per block, forward and backward;
- a cProfile of the tower's forward and backward, by time of the function's own.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import time

import torch

ITERATIONS = 20


def build(provider: str, device):
    import transformers
    from benchmarks.e2e_vlm import QWEN2_5_VL_3B_VISION, QWEN_TOKENS, TINY_TEXT, build_model

    import tigon

    text = copy.deepcopy(TINY_TEXT)
    text["vocab_size"] = 151936
    vision = {**QWEN2_5_VL_3B_VISION, "out_hidden_size": text["hidden_size"]}
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                           **QWEN_TOKENS)
    torch.manual_seed(0)
    model = build_model(config, device=device)
    if provider == "tigon":
        tigon.patch(model)
    return model


def tower_step(visual, pixels, grid_thw):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = visual(pixels, grid_thw=grid_thw)
    out = out.pooler_output if hasattr(out, "pooler_output") else out
    return out


def timed(fn, sync: bool) -> float:
    """Median seconds of ``fn`` over ITERATIONS runs; with ``sync`` each run ends on the GPU's finish."""
    times = []
    for _ in range(ITERATIONS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def module_split(visual, pixels, grid_thw) -> dict:
    """Host ms of each module block 0 calls, from its pre-hook to its post-hook (median)."""
    block = visual.blocks[0]
    spans: dict = {}
    marks = {}
    handles = []
    for name, module in [("block", block), *block.named_modules()]:
        if module is block and name != "block":
            continue
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: marks.__setitem__(n, time.perf_counter())))
        handles.append(module.register_forward_hook(
            lambda m, a, o, n=name: spans.setdefault(n, []).append(time.perf_counter() - marks[n])))
    try:
        for _ in range(ITERATIONS):
            tower_step(visual, pixels, grid_thw).float().sum().backward()
    finally:
        for h in handles:
            h.remove()
    return {n: statistics.median(v) * 1e3 for n, v in spans.items()}


def launches(visual, pixels, grid_thw) -> tuple[int, int]:
    """CUDA kernels launched by the tower's forward and by its backward."""
    from torch.profiler import ProfilerActivity, profile

    counts = []
    out = None
    for phase in ("forward", "backward"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if phase == "forward":
                out = tower_step(visual, pixels, grid_thw).float().sum()
            else:
                out.backward()
            torch.cuda.synchronize()
        counts.append(sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA))
    return counts[0], counts[1]


def measure(provider: str, args) -> None:
    """Everything the module docs list, for one provider's tower."""
    device = torch.device("cuda")
    model = build(provider, device)
    visual = model.model.visual
    config = visual.config
    features = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    gen = torch.Generator(device=device).manual_seed(0)
    pixels = torch.randn(args.images * args.grid ** 2, features, device=device, generator=gen)
    grid_thw = torch.tensor([[1, args.grid, args.grid]] * args.images, device=device)
    state = {}

    def forward():
        state["out"] = tower_step(visual, pixels, grid_thw).float().sum()

    def backward():
        state["out"].backward()

    def step():
        forward()
        backward()

    def backward_host():
        times = []
        for _ in range(ITERATIONS):
            forward()
            torch.cuda.synchronize()
            start = time.perf_counter()
            backward()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    for _ in range(5):
        step()
    host_fwd = timed(forward, sync=False)
    backward()
    host_bwd = backward_host()
    gpu = timed(step, sync=True)
    blocks = len(visual.blocks)
    fwd_launches, bwd_launches = launches(visual, pixels, grid_thw)
    print(f"== {provider}: tower forward host {host_fwd * 1e3:.1f} ms ({host_fwd / blocks * 1e6:.0f} µs a block "
          f"with the tower's own work), backward host {host_bwd * 1e3:.1f} ms, forward+backward with the GPU "
          f"{gpu * 1e3:.1f} ms; kernels: forward {fwd_launches} ({fwd_launches / blocks:.1f} a block), "
          f"backward {bwd_launches} ({bwd_launches / blocks:.1f} a block)")
    split = module_split(visual, pixels, grid_thw)
    print("   block 0's forward by module (host ms, median; hooks on): "
          + ", ".join(f"{n} {v:.3f}" for n, v in split.items()))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        step()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", nargs="+", default=["stock", "tigon"])
    parser.add_argument("--images", type=int, default=1)
    parser.add_argument("--grid", type=int, default=28)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    for provider in args.providers:
        measure(provider, args)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
