"""Sweep RoPE's launch geometry on a GPU, checking every setting against transformers' formula.

    PYTHONPATH=src python3 scripts/tune_rope.py                # every benchmark case
    PYTHONPATH=src python3 scripts/tune_rope.py Qwen2.5-0.5B   # only cases whose label holds a name
    PYTHONPATH=src python3 scripts/tune_rope.py --cpu          # a dry run of the logic (interpreter)

An experiment kept out of the package (STYLE: llm.c habit): its findings go into the launch-config
constants of src/tigon/ops/rope.py (TILE_ELEMENTS, ELEMENTS_PER_WARP, MAX_WARPS, MAX_BLOCK_H).
Cases: the benchmark spec's (src/tigon/bench/specs/rope.py): Llama-3-8B heads in [B, H, T, D], and
every model of the table in the projection layout, B = 8, T = 2048, bf16. Issue 4 measured tigon at
89-94% of SOL on all but Qwen2.5-0.5B (14 / 2 heads of 64: 76%), and 1-4% behind the best of
torch.compile and Liger per layout.

Per case a coordinate descent from the shipped constants (each knob over its values, the others
held at the best so far, one pass), then every case's winner timed on every case, so that one
setting can be picked for all (geometric mean of % SOL). One line per setting, printed as it is
measured. Times are GPU times of forward + backward from the benchmark harness (the step queued
behind a sleeping GPU, L2 flushed before each step); SOL = q and k read and written once forward
and once backward over the copy bandwidth measured first. A setting whose output or gradients
differ from the reference beyond bf16 rounding is reported and never chosen. The launch geometry
is cached per shape in the package; the sweep calls the uncached function.
"""

from __future__ import annotations

import math
import sys
import time

import torch

import tigon.ops  # noqa: F401  (defines the kernels)
from tigon.bench.specs import load_specs

rope_mod = sys.modules["tigon.ops.rope"]

KNOBS = {
    "TILE_ELEMENTS": (2048, 4096, 8192, 16384),
    "ELEMENTS_PER_WARP": (256, 512, 1024, 2048),
    "MAX_WARPS": (4, 8, 16),
    "MAX_BLOCK_H": (1, 2, 4, 8, 16),
}
TOLERANCE = 2e-2  # relative norm error of bf16 outputs and gradients against the fp32 reference


def _fmt(setting: dict) -> str:
    return " ".join(f"{name.lower()}={value}" for name, value in setting.items())


class Case:
    """One benchmark case: inputs, the fp32 reference, and the measurement of a setting."""

    def __init__(self, case, device, bandwidth):
        self.label = case.label
        inputs = case.make_inputs(device, torch.bfloat16)
        self.q, self.k, self.cos, self.sin = inputs["q"], inputs["k"], inputs["cos"], inputs["sin"]
        self.dq = torch.randn_like(self.q)
        self.dk = torch.randn_like(self.k)
        ref = [t.detach().float().requires_grad_() for t in (self.q, self.k)]
        outs = rope_mod.rope_reference(ref[0], ref[1], self.cos.float(), self.sin.float())
        grads = torch.autograd.grad(outs, ref, (self.dq.float(), self.dk.float()))
        self.ref = [o.detach() for o in outs] + list(grads)
        self.sol_ms = case.sol_bytes["full"] / bandwidth * 1e3
        self.device = device

    def step(self):
        q_out, k_out = rope_mod.rope(self.q, self.k, self.cos, self.sin)
        return torch.autograd.grad((q_out, k_out), (self.q, self.k), (self.dq, self.dk))

    def errors(self):
        q_out, k_out = rope_mod.rope(self.q, self.k, self.cos, self.sin)
        grads = torch.autograd.grad((q_out, k_out), (self.q, self.k), (self.dq, self.dk))
        got = [q_out.detach(), k_out.detach(), *grads]
        return max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(got, self.ref, strict=True))

    def measure(self, setting: dict, timer):
        """ms of one setting (constant name -> value), or None when it fails; prints one line."""
        shipped = {name: getattr(rope_mod, name) for name in setting}
        for name, value in setting.items():
            setattr(rope_mod, name, value)
        try:
            err = self.errors()
            ms = timer(self.step, self.sol_ms * 2)
        except Exception as exc:  # a setting that does not compile is a result
            print(f"  {self.label} {_fmt(setting)}: FAILED {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:160] if str(exc) else ''}", flush=True)
            return None
        finally:
            for name, value in shipped.items():
                setattr(rope_mod, name, value)
        mark = "" if err <= TOLERANCE else f"  WRONG (error {err:.1e})"
        print(f"  {self.label} {_fmt(setting)}: {ms:.4f} ms ({100 * self.sol_ms / ms:.0f}% SOL){mark}", flush=True)
        return ms if err <= TOLERANCE else None


def descend(case: Case, start: dict, timer):
    """One coordinate-descent pass from ``start``: (best ms, best setting)."""
    best, best_ms = dict(start), case.measure(start, timer)
    for name, values in KNOBS.items():
        for value in values:
            if value == best[name]:
                continue
            trial = dict(best, **{name: value})
            ms = case.measure(trial, timer)
            if ms is not None and (best_ms is None or ms < best_ms):
                best_ms, best = ms, trial
    return best_ms, best


def main(argv) -> None:
    cpu = "--cpu" in argv
    names = [a for a in argv if not a.startswith("--")]
    t0 = time.perf_counter()
    spec = load_specs(["rope"])["rope"]
    if cpu:  # the logic only: the spec's small check case under the interpreter, host-clock timing
        device, bandwidth, cases = torch.device("cpu"), 1e9, [spec.check_case()]

        def timer(step, _estimate):
            start = time.perf_counter()
            step()
            return (time.perf_counter() - start) * 1e3
    else:
        from tigon.bench.harness import copy_bandwidth, gpu_time

        device, bandwidth, timer = torch.device("cuda"), copy_bandwidth(), gpu_time
        cases = [c for c in spec.cases() if not names or any(n in c.label for n in names)]
        print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    rope_mod.rope_launch = getattr(rope_mod.rope_launch, "__wrapped__", rope_mod.rope_launch)  # uncached
    shipped = {name: getattr(rope_mod, name) for name in KNOBS}
    print("shipped: " + _fmt(shipped), flush=True)
    measured = [Case(c, device, bandwidth) for c in cases]
    winners = []
    for case in measured:
        print(f"{case.label}: SOL {case.sol_ms:.4f} ms", flush=True)
        ms, setting = descend(case, shipped, timer)
        if ms is not None:
            print(f"{case.label}: best {ms:.4f} ms ({100 * case.sol_ms / ms:.0f}% SOL) with {_fmt(setting)}",
                  flush=True)
            if setting not in winners:
                winners.append(setting)
    if shipped not in winners:
        winners.insert(0, shipped)
    print("every winner on every case (% SOL, geometric mean last):", flush=True)
    scores = []
    for setting in winners:
        percents = []
        for case in measured:
            ms = case.measure(setting, timer)
            percents.append(0.0 if ms is None else 100 * case.sol_ms / ms)
        geomean = math.exp(sum(math.log(max(p, 1e-3)) for p in percents) / len(percents))
        scores.append((geomean, setting))
        print(f"  {' '.join(f'{p:4.0f}' for p in percents)}  {geomean:5.1f}  {_fmt(setting)}", flush=True)
    geomean, setting = max(scores, key=lambda s: s[0])
    print(f"--- recommended ({time.perf_counter() - t0:.0f} s): {_fmt(setting)} (geomean {geomean:.1f}% of SOL)")


if __name__ == "__main__":
    main(sys.argv[1:])
