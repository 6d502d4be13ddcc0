"""Where the host's time goes in one training step (the e2e benchmark's model and step), eager or compiled.

    PYTHONPATH=src:. python dev/host_profile.py --model qwen2 --provider tigon [--steps 3]
    PYTHONPATH=src:. python dev/host_profile.py --model gemma2 --provider tigon+compile  # the compiled step
    PYTHONPATH=src:. python dev/host_profile.py --ops rms_norm rope swiglu   # per-op host cost
    PYTHONPATH=src:. python dev/host_profile.py --model qwen2_5_vl --batch 1 --phases   # a VLM (e2e_vlm.py)

A step whose GPU time is below its wall time is bound by the host (the e2e profile's busy / wall
column). This runs the benchmark's own step under cProfile and prints the functions with the most
time of their own, with the time spent waiting for the GPU (``item``, ``tolist``, ``synchronize``)
separated out, so that what is left is the host's launch work.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from benchmarks.e2e import LR, SEED, batch_for, model_spec

WAITS = ("item", "tolist", "synchronize", "cpu")
OP_ITERATIONS = 300


def op_host_costs(names, top: int) -> None:
    """Host time of one forward+backward of each op at its spec's check size (GPU work negligible),
    per provider, then a cProfile of tigon's."""
    from tigon.bench.harness import make_step, providers_of
    from tigon.bench.specs import load_specs

    for name, spec in load_specs(names).items():
        case = spec.check_case()
        providers = {k: v for k, v in providers_of(spec).items() if k != "compile"}
        steps = {}
        for provider, fn in providers.items():
            inputs = case.make_inputs(torch.device("cuda"), torch.bfloat16)
            step = steps[provider] = make_step(fn, inputs, spec, "full")
            for _ in range(20):
                step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(OP_ITERATIONS):
                step()
            torch.cuda.synchronize()
            us = (time.perf_counter() - start) / OP_ITERATIONS * 1e6
            print(f"{name:>14} {case.label:<28} {provider:>8}: {us:7.1f} us per forward+backward")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(OP_ITERATIONS):
            steps["tigon"]()
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
        print(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2")
    parser.add_argument("--provider", default="tigon", choices=("stock", "tigon", "compile", "tigon+compile"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, help="sequences per step (default: the e2e benchmark's)")
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--ops", nargs="+", help="per-op host cost of these benchmark specs instead")
    parser.add_argument("--phases", action="store_true",
                        help="unprofiled host time of forward, backward and optimizer step (gc on and off), "
                             "then torch.profiler's CPU-side op table instead of cProfile")
    args = parser.parse_args()
    if args.ops:
        op_host_costs(args.ops, args.top)
        return

    from benchmarks import e2e_vlm

    import tigon
    from tigon.bench.models import build_model

    device = torch.device("cuda")
    batch = batch_for(args.model, args.batch)
    torch.manual_seed(SEED)
    if args.model in e2e_vlm.SPECS:  # a VLM: its model and an image batch as the e2e benchmark builds them
        spec = e2e_vlm.model_spec(args.model)
        model = e2e_vlm.build_model(spec.config, device=device)
        gen = torch.Generator(device=device).manual_seed(SEED)
        inputs = e2e_vlm.batches(spec, 1, batch, args.seq, device=device, generator=gen)[0]
    else:
        spec = model_spec(args.model)
        model = build_model(spec.config, device=device)
        ids = torch.randint(spec.config.vocab_size, (batch, args.seq), device=device)
        inputs = {"input_ids": ids, "labels": ids}
    if args.provider.startswith("tigon"):
        tigon.patch(model)
    forward = torch.compile(model) if args.provider.endswith("compile") else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step().item()
    torch.cuda.synchronize()
    if args.phases:
        phases(forward, optimizer, inputs, args)
        return
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(args.steps):
        step().item()
    profiler.disable()
    wall = (time.perf_counter() - start) / args.steps * 1e3
    stats = pstats.Stats(profiler)
    waits = sum(
        tt for (_, _, name), (_, _, tt, _, _) in stats.stats.items()
        if any(w in name for w in WAITS)
    ) / args.steps * 1e3
    print(f"{args.model} {args.provider}: wall {wall:.1f} ms/step, waiting on the GPU {waits:.1f} ms, "
          f"host work {wall - waits:.1f} ms")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats("tigon", 40)
    print(out.getvalue())


def phases(model, optimizer, inputs, args) -> None:
    """Host time of each phase with no profiler (the GPU runs behind; each step ends with one sync),
    with Python's garbage collector on and off; then where the host's time goes by torch op."""
    import gc

    def timed_step():
        marks = [time.perf_counter()]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**inputs).loss
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        loss.item()
        marks.append(time.perf_counter())
        return [b - a for a, b in zip(marks, marks[1:], strict=False)]

    collections = {}  # generation -> [count, seconds]
    started = []

    def on_gc(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            entry = collections.setdefault(info["generation"], [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - started.pop()

    gc.callbacks.append(on_gc)
    for label in ("gc on", "gc off", "gc on, frozen"):
        if label == "gc off":
            gc.disable()
        elif label == "gc on, frozen":
            gc.enable()
            gc.collect()
            gc.freeze()
        collections.clear()
        n = max(args.steps, 8)
        rows = [timed_step() for _ in range(n)]
        med = [statistics.median(r[i] for r in rows) * 1e3 for i in range(4)]
        mean = sum(sum(r[:3]) for r in rows) / n * 1e3
        spent = ", ".join(f"gen{g}: {c / n:.1f}/step {t / n * 1e3:.1f} ms" for g, (c, t) in sorted(collections.items()))
        print(f"{args.model} {args.provider} ({label}): forward {med[0]:.1f} ms, backward {med[1]:.1f}, "
              f"optimizer {med[2]:.1f}, wait for GPU {med[3]:.1f}; host {sum(med[:3]):.1f} ms/step "
              f"(mean {mean:.1f}); collections {spent or 'none'}; tracked objects {len(gc.get_objects())}")
    gc.callbacks.remove(on_gc)
    gc.unfreeze()
    if hasattr(getattr(model, "model", None), "visual"):
        vision_share(model, timed_step)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            timed_step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))


def vision_share(model, timed_step) -> None:
    """A VLM's host time split at its vision tower: the tower's forward (its forward hooks), and its
    backward (from the gradient reaching the tower's output, the backward's last part, to the end)."""
    marks = {}

    def output_hook(module, args, output):
        marks["vision forward"] = time.perf_counter() - marks.pop("start")
        out = output[0] if isinstance(output, tuple) else getattr(output, "pooler_output", output)
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(lambda grad: marks.__setitem__("vision backward start", time.perf_counter()))

    visual = model.model.visual
    handles = [visual.register_forward_pre_hook(lambda m, a: marks.__setitem__("start", time.perf_counter())),
               visual.register_forward_hook(output_hook)]
    original = torch.Tensor.backward

    def backward(self, *a, **k):
        original(self, *a, **k)
        marks["vision backward"] = time.perf_counter() - marks.pop("vision backward start", time.perf_counter())

    torch.Tensor.backward = backward
    try:
        rows = []
        for _ in range(6):
            phases_ms = timed_step()
            rows.append((marks["vision forward"], marks["vision backward"], phases_ms[0], phases_ms[1]))
    finally:
        torch.Tensor.backward = original
        for handle in handles:
            handle.remove()
    med = [statistics.median(r[i] for r in rows) * 1e3 for i in range(4)]
    print(f"vision tower: forward {med[0]:.1f} of {med[2]:.1f} ms, backward {med[1]:.1f} of {med[3]:.1f} ms "
          "(host, median of 6 steps)")


if __name__ == "__main__":
    main()
