"""Sweep the cross-entropy row kernels' knobs on a GPU, checking every setting against torch.

    PYTHONPATH=src python3 dev/tune_ce.py            # all four shapes
    PYTHONPATH=src python3 dev/tune_ce.py 128256     # only the shapes whose V is named

An experiment kept out of the package (STYLE: llm.c habit): its findings go into the defaults of
CrossEntropyConfig in src/tigon/_kernels/cross_entropy_launch.py (and their why into docs/tuning.md). Each
setting is a CrossEntropyConfig passed to the row launcher. Shapes: N = 8192 tokens in bf16 at
V = 32000, 128256, 151936 and 256000 with softcap 30, targets as the benchmark draws them (every
IGNORED_EVERY-th token ignored). Each shape runs a coordinate descent from the shipped config:
every value of one knob with the others at the best so far, knob after knob, one pass (V = 32000
once in each regime: row in registers, and streamed).
One line per setting (printed as it is measured, so a cut-off run still says something), then
the best setting per shape and a summary. About 60 settings; on the H100 (2026-11-22) the sweep
took under 3 minutes, mostly Triton compiles (each distinct block/warps/pipeline combination
compiles once per softcap flag); its log is benchmarks/results/tune_ce-*.log.

Times are GPU times of the row kernel (loss and gradient: the whole work of forward + backward, the
backward's scaling by grad_output = 1 being a no-op) from the benchmark harness (the step queued behind a
sleeping GPU, L2 flushed before each step); SOL = one read of the logits and one write of the
gradient over the copy bandwidth measured first. A setting that fails to compile or gives a
wrong loss/gradient is reported and never chosen.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from tigon._kernels import REDUCTION_SCALES, next_power_of_2, row_launch
from tigon.bench.harness import copy_bandwidth, gpu_time
from tigon.bench.specs.cross_entropy import IGNORED_EVERY
from tigon.ops.cross_entropy import CONFIG, launch_cross_entropy_rows

DEVICE = "cuda"
TOKENS = 8192
SHAPES = ((32000, None), (128256, None), (151936, None), (256000, 30.0))
LOSS_TOLERANCE = 1e-4  # relative, fp32 loss against the fp32 torch reference
GRAD_TOLERANCE = 3e-2  # bf16 gradient against an fp32 torch reference (API.md's bf16 bound)
MB = 1 << 20

# Values tried per knob, in the order the descent visits them. Block width and warps go together
# (the pair sets the registers per thread: ptxas -v for sm_90 shows no spills for these pairs).
# (single_values_per_thread only matters below 32768 classes, where the warp cap does not bind.)
SINGLE_KNOBS = {
    "single_max_warps": (16, 32),
    "single_programs_per_sm": (1, 2, 4),
    "single_row_prefetch": (False, True),
}
STREAM_KNOBS = {
    ("stream_block_v", "stream_warps"): ((8192, 16), (16384, 32), (16384, 16), (8192, 8)),
    ("stream_softcap_block_v", "stream_softcap_warps"): ((8192, 16), (16384, 32), (16384, 16), (8192, 8)),
    "stream_prefetch": (1, 2),
    "stream_wide_prefetch": (1, 2),
    "stream_softcap_prefetch": (1, 2),
    "stream_softcap_hinted": (False, True),
    "stream_hinted_max_bytes": (0, 96 * MB, 256 * MB),
    "stream_programs_per_sm": (0.5, 0.75, 1.0, 2.0),
    "stream_l2_hints": (False, True),
}


def _reference(logits, target, softcap):
    z = logits.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return torch.nn.functional.cross_entropy(z, target)


def _names(knob):
    return knob if isinstance(knob, tuple) else (knob,)


def _as_values(knob, value):
    return value if isinstance(knob, tuple) else (value,)


class Shape:
    """One (V, softcap) case: inputs, the fp32 reference, and the measurement of a setting."""

    def __init__(self, vocab, softcap, bandwidth):
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        self.vocab, self.softcap = vocab, softcap
        self.logits = torch.randn(TOKENS, vocab, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        self.logits.requires_grad_(True)
        # the benchmark's targets: uniform classes, every IGNORED_EVERY-th token ignored
        self.target = torch.randint(vocab, (TOKENS,), device=DEVICE, generator=gen)
        self.target[::IGNORED_EVERY] = -100
        self.ref_loss = _reference(self.logits, self.target, softcap)
        (self.ref_grad,) = torch.autograd.grad(self.ref_loss, self.logits)
        self.sol_ms = 2 * self.logits.numel() * self.logits.element_size() / bandwidth * 1e3
        self.label = f"V={vocab}" + (f" softcap={softcap:g}" if softcap else "")

    def step(self, config):
        """Loss and gradient of every row under ``config``: the launches of forward + backward."""
        scales, _ = REDUCTION_SCALES(self.target, None, -100, "mean", self.vocab)
        loss_rows = torch.empty(TOKENS, dtype=torch.float32, device=DEVICE)
        grad = torch.empty_like(self.logits)
        launch_cross_entropy_rows(self.logits.detach(), self.target, None, scales, None, grad, loss_rows,
                                  -100, 0.0, 0.0, self.softcap, 1.0, config=config)
        return loss_rows.sum(), grad

    def measure(self, setting: dict):
        """ms of one setting (CrossEntropyConfig field -> value), or None when it fails; prints one line."""
        try:
            config = dataclasses.replace(CONFIG, **setting)
            cfg = row_launch(TOKENS, self.vocab, self.logits.device, softcap=self.softcap is not None, config=config)
            start = time.perf_counter()
            loss, grad = self.step(config)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - start  # mostly the compile, for a new geometry
            loss_err = abs(loss.item() - self.ref_loss.item()) / abs(self.ref_loss.item())
            grad_err = ((grad.float() - self.ref_grad.float()).norm() / self.ref_grad.float().norm()).item()
            grad = None
            ok = loss_err <= LOSS_TOLERANCE and grad_err <= GRAD_TOLERANCE
            ms = gpu_time(lambda: self.step(config), self.sol_ms * 2)
        except Exception as exc:  # a setting that does not compile (or runs out of resources) is a result
            print(f"  {self.label} {_fmt(setting)}: FAILED {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:160] if str(exc) else ''}", flush=True)
            return None
        geometry = (f"[{'single' if cfg.single_block else 'stream'} block={cfg.block_v} warps={cfg.num_warps} "
                    f"programs={cfg.programs}]")
        mark = "" if ok else f"  WRONG (loss {loss_err:.1e}, grad {grad_err:.1e})"
        print(f"  {self.label} {_fmt(setting)} {geometry}: {ms:.3f} ms ({100 * self.sol_ms / ms:.0f}% SOL)"
              f" first call {first_s:.1f} s{mark}", flush=True)
        return ms if ok else None

    def release(self):
        self.logits = self.ref_grad = self.ref_loss = None
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def _fmt(setting: dict) -> str:
    return " ".join(f"{name}={value}" for name, value in setting.items())


def descend(shape: Shape, knobs: dict, start: dict):
    """One coordinate-descent pass from ``start``: (best ms, best setting)."""
    best = dict(start)
    best_ms = shape.measure(best)
    for knob, values in knobs.items():
        names = _names(knob)
        current = tuple(best[n] for n in names)
        for value in values:
            value = _as_values(knob, value)
            if value == current:
                continue
            trial = dict(best, **dict(zip(names, value, strict=True)))
            ms = shape.measure(trial)
            if ms is not None and (best_ms is None or ms < best_ms):
                best_ms, best = ms, trial
    return best_ms, best


def _start(knobs: dict, **overrides) -> dict:
    setting = {name: getattr(CONFIG, name) for knob in knobs for name in _names(knob)}
    setting.update(overrides)
    return setting


def main(vocabs=None) -> None:
    t0 = time.perf_counter()
    bandwidth = copy_bandwidth() if DEVICE == "cuda" else 1e12
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s on {device}", flush=True)
    print("shipped: " + _fmt({name: getattr(CONFIG, name) for name in _knob_names()}), flush=True)
    summary = []
    for vocab, softcap in SHAPES:
        if vocabs and vocab not in vocabs:
            continue
        shape = Shape(vocab, softcap, bandwidth)
        print(f"{shape.label}: SOL {shape.sol_ms:.3f} ms", flush=True)
        runs = []
        single_key = "max_single_block_v_softcap" if softcap else "max_single_block_v"
        if next_power_of_2(vocab) <= 32768:  # fits the register regime: try it, then streaming
            runs.append(descend(shape, SINGLE_KNOBS, _start(SINGLE_KNOBS, **{single_key: 32768})))
            runs.append(descend(shape, STREAM_KNOBS, _start(STREAM_KNOBS, **{single_key: 8192})))
        else:
            runs.append(descend(shape, STREAM_KNOBS, _start(STREAM_KNOBS)))
        found = [(ms, setting) for ms, setting in runs if ms is not None]
        if found:
            ms, setting = min(found, key=lambda r: r[0])
            line = f"{shape.label}: best {ms:.3f} ms ({100 * shape.sol_ms / ms:.0f}% SOL) with {_fmt(setting)}"
        else:
            line = f"{shape.label}: no setting passed"
        print(line, flush=True)
        summary.append(line)
        shape.release()
    print(f"--- summary ({time.perf_counter() - t0:.0f} s)")
    for line in summary:
        print(line)


def _knob_names():
    names = ["max_single_block_v", "max_single_block_v_softcap"]
    for knobs in (SINGLE_KNOBS, STREAM_KNOBS):
        for knob in knobs:
            names.extend(_names(knob))
    return names


if __name__ == "__main__":
    main({int(arg) for arg in sys.argv[1:]} or None)
