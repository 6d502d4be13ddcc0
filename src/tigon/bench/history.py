"""One machine-readable record per benchmark run, appended to a JSON-lines history file.

Every writer of results — ``tigon bench`` (the harness) and the scripts in ``benchmarks/`` — appends
one line per run to ``benchmarks/results/history.jsonl`` of the source checkout tigon is imported
from (or to the file its caller names), so that the numbers behind every page of
``benchmarks/results/latest/`` and every later rerun stay in one file that a script can read:

    {"date": "2026-11-28", "device": "NVIDIA H100 80GB HBM3", "versions": {"torch": "2.11.0+cu130", ...},
     "benchmark": "bench", "command": "tigon bench fused_linear_cross_entropy", "rows": [...], ...}

Required keys: ``date`` (ISO day), ``device`` (the GPU's name), ``versions`` (package → version),
``benchmark`` (``bench``, ``e2e``, ``e2e-context``, ``e2e-memory-speed``, ``e2e-tp``, ``distributed``,
``lora``, ``context``, ``warmup``, ``trl-steps`` or ``trl-longest-dpo``), ``command`` (the command line that made
the run) and ``rows`` (the run's result rows, as its JSON file holds them). Anything else the run reports (settings,
copy bandwidth, wall time) rides along under its own key.

Appending is one ``write`` of one line to a file opened in append mode, so runs that finish at the
same time do not interleave within a line.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

REQUIRED = ("date", "device", "versions", "benchmark", "command", "rows")
FILE_NAME = "history.jsonl"
NONE = "none"  # as ``--history``: append the run nowhere (tigon bench and the benchmark scripts alike)
# Keys of a result that are the record's own, or that only name a temporary directory of the run.
_DROPPED_ROW_KEYS = ("quiet_path",)


def repo_results() -> Path | None:
    """``benchmarks/results`` of the source checkout tigon is imported from; None for an installed
    wheel (whose package has no repository around it)."""
    root = Path(__file__).resolve().parents[3]
    results = root / "benchmarks" / "results"
    return results if (root / "pyproject.toml").is_file() and results.is_dir() else None


def default_path() -> Path | None:
    """The history file a run appends to unless told otherwise: the checkout's
    ``benchmarks/results/history.jsonl``, or None (nothing appended) outside a checkout."""
    results = repo_results()
    return None if results is None else results / FILE_NAME


def command_line(argv: list[str] | None = None) -> str:
    """The command line of this process as a user would type it: ``tigon bench ...`` for the
    console script (or ``python -m tigon.cli``), ``python benchmarks/e2e.py ...`` for a script."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    prog = Path(argv[0])
    if prog.name in ("tigon", "cli.py", "__main__.py") and "tigon" in str(prog):
        head = ["tigon"]
    elif prog.suffix == ".py":
        head = ["python", f"{prog.parent.name}/{prog.name}" if prog.parent.name == "benchmarks" else str(prog)]
    else:
        head = [prog.name]
    return shlex.join(head + argv[1:])


def record(result: dict, *, benchmark: str, command: str) -> dict:
    """The history record of one run's ``result`` (the dict its JSON file holds)."""
    versions = result.get("versions") or {}
    if isinstance(versions, str):  # "torch 2.11.0, transformers 5.17.0"
        versions = dict(part.strip().split(" ", 1) for part in versions.split(",") if part.strip())
    rows = [{k: v for k, v in row.items() if k not in _DROPPED_ROW_KEYS} for row in result.get("rows", [])]
    out = {
        "date": result.get("date"),
        "device": result.get("device") or result.get("gpu"),
        "versions": versions,
        "benchmark": benchmark,
        "command": command,
        "rows": rows,
    }
    for key, value in result.items():
        if key not in out and key not in ("gpu", "files"):
            out[key] = value
    return out


def append(result: dict, *, benchmark: str, command: str | None = None, path: Path | str | None) -> dict | None:
    """Append the record of one run to the history file ``path`` (created with its folder if
    missing); ``path=None`` appends nothing. Returns the record written, or None."""
    if path is None:
        return None
    entry = record(result, benchmark=benchmark, command=command_line() if command is None else command)
    missing = [k for k in REQUIRED if entry[k] in (None, "")]
    if missing:
        raise ValueError(f"result: a history record needs {', '.join(missing)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(entry, separators=(",", ":"), default=str) + "\n"
    with path.open("a", encoding="utf-8") as f:
        f.write(line)
    return entry


def read(path: Path | str) -> list[dict]:
    """Every record of a history file, oldest first."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def add_argument(parser) -> None:
    """``--history PATH`` on a benchmark script's argument parser."""
    parser.add_argument("--history", type=Path, default=None,
                        help="JSON-lines file the run is appended to, or 'none' (default: "
                        "benchmarks/results/history.jsonl; none for a --tiny or --device cpu smoke run unless named)")


def script_path(args) -> Path | None:
    """Where a benchmark script's run is appended: ``--history`` when given (nowhere for ``none``); otherwise the
    checkout's history file, except for smoke runs (``--tiny`` or ``--device cpu``), whose numbers are no result."""
    if getattr(args, "history", None) is not None:
        return None if str(args.history) == NONE else args.history
    if getattr(args, "tiny", False) or getattr(args, "device", "cuda") == "cpu":
        return None
    return default_path()
