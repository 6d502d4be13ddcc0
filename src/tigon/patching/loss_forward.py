"""The loss path every patched CausalLM shares: one generic ``forward`` and one loss function.

``causal_lm_forward(family, causal_lm_cls, model_cls)`` builds the forward bound to a patched model when
``fused_linear_cross_entropy`` is on. In training mode with labels it runs the decoder, keeps the
last hidden states (``logits_to_keep`` applied as stock does) and computes

    loss = Σ_tokens CE(softcap(logit_scale · (h Wᵀ + b)), y) / (num_items_in_batch or #non-ignored)

through ``tigon.ops.fused_linear_cross_entropy`` without building the ``[tokens, vocab]`` logits; it
returns ``logits=None``. The key/value cache is left as the caller and config ask: without one,
transformers looks for packed sequences in ``position_ids``, which costs eager mode a host sync and
makes compiled attention dense-masked, more than the cache's copies of keys and values. The
projection runs *inside* ``lm_head``'s own call (its forward is taught to take a ``target``), so
FSDP2 / ZeRO-3 hooks registered on ``lm_head`` gather its weight for the forward and again for the
backward exactly as they would for the logits projection. In eval mode or
without labels the model's stock forward runs unchanged (stock logits and stock loss).

The family's quirks come from its table row: Gemma-2/3's ``final_logit_softcapping`` (``softcap``),
Granite's ``logits / logits_scaling`` (``logit_scale = 1 / logits_scaling``), a logit multiplier
read from the model (Cohere-2's ``logit_scale``, Falcon-H1's ``model.lm_head_multiplier``: the
``logit_scale`` option; the fp32 product, where stock multiplies the logits in their dtype), and the MoE router
load-balancing loss (``loss += router_aux_loss_coef · aux`` when ``output_router_logits``), as the
stock forwards do. Labels are shifted as transformers' ``ForCausalLMLoss`` does (or taken as given in
``shift_labels``), and ``ignore_index`` / ``num_items_in_batch`` (gradient accumulation: a sum divided
by the items of the whole accumulated batch) are honoured.

Vision-language rows (``...ForConditionalGeneration``, vision_language.py) run the same forward: their
stock forwards hand ``self.model`` the same arguments, so the generic one does too (plus ``labels`` where the
base model's forward takes them, as Gemma-3's does), and build the output class the stock forward returns;
PaliGemma's softcapping reads the text config, where the installed forward applies it.

``causal_lm_cross_entropy`` is the ``cross_entropy=True`` path: it replaces only the model's
``loss_function`` (an instance attribute transformers provides for this), so the stock forward builds
the logits (with its own softcapping and scaling) and tigon's cross-entropy reduces them.
"""

from __future__ import annotations

import inspect
import sys
import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from tigon.patching import decorator_chains

try:  # a tensor-parallel head's weight, and FSDP2's wrapped modules (whose shards are DTensors too)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = FSDPModule = ()

IGNORE_INDEX = -100

try:  # transformers >= 5.22 names the slicing; older 5.x inline it in every forward
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # pragma: no cover - depends on the installed transformers

    def slice_logits_to_keep(hidden_states, logits_to_keep):
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, keep, :]


def shifted_targets(labels, shift_labels, ignore_index):
    """Targets aligned with the positions that predict them, as ``ForCausalLMLoss`` makes them."""
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    return shift_labels


def _reduction(num_items_in_batch):
    return "mean" if num_items_in_batch is None else "sum"


def _per_item(loss, num_items_in_batch, target, ignore_index):
    """The loss as transformers' ``ForCausalLMLoss`` gives it: the summed loss divided by the items of the
    whole (accumulated) batch, or the mean over this batch's items.

    Where there is nothing to divide by, stock's loss is torch's division by zero: the mean over no items
    (every label ignored) is 0/0, NaN, where tigon's ops document 0; a sum divided by ``num_items_in_batch``
    = 0 is NaN (or ±inf). The patched model gives those values too. Its gradients stay zeros, as stock's do:
    torch's cross-entropy gives an ignored position no gradient whatever the loss, while tigon's ops would
    multiply their zeros by an infinite output gradient, so the division by zero is kept off the graph.
    """
    if num_items_in_batch is None:
        return torch.where((target != ignore_index).any(), loss, torch.nan)
    if not torch.is_tensor(num_items_in_batch):
        return loss / num_items_in_batch if num_items_in_batch != 0 else loss * 0 + loss.detach() / 0
    items = num_items_in_batch.to(loss.device)
    counted = items != 0
    return torch.where(counted, loss / torch.where(counted, items, 1), loss.detach() / items)


