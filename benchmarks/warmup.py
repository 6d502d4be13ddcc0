"""A training job's first step with a cold Triton cache, and after ``tigon warmup``: on a GPU, fresh processes.

    python benchmarks/warmup.py --out benchmarks/results     # Llama-3.2-1B-shaped, batch 1 x 2048 (aimed at < 4 min)

What is measured. The model is Llama-3.2-1B-shaped (16 layers, V=128256; ``tigon.bench.models``), random
weights in fp32, ``tigon.patch`` with its default switches, bf16 autocast, fused AdamW, batch 1 x 2048 random
tokens. A step is forward with labels, backward, ``optimizer.step()`` and ``zero_grad``, timed on the host
with a device synchronisation after each phase (forward, backward, optimizer). Fresh processes, each with
its own ``TRITON_CACHE_DIR``:

1. cold: an empty cache; the first step (which compiles every kernel tigon launches), then ``--steps``
   more steps, of which the median is the steady step;
2. warmup: ``tigon warmup Llama-3.2-1B-shaped --autocast --dtype bf16 --seq 2048`` into another empty cache,
   timed as a whole process (imports included);
3. warm: the training process of 1. again, with the cache that 2. filled; once more with its first step
   profiled (``cProfile``: the functions that take the most time, by their own time and by cumulative time;
   that process's times are not reported, the profiler slows every Python call);
4. warm, libraries started: as 3., after a start-up that any PyTorch job pays once whatever it trains (a
   small bf16 matmul forward and backward, which starts cuBLAS/cuBLASLt and the autograd engine's device
   thread, and a fused AdamW step on a small parameter), timed on its own;
5. stock: the same model and step without ``tigon.patch`` (no Triton kernel at all): the first step's
   cost that is PyTorch's, not tigon's;
6. warm, a gap: as 3., with ``--gap`` seconds (2) between ``tigon.patch`` and the first step, where a training
   script loads its data and builds its optimizer and trainer. ``tigon.patch`` (``prehash=True``, the default)
   hashes Triton's compiler key on a background thread, which the first kernel lookup of a process otherwise
   computes inside the first forward; in 3. the first step follows the patch at once, so nothing overlaps it.

Reported: each process's first step and steady step split by phase, first / steady, the start-up's time,
the cache entries each process compiled (the warm steps' must be 0: warmup compiled everything training
launches) and the warm first step's profile. Results go to ``<out>/warmup-<device>-<date>.{json,md}``, the
markdown is printed last, and the run is appended to ``benchmarks/results/history.jsonl`` (one row per
measurement; ``--history PATH``: another file, ``none``: nowhere).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "Llama-3.2-1B-shaped"
TIMEOUT_S = 600
PHASES = ("forward", "backward", "optimizer")
PROFILE_ROWS = 15  # functions listed from the warm first step's profile, by own and by cumulative time


def parse_args(argv=None) -> argparse.Namespace:
    from tigon.bench import history  # a light module: the workers import no kernels until they build the model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON and markdown")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--steps", type=int, default=5, help="steady steps after the first (default 5)")
    p.add_argument("--gap", type=float, default=2.0,
                   help="seconds between the patch and the first step in the last process (default 2)")
    history.add_argument(p)
    # one training process (internal): --worker, with what it runs
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stock", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--start-libraries", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.seq < 1 or args.batch < 1 or args.steps < 1:
        p.error("--seq, --batch and --steps must be positive")
    if args.gap < 0:
        p.error("--gap must be 0 or more")
    return args


# ------------------------------------------------------------------------------------------ one process


def start_libraries(device) -> float:
    """What any PyTorch training job starts once, whatever its model: cuBLAS/cuBLASLt (a bf16 matmul under
    autocast, forward and backward: the backward also starts the autograd engine's device thread) and fused
    AdamW's kernels (one step on a small parameter). Its seconds."""
    import torch

    start = time.perf_counter()
    w = torch.randn(256, 256, device=device, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = torch.randn(64, 256, device=device) @ w
    y.float().sum().backward()
    torch.optim.AdamW([w], lr=1e-5, fused=True).step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def profile_rows(profile: cProfile.Profile) -> dict:
    """The functions that took the most time, by their own time and by cumulative time: (seconds, calls,
    ``file:line(function)`` with the file relative to its package)."""
    stats = pstats.Stats(profile)

    def where(key) -> str:
        file, line, name = key
        parts = Path(file).parts
        for anchor in ("site-packages", "src", "lib"):
            if anchor in parts:
                parts = parts[len(parts) - parts[::-1].index(anchor):]
                break
        return f"{'/'.join(parts)}:{line}({name})" if line else name

    rows = {}
    for order, column in (("own", 2), ("cumulative", 3)):
        ranked = sorted(stats.stats.items(), key=lambda kv: kv[1][column], reverse=True)[:PROFILE_ROWS]
        rows[order] = [[round(v[column], 4), v[1], where(k)] for k, v in ranked]
    return rows


def train_worker(args) -> dict:
    """Build (and patch, unless ``--stock``), then time the first step and the steady steps by phase (run in
    a fresh process)."""
    import torch

    import tigon
    from tigon.bench.models import build_model, model_config

    device = torch.device("cuda")
    config = model_config("llama", tiny=False).config
    model = build_model(config, device=device)
    if not args.stock:
        tigon.patch(model)
    time.sleep(args.gap)  # what a script does between patching and its first step (only the last process)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(config.vocab_size, (args.batch, args.seq), device=device)
    torch.cuda.synchronize()
    out = {"start_libraries_s": start_libraries(device) if args.start_libraries else None}

    def step() -> dict:
        times, start = {}, time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        times["forward"] = time.perf_counter() - start
        loss.backward()
        torch.cuda.synchronize()
        times["backward"] = time.perf_counter() - start - times["forward"]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times["step"] = time.perf_counter() - start
        times["optimizer"] = times["step"] - times["forward"] - times["backward"]
        return times

    profile = cProfile.Profile() if args.profile else None
    if profile is not None:
        profile.enable()
    first = step()
    if profile is not None:
        profile.disable()
        out["profile"] = profile_rows(profile)
    steady = [step() for _ in range(args.steps)]
    out["first"] = first
    out["steady"] = {k: statistics.median(s[k] for s in steady) for k in (*PHASES, "step")}
    out["steady_steps_s"] = [s["step"] for s in steady]
    return out


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


def train_process(args, cache: Path, *flags: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--seq", str(args.seq), "--batch", str(args.batch),
           "--steps", str(args.steps), "--gap", "0", *flags]
    stdout, seconds, compiled = _run(cmd, cache)
    result = json.loads(stdout.strip().splitlines()[-1])
    return {**result, "process_s": seconds, "compiled_entries": compiled}


def warmup_process(args, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "tigon.cli", "warmup", MODEL, "--autocast", "--dtype", "bf16",
           "--seq", str(args.seq), "--batch", str(args.batch)]
    stdout, seconds, compiled = _run(cmd, cache)
    return {"process_s": seconds, "compiled_entries": compiled, "output": stdout}


# ------------------------------------------------------------------------------------------ report

ROWS = (  # result key, what the process was
    ("cold", "tigon, cold cache (the first step compiles)"),
    ("warm", "tigon, after `tigon warmup`"),
    ("warm_started", "tigon, after `tigon warmup`, libraries started"),
    ("stock", "stock (no tigon, no Triton)"),
    ("warm_gap", "tigon, after `tigon warmup`, a gap between the patch and the first step"),
)


def markdown(result: dict) -> str:
    setup, warmup = result["setup"], result["warmup"]
    rows = [(key, title, result[key]) for key, title in ROWS if key in result]
    lines = [
        f"# First training step: cold Triton cache vs after `tigon warmup` ({setup['device']}, {setup['date']})",
        "",
        f"{setup['model']}, tigon.patch defaults, bf16 autocast, fused AdamW, batch {setup['batch']} x "
        f"{setup['seq']}; each row a fresh process with its own `TRITON_CACHE_DIR`; steady = median of "
        f"{setup['steps']} steps after the first; a device synchronisation after each phase. "
        + ", ".join(f"{k} {v}" for k, v in setup["versions"].items() if v),
        "",
        f"`tigon warmup` (the whole process): {warmup['process_s']:.1f} s, {warmup['compiled_entries']} cache "
        "entries compiled.",
        "",
        "| process | first step s (forward / backward / optimizer) | steady step s (forward / backward / optimizer) "
        "| first / steady | cache entries compiled |",
        "| --- | --- | --- | ---: | ---: |",
    ]

    def phases(t: dict) -> str:
        return f"{t['step']:.3f} ({' / '.join(f'{t[k]:.3f}' for k in PHASES)})"

    for _, title, r in rows:
        lines.append(f"| {title} | {phases(r['first'])} | {phases(r['steady'])} | "
                     f"{r['first']['step'] / r['steady']['step']:.1f}x | {r['compiled_entries']} |")
    cold, warm = result.get("cold"), result.get("warm")
    if cold and warm:
        ratio = {key: r["first"]["step"] / r["steady"]["step"] for key, _, r in rows}
        stock = f"; stock: {ratio['stock']:.1f}x" if "stock" in ratio else ""
        lines += ["", f"After warmup the first step takes {ratio['warm']:.1f}x a steady step (cold: "
                  f"{ratio['cold']:.1f}x{stock}); warmup saved {cold['first']['step'] - warm['first']['step']:.1f} s "
                  "of the first step."]
    if "warm_gap" in result and warm:
        gap = result["warm_gap"]
        lines += ["", f"With {setup.get('gap_s', 2.0):g} s between the patch and the first step (row "
                  f"{[key for key, _, _ in rows].index('warm_gap') + 1}), the first step takes "
                  f"{gap['first']['step']:.3f} s against {warm['first']['step']:.3f} s right after the patch (row 2; "
                  "during the gap tigon.patch's background thread hashes Triton's compiler key)."]
    started = result.get("warm_started", {}).get("start_libraries_s")
    if started is not None:
        lines += ["", f"Library start-up before the first step (row 3): {started:.3f} s."]
    profile = result.get("warm_profile")
    if profile:
        for order in ("own", "cumulative"):
            lines += ["", f"After warmup, the first step's {PROFILE_ROWS} costliest functions by {order} time "
                      "(cProfile):", "", "| seconds | calls | function |", "| ---: | ---: | --- |"]
            lines += [f"| {sec:.4f} | {calls} | `{where}` |" for sec, calls, where in profile[order]]
    return "\n".join(lines) + "\n"


def history_result(result: dict) -> dict:
    """The run as a history record's fields: one row per measurement (each process's first step with the cache
    entries it compiled and its phases, its steady step; the warmup process as a whole), the setup and the
    warm first step's profile beside them."""
    rows = []
    for key, _ in ROWS:
        if key not in result:
            continue
        r = result[key]
        rows.append({"measurement": f"{key}_first_step", "s": round(r["first"]["step"], 3),
                     "compiled": r["compiled_entries"],
                     "phases_s": {k: round(r["first"][k], 3) for k in PHASES}})
        rows.append({"measurement": f"{key}_steady_step", "s": round(r["steady"]["step"], 3)})
    rows.append({"measurement": "warmup_process", "s": round(result["warmup"]["process_s"], 1),
                 "compiled": result["warmup"]["compiled_entries"]})
    setup = result["setup"]
    out = {"date": setup["date"], "device": setup["device"], "versions": setup["versions"], "rows": rows,
           "model": setup["model"], "batch": setup["batch"], "seq": setup["seq"], "gap_s": setup.get("gap_s")}
    started = result.get("warm_started", {}).get("start_libraries_s")
    if started is not None:
        out["start_libraries_s"] = round(started, 3)
    if result.get("warm_profile"):
        out["warm_profile"] = result["warm_profile"]
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(train_worker(args)))
        return
    import torch

    from tigon.bench.harness import versions

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/warmup.py times Triton compilation on a GPU; this machine has none")
    setup = {"model": MODEL, "seq": args.seq, "batch": args.batch, "steps": args.steps, "gap_s": args.gap,
             "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
             "versions": versions()}
    result = {"setup": setup}
    with tempfile.TemporaryDirectory(prefix="tigon-warmup-bench-") as tmp:
        cold_cache, warm_cache, stock_cache = Path(tmp) / "cold", Path(tmp) / "warm", Path(tmp) / "stock"
        print("cold: first step with an empty cache ...", flush=True)
        result["cold"] = train_process(args, cold_cache)
        print("tigon warmup into an empty cache ...", flush=True)
        result["warmup"] = warmup_process(args, warm_cache)
        print("after warmup: first step with the warmed cache ...", flush=True)
        result["warm"] = train_process(args, warm_cache)
        print("after warmup: the first step profiled ...", flush=True)
        result["warm_profile"] = train_process(args, warm_cache, "--profile")["profile"]
        print("after warmup, libraries started first ...", flush=True)
        result["warm_started"] = train_process(args, warm_cache, "--start-libraries")
        print("stock: the same step without tigon ...", flush=True)
        result["stock"] = train_process(args, stock_cache, "--stock")
        print(f"after warmup, {args.gap:g} s between the patch and the first step ...", flush=True)
        result["warm_gap"] = train_process(args, warm_cache, "--gap", str(args.gap))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"warmup-{setup['device'].replace(' ', '-')}-{setup['date']}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    from tigon.bench import history

    target = history.script_path(args)
    if target is not None:
        history.append(history_result(result), benchmark="warmup", path=target)
        print(f"appended the run to {target}")
    text = markdown(result)
    Path(f"{stem}.md").write_text(text)
    print()
    print(text)
    print(f"wrote {stem}.json, {stem}.md")


if __name__ == "__main__":
    main()
