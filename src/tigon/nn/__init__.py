"""Module level: drop-in ``nn.Module`` replacements with transformers' parameter names (API.md)."""

from tigon.nn.loss import CrossEntropyLoss, FusedLinearCrossEntropyLoss
from tigon.nn.mlp import GEGLUMLP, SwiGLUMLP
from tigon.nn.norm import LayerNorm, RMSNorm

__all__ = [
    "CrossEntropyLoss", "FusedLinearCrossEntropyLoss", "GEGLUMLP", "LayerNorm", "RMSNorm", "SwiGLUMLP",
]