def causal_lm_cross_entropy(
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=IGNORE_INDEX, shift_labels=None, **_
):
    """``ForCausalLMLoss`` with ``tigon.ops.cross_entropy`` (fp32 math on the logits as they are)."""
    from tigon.ops.cross_entropy import cross_entropy

    target = shifted_targets(labels, shift_labels, ignore_index).to(logits.device)
    loss = cross_entropy(
        logits.reshape(-1, vocab_size),  # (N, V)
        target.reshape(-1),  # (N,)
        ignore_index=ignore_index,
        reduction=_reduction(num_items_in_batch),
    )
    return _per_item(loss, num_items_in_batch, target, ignore_index)


causal_lm_cross_entropy._tigon = True


def linear_or_fused_loss(self, input, target=None, **loss_kwargs):
    """``lm_head.forward``: the plain projection, or with ``target`` the fused projection + loss.

    Bound to the ``nn.Linear`` instance; with no ``target`` it is exactly ``nn.Linear.forward``, or
    the forward the patch found on a tensor-parallel head (which gathers the logits). With a target
    and such a head, each rank computes the loss over its own classes (vocab_parallel_cross_entropy.py).
    """
    if target is None:
        logits_forward = vars(self).get(LOGITS_FORWARD)
        return logits_forward(input) if logits_forward is not None else nn.Linear.forward(self, input)
    if vocab_parallel_head(self):
        from tigon.ops.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(
            input.reshape(-1, input.shape[-1]), self.weight, target.reshape(-1), bias_shard=self.bias, **loss_kwargs
        )
    from tigon.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

    return fused_linear_cross_entropy(
        input.reshape(-1, input.shape[-1]),  # (N, H)
        self.weight,  # (V, H), read in this module's call so its hooks have gathered it
        target.reshape(-1),  # (N,)
        linear_bias=self.bias,
        **loss_kwargs,
    )


linear_or_fused_loss._tigon = True
# The instance attribute the patch sets on the lm_head whose forward it rebinds.
TAKES_TARGET = "_tigon_takes_target"
# ... and on a tensor-parallel head, the forward it found there (transformers' colwise plan).
LOGITS_FORWARD = "_tigon_logits_forward"


def vocab_parallel_head(lm_head) -> bool:
    """Whether tensor parallelism split ``lm_head`` by classes: its weight a DTensor split by rows over a 1-D
    mesh, and on the instance transformers' tensor-parallel forward (kept by the patch as LOGITS_FORWARD, or
    wrapped around tigon's by a model built from patched classes). FSDP2's shards are DTensors split by rows
    too, but FSDP2 installs hooks, not a forward, and gathers the whole weight for the head's call: a head
    that FSDP2 wraps, or whose only instance forward is tigon's, is not a tensor-parallel one."""
    weight = lm_head.weight
    if not isinstance(weight, DTensor) or isinstance(lm_head, FSDPModule):
        return False
    own = vars(lm_head).get("forward")
    foreign_forward = own is not None and not getattr(getattr(own, "__func__", own), "_tigon", False)
    if not (LOGITS_FORWARD in vars(lm_head) or foreign_forward):
        return False
    from tigon.ops.vocab_parallel_cross_entropy import vocab_sharded

    return vocab_sharded(weight)


def _loss_call(lm_head):
    """What computes the loss: ``lm_head``'s own call (its hooks gather a sharded weight: FSDP2, ZeRO-3), or
    for a tensor-parallel head the fused loss bound to it. Such a head has no hooks to run (its weight stays
    split), and a model built from patched classes and then split has its forward wrapped in one that would
    take the loss for a shard of logits."""
    if modules_to_save_wrapper(lm_head):  # its forward calls the copy it runs now, with the target
        return lm_head
    return types.MethodType(linear_or_fused_loss, lm_head) if vocab_parallel_head(lm_head) else lm_head


