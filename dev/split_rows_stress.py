"""Split rows under load: run the norms' split-row kernels (the programs of a row swap partial sums through
global memory, ``tigon._kernels.norm_rows.exchange_row_sums``) many times, in several processes at once, and
report every run whose result is not bitwise the first one's: which tensor, which rows, which columns (so which
slice), and how far off.

    python dev/split_rows_stress.py --procs 8 --seconds 90

Each process loops over the cases below (rms_norm, add_rms_norm and layer_norm with rows split in the backward,
at the test's width and at Llama-3.1-405B's 16384 with the shipped settings; rms_norm with rows split in the
forward) and compares each result with its own first one. A GPU only.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.helpers
from tests.helpers import assert_bitwise_equal  # noqa: E402


def cases():
    """(name, the config module, its backward overrides or None, its forward's or None, rows, hidden, the op)."""
    split_knobs = dict(split_max_hidden=1 << 20)
    return [
        ("rms_norm bwd split 4096", "tigon._kernels.norm_launch", dict(split_slice=4096, split_warps=8, **split_knobs),
         None, 2048, 5 * 4096 - 93, "rms_norm"),
        ("add_rms_norm bwd split 4096", "tigon._kernels.norm_launch",
         dict(split_slice=4096, split_warps=8, **split_knobs), None, 2048, 5 * 4096 - 93, "add_rms_norm"),
        ("add_rms_norm bwd split 8192", "tigon._kernels.norm_launch",
         dict(split_slice=8192, split_warps=16, **split_knobs), None, 2048, 5 * 4096 - 93, "add_rms_norm"),
        ("add_rms_norm 16384 shipped", "tigon._kernels.norm_launch", None, None, 4096, 16384, "add_rms_norm"),
        ("rms_norm 16384 shipped", "tigon._kernels.norm_launch", None, None, 4096, 16384, "rms_norm"),
        ("rms_norm fwd split 40000", "tigon._kernels.norm_launch", None, None, 512, 40000, "rms_norm"),
        ("layer_norm bwd split 4096", "tigon._kernels.norm_launch",  # LayerNorm splits rows by RMSNorm's settings
         dict(split_slice=4096, split_warps=8, **split_knobs), None, 2048, 5 * 4096 - 93, "layer_norm"),
    ]


def run_case(case, seed=0):
    import torch

    from tigon.ops import add_rms_norm, layer_norm, rms_norm

    name, module_name, backward, forward, rows, hidden, fn = case
    module = importlib.import_module(module_name)
    saved = module.CONFIG
    if backward is not None:
        module.CONFIG = dataclasses.replace(saved, backward=dataclasses.replace(saved.backward, **backward))
    if forward is not None:
        module.CONFIG = dataclasses.replace(module.CONFIG, forward=dataclasses.replace(saved.forward, **forward))
    try:
        g = torch.Generator(device="cuda").manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)

        x, w, dy = randn(rows, hidden).requires_grad_(), randn(hidden).requires_grad_(), randn(rows, hidden)
        if fn == "rms_norm":
            out, inputs, grads = rms_norm(x, w), (x, w), (dy,)
            outs = (out,)
        elif fn == "add_rms_norm":
            r, ds = randn(rows, hidden), randn(rows, hidden)
            outs, inputs, grads = add_rms_norm(x, r, w), (x, w), (dy, ds)
        else:
            b = randn(hidden).requires_grad_()
            outs, inputs, grads = (layer_norm(x, w, b),), (x, w, b), (dy,)
        got = torch.autograd.grad(outs, inputs, grads)
        return [o.detach() for o in outs] + list(got)
    finally:
        module.CONFIG = saved


def worker(index, seconds, queue):
    import torch

    torch.cuda.set_device(0)
    all_cases = cases()
    firsts = {case[0]: run_case(case) for case in all_cases}
    runs, found = 0, []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for case in all_cases:
            again = run_case(case)
            for i, (a, b) in enumerate(zip(firsts[case[0]], again, strict=True)):
                try:
                    assert_bitwise_equal(a, b, f"{case[0]}, tensor {i}")
                except AssertionError as difference:
                    if len(found) < 50:
                        found.append(str(difference))
            runs += 1
    torch.cuda.synchronize()
    queue.put({"process": index, "runs": runs, "mismatches": found})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=worker, args=(i, args.seconds, queue)) for i in range(args.procs)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    runs = sum(r["runs"] for r in results)
    mismatches = [m for r in results for m in r["mismatches"]]
    print(json.dumps({"processes": args.procs, "runs": runs, "mismatched": len(mismatches)}))
    for m in mismatches:
        print(m)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
