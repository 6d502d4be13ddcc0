"""Shared test helpers: tolerances, random inputs, layout twins, and the fp64 reference runner."""

from __future__ import annotations

import contextlib
import socket

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# ‖out − ref‖ / ‖ref‖ against an fp64 reference with the same intermediate roundings (API.md).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}
LOSS_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def randn(*shape, dtype=torch.float32, scale=1.0, requires_grad=False, device=DEVICE):
    """Normal random values (never zeros), made in fp32 then cast, so every dtype sees one draw."""
    t = (torch.randn(*shape, dtype=torch.float32, device=device) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """A twin of ``t`` with the same values whose last dim has stride 2 (and rows are padded)."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide.normal_()  # garbage in the gaps, so reading them would show
    twin = wide[..., ::2]
    with torch.no_grad():
        twin.copy_(t)
    assert not twin.is_contiguous()
    return twin.requires_grad_(t.requires_grad)


def stride0_like(t: torch.Tensor) -> torch.Tensor:
    """A random scalar expanded to ``t``'s shape: every stride 0, as ``out.sum()`` backward gives."""
    return torch.randn((), dtype=torch.float32, device=t.device).to(t.dtype).expand_as(t)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(out, ref, dtype, what="output", tolerance=None):
    """‖out − ref‖/‖ref‖ within the dtype's tolerance.

    The reference is first rounded to ``out.dtype``: an output can only hold representable values,
    and for tiny magnitudes (fp16 subnormals) that last rounding alone exceeds any tolerance.
    """
    tol = (tolerance or TOLERANCE)[dtype]
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out.detach()).all(), f"{what}: non-finite values"
    if out.dtype != ref.dtype and out.is_floating_point():
        ref = ref.detach().to(out.dtype)
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e} ({dtype})"


def fp64_reference(fn, tensors: dict, grad_output=None, **kwargs):
    """Run ``fn(**tensors, **kwargs)`` in fp64 and backpropagate ``grad_output``.

    Every floating tensor becomes an fp64 leaf that requires grad iff the original does. Returns the
    output (or tuple of outputs) and a dict of gradients by name. ``grad_output`` may be a tensor or a
    tuple matching the outputs; None for a scalar output means a gradient of 1.
    """
    leaves = {}
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            leaves[name] = t.detach().double().requires_grad_(t.requires_grad)
        else:
            leaves[name] = t
    out = fn(**leaves, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    grads_out = grad_output if isinstance(grad_output, tuple) else (grad_output,)
    pairs = [(o, g) for o, g in zip(outs, grads_out, strict=False) if o is not None and o.requires_grad]
    grads = {}
    if pairs:
        torch.autograd.backward(
            [o for o, _ in pairs],
            [torch.ones_like(o) if g is None else g.to(o.device, torch.float64).expand_as(o) for o, g in pairs],
        )
        grads = {n: t.grad for n, t in leaves.items() if isinstance(t, torch.Tensor) and t.grad is not None}
    return out, grads


def repeatable_grads(fn, inputs, grad_outputs):
    """Gradients of ``fn()`` w.r.t. ``inputs``, computed twice and asserted bitwise equal (reductions
    without atomics give the same result run to run); returns the first."""
    first = torch.autograd.grad(fn(), inputs, grad_outputs)
    second = torch.autograd.grad(fn(), inputs, grad_outputs)
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        assert_bitwise_equal(a, b, f"gradient {i}")
    return first


def assert_bitwise_equal(first: torch.Tensor, again: torch.Tensor, what: str) -> None:
    """``first`` and ``again`` (two runs of the same computation) equal bit for bit, NaN where both are NaN; a
    failure says where they differ (rows and columns of the last dimension) and by how much, so that a rare
    difference on a GPU run can be told apart: a whole slice of a row (one program's part), single elements, or
    values far outside the data's range (memory written by something else)."""
    assert first.shape == again.shape and first.dtype == again.dtype, f"{what}: {first.shape} {first.dtype} " \
        f"against {again.shape} {again.dtype}"
    differ = (first != again) & ~(first.isnan() & again.isnan())
    if not differ.any():
        return
    grid = differ.reshape(-1, differ.shape[-1]) if differ.dim() else differ.reshape(1, 1)
    rows, cols = grid.any(dim=1).nonzero().flatten().tolist(), grid.any(dim=0).nonzero().flatten().tolist()
    a, b = first[differ].double(), again[differ].double()
    raise AssertionError(
        f"{what} differs between two runs in {int(differ.sum())} of {differ.numel()} elements: rows {rows[:10]}"
        f"{' ...' if len(rows) > 10 else ''} ({len(rows)} of {grid.shape[0]}), columns {cols[0]}-{cols[-1]} "
        f"({len(cols)} of {grid.shape[1]}); largest |value| there {a.abs().max():.4g} in the first run, "
        f"{b.abs().max():.4g} in the second, largest |difference| {(a - b).abs().max():.4g}")


def node_names(t: torch.Tensor) -> set:
    """The class names of the autograd nodes that made ``t``, walking back from its ``grad_fn``."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo += [f for f, _ in fn.next_functions]
    return names


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for torchrun and process-group rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_group(backend: str):
    """torch.distributed initialised in this process as a group of one rank, destroyed after."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
