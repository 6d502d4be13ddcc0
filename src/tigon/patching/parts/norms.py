"""The norm parts: RMSNorm and LayerNorm modules swapped for ``tigon.nn``'s, and the residual joins beside them.

- ``rms_norm``: each RMSNorm module is swapped for a ``tigon.nn.RMSNorm`` that adopts the *same* weight
  ``Parameter`` (state-dict keys and optimizer state stay valid); a norm whose output goes only to projections
  (the row's ``projection_norms``) gives it in the autocast dtype under autocast. With it, decoder layers whose
  residual joins sit beside norms (pre-norm layers as Llama's, Gemma-2/3's sandwich, OLMo-2/3's post-norms)
  get, on the instance, a forward that runs those joins as fused tigon ops (residual_joins.py). The class
  forward is checked statement for statement first; another one (another transformers version's) keeps
  running, with a warning. That forward is checkpointed as transformers checkpoints the class's
  (layer_forward.py).
- ``layer_norm``: each affine LayerNorm over the last dim is swapped for ``tigon.nn.LayerNorm`` with the same
  weight and bias.
"""

from __future__ import annotations

import warnings

from torch import nn

from tigon.patching import decorator_chains, residual_joins
from tigon.patching.instance_methods import InstanceMethod, Recipe
from tigon.patching.layer_forward import LayerForward, checkpoint_wrappers, checkpoints_in_class_forward
from tigon.patching.parts import Part
from tigon.patching.patch_handle import SetAttr, SwapModule
from tigon.patching.sites import (
    check_plain,
    full_shape,
    hub_kernel,
    is_tigon,
    on_meta,
    own_forward,
    sites,
    transformers_version,
)


def note_hub_kernel(plan, old):
    """Report a Hub kernel (transformers' use_kernels) that the module tigon swaps in takes over from."""
    repo = hub_kernel(old)
    if repo is not None:
        plan.note(f"{type(old).__name__}: tigon's module in place of the Hub kernel {repo} that transformers' "
                  "use_kernels set (Patch.revert() puts it back)")


def norm_eps(module, path):
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    if not isinstance(eps, (float, int)):
        raise ValueError(f"{path} ({type(module).__name__}) has no float eps / variance_epsilon")
    return float(eps)


def rms_norm_line(family, classes):
    spec = family.norm
    line = f"{classes.norm.__name__} -> tigon.nn.RMSNorm(casting={spec.casting!r}, offset={spec.offset})"
    if family.projection_norms:
        line += f"; {'/'.join(family.projection_norms)} give their output in the autocast dtype under autocast"
    return line


def layer_norm_line(classes):
    return f"{classes.layer_norm.__name__} -> tigon.nn.LayerNorm"


def joins_line(family, classes):
    layout = residual_joins.LAYOUTS[family.joined_layer]
    return f"{classes.decoder_layer.__name__}.forward -> residual joins as {layout.ops} (instance forward)"


def _feeds_projections(places, family, classes) -> bool:
    """Whether every place a norm sits is one of the ``projection_norms`` of a decoder layer that runs
    transformers' own forward (a subclass or a wrapper might route the output elsewhere)."""
    layer = classes.decoder_layer
    return layer is not None and all(
        isinstance(parent, layer) and type(parent).forward is layer.forward and own_forward(parent) is None
        and name in family.projection_norms
        for parent, name in places
    )


def plan_rms_norms(plan, root, family, classes):
    from tigon.nn.norm import RMSNorm

    spec = family.norm
    line = rms_norm_line(family, classes)
    for old, places, path in sites(root, classes.norm):
        check_plain(old, classes.norm, path, replaced_whole=True)
        weight = old._parameters.get("weight")
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            raise ValueError(f"{path} ({type(old).__name__}) has no 1-D weight Parameter")
        eps = norm_eps(old, path)
        size = full_shape(weight)[0]
        new = on_meta(lambda n=size, e=eps: RMSNorm(n, e, offset=spec.offset, casting=spec.casting))
        new.weight = weight
        if _feeds_projections(places, family, classes):
            new.autocast_output = True
        new.train(old.training)
        plan.add(SwapModule(old, new, places), line)
        note_hub_kernel(plan, old)


