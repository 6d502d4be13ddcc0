"""Sweep the norm kernels' launch geometry on a GPU and print the kernel time of each choice.

An experiment kept out of the package (STYLE: llm.c habit): its findings go into
``RMSNormConfig`` (forward / backward) in src/tigon/_kernels/norm_launch.py and ``LayerNormConfig`` in
src/tigon/ops/layer_norm.py, with its logs in benchmarks/results/ (tune_norm*-<device>-<date>.log).

    PYTHONPATH=src python3 dev/tune_norm.py                 # every section
    PYTHONPATH=src python3 dev/tune_norm.py fused-ln fused  # one or more of: fused-ln fused stream boundary
                                                                # wide long-fwd split host

fused-ln: LayerNorm where rows are held in registers (N <= 8192): every field of layer_norm.py's
        LayerNormTuning (forward tile and warps; backward tile, warps, programs per SM, how loads are
        kept in flight, one or two row reductions, the partial-row sum's tile) at 16384x896,
        65536x1024, 32768x2048, 16384x4096 and 8192x8192. Per shape and direction a coordinate
        descent from the shipped setting (each knob in turn over its values, the others held), each
        setting checked against torch in fp32 before it is timed and printed as it goes; then every
        shape's winner timed on every shape, and the one setting with the best geomean of % of SOL
        printed as LayerNormTuning fields. About 2 minutes on an H100 (most of it compiling).
fused:  the same for RMSNorm and add_rms_norm at the short-row shapes 16384x896 and 65536x1024
        (norm_launch.py's RMSNormConfig forward / backward: tile_elements, elements_per_warp, max_warps,
        programs_per_sm; one setting for both ops, which share them). About 1 minute.
stream: the streamed backward's knobs (the ``stream_*`` fields and ``chunk``, ``elements_per_warp``)
        for rms_norm, add_rms_norm and layer_norm at hidden 16384..65536: per shape a coordinate
        descent from the shipped default (each knob in turn over its values, the others held, two
        rounds), then every shape's winner and the shipped knobs timed on every shape, so that one
        setting can be picked for all. About 3-4 minutes on an H100.
boundary: RMSNorm's forward and backward over hidden sizes 896..65536 with where rows stop being
        held in registers (max_fused_hidden) moved; inputs replayed from L2 at the small sizes.
wide:   RMSNorm, add_rms_norm and LayerNorm at 4096x16384 with the row held in registers (the
        backward's max_fused_hidden raised to 16384) and up to 32 warps a row, against the shipped
        streamed backward; each setting checked against torch first. About 1-2 minutes. On the H100
        (benchmarks/results/tune_norm_wide-*.log) the fused backward loses (RMSNorm 0.30 ms
        against the streamed 0.20; LayerNorm 0.62 against 0.23); without its software prefetch (a
        kernel variant tried then, not kept) RMSNorm reached 0.194 and add_rms_norm 0.247 against
        0.203 and 0.254: 3-5% on one size, not enough to catch Liger-Kernel there, so the streamed
        backward stays.
split:  the backward of rows of 16K-64K split over programs that swap their partial row sums (the
        split_* fields of RMSNormConfig.backward), each setting checked, against the streamed backward.
long-fwd: the forward of rms_norm, add_rms_norm and layer_norm at hidden 16384..65536: where rows stop
        being held in registers (max_fused_hidden) and the streamed forward's chunk and warps.
host:   the eager host cost of one small forward+backward, with a profile.

Times are of the kernels alone (CUDA-graph replay). In fused-ln and fused, each timed call reads
its own copy of the inputs, rotating through enough copies (ROTATE_BYTES) that replays do not find
them in the 50 MB L2; the stream shapes' tensors are 128 MiB or more anyway. SOL is the minimal
bytes over the copy bandwidth measured first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

import tigon.ops  # noqa: F401  (defines the kernels)
from tigon._kernels.launch import _direct_launch

rms = sys.modules["tigon.ops.rms_norm"]
norm_launch = sys.modules["tigon._kernels.norm_launch"]  # RMSNorm's CONFIG
ln = sys.modules["tigon.ops.layer_norm"]


def set_rms_config(*, forward=None, backward=None):
    """Make RMSNorm's config (shared by the three norms' split and streamed geometry) launch with
    these direction settings. The norms launch through registered ops, which take no config, so
    this script swaps the module's default (frozen) config, as the tests do."""
    norm_launch.CONFIG = dataclasses.replace(norm_launch.CONFIG, forward=forward or norm_launch.CONFIG.forward,
                                     backward=backward or norm_launch.CONFIG.backward)

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


