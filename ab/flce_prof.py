import os, sys, torch, time
from collections import defaultdict
from tigon.ops.fused_linear_cross_entropy import fused_linear_cross_entropy, chunk_plan
from tigon.bench.specs.cross_entropy import _target
dev = "cuda"

def gpu_ms(fn, reps=5):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        torch.cuda._sleep(20_000_000)
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts)//2]

def profile(fn, label):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        torch.cuda._sleep(20_000_000)
        fn(); torch.cuda.synchronize()
    agg = defaultdict(lambda: [0.0, 0])
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and 'sleep' not in e.name:
            agg[e.name][0] += e.device_time_total / 1000; agg[e.name][1] += 1
    tot = sum(v[0] for v in agg.values())
    print(f"--- {label}: kernels sum {tot:.2f} ms")
    for k, (ms, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {ms:8.3f} ms {n:5d}x  {k[:110]}")

for label, N, H, V, cap in [("qwen", 8192, 896, 151936, None), ("gemma", 8192, 2304, 256000, 30.0), ("llama", 8192, 4096, 128256, None)]:
    torch.manual_seed(0)
    w = (torch.randn(V, H, device=dev) * H**-0.5).to(torch.bfloat16).requires_grad_()
    x = torch.randn(N, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    t = _target(N, V, dev)
    print(label, chunk_plan(N, V, H, 2))
    def step():
        loss = fused_linear_cross_entropy(x, w, t, softcap=cap)
        loss.backward()
        x.grad = None; w.grad = None
    print(f"{label} fwd+bwd {gpu_ms(step):.3f} ms")
    profile(step, label)
    del w, x

def tf(flop, ms): return flop / ms / 1e9
print("=== matmul microbench, whole pass over V, H=896 N=8192 V=151936")
N, H, V = 8192, 896, 151936
x = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
w = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.03
fl = 2 * N * H * V
for Vc in [1024, 2560, 5120, 10240]:
    buf = torch.empty(N * Vc, device=dev, dtype=torch.bfloat16)
    dx32 = torch.zeros(N, H, device=dev, dtype=torch.float32)
    dw = torch.empty(V, H, device=dev, dtype=torch.bfloat16)
    chunks = [(c, min(V, c + Vc)) for c in range(0, V, Vc)]
    def logits():
        for c0, c1 in chunks: torch.mm(x, w[c0:c1].t(), out=buf[: N * (c1 - c0)].view(N, c1 - c0))
    def dwmm():
        for c0, c1 in chunks: torch.mm(buf[: N * (c1 - c0)].view(N, c1 - c0).t(), x, out=dw[c0:c1])
    def dxmm():
        for c0, c1 in chunks: torch.addmm(dx32, buf[: N * (c1 - c0)].view(N, c1 - c0), w[c0:c1], beta=1.0, out_dtype=torch.float32, out=dx32)
    r = [gpu_ms(f) for f in (logits, dwmm, dxmm)]
    print(f"Vc={Vc}: logits {r[0]:.3f} ms ({tf(fl,r[0]):.0f} TF/s)  dW {r[1]:.3f} ({tf(fl,r[1]):.0f})  dX32 {r[2]:.3f} ({tf(fl,r[2]):.0f})")
    del buf
print("=== by tokens, H=2304 V=256000 N=8192")
N, H, V = 8192, 2304, 256000
x = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
w = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.03
fl = 2 * N * H * V
for C in [704, 1024, 2048, 4096]:
    buf = torch.randn(C, V, device=dev, dtype=torch.bfloat16)
    dx = torch.empty(N, H, device=dev, dtype=torch.bfloat16)
    dw = torch.zeros(V, H, device=dev, dtype=torch.bfloat16)
    chunks = [(c, min(N, c + C)) for c in range(0, N, C)]
    def logits():
        for c0, c1 in chunks: torch.mm(x[c0:c1], w.t(), out=buf[: c1 - c0])
    def dxmm():
        for c0, c1 in chunks: torch.mm(buf[: c1 - c0], w, out=dx[c0:c1])
    def dwmm():
        for c0, c1 in chunks: dw.addmm_(buf[: c1 - c0].t(), x[c0:c1], beta=1.0)
    r = [gpu_ms(f) for f in (logits, dxmm, dwmm)]
    print(f"C={C}: logits {r[0]:.3f} ms ({tf(fl,r[0]):.0f} TF/s)  dX {r[1]:.3f} ({tf(fl,r[1]):.0f})  dW+= {r[2]:.3f} ({tf(fl,r[2]):.0f})")
    del buf