def plan_layer_norms(plan, root, family, classes):
    from tigon.nn.norm import LayerNorm

    line = layer_norm_line(classes)
    for old, places, path in sites(root, classes.layer_norm):
        check_plain(old, classes.layer_norm, path, replaced_whole=True)
        weight, bias = old._parameters.get("weight"), old._parameters.get("bias")
        shape = getattr(old, "normalized_shape", None)
        if weight is None or weight.dim() != 1 or (shape is not None and tuple(shape) != full_shape(weight)):
            raise ValueError(f"{path} ({type(old).__name__}) is not an affine LayerNorm over the last dim")
        eps = norm_eps(old, path)
        new = on_meta(lambda w=weight, e=eps, b=bias: LayerNorm(full_shape(w)[0], e, bias=b is not None))
        new.weight = weight
        if bias is not None:
            new.bias = bias
        new.train(old.training)
        plan.add(SwapModule(old, new, places), line)
        note_hub_kernel(plan, old)


def joined_layer_forward(layer_cls, layout_name):
    """tigon's body of the ``layout_name`` layer (residual_joins.LAYOUTS) under the class forward's own decorators
    (5.24's @deprecate_kwarg), except the checkpointing wrapper, which LayerForward stands for on the instance."""
    layout = residual_joins.LAYOUTS[layout_name]
    return decorator_chains.rewrapped(
        layer_cls.forward, layout.forward_for(layer_cls.forward), skip_outer=checkpoint_wrappers(layer_cls.forward)
    )


def plan_joined_layers(plan, root, family, classes):
    """Part of the ``rms_norm`` switch: the family's decoder layers get residual_joins.py's forward."""
    from tigon.nn.norm import RMSNorm

    layout = residual_joins.LAYOUTS[family.joined_layer]
    layer_cls = classes.decoder_layer
    try:
        variant = residual_joins.matched_variant(layer_cls.forward, layout.source)
    except decorator_chains.WrapperMismatch as err:
        raise ValueError(f"{family.model_type}: joined layer: {layer_cls.__name__}.forward: {err}") from err
    if variant is None:
        # Another transformers version's layer: its own forward keeps running (with tigon's norms, as
        # any layer does); only the fused joins, which would replace that forward, are left out.
        warnings.warn(
            f"tigon: {layer_cls.__name__}.forward is not the {family.joined_layer} forward tigon knows (transformers "
            f"{transformers_version()}): its residual joins stay unfused; everything else is patched",
            stacklevel=5,
        )
        return
    forward = Recipe(joined_layer_forward, (layer_cls, family.joined_layer))
    line = joins_line(family, classes)
    for layer, _, path in sites(root, layer_cls):
        if is_tigon(own_forward(layer)):
            continue
        check_plain(layer, layer_cls, path)
        norms = [layer._modules.get(name) for name in layout.norms]
        if not all(isinstance(norm, (classes.norm, RMSNorm)) for norm in norms):
            raise ValueError(f"{path}'s {'/'.join(layout.norms)} are not all {classes.norm.__name__} modules")
        inner = InstanceMethod(layer, forward)
        plan.add(SetAttr(layer, "forward", LayerForward(layer, inner, checkpoint=checkpoints_in_class_forward())), line)


def _plan_rms_norms_and_joins(plan, model, family, classes, switches):
    plan_rms_norms(plan, model, family, classes)
    if family.joined_layer:
        plan_joined_layers(plan, model, family, classes)


RMS_NORMS = Part(
    "rms_norm", lambda f, c: c.norm is not None, _plan_rms_norms_and_joins,
    lambda f, c, s: [rms_norm_line(f, c)] + ([joins_line(f, c)] if f.joined_layer else []),
)
LAYER_NORMS = Part(
    "layer_norm", lambda f, c: c.layer_norm is not None,
    lambda plan, m, f, c, s: plan_layer_norms(plan, m, f, c), lambda f, c, s: [layer_norm_line(c)],
)
