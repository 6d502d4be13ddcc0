"""Run benchmark specs on a GPU: median times, bandwidth against the copy bandwidth measured in the
same run, peak memory; results as JSON, a markdown table and PNG plots.

Every number comes from this run: the copy bandwidth that % of speed-of-light is taken against is
measured first, on the same device, with the same timer.

Two times per step, both from CUDA events around it:

* ``ms`` (the headline, and what % of SOL is taken against): *GPU time*. Before each step the GPU is
  held in a ``torch.cuda._sleep`` long enough for the host to queue the whole step behind it, so
  the events measure the step's kernels running back to back — what the step costs inside a
  training loop, where the host runs ahead of the GPU behind the matmuls. No CUDA-graph capture is
  involved (a capture that fails part-way poisons the CUDA RNG for the rest of the process). A step
  that synchronises inside (``.item()``) cannot be queued, and its host time stays in the number.
* ``wall_ms``: the same events with no sleep (``triton.testing.do_bench``), host launch cost
  included: what a loop that waits on these ops alone sees. On a slow host (a VM, for one)
  small shapes measure the host here, for every provider alike.

L2 is flushed (a 256 MB write) before every timed step in both.

Each run writes ``<device>-<date>.{json,md,png}`` into its output folder and appends one line to a
history file (``tigon.bench.history``: by default ``benchmarks/results/history.jsonl`` of the
checkout tigon runs from).
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from tigon.bench import history as _history
from tigon.bench.spec import MODES, Case, Spec

COPY_BYTES = 1 << 30  # 1 GiB source: far past L2, so the copy measures device memory
WARMUP_MS = 25
REP_MS = 100


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers", "trl", "liger-kernel"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import triton.testing

    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
    return 2 * COPY_BYTES / (ms * 1e-3)


def _outputs(out, spec: Spec):
    outs = out if isinstance(out, tuple) else (out,)
    if spec.grad_outputs is not None:
        outs = tuple(outs[i] for i in spec.grad_outputs)
    return tuple(o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad)


def _grad_inputs(inputs: dict):
    return [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]


def make_step(fn, inputs: dict, spec: Spec, mode: str):
    """A zero-argument callable doing one ``mode`` step of ``fn`` on ``inputs``."""
    leaves = _grad_inputs(inputs)
    if mode == "fwd":
        return lambda: fn(**inputs)
    if mode == "full":
        # The random output gradient is drawn once, outside the timed region.
        outs = _outputs(fn(**inputs), spec)
        grads = [torch.randn_like(o) if o.dim() else torch.ones_like(o) for o in outs]
        del outs

        def full():
            torch.autograd.grad(_outputs(fn(**inputs), spec), leaves, grads, allow_unused=True)

        return full
    outs = _outputs(fn(**inputs), spec)
    grads = [torch.randn_like(o) if o.dim() else torch.ones_like(o) for o in outs]
    return lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)


def measure(step) -> tuple[float, float, float]:
    """(GPU ms, wall ms, peak MB allocated above what was allocated before one step); medians."""
    import triton.testing

    step()  # compile / autotune outside the timing
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    wall = triton.testing.do_bench(step, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
    return gpu_time(step, wall), wall, peak


L2_FLUSH_BYTES = 256 << 20
# The sleep that holds the GPU covers this multiple of the step's host time, plus a margin.
SLEEP_HOST_FACTOR = 2.0
SLEEP_MARGIN_MS = 0.05
MAX_SLEEP_MS = 200.0
_cycles_per_ms: float | None = None


def sleep_cycles_per_ms() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on this GPU, measured once per run."""
    global _cycles_per_ms
    if _cycles_per_ms is None:
        cycles = 20_000_000
        torch.cuda._sleep(cycles)  # first call: module load, clocks up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _cycles_per_ms = cycles / start.elapsed_time(end)
    return _cycles_per_ms


