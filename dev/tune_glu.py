"""Sweep the GLU kernels' launch geometry on a GPU against torch.compile, in one process.

    PYTHONPATH=src python3 dev/tune_glu.py            # swiglu at every benchmark intermediate size
    PYTHONPATH=src python3 dev/tune_glu.py geglu      # or geglu

An experiment kept out of the package (STYLE: llm.c habit): its findings go into the defaults
of GluConfig in src/tigon/ops/glu.py (tile_elements, elements_per_warp, max_warps). A harness run
on the H100 put SwiGLU and GeGLU at 99-101% of the copy-bandwidth SOL, with torch.compile
0.1-0.6% ahead at every shape (benchmarks/results/rope-glu-*). Here each setting is timed as the
harness times a cell (forward + backward, GPU time behind a sleeping GPU, L2 flushed), checked
against the fp32 reference first, and set next to compile's time measured in the same process,
before and after the sweep (the bandwidth drifts a little over minutes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import sys
import time

import torch

import tigon.ops  # noqa: F401  (defines the kernels)
from tigon.bench.harness import copy_bandwidth, gpu_time, make_step, providers_of
from tigon.bench.specs import load_specs

glu_mod = sys.modules["tigon.ops.glu"]

KNOBS = {
    "tile_elements": (2048, 4096, 8192, 16384),
    "elements_per_warp": (256, 512, 1024),
    "max_warps": (4, 8, 16),
}
TOLERANCE = 2e-2  # relative norm error of bf16 outputs and gradients against the fp32 reference


@contextlib.contextmanager
def constants(setting: dict):
    """glu.py's GluConfig with ``setting`` (field -> value) for the block, then the shipped one. The
    op launches through registered ops, which take no config, so the module's default is swapped."""
    shipped = glu_mod.CONFIG
    glu_mod.CONFIG = dataclasses.replace(shipped, **setting)
    try:
        yield
    finally:
        glu_mod.CONFIG = shipped


def relative_error(fn, inputs, activation) -> float:
    gate, up = inputs["gate"], inputs["up"]
    dh = torch.randn_like(gate)
    out = fn(**inputs)
    grads = torch.autograd.grad(out, (gate, up), dh)
    gf, uf = (t.detach().float().requires_grad_() for t in (gate, up))
    ref = glu_mod.glu_reference(gf, uf, activation)
    ref_grads = torch.autograd.grad(ref, (gf, uf), dh.float())
    pairs = [(out, ref), *zip(grads, ref_grads, strict=True)]
    return max(((a.float() - b).norm() / b.norm()).item() for a, b in pairs)


def main(argv) -> None:
    op = argv[0] if argv else "swiglu"
    activation = "silu" if op == "swiglu" else "gelu_tanh"
    t0 = time.perf_counter()
    spec = load_specs([op])[op]
    bandwidth = copy_bandwidth()
    print(f"{op}: copy bandwidth {bandwidth / 1e9:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    providers = providers_of(spec, only=("tigon", "compile"))
    shipped = {name: getattr(glu_mod.CONFIG, name) for name in KNOBS}
    settings = [dict(zip(KNOBS, values, strict=True)) for values in itertools.product(*KNOBS.values())]
    table = {}  # setting index -> [ms per case]
    compile_ms = []
    for case in spec.cases():
        inputs = case.make_inputs(torch.device("cuda"), torch.bfloat16)
        sol_ms = case.sol_bytes["full"] / bandwidth * 1e3
        compile_step = make_step(providers["compile"], inputs, spec, "full")
        before = gpu_time(compile_step, sol_ms)
        seen = {}
        for i, setting in enumerate([shipped, *settings]):
            with constants(setting):
                cfg = glu_mod.glu_launch(*inputs["gate"].shape, flat=True)
                if cfg in seen:
                    table.setdefault(i, []).append(seen[cfg])
                    continue
                err = relative_error(providers["tigon"], inputs, activation)
                step = make_step(providers["tigon"], inputs, spec, "full")
                ms = math.inf if err > TOLERANCE else gpu_time(step, sol_ms)
            seen[cfg] = ms
            table.setdefault(i, []).append(ms)
            print(f"  {case.label} {setting} [block {cfg.block_n}, {cfg.num_warps} warps]: {ms:.4f} ms "
                  f"({100 * sol_ms / ms:.1f}% SOL){f'  WRONG {err:.1e}' if err > TOLERANCE else ''}", flush=True)
        after = gpu_time(compile_step, sol_ms)
        compile_ms.append(min(before, after))
        print(f"{case.label}: compile {before:.4f} / {after:.4f} ms; shipped {table[0][-1]:.4f}; "
              f"best {min(v[-1] for v in table.values()):.4f}", flush=True)
        del inputs
    # one setting for all shapes: the best geometric mean of (tigon ms / compile ms)
    def ratio(i):
        return math.exp(sum(math.log(t / c) for t, c in zip(table[i], compile_ms, strict=True)) / len(compile_ms))

    ranked = sorted(table, key=ratio)
    for i in ranked[:6]:
        setting = shipped if i == 0 else settings[i - 1]
        cells = " ".join(f"{t:.4f}" for t in table[i])
        print(f"  {ratio(i):.4f} x compile  {cells}  {setting}{'  (shipped)' if i == 0 else ''}", flush=True)
    print(f"shipped: {ratio(0):.4f} x compile; compile ms {' '.join(f'{c:.4f}' for c in compile_ms)}")
    best = shipped if ranked[0] == 0 else settings[ranked[0] - 1]
    print(f"--- recommended ({time.perf_counter() - t0:.0f} s): {best}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
