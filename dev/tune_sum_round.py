"""The fused linear CE's last dW chunk: cuBLAS's fp32 sum then a cast, against one Triton matmul that adds
and rounds (src/tigon/_kernels/add_round_matmul.py), for several tilings, on a GPU.

    PYTHONPATH=src python3 dev/tune_sum_round.py [tiling ...]   # a tiling: BM,BN,BK,STAGES,WARPS,WS[,DTMA]

An experiment kept out of the package (STYLE: llm.c habit): its findings go into SumRoundConfig's defaults.
For each head (V, H) and chunk of K tokens: A = dl_c (K, V) bf16, B = X_c (K, H) bf16, C (V, H) fp32;
GPU ms (the harness's ``gpu_time``: launches queued behind a sleeping GPU, L2 flushed) of

* cuBLAS: ``C += Aᵀ·B`` (out_dtype fp32, beta 1), then ``C.to(bf16)``: what the op did before;
* the same matmul alone, and the cast alone;
* each tiling of the Triton kernel, its result compared with cuBLAS's (bf16 values that differ, and the
  largest difference in units of the last place);
* the kernel's two other uses measured against cuBLAS: a middle chunk, C += Aᵀ·B in fp32 in place
  (``--inplace``), and a 16-bit running sum, D = round(D + Aᵀ·B) in place (the plans without the
  accumulator), each against cuBLAS's ``addmm`` doing the same, and cuBLAS's plain product (beta 0, 16-bit
  out) as the matmul's floor.
"""

from __future__ import annotations

import sys

import torch

from tigon._kernels import SumRoundConfig, sum_round
from tigon._kernels.add_round_matmul import _sum_round_impl
from tigon.bench.harness import gpu_time

HEADS = (("Qwen2.5-0.5B", 151936, 896, (2048, 3072)), ("Llama-3-8B", 128256, 4096, (1280,)),
         ("Gemma-2-2B", 256000, 2304, (768,)))
TILINGS = (  # BM, BN, BK, STAGES, WARPS, WARP_SPECIALIZE, D_TMA
    (128, 128, 64, 4, 8, True, False),
    (128, 128, 64, 4, 8, True, True),
    (128, 128, 64, 3, 8, True, True),
    (128, 256, 64, 3, 8, True, False),
)
# (tune_sum_round-3.log, 2026-11-28, also swept C loaded before the K loop, an option the kernel had then:
# it spilled, 7-120 ms.)


def _ulps(got, want):
    """|got − want| in units of want's last place (bf16: 8 bits of mantissa)."""
    exponent = torch.frexp(want.float().abs().clamp_min(1e-30))[1]
    ulp = torch.ldexp(torch.ones_like(want, dtype=torch.float32), exponent - 8)
    return ((got.float() - want.float()).abs() / ulp).max().item()