def sweep_boundary(bandwidth):
    base_fwd, base_bwd = norm_launch.CONFIG.forward, norm_launch.CONFIG.backward
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
            set_rms_config(forward=dataclasses.replace(base_fwd, **v))
            try:
                ms = bench(forward)
                results.append(("fwd", v, ms, 100 * fwd_sol / ms))
            except Exception as exc:
                results.append(("fwd", v, float("nan"), f"{type(exc).__name__}"))
        set_rms_config(forward=base_fwd)
        _, _, rstd = forward()
        backward = functools.partial(rms._backward, dy, x, w, rstd, None, 1e-6, 0.0, "llama")
        for v in BWD_VARIANTS:
            set_rms_config(backward=dataclasses.replace(base_bwd, **v))
            try:
                ms = bench(backward)
                results.append(("bwd", v, ms, 100 * bwd_sol / ms))
            except Exception as exc:
                results.append(("bwd", v, float("nan"), f"{type(exc).__name__}"))
        set_rms_config(backward=base_bwd)
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
    "add_rms_norm": ((4096, 16384), (2048, 32768), (1024, 65536)),
    "layer_norm": ((4096, 16384), (2048, 32768)),
}
# The descent's space: each knob's values.
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


@dataclasses.dataclass
class StreamCase:
    op: str
    rows: int
    hidden: int
    forward: object  # () -> outputs, the op's forward launcher
    backward: object  # () -> grads, its backward launcher
    fwd_bytes: int  # minimal bytes moved (the M×N tensors read and written)
    bwd_bytes: int
    row_bytes: int  # bytes of one row pass 2 reads again (dy and x)
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
    return " ".join(parts)


