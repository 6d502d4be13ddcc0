"""Sweep the log-prob head's chunk width and row-kernel geometry on a GPU, against TRL's head.

    PYTHONPATH=src python3 dev/tune_logprobs_chunks.py

An experiment kept out of the package (STYLE: llm.c habit): its findings go into the defaults of
FusedLinearLogprobsConfig in src/tigon/ops/fused_linear_logprobs.py. The head keeps each chunk of
logits in fp32 (N tokens × a chunk of classes), and its backward sums dX over the class chunks in an
fp32 accumulator that every chunk's matmul reads and writes: wider chunks mean fewer passes over that
accumulator (8192 × 4096 × 4 bytes, read and written per chunk at H = 4096) and wider matmuls, for a
larger workspace. For each ``workspace_bytes`` and (``block_v``, ``num_warps``) of the row kernels,
at the benchmark's two heads (N = 8192, V = 151936, H = 4096 and 896; entropy on; every 64th target
ignored): GPU ms of the forward alone (no gradient: scoring a reference) and of forward + backward
(random upstream gradients for both outputs), by the harness's ``gpu_time`` (launches queued behind
a sleeping GPU, L2 flushed), and the peak memory beyond the inputs; TRL 1.16's head
(``trl.kernels.ChunkedLogProbFunction``, as the benchmark calls it) and the bf16 cuBLAS matmuls
alone in the same process. Each setting's outputs and gradients are checked against the shipped
setting's.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from tigon.bench.harness import gpu_time
from tigon.bench.specs import logprobs as spec
from tigon.ops.fused_linear_logprobs import DEFAULT_CONFIG, fused_linear_logprobs

MIB = 1 << 20
WORKSPACES = (256 * MIB, 512 * MIB, 1024 * MIB)
GEOMETRIES = ((1024, 4), (2048, 8), (4096, 8))


def _peak_mb(step, base):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MIB


class HeadBench:
    """One benchmark head (N = spec.TOKENS, bf16, random upstream gradients for both outputs) and the two
    measurements every sweep makes of it: ``timed`` (forward alone and forward + backward, GPU ms and peaks
    beyond the inputs) and ``outputs`` (log-probs, entropy and their gradients, to compare settings)."""

    def __init__(self, label, hidden, vocab, width=44):
        inputs = spec._make(spec.TOKENS, hidden, vocab)("cuda", torch.bfloat16)
        self.x, self.w, self.t = inputs["input"], inputs["linear_weight"], inputs["target"]
        self.g_lp = torch.randn(spec.TOKENS, device="cuda")
        self.g_ent = torch.randn(spec.TOKENS, device="cuda")
        self.base = torch.cuda.memory_allocated()
        self.width = width
        print(f"\n{label}: N={spec.TOKENS} H={hidden} V={vocab}", flush=True)

    def timed(self, name, head):
        x, w, t = self.x, self.w, self.t

        def fwd():
            with torch.no_grad():
                head(x, w, t)

        def full():
            out = head(x, w, t)
            out = out if isinstance(out, tuple) else (out,)  # the floor: one output
            grads = (self.g_lp, self.g_ent)[: len(out)]
            torch.autograd.backward(out, tuple(g[: o.numel()] for o, g in zip(out, grads, strict=True)))
            x.grad = w.grad = None

        fwd(), full()  # compiles, cuBLAS set-up
        f_ms, full_ms = gpu_time(fwd, 20.0), gpu_time(full, 70.0)
        print(f"  {name:<{self.width}} fwd {f_ms:7.3f} ms  full {full_ms:7.3f} ms  peak fwd "
              f"{_peak_mb(fwd, self.base):7.0f} MB  full {_peak_mb(full, self.base):7.0f} MB", flush=True)

    def outputs(self, config):
        x, w = self.x, self.w
        lp, ent = fused_linear_logprobs(x, w, self.t, entropy=True, config=config)
        torch.autograd.backward((lp, ent), (self.g_lp, self.g_ent))
        out = (lp.detach(), ent.detach(), x.grad, w.grad)
        x.grad = w.grad = None
        return out


def sweep(label, hidden, vocab, trl_head) -> None:
    """Every setting at one head, with TRL's head and the matmul floor."""
    bench = HeadBench(label, hidden, vocab)
    timed, outputs = bench.timed, bench.outputs
    want = outputs(DEFAULT_CONFIG)
    timed("matmul floor", spec._matmul_floor)
    if trl_head is not None:
        timed("TRL 1.16", trl_head)
    for workspace in WORKSPACES:
        for block_v, warps in GEOMETRIES:
            config = dataclasses.replace(DEFAULT_CONFIG, workspace_bytes=workspace, block_v=block_v, num_warps=warps)
            got = outputs(config)
            err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                      for a, b in zip(got, want, strict=True))
            chunk = config.chunk_classes(spec.TOKENS, vocab, 2)
            timed(f"tigon ws {workspace // MIB} MiB ({chunk} classes) block {block_v} w{warps} "
                  f"[max rel diff {err:.1e}]",
                  lambda a, b, c, config=config: fused_linear_logprobs(a, b, c, entropy=True, config=config))


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    trl_head = spec._trl()
    for label, hidden, vocab in spec.SHAPES:
        sweep(label, hidden, vocab, trl_head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
