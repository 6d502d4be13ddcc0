"""How far a family's fp32 AdamW run drifts from stock when only one part is patched (GPU or CPU).

    PYTHONPATH=src python3 dev/family_drift.py glm4_moe gpt_oss llama

For each family: the per-step relative loss difference from stock over 10 AdamW steps (lr 1e-2, the
tests' tiny models, tests/patching/tiny.py), with every switch on, and with one switch alone. A
part that changes no math but only which matmul kernels run (the fused linear cross-entropy's class
chunks) shows how much the run amplifies rounding-level differences on its own.
"""

from __future__ import annotations

import copy
import os
import sys

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from tests.helpers import DEVICE  # noqa: E402
from tests.patching.tiny import tiny_model, train  # noqa: E402

import tigon  # noqa: E402

SWITCHES = ("rope", "rms_norm", "layer_norm", "mlp", "fused_linear_cross_entropy")
STEPS = 10


def drift(model_type: str, **switches) -> list[float]:
    torch.manual_seed(0)
    stock = tiny_model(model_type).to(DEVICE)
    patched = copy.deepcopy(stock)
    tigon.patch(patched, **switches)
    want, _ = train(stock, STEPS)
    got, _ = train(patched, STEPS)
    return [abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)]


def main(model_types):
    for model_type in model_types:
        rows = {"all": {}}
        for name in SWITCHES:
            rows[f"{name} alone"] = {s: s == name for s in SWITCHES}
        for label, switches in rows.items():
            errors = drift(model_type, **switches)
            print(f"{model_type:12s} {label:36s} max {max(errors):.2e}  per step "
                  + " ".join(f"{e:.1e}" for e in errors), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["glm4_moe", "gpt_oss"])