class StreamTimer:
    """Times one case's backward under RMSNormConfig.backward overrides, each setting once."""

    def __init__(self, case, base):
        self.case, self.base, self.seen, self.shipped = case, base, {}, norm_launch.CONFIG.backward
        self.expected = [g.float().clone() for g in case.backward() if g is not None and g.numel()]

    def check(self):
        """The setting's gradients against the shipped setting's (the same math, other launch)."""
        got = [g for g in self.case.backward() if g is not None and g.numel()]
        for out, ref in zip(got, self.expected, strict=True):
            err = rel_err(out, ref)
            if not err < CHECK_TOLERANCE:
                raise AssertionError(f"gradient off by {err:.2e} relative")

    def __call__(self, **overrides):
        key = tuple(sorted(overrides.items()))
        if key not in self.seen:
            set_rms_config(backward=dataclasses.replace(self.base, **overrides))
            try:
                self.check()
                self.seen[key] = bench(self.case.backward, rep=STREAM_REP)
            except Exception as exc:  # a setting past the shared memory or the registers: skip it
                print(f"      {describe(overrides)}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
                self.seen[key] = math.inf
            finally:
                set_rms_config(backward=self.shipped)
        return self.seen[key]


def descend(timer, start):
    """Coordinate descent over STREAM_SPACE from ``start``."""
    best = dict(start)
    best_ms = timer(**best)
    for _ in range(STREAM_ROUNDS):
        improved = False
        for knob, values in STREAM_SPACE.items():
            for value in values:
                if value == best[knob]:
                    continue
                trial = {**best, knob: value}
                ms = timer(**trial)
                if ms < best_ms:
                    best, best_ms, improved = trial, ms, True
        if not improved:
            break
    return best, best_ms


def sweep_stream(bandwidth):
    base = dataclasses.replace(norm_launch.CONFIG.backward, split_max_hidden=0)  # the streamed backward itself
    # ~6 tensors of 128 MiB per case, all kept: ~5 GiB
    cases = [make_case(op, rows, hidden) for op, shapes in STREAM_SHAPES.items() for rows, hidden in shapes]
    timers = {case.name: StreamTimer(case, base) for case in cases}
    winners = []
    for case in cases:
        timer = timers[case.name]
        sol_ms = case.bwd_bytes / bandwidth * 1e3
        launch = rms.norm_backward_launch(case.rows, case.hidden, torch.device(DEVICE))
        shipped_ms = timer()
        fwd_ms = bench(case.forward, rep=STREAM_REP)
        start = {**knobs_of(base), "stream_rows": launch.block_m, "stream_split": launch.split}
        best, best_ms = descend(timer, start)
        winners.append(best)
        fwd_bwd = 100 * (case.fwd_bytes + case.bwd_bytes) / bandwidth * 1e3 / (fwd_ms + best_ms)
        print(
            f"{case.name}: shipped knobs -> rows={launch.block_m} split={launch.split} "
            f"bands={launch.bands} warps={launch.num_warps}: bwd {shipped_ms:.4f} ms "
            f"({100 * sol_ms / shipped_ms:.0f}% SOL)"
        )
        print(
            f"    best  {describe(best)}: bwd {best_ms:.4f} ms ({100 * sol_ms / best_ms:.0f}% SOL); "
            f"fwd {fwd_ms:.4f} ms; fwd+bwd {fwd_bwd:.0f}% SOL; {len(timer.seen)} settings timed"
        )
        ranked = sorted(((ms, dict(k)) for k, ms in timer.seen.items() if ms < math.inf), key=lambda r: r[0])
        for ms, knobs in ranked[1:6]:
            print(f"    next  {describe(knobs)}: {ms:.4f} ms ({100 * sol_ms / ms:.0f}%)")

    # Every shape's winner on every shape, and the shipped knobs: one setting for all shapes.
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
        score(knobs)
    score(knobs_of(base))
    geo, i = max(scores)
    fields = ", ".join(f"{k}={v!r}" for k, v in candidates[i].items())
    print(f"best single setting: #{i} (geomean {geo:.1f}% of SOL): RMSNormConfig.backward fields {fields}")


# ------------------------------------------------------------------------- split rows, backward

SPLIT_SHAPES = ((4096, 16384), (2048, 32768), (1024, 65536))
SPLIT_SPACE = [
    dict(split_slice=slice_, split_warps=warps, split_programs_per_sm=pps)
    for slice_ in (2048, 4096, 8192)
    for warps in (8, 16)
    for pps in (0.5, 1.0)
]


def sweep_split(bandwidth):
    """The backward of rows of 16K-64K with each row split over programs that swap partial row sums
    (split_max_hidden raised past the row), per slice width, warps and programs per SM, against the
    streamed backward; every setting checked against the streamed one's gradients first."""
    base = norm_launch.CONFIG.backward
    best_of = {}
    for op in ("rms_norm", "add_rms_norm", "layer_norm"):
        for rows, hidden in SPLIT_SHAPES:
            case = make_case(op, rows, hidden)
            sol_ms = case.bwd_bytes / bandwidth * 1e3
            timer = StreamTimer(case, dataclasses.replace(base, split_max_hidden=0))
            streamed = timer()
            results = []
            for knobs in SPLIT_SPACE:
                ms = timer(split_max_hidden=1 << 20, **knobs)
                if ms < math.inf:
                    results.append((ms, knobs))
            results.sort(key=lambda r: r[0])
            print(f"{case.name} bwd: streamed {streamed:.4f} ms ({100 * sol_ms / streamed:.0f}% SOL)")
            for ms, knobs in results[:5]:
                print(f"    split {knobs}: {ms:.4f} ms ({100 * sol_ms / ms:.0f}% SOL)")
            for ms, knobs in results:
                key = tuple(sorted(knobs.items()))
                best_of.setdefault(key, []).append(100 * sol_ms / ms)
    count = len(SPLIT_SHAPES) * 3
    ranked = sorted(
        ((math.exp(sum(math.log(v) for v in vals) / len(vals)), dict(key)) for key, vals in best_of.items()
         if len(vals) == count),
        key=lambda r: -r[0],
    )
    print("\nsplit settings timed on every shape, by geomean % of SOL:")
    for geo, knobs in ranked[:6]:
        print(f"    {geo:5.1f}%  {knobs}")


# ------------------------------------------------------------------------- long rows, forward

LONG_FWD_SHAPES = ((4096, 16384), (2048, 32768), (1024, 65536))
LONG_FWD_SPACE = [
    dict(max_fused_hidden=mf, chunk=chunk, elements_per_warp=epw)
    for mf in (8192, 16384, 32768, 65536)
    for chunk in (2048, 4096, 8192)
    for epw in (256, 512)
]


def sweep_long_forward(bandwidth):
    """The forward of rows of 16K-64K: where rows stop being held in registers (a row held whole
    spills past ~32K values a program) and the streamed forward's chunk and warps, per op; split rows
    off (the shipped forward, printed first, may split them)."""
    base = norm_launch.CONFIG.forward
    for op in ("rms_norm", "add_rms_norm", "layer_norm"):
        for rows, hidden in LONG_FWD_SHAPES:
            case = make_case(op, rows, hidden)
            sol_ms = case.fwd_bytes / bandwidth * 1e3
            results = []
            for knobs in LONG_FWD_SPACE:
                if knobs["max_fused_hidden"] >= hidden and knobs["chunk"] != base.chunk:
                    continue  # a row held whole: the chunk is unused
                # held whole or streamed
                set_rms_config(forward=dataclasses.replace(base, split_max_hidden=0, **knobs))
                try:
                    results.append((bench(case.forward, rep=STREAM_REP), knobs))
                except Exception as exc:
                    print(f"      {op} {rows}x{hidden} {knobs}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
                finally:
                    set_rms_config(forward=base)
            shipped = bench(case.forward, rep=STREAM_REP)
            results.sort(key=lambda r: r[0])
            print(f"{case.name} fwd: shipped {shipped:.4f} ms ({100 * sol_ms / shipped:.0f}% SOL)")
            for ms, knobs in results[:4]:
                print(f"    {knobs}: {ms:.4f} ms ({100 * sol_ms / ms:.0f}% SOL)")


# ------------------------------------------------------------------- fused (rows held in registers)

FUSED_SHAPES = {
    "layer_norm": ((16384, 896), (65536, 1024), (32768, 2048), (16384, 4096), (8192, 8192)),
    "rms_norm": ((16384, 896), (65536, 1024)),
    "add_rms_norm": ((16384, 896), (65536, 1024)),
}
# Each direction's knobs and their values: layer_norm.py's LayerNormTuning fields, and the fused
# fields of norm_launch.py's RMSNormConfig forward / backward. Settings that launch the same geometry (e.g. every
# tile of one row at N = 8192) are timed once.
LN_SPACE = {
    "fwd": {
        "fwd_tile_elements": (2048, 4096, 8192, 16384),
        "fwd_elements_per_warp": (256, 512, 1024),
        "fwd_max_warps": (8, 16),
    },
    "bwd": {
        "bwd_tile_elements": (1024, 2048, 4096, 8192),
        "bwd_elements_per_warp": (256, 512, 1024),
        "bwd_max_warps": (8, 16),
        "bwd_programs_per_sm": (1, 2, 3, 4),
        "bwd_stages": (0, 1, 2, 3),
        "bwd_paired_sums": (True, False),
        "reduce_cols": (32, 64, 128),
    },
}
RMS_SPACE = {
    "fwd": {"tile_elements": (2048, 4096, 8192, 16384), "elements_per_warp": (256, 512, 1024), "max_warps": (8, 16)},
    "bwd": {
        "tile_elements": (1024, 2048, 4096, 8192),
        "elements_per_warp": (256, 512, 1024),
        "max_warps": (8, 16),
        "programs_per_sm": (1, 1.5, 2, 3, 4),
    },
}
FUSED_ROUNDS = 1  # descent rounds per shape and direction (2 doubles the section's time)
FUSED_REP = 10  # ms of replays per timing
ROTATE_BYTES = 160 << 20  # the input copies a timed call rotates through: over 3x the 50 MB L2
CHECK_TOLERANCE = 1e-2  # ‖out − ref‖/‖ref‖ against torch in fp32: bf16 rounding is ~3e-3


def rel_err(out, ref):
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@dataclasses.dataclass
class FusedCase:
    op: str
    rows: int
    hidden: int
    copies: int
    run: dict  # direction -> () -> outputs: the launcher on every copy of the inputs, in turn
    check: dict  # direction -> () -> worst relative error of copy 0's outputs against torch
    bytes: dict  # direction -> minimal bytes of one call

    @property
    def name(self):
        return f"{self.op} {self.rows}x{self.hidden}"

    @property
    def slot(self):
        """Which tuning group the op reads: rms_norm and add_rms_norm share theirs."""
        return "layer_norm" if self.op == "layer_norm" else "rms"


def fused_space(slot):
    return LN_SPACE if slot == "layer_norm" else RMS_SPACE


@contextlib.contextmanager
def tuned(slot, direction, knobs):
    """The op's config with ``knobs`` replaced, for the duration (LayerNormConfig for layer_norm,
    else RMSNormConfig's ``direction``)."""
    base_ln, base_rms = ln.CONFIG, norm_launch.CONFIG
    if slot == "layer_norm":
        ln.CONFIG = dataclasses.replace(base_ln, **knobs)
    elif direction == "fwd":
        set_rms_config(forward=dataclasses.replace(base_rms.forward, **knobs))
    else:
        set_rms_config(backward=dataclasses.replace(base_rms.backward, **knobs))
    try:
        yield
    finally:
        ln.CONFIG, norm_launch.CONFIG = base_ln, base_rms


def geometry(case, direction):
    """What the current tuning launches for this case: settings with the same one are timed once."""
    device = torch.device(DEVICE)
    if case.slot == "layer_norm":
        if direction == "fwd":
            return ln.forward_launch(case.rows, case.hidden)
        t = ln.CONFIG
        launch = ln.backward_launch(case.rows, case.hidden, device)
        return launch, t.bwd_paired_sums, t.reduce_bands, t.reduce_cols, t.reduce_warps
    if direction == "fwd":
        return rms.norm_launch(case.rows, case.hidden, backward=False)
    return rms.norm_backward_launch(case.rows, case.hidden, device)


def describe_launch(launch):
    extra = ""
    if isinstance(launch, tuple):
        launch, extra = launch[0], f" paired={launch[1]} reduce={launch[2]}x{launch[3]}/{launch[4]}w"
    text = f"rows={launch.block_m} warps={launch.num_warps}"
    if hasattr(launch, "bands"):
        text += f" bands={launch.bands} stages={launch.stages}"
    return text + extra


def make_fused_case(op, rows, hidden):
    eps = 1e-5 if op == "layer_norm" else 1e-6
    tensor = rows * hidden * 2
    byte_counts = {
        "fwd": (4 if op == "add_rms_norm" else 2) * tensor,
        "bwd": (4 if op == "add_rms_norm" else 3) * tensor,
    }
    copies = max(1, math.ceil(ROTATE_BYTES / min(byte_counts.values())))

    def randn(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16)

    xs = [(randn(rows, hidden) * 2 + 3).to(torch.bfloat16) for _ in range(copies)]
    dys = [randn(rows, hidden) for _ in range(copies)]
    w = randn(hidden)
    wf = w.float().requires_grad_()
    if op == "layer_norm":
        b = randn(hidden)
        saved = [ln._forward(x, w, b, eps) for x in xs]
        xf, bf = xs[0].float().requires_grad_(), b.float().requires_grad_()
        yf = F.layer_norm(xf, (hidden,), wf, bf, eps)
        ref = (yf.detach(), xf.detach().mean(-1), *torch.autograd.grad(yf, (xf, wf, bf), dys[0].float()))

        def check_fwd():
            y, mean, _ = ln._forward(xs[0], w, b, eps)
            return max(rel_err(y, ref[0]), rel_err(mean, ref[1]))

        def check_bwd():
            grads = ln._backward(dys[0], xs[0], w, b, saved[0][1], saved[0][2])
            return max(rel_err(g, r) for g, r in zip(grads, ref[2:], strict=True))

        run = {
            "fwd": lambda: [ln._forward(x, w, b, eps) for x in xs],
            "bwd": lambda: [ln._backward(dy, x, w, b, m, r) for dy, x, (_, m, r) in zip(dys, xs, saved, strict=True)],
        }
    elif op == "rms_norm":
        saved = [rms._forward(x, None, w, eps, 0.0, "llama")[2] for x in xs]
        xf = xs[0].float().requires_grad_()
        yf = rms.rms_norm_reference(xf, wf, eps, io_dtype=torch.bfloat16)
        ref = (yf.detach(), *torch.autograd.grad(yf, (xf, wf), dys[0].float()))

        def check_fwd():
            return rel_err(rms._forward(xs[0], None, w, eps, 0.0, "llama")[0], ref[0])

        def check_bwd():
            grads = rms._backward(dys[0], xs[0], w, saved[0], None, eps, 0.0, "llama")[:2]
            return max(rel_err(g, r) for g, r in zip(grads, ref[1:], strict=True))

        run = {
            "fwd": lambda: [rms._forward(x, None, w, eps, 0.0, "llama") for x in xs],
            "bwd": lambda: [
                rms._backward(dy, x, w, r, None, eps, 0.0, "llama") for dy, x, r in zip(dys, xs, saved, strict=True)
            ],
        }
    else:
        res = [randn(rows, hidden) for _ in range(copies)]
        dss = [randn(rows, hidden) for _ in range(copies)]
        saved = [rms._forward(x, r, w, eps, 0.0, "llama") for x, r in zip(xs, res, strict=True)]
        xf, rf = xs[0].float().requires_grad_(), res[0].float()
        yf, sf = rms.add_rms_norm_reference(xf, rf, wf, eps, io_dtype=torch.bfloat16)
        ref = (yf.detach(), sf.detach(), *torch.autograd.grad((yf, sf), (xf, wf), (dys[0].float(), dss[0].float())))

        def check_fwd():
            y, s, _ = rms._forward(xs[0], res[0], w, eps, 0.0, "llama")
            return max(rel_err(y, ref[0]), rel_err(s, ref[1]))

        def check_bwd():
            _, s, rstd = saved[0]
            grads = rms._backward(dys[0], s, w, rstd, dss[0], eps, 0.0, "llama")[:2]
            return max(rel_err(g, r) for g, r in zip(grads, ref[2:], strict=True))

        run = {
            "fwd": lambda: [rms._forward(x, r, w, eps, 0.0, "llama") for x, r in zip(xs, res, strict=True)],
            "bwd": lambda: [
                rms._backward(dy, s, w, rstd, ds, eps, 0.0, "llama")
                for dy, (_, s, rstd), ds in zip(dys, saved, dss, strict=True)
            ],
        }
    return FusedCase(op, rows, hidden, copies, run, {"fwd": check_fwd, "bwd": check_bwd}, byte_counts)


class FusedTimer:
    """Times one case's direction under tuning overrides: checked first, each geometry once."""

    def __init__(self, case, direction, bandwidth):
        self.case, self.direction, self.seen = case, direction, {}
        self.sol_ms = case.bytes[direction] / bandwidth * 1e3

    def percent(self, ms):
        return 100 * self.sol_ms / ms

    def __call__(self, knobs):
        case, direction = self.case, self.direction
        with tuned(case.slot, direction, knobs):
            key = geometry(case, direction)
            if key in self.seen:
                return self.seen[key]
            try:
                err = case.check[direction]()
                if err > CHECK_TOLERANCE:
                    result = f"WRONG: relative error {err:.2e}"
                    ms = math.inf
                else:
                    ms = bench(case.run[direction], rep=FUSED_REP) / case.copies
                    result = f"{ms:.4f} ms ({self.percent(ms):.0f}% SOL)"
            except Exception as exc:  # past the registers or the shared memory: skip the setting
                ms, result = math.inf, f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
            self.seen[key] = ms
            print(f"  {case.name} {direction} {describe_knobs(knobs)} [{describe_launch(key)}]: {result}", flush=True)
        return ms


def describe_knobs(knobs):
    return " ".join(f"{k.removeprefix('fwd_').removeprefix('bwd_')}={v}" for k, v in knobs.items())


def descend_fused(timer, start, space):
    """Coordinate descent over ``space`` from ``start`` (FUSED_ROUNDS rounds at most)."""
    best, best_ms = dict(start), timer(start)
    for _ in range(FUSED_ROUNDS):
        improved = False
        for knob, values in space.items():
            for value in values:
                if value != best[knob]:
                    trial = {**best, knob: value}
                    ms = timer(trial)
                    if ms < best_ms:
                        best, best_ms, improved = trial, ms, True
        if not improved:
            break
    return best, best_ms


def sweep_fused_ops(bandwidth, ops):
    """Descent per shape and direction for ``ops`` (one tuning slot), then one setting for all."""
    cases = [make_fused_case(op, rows, hidden) for op in ops for rows, hidden in FUSED_SHAPES[op]]
    slot = cases[0].slot
    space = fused_space(slot)
    recommended = {}
    for direction in ("fwd", "bwd"):
        if slot == "layer_norm":
            shipped_tuning = ln.CONFIG
        else:
            shipped_tuning = norm_launch.CONFIG.forward if direction == "fwd" else norm_launch.CONFIG.backward
        shipped = {k: getattr(shipped_tuning, k) for k in space[direction]}
        timers = {case.name: FusedTimer(case, direction, bandwidth) for case in cases}
        winners = []
        for case in cases:
            timer = timers[case.name]
            shipped_ms = timer(shipped)
            best, best_ms = descend_fused(timer, shipped, space[direction])
            winners.append(best)
            print(
                f"{case.name} {direction}: best {describe_knobs(best)}: {best_ms:.4f} ms "
                f"({timer.percent(best_ms):.0f}% SOL); shipped {shipped_ms:.4f} ms ({timer.percent(shipped_ms):.0f}%)",
                flush=True,
            )
        # every shape's winner (and the shipped setting) on every shape: one setting for all
        print(f"\n{slot} {direction}: % of SOL, every candidate on every shape (geomean last)")
        print("     " + " ".join(f"{c.op[:12]:>12}" for c in cases))
        print("     " + " ".join(f"{c.rows}x{c.hidden}".rjust(12) for c in cases))
        candidates, scores = [], []
        for knobs in [shipped, *winners]:
            if knobs in candidates:
                continue
            candidates.append(knobs)
            row = [timers[c.name].percent(timers[c.name](knobs)) for c in cases]
            geo = math.exp(sum(math.log(max(v, 1e-3)) for v in row) / len(row))
            scores.append((geo, len(candidates) - 1))
            mark = "  (shipped)" if knobs == shipped else ""
            print(f"  {len(candidates) - 1:<2} " + " ".join(f"{v:12.0f}" for v in row)
                  + f"  {geo:7.1f}   {describe_knobs(knobs)}{mark}", flush=True)
        geo, i = max(scores)
        recommended[direction] = candidates[i]
        print(f"{slot} {direction}: recommended #{i} (geomean {geo:.1f}% of SOL)\n")
    if slot == "layer_norm":
        fields = {**recommended["fwd"], **recommended["bwd"]}
        text = ", ".join(f"{k}={v!r}" for k, v in fields.items())
        print(f"recommended: layer_norm.py LayerNormConfig({text})")
    else:
        for direction, name in (("fwd", "forward"), ("bwd", "backward")):
            fields = ", ".join(f"{k}={v!r}" for k, v in recommended[direction].items())
            print(f"recommended: norm_launch.py RMSNormConfig.{name} fields {fields}")


def sweep_fused_ln(bandwidth):
    sweep_fused_ops(bandwidth, ("layer_norm",))


def sweep_fused_rms(bandwidth):
    sweep_fused_ops(bandwidth, ("rms_norm", "add_rms_norm"))


# ------------------------------------------------------- wide rows held in registers (N = 16384)

WIDE_SHAPE = (4096, 16384)
WIDE_RMS = {
    "fwd": [dict(max_warps=w, elements_per_warp=e) for w in (16, 32) for e in (256, 512)],
    "bwd": [
        dict(max_fused_hidden=16384, max_warps=w, elements_per_warp=e, programs_per_sm=p)
        for w in (16, 32) for e in (256, 512) for p in (1, 2)
    ],
}
WIDE_LN = {
    "fwd": [dict(fwd_max_warps=w, fwd_elements_per_warp=e) for w in (16, 32) for e in (256, 512)],
    "bwd": [
        dict(bwd_max_warps=w, bwd_elements_per_warp=e, bwd_programs_per_sm=p, bwd_stages=st)
        for w in (16, 32) for e in (256, 512) for p in (1, 2) for st in (0, 1)
    ],
}


def sweep_wide(bandwidth):
    """Rows of 16384 in registers: every setting of WIDE_* against the shipped launch, per op."""
    for op in ("rms_norm", "add_rms_norm", "layer_norm"):
        case = make_fused_case(op, *WIDE_SHAPE)
        for direction in ("fwd", "bwd"):
            timer = FusedTimer(case, direction, bandwidth)
            shipped = timer({})
            print(f"{case.name} {direction}: shipped {shipped:.4f} ms ({timer.percent(shipped):.0f}% SOL)", flush=True)
            settings = (WIDE_LN if op == "layer_norm" else WIDE_RMS)[direction]
            results = []
            for knobs in settings:
                with contextlib.ExitStack() as stack:
                    if op == "layer_norm" and direction == "bwd":  # the regime boundary is RMSNorm's
                        stack.enter_context(tuned("rms", "bwd", {"max_fused_hidden": 16384}))
                    ms = timer(knobs)
                results.append((ms, knobs))
            ms, knobs = min(results, key=lambda r: r[0])
            print(f"{case.name} {direction}: best {describe_knobs(knobs)} {ms:.4f} ms ({timer.percent(ms):.0f}% SOL)"
                  f" against shipped {shipped:.4f}\n", flush=True)


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


SECTIONS = {
    "fused-ln": sweep_fused_ln, "fused": sweep_fused_rms, "stream": sweep_stream, "boundary": sweep_boundary,
    "wide": sweep_wide, "long-fwd": sweep_long_forward, "split": sweep_split, "host": None,
}


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
