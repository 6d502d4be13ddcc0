"""Host cost (Python, dispatcher, autograd) of one eager training step, measured on a CPU without a GPU.

    PYTHONPATH=src python dev/host_cost.py [--steps 40] [--layers 24] [--profile] [--counts] [--no-grad]

Why: at Qwen2.5-0.5B's shape (batch 4 × 2048, bf16 autocast, eager) the H100 has ~72 ms of work per
step, but the host needs 85-130 ms to issue it: the step is bound by Python, torch's dispatcher and the
autograd engine, not by the GPU. That cost does not depend on the tensors' sizes, so it can be measured
here: a model with Qwen2.5-0.5B's *structure* (the real transformers Qwen2 code, 24 layers, 14/2
heads, tied embeddings, ``tigon.patch``) but tiny widths (hidden 16, intermediate 32, head_dim 8,
vocab 64) and 8 tokens, where the arithmetic is negligible and what is left is the host's work.

Triton kernels cannot run on a CPU except under the interpreter (far too slow to time), so every eager
launch is stubbed, as late as possible: the kernels stay ``@triton.jit`` functions (TRITON_INTERPRET
is not set while they are defined), so ``wrap_triton`` hands out tigon's :class:`FastLaunch` as on the
GPU, and the first launch of each specialization goes to a stubbed ``JITFunction.run`` that returns a
compiled-kernel stand-in whose launcher does nothing. FastLaunch caches it as it caches a real one,
and every later launch runs FastLaunch's own code unchanged: the specialization key, the cache
lookup, the launcher call with its arguments. What the GPU path calls and the CPU has not is replaced
by a C builtin of the same shape (``torch._C._cuda_getDevice`` -> ``int``, the raw stream ->
``abs``), ``shared_cast.STACKED_DEVICES`` gets "cpu" so that q/k/v take the stacked path the GPU
takes, and ``fused_attention.DEVICES`` so that the attention runs as the one node it is on the GPU
(calling sdpa's CPU flash backend where the GPU calls cuDNN's or flash's). The stubbed kernels'
outputs are ``torch.empty`` garbage: fine for timing, since nothing on the patched layer path reads
values to choose a path (the loss is not printed).

Remaining CPU/GPU differences (small; both providers have them): autocast's CPU op lists, matmul_to's
fp32 output (GPU: one ``addmm(out_dtype=...)``; CPU: the product and a cast), check_tensor's CPU
branch. Reported: median host ms per step (forward + backward; the optimizer, torch AdamW foreach,
separately) for stock and tigon, per decoder layer µs; with ``--no-grad`` also one forward under
``torch.no_grad`` (a reference model's or an old policy's scoring, where the attention takes its own
forward, not the node; the models' forwards alternate: on this project's 2-core CPU, 2026-11-27, tigon's
took 1.08–1.26× stock's host time in four runs, its Python layers costing more than the ~100 aten ops a
layer it saves); and with ``--counts`` per-layer counts of
autograd nodes, casting ``Tensor.to`` calls, ``torch.empty`` calls and (stubbed) Triton launches;
with ``--profile`` a cProfile of tigon's step (tottime, and cumulative restricted to tigon).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # kernels must be JITFunctions, as on the GPU

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import tigon  # noqa: E402
import tigon._kernels.inputs as inputs  # noqa: E402
import tigon._kernels.launch as launch  # noqa: E402
from tigon.patching import fused_attention, shared_cast  # noqa: E402

# Widths small enough that even the CPU's bf16 matmuls cost next to nothing (oneDNN: ~12 µs for
# 8 × 64 × 128, ~2 µs for 8 × 16 × 16), so that both providers' times are host work.
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=14, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


class _Compiled:
    """What FastLaunch takes from a compiled kernel: a launcher (here doing nothing), its function
    handle and packed metadata."""

    function = packed_metadata = None

    @staticmethod
    def run(*args):
        return None


LAUNCHES = {"first": 0}


def _stub_run(self, *args, grid=None, warmup=False, **kwargs):
    LAUNCHES["first"] += 1
    return _Compiled()


def stub_gpu() -> None:
    """Make tigon's eager launch path run on the CPU with no-op kernels (module docstring)."""
    JITFunction.run = _stub_run
    launch._current_device = int                    # torch._C._cuda_getDevice(): a C call returning 0
    torch._C._cuda_getCurrentRawStream = abs        # a C call of one int argument
    inputs.interpreter_active = lambda: True        # check_tensor lets CPU tensors through
    shared_cast.STACKED_DEVICES = ("cuda", "cpu")   # q/k/v stacked, as on the GPU
    fused_attention.DEVICES = ("cuda", "cpu")       # the attention as one node, as on the GPU
    # The loss's target range check reads a flag a (stubbed) kernel wrote: clear the garbage first.
    from tigon._kernels import RangeCheck

    raise_if_bad = RangeCheck.raise_if_bad

    def cleared(self, vocab, ignore_index):
        if self.flag is not None:
            self.flag.zero_()
        return raise_if_bad(self, vocab, ignore_index)

    RangeCheck.raise_if_bad = cleared


