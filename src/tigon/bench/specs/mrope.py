"""M-RoPE: Qwen2.5-VL-3B and -7B's attention (sectioned streams [16, 24, 24], heads of 128), with q and
k contiguous [B, H, T, D] (the layout Liger's kernel takes) and as a model hands them over (the
transpose of a [B, T, H, D] projection).

Speed of light, as rope's spec counts it: q and k read and written once forward and once backward;
the cos/sin tables ([3, B, T, D] each, of which a kernel reads one stream per column) are left out.
"""

from __future__ import annotations

import math

import torch

from tigon.bench.models import TOKENS
from tigon.bench.spec import Case, Spec
from tigon.bench.specs.rope import _bytes
from tigon.ops.mrope import mrope, mrope_reference

BATCH = 8
SEQ_LEN = TOKENS // BATCH
ROPE_THETA = 1000000.0
MROPE_SECTION = (16, 24, 24)  # Qwen2-VL and Qwen2.5-VL: temporal, height, width frequencies

# name -> (q heads, k heads, head dim), from the published configs
MODELS = {
    "Qwen2.5-VL-3B": (16, 2, 128),
    "Qwen2.5-VL-7B": (28, 4, 128),
}


def _position_ids(seq_len, device):
    """Qwen2-VL's [3, T] position ids for text, one image, then text again: the image's tokens share one
    temporal position while height and width walk its grid of side × side patches (up to 32 × 32,
    after up to 64 text tokens), and the text after it resumes past the image's largest position."""
    before = min(64, seq_len // 4)
    side = min(32, math.isqrt((seq_len - before) // 2))
    grid = torch.arange(side * side, device=device)
    after = seq_len - before - grid.numel()
    text_before = torch.arange(before, device=device).expand(3, before)
    image = torch.stack((torch.full_like(grid, before), before + grid // side, before + grid % side))
    text_after = (before + side + torch.arange(after, device=device)).expand(3, after)
    return torch.cat((text_before, image, text_after), dim=1)


def _cos_sin(batch, seq_len, head_dim, device, dtype):
    """The per-stream [3, B, T, D] tables Qwen2-VL's rotary module computes (each stream's
    cat(freqs, freqs)) from :func:`_position_ids`: real angles, three distinct streams."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / ROPE_THETA**exponents
    freqs = _position_ids(seq_len, device)[..., None].float() * inv_freq                 # (3, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None].expand(3, batch, seq_len, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _make(batch, seq_len, q_heads, k_heads, head_dim, section, *, projection_layout):
    def make(device, dtype):
        def heads(n):
            if projection_layout:  # proj(x).view(B, T, H, D).transpose(1, 2), as a leaf
                t = torch.randn(batch, seq_len, n, head_dim, device=device, dtype=dtype).transpose(1, 2)
                return t.detach().requires_grad_()
            return torch.randn(batch, n, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)

        cos, sin = _cos_sin(batch, seq_len, head_dim, device, dtype)
        return {"q": heads(q_heads), "k": heads(k_heads), "cos": cos, "sin": sin, "mrope_section": list(section)}

    return make


def _case(label, batch, seq_len, q_heads, k_heads, head_dim, *, projection_layout, section=MROPE_SECTION, elem=2):
    layout = "proj" if projection_layout else "BHTD"
    params = {"B": batch, "T": seq_len, "Hq": q_heads, "Hk": k_heads, "D": head_dim, "layout": layout}
    return Case(
        f"{label} B={batch} T={seq_len} H={q_heads}/{k_heads} D={head_dim} {layout}",
        params,
        _make(batch, seq_len, q_heads, k_heads, head_dim, section, projection_layout=projection_layout),
        _bytes(batch, seq_len, q_heads, k_heads, head_dim, elem),
    )


def _cases():
    return [
        _case(name, BATCH, SEQ_LEN, *heads, projection_layout=projection_layout)
        for name, heads in MODELS.items()
        for projection_layout in (False, True)
    ]


def _check_case():
    return _case("check", 2, 12, 4, 2, 16, projection_layout=True, section=(2, 3, 3), elem=4)


def _liger():
    """Liger-Kernel's Qwen2-VL M-RoPE, or None."""
    try:
        from liger_kernel.transformers.qwen2vl_mrope import liger_multimodal_rotary_pos_emb
    except ImportError:
        return None
    return lambda q, k, cos, sin, mrope_section: liger_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section)


MROPE = Spec(
    name="mrope",
    cases=_cases,
    providers={
        "eager": lambda q, k, cos, sin, mrope_section: mrope_reference(q, k, cos, sin, mrope_section),
        "tigon": lambda q, k, cos, sin, mrope_section: mrope(q, k, cos, sin, mrope_section),
    },
    peers={"liger": _liger},
    check_case=_check_case,
)

SPECS = (MROPE,)
