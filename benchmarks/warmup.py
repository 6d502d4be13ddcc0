"""A training job's first step with a cold Triton cache, and after ``tigon warmup``: on a GPU, fresh processes.

    python benchmarks/warmup.py --out benchmarks/results     # Llama-3.2-1B-shaped, batch 1 x 2048 (aimed at < 4 min)

What is measured. The model is Llama-3.2-1B-shaped (16 layers, V=128256; ``tigon.bench.models``), random
weights in fp32, ``tigon.patch`` with its default switches, bf16 autocast, fused AdamW, batch 1 x 2048 random
tokens. A step is forward with labels, backward, ``optimizer.step()`` and ``zero_grad``, timed on the host
with ``loss.item()`` as the synchronisation. Three fresh processes, each with its own ``TRITON_CACHE_DIR``:

1. cold: an empty cache; the first step (which compiles every kernel tigon launches), then ``--steps``
   more steps, of which the median is the steady step;
2. warmup: ``tigon warmup Llama-3.2-1B-shaped --autocast --dtype bf16 --seq 2048`` into another empty cache,
   timed as a whole process (imports included);
3. warm: the training process of 1. again, with the cache that 2. filled.

Reported: the cold first step, the warmup's time, the warm first step, the steady step, warm first / steady
(what a first step still costs beyond a steady one: cuBLAS and allocator start-up, AdamW's state), and the
cache entries each process compiled (the warm step's must be 0: warmup compiled everything training
launches). Results go to ``<out>/warmup-<device>-<date>.{json,md}``; the markdown is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "Llama-3.2-1B-shaped"
TIMEOUT_S = 600


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON and markdown")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--steps", type=int, default=5, help="steady steps after the first (default 5)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one training process (internal)
    args = p.parse_args(argv)
    if args.seq < 1 or args.batch < 1 or args.steps < 1:
        p.error("--seq, --batch and --steps must be positive")
    return args


# ------------------------------------------------------------------------------------------ one process


def train_worker(args) -> dict:
    """Build, patch, and time the first step and the steady steps (run in a fresh process)."""
    import torch

    import tigon
    from tigon.bench.models import build_model, model_config

    device = torch.device("cuda")
    config = model_config("llama", tiny=False).config
    model = build_model(config, device=device)
    tigon.patch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(config.vocab_size, (args.batch, args.seq), device=device)

    def step() -> float:
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        return time.perf_counter() - start

    torch.cuda.synchronize()
    first = step()
    steady = [step() for _ in range(args.steps)]
    return {"first_step_s": first, "steady_steps_s": steady, "steady_step_s": statistics.median(steady)}


def _env(cache: Path) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    return env


def _run(cmd, cache: Path) -> tuple[str, float, int]:
    """Run ``cmd`` in a fresh process on ``cache``: its stdout, wall seconds, and entries it added."""
    from tigon.warmup import cache_entries

    before = len(cache_entries(cache))
    start = time.perf_counter()
    done = subprocess.run(cmd, env=_env(cache), capture_output=True, text=True, timeout=TIMEOUT_S)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{done.stderr[-4000:]}")
    return done.stdout, seconds, len(cache_entries(cache)) - before


def train_process(args, cache: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--seq", str(args.seq), "--batch", str(args.batch),
           "--steps", str(args.steps)]
    stdout, seconds, compiled = _run(cmd, cache)
    result = json.loads(stdout.strip().splitlines()[-1])
    return {**result, "process_s": seconds, "compiled_entries": compiled}


def warmup_process(args, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "tigon.cli", "warmup", MODEL, "--autocast", "--dtype", "bf16",
           "--seq", str(args.seq), "--batch", str(args.batch)]
    stdout, seconds, compiled = _run(cmd, cache)
    return {"process_s": seconds, "compiled_entries": compiled, "output": stdout}


# ------------------------------------------------------------------------------------------ report


def markdown(result: dict) -> str:
    cold, warm, warmup = result["cold"], result["warm"], result["warmup"]
    setup = result["setup"]
    lines = [
        f"# First training step: cold Triton cache vs after `tigon warmup` ({setup['device']}, {setup['date']})",
        "",
        f"{setup['model']}, tigon.patch defaults, bf16 autocast, fused AdamW, batch {setup['batch']} x "
        f"{setup['seq']}; each row a fresh process with its own `TRITON_CACHE_DIR`; steady = median of "
        f"{setup['steps']} steps after the first. "
        + ", ".join(f"{k} {v}" for k, v in setup["versions"].items() if v),
        "",
        "| measurement | seconds | cache entries compiled |",
        "| --- | ---: | ---: |",
        f"| cold: first step (compiles) | {cold['first_step_s']:.2f} | {cold['compiled_entries']} |",
        f"| cold: steady step | {cold['steady_step_s']:.3f} | |",
        f"| `tigon warmup` (whole process) | {warmup['process_s']:.1f} | {warmup['compiled_entries']} |",
        f"| after warmup: first step | {warm['first_step_s']:.2f} | {warm['compiled_entries']} |",
        f"| after warmup: steady step | {warm['steady_step_s']:.3f} | |",
        "",
        f"After warmup the first step takes {warm['first_step_s'] / warm['steady_step_s']:.1f}x a steady step "
        f"(cold: {cold['first_step_s'] / cold['steady_step_s']:.1f}x); warmup saved "
        f"{cold['first_step_s'] - warm['first_step_s']:.1f} s of the first step.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(train_worker(args)))
        return
    import torch

    from tigon.bench.harness import versions

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/warmup.py times Triton compilation on a GPU; this machine has none")
    setup = {"model": MODEL, "seq": args.seq, "batch": args.batch, "steps": args.steps,
             "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
             "versions": versions()}
    with tempfile.TemporaryDirectory(prefix="tigon-warmup-bench-") as tmp:
        cold_cache, warm_cache = Path(tmp) / "cold", Path(tmp) / "warm"
        print("cold: first step with an empty cache ...", flush=True)
        cold = train_process(args, cold_cache)
        print("tigon warmup into an empty cache ...", flush=True)
        warmup = warmup_process(args, warm_cache)
        print("after warmup: first step with the warmed cache ...", flush=True)
        warm = train_process(args, warm_cache)
    result = {"setup": setup, "cold": cold, "warmup": warmup, "warm": warm}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"warmup-{setup['device'].replace(' ', '-')}-{setup['date']}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    Path(f"{stem}.md").write_text(text)
    print()
    print(text)
    print(f"wrote {stem}.json, {stem}.md")


if __name__ == "__main__":
    main()
