"""Norm modules: thin wrappers over tigon.ops with transformers' parameter names and init."""

from __future__ import annotations

import torch
from torch import nn

from tigon.ops.rms_norm import CASTINGS, rms_norm


class RMSNorm(nn.Module):
    """Drop-in for ``LlamaRMSNorm`` (casting="llama") and ``GemmaRMSNorm`` (casting="gemma", offset=1).

    ``weight`` starts at ones, or at zeros when ``offset=1.0`` (Gemma stores ``w`` and scales by
    ``1 + w``), so a fresh module is the identity scale either way and checkpoints load unchanged.
    """

    def __init__(self, hidden_size, eps=1e-6, *, offset=0.0, casting="llama", device=None, dtype=None):
        super().__init__()
        if casting not in CASTINGS:
            raise ValueError(f"casting must be one of {CASTINGS}, got {casting!r}")
        init = torch.zeros if offset == 1.0 else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = float(offset)
        self.casting = casting

    @property
    def eps(self) -> float:
        return self.variance_epsilon

    def forward(self, hidden_states):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, offset=self.offset, casting=self.casting)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}, offset={self.offset}, casting={self.casting!r}"