def build(provider: str, layers: int, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model("qwen2", num_hidden_layers=layers, **TINY)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    if provider == "tigon":
        tigon.patch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, optimizer


def make_step(model, optimizer, ids):
    def forward_backward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    def optimize():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return forward_backward, optimize


def timed(provider, layers, steps, ids):
    """(forward+backward, forward, optimizer) host ms of one step: this thread's CPU time (the autograd
    engine runs a CPU backward on the calling thread; torch runs one thread here), so that time the
    scheduler gives other processes on a shared machine is not counted; each the median over blocks of
    5 steps of the block's minimum."""
    model, optimizer = build(provider, layers)
    forward_backward, optimize = make_step(model, optimizer, ids)
    for _ in range(3):
        forward_backward()
        optimize()
    gc.collect()
    rows = []
    for _ in range(steps):
        t0 = time.thread_time()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        t1 = time.thread_time()
        loss.backward()
        t2 = time.thread_time()
        optimize()
        t3 = time.thread_time()
        rows.append((t2 - t0, t1 - t0, t3 - t2))
    return tuple(_block_minima_median([r[j] for r in rows]) for j in range(3))


def _block_minima_median(seconds) -> float:
    """ms: the median over blocks of 5 consecutive timings of each block's minimum (the host's speed
    drifts and other processes interrupt; a block's minimum is its undisturbed run)."""
    return statistics.median(min(seconds[i:i + 5]) for i in range(0, len(seconds) - 4, 5)) * 1e3


def timed_no_grad(providers, layers, steps, ids):
    """{(provider, layers): host ms of one forward under ``torch.no_grad()``} (scoring with a reference model,
    an old policy, eval) at ``layers`` and at 1 layer, the models' forwards alternating (this machine's speed
    drifts within a run); each the median over blocks of 5 rounds of the block's minimum."""
    models = {(p, n): build(p, n)[0] for p in providers for n in (layers, 1)}

    def forward(model):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids)

    for model in models.values():
        for _ in range(3):
            forward(model)
    gc.collect()
    rows = {key: [] for key in models}
    for _ in range(steps):
        for key, model in models.items():
            t0 = time.thread_time()
            forward(model)
            rows[key].append(time.thread_time() - t0)
    return {key: _block_minima_median(r) for key, r in rows.items()}


