"""The SwiGLU MLP module: tigon's recomputing node against transformers' LlamaMLP (its forward on the
same nn.Linear weights), LlamaMLP with tigon's fused activation, and LlamaMLP with Liger's.

Compute-bound (nine GEMMs of 2·M·H·I flops per step), so the cases report flops, not a speed of
light. Memory: the harness's peak covers a whole step; what the recomputation saves is what stays
allocated between forward and backward, which is what a deep model multiplies by its layer count.
Each case's params carry those saved bytes per token (x, plus the intermediate-sized tensors each
provider keeps: LlamaMLP 4, with a fused activation 3, tigon 2); :func:`saved_activation_bytes`
measures them on the GPU (tests/nn/test_mlp.py asserts tigon's are at least 40% below LlamaMLP's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tigon.bench.models import MODELS_BY_NAME, TOKENS
from tigon.bench.spec import Case, Spec
from tigon.nn.mlp import gated_mlp, gated_mlp_reference
from tigon.ops.glu import swiglu

# Intermediate-sized tensors each provider keeps for the backward (besides its input x). torch.compile's
# partitioner decides its own (it may recompute the activation); saved_activation_bytes measures it.
KEPT_INTERMEDIATES = {"eager": 4, "fused_act": 3, "liger": 3, "tigon": 2}
# The anchor (Llama-3-8B) and two smaller widths, where the activation's share of the time grows.
MODEL_NAMES = ("Llama-3-8B", "Llama-3.2-1B", "Qwen2.5-0.5B")


def _flops(rows, hidden, intermediate):
    gemm = 2 * rows * hidden * intermediate
    return {"fwd": 3 * gemm, "bwd": 6 * gemm, "full": 9 * gemm}


def _make(rows, hidden, intermediate):
    def make(device, dtype):
        def weight(out_features, in_features):
            w = torch.randn(out_features, in_features, device=device, dtype=dtype) * in_features**-0.5
            return w.requires_grad_()

        return {
            "x": torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True),
            "gate_weight": weight(intermediate, hidden),
            "up_weight": weight(intermediate, hidden),
            "down_weight": weight(hidden, intermediate),
        }

    return make


def _case(label, rows, hidden, intermediate, elem=2):
    saved = {p: (hidden + n * intermediate) * elem for p, n in KEPT_INTERMEDIATES.items()}
    params = {"M": rows, "H": hidden, "I": intermediate, "saved_bytes_per_token": saved}
    return Case(f"{label} M={rows} {hidden}->{intermediate}", params, _make(rows, hidden, intermediate), {},
                _flops(rows, hidden, intermediate))


def _cases():
    return [_case(name, TOKENS, MODELS_BY_NAME[name].hidden, MODELS_BY_NAME[name].intermediate)
            for name in MODEL_NAMES]


def _check_case():
    return _case("check", 6, 32, 72, elem=4)


def _llama_mlp_with(act_mul):
    """LlamaMLP's forward with ``act_mul(gate, up)`` in place of ``silu(gate) * up``."""

    def mlp(x, gate_weight, up_weight, down_weight):
        return F.linear(act_mul(F.linear(x, gate_weight), F.linear(x, up_weight)), down_weight)

    return mlp


def _liger():
    """LigerSwiGLUMLP's forward (LlamaMLP with Liger's SiLU-mul), or None."""
    try:
        from liger_kernel.transformers.functional import liger_swiglu
    except ImportError:
        return None
    return _llama_mlp_with(liger_swiglu)


def saved_activation_bytes(case: Case, providers: dict, *, dtype=torch.bfloat16) -> dict:
    """Bytes each provider keeps allocated from its forward for its backward (output excluded), GPU."""
    out = {}
    for name, fn in providers.items():
        inputs = case.make_inputs(torch.device("cuda"), dtype)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = fn(**inputs)
        out[name] = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
        del y, inputs
    return out


MLP = Spec(
    name="swiglu_mlp",
    cases=_cases,
    providers={
        "eager": lambda x, gate_weight, up_weight, down_weight: gated_mlp_reference(
            x, gate_weight, up_weight, down_weight, activation="silu"
        ),
        "fused_act": _llama_mlp_with(swiglu),
        "tigon": lambda x, gate_weight, up_weight, down_weight: gated_mlp(
            x, gate_weight, up_weight, down_weight, activation="silu"
        ),
    },
    peers={"liger": _liger},
    check_case=_check_case,
)

SPECS = (MLP,)
