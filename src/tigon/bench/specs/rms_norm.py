"""RMSNorm and add_rms_norm: Llama-style casting at the table's hidden sizes and a sweep to 65536; the
pre-norm join (add_rms_norm of a bf16 output into the fp32 stream) and the sandwich-norm join
(sandwich_norm_join) as Llama and Gemma-2 run them under autocast."""

from __future__ import annotations

import torch

from tigon.bench.models import MODELS, TOKENS
from tigon.bench.spec import Case, Spec
from tigon.ops.norm_joins import (
    CONFIG as POST_NORM_JOIN_CONFIG,
)
from tigon.ops.norm_joins import (
    post_norm_join,
    post_norm_join_reference,
    sandwich_norm_join,
    sandwich_norm_join_reference,
)
from tigon.ops.rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference

SWEEP = (1024, 2048, 8192, 16384, 32768, 65536)


def _bytes(rows, hidden, elem, *, residual=False):
    tensor, vector = rows * hidden * elem, hidden * elem
    ins = 2 if residual else 1  # forward reads x (and residual), writes y (and s)
    fwd = ins * tensor + vector + ins * tensor + 4 * rows
    # backward reads dy (and ds), x or s, w, rstd; writes dx, dw
    bwd = (ins + 1) * tensor + vector + 4 * rows + tensor + vector
    return {"fwd": fwd, "bwd": bwd, "full": fwd + bwd}


def _shapes():
    shapes = [(m.name, TOKENS, m.hidden) for m in MODELS]
    shapes += [(f"sweep N={n}", TOKENS * 4096 // n, n) for n in SWEEP]
    seen, out = set(), []
    for label, rows, hidden in shapes:
        if (rows, hidden) not in seen:
            seen.add((rows, hidden))
            out.append((label, rows, hidden))
    return out


def _cases(residual=False):
    cases = []
    for label, rows, hidden in _shapes():

        def make(device, dtype, rows=rows, hidden=hidden):
            inputs = {
                "x": torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True),
                "weight": torch.randn(hidden, device=device, dtype=dtype, requires_grad=True),
            }
            if residual:
                inputs["residual"] = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
            return inputs

        cases.append(
            Case(
                f"{label} M={rows} N={hidden}", {"M": rows, "N": hidden}, make,
                _bytes(rows, hidden, 2, residual=residual),
            )
        )
    return cases


def _check_case(residual=False):
    def make(device, dtype):
        inputs = {
            "x": torch.randn(3, 5, 200, device=device, dtype=dtype, requires_grad=True),
            "weight": torch.randn(200, device=device, dtype=dtype, requires_grad=True),
        }
        if residual:
            inputs["residual"] = torch.randn(3, 5, 200, device=device, dtype=dtype, requires_grad=True)
        return inputs

    return Case("check B=3 T=5 N=200", {"M": 15, "N": 200}, make, _bytes(15, 200, 4, residual=residual))


def _liger(name):
    """Liger-Kernel's functional form, with its defaults (what its users get), or None."""
    try:
        from liger_kernel.transformers import functional
    except ImportError:
        return None
    fn = getattr(functional, name)
    if name == "liger_rms_norm":
        return lambda x, weight: fn(x, weight, 1e-6)
    return lambda x, residual, weight: fn(x, residual, weight, 1e-6)


RMS_NORM = Spec(
    name="rms_norm",
    cases=_cases,
    providers={
        "eager": lambda x, weight: rms_norm_reference(x, weight),
        "tigon": lambda x, weight: rms_norm(x, weight),
    },
    peers={"liger": lambda: _liger("liger_rms_norm")},
    check_case=_check_case,
)

ADD_RMS_NORM = Spec(
    name="add_rms_norm",
    cases=lambda: _cases(residual=True),
    providers={
        "eager": lambda x, residual, weight: add_rms_norm_reference(x, residual, weight),
        "tigon": lambda x, residual, weight: add_rms_norm(x, residual, weight),
    },
    peers={"liger": lambda: _liger("liger_fused_add_rms_norm")},
    check_case=lambda: _check_case(residual=True),
)


def _join_cases(with_next=True):
    """Gemma-2 under bf16 autocast: a bf16 sublayer output joins the fp32 residual stream (fp32 norm
    weights), and the next norm's output is the bf16 copy the projections read. The table's hidden
    sizes, Gemma-2-2B's 2304 and the fused limit. Without the next norm (post_norm_join), no y and no
    next_weight."""
    # forward: read x (2 B) and residual (4); write s (4), y (2). backward: read dy (2), ds (4),
    # s (4), x (2); write dx (2), dresidual (4). Without the next norm: forward 10; backward reads
    # ds and x and writes dx (8; residual's gradient is ds itself). Weights and rstd are noise.
    return _autocast_join_cases(
        sorted({m.hidden for m in MODELS} | {2304, POST_NORM_JOIN_CONFIG.max_fused_hidden}),
        (12, 18) if with_next else (10, 8),
        ("weight", "next_weight") if with_next else ("weight",), weight_offset=0.0,
    )


def _autocast_join_cases(hiddens, bytes_per_element, weights, *, weight_offset):
    """TOKENS rows of bf16 x (the autocast dtype) and an fp32 residual, and fp32 norm weights
    ``weight_offset + 0.1·N(0, 1)``; SOL from the (forward, backward) bytes an element."""
    fwd, bwd = bytes_per_element
    cases = []
    for hidden in hiddens:
        rows = TOKENS

        def make(device, dtype, rows=rows, hidden=hidden):
            inputs = {
                "x": torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True),
                "residual": torch.randn(rows, hidden, device=device, dtype=torch.float32, requires_grad=True),
            }
            for name in weights:
                inputs[name] = (weight_offset + 0.1 * torch.randn(hidden, device=device)).requires_grad_()
            return inputs

        tensor = rows * hidden
        sol = {"fwd": fwd * tensor, "bwd": bwd * tensor, "full": (fwd + bwd) * tensor}
        cases.append(Case(f"M={rows} N={hidden}", {"M": rows, "N": hidden}, make, sol))
    return cases


