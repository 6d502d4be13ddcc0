"""Sweep RoPE's launch geometry on a GPU, both tilings and the rule between them, checking every
setting against transformers' formula.

    PYTHONPATH=src python3 dev/tune_rope.py                # every benchmark case
    PYTHONPATH=src python3 dev/tune_rope.py Qwen2.5-0.5B   # only cases whose label holds a name
    PYTHONPATH=src python3 dev/tune_rope.py --cpu          # a dry run of the logic (interpreter)

An experiment kept out of the package (STYLE: llm.c habit): its findings go into the defaults of
RopeConfig in src/tigon/ops/rope.py, which the last line prints as fields to copy. Cases: the
benchmark spec's (src/tigon/bench/specs/rope.py): Llama-3-8B heads in [B, H, T, D], and every model
of the table in the projection layout, B = 8, T = 2048, bf16. The first sweep (head-block tiling
only; benchmarks/results/2026-11-22/tune_rope.log, 55 s) set the head-block
constants and left Qwen2.5-0.5B (14 / 2 heads of 64) at 77% of SOL, for which the token tiling
was written.

rope.py has two tilings (its docstring): head-block (tile_elements, elements_per_warp, max_warps,
max_block_h) and token (token_tile_elements, token_elements_per_warp, token_max_warps), and a rule
choosing between them (token_tiling_below_block_h; the token tiling also needs one position's heads
to fit in token_tile_elements). The sweep, in one call:

1. baseline: the shipped constants on every case;
2. head-block: the token tiling switched off (token_tiling_below_block_h = 0); per case a
   coordinate descent over the head-block knobs from the shipped values (each knob over its
   values, the others held at the best so far, one pass); then every case's winner on every case,
   and the best geometric mean of % SOL is kept;
3. token: the token tiling forced wherever it fits; the same over the token knobs (a setting under
   which a case's heads do not fit in one token tile is skipped for that case, not timed);
4. rule: for every token winner and every threshold, the % SOL each case would get (its time under
   the tiling the rule picks, from steps 2 and 3, no new timing); the best geometric mean wins;
5. confirm: the winning constants timed on every case through the real selection, next to the
   baseline, and printed as the assignments to make in rope.py.

One line per setting, printed as it is measured. Times are GPU times of forward + backward from
the benchmark harness (the step queued behind a sleeping GPU, L2 flushed before each step); SOL =
q and k read and written once forward and once backward over the copy bandwidth measured first. A
setting whose output or gradients differ from the reference beyond bf16 rounding is reported and
never chosen. The launch geometry is cached per shape and config in the package.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from contextlib import contextmanager

if "--cpu" in sys.argv[1:]:  # before tigon defines its kernels: @triton.jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import tigon.ops  # noqa: E402, F401  (defines the kernels)
from tigon.bench.specs import load_specs  # noqa: E402

rope_mod = sys.modules["tigon.ops.rope"]

HEAD_BLOCK_KNOBS = {
    "tile_elements": (1024, 2048, 4096, 8192),
    "elements_per_warp": (128, 256, 512, 1024),
    "max_warps": (4, 8, 16),
    "max_block_h": (1, 2, 4, 8, 16),
}
TOKEN_KNOBS = {
    "token_tile_elements": (1024, 2048, 4096, 8192, 16384),
    "token_elements_per_warp": (128, 256, 512, 1024),
    "token_max_warps": (4, 8, 16),
}
RULE = "token_tiling_below_block_h"
# Token tiling where the head-block tiling would hold fewer heads than this: 0 never, and a value
# above every max_block_h swept wherever one position's heads fit in a token tile.
THRESHOLDS = (0, 2, 4, 8, 16, 2 * max(HEAD_BLOCK_KNOBS["max_block_h"]))
NEVER, ALWAYS = THRESHOLDS[0], THRESHOLDS[-1]
TOLERANCE = 2e-2  # relative norm error of bf16 outputs and gradients against the fp32 reference


def _fmt(setting: dict) -> str:
    return " ".join(f"{name}={value}" for name, value in setting.items())


@contextmanager
def _constants(setting: dict):
    """rope.py's RopeConfig with ``setting`` (field -> value) for the block, then the shipped one. The op
    launches through registered ops, which take no config, so the module's default is swapped."""
    shipped = rope_mod.CONFIG
    rope_mod.CONFIG = dataclasses.replace(shipped, **setting)
    try:
        yield
    finally:
        rope_mod.CONFIG = shipped