def modules_to_save_wrapper(module) -> bool:
    """Whether ``module`` is PEFT's ``ModulesToSaveWrapper`` (``modules_to_save=["lm_head"]``): a trained
    copy of the head per adapter beside the original, its forward calling the active one with the
    arguments it is given (a target too)."""
    other = sys.modules.get("peft.utils.other")
    return other is not None and type(module) is getattr(other, "ModulesToSaveWrapper", None)


def active_head(lm_head):
    """The module ``lm_head``'s call computes with: itself, or for a ``ModulesToSaveWrapper`` the one its
    forward calls now (the active adapter's copy; the original with adapters disabled, or where the
    active adapter has no copy), as PEFT's forward decides it, at each call."""
    if not modules_to_save_wrapper(lm_head):
        return lm_head
    active = lm_head.active_adapters
    if lm_head.disable_adapters or not active or any(name not in lm_head._adapters for name in active):
        return lm_head.original_module
    return lm_head.modules_to_save[active[0]]


def _takes_target(lm_head) -> bool:
    """Whether ``lm_head`` is still the module the patch taught to take a target (for a PEFT
    ``modules_to_save`` wrapper: the copy it runs now, :func:`active_head`; the wrapper hands the target on).

    It may have been replaced since (``resize_token_embeddings``, an adapter added after the patch);
    the stock loss path is right for any head, so that is what runs then, with a warning.
    """
    # A flag the patch sets on the head it rebinds, rather than a comparison of the bound method's
    # __func__: Dynamo does not see that identity, and would take the warning path (a graph break)
    # and the full logits under torch.compile.
    if vars(active_head(lm_head)).get(TAKES_TARGET, False):
        return True
    warnings.warn(
        f"tigon: lm_head is now a {type(lm_head).__name__} that the patch did not set up; computing the "
        "loss from full logits (the stock path). Patch after resizing or wrapping the output layer.",
        stacklevel=3,
    )
    return False


def logit_multiplier(model, path: str):
    """The attribute at dotted ``path`` of the CausalLM ``model`` by which its stock forward multiplies
    the logits (families.Family.logit_multiplier)."""
    value = model
    for name in path.split("."):
        value = getattr(value, name, None)
    return value


def _mentions(fn, name: str) -> bool:
    """Whether ``fn``'s code reads ``name`` (an attribute, or a ``getattr`` string)."""
    code = fn.__code__
    return name in code.co_names or name in code.co_consts


