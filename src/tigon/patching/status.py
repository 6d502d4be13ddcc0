"""Whether each family row checks out on the installed transformers: ``tigon env`` prints it and
``tigon check`` fails on it.

A row checks out when everything ``tigon.patch`` relies on is where the row says, in the form it
knows: the classes exist; the attention forward's body (through its decorators) calls the
module-level rotate-half ``apply_rotary_pos_emb``; the forwards tigon rewraps show the body they run;
the decoder layer of a joined family is, statement for statement, a forward tigon fuses (in one of
the known releases' variants); the MoE router loss exists; MoE experts sit behind transformers'
experts dispatch with its default gate (or the row's own activation). These are the checks ``patch`` makes
before it changes anything; here they run without a model.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from tigon.patching import engine, experts_forwards, residual_joins
from tigon.patching.families import FAMILIES
from tigon.patching.parts.attention import check_rotary, fuses_attention


@dataclass(frozen=True)
class FamilyStatus:
    """``ok``: True (checks out), False (does not: ``detail`` says which part), None (this transformers
    has no such model)."""

    model_type: str
    ok: bool | None
    detail: str


def family_status(model_type: str) -> FamilyStatus:
    family = FAMILIES[model_type]
    try:
        importlib.import_module(family.module_name)
    except ImportError:
        return FamilyStatus(model_type, None, f"not in this transformers ({family.module_name})")
    try:
        classes = engine.resolve(family)
        parts = []
        if classes.norm is not None:
            parts.append("rms_norm")
        if classes.layer_norm is not None:
            parts.append("layer_norm")
        if classes.mlp is not None:
            parts.append(f"mlp ({family.mlp.layout})")
        if classes.experts is not None:
            eager = {"gate": "its eager loop calls the gate", "inline": "eager loop replaced",
                     None: "eager loop unknown: stays stock"}[experts_forwards.check_class(family, classes.experts)]
            parts.append(f"experts ({family.experts.layout}, {eager})")
        if classes.attention is not None:
            parts.append("rope")
            if fuses_attention(family, classes, {"fused_attention": True}):
                parts.append("attention as one node (fused_attention)")
        if family.joined_layer:
            variant = residual_joins.matched_variant(
                classes.decoder_layer.forward, residual_joins.LAYOUTS[family.joined_layer].source
            )
            if variant is None:
                return FamilyStatus(
                    model_type, False,
                    f"joined layer: {classes.decoder_layer.__name__}.forward is not the {family.joined_layer} "
                    "forward tigon knows (patch would leave its joins unfused)",
                )
            parts.append(f"joins ({family.joined_layer}, cache argument {variant!r})")
        if family.is_vision_language:
            parts.append(_vision_status(family, classes))
        parts.append("fused linear cross-entropy")
    except ValueError as err:
        return FamilyStatus(model_type, False, str(err))
    return FamilyStatus(model_type, True, ", ".join(parts))


def _vision_status(family, classes) -> str:
    """A VLM row's vision parts (the vision rotary checked as patch checks it) and its loss forward."""
    from tigon.patching import vision_language

    if vision_language.returned_class(classes.causal_lm.forward) is None:
        raise ValueError(f"{family.model_type}: loss: {classes.causal_lm.__name__}.forward returns no one output class")
    vision = classes.vision
    if vision.attention is not None:
        check_rotary(vision_language.vision_family(family), vision)
    names = [c.__name__ for c in (vision.norm, vision.layer_norm, vision.mlp, vision.attention) if c is not None]
    text = "language model from config.text_config, " if family.text_from_config else ""
    return f"{text}vision ({', '.join(names)})"


def all_family_statuses() -> list[FamilyStatus]:
    return [family_status(model_type) for model_type in sorted(FAMILIES)]


def format_status(status: FamilyStatus) -> str:
    mark = {True: "ok  ", False: "FAIL", None: "--  "}[status.ok]
    return f"{mark} {status.model_type:<16} {status.detail}"
