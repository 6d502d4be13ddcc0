"""The log-prob head's row kernels on a second CUDA stream, beside the next chunk's matmul: a measurement.

    PYTHONPATH=src python3 dev/overlap_logprobs.py

An experiment kept out of the package (STYLE: llm.c habit). The head (fused_linear_logprobs.py) runs,
per class chunk, a cuBLAS matmul (compute-bound) and then a row kernel over its fp32 logits
(memory-bound): the statistics in the forward, dl in the backward. On one stream they take turns, so
the row kernels' ~1.5 ms (forward) and ~2.5 ms (backward) of HBM traffic at H = 4096 add to the
matmuls' time. Here chunk i's row kernel runs on a side stream while the main stream makes chunk i+1's
logits (and, in the backward, chunk i-1's dW and dX products), over two buffers: if the GPU interleaves
the two kernels' blocks, the memory-bound work hides under the compute-bound.

For each head of the benchmark (N = 8192, V = 151936, H = 4096 and 896, bf16, entropy on), the GPU ms
(harness's ``gpu_time``) of: the bf16 matmul floor; tigon's op as shipped; the same passes written here
on one stream (the baseline the overlap is compared with); and on two streams, with the side stream at
normal and at high priority, with chunks of the shipped width (twice the workspace) and half of it.
Outputs and gradients are checked against the shipped op's. Also the raw ingredients: one chunk's
matmul, one row kernel, and both launched on two streams at once.

Findings (H100, benchmarks/results/2026-11-27/overlap_logprobs.log): little overlaps. At H = 4096 a
chunk's matmul (1.93 ms) and a statistics pass (0.27 ms) take 2.05 ms together on two streams, not
1.93: cuBLAS's tiles hold the SMs, and the row kernel's blocks run mostly in the gaps. Whole passes:
forward 14.70 → 14.56 ms, backward 44.12 → 42.91 ms with the side stream at high priority (45.60 at
normal priority); at H = 896 forward 5.77 → 5.54, backward 12.41 → 12.31. About 2% of the step, for
a second buffer of each kind (or narrower chunks, which cost more than the overlap gains) and
cross-stream lifetimes in the op: not adopted. What the head's gap to the matmuls needs is the row
work inside the matmul (module docs of fused_linear_logprobs.py), not beside it.
"""

from __future__ import annotations

import sys

import torch

from tigon._kernels import (
    LOGPROB_CHUNK_GRAD,
    LOGPROB_CHUNK_STATS,
    LogprobOptions,
    class_chunks,
    linear_fp32,
    matmul_accumulate,
)
from tigon.bench.harness import gpu_time
from tigon.bench.specs import logprobs as spec
from tigon.ops.fused_linear_logprobs import DEFAULT_CONFIG, fused_linear_logprobs

LAUNCH = (DEFAULT_CONFIG.block_v, DEFAULT_CONFIG.num_warps)


def _event(stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


def forward_pass(x, w, t, opts, chunk, side):
    """(logprobs, lse, entropy): the shipped forward's kernels; with ``side`` the row kernels run there."""
    main = torch.cuda.current_stream() if side is not None else None
    num_tokens, vocab = x.shape[0], w.shape[0]
    slots = 2 if side is not None else 1
    buffers = [torch.empty(num_tokens * chunk, dtype=torch.float32, device=x.device) for _ in range(slots)]
    read = [None] * slots
    chunks = class_chunks(vocab, chunk)
    state, outputs = torch.empty(0, dtype=torch.float32, device=x.device), None
    for i, (c0, c1) in enumerate(chunks):
        slot = i % slots
        if read[slot] is not None:
            main.wait_event(read[slot])
        logits = linear_fp32(x, w[c0:c1], None, buffers[slot][: num_tokens * (c1 - c0)].view(num_tokens, c1 - c0))
        args = (t, state, c0, vocab, i == 0, i == len(chunks) - 1, opts.ignore_index, opts.logit_scale,
                opts.softcap, opts.softcap_scale, opts.entropy, opts.extras, *LAUNCH)
        if side is None:
            state, *outputs = LOGPROB_CHUNK_STATS(logits, *args)
            continue
        side.wait_event(_event(main))
        with torch.cuda.stream(side):
            state, *outputs = LOGPROB_CHUNK_STATS(logits, *args)
            read[slot] = _event(side)
    if side is not None:
        main.wait_stream(side)
    return outputs[0], outputs[1], outputs[2]


def backward_pass(x, w, t, lse, ent, g_lp, g_ent, opts, chunk, side):
    """(dx fp32, dw): main stream L0, L1, dW0, dX0, L2, dW1, dX1, ...; dl_i on ``side`` (or in line)."""
    main = torch.cuda.current_stream() if side is not None else None
    num_tokens, vocab = x.shape[0], w.shape[0]
    slots = 2 if side is not None else 1
    logit_buffers = [torch.empty(num_tokens * chunk, dtype=torch.float32, device=x.device) for _ in range(slots)]
    grad_buffers = [torch.empty(num_tokens * chunk, dtype=x.dtype, device=x.device) for _ in range(slots)]
    dx32 = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    dw = torch.empty(w.shape, dtype=w.dtype, device=x.device)
    chunks = class_chunks(vocab, chunk)
    made, used, dl = {}, [None] * slots, {}

    def remake(i):
        c0, c1 = chunks[i]
        slot = i % slots
        logits = linear_fp32(x, w[c0:c1], None,
                              logit_buffers[slot][: num_tokens * (c1 - c0)].view(num_tokens, c1 - c0))
        grad = grad_buffers[slot][: num_tokens * (c1 - c0)].view(num_tokens, c1 - c0)
        args = (t, lse, ent, g_lp, g_ent, c0, *opts.transform(), *LAUNCH)
        if side is None:
            LOGPROB_CHUNK_GRAD(logits, grad, *args)
        else:
            side.wait_event(_event(main))
            if used[slot] is not None:
                side.wait_event(used[slot])
            with torch.cuda.stream(side):
                LOGPROB_CHUNK_GRAD(logits, grad, *args)
                made[i] = _event(side)
        dl[i] = grad

    def consume(i):
        c0, c1 = chunks[i]
        if side is not None:
            main.wait_event(made.pop(i))
        grad = dl.pop(i)
        matmul_accumulate(dw[c0:c1], grad.t(), x, first=True)
        matmul_accumulate(dx32, grad, w[c0:c1], first=i == 0)
        used[i % slots] = _event(main) if side is not None else None

    if side is None:
        for i in range(len(chunks)):
            remake(i)
            consume(i)
    else:
        remake(0)
        for i in range(len(chunks)):
            if i + 1 < len(chunks):
                remake(i + 1)
            consume(i)
    return dx32, dw


def _passes(x2, w, t, g_lp, g_ent, opts, chunk, side, want):
    """One setting: its forward and backward timed, its results against the shipped op's."""
    lp, lse, ent = forward_pass(x2, w, t, opts, chunk, side)
    dx, dw = backward_pass(x2, w, t, lse, ent, g_lp, g_ent, opts, chunk, side)
    torch.cuda.synchronize()
    err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
              for a, b in zip((lp, ent, dx, dw.float()), want, strict=True))
    f_ms = gpu_time(lambda: forward_pass(x2, w, t, opts, chunk, side), 16.0)
    b_ms = gpu_time(lambda: backward_pass(x2, w, t, lse, ent, g_lp, g_ent, opts, chunk, side), 46.0)
    return f_ms, b_ms, err