def count(provider, layers, ids):
    """Counts for one forward+backward (differences between ``layers`` and ``layers + 1`` give the
    per-layer numbers, free of the embedding and the loss head)."""
    model, optimizer = build(provider, layers)
    forward_backward, optimize = make_step(model, optimizer, ids)
    forward_backward()
    optimize()
    launches = {"n": 0}
    original = launch.FastLaunch.launch

    def counting(self, grid, args, kwargs):
        launches["n"] += 1
        return original(self, grid, args, kwargs)

    launch.FastLaunch.launch = counting
    to_calls = {"n": 0, "cast": 0}
    original_to = torch.Tensor.to
    # Tensor.to is a C method: count calls from Python through a wrapper on the class for this step only

    def to(self, *args, **kwargs):
        to_calls["n"] += 1
        out = original_to(self, *args, **kwargs)
        to_calls["cast"] += out is not self
        return out

    empties = {"n": 0}
    original_empty, original_empty_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):
        empties["n"] += 1
        return original_empty(*args, **kwargs)

    def empty_like(*args, **kwargs):
        empties["n"] += 1
        return original_empty_like(*args, **kwargs)

    torch.Tensor.to, torch.empty, torch.empty_like = to, empty, empty_like
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        nodes, seen, stack = 0, set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            nodes += type(node).__name__ != "AccumulateGrad"
            stack.extend(n for n, _ in node.next_functions)
        forward_launches = launches["n"]
        loss.backward()
    finally:
        torch.Tensor.to, torch.empty, torch.empty_like = original_to, original_empty, original_empty_like
        launch.FastLaunch.launch = original
    # aten ops (what the dispatcher runs, seen by the profiler, which changes no path: a dispatch mode
    # would make tigon take its traced path)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_backward()
    ops = {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}
    return {"autograd nodes": nodes, "Tensor.to (python)": to_calls["n"], "Tensor.to casting": to_calls["cast"],
            "torch.empty(_like) (python)": empties["n"], "launches fwd": forward_launches,
            "launches fwd+bwd": launches["n"], "aten ops": sum(ops.values()),
            "aten::_to_copy": ops.get("aten::_to_copy", 0),
            "aten::empty*": sum(v for k, v in ops.items() if k.startswith("aten::empty"))}


def profile(layers, steps, ids, top):
    model, optimizer = build("tigon", layers)
    forward_backward, optimize = make_step(model, optimizer, ids)
    for _ in range(3):
        forward_backward()
        optimize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        forward_backward()
    profiler.disable()
    for sort, restrict in (("tottime", ()), ("tottime", ("tigon",)), ("cumulative", ("tigon",))):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(sort).print_stats(*restrict, top)
        print(f"cProfile of {steps} forward+backward steps, {layers} layers, sorted by {sort}"
              + (", tigon's functions" if restrict else ""))
        print(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--providers", nargs="+", default=["stock", "tigon"])
    parser.add_argument("--profile", action="store_true", help="cProfile of tigon's forward+backward")
    parser.add_argument("--counts", action="store_true", help="per-layer counts (nodes, casts, empties, launches)")
    parser.add_argument("--no-grad", action="store_true", help="also a forward under torch.no_grad (scoring)")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    stub_gpu()
    torch.set_num_threads(1)
    ids = torch.randint(TINY["vocab_size"], (1, args.tokens))
    print(f"torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}; "
          f"Qwen2-structured, {args.layers} layers, tiny widths, 1 x {args.tokens} tokens, launches stubbed")
    results = {}
    for provider in args.providers:
        fb, fwd, opt = timed(provider, args.layers, args.steps, ids)
        fb1, fwd1, _ = timed(provider, 1, args.steps, ids)
        results[provider] = fb
        per_layer = (fb - fb1) / (args.layers - 1) * 1e3
        per_layer_fwd = (fwd - fwd1) / (args.layers - 1) * 1e3
        print(f"{provider:>6}: forward+backward {fb:7.2f} ms/step ({args.steps} steps; forward {fwd:6.2f}), "
              f"optimizer {opt:5.2f} ms; per decoder layer {per_layer:6.1f} us (forward {per_layer_fwd:6.1f}); "
              f"outside the layers {fb1 - per_layer / 1e3:5.2f} ms")
    if "stock" in results and "tigon" in results:
        print(f"tigon / stock host time: {results['tigon'] / results['stock']:.3f}")
    if args.no_grad:
        scored = timed_no_grad(args.providers, args.layers, args.steps, ids)
        for provider in args.providers:
            full, one = scored[provider, args.layers], scored[provider, 1]
            print(f"{provider:>6}: no-grad forward {full:7.2f} ms; per decoder layer "
                  f"{(full - one) / (args.layers - 1) * 1e3:6.1f} us")
        if "stock" in args.providers and "tigon" in args.providers:
            print(f"tigon / stock no-grad host time: {scored['tigon', args.layers] / scored['stock', args.layers]:.3f}")
    if args.counts:
        for provider in args.providers:
            one, two = count(provider, 1, ids), count(provider, 2, ids)
            print(f"{provider:>6} per layer: " + ", ".join(f"{k} {two[k] - one[k]}" for k in one))
    if args.profile:
        profile(args.layers, max(3, args.steps // 5), ids, args.top)


if __name__ == "__main__":
    main()