def causal_lm_forward(family, causal_lm_cls, model_cls):
    """The generic CausalLM forward for one family row (see the module docstring): ``causal_lm_cls``'s, over
    ``model_cls``'s forward.

    It takes its arguments as the stock forward's body names them (``cache`` from transformers 5.24,
    ``past_key_values`` before), reports the stock signature to ``inspect.signature``, and runs under
    the stock forward's own decorators (``@can_return_tuple``, 5.24's ``@deprecate_kwarg``).
    """
    import dataclasses
    import importlib

    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    stock_forward, model_forward = causal_lm_cls.forward, model_cls.forward
    modeling_module = importlib.import_module(family.module_name)
    load_balancing_loss = getattr(modeling_module, family.router_aux_loss) if family.router_aux_loss else None
    stock_body = decorator_chains.body(stock_forward)
    positional, defaults = decorator_chains.named_parameters(stock_body, skip=1)  # after self
    vision_output_class = None  # a VLM row: the class its stock forward returns
    model_takes_labels = False
    if family.is_vision_language:
        # The output class the stock forward builds (it varies by family and release), and labels for
        # the base model where it takes them (Gemma-3's masks image tokens bidirectionally in training).
        from tigon.patching.vision_language import returned_class

        vision_output_class = returned_class(stock_forward)
        if vision_output_class is None:
            raise ValueError(
                f"{family.model_type}: loss: {stock_body.__qualname__} does not return one output class; "
                "this transformers version does not match tigon's table"
            )
        model_takes_labels = "labels" in inspect.signature(decorator_chains.body(model_forward)).parameters
    # Whether the stock forward softcaps its logits: a VLM row's flag says the family may (PaliGemma-2's
    # Gemma-2 text config); the installed forward says whether it does (PaliGemma's does from 5.2x, not 5.17).
    softcaps = family.final_logit_softcapping and (
        not family.is_vision_language or _mentions(stock_body, "final_logit_softcapping")
    )
    # What the backbone's output hands on as is: the cache (under either name), hidden states, attentions.
    passed_on = {cls: [f.name for f in dataclasses.fields(cls)
                       if f.name not in ("loss", "aux_loss", "logits", "router_logits")]
                 for cls in (CausalLMOutputWithPast, MoeCausalLMOutputWithPast, vision_output_class) if cls}

    def forward(self, *args, **kwargs):
        arguments = decorator_chains.bind(positional, defaults, args, kwargs)
        labels = arguments.pop("labels", None)
        if not (self.training and labels is not None) or not _takes_target(self.lm_head):
            return stock_body(self, *args, **kwargs)
        logits_to_keep = arguments.pop("logits_to_keep", 0)
        return_dict = arguments.pop("return_dict", None)
        if load_balancing_loss is not None:
            output_router_logits = arguments.get("output_router_logits")
            if output_router_logits is None:
                output_router_logits = self.config.output_router_logits
            arguments["output_router_logits"] = output_router_logits
        if model_takes_labels:
            arguments["labels"] = labels
        outputs = self.model(**arguments)
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)  # (B, T', H)

        ignore_index = arguments.get("ignore_index", IGNORE_INDEX)
        num_items_in_batch = arguments.get("num_items_in_batch")
        target = shifted_targets(labels, arguments.get("shift_labels"), ignore_index)  # (B, T')
        target = target.to(hidden_states.device)
        softcap = getattr(self.config.get_text_config(), "final_logit_softcapping", None) if softcaps else None
        logit_scale = 1.0 / self.config.logits_scaling if family.logits_scaling else 1.0
        if family.logit_multiplier is not None:
            logit_scale = logit_scale * logit_multiplier(self, family.logit_multiplier)
        loss = _loss_call(self.lm_head)(
            hidden_states,
            target=target,
            ignore_index=ignore_index,
            reduction=_reduction(num_items_in_batch),
            softcap=softcap,
            logit_scale=logit_scale,
        )
        loss = _per_item(loss, num_items_in_batch, target, ignore_index)

        # An MoE backbone's output class has a router_logits field (MoeModelOutputWithPast), which the
        # stock forward hands on in a MoeCausalLMOutputWithPast, with or without a router loss. (Not the
        # attribute: transformers 5.17's output recorder adds router_logits to a BaseModelOutputWithPast,
        # and the stock forward returns a CausalLMOutputWithPast without them.)
        if vision_output_class is not None:
            output_class = vision_output_class
            moe_output = load_balancing_loss is not None
        else:
            fields = getattr(type(outputs), "__dataclass_fields__", {})
            moe_output = load_balancing_loss is not None or "router_logits" in fields
            output_class = MoeCausalLMOutputWithPast if moe_output else CausalLMOutputWithPast
        common = {name: getattr(outputs, name, None) for name in passed_on[output_class]}
        if load_balancing_loss is None and not moe_output:
            out = output_class(loss=loss, logits=None, **common)
        elif load_balancing_loss is None:
            out = output_class(loss=loss, logits=None, router_logits=outputs.router_logits, **common)
        else:
            aux_loss = None
            if output_router_logits:
                aux_loss = load_balancing_loss(
                    outputs.router_logits, self.num_experts, self.num_experts_per_tok, arguments.get("attention_mask")
                )
                loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
            out = output_class(loss=loss, aux_loss=aux_loss, logits=None, router_logits=outputs.router_logits, **common)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return out if return_dict else out.to_tuple()

    forward.__signature__ = inspect.signature(stock_body)
    forward.__name__, forward.__qualname__ = stock_body.__name__, stock_body.__qualname__
    forward.__doc__ = f"tigon's generic CausalLM forward ({family.model_type}); see tigon.patching.loss_forward."
    forward._tigon = True
    wrapped = decorator_chains.rewrapped(stock_forward, forward)
    wrapped._tigon = True
    return wrapped
