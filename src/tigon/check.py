"""``tigon check``: every op against its reference on whatever device is present.

Runs each benchmark spec's small ``check_case`` in float32, ``tigon`` against ``eager``, comparing
the outputs and every input gradient by ‖tigon − eager‖ / ‖eager‖. On a machine without CUDA the
kernels run on CPU tensors through Triton's interpreter: the caller must have set
``TRITON_INTERPRET=1`` before anything imported ``tigon.ops`` (the CLI does).
"""

from __future__ import annotations

import time

import torch

TOLERANCE = 1e-4  # float32, as API.md's precision rule


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_spec(spec, device: torch.device) -> tuple[float, str]:
    """Largest relative error over outputs and gradients, and what it was measured on."""
    case = spec.check_case()
    worst, where = 0.0, "output"
    results = {}
    for provider in ("eager", "tigon"):
        torch.manual_seed(0)
        inputs = case.make_inputs(device, torch.float32)
        out = spec.providers[provider](**inputs)
        outs = out if isinstance(out, tuple) else (out,)
        diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        if spec.grad_outputs is not None:
            diff = [outs[i] for i in spec.grad_outputs]
        torch.manual_seed(1)
        grads_out = [torch.randn_like(o) for o in diff]
        leaves = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.requires_grad}
        grads = torch.autograd.grad(diff, list(leaves.values()), grads_out, allow_unused=True) if diff else ()
        results[provider] = (outs, dict(zip(leaves, grads, strict=False)))
    (ref_outs, ref_grads), (outs, grads) = results["eager"], results["tigon"]
    for i, (o, r) in enumerate(zip(outs, ref_outs, strict=True)):
        if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor):
            err = _rel(o, r)
            if not err <= worst:  # NaN propagates as the worst
                worst, where = err, f"output {i}"
    for name, r in ref_grads.items():
        g = grads.get(name)
        if r is None and g is None:
            continue
        if r is None or g is None:
            return float("inf"), f"d{name} missing"
        err = _rel(g, r)
        if not err <= worst:
            worst, where = err, f"d{name}"
    return worst, where


def run_checks(names=None, *, log=print) -> bool:
    from tigon._interpreter import interpreter_active
    from tigon.bench.specs import load_specs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mode = "Triton interpreter on CPU" if interpreter_active() and device.type == "cpu" else str(device)
    log(f"tigon check on {mode}: each op in float32 against its PyTorch reference (tolerance {TOLERANCE:g})")
    ok = True
    for spec in load_specs(names).values():
        if spec.check_case is None:
            continue
        start = time.perf_counter()
        try:
            err, where = check_spec(spec, device)
            passed = err <= TOLERANCE
            detail = f"max rel err {err:.2e} ({where})"
        except Exception as exc:  # report every op, then fail at the end
            passed, detail = False, f"{type(exc).__name__}: {exc}"
        ok &= passed
        log(f"{'ok  ' if passed else 'FAIL'} {spec.name:<28} {detail}  [{time.perf_counter() - start:.1f} s]")
    log("all ops match their references" if ok else "MISMATCH: see the FAIL lines above")
    return ok
