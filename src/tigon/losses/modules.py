"""Class forms of the post-training losses: options in the constructor, tensors in the call.

``DPOLoss(beta=0.2, loss_type="ipo")(input, linear_weight, target, ref_logps=...)`` computes what
``dpo_loss(input, linear_weight, target, beta=0.2, loss_type="ipo", ref_logps=...)`` computes. The
call takes the tensors in each class's ``call_order`` — the function's positional tensors, then
``linear_bias``, then the others (``ref_*``, ``old_logps``, …) — positionally or by name. The
per-batch values ``kl`` (KTO) and ``num_items_in_batch`` (GRPO) may be given in either place; the
call's value wins.
"""

from __future__ import annotations

import inspect

import torch

from tigon.losses.grpo import grpo_loss, grpo_options
from tigon.losses.kto import kto_loss, kto_options
from tigon.losses.preference import (
    cpo_loss,
    cpo_options,
    dpo_loss,
    dpo_options,
    orpo_loss,
    orpo_options,
    simpo_loss,
    simpo_options,
)
from tigon.ops.fused_linear_logprobs import check_head_options

# Keywords that carry tensors of one batch: taken by the call, never by the constructor.
TENSOR_KEYWORDS = frozenset({
    "linear_bias", "ref_input", "ref_linear_weight", "ref_linear_bias", "ref_logps", "old_logps",
})
# Per-batch values that may be fixed in the constructor or passed with each call.
PER_BATCH_KEYWORDS = frozenset({"kl", "num_items_in_batch"})


class _FusedLinearLoss(torch.nn.Module):
    """Binds a loss function's options; ``forward`` passes the tensors. No parameters, no buffers."""

    function = None  # the functional form, set by each class
    check_options = None  # the function's own option checks, run on the options when the loss is built
    call_order: tuple[str, ...] = ()  # what the call takes, in order

    def __init__(self, **options):
        super().__init__()
        signature = inspect.signature(type(self).function)
        allowed = {
            name for name, p in signature.parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in TENSOR_KEYWORDS
        }
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown option(s) {', '.join(unknown)}; "
                f"it takes {', '.join(sorted(allowed))}"
            )
        # The options as the function will see them (its defaults where not given), checked now
        # rather than at the first call; per-batch values (kl, num_items_in_batch) at the call.
        chosen = {name: signature.parameters[name].default for name in allowed} | options
        check = type(self).check_options
        check(**{name: chosen[name] for name in inspect.signature(check).parameters})
        check_head_options(chosen["temperature"], chosen["softcap"], chosen["logit_scale"], chosen["ignore_index"])
        self.options = dict(options)

    def forward(self, *tensors, **keywords):
        order = type(self).call_order
        if len(tensors) > len(order):
            raise TypeError(f"{type(self).__name__} takes at most {len(order)} tensors ({', '.join(order)}), "
                            f"got {len(tensors)}")
        unknown = sorted(set(keywords) - set(order))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got unexpected keyword(s) {', '.join(unknown)}; options go to the constructor"
            )
        given = dict(zip(order, tensors, strict=False))
        twice = sorted(set(given) & set(keywords))
        if twice:
            raise TypeError(f"{type(self).__name__}() got {', '.join(twice)} both by position and by name")
        given |= keywords
        # a per-batch value passed as None leaves the constructor's (or the function's default) in place
        given = {k: v for k, v in given.items() if not (k in PER_BATCH_KEYWORDS and v is None)}
        return type(self).function(**{**self.options, **given})

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


class DPOLoss(_FusedLinearLoss):
    """:func:`tigon.losses.dpo_loss`; call ``(input, linear_weight, target, linear_bias=None, ref_input=None,
    ref_linear_weight=None, ref_linear_bias=None, ref_logps=None)``."""

    function = staticmethod(dpo_loss)
    check_options = staticmethod(dpo_options)
    call_order = ("input", "linear_weight", "target", "linear_bias", "ref_input", "ref_linear_weight",
                  "ref_linear_bias", "ref_logps")


class ORPOLoss(_FusedLinearLoss):
    """:func:`tigon.losses.orpo_loss`; call ``(input, linear_weight, target, linear_bias=None)``."""

    function = staticmethod(orpo_loss)
    check_options = staticmethod(orpo_options)
    call_order = ("input", "linear_weight", "target", "linear_bias")


class CPOLoss(_FusedLinearLoss):
    """:func:`tigon.losses.cpo_loss`; call ``(input, linear_weight, target, linear_bias=None)``."""

    function = staticmethod(cpo_loss)
    check_options = staticmethod(cpo_options)
    call_order = ("input", "linear_weight", "target", "linear_bias")


class SimPOLoss(_FusedLinearLoss):
    """:func:`tigon.losses.simpo_loss`; call ``(input, linear_weight, target, linear_bias=None)``."""

    function = staticmethod(simpo_loss)
    check_options = staticmethod(simpo_options)
    call_order = ("input", "linear_weight", "target", "linear_bias")


class KTOLoss(_FusedLinearLoss):
    """:func:`tigon.losses.kto_loss`; call ``(input, linear_weight, target, preference_labels, linear_bias=None,
    ref_input=None, ref_linear_weight=None, ref_linear_bias=None, ref_logps=None, kl=None)``."""

    function = staticmethod(kto_loss)
    check_options = staticmethod(kto_options)
    call_order = ("input", "linear_weight", "target", "preference_labels", "linear_bias", "ref_input",
                  "ref_linear_weight", "ref_linear_bias", "ref_logps", "kl")


class GRPOLoss(_FusedLinearLoss):
    """:func:`tigon.losses.grpo_loss`; call ``(input, linear_weight, target, advantages, linear_bias=None,
    old_logps=None, ref_logps=None, num_items_in_batch=None)``."""

    function = staticmethod(grpo_loss)
    check_options = staticmethod(grpo_options)
    call_order = ("input", "linear_weight", "target", "advantages", "linear_bias", "old_logps", "ref_logps",
                  "num_items_in_batch")
