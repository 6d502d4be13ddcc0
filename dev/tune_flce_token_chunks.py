"""The fused linear CE's token chunking at the benchmark heads, forced: does an aligned last chunk that is much
smaller than the others cost more than its share, on a GPU?

    PYTHONPATH=src python3 dev/tune_flce_token_chunks.py

An experiment kept out of the package (STYLE: llm.c habit): its findings go into chunk_plan's alignment
(FusedLinearCrossEntropyConfig.token_align). By tokens in dW's dtype, the plan cuts N = 8192 into the fewest
chunks the memory budget allows, each a multiple of 256 tokens: at Llama-3-8B's head 6 chunks of 1280 and one
of 512, at Gemma-2-2B's 10 of 768 and one of 512. A small last chunk still reads and writes all of dW (its
matmul's K is short). Each plan below keeps the largest chunk (the memory) of the shipped one or less;
GPU ms of forward + backward by the harness's ``gpu_time`` (L2 flushed, launches queued behind a sleeping
GPU), each plan's gradients checked against the shipped plan's, its peak memory beyond the inputs (the
benchmark's measure: gradients, chunk, per-token state) and its dW's error against fp64
(dev/flce_dw_error.py's reference and norms). Larger chunks than the shipped plans' are listed too: what
the memory they take buys.
"""

from __future__ import annotations

import sys

import torch

import tigon.ops  # noqa: F401
from tigon.bench.harness import gpu_time
from tigon.bench.specs.cross_entropy import _target

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from flce_dw_error import errors, reference  # noqa: E402

flce = sys.modules["tigon.ops.fused_linear_cross_entropy"]
N = 8192
HEADS = (  # label, hidden, vocab, softcap, plans as (size, last)
    ("Llama-3-8B", 4096, 128256, None, ((1280, 0), (1536, 0), (1792, 0), (1024, 0))),
    ("Gemma-2-2B", 2304, 256000, 30.0, ((768, 0), (1024, 0), (1280, 0), (1536, 0))),
)


def run(label, hidden, vocab, softcap, plans):
    x = (torch.randn(N, hidden, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda") * hidden**-0.5).bfloat16().requires_grad_()
    target = _target(N, vocab, "cuda")
    shipped = flce.chunk_plan(N, vocab, hidden, 2)
    print(f"\n{label}: N={N} H={hidden} V={vocab} softcap={softcap}; shipped plan {shipped}", flush=True)
    _, _, dw_ref = reference(x, w, target, softcap, 1024)
    logits = x @ w.t()                                      # eager, unfused (compile's rounding of dW too)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=-100).backward()
    print(f"  eager (unfused) dW rel err {errors(w.grad, dw_ref)[0]:.2e}", flush=True)
    del logits
    x.grad = w.grad = None
    original = flce.chunk_plan
    want = None
    for size, last in plans:
        plan = flce.ChunkPlan(True, size, last=last)
        flce.chunk_plan = lambda *a, plan=plan, **k: plan

        def step():
            loss = flce.fused_linear_cross_entropy(x, w, target, softcap=softcap)
            loss.backward()

        try:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            dw_rel = errors(w.grad, dw_ref)[0]
            got = (x.grad.clone(), w.grad.clone())
            x.grad = w.grad = None
            if want is None:
                want = got
            diff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                       for a, b in zip(got, want, strict=True))
            got = None

            def timed():
                step()
                x.grad = w.grad = None

            ms = gpu_time(timed, 50.0)
        finally:
            flce.chunk_plan = original
        sizes = [c1 - c0 for c0, c1 in plan.token_chunks(N)]
        print(f"  chunks {sizes[0]} × {sizes.count(sizes[0])}" + (f" + {sizes[-1]}" if sizes[-1] != sizes[0] else "")
              + f": {ms:7.3f} ms  peak {peak:6.0f} MiB  dW rel err {dw_rel:.2e}"
              + f"  [max rel diff of the gradients to the first plan's {diff:.1e}]", flush=True)


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for head in HEADS:
        run(*head)


if __name__ == "__main__":
    main()
