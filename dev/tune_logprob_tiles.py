"""The log-prob head's tile kernel (matmul + row math in its epilogue) against its row-kernel path,
TRL's head and the matmul floor, for several tilings, on a GPU.

    PYTHONPATH=src python3 dev/tune_logprob_tiles.py [tiling ...]      # a tiling: BM,BN,BK,GROUP,STAGES,WARPS,WS,SPLIT

An experiment kept out of the package (STYLE: llm.c habit): its findings go into the ``tile_*`` defaults
of FusedLinearLogprobsConfig (src/tigon/ops/fused_linear_logprobs.py). At the benchmark's two heads
(N = 8192, V = 151936, H = 4096 and 896; entropy on; every 64th target ignored): GPU ms of the forward
alone (no gradient) and of forward + backward (random upstream gradients for both outputs), by the
harness's ``gpu_time`` (launches queued behind a sleeping GPU, L2 flushed), and the peak memory beyond
the inputs. Each tiling's outputs and gradients are compared with the row-kernel path's (cuBLAS logits
in fp32); a tiling Triton cannot compile is reported and skipped.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from tune_logprobs_chunks import HeadBench  # (dev/ is the script's folder: first on sys.path)

from tigon.bench.specs import logprobs as spec
from tigon.ops.fused_linear_logprobs import DEFAULT_CONFIG, fused_linear_logprobs

TILINGS = (  # BM, BN, BK, GROUP, STAGES, WARPS, WARP_SPECIALIZE, EPILOGUE_SPLIT
    (128, 256, 64, 8, 3, 8, False, 1),
    (128, 256, 64, 8, 3, 8, False, 2),
    (128, 256, 64, 8, 4, 8, True, 2),
    (128, 256, 64, 16, 3, 8, False, 2),
)


def sweep(label, hidden, vocab, trl_head, tilings) -> None:
    bench = HeadBench(label, hidden, vocab, width=58)
    timed, outputs = bench.timed, bench.outputs

    rows = dataclasses.replace(DEFAULT_CONFIG, tiles=False)
    want = outputs(rows)
    timed("matmul floor", spec._matmul_floor)
    if trl_head is not None:
        timed("TRL 1.16", trl_head)
    timed("tigon, row kernels (cuBLAS fp32 logits)",
          lambda a, b, c: fused_linear_logprobs(a, b, c, entropy=True, config=rows))
    for tiling in tilings:
        bm, bn, bk, group, stages, warps, ws, split = tiling
        config = dataclasses.replace(DEFAULT_CONFIG, tiles=True, tile_m=bm, tile_n=bn, tile_k=bk, tile_group=group,
                                     tile_stages=stages, tile_warps=warps, tile_warp_specialize=ws,
                                     tile_epilogue_split=split)
        try:
            got = outputs(config)
        except Exception as e:  # noqa: BLE001  (a tiling this Triton cannot compile: say so, go on)
            print(f"  tiles {tiling}: {type(e).__name__} {str(e)[:200]}", flush=True)
            continue
        err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                  for a, b in zip(got, want, strict=True))
        got = None  # (not counted in the peaks)
        timed(f"tiles {tiling} [max rel diff {err:.1e}]",
              lambda a, b, c, config=config: fused_linear_logprobs(a, b, c, entropy=True, config=config))


def main(argv) -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    tilings = [tuple(int(v) if v not in ("True", "False") else v == "True" for v in a.split(",")) for a in argv]
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    trl_head = spec._trl()
    for label, hidden, vocab in spec.SHAPES:
        sweep(label, hidden, vocab, trl_head, tilings or TILINGS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
