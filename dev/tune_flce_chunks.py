"""Sweep the geometry of the fused linear loss's vocabulary-chunk kernels on a GPU.

    PYTHONPATH=src python3 dev/tune_flce_chunks.py

An experiment kept out of the package (STYLE: llm.c habit): its findings go into the defaults of
VocabChunkConfig in src/tigon/_kernels/vocab_chunks.py (each setting is one, passed to the launchers).
By classes (fused_linear_cross_entropy.py), each chunk of logits (N tokens × a few thousand classes)
is written by a matmul and then read by the statistics kernel (pass 1) or overwritten with the
gradient (pass 2). Each kernel is timed alone, right after the matmul that writes its chunk (so L2
holds what it would hold in the fused loss), at Qwen2.5-0.5B's head (H = 896, V = 151936) and the
chunk widths the plan picks at N = 8192 and 4096, for: the persistent streamed grid (row_max_width =
0) and one program a row with each block width, warps and prefetch. Then the whole fused loss
(forward + backward, GPU time behind a sleeping GPU) and its peak memory against the gradients, with
the shipped knobs and with the persistent grid. Each setting's outputs are checked against the
persistent grid's. About a minute on the H100, mostly Triton compiles; its log is
benchmarks/results/tune_flce_chunks-*.log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys

import torch

import tigon.ops  # noqa: F401  (defines the kernels)
from tigon._kernels import REDUCTION_SCALES, VocabChunkConfig, launch_vocab_chunk_grad, launch_vocab_chunk_stats
from tigon._kernels import vocab_chunks as _vocab_chunks
from tigon.bench.specs.cross_entropy import _target

flce = sys.modules["tigon.ops.fused_linear_cross_entropy"]

DEVICE = "cuda"
HIDDEN, VOCAB = 896, 151936
CASES = ((8192, 4352, None), (8192, 4096, None), (8192, 8192, None), (4096, 9216, None), (4096, 16384, None),
         (8192, 4352, 30.0))
BLOCKS, WARPS, PREFETCH = (512, 1024, 2048, 4096), (1, 2, 4, 8), (1, 2)
REPS = 15


def _events_us(before, fn) -> float:
    """Median µs of ``fn`` alone, each run right after ``before`` (which writes its input)."""
    times = []
    for _ in range(REPS):
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[REPS // 2]


@contextlib.contextmanager
def _default_chunk_config(config: VocabChunkConfig):
    """The whole loss launches its chunk kernels through registered ops, which take no config: for
    the end-to-end comparison only, the module's default is swapped (as the tests do)."""
    shipped = _vocab_chunks.CONFIG
    _vocab_chunks.CONFIG = config
    try:
        yield
    finally:
        _vocab_chunks.CONFIG = shipped


def sweep_case(weight, tokens: int, width: int, softcap) -> None:
    """Every setting's two kernel times at one chunk shape, fastest first."""
    shipped = _vocab_chunks.CONFIG
    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    target = _target(tokens, VOCAB, DEVICE)
    scales, _ = REDUCTION_SCALES(target, None, -100, "mean", VOCAB)
    chunk = torch.empty(tokens, width, device=DEVICE, dtype=torch.bfloat16)
    opts = (-100, 0.0, 0.0, softcap, 1.0)

    def make():
        torch.mm(x, weight[:width].t(), out=chunk)

    make()
    lse = torch.logsumexp(chunk.float(), 1) + 1.0
    state = torch.empty(4, tokens, device=DEVICE)
    start_state = torch.tensor([[-1e4], [1.0], [0.0], [0.0]], device=DEVICE).expand_as(state)

    def stats(config):
        state.copy_(start_state)
        loss_rows = torch.empty(tokens, device=DEVICE)
        launch_vocab_chunk_stats(chunk, target, None, scales, state, loss_rows, torch.empty_like(lse), 0, VOCAB, False,
                           *opts, config=config)

    def grad(config):
        launch_vocab_chunk_grad(chunk, target, None, scales, None, lse, 0, VOCAB, *opts, config=config)

    def outputs(config):
        make()
        stats(config)
        grad(config)
        return state.clone(), chunk.clone()

    settings = [("persistent grid", dataclasses.replace(shipped, row_max_width=0))]
    for block, warps, prefetch in itertools.product(BLOCKS, WARPS, PREFETCH):
        if 4 <= block // (32 * warps) <= 32 and not (prefetch == 2 and block >= width):
            settings.append((f"one row a program: block {block}, {warps} warps, {prefetch} ahead", VocabChunkConfig(
                row_max_width=1 << 30, block_v=block, num_warps=warps, prefetch=prefetch)))
    rows, reference = [], None
    for label, config in settings:
        got = outputs(config)
        reference = reference or got
        ok = torch.allclose(got[0], reference[0], rtol=1e-5, atol=1e-5) and torch.equal(got[1], reference[1])
        stats_us = _events_us(make, lambda c=config: stats(c))
        rows.append((stats_us, _events_us(make, lambda c=config: grad(c)), label, ok))
    hbm_us = tokens * width * 2 / 3.0e6
    cap = f", softcap {softcap:g}" if softcap else ""
    print(f"N={tokens} width={width}{cap}: HBM read {hbm_us:.1f} us, read + write {2 * hbm_us:.1f}; "
          f"{rows[0][2]}: {rows[0][0]:.1f} + {rows[0][1]:.1f} us (stats + gradient)")
    for stats_us, grad_us, label, ok in sorted(rows, key=lambda r: r[0] + r[1])[:8]:
        print(f"    {stats_us:6.1f} + {grad_us:6.1f} us  {label}{'' if ok else '  WRONG OUTPUT'}")
    wrong = [r[2] for r in rows if not r[3]]
    if wrong:
        print("    wrong outputs:", wrong)
    sys.stdout.flush()


def whole_loss(weight, tokens: int) -> None:
    """The fused loss's GPU time and peak memory, the shipped chunk config against the persistent grid."""
    shipped = _vocab_chunks.CONFIG
    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = weight.clone().requires_grad_()
    target = _target(tokens, VOCAB, DEVICE)

    def step():
        flce.fused_linear_cross_entropy(x, w, target).backward()
        x.grad = w.grad = None

    plan = flce.chunk_plan(tokens, VOCAB, HIDDEN, 2)
    for label, config in (("shipped", shipped), ("persistent grid", dataclasses.replace(shipped, row_max_width=0))):
        with _default_chunk_config(config):
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            times = []
            for _ in range(5):
                torch.cuda._sleep(30_000_000)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            gradients = (tokens + VOCAB) * HIDDEN * 2
            print(f"fused linear CE N={tokens} H={HIDDEN} V={VOCAB}, {plan}, {label}: "
                  f"{sorted(times)[2]:.3f} ms, peak {peak / gradients:.3f}x the gradients", flush=True)


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    weight = (torch.randn(VOCAB, HIDDEN, device=DEVICE) * HIDDEN**-0.5).to(torch.bfloat16)
    for case in CASES:
        sweep_case(weight, *case)
    for tokens in (8192, 4096):
        whole_loss(weight, tokens)


if __name__ == "__main__":
    main()
