"""The benchmark harness on two source trees, one after the other, and the ratio of their GPU times.

    python3 scripts/bench-ab.py OLD_SRC NEW_SRC [--out DIR] [--rounds 1] [-- tigon bench arguments]

Runs ``tigon bench --providers tigon --quick`` (or the arguments after ``--``) with ``PYTHONPATH`` at OLD_SRC,
then at NEW_SRC, ``--rounds`` times alternately (a slow minute of the GPU then falls on both), each run a
fresh process writing into its own folder. Prints, per op, case and mode, the median of the new run's GPU
ms over the old one's, and the median and range of those ratios over every row: a refactor that changes no
kernel keeps the median within ±2%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    bench = ["--providers", "tigon", "--quick"]
    if "--" in argv:
        split = argv.index("--")
        argv, bench = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", type=Path, help="the source tree before (a folder holding tigon/)")
    p.add_argument("new", type=Path, help="the source tree after")
    p.add_argument("--out", type=Path, default=Path("bench-ab"), help="folder for each run's results")
    p.add_argument("--rounds", type=int, default=1, help="old/new pairs (default 1)")
    args = p.parse_args(argv)
    for tree in (args.old, args.new):
        if not (tree / "tigon" / "__init__.py").is_file():
            p.error(f"{tree} holds no tigon/ package")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.bench = bench
    return args


def run(tree: Path, out: Path, bench: list[str]) -> list[dict]:
    """One ``tigon bench`` process on ``tree``; its result rows."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.resolve()), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "tigon.cli", "bench", *bench, "--out", str(out)]
    if "--history" in (tree / "tigon" / "cli.py").read_text():  # (a tree from before the history file has none)
        cmd += ["--history", "none"]
    subprocess.run(cmd, env=env, check=True)
    (result,) = sorted(out.glob("*.json"))
    return json.loads(result.read_text())["rows"]


def key(row: dict) -> tuple:
    return row["op"], row["case"], row["provider"], row["mode"]


def ratios(old_runs: list[list[dict]], new_runs: list[list[dict]]) -> dict:
    """(op, case, provider, mode) -> median new ms / median old ms, over the rows both sides timed."""
    def medians(runs):
        times = {}
        for rows in runs:
            for row in rows:
                if isinstance(row.get("ms"), (int, float)):
                    times.setdefault(key(row), []).append(row["ms"])
        return {k: statistics.median(v) for k, v in times.items()}

    old, new = medians(old_runs), medians(new_runs)
    return {k: new[k] / old[k] for k in sorted(old.keys() & new.keys()) if old[k] > 0}


def report(table: dict) -> str:
    lines = ["| op | case | provider | mode | new / old |", "| --- | --- | --- | --- | ---: |"]
    lines += [f"| {op} | {case} | {provider} | {mode} | {r:.3f} |" for (op, case, provider, mode), r in table.items()]
    values = list(table.values())
    if values:
        lines += ["", f"{len(values)} rows: median new / old {statistics.median(values):.3f} "
                  f"(range {min(values):.3f}-{max(values):.3f})"]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    old_runs, new_runs = [], []
    for i in range(args.rounds):
        old_runs.append(run(args.old, args.out / f"old-{i}", args.bench))
        new_runs.append(run(args.new, args.out / f"new-{i}", args.bench))
    print(report(ratios(old_runs, new_runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
