"""Second sweep: one program per row at more widths (incl. the old persistent path), then whole FLCE."""
import itertools, sys, torch
import tigon.ops
ce = sys.modules['tigon.ops.cross_entropy']; fl = sys.modules['tigon.ops.fused_linear_cross_entropy']
from tigon.ops.cross_entropy import RowLaunch, CHUNK_STATS, CHUNK_GRAD, REDUCTION_SCALES
from tigon.bench.specs.cross_entropy import _target
dev = "cuda"; H, V = 896, 151936
torch.manual_seed(0)
w = (torch.randn(V, H, device=dev) * H**-0.5).to(torch.bfloat16)
opts = (-100, 0.0, 0.0, None, 1.0)

def timed(pre, fn, reps=15):
    ts = []
    for _ in range(reps):
        pre()
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record()
        torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1000)
    ts.sort(); return ts[len(ts) // 2]

orig = ce._row_launch
for N, width in [(8192, 4096), (8192, 4352), (8192, 7936), (8192, 8192), (4096, 9216), (4096, 16384)]:
    x = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
    t = _target(N, V, dev)
    scales, _ = REDUCTION_SCALES(t, None, -100, "mean", V)
    buf = torch.empty(N, width, device=dev, dtype=torch.bfloat16)
    wc = w[:width]
    mm = lambda: torch.mm(x, wc.t(), out=buf)
    state = torch.zeros(4, N, device=dev); state[0] = -1e4; state[1] = 1.0
    loss_rows = torch.empty(N, device=dev); lse = torch.empty(N, device=dev)
    mm(); lse.copy_(torch.logsumexp(buf.float(), 1) + 5.0)
    st = lambda: CHUNK_STATS(buf, t, None, scales, state, loss_rows, lse, 0, V, False, *opts)
    gr = lambda: CHUNK_GRAD(buf, t, None, scales, None, lse, 0, V, *opts)
    res = []
    old = ce.CHUNK_ROW_MAX_WIDTH
    ce.CHUNK_ROW_MAX_WIDTH = 0
    res.append((timed(mm, st), timed(mm, gr), "old persistent"))
    ce.CHUNK_ROW_MAX_WIDTH = old
    for bv, warps, pf in itertools.product([512, 1024, 2048, 4096], [1, 2, 4, 8], [1, 2]):
        vpt = bv // (32 * warps)
        if vpt < 4 or vpt > 32 or (pf == 2 and bv >= width):
            continue
        cfg = RowLaunch(bv, warps, False, N, pf, 1)
        ce._row_launch = lambda *a, cfg=cfg: cfg
        res.append((timed(mm, st), timed(mm, gr), f"bv={bv} w={warps} pf={pf}"))
        ce._row_launch = orig
    hbm = N * width * 2 / 3.0e6
    print(f"N={N} width={width} (HBM read {hbm:.1f} us, read+write {2*hbm:.1f}); {res[0][2]}: {res[0][0]:.1f} + {res[0][1]:.1f} us")
    res.sort(key=lambda r: r[0] + r[1])
    print("   ", "; ".join(f"{r[0]:.1f}+{r[1]:.1f} {r[2]}" for r in res[:8]), flush=True)
    del buf

def flce(N, plan=None):
    x = torch.randn(N, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    wg = w.clone().requires_grad_()
    t = _target(N, V, dev)
    saved = fl.chunk_plan
    if plan: fl.chunk_plan = lambda *a, **k: plan
    def step():
        fl.fused_linear_cross_entropy(x, wg, t).backward(); x.grad = None; wg.grad = None
    step(); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(); torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated() - base
    ts = []
    for _ in range(5):
        torch.cuda._sleep(30_000_000)
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); step(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    fl.chunk_plan = saved
    ts.sort(); grads = (N + V) * H * 2
    used = plan or fl.chunk_plan(N, V, H, 2)
    print(f"FLCE N={N} {used}: {ts[2]:.3f} ms, peak {peak / grads:.3f} x grads", flush=True)
for N in (8192, 4096):
    flce(N)
flce(8192, fl.ChunkPlan(False, 4096))
flce(8192, fl.ChunkPlan(False, 6144))
flce(4096, fl.ChunkPlan(False, 8192))
