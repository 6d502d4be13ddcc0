"""Where the host's time goes in one eager training step (the e2e benchmark's model and step).

    PYTHONPATH=src:. python scripts/host_profile.py --model qwen2 --provider tigon [--steps 3]

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
import time

import torch
from benchmarks.e2e import LR, SEED, batch_for, model_spec

WAITS = ("item", "tolist", "synchronize", "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2")
    parser.add_argument("--provider", default="tigon", choices=("stock", "tigon"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--top", type=int, default=45)
    args = parser.parse_args()

    import tigon
    from tigon.demo import build_model

    device = torch.device("cuda")
    spec = model_spec(args.model)
    torch.manual_seed(SEED)
    model = build_model(spec.config, device=device)
    if args.provider == "tigon":
        tigon.patch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    batch = batch_for(args.model, None)
    ids = torch.randint(spec.config.vocab_size, (batch, args.seq), device=device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step().item()
    torch.cuda.synchronize()
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


if __name__ == "__main__":
    main()