def _geomean(percents) -> float:
    return math.exp(sum(math.log(max(p, 1e-3)) for p in percents) / len(percents))


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

    def launch(self, setting: dict):
        """The launch config rope.py picks for this case under ``setting`` (q, k are [B, H, T, D])."""
        return rope_mod.rope_launch(
            self.q.shape[2], self.q.shape[1], self.k.shape[1], self.cos.shape[-1], self.q.shape[3],
            self.q.dtype == self.k.dtype, config=dataclasses.replace(rope_mod.CONFIG, **setting),
        )

    def step(self):
        q_out, k_out = rope_mod.rope(self.q, self.k, self.cos, self.sin)
        return torch.autograd.grad((q_out, k_out), (self.q, self.k), (self.dq, self.dk))

    def errors(self):
        q_out, k_out = rope_mod.rope(self.q, self.k, self.cos, self.sin)
        grads = torch.autograd.grad((q_out, k_out), (self.q, self.k), (self.dq, self.dk))
        got = [q_out.detach(), k_out.detach(), *grads]
        return max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(got, self.ref, strict=True))

    def measure(self, setting: dict, timer, token_only=False):
        """ms of one setting (constant name -> value), or None when it fails, is wrong, or (with
        ``token_only``) does not take the token tiling here; prints one line."""
        cfg = self.launch(setting)
        tiling = (f"{'token' if cfg.token_tiling else 'head-block'} h{cfg.block_h} t{cfg.block_t} "
                  f"w{cfg.num_warps}")
        if token_only and not cfg.token_tiling:
            print(f"  {self.label} {_fmt(setting)}: skipped (a position's heads do not fit a token tile)",
                  flush=True)
            return None
        with _constants(setting):
            try:
                err = self.errors()
                ms = timer(self.step, self.sol_ms * 2)
            except Exception as exc:  # a setting that does not compile is a result
                print(f"  {self.label} {_fmt(setting)} [{tiling}]: FAILED {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:160] if str(exc) else ''}", flush=True)
                return None
        mark = "" if err <= TOLERANCE else f"  WRONG (error {err:.1e})"
        print(f"  {self.label} {_fmt(setting)} [{tiling}]: {ms:.4f} ms ({100 * self.sol_ms / ms:.0f}% SOL)"
              f"{mark}", flush=True)
        return ms if err <= TOLERANCE else None


def descend(case: Case, start: dict, knobs: dict, fixed: dict, timer, token_only=False):
    """One coordinate-descent pass over ``knobs`` from ``start`` (``fixed`` held): (best ms, best knobs)."""
    best = dict(start)
    best_ms = case.measure({**fixed, **best}, timer, token_only)
    for name, values in knobs.items():
        held = best[name]  # measured already, with the other knobs as they are now
        for value in values:
            if value == held:
                continue
            trial = dict(best, **{name: value})
            ms = case.measure({**fixed, **trial}, timer, token_only)
            if ms is not None and (best_ms is None or ms < best_ms):
                best_ms, best = ms, trial
    return best_ms, best