def sweep(label, vocab, hidden, chunk, tilings):
    a = torch.randn(chunk, vocab, device="cuda", dtype=torch.bfloat16) * 1e-3
    b = torch.randn(chunk, hidden, device="cuda", dtype=torch.bfloat16)
    c0 = torch.randn(vocab, hidden, device="cuda") * 1e-2
    c = c0.clone()
    out = torch.empty(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    flops = 2 * chunk * vocab * hidden

    def cublas():
        torch.addmm(c, a.t(), b, beta=1.0, out_dtype=torch.float32, out=c)
        return c.to(torch.bfloat16)

    def matmul():
        torch.addmm(c, a.t(), b, beta=1.0, out_dtype=torch.float32, out=c)

    def cast():
        out.copy_(c)

    want = (c0 + torch.addmm(torch.zeros_like(c0), a.t(), b, beta=0.0, out_dtype=torch.float32)).to(torch.bfloat16)
    print(f"\n{label}: V={vocab} H={hidden} K={chunk}", flush=True)
    for name, step, est in (("cuBLAS sum + cast", cublas, 2.0), ("cuBLAS sum alone", matmul, 1.5),
                            ("cast alone", cast, 0.3)):
        step()
        ms = gpu_time(step, est)
        print(f"  {name:<44} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TF/s", flush=True)
    for tiling in tilings:
        config = SumRoundConfig(*tiling)
        try:
            sum_round(a, b, c0, out, config)
        except Exception as e:  # noqa: BLE001  (a tiling this Triton cannot compile: say so, go on)
            print(f"  tiles {tiling}: {type(e).__name__} {str(e)[:200]}", flush=True)
            continue
        torch.cuda.synchronize()
        differ = int((out != want).sum())
        ulps = _ulps(out, want)
        ms = gpu_time(lambda config=config: sum_round(a, b, c0, out, config), 1.5)
        print(f"  tiles {str(tiling):<50} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TF/s  "
              f"[{differ} differ, max {ulps:.2f} ulp]", flush=True)


def sweep_inplace(label, vocab, hidden, chunk, tilings, dtype):
    """C += Aᵀ·B in place, C in ``dtype`` (fp32: a middle chunk of the accumulator; 16-bit: the running
    sum of the plans without it), the kernel against cuBLAS's addmm."""
    a = torch.randn(chunk, vocab, device="cuda", dtype=torch.bfloat16) * 1e-3
    b = torch.randn(chunk, hidden, device="cuda", dtype=torch.bfloat16)
    c0 = (torch.randn(vocab, hidden, device="cuda") * 1e-2).to(dtype)
    c = c0.clone()
    flops = 2 * chunk * vocab * hidden
    out_dtype = {"out_dtype": torch.float32} if dtype == torch.float32 else {}

    def cublas():
        torch.addmm(c, a.t(), b, beta=1.0, out=c, **out_dtype)

    def floor():
        torch.mm(a.t(), b)

    want = (c0.float() + torch.addmm(torch.zeros(vocab, hidden, device="cuda"), a.t(), b, beta=0.0,
                                     out_dtype=torch.float32)).to(dtype)
    print(f"\n{label}: V={vocab} H={hidden} K={chunk}, in place in {dtype}", flush=True)
    for name, step, est in (("cuBLAS addmm in place", cublas, 1.5), ("cuBLAS product alone (beta 0)", floor, 1.2)):
        step()
        ms = gpu_time(step, est)
        print(f"  {name:<44} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TF/s", flush=True)
    for tiling in tilings:
        config = SumRoundConfig(*tiling)
        c.copy_(c0)
        try:
            _sum_round_impl(a, b, c, c, *config.tiling())
        except Exception as e:  # noqa: BLE001
            print(f"  tiles {tiling}: {type(e).__name__} {str(e)[:200]}", flush=True)
            continue
        torch.cuda.synchronize()
        differ = int((c != want).sum())
        ulps = _ulps(c, want) if dtype != torch.float32 else float((c - want).abs().max() / want.abs().max())
        ms = gpu_time(lambda config=config: _sum_round_impl(a, b, c, c, *config.tiling()), 1.5)
        print(f"  tiles {str(tiling):<50} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TF/s  "
              f"[{differ} differ, max {ulps:.2g}{' ulp' if dtype != torch.float32 else ' rel'}]", flush=True)


def main(argv):
    tilings = [tuple(int(v) if v.isdigit() else v == "True" for v in arg.split(",")) for arg in argv] or TILINGS
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for label, vocab, hidden, chunks in HEADS:
        for chunk in chunks:
            sweep(label, vocab, hidden, chunk, tilings)
    sweep_inplace("Qwen2.5-0.5B", 151936, 896, 3072, tilings, torch.float32)
    sweep_inplace("Llama-3-8B", 128256, 4096, 1280, tilings, torch.bfloat16)
    sweep_inplace("Gemma-2-2B", 256000, 2304, 768, tilings, torch.bfloat16)


if __name__ == "__main__":
    main(sys.argv[1:])