def measure(label, hidden, vocab, streams, opts) -> None:
    """Every setting at one head, with the shipped op and the matmul floor; then the raw ingredients."""
    inputs = spec._make(spec.TOKENS, hidden, vocab)("cuda", torch.bfloat16)
    x2, w, t = inputs["input"].detach(), inputs["linear_weight"].detach(), inputs["target"]
    g_lp, g_ent = torch.randn(spec.TOKENS, device="cuda"), torch.randn(spec.TOKENS, device="cuda")
    shipped = DEFAULT_CONFIG.chunk_classes(spec.TOKENS, vocab, 2, w.numel() * 2)
    print(f"\n{label}: N={spec.TOKENS} H={hidden} V={vocab}; shipped chunk {shipped} classes", flush=True)

    xr, wr = x2.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = fused_linear_logprobs(xr, wr, t, entropy=True)
    torch.autograd.backward((lp, ent), (g_lp, g_ent))
    want = (lp.detach(), ent.detach(), xr.grad.float(), wr.grad.float())

    def op_fwd():
        with torch.no_grad():
            fused_linear_logprobs(x2, w, t, entropy=True)

    def op_full():
        a, b = fused_linear_logprobs(xr, wr, t, entropy=True)
        torch.autograd.backward((a, b), (g_lp, g_ent))
        xr.grad = wr.grad = None

    op_fwd(), op_full()
    print(f"  matmul floor, forward {gpu_time(lambda: x2 @ w.t(), 15.0):7.3f} ms", flush=True)
    print(f"  tigon op: forward {gpu_time(op_fwd, 16.0):7.3f} ms, forward + backward {gpu_time(op_full, 62.0):7.3f} ms",
          flush=True)
    for chunk in (shipped, shipped // 2 // 512 * 512):
        for name, side in (("one stream", None), ("side normal", streams["normal"]), ("side high", streams["high"])):
            f_ms, b_ms, err = _passes(x2, w, t, g_lp, g_ent, opts, chunk, side, want)
            print(f"  chunk {chunk:6d} {name:<12} forward {f_ms:7.3f} ms  backward {b_ms:7.3f} ms  "
                  f"sum {f_ms + b_ms:7.3f}  [max rel diff {err:.1e}]", flush=True)
    # the raw ingredients at the shipped width: a chunk's matmul and a statistics pass over other logits
    buf = torch.empty(spec.TOKENS, shipped, dtype=torch.float32, device="cuda")
    state = torch.empty(0, dtype=torch.float32, device="cuda")
    other = torch.randn(spec.TOKENS, shipped, device="cuda")

    def mm():
        linear_fp32(x2, w[:shipped], None, buf)

    def stats():
        LOGPROB_CHUNK_STATS(other, t, state, 0, vocab, True, True, opts.ignore_index, opts.logit_scale, opts.softcap,
                    opts.softcap_scale, True, False, *LAUNCH)

    print(f"  one chunk: matmul {gpu_time(mm, 2.0):6.3f} ms, stats {gpu_time(stats, 1.0):6.3f} ms", flush=True)
    for side_name, side in streams.items():
        def both(side=side):
            main = torch.cuda.current_stream()
            side.wait_event(_event(main))
            with torch.cuda.stream(side):
                stats()
            mm()
            main.wait_stream(side)

        print(f"  one chunk: both on two streams ({side_name} priority) {gpu_time(both, 3.0):6.3f} ms", flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    streams = {"normal": torch.cuda.Stream(), "high": torch.cuda.Stream(priority=-1)}
    opts = LogprobOptions.make(-100, 1.0, None, 1.0, True, False)
    for label, hidden, vocab in spec.SHAPES:
        measure(label, hidden, vocab, streams, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
