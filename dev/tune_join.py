"""The sandwich-norm join (tigon.ops.sandwich_norm_join / post_norm_join) on the GPU: the fused op at
several backward warp settings (BWD_ELEMENTS_PER_WARP), the same math as tigon's rms_norm + add +
rms_norm, torch.compile of the eager reference and eager itself, at Gemma-2-2B's and -9B's hidden sizes
with bf16 x, an fp32 residual stream and fp32 weights (autocast training).

    python3 dev/tune_join.py

Times are medians of 50 forward+backward steps between CUDA events, host launch cost included (the
harness, ``tigon bench sandwich_norm_join``, gives the GPU times). "post": the second join of a
layer (post_norm_join, no norm after it).
"""

import importlib

import torch

from tigon.ops import rms_norm

J = importlib.import_module("tigon.ops.post_norm_join")  # the attribute is the function


def chain(x, r, w, w2):
    s = r + rms_norm(x, w, casting="gemma", offset=1.0)
    return rms_norm(s, w2, casting="gemma", offset=1.0, out_dtype=torch.bfloat16), s


def fused(x, r, w, w2):
    return J.sandwich_norm_join(x, r, w, w2, casting="gemma", offset=1.0, out_dtype=torch.bfloat16)


def ref(x, r, w, w2):
    return J.sandwich_norm_join_reference(x, r, w, w2, casting="gemma", offset=1.0, out_dtype=torch.bfloat16)


def post(x, r, w, w2):
    return None, J.post_norm_join(x, r, w, casting="gemma", offset=1.0)


def post_chain(x, r, w, w2):
    return None, r + rms_norm(x, w, casting="gemma", offset=1.0)


def bench(fn, rows, hidden, reps=50):
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(rows, hidden, device="cuda", requires_grad=True)
    w = (0.1 * torch.randn(hidden, device="cuda")).requires_grad_()
    w2 = (0.1 * torch.randn(hidden, device="cuda")).requires_grad_()
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    ds = torch.randn(rows, hidden, device="cuda")

    def step():
        y, s = fn(x, r, w, w2)
        outs = [s] + ([y] if y is not None else [])
        grads = [ds] + ([dy] if y is not None else [])
        torch.autograd.backward(outs, grads)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


compiled = torch.compile(ref, dynamic=False)
for rows, hidden in ((4096, 2304), (16384, 2304), (16384, 3584)):
    elems = rows * hidden
    sol_ms = 30 * elems / 3.0e12 * 1e3
    line = [f"{rows}x{hidden} SOL~{sol_ms:.3f}"]
    for epw in (256, 512, 1024):
        J.BWD_ELEMENTS_PER_WARP = epw
        line.append(f"fused(epw={epw}) {bench(fused, rows, hidden):.3f}")
    J.BWD_ELEMENTS_PER_WARP = 512
    line.append(f"chain {bench(chain, rows, hidden):.3f}")
    line.append(f"compile {bench(compiled, rows, hidden):.3f}")
    line.append(f"eager {bench(ref, rows, hidden):.3f}")
    line.append(f"| post fused {bench(post, rows, hidden):.3f} chain {bench(post_chain, rows, hidden):.3f}")
    print(" ; ".join(line), flush=True)
