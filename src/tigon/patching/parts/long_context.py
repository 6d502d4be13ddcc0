"""The long-context switches: ``offload_activations`` and ``tiled_mlp`` (both off by default).

- ``offload_activations``: each decoder layer gets forward hooks that run its forward inside a
  ``tigon.nn.activation_offload.LayerScope``: what the layer saves for its backward (with gradient
  checkpointing: its input) waits in pinned host memory and comes back a layer ahead in the backward.
  All layers of a model share one :class:`~tigon.nn.activation_offload.Offloader` (one host pool, one
  side stream a device, the chain of layers the prefetch follows); :func:`offloader_of` returns it.
  Where transformers checkpoints around the layer's hooks (5.17–5.22: in ``GradientCheckpointingLayer.__call__``)
  the layer's checkpoint function is wrapped to enter the scope around the checkpoint call (a pre-hook on
  the module that calls the layers wraps the one ``gradient_checkpointing_enable()`` sets after the patch).
  The scope is entered before any other hook's (recompute_norms' scope then stays off on that layer: the
  host holds what it would have remade). Tensors on the CPU are never offloaded: a CPU model runs as
  it would without the switch, and ``Patch.replaced`` says so when the model is on the CPU at the patch.
  Exclusive with ``cuda_graphs`` (a captured layer replays fixed addresses; the copies move them).
- ``tiled_mlp``: each gated MLP module (the family's class, or the tigon GLU module the ``mlp`` switch
  swaps in: found when the patch is applied) gets an instance forward, ``tigon.nn.tiled_mlp.TiledForward``,
  that runs its forward over chunks of tokens, forward and backward.
- ``keep_attention``: each decoder layer's checkpoint function is wrapped
  (``tigon.nn.kept_attention.LayerKeep``, kept wrapped as the offload's is) so that under non-reentrant
  gradient checkpointing the recompute in the backward takes the attention kernel's outputs of the forward back
  instead of running the T² kernel again (tigon.nn.kept_attention): in tigon's attention node where the family's
  attention runs as one, and through transformers' sdpa attention function otherwise (the model's config is
  marked for tigon's wrapper of it, band_attention.KeptMark, which hands the call to tigon.nn.kept_sdpa).

These are changes that ``Patch.revert()`` undoes (hooks removed, instance forwards and attributes
restored); patching what is patched already is a no-op.
"""

from __future__ import annotations

import torch

from tigon.nn.activation_offload import LayerOffload, OffloadConfig, Offloader
from tigon.nn.attention import MaskBiases
from tigon.nn.kept_attention import LayerKeep
from tigon.nn.tiled_mlp import TiledForward, TiledMLPConfig
from tigon.patching import band_attention
from tigon.patching.instance_methods import InstanceMethod, Recipe, class_forward
from tigon.patching.interface_marks import carried
from tigon.patching.parts import Part
from tigon.patching.parts.attention import fuses_attention
from tigon.patching.patch_handle import SetAttr
from tigon.patching.sites import own_forward

OFFLOAD_ATTR = "_tigon_offload"  # on a decoder layer: its LayerOffload
OFFLOADER_ATTR = "_tigon_offloader"  # on the model: the Offloader its layers share
KEEP_ATTR = "_tigon_keep_attention"  # on a decoder layer: its LayerKeep


def check(switches) -> None:
    if switches.get("offload_activations") and switches.get("cuda_graphs"):
        raise ValueError("offload_activations and cuda_graphs are exclusive (a captured layer replays fixed "
                         "device addresses; offloading frees and remakes them): pass one of them True")


def _modules_of(root, classes):
    """Every module that is an instance of one of ``classes`` under ``root``, with one (parent, name)
    place it sits."""
    found = {}
    for parent in root.modules():
        for name, child in parent._modules.items():
            if isinstance(child, classes) and id(child) not in found:
                found[id(child)] = (child, parent, name)
    return list(found.values())


# ------------------------------------------------------------------------------------------ offload


def offload_lines(family, classes, switches) -> list[str]:
    check(switches)
    return [f"{classes.decoder_layer.__name__}: what it saves for the backward (with gradient checkpointing: its "
            "input) -> pinned host memory on a side stream, back a layer ahead in the backward, on CUDA devices "
            "(offload_activations)"]


CPU_LINE = "offload_activations: the model is on the CPU: nothing is offloaded"


def plan_offload(plan, model, family, classes, switches, config: OffloadConfig | None = None) -> None:
    """The offload_activations switch on every decoder layer of ``model``."""
    check(switches)
    offloader = getattr(model, OFFLOADER_ATTR, None) or Offloader(config)
    line = offload_lines(family, classes, switches)[0]
    added = False
    for layer, parent, _ in _modules_of(model, classes.decoder_layer):
        if vars(layer).get(OFFLOAD_ATTR) is not None:
            continue
        change = LayerOffload(layer, offloader, _caller_of(model, parent))
        plan.add(change, line)
        plan.add(SetAttr(layer, OFFLOAD_ATTR, change))
        added = True
    if not added:
        return
    if getattr(model, OFFLOADER_ATTR, None) is None:
        plan.add(SetAttr(model, OFFLOADER_ATTR, offloader))
    parameter = next(model.parameters(), None)
    if parameter is not None and parameter.device.type not in offloader.config.device_types:
        plan.note(CPU_LINE if parameter.device.type == "cpu"
                  else f"offload_activations: the model is on {parameter.device.type}: nothing is offloaded")


