"""The MoE experts' gated activation on the packed gate/up projection (tigon.ops.moe_glu) against
transformers' eager ``_apply_gate`` and its torch.compile.

Cases: the routed rows of one MoE layer at 16384 tokens (S = tokens × top-k), at the experts' widths
of published MoE models: Qwen3-30B-A3B (top-8 of 128 experts, I=768), Mixtral-8x7B (top-2, I=14336),
both "halves" + silu; GPT-OSS-20B (top-4, I=2880), "interleaved" + its clamped swiglu.

Speed of light: forward reads gate_up (2·S·I) and writes h (S·I); backward reads dh (S·I) and gate_up
(2·S·I) and writes the packed gradient (2·S·I).
"""

from __future__ import annotations

import torch

from tigon.bench.models import TOKENS
from tigon.bench.spec import Case, Spec
from tigon.ops.moe_glu import CLAMPED_SWIGLU, moe_glu, moe_glu_reference

# (model, top-k, expert intermediate size)
HALVES_MODELS = (("Qwen3-30B-A3B", 8, 768), ("Mixtral-8x7B", 2, 14336))
INTERLEAVED_MODELS = (("GPT-OSS-20B", 4, 2880),)


def _bytes(rows, cols, elem):
    h = rows * cols * elem
    return {"fwd": 3 * h, "bwd": 5 * h, "full": 8 * h}


def _make(rows, cols):
    def make(device, dtype):
        # scale 4: GPT-OSS's clamps (limit 7) and the activations' tails are both exercised
        gate_up = torch.randn(rows, 2 * cols, device=device, dtype=torch.float32) * 4
        return {"gate_up": gate_up.to(dtype).requires_grad_()}

    return make


def _cases(models):
    def cases():
        return [
            Case(f"{name} S={TOKENS}x{top_k} I={cols}", {"S": TOKENS * top_k, "I": cols},
                 _make(TOKENS * top_k, cols), _bytes(TOKENS * top_k, cols, 2))
            for name, top_k, cols in models
        ]

    return cases


def _check_case():
    return Case("check S=15 I=300", {"S": 15, "I": 300}, _make(15, 300), _bytes(15, 300, 4))


MOE_SWIGLU = Spec(
    name="moe_swiglu",
    cases=_cases(HALVES_MODELS),
    providers={
        "eager": lambda gate_up: moe_glu_reference(gate_up, "halves", "silu"),
        "tigon": lambda gate_up: moe_glu(gate_up, layout="halves", activation="silu"),
    },
    check_case=_check_case,
)

MOE_GPT_OSS = Spec(
    name="moe_gpt_oss",
    cases=_cases(INTERLEAVED_MODELS),
    providers={
        "eager": lambda gate_up: moe_glu_reference(gate_up, "interleaved", CLAMPED_SWIGLU),
        "tigon": lambda gate_up: moe_glu(gate_up, layout="interleaved", activation=CLAMPED_SWIGLU),
    },
    check_case=_check_case,
)

SPECS = (MOE_SWIGLU, MOE_GPT_OSS)
