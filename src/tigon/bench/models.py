"""Shapes of real models, the one table every benchmark spec takes its sizes from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    final_logit_softcap: float | None = None


MODELS = (
    ModelShape("Llama-3-8B", 4096, 14336, 32, 8, 128, 128256),
    ModelShape("Llama-3.2-1B", 2048, 8192, 32, 8, 64, 128256),
    ModelShape("Qwen2.5-7B", 3584, 18944, 28, 4, 128, 152064),
    ModelShape("Qwen2.5-0.5B", 896, 4864, 14, 2, 64, 151936),
    ModelShape("Gemma-2-9B", 3584, 14336, 16, 8, 256, 256000, final_logit_softcap=30.0),
)

MODELS_BY_NAME = {m.name: m for m in MODELS}

# Tokens per step used across specs: a batch of 8 × 2048, the size the issues' anchors were taken at.
TOKENS = 16384