def _caller_of(model, parent):
    """The module whose forward calls a layer that sits in ``parent``: ``parent`` itself, or, where
    ``parent`` is a container without a forward (the ``layers`` ModuleList), the module holding it."""
    if not isinstance(parent, (torch.nn.ModuleList, torch.nn.ModuleDict)):
        return parent
    for module in model.modules():
        if any(child is parent for child in module._modules.values()):
            return module
    return None


def offloader_of(model) -> Offloader | None:
    """The Offloader of a model patched with ``offload_activations=True`` (held by the module patched: the
    model, or its base model when a class patch reached that first; found inside PEFT wrappers too), for
    its host-memory figures (``host_bytes``, ``peak_host_bytes``); None if it is not patched so."""
    for module in model.modules():
        offloader = vars(module).get(OFFLOADER_ATTR)
        if offloader is not None:
            return offloader
    return None


# ---------------------------------------------------------------------------------------- tiled MLP


def _mlp_classes(classes) -> tuple:
    from tigon.nn.mlp import GEGLUMLP, SwiGLUMLP

    return (classes.mlp, SwiGLUMLP, GEGLUMLP)


def tiled_mlp_lines(family, classes, switches, config: TiledMLPConfig | None = None) -> list[str]:
    config = config or TiledMLPConfig()
    return [f"{classes.mlp.__name__}: forward and backward over chunks of max({config.min_tokens}, "
            f"{config.tokens_per_hidden:g}·hidden_size) tokens, each chunk recomputed in the backward (tiled_mlp)"]


class _TileMLP:
    """Give the MLP module at ``parent.name`` *when the patch is applied* (the ``mlp`` switch's swap, planned
    before, has put tigon's module there by then) a :class:`TiledForward` over the forward it runs."""

    def __init__(self, parent, name, hidden_size, config):
        self.parent, self.name, self.hidden_size, self.config = parent, name, hidden_size, config
        self.set = None

    def apply(self):
        module = self.parent._modules[self.name]
        inner = own_forward(module) or InstanceMethod(module, Recipe(class_forward, (type(module),)))
        self.set = SetAttr(module, "forward", TiledForward(module, inner, self.hidden_size, self.config))
        self.set.apply()

    def blocked(self, state):
        return None if self.set is None else self.set.blocked(state)

    def undo(self):
        if self.set is not None:
            self.set.undo()


def plan_tiled_mlp(plan, model, family, classes, switches, config: TiledMLPConfig | None = None) -> None:
    """The tiled_mlp switch on every gated MLP of ``model``."""
    config = config or TiledMLPConfig()
    hidden_size = getattr(model.config, "hidden_size", None)
    if not isinstance(hidden_size, int):
        raise ValueError(f"{family.model_type}: tiled_mlp: the model's config has no integer hidden_size")
    line = tiled_mlp_lines(family, classes, switches, config)[0]
    for module, parent, name in _modules_of(model, _mlp_classes(classes)):
        if isinstance(vars(module).get("forward"), TiledForward):
            continue
        plan.add(_TileMLP(parent, name, hidden_size, config), line)


# ------------------------------------------------------------------------------------ kept attention


def keep_attention_lines(family, classes, switches) -> list[str]:
    where = ("tigon's attention node, or transformers' sdpa attention function where the node stands aside"
             if fuses_attention(family, classes, switches) else "transformers' sdpa attention function")
    return [f"{classes.decoder_layer.__name__}: under non-reentrant gradient checkpointing, the attention kernel's "
            f"output and log-sum-exp kept from the forward ({where}), for the recompute in the backward to take "
            "back instead of running the kernel again (keep_attention)"]


def plan_keep_attention(plan, model, family, classes, switches) -> None:
    """The keep_attention switch: every decoder layer of ``model`` hands its checkpoint a KeptCall, and the model is
    marked for the sdpa wrapper's kept calls (band_attention.KeptMark)."""
    line = keep_attention_lines(family, classes, switches)[0]
    added, biases = False, MaskBiases()  # the masks' biases, one per mask for all the layers (kept_sdpa's calls)
    for layer, parent, _ in _modules_of(model, classes.decoder_layer):
        if vars(layer).get(KEEP_ATTR) is not None:
            continue
        change = LayerKeep(layer, _caller_of(model, parent), biases)
        plan.add(change, line)
        plan.add(SetAttr(layer, KEEP_ATTR, change))
        added = True
    if not band_attention.marked(model.config, band_attention.KEPT):
        for change in carried(model, band_attention.KeptMark(model.config)):
            plan.add(change)
    implementation = getattr(model.config, "_attn_implementation", None)
    if added and implementation != "sdpa":
        plan.note(f"keep_attention: the model's attention implementation is {implementation!r}, not 'sdpa': "
                  "nothing is kept")


OFFLOAD = Part("offload_activations", lambda f, c: c.decoder_layer is not None, plan_offload, offload_lines)
KEEP_ATTENTION = Part("keep_attention", lambda f, c: c.decoder_layer is not None and c.attention is not None,
                      plan_keep_attention, keep_attention_lines)
TILED_MLP = Part("tiled_mlp", lambda f, c: c.mlp is not None, plan_tiled_mlp, tiled_mlp_lines)
