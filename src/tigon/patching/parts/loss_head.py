"""The loss part: the CausalLM's loss through tigon (``fused_linear_cross_entropy``, or ``cross_entropy``).

- ``fused_linear_cross_entropy`` (the default): the CausalLM instance gets the generic forward of
  loss_forward.py, and ``lm_head`` learns to take a target (fused linear cross-entropy, no logits in
  training). The head must be a plain ``nn.Linear`` (or one that tensor parallelism split by classes), or
  PEFT's ``modules_to_save`` wrapper of one: then the original and each adapter's copy take a target, and
  the fused loss runs over the one the wrapper calls (loss_forward.active_head).
- ``cross_entropy``: the instance's ``loss_function`` becomes tigon's cross-entropy over the stock logits.

A model whose forward is TRL's fused LM head (a TRL trainer added it: the model was patched after the
trainer was made) keeps that forward under ``fused_linear_cross_entropy``: TRL trains through it, scoring
the tokens from the backbone's output with its own head (tigon.patch_trl() makes that tigon's op), and hands
every other call to the stock forward it wraps. The backbone's parts are patched beneath it as they are
under a model patched before TRL wrapped it, where TRL's head wraps tigon's forward instead.
"""

from __future__ import annotations

import importlib

from torch import nn

from tigon.patching import loss_forward, trl
from tigon.patching.instance_methods import InstanceMethod, Recipe
from tigon.patching.parts import Part
from tigon.patching.patch_handle import SetAttr
from tigon.patching.sites import check_plain, is_tigon, own_forward


def loss_lines(classes, switches):
    name = classes.causal_lm.__name__
    if switches["fused_linear_cross_entropy"]:
        return [
            f"{name}.forward -> tigon generic forward (training loss: fused linear cross-entropy, no logits)",
            "lm_head.forward -> nn.Linear, or tigon.ops.fused_linear_cross_entropy when given a target",
        ]
    if switches["cross_entropy"]:
        return [f"{name}.loss_function -> tigon.ops.cross_entropy"]
    return []


def trl_head_line(classes):
    return (f"{classes.causal_lm.__name__}.forward is TRL's fused LM head (trl add_fused_lm_head): kept, the "
            "training loss TRL's (tigon.patch_trl() computes it with tigon)")


def _check_head(model, lm_head, family, classes, parallel_head, path="lm_head"):
    if (type(lm_head) is nn.Linear and isinstance(lm_head.weight, loss_forward.DTensor) and not parallel_head
            and own_forward(lm_head) is not None):
        raise ValueError(
            f"lm_head's weight is a DTensor placed {tuple(lm_head.weight.placements)} over a "
            f"{lm_head.weight.device_mesh.ndim}-D mesh; the fused loss takes a head split by classes over a 1-D "
            "mesh (tensor parallel) or a whole one: pass fused_linear_cross_entropy=False for this model"
        )
    if type(lm_head) is not nn.Linear or (own_forward(lm_head) is not None and not parallel_head):
        raise ValueError(
            f"{path} is {type(lm_head).__name__}, not a plain nn.Linear (LoRA on lm_head?); "
            "pass fused_linear_cross_entropy=False (and cross_entropy=True) for this model"
        )
    if not isinstance(getattr(model, "model", None), classes.model):
        raise ValueError(f"the model's .model is not a {classes.model.__name__}")
    if family.logit_multiplier is not None:
        multiplier = loss_forward.logit_multiplier(model, family.logit_multiplier)
        if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)):
            raise ValueError(
                f"{family.model_type}: loss: the model's {family.logit_multiplier} is "
                f"{type(multiplier).__name__}, not the number the family's row expects"
            )


def _plan_head(plan, lm_head, line):
    """``lm_head`` (an ``nn.Linear``) takes a target: the fused projection and loss."""
    plan.add(SetAttr(lm_head, "forward", InstanceMethod(lm_head, loss_forward.linear_or_fused_loss)), line)
    plan.add(SetAttr(lm_head, loss_forward.TAKES_TARGET, True))


def plan_loss(plan, model, family, classes, switches):
    lines = loss_lines(classes, switches)
    forward = own_forward(model)
    loss_function = vars(model).get("_loss_function")
    if switches["fused_linear_cross_entropy"]:
        if is_tigon(forward):
            return
        if trl.is_fused_head(forward) and type(model).forward is classes.causal_lm.forward:
            plan.note(trl_head_line(classes))
            return
        importlib.import_module("tigon.ops.fused_linear_cross_entropy")  # fail here, not at the first step
        if is_tigon(loss_function):
            raise ValueError("the model is already patched with cross_entropy=True; revert that patch first")
        check_plain(model, classes.causal_lm, "the model")
        lm_head = getattr(model, "lm_head", None)
        forward = Recipe(loss_forward.causal_lm_forward, (family, classes.causal_lm, classes.model))
        if loss_forward.modules_to_save_wrapper(lm_head):
            # PEFT's modules_to_save: the original head and each adapter's trained copy take a target; the
            # wrapper's forward picks one at each call and hands it the target (loss_forward.active_head)
            heads = {"lm_head.original_module": lm_head.original_module,
                     **{f"lm_head.modules_to_save.{name}": head for name, head in lm_head.modules_to_save.items()}}
            for path, head in heads.items():
                _check_head(model, head, family, classes, False, path)
            plan.add(SetAttr(model, "forward", InstanceMethod(model, forward)), lines[0])
            for head in heads.values():
                if not is_tigon(own_forward(head)):
                    _plan_head(plan, head, lines[1] + " (PEFT modules_to_save: the active copy's)")
            return
        # A tensor-parallel head (transformers' colwise plans): its weight a DTensor split by classes,
        # and on the instance the forward that gathers its logits, kept for the logits path.
        parallel_head = type(lm_head) is nn.Linear and loss_forward.vocab_parallel_head(lm_head)
        _check_head(model, lm_head, family, classes, parallel_head)
        plan.add(SetAttr(model, "forward", InstanceMethod(model, forward)), lines[0])
        if parallel_head and own_forward(lm_head) is not None:
            plan.add(SetAttr(lm_head, loss_forward.LOGITS_FORWARD, own_forward(lm_head)))
        _plan_head(plan, lm_head, lines[1])
    elif switches["cross_entropy"]:
        if is_tigon(loss_function):
            return
        importlib.import_module("tigon.ops.cross_entropy")
        if is_tigon(forward):
            raise ValueError(
                "the model is already patched with fused_linear_cross_entropy=True; revert that patch first"
            )
        if loss_function is not None:
            raise ValueError("the model has its own loss_function set; tigon will not replace it")
        plan.add(SetAttr(model, "_loss_function", loss_forward.causal_lm_cross_entropy), lines[0])


# None: two switches choose the loss; planned on a CausalLM only (engine.py)
LOSS_HEAD = Part(None, lambda f, c: True, plan_loss, lambda f, c, s: loss_lines(c, s))