def sweep(title, cases, knobs, fixed, timer, token_only=False):
    """Steps 2 and 3: per-case descent, then every winner on every case. Returns the winners (knob
    settings, the shipped one first) and per winner its ms on each case (None where it does not
    apply or fails)."""
    start = {name: getattr(rope_mod, name) for name in knobs}
    print(f"=== {title}: {_fmt(fixed)}; from {_fmt(start)}", flush=True)
    winners = [start]
    for case in cases:
        print(f"{case.label}: SOL {case.sol_ms:.4f} ms", flush=True)
        ms, setting = descend(case, start, knobs, fixed, timer, token_only)
        if ms is not None:
            print(f"{case.label}: best {ms:.4f} ms ({100 * case.sol_ms / ms:.0f}% SOL) with {_fmt(setting)}",
                  flush=True)
            if setting not in winners:
                winners.append(setting)
    print(f"{title}: every winner on every case (% SOL, - where it does not apply; geometric mean last):",
          flush=True)
    times = []
    for setting in winners:
        times.append([case.measure({**fixed, **setting}, timer, token_only) for case in cases])
        cells = " ".join("   -" if ms is None else f"{100 * c.sol_ms / ms:4.0f}"
                         for c, ms in zip(cases, times[-1], strict=True))
        print(f"  {cells}  {_geomean(_percents(cases, times[-1])):5.1f}  {_fmt(setting)}", flush=True)
    return winners, times


def _percents(cases, times):
    """% SOL per case; 0 where a setting failed or did not apply."""
    return [0.0 if ms is None else 100 * c.sol_ms / ms for c, ms in zip(cases, times, strict=True)]


def choose_rule(cases, head_knobs, head_ms, token_winners, token_times):
    """Step 4: the token winner and threshold with the best geometric mean, from measured times."""
    print("=== rule: % SOL per case under each threshold (from the times above; geometric mean last)",
          flush=True)
    best = None
    for index, token_knobs in enumerate(token_winners):
        for threshold in THRESHOLDS:
            setting = {**head_knobs, **token_knobs, RULE: threshold}
            percents, cells = [], []
            for i, case in enumerate(cases):
                token = case.launch(setting).token_tiling
                ms = token_times[index][i] if token else head_ms[i]
                percents.append(0.0 if ms is None else 100 * case.sol_ms / ms)
                cells.append(f"{percents[-1]:4.0f}{'*' if token else ' '}")
            score = _geomean(percents)
            print(f"  {' '.join(cells)}  {score:5.1f}  {_fmt(token_knobs)} {RULE.lower()}={threshold}",
                  flush=True)
            if best is None or score > best[0]:
                best = (score, setting)
    print("  (* = token tiling)", flush=True)
    return best[1]


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
    shipped = {name: getattr(rope_mod.CONFIG, name) for name in (*HEAD_BLOCK_KNOBS, *TOKEN_KNOBS, RULE)}
    measured = [Case(c, device, bandwidth) for c in cases]

    print(f"=== baseline: {_fmt(shipped)}", flush=True)
    baseline = [case.measure(shipped, timer) for case in measured]
    head_winners, head_times = sweep("head-block", measured, HEAD_BLOCK_KNOBS, {RULE: NEVER}, timer)
    scores = [_geomean(_percents(measured, times)) for times in head_times]
    best = max(range(len(scores)), key=scores.__getitem__)
    print(f"head-block: best {_fmt(head_winners[best])} (geomean {scores[best]:.1f}% of SOL)", flush=True)
    token_winners, token_times = sweep("token", measured, TOKEN_KNOBS, {RULE: ALWAYS}, timer, token_only=True)
    recommended = choose_rule(measured, head_winners[best], head_times[best], token_winners, token_times)

    print("=== confirm: baseline and recommended, through the real selection (% SOL, geometric mean last)",
          flush=True)
    confirmed = [case.measure(recommended, timer) for case in measured]
    for label, times in (("baseline", baseline), ("recommended", confirmed)):
        percents = _percents(measured, times)
        print(f"  {' '.join(f'{p:4.0f}' for p in percents)}  {_geomean(percents):5.1f}  {label}", flush=True)
    print(f"--- recommended ({time.perf_counter() - t0:.0f} s), to set in src/tigon/ops/rope.py: "
          + ", ".join(f"{name} = {value}" for name, value in recommended.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
