"""Sweep the norm kernels' launch geometry on a GPU and print the kernel time of each choice.

An experiment kept out of the package (STYLE: llm.c habit): its findings go into
``FWD_TUNING`` / ``BWD_TUNING`` in src/tigon/ops/rms_norm.py, with its logs in benchmarks/results/ (tune_norm*-<device>-<date>.log).

    PYTHONPATH=src python3 scripts/tune_norm.py                 # every section
    PYTHONPATH=src python3 scripts/tune_norm.py stream          # one or more of: fused stream host

fused:  forward and backward geometry of RMSNorm over hidden sizes 896..65536 (elements per warp,
        programs per SM, where rows stop being held in registers).
stream: the streamed backward's knobs (the ``stream_*`` fields and ``chunk``, ``elements_per_warp``)
        for rms_norm, add_rms_norm and layer_norm at hidden 16384..65536: per shape a coordinate
        descent from the shipped default (each knob in turn over its values, the others held, two
        rounds), then every shape's winner and the shipped knobs under several L2 budgets timed on
        every shape, so that one setting can be picked for all. About 3-4 minutes on an H100.
host:   the eager host cost of one small forward+backward, with a profile.

Times are of the kernels alone (CUDA-graph replay). Every tensor of the stream shapes is 128 MiB or
more, far past the 50 MB L2, so replays do not find their inputs in L2; SOL is the minimal bytes
over the copy bandwidth measured first.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time

import torch
import triton.testing

import tigon.ops  # noqa: F401  (defines the kernels)
from tigon.ops._common import _direct_launch

rms = sys.modules["tigon.ops.rms_norm"]
ln = sys.modules["tigon.ops.layer_norm"]

SHAPES = ((16384, 896), (16384, 2048), (16384, 4096), (8192, 8192), (4096, 16384), (2048, 32768), (1024, 65536))
BWD_VARIANTS = [
    dict(programs_per_sm=pps, elements_per_warp=epw, max_fused_hidden=mf)
    for pps in (1, 2, 4)
    for epw in (256, 512)
    for mf in (8192, 16384)
]
FWD_VARIANTS = [dict(elements_per_warp=epw, max_fused_hidden=mf) for epw in (256, 512, 1024) for mf in (16384, 65536)]


def bench(fn, rep=40):
    """GPU time of ``fn`` replayed as a CUDA graph: the kernels alone, without host launch cost."""
    with _direct_launch():
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def copy_bandwidth():
    bw_src = torch.empty(1 << 28, device="cuda")
    bw_dst = torch.empty_like(bw_src)
    copy_ms = bench(lambda: bw_dst.copy_(bw_src))
    bandwidth = 2 * bw_src.numel() * 4 / (copy_ms * 1e-3)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    return bandwidth
    return bandwidth


def sweep_fused(bandwidth):
    base_fwd, base_bwd = rms.FWD_TUNING, rms.BWD_TUNING
    for rows, hidden in SHAPES:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        tensor = rows * hidden * 2
        fwd_sol = 2 * tensor / bandwidth * 1e3
        bwd_sol = 3 * tensor / bandwidth * 1e3
        forward = functools.partial(rms._forward, x, None, w, 1e-6, 0.0, "llama")
        results = []
        for v in FWD_VARIANTS:
            rms.FWD_TUNING = dataclasses.replace(base_fwd, **v)
            try:
                ms = bench(forward)
                results.append(("fwd", v, ms, 100 * fwd_sol / ms))
            except Exception as exc:
                results.append(("fwd", v, float("nan"), f"{type(exc).__name__}"))
        rms.FWD_TUNING = base_fwd
        _, _, rstd = forward()
        backward = functools.partial(rms._backward, dy, x, w, rstd, None, 1e-6, 0.0, "llama")
        for v in BWD_VARIANTS:
            rms.BWD_TUNING = dataclasses.replace(base_bwd, **v)
            try:
                ms = bench(backward)
                results.append(("bwd", v, ms, 100 * bwd_sol / ms))
            except Exception as exc:
                results.append(("bwd", v, float("nan"), f"{type(exc).__name__}"))
        rms.BWD_TUNING = base_bwd
        for direction in ("fwd", "bwd"):
            rs = sorted((r for r in results if r[0] == direction and r[2] == r[2]), key=lambda r: r[2])
            best = rs[0] if rs else None
            print(f"M={rows} N={hidden} {direction}: best {best[1]} {best[2]:.4f} ms ({best[3]:.0f}% SOL)")
            for r in rs[1:4]:
                print(f"      next {r[1]} {r[2]:.4f} ms ({r[3]:.0f}%)")
        cur_f, cur_b = bench(forward), bench(backward)
        print(
            f"      current config: fwd {cur_f:.4f} ms ({100 * fwd_sol / cur_f:.0f}%), "
            f"bwd {cur_b:.4f} ms ({100 * bwd_sol / cur_b:.0f}%)"
        )


# ------------------------------------------------------------------------------ streamed backward

STREAM_SHAPES = {
    "rms_norm": ((4096, 16384), (2048, 32768), (1024, 65536)),
    "add_rms_norm": ((4096, 16384), (2048, 32768)),
    "layer_norm": ((4096, 16384), (2048, 32768)),
}
# The descent's space: each knob's values (the ``stream_*`` ones exact: stream_l2_bytes=None).
STREAM_SPACE = {
    "stream_rows": (1, 2, 4),
    "stream_split": (1, 2, 4),
    "stream_stages": (1, 2, 3),
    "chunk": (2048, 4096),
    "elements_per_warp": (256, 512),  # fewer warps spill: each thread holds ~5 fp32 values an element
    "stream_programs_per_sm": (1.0, 2.0),
    "stream_evict_first": (False, True),
}
STREAM_ROUNDS = 2
STREAM_REP = 20  # ms of replays per timing: the descent times ~200 configurations
STREAM_BUDGETS = (16 << 20, 24 << 20, 32 << 20, 48 << 20)


@dataclasses.dataclass
class StreamCase:
    op: str
    rows: int
    hidden: int
    forward: object  # () -> outputs, the op's forward launcher
    backward: object  # () -> grads, its backward launcher
    fwd_bytes: int  # minimal bytes moved (the M×N tensors read and written)
    bwd_bytes: int
    row_bytes: int  # what norm_backward_launch is given
    partials: int

    @property
    def name(self):
        return f"{self.op} {self.rows}x{self.hidden}"


DEVICE = "cuda"


def make_case(op, rows, hidden):
    def randn(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16)

    x, w, dy = randn(rows, hidden), randn(hidden), randn(rows, hidden)
    tensor = rows * hidden * x.element_size()
    eps = 1e-6
    if op == "layer_norm":
        b = randn(hidden)
        _, mean, rstd = ln._forward(x, w, b, eps)
        return StreamCase(
            op, rows, hidden, lambda: ln._forward(x, w, b, eps), lambda: ln._backward(dy, x, w, b, mean, rstd),
            2 * tensor, 3 * tensor, 4 * hidden, 2,
        )
    if op == "add_rms_norm":
        res, ds = randn(rows, hidden), randn(rows, hidden)
        _, s, rstd = rms._forward(x, res, w, eps, 0.0, "llama")
        return StreamCase(
            op, rows, hidden, lambda: rms._forward(x, res, w, eps, 0.0, "llama"),
            lambda: rms._backward(dy, s, w, rstd, ds, eps, 0.0, "llama"), 4 * tensor, 4 * tensor, 4 * hidden, 1,
        )
    _, _, rstd = rms._forward(x, None, w, eps, 0.0, "llama")
    return StreamCase(
        op, rows, hidden, lambda: rms._forward(x, None, w, eps, 0.0, "llama"),
        lambda: rms._backward(dy, x, w, rstd, None, eps, 0.0, "llama"), 2 * tensor, 3 * tensor, 4 * hidden, 1,
    )


def knobs_of(tuning):
    return {k: getattr(tuning, k) for k in STREAM_SPACE}


def describe(knobs):
    short = {"stream_rows": "rows", "stream_split": "split", "stream_stages": "stages", "chunk": "chunk",
             "elements_per_warp": "epw", "stream_programs_per_sm": "pps", "stream_evict_first": "evict"}
    parts = [f"{short[k]}={knobs[k]}" for k in STREAM_SPACE if k in knobs]
    if "stream_l2_bytes" in knobs:
        budget = knobs["stream_l2_bytes"]
        parts.append("l2=" + ("none" if budget is None else f"{budget >> 20}MiB"))
    return " ".join(parts)


class StreamTimer:
    """Times one case's backward under BWD_TUNING overrides, each setting once."""

    def __init__(self, case, base):
        self.case, self.base, self.seen = case, base, {}

    def __call__(self, **overrides):
        key = tuple(sorted(overrides.items()))
        if key not in self.seen:
            rms.BWD_TUNING = dataclasses.replace(self.base, **overrides)
            try:
                self.seen[key] = bench(self.case.backward, rep=STREAM_REP)
            except Exception as exc:  # a setting past the shared memory or the registers: skip it
                print(f"      {describe(overrides)}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
                self.seen[key] = math.inf
            finally:
                rms.BWD_TUNING = self.base
        return self.seen[key]


def descend(timer, start):
    """Coordinate descent over STREAM_SPACE from ``start`` (exact knobs, no L2 budget)."""
    best = dict(start)
    best_ms = timer(stream_l2_bytes=None, **best)
    for _ in range(STREAM_ROUNDS):
        improved = False
        for knob, values in STREAM_SPACE.items():
            for value in values:
                if value == best[knob]:
                    continue
                trial = {**best, knob: value}
                ms = timer(stream_l2_bytes=None, **trial)
                if ms < best_ms:
                    best, best_ms, improved = trial, ms, True
        if not improved:
            break
    return best, best_ms


def sweep_stream(bandwidth):
    base = rms.BWD_TUNING
    # ~6 tensors of 128 MiB per case, all kept: ~5 GiB
    cases = [make_case(op, rows, hidden) for op, shapes in STREAM_SHAPES.items() for rows, hidden in shapes]
    timers = {case.name: StreamTimer(case, base) for case in cases}
    winners = []
    for case in cases:
        timer = timers[case.name]
        sol_ms = case.bwd_bytes / bandwidth * 1e3
        launch = rms.norm_backward_launch(case.rows, case.hidden, case.row_bytes, case.partials, torch.device(DEVICE))
        shipped_ms = timer()
        fwd_ms = bench(case.forward, rep=STREAM_REP)
        start = {**knobs_of(base), "stream_rows": launch.block_m, "stream_split": launch.split}
        best, best_ms = descend(timer, start)
        winners.append(best)
        fwd_bwd = 100 * (case.fwd_bytes + case.bwd_bytes) / bandwidth * 1e3 / (fwd_ms + best_ms)
        print(
            f"{case.name}: shipped knobs (l2 {base.stream_l2_bytes}) -> rows={launch.block_m} split={launch.split} "
            f"bands={launch.bands} warps={launch.num_warps}: bwd {shipped_ms:.4f} ms "
            f"({100 * sol_ms / shipped_ms:.0f}% SOL)"
        )
        print(
            f"    best  {describe(best)}: bwd {best_ms:.4f} ms ({100 * sol_ms / best_ms:.0f}% SOL); "
            f"fwd {fwd_ms:.4f} ms; fwd+bwd {fwd_bwd:.0f}% SOL; {len(timer.seen)} settings timed"
        )
        ranked = sorted(((ms, dict(k)) for k, ms in timer.seen.items() if ms < math.inf), key=lambda r: r[0])
        for ms, knobs in ranked[1:6]:
            knobs.pop("stream_l2_bytes", None)
            print(f"    next  {describe(knobs)}: {ms:.4f} ms ({100 * sol_ms / ms:.0f}%)")

    # Every shape's winner on every shape; then the best of them under L2 budgets (the budget picks
    # rows and split per shape, up to 4 each), and the shipped knobs: one setting for all shapes.
    print("\nbwd % of SOL, every candidate on every shape (geomean last):")
    print("  #  " + " ".join(f"{case.op:>12}" for case in cases) + "  geomean")
    print("     " + " ".join(f"{case.rows}x{case.hidden}".rjust(12) for case in cases))
    candidates, scores = [], []

    def score(setting):
        if setting in candidates:
            return
        candidates.append(setting)
        row = [100 * case.bwd_bytes / bandwidth * 1e3 / timers[case.name](**setting) for case in cases]
        geo = math.exp(sum(math.log(max(v, 1e-3)) for v in row) / len(row))
        index = len(candidates) - 1
        scores.append((geo, index))
        print(f"  {index:<2} " + " ".join(f"{v:12.0f}" for v in row) + f"  {geo:7.1f}   {describe(setting)}")

    for knobs in winners:
        score({**knobs, "stream_l2_bytes": None})
    best_exact = candidates[max(scores)[1]]
    for budget in STREAM_BUDGETS:
        score({**best_exact, "stream_rows": 4, "stream_split": 4, "stream_l2_bytes": budget})
    score({**knobs_of(base), "stream_l2_bytes": base.stream_l2_bytes})
    geo, i = max(scores)
    fields = ", ".join(f"{k}={v!r}" for k, v in candidates[i].items())
    print(f"best single setting: #{i} (geomean {geo:.1f}% of SOL): BWD_TUNING fields {fields}")


def host_overhead():
    # CPU cost of one eager forward+backward through the public function, on a tensor so small
    # that the GPU waits on the CPU: this is the per-call overhead a training step pays.
    x = torch.randn(8, 256, device="cuda", requires_grad=True)
    w = torch.randn(256, device="cuda", requires_grad=True)
    g = torch.randn(8, 256, device="cuda")
    for _ in range(20):
        torch.autograd.grad(tigon.ops.rms_norm(x, w), (x, w), g)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        torch.autograd.grad(tigon.ops.rms_norm(x, w), (x, w), g)
    torch.cuda.synchronize()
    print(f"eager rms_norm fwd+bwd host overhead: {(time.perf_counter() - start) / 200 * 1e6:.0f} us per call")
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        torch.autograd.grad(tigon.ops.rms_norm(x, w), (x, w), g)
    torch.cuda.synchronize()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)


SECTIONS = {"fused": sweep_fused, "stream": sweep_stream, "host": None}


def main():
    sections = sys.argv[1:] or list(SECTIONS)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        sys.exit(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    bandwidth = copy_bandwidth()
    for section in sections:
        start = time.perf_counter()
        if section == "host":
            host_overhead()
        else:
            SECTIONS[section](bandwidth)
        print(f"[{section}: {time.perf_counter() - start:.0f} s]")


if __name__ == "__main__":
    main()
