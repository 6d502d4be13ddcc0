"""LayerNorm with weight and bias: the RMSNorm spec's shapes (model table + hidden sweep)."""

from __future__ import annotations

import torch

from tigon.bench.spec import Case, Spec
from tigon.bench.specs.rms_norm import _shapes
from tigon.ops.layer_norm import layer_norm, layer_norm_reference

EPS = 1e-5


def _bytes(rows, hidden, elem):
    tensor, vector, stats = rows * hidden * elem, hidden * elem, 4 * rows
    # forward reads x, w, b; writes y, mean, rstd
    fwd = tensor + 2 * vector + tensor + 2 * stats
    # backward reads dy, x, w, mean, rstd; writes dx, dw, db
    bwd = 2 * tensor + vector + 2 * stats + tensor + 2 * vector
    return {"fwd": fwd, "bwd": bwd, "full": fwd + bwd}


def _make(rows, hidden):
    def make(device, dtype):
        return {
            "x": torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True),
            "weight": torch.randn(hidden, device=device, dtype=dtype, requires_grad=True),
            "bias": torch.randn(hidden, device=device, dtype=dtype, requires_grad=True),
        }

    return make


def _cases():
    return [
        Case(
            f"{label} M={rows} N={hidden}",
            {"M": rows, "N": hidden},
            _make(rows, hidden),
            _bytes(rows, hidden, 2),
        )
        for label, rows, hidden in _shapes()
    ]


def _check_case():
    return Case("check M=15 N=200", {"M": 15, "N": 200}, _make(15, 200), _bytes(15, 200, 4))


def _liger():
    """Liger-Kernel's functional form, or None."""
    try:
        from liger_kernel.transformers.functional import liger_layer_norm
    except ImportError:
        return None
    return lambda x, weight, bias: liger_layer_norm(x, weight, bias, EPS)


LAYER_NORM = Spec(
    name="layer_norm",
    cases=_cases,
    providers={
        "eager": lambda x, weight, bias: layer_norm_reference(x, weight, bias, EPS),
        "tigon": lambda x, weight, bias: layer_norm(x, weight, bias, EPS),
    },
    peers={"liger": _liger},
    check_case=_check_case,
)

SPECS = (LAYER_NORM,)
