"""Sweep the vocabulary-chunk CE kernels' geometry at N=8192 (FLCE by classes), then whole FLCE."""
import itertools, torch
import sys
import tigon.ops
ce = sys.modules['tigon.ops.cross_entropy']
fl = sys.modules['tigon.ops.fused_linear_cross_entropy']
from tigon.ops.cross_entropy import RowLaunch, CHUNK_STATS, CHUNK_GRAD, REDUCTION_SCALES
from tigon.ops._common import persistent_programs
from tigon.bench.specs.cross_entropy import _target
dev = "cuda"; N, H, V = 8192, 896, 151936
sms = persistent_programs(torch.device(dev), 1)
orig = ce._row_launch
torch.manual_seed(0)
x = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
w = (torch.randn(V, H, device=dev) * H**-0.5).to(torch.bfloat16)
t = _target(N, V, dev)
scales, _ = REDUCTION_SCALES(t, None, -100, "mean", V)
opts = (-100, 0.0, 0.0, None, 1.0)

def timed(pre, fn, reps=15):
    ts = []
    for _ in range(reps):
        pre()
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record()
        torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1000)
    ts.sort(); return ts[len(ts) // 2]

def cfgs(width):
    out = []
    for bv, warps, pps, pf in itertools.product([1024, 2048, 4096], [4, 8, 16], [2, 4, 8, 0], [1, 2]):
        if bv > triton_next(width) or (pf == 2 and bv >= width) or bv // (32 * warps) < 4 or bv // (32 * warps) > 32:
            continue
        progs = N if pps == 0 else pps * sms
        out.append((bv, warps, pps, pf, RowLaunch(bv, warps, False, progs, pf, 1)))
    return out

def triton_next(n):
    p = 1
    while p < n: p *= 2
    return p

best = {}
for width in [2560, 3072, 4096]:
    buf = torch.empty(N, width, device=dev, dtype=torch.bfloat16)
    wc = w[:width]
    mm = lambda: torch.mm(x, wc.t(), out=buf)
    state = torch.zeros(4, N, device=dev); state[0] = -1e4; state[1] = 1.0
    loss_rows = torch.empty(N, device=dev); lse = torch.empty(N, device=dev)
    mm(); lse.copy_(torch.logsumexp(buf.float(), 1) + 5.0)
    res = []
    ce._row_launch = orig
    base_s = timed(mm, lambda: CHUNK_STATS(buf, t, None, scales, state, loss_rows, lse, 0, V, False, *opts))
    base_g = timed(mm, lambda: CHUNK_GRAD(buf, t, None, scales, None, lse, 0, V, *opts))
    print(f"width {width}: shipped stats {base_s:.1f} us  grad {base_g:.1f} us  (HBM read {N*width*2/3.0e6:.1f} us)", flush=True)
    for bv, warps, pps, pf, cfg in cfgs(width):
        ce._row_launch = lambda *a, cfg=cfg: cfg
        try:
            s_us = timed(mm, lambda: CHUNK_STATS(buf, t, None, scales, state, loss_rows, lse, 0, V, False, *opts))
            g_us = timed(mm, lambda: CHUNK_GRAD(buf, t, None, scales, None, lse, 0, V, *opts))
        except Exception as e:
            print("  fail", bv, warps, pps, pf, type(e).__name__, str(e)[:100]); continue
        res.append((s_us, g_us, bv, warps, pps, pf))
    for key, name in ((0, "stats"), (1, "grad")):
        res.sort(key=lambda r: r[key])
        print(f"  best {name}:", "; ".join(f"{r[key]:.1f}us bv={r[2]} w={r[3]} pps={r[4]} pf={r[5]}" for r in res[:6]), flush=True)
    res.sort(key=lambda r: r[0] + r[1])
    print("  best sum:", "; ".join(f"{r[0]:.1f}+{r[1]:.1f} bv={r[2]} w={r[3]} pps={r[4]} pf={r[5]}" for r in res[:6]), flush=True)
    best[width] = res[0]
    del buf

# whole FLCE with each width's best setting, at several class-chunk widths
ce._row_launch = orig
xg = x.clone().requires_grad_(); wg = w.clone().requires_grad_()
def flce_ms():
    def step():
        fl.fused_linear_cross_entropy(xg, wg, t).backward(); xg.grad = None; wg.grad = None
    step(); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(); torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated() - base
    ts = []
    for _ in range(5):
        torch.cuda._sleep(30_000_000)
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); step(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[2], peak
grads = N * H * 2 + V * H * 2
print(f"shipped FLCE: %.3f ms, peak %.3f x grads" % ((r := flce_ms())[0], r[1] / grads))
for width, (s_us, g_us, bv, warps, pps, pf) in best.items():
    cfg = RowLaunch(bv, warps, False, N if pps == 0 else pps * sms, pf, 1)
    ce._row_launch = lambda *a, cfg=cfg: cfg
    fl.chunk_plan = lambda *a, width=width, **k: fl.ChunkPlan(False, width)
    ms, peak = flce_ms()
    print(f"FLCE class chunk {width}, bv={bv} w={warps} pps={pps} pf={pf}: {ms:.3f} ms, peak {peak/grads:.3f} x grads", flush=True)