def gpu_time(step, estimate_ms: float, *, rep_ms: float = REP_MS) -> float:
    """Median GPU time of ``step`` in ms, its launches queued behind a sleeping GPU (module docs)."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    sleep_ms = min(MAX_SLEEP_MS, SLEEP_HOST_FACTOR * host_ms + SLEEP_MARGIN_MS)
    cycles = int(sleep_cycles_per_ms() * sleep_ms)
    reps = max(5, min(200, int(rep_ms / max(estimate_ms + sleep_ms, 1e-3))))
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.zero_()
        torch.cuda._sleep(cycles)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def providers_of(spec: Spec, only=None) -> dict:
    """The spec's providers plus ``compile`` (a fresh, static-shape torch.compile of ``eager``, so
    that no case runs a graph specialised for another, or a dynamic-shape one) and the peers' that
    import; ``only``: keep just these names."""
    providers = dict(spec.providers)
    if only is None or "compile" in only:
        torch._dynamo.reset()
        providers["compile"] = torch.compile(spec.providers["eager"], dynamic=False)
    for name, make in spec.peers.items():
        if only is None or name in only:
            peer = make()
            if peer is not None:
                providers[name] = peer
    return providers if only is None else {k: v for k, v in providers.items() if k in only}


# torch.compile donates the saved buffers of its backward graph, which forbids the repeated
# ``retain_graph`` backward that the bwd mode times; its backward shows in the full mode.
SKIP = {("compile", "bwd")}


def run_spec(spec: Spec, bandwidth: float, *, quick=False, providers=None, log=print) -> list[dict]:
    rows = []
    cases = spec.cases()
    if quick:
        cases = cases[:2]
    for case in cases:
        for provider, fn in providers_of(spec, providers).items():
            for mode in spec.modes:
                if (provider, mode) in SKIP:
                    continue
                row = {"op": spec.name, "case": case.label, "params": case.params, "provider": provider, "mode": mode}
                try:
                    inputs = case.make_inputs(torch.device("cuda"), spec.dtype)
                    ms, wall, peak = measure(make_step(fn, inputs, spec, mode))
                    row.update(ms=ms, wall_ms=wall, peak_mb=peak)
                    _add_rates(row, case, bandwidth)
                except torch.OutOfMemoryError:
                    row.update(error="out of memory")
                except Exception as exc:  # one provider failing (e.g. a Liger API mismatch) is a result
                    row.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                finally:
                    inputs = None
                    gc.collect()
                    torch.cuda.empty_cache()
                rows.append(row)
                log(_row_line(row))
    return rows


def _add_rates(row: dict, case: Case, bandwidth: float) -> None:
    t = row["ms"]
    sol = case.sol_bytes.get(row["mode"])
    if sol:
        row["gbps"] = sol / (t * 1e-3) / 1e9
        row["sol_ms"] = sol / bandwidth * 1e3
        row["sol_pct"] = 100 * row["sol_ms"] / t
    flops = case.flops.get(row["mode"])
    if flops:
        row["tflops"] = flops / (t * 1e-3) / 1e12


def _row_line(row: dict) -> str:
    head = f"{row['op']:>14} {row['case'][:44]:<44} {row['provider']:>8} {row['mode']:>4}"
    if "error" in row:
        return f"{head}  ERROR {row['error']}"
    sol = f" {row['sol_pct']:5.1f}% SOL" if "sol_pct" in row else ""
    wall = f" (wall {row['wall_ms']:.3f})" if "wall_ms" in row else ""
    return f"{head} {row['ms']:9.3f} ms{sol}{wall} {row['peak_mb']:9.1f} MB"


def markdown(result: dict) -> str:
    """One table per op: rows = cases, columns = providers, cell = full-mode ms (% of SOL)."""
    lines = [
        f"# tigon benchmarks — {result['device']} — {result['date']}",
        "",
        f"Versions: {', '.join(f'{k} {v}' for k, v in result['versions'].items() if v)}. "
        f"Copy bandwidth measured in this run: {result['copy_bandwidth_gbps']:.0f} GB/s (read + write). "
        "Cells: median GPU ms of forward+backward (CUDA events around each step, its launches queued "
        "behind a sleeping GPU so that host launch cost is hidden as in a training loop; L2 flushed "
        "before each step); % of speed of light = minimal bytes / that bandwidth; peak MB allocated "
        "beyond the inputs in brackets. The wall-clock tables after them time the same steps with "
        "the host's launch cost included.",
    ]
    by_op: dict[str, list] = {}
    for row in result["rows"]:
        by_op.setdefault(row["op"], []).append(row)
    for op, rows in by_op.items():
        lines += _table(op, rows, "", _cell)
    for op, rows in by_op.items():
        if any("wall_ms" in r for r in rows):
            lines += _table(op, rows, ", wall clock: median ms, host launch cost included", _wall_cell)
    return "\n".join(lines) + "\n"


def _table(op: str, rows: list[dict], title: str, cell) -> list[str]:
    """One markdown table of ``op``: rows = cases, columns = providers, full mode when there is one."""
    mode = "full" if any(r["mode"] == "full" for r in rows) else rows[0]["mode"]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    lines = ["", f"## {op} ({mode}){title}", "", "| case | " + " | ".join(providers) + " |",
             "| --- |" + " --- |" * len(providers)]
    for case in dict.fromkeys(r["case"] for r in rows):
        cells = []
        for p in providers:
            match = [r for r in rows if r["case"] == case and r["provider"] == p and r["mode"] == mode]
            cells.append(cell(match[0]) if match else "—")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return lines


def _wall_cell(row: dict) -> str:
    return f"{row['wall_ms']:.3f}" if "wall_ms" in row else _cell(row)


def _cell(row: dict) -> str:
    if "error" in row:
        return "error" if "memory" not in row["error"] else "OOM"
    sol = f" ({row['sol_pct']:.0f}%)" if "sol_pct" in row else ""
    tf = f" {row['tflops']:.0f} TF/s" if "tflops" in row else ""
    return f"{row['ms']:.3f}{sol}{tf} [{row['peak_mb']:.0f}]"


def plot(result: dict, path: Path) -> None:
    """One bar chart per op (full mode), providers side by side per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in result["rows"]))
    fig, axes = plt.subplots(len(ops), 1, figsize=(12, 3.2 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops, strict=True):
        rows = [r for r in result["rows"] if r["op"] == op and r["mode"] == "full" and "ms" in r]
        cases = list(dict.fromkeys(r["case"] for r in rows))
        providers = list(dict.fromkeys(r["provider"] for r in rows))
        width = 0.8 / max(1, len(providers))
        for i, p in enumerate(providers):
            xs, ys = [], []
            for j, c in enumerate(cases):
                match = [r["ms"] for r in rows if r["case"] == c and r["provider"] == p]
                if match:
                    xs.append(j + i * width)
                    ys.append(match[0])
            ax.bar(xs, ys, width, label=p)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels([c[:28] for c in cases], rotation=20, ha="right", fontsize=7)
        ax.set_ylabel("ms (fwd+bwd)")
        ax.set_title(op)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


AUTO = "auto"  # history=AUTO: the checkout's benchmarks/results/history.jsonl (none outside a checkout)


def history_path(history: Path | str | None) -> Path | None:
    """The file a run appends to: ``history`` itself, the default for ``AUTO``, nothing for None."""
    if history == AUTO:
        return _history.default_path()
    return None if history is None else Path(history)


def save(result: dict, out_dir: Path, stem: str) -> list[Path]:
    """Write the run's JSON and markdown into ``out_dir`` (as often as a spec finishes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps(result, indent=1))
    paths[1].write_text(markdown(result))
    return paths


def finish(result: dict, out_dir: Path, stem: str, *, history: Path | str | None = AUTO, command: str | None = None,
           log=print) -> list[Path]:
    """The run's last writes: its JSON and markdown, its plot, and its line in the history file."""
    paths = save(result, out_dir, stem)
    try:
        plot(result, out_dir / f"{stem}.png")
        paths.append(out_dir / f"{stem}.png")
    except ImportError:
        log("matplotlib not installed: no plot written (pip install 'tigon[demo]')")
    target = history_path(history)
    if target is not None:
        _history.append(result, benchmark="bench", command=command, path=target)
        log(f"appended the run to {target}")
    return paths


def run(names=None, *, out_dir: Path, quick=False, providers=None, history: Path | str | None = AUTO,
        command: str | None = None, log=print) -> dict:
    """Run the specs ``names`` (all when None) and write the results into ``out_dir``.

    ``history``: the JSON-lines file the run is appended to (``AUTO``: the checkout's
    ``benchmarks/results/history.jsonl``; None: none); ``command``: the command line recorded there
    (default: this process's, ``tigon bench ...``).
    """
    from tigon.bench.specs import load_specs

    if not torch.cuda.is_available():
        raise RuntimeError("tigon bench needs a CUDA GPU; this machine has none")
    specs = load_specs(names)
    if names:
        missing = set(names) - set(specs)
        if missing:
            raise ValueError(f"unknown benchmark(s) {sorted(missing)}; available: {sorted(load_specs())}")
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s on {device_name()}")
    date = _dt.date.today().isoformat()
    result = {
        "device": device_name(),
        "date": date,
        "versions": versions(),
        "copy_bandwidth_gbps": bandwidth / 1e9,
        "modes": list(MODES),
        "rows": [],
    }
    stem = f"{device_name().replace(' ', '-')}-{date}"
    for spec in specs.values():
        result["rows"] += run_spec(spec, bandwidth, quick=quick, providers=providers, log=log)
        # Written after every spec, so a run cut short still leaves what it measured.
        save(result, out_dir, stem)
    paths = finish(result, out_dir, stem, history=history, command=command, log=log)
    result["files"] = [str(p) for p in paths]
    return result
