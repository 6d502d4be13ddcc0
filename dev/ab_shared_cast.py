"""A/B of the attention projections' shared casts (src/tigon/patching/shared_cast.py) in the e2e step.

    PYTHONPATH=src:. python3 dev/ab_shared_cast.py MODEL VARIANT     # one process per run
    for m in qwen2 llama gemma2; do for v in stock tigon noshared; do ...; done; done

VARIANT: stock (unpatched), tigon (tigon.patch), noshared (tigon.patch, then q/k/v/o's instance
forwards taken off again: the stock nn.Linear under autocast). Prints tokens/s (median of 8 steps
after 3) and activation memory (peak - 16 B x parameters), with e2e's model, optimizer, batch and
step. An experiment kept out of the package (STYLE: llm.c habit); its results are quoted in
benchmarks/results/README.md.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from benchmarks.e2e import LR, OPTIMIZER_BYTES_PER_PARAM, SEED, batch_for, model_spec

import tigon
from tigon.bench.models import build_model, parameter_count
from tigon.nn.shared_cast_linear import CACHE_ATTR
from tigon.patching.parts.attention import OUTPUT_PROJECTION, QKV_PROJECTIONS

WARMUP, STEPS, SEQ = 3, 8, 2048


def unshare(model) -> None:
    """Take the shared-cast forwards off q/k/v/o again (the class's nn.Linear.forward runs)."""
    for module in model.modules():
        for name in (*QKV_PROJECTIONS, OUTPUT_PROJECTION):
            projection = module._modules.get(name)
            if projection is not None and "forward" in vars(projection):
                del projection.forward
                vars(projection).pop(CACHE_ATTR, None)


def main(model_type: str, variant: str) -> None:
    spec = model_spec(model_type)
    torch.manual_seed(SEED)
    model = build_model(spec.config, device="cuda")
    params = parameter_count(model)
    if variant != "stock":
        tigon.patch(model)
    if variant == "noshared":
        unshare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    batch = batch_for(model_type, None)
    ids = torch.randint(spec.config.vocab_size, (batch, SEQ), device="cuda")

    def step() -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(STEPS):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    activation = (torch.cuda.max_memory_allocated() - OPTIMIZER_BYTES_PER_PARAM * params) / 2**30
    print(f"{model_type:7} {variant:9} {batch * SEQ / median / 1e3:6.1f}k tok/s  step {median * 1e3:6.1f} ms  "
          f"act {activation:5.2f} GiB")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
