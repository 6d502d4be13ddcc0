"""How far each fused linear cross-entropy's gradients and loss are from fp64 (GPU; --tiny on CPU).

    PYTHONPATH=src python3 dev/flce_dw_error.py                  # the benchmark heads, N = 8192, bf16
    PYTHONPATH=src python3 dev/flce_dw_error.py --providers tigon cce cce_exact
    TRITON_INTERPRET=1 PYTHONPATH=src python3 dev/flce_dw_error.py --tiny   # a small head on the CPU

An experiment kept out of the package (STYLE: llm.c habit). For each head of the benchmark spec
(``FLCE_SHAPES`` in tigon/bench/specs/cross_entropy.py: Llama-3-8B, Qwen2.5-0.5B, Gemma-2-2B with
softcap 30) it draws the inputs as the benchmark cases draw them (bf16 tokens and head, one target
in 64 ignored), runs every provider the benchmark has (eager, tigon, compile, liger, cce, cce_exact,
whichever import here) for the mean loss and its gradients, and compares them with fp64:

    reference  the logits X·Wᵀ in fp64 from the bf16 X and W (no rounding to bf16), softcap, then
               cross-entropy, all in fp64, made by token chunks (fp64 logits of all tokens would
               take N·V·8 bytes: 16.8 GB at Gemma-2-2B's head); dX and dW by autograd, chunk by
               chunk (dW summed over the chunks in fp64).
    rel        ‖g − ref‖ / ‖ref‖ (for dW, dX; for the loss |loss − ref| / |ref|)
    max        max |g − ref| / max |ref|

The row ``ref→bf16`` is the reference itself rounded to bf16: the error of one rounding, the least
any provider returning bf16 gradients can have (an unfused loss's dW is one matmul, rounded once).
``compile`` is the harness's: a static-shape torch.compile of the eager reference (its first call
at each head compiles, ~10-30 s).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.nn.functional as F

import tigon.ops  # noqa: F401
from tigon.bench.harness import providers_of
from tigon.bench.specs.cross_entropy import FLCE_SHAPES, FUSED_LINEAR_CROSS_ENTROPY, TOKENS, _flce_case
from tigon.ops.fused_linear_cross_entropy import chunk_plan

DTYPE = torch.bfloat16
IGNORE_INDEX = -100
TINY = (("tiny", 64, 1000, None), ("tiny-softcap", 64, 1000, 30.0))
TINY_TOKENS = 96


def reference(x, w, target, softcap, chunk):
    """(loss, dX, dW) of the mean loss in fp64 from bf16 ``x`` (N, H) and ``w`` (V, H), by token chunks."""
    w64 = w.detach().double().requires_grad_()
    valid = int((target != IGNORE_INDEX).sum())
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    dx = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    for c0 in range(0, x.shape[0], chunk):
        x64 = x[c0:c0 + chunk].detach().double().requires_grad_()
        logits = x64 @ w64.t()
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        loss_c = F.cross_entropy(logits, target[c0:c0 + chunk], ignore_index=IGNORE_INDEX, reduction="sum") / valid
        loss_c.backward()                                  # dW accumulates into w64.grad in fp64
        dx[c0:c0 + chunk] = x64.grad
        loss += loss_c.detach()
        del logits, loss_c, x64
    return loss, dx, w64.grad


def errors(got, ref):
    """(‖got − ref‖/‖ref‖, max|got − ref|/max|ref|), in fp64, one row block at a time (memory)."""
    diff_sq = ref_sq = 0.0
    diff_max = ref_max = 0.0
    for r0 in range(0, ref.shape[0] if ref.dim() else 1, 16384):
        g = got.double() if not ref.dim() else got[r0:r0 + 16384].double()
        r = ref if not ref.dim() else ref[r0:r0 + 16384]
        d = g - r
        diff_sq += float((d * d).sum())
        ref_sq += float((r * r).sum())
        diff_max = max(diff_max, float(d.abs().max()))
        ref_max = max(ref_max, float(r.abs().max()))
    return diff_sq**0.5 / max(ref_sq**0.5, 1e-300), diff_max / max(ref_max, 1e-300)


def row(name, loss, dx, dw, ref, seconds=None):
    ref_loss, ref_dx, ref_dw = ref
    loss_err = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
    dw_rel, dw_max = errors(dw, ref_dw)
    dx_rel, dx_max = errors(dx, ref_dx)
    took = f"  {seconds:6.1f} s" if seconds is not None else ""
    print(f"  {name:10s} {dw_rel:9.2e} {dw_max:9.2e}   {dx_rel:9.2e} {dx_max:9.2e}   {loss_err:9.2e}{took}",
          flush=True)


def run_shape(label, tokens, hidden, vocab, softcap, providers, device, ref_chunk):
    case = _flce_case(label, tokens, hidden, vocab, softcap)
    torch.manual_seed(0)
    inputs = case.make_inputs(device, DTYPE)
    x, w, target = inputs["input"], inputs["linear_weight"], inputs["target"]
    print(f"\n{case.label}  (tigon's plan: {chunk_plan(tokens, vocab, hidden, 2)})", flush=True)
    t0 = time.perf_counter()
    ref = reference(x, w, target, softcap, ref_chunk)
    print(f"  fp64 reference: {time.perf_counter() - t0:.1f} s, loss {float(ref[0]):.6f}")
    print(f"  {'provider':10s} {'dW rel':>9s} {'dW max':>9s}   {'dX rel':>9s} {'dX max':>9s}   {'loss rel':>9s}")
    row("ref→bf16", ref[0].float(), ref[1].to(DTYPE), ref[2].to(DTYPE), ref)
    for name, fn in providers.items():
        t0 = time.perf_counter()
        try:
            loss = fn(**inputs)
            dx, dw = torch.autograd.grad(loss, (x, w))
        except Exception as exc:  # one provider failing is a result, as in the harness
            print(f"  {name:10s} error: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
            continue
        if device.type == "cuda":
            torch.cuda.synchronize()
        row(name, loss.detach(), dx, dw, ref, time.perf_counter() - t0)
        del loss, dx, dw
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", nargs="+", metavar="NAME", help="only these (default: all that import)")
    parser.add_argument("--shapes", nargs="+", metavar="LABEL", help="only these heads (e.g. Qwen2.5-0.5B)")
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"tokens (default {TOKENS}; {TINY_TOKENS} with --tiny)")
    parser.add_argument("--tiny", action="store_true",
                        help="small heads on the CPU (TRITON_INTERPRET=1), eager and tigon")
    parser.add_argument("--ref-chunk", type=int, default=1024, help="tokens per chunk of the fp64 reference")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    shapes = TINY if args.tiny else FLCE_SHAPES
    tokens = args.tokens or (TINY_TOKENS if args.tiny else TOKENS)
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes]
    only = args.providers or (["eager", "tigon"] if args.tiny else None)
    if device.type == "cuda":
        print(torch.cuda.get_device_name(), torch.__version__, flush=True)
        torch.backends.cuda.matmul.allow_tf32 = False     # the fp64 reference is fp64 anyway
    for label, hidden, vocab, softcap in shapes:
        # A fresh compile per head, as the harness makes one per case.
        providers = providers_of(FUSED_LINEAR_CROSS_ENTROPY, only)
        run_shape(label, tokens, hidden, vocab, softcap, providers, device, args.ref_chunk)
        providers = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
