"""RoPE: the issue's anchor (Llama-3-8B heads, q/k contiguous [B, H, T, D]) and the model table in
the layout a model really hands over (the transpose of a [B, T, H, D] projection).

Speed of light, as issue 4 counts it: q and k read and written once forward and once backward;
cos/sin (B·T·D each, 1/(Hq + Hk) of that per head) are left out.
"""

from __future__ import annotations

import torch

from tigon.bench.models import MODELS, TOKENS
from tigon.bench.spec import Case, Spec
from tigon.ops.rope import rope, rope_reference

BATCH = 8
SEQ_LEN = TOKENS // BATCH
ROPE_THETA = 500000.0


def _bytes(batch, seq_len, q_heads, k_heads, head_dim, elem):
    moved = 2 * batch * seq_len * (q_heads + k_heads) * head_dim * elem  # read + write q and k
    return {"fwd": moved, "bwd": moved, "full": 2 * moved}


def _cos_sin(batch, seq_len, head_dim, device, dtype):
    """LlamaRotaryEmbedding's [B, T, D] tables (real angles: rotations keep the norm over repeats)."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / ROPE_THETA**exponents
    freqs = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1).expand(batch, seq_len, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _make(batch, seq_len, q_heads, k_heads, head_dim, *, projection_layout):
    def make(device, dtype):
        def heads(n):
            if projection_layout:  # proj(x).view(B, T, H, D).transpose(1, 2), as a leaf
                t = torch.randn(batch, seq_len, n, head_dim, device=device, dtype=dtype).transpose(1, 2)
                return t.detach().requires_grad_()
            return torch.randn(batch, n, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)

        cos, sin = _cos_sin(batch, seq_len, head_dim, device, dtype)
        return {"q": heads(q_heads), "k": heads(k_heads), "cos": cos, "sin": sin}

    return make


def _case(label, batch, seq_len, q_heads, k_heads, head_dim, *, projection_layout, elem=2):
    layout = "proj" if projection_layout else "BHTD"
    params = {"B": batch, "T": seq_len, "Hq": q_heads, "Hk": k_heads, "D": head_dim, "layout": layout}
    return Case(
        f"{label} B={batch} T={seq_len} H={q_heads}/{k_heads} D={head_dim} {layout}",
        params,
        _make(batch, seq_len, q_heads, k_heads, head_dim, projection_layout=projection_layout),
        _bytes(batch, seq_len, q_heads, k_heads, head_dim, elem),
    )


def _cases():
    llama = MODELS[0]
    cases = [_case(llama.name, BATCH, SEQ_LEN, llama.num_heads, llama.num_kv_heads, llama.head_dim,
                   projection_layout=False)]
    for m in MODELS:
        heads = (m.num_heads, m.num_kv_heads, m.head_dim)
        cases.append(_case(m.name, BATCH, SEQ_LEN, *heads, projection_layout=True))
    return cases


def _check_case():
    return _case("check", 2, 5, 4, 2, 16, projection_layout=True, elem=4)


def _liger():
    """Liger-Kernel's functional rope, or None."""
    try:
        from liger_kernel.transformers.functional import liger_rope
    except ImportError:
        return None
    return lambda q, k, cos, sin: liger_rope(q, k, cos, sin)


ROPE = Spec(
    name="rope",
    cases=_cases,
    providers={
        "eager": lambda q, k, cos, sin: rope_reference(q, k, cos, sin),
        "tigon": lambda q, k, cos, sin: rope(q, k, cos, sin),
    },
    peers={"liger": _liger},
    check_case=_check_case,
)

SPECS = (ROPE,)
