"""Sweep the streamed cross-entropy kernel's launch geometry on a GPU (rows longer than
``MAX_SINGLE_BLOCK_V``, read twice), and check every setting's loss and gradient against torch.

    PYTHONPATH=src python3 scripts/tune_ce.py

An experiment kept out of the package (STYLE: llm.c habit): its findings go into the STREAM_*
constants of src/tigon/ops/cross_entropy.py. Not yet run on a GPU (written when the session's device
time had run out); about two minutes on an H100 by estimate. Times are GPU times of forward+backward from the
benchmark harness (the step queued behind a sleeping GPU, L2 flushed before each step); SOL = one
read of the logits and one write of the gradient over the copy bandwidth measured first.
"""

from __future__ import annotations

import itertools
import sys

import torch

import tigon.ops  # noqa: F401  (defines the kernels)
from tigon.bench.harness import copy_bandwidth, gpu_time

ce = sys.modules["tigon.ops.cross_entropy"]

TOKENS = 8192
SHAPES = ((128256, None), (256000, 30.0))
BLOCKS = (4096, 8192)
WARPS = (8, 16)
PROGRAMS_PER_SM = (1, 2)
GRAD_TOLERANCE = 3e-2  # bf16 gradient against an fp32 torch reference (API.md's bf16 bound)


def _reference(logits, target, softcap):
    z = logits.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return torch.nn.functional.cross_entropy(z, target)


def main() -> None:
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s on {torch.cuda.get_device_name()}")
    shipped = (ce.STREAM_BLOCK_V, ce.STREAM_WARPS, ce.STREAM_PROGRAMS_PER_SM)
    for vocab, softcap in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(TOKENS, vocab, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits.requires_grad_(True)
        target = torch.randint(vocab, (TOKENS,), device="cuda", generator=gen)
        ref_loss = _reference(logits, target, softcap)
        (ref_grad,) = torch.autograd.grad(ref_loss, logits)
        sol_ms = 2 * logits.numel() * logits.element_size() / bandwidth * 1e3
        results = []
        for block, warps, per_sm in itertools.product(BLOCKS, WARPS, PROGRAMS_PER_SM):
            ce.STREAM_BLOCK_V, ce.STREAM_WARPS, ce.STREAM_PROGRAMS_PER_SM = block, warps, per_sm

            def step(logits=logits, target=target, softcap=softcap):
                loss = ce.cross_entropy(logits, target, softcap=softcap)
                return torch.autograd.grad(loss, logits)

            try:
                loss = ce.cross_entropy(logits, target, softcap=softcap)
                (grad,) = torch.autograd.grad(loss, logits)
                loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
                grad_err = ((grad.float() - ref_grad.float()).norm() / ref_grad.float().norm()).item()
                ok = loss_err <= 1e-4 and grad_err <= GRAD_TOLERANCE
                step()
                ms = gpu_time(step, 5.0)
            except Exception as exc:  # a setting that does not compile (spills past the limit) is a result
                print(f"  V={vocab} block={block} warps={warps} per_sm={per_sm}: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:120]}")
                continue
            mark = "" if ok else f"  WRONG (loss {loss_err:.1e}, grad {grad_err:.1e})"
            shipped_mark = "  (shipped)" if (block, warps, per_sm) == shipped else ""
            print(f"  V={vocab} softcap={softcap} block={block} warps={warps} per_sm={per_sm}: "
                  f"{ms:.3f} ms ({100 * sol_ms / ms:.0f}% SOL){mark}{shipped_mark}")
            if ok:
                results.append((ms, block, warps, per_sm))
        ce.STREAM_BLOCK_V, ce.STREAM_WARPS, ce.STREAM_PROGRAMS_PER_SM = shipped
        best = min(results)
        print(f"V={vocab}: best block={best[1]} warps={best[2]} per_sm={best[3]}: {best[0]:.3f} ms "
              f"({100 * sol_ms / best[0]:.0f}% SOL)")
        logits = ref_grad = step = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
