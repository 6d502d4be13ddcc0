"""The ``recompute_norms`` part (off by default): each pre-norm decoder layer remakes its norms' outputs and the
fused join's sum in the backward instead of saving them (norm_recompute.py's saved-tensor scope and hooks).
Planned after the norms: the hooks go on the tigon norms that part swaps in."""

from __future__ import annotations

from torch import nn

from tigon.patching import norm_recompute
from tigon.patching.parts import Part
from tigon.patching.patch_handle import SetAttr
from tigon.patching.sites import sites

RECOMPUTE_ATTR = "_tigon_recompute"
HOOKED = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")


def recompute_line(classes):
    return (f"{classes.decoder_layer.__name__}: norm outputs and the fused join's sum remade in the backward "
            "instead of saved (recompute_norms)")


def plan_recompute(plan, root, family, classes, switches=None):
    for layer, _, path in sites(root, classes.decoder_layer):
        if vars(layer).get(RECOMPUTE_ATTR) is not None:
            continue
        if not all(isinstance(getattr(layer, name, None), nn.Module) for name in HOOKED):
            raise ValueError(f"{path} has no {'/'.join(HOOKED)} to hook")
        change = norm_recompute.LayerRecompute(layer)
        plan.add(change, recompute_line(classes))
        plan.add(SetAttr(layer, RECOMPUTE_ATTR, change))


RECOMPUTE = Part("recompute_norms", lambda f, c: f.joined_layer == "pre_norm" and c.decoder_layer is not None,
                 plan_recompute, lambda f, c, s: [recompute_line(c)])
