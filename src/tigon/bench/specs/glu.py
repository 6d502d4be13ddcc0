"""SwiGLU and GeGLU (tanh) on [tokens, intermediate]: the issue's anchor 16384 × 14336 (Llama-3-8B)
and the model table's intermediate sizes.

Speed of light: forward reads gate, up and writes h (3 tensors); backward reads dh, gate, up and
writes dgate, dup (5 tensors).
"""

from __future__ import annotations

import torch

from tigon.bench.models import MODELS, TOKENS
from tigon.bench.spec import Case, Spec
from tigon.ops.glu import geglu, glu_reference, swiglu


def _bytes(rows, cols, elem):
    tensor = rows * cols * elem
    return {"fwd": 3 * tensor, "bwd": 5 * tensor, "full": 8 * tensor}


def _make(rows, cols):
    def make(device, dtype):
        return {
            "gate": torch.randn(rows, cols, device=device, dtype=dtype, requires_grad=True),
            "up": torch.randn(rows, cols, device=device, dtype=dtype, requires_grad=True),
        }

    return make


def _cases():
    cases, seen = [], set()
    for m in MODELS:
        if m.intermediate in seen:
            continue
        seen.add(m.intermediate)
        label = f"{m.name} M={TOKENS} I={m.intermediate}"
        cases.append(Case(label, {"M": TOKENS, "I": m.intermediate}, _make(TOKENS, m.intermediate),
                          _bytes(TOKENS, m.intermediate, 2)))
    return cases


def _check_case():
    return Case("check M=15 I=300", {"M": 15, "I": 300}, _make(15, 300), _bytes(15, 300, 4))


def _liger(name):
    """Liger-Kernel's functional form (positional ``(a, b)``: gate, up), or None."""
    try:
        from liger_kernel.transformers import functional
    except ImportError:
        return None
    fn = getattr(functional, name)
    return lambda gate, up: fn(gate, up)


SWIGLU = Spec(
    name="swiglu",
    cases=_cases,
    providers={
        "eager": lambda gate, up: glu_reference(gate, up, "silu"),
        "tigon": lambda gate, up: swiglu(gate, up),
    },
    peers={"liger": lambda: _liger("liger_swiglu")},
    check_case=_check_case,
)

GEGLU = Spec(
    name="geglu",
    cases=_cases,
    providers={
        "eager": lambda gate, up: glu_reference(gate, up, "gelu_tanh"),
        "tigon": lambda gate, up: geglu(gate, up, approximate="tanh"),
    },
    peers={"liger": lambda: _liger("liger_geglu")},  # tanh GELU, as Gemma uses
    check_case=_check_case,
)

SPECS = (SWIGLU, GEGLU)