def _join(fn):
    def run(x, residual, weight, next_weight):
        return fn(x, residual, weight, next_weight, casting="gemma", offset=1.0, out_dtype=x.dtype)

    return run


def _post_join(fn):
    def run(x, residual, weight):
        return fn(x, residual, weight, casting="gemma", offset=1.0)

    return run


def _join_check_case(with_next=True):
    def make(device, dtype):
        inputs = {
            "x": torch.randn(3, 5, 200, device=device, dtype=dtype, requires_grad=True),
            "residual": torch.randn(3, 5, 200, device=device, dtype=dtype, requires_grad=True),
            "weight": torch.randn(200, device=device, dtype=dtype, requires_grad=True),
        }
        if with_next:
            inputs["next_weight"] = torch.randn(200, device=device, dtype=dtype, requires_grad=True)
        return inputs

    return Case("check B=3 T=5 N=200", {"M": 15, "N": 200}, make, {"fwd": 0, "bwd": 0, "full": 0})


SANDWICH_NORM_JOIN = Spec(
    name="sandwich_norm_join",
    cases=_join_cases,
    providers={
        # transformers' lines: residual + post_norm(x), then pre_norm of the sum, cast for the MLP
        "eager": _join(sandwich_norm_join_reference),
        "tigon": _join(sandwich_norm_join),
    },
    check_case=_join_check_case,
)

POST_NORM_JOIN = Spec(
    name="post_norm_join",
    cases=lambda: _join_cases(with_next=False),
    providers={
        # transformers' line: residual + post_norm(x)
        "eager": _post_join(post_norm_join_reference),
        "tigon": _post_join(post_norm_join),
    },
    check_case=lambda: _join_check_case(with_next=False),
)


def _pre_join_cases():
    """A pre-norm layer (Llama, Qwen) under bf16 autocast: the attention's bf16 output joins the fp32
    residual stream, and the MLP's pre-norm (fp32 weight) gives the bf16 copy its projections read.
    The table's hidden sizes."""
    # forward: read x (2 B) and residual (4); write s (4), y (2). backward: read dy (2), ds (4),
    # s (4); write dx (2), dresidual (4). The weight and rstd are noise.
    return _autocast_join_cases(sorted({m.hidden for m in MODELS}), (12, 16), ("weight",), weight_offset=1.0)


def _pre_join_check_case():
    def make(device, dtype):
        return {
            "x": torch.randn(3, 5, 200, device=device, dtype=dtype, requires_grad=True),
            "residual": torch.randn(3, 5, 200, device=device, dtype=torch.float32, requires_grad=True),
            "weight": torch.randn(200, device=device, requires_grad=True),
        }

    return Case("check B=3 T=5 N=200", {"M": 15, "N": 200}, make, {"fwd": 0, "bwd": 0, "full": 0})


ADD_RMS_NORM_AUTOCAST = Spec(
    name="add_rms_norm_autocast",
    cases=_pre_join_cases,
    providers={
        # transformers' lines: residual + attention output, then the fp32 norm, cast by the MLP's linears
        "eager": lambda x, residual, weight: _cast_y(add_rms_norm_reference(x, residual, weight), x.dtype),
        "tigon": lambda x, residual, weight: add_rms_norm(x, residual, weight, out_dtype=x.dtype),
    },
    check_case=_pre_join_check_case,
)


def _cast_y(outputs, dtype):
    y, s = outputs
    return y.to(dtype), s


SPECS = (RMS_NORM, ADD_RMS_NORM, SANDWICH_NORM_JOIN, POST_NORM_JOIN, ADD_RMS_NORM_AUTOCAST)
