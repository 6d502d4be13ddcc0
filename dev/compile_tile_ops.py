"""The tile matmuls under torch.compile: the log-prob head's tile kernel and the fused linear CE's add-and-round
matmul, on and off, inside a static-shape torch.compile (GPU only).

    PYTHONPATH=src python3 dev/compile_tile_ops.py

An experiment kept out of the package (STYLE: llm.c habit). Their launches take host-made TMA descriptors,
which Inductor does not trace; as opaque registered ops (``TigonOp``'s ``fake``) they run inside a compiled
graph as they run in eager mode. For each of the benchmark's heads (N = 8192, bf16), forward + backward GPU ms
by the harness's ``gpu_time`` (L2 flushed, launches queued behind a sleeping GPU) of

* ``fused_linear_logprobs`` with entropy (V = 151936, H = 4096 and 896): eager, compiled with the tiles
  (the default), compiled with ``tiles=False`` (the row kernels over fp32 logits chunks: what compile ran
  before);
* ``fused_linear_cross_entropy`` at Qwen2.5-0.5B's head: eager, compiled, compiled with ``sum_round=False``
  (cuBLAS's fp32 sum and a cast for the last chunk);

and each compiled variant's outputs and gradients against eager's (largest difference over the largest value).
"""

from __future__ import annotations

import dataclasses
import sys

import torch

import tigon.ops  # noqa: F401
from tigon.bench.harness import gpu_time
from tigon.bench.specs.cross_entropy import _target
from tigon.ops.fused_linear_logprobs import FusedLinearLogprobsConfig, fused_linear_logprobs

flce = sys.modules["tigon.ops.fused_linear_cross_entropy"]
N, V = 8192, 151936


def _diff(got, want):
    return max(float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
               for g, w in zip(got, want, strict=True))


def _measure(label, step, want, leaves):
    outs = step()
    got = [*outs, *(t.grad for t in leaves)]
    for t in leaves:
        t.grad = None

    def timed():
        step()
        for t in leaves:
            t.grad = None

    ms = gpu_time(timed, 20.0)
    diff = f"{_diff(got, want):.1e}" if want is not None else "-"
    print(f"  {label:44s} {ms:8.3f} ms   [max diff to eager {diff}]", flush=True)
    return got


def logprobs(hidden):
    x = (torch.randn(N, hidden, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, hidden, device="cuda") * hidden**-0.5).bfloat16().requires_grad_()
    target = _target(N, V, "cuda")
    print(f"\nfused_linear_logprobs + entropy, N={N} H={hidden} V={V}", flush=True)

    def run(fn):
        def step():
            lp, ent = fn(x, w, target)
            (lp.sum() + ent.sum()).backward()
            return lp.detach(), ent.detach()
        return step

    eager = run(lambda a, b, t: fused_linear_logprobs(a, b, t, entropy=True))
    want = _measure("eager (tiles)", eager, None, (x, w))
    for name, tiles in (("compiled, tiles", None), ("compiled, row kernels (tiles=False)", False)):
        config = FusedLinearLogprobsConfig(tiles=tiles)
        compiled = torch.compile(lambda a, b, t, config=config: fused_linear_logprobs(a, b, t, entropy=True,
                                                                                       config=config),
                                 dynamic=False)
        _measure(name, run(compiled), want, (x, w))


def cross_entropy():
    hidden = 896
    x = (torch.randn(N, hidden, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, hidden, device="cuda") * hidden**-0.5).bfloat16().requires_grad_()
    target = _target(N, V, "cuda")
    print(f"\nfused_linear_cross_entropy, N={N} H={hidden} V={V}: {flce.chunk_plan(N, V, hidden, 2)}", flush=True)

    def step_of(fn):
        def step():
            loss = fn(x, w, target)
            loss.backward()
            return (loss.detach(),)
        return step

    want = _measure("eager", step_of(flce.fused_linear_cross_entropy), None, (x, w))
    shipped = flce.CONFIG
    for name, sum_round in (("compiled, add-and-round matmul", None), ("compiled, sum_round=False", False)):
        flce.CONFIG = dataclasses.replace(shipped, sum_round=sum_round)
        try:
            torch._dynamo.reset()
            compiled = torch.compile(lambda a, b, t: flce.fused_linear_cross_entropy(a, b, t), dynamic=False)
            _measure(name, step_of(compiled), want, (x, w))
        finally:
            flce.CONFIG = shipped


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for hidden in (4096, 896):
        logprobs(hidden)
    cross_entropy()


if __name__ == "__main__":
    main()
