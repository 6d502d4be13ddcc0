"""Loss modules: thin wrappers over tigon.ops.cross_entropy and fused_linear_cross_entropy.

Like ``torch.nn.CrossEntropyLoss``, the class weights are a buffer named ``weight`` (in the
state_dict only when given), and the options are fixed at construction.
"""

from __future__ import annotations

import torch
from torch import nn

from tigon.ops.cross_entropy import check_loss_options, cross_entropy
from tigon.ops.fused_linear_cross_entropy import fused_linear_cross_entropy


class _LossOptions(nn.Module):
    def __init__(self, weight, ignore_index, label_smoothing, reduction, z_loss, softcap, logit_scale):
        super().__init__()
        if weight is not None and not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a torch.Tensor or None, got {type(weight).__name__}")
        # Scalar options are checked now; the weight against the logits at the first call.
        check_loss_options(
            None, 0, None, ignore_index, label_smoothing, reduction, z_loss, softcap, logit_scale
        )
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.z_loss = z_loss
        self.softcap = softcap
        self.logit_scale = logit_scale

    def _options(self):
        return dict(
            weight=self.weight, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            reduction=self.reduction, z_loss=self.z_loss, softcap=self.softcap, logit_scale=self.logit_scale,
        )

    def extra_repr(self) -> str:
        parts = [f"ignore_index={self.ignore_index}", f"reduction={self.reduction!r}"]
        if self.label_smoothing:
            parts.append(f"label_smoothing={self.label_smoothing}")
        if self.z_loss:
            parts.append(f"z_loss={self.z_loss}")
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap}")
        if self.logit_scale != 1.0:
            parts.append(f"logit_scale={self.logit_scale}")
        return ", ".join(parts)


class CrossEntropyLoss(_LossOptions):
    """``tigon.ops.cross_entropy`` as a module: ``forward(logits [..., V], target [...])``."""

    def __init__(self, weight=None, ignore_index=-100, label_smoothing=0.0, reduction="mean", z_loss=0.0,
                 softcap=None, logit_scale=1.0, inplace_backward=False):
        super().__init__(weight, ignore_index, label_smoothing, reduction, z_loss, softcap, logit_scale)
        if not isinstance(inplace_backward, bool):
            raise TypeError(f"inplace_backward must be True or False, got {inplace_backward!r}")
        self.inplace_backward = inplace_backward

    def forward(self, logits, target):
        return cross_entropy(logits, target, inplace_backward=self.inplace_backward, **self._options())


class FusedLinearCrossEntropyLoss(_LossOptions):
    """``tigon.ops.fused_linear_cross_entropy`` as a module.

    ``forward(input [..., H], linear_weight (V, H), target [...], linear_bias=None)``: the head's
    weight is an argument (it belongs to the model's lm_head), not a parameter of this module.
    """

    def __init__(self, weight=None, ignore_index=-100, label_smoothing=0.0, reduction="mean", z_loss=0.0,
                 softcap=None, logit_scale=1.0):
        super().__init__(weight, ignore_index, label_smoothing, reduction, z_loss, softcap, logit_scale)

    def forward(self, input, linear_weight, target, linear_bias=None):
        return fused_linear_cross_entropy(
            input, linear_weight, target, linear_bias=linear_bias, **self._options()
        )
