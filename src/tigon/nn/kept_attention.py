r"""Attention kept through gradient checkpointing: the recompute in the backward reuses the attention kernel's
output from the forward instead of running the kernel again.

Non-reentrant checkpointing (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, transformers'
default) runs a layer's forward twice: in the forward pass, keeping only the layer's input, and again in the
backward, to remake the tensors the layer's backward reads. For self-attention over T tokens that second run
includes the T² kernel. Per layer, with F the kernel's forward flops (4·T²·Hq·D over the causal half: 2·T²·Hq·D),
a step spends F forward, F again in the recompute and about 2.5·F in the kernel's backward (five products
against the forward's two): the recompute is 1/4.5 of the attention's work, and at long context attention is
most of a step (Llama-3.1-8B at 262,144 tokens: ~87% of the flops). What the backward needs from that kernel
is small, the output O (B, T, Hq·D) in the compute dtype and its log-sum-exp L (B, Hq, T) in fp32: at
Llama-3.1-8B's widths in bf16, 8 KB + 128 B a token a layer, about what the checkpoint keeps of the layer's
input.

:class:`KeptCall` is the function a checkpoint is handed, around the layer's forward (the same object runs in
the forward and in the recompute). Each call makes it the current holder of this thread (:func:`current`) for
its duration. In the first call, each attention node (``tigon.nn.attention.AttentionNode``) records what its
kernel returned (:meth:`KeptCall.attend`: O, L and the backend's other outputs, in call order); in a later
call, the recompute, each node takes its entry back instead of launching the kernel, after checking that the
call is the same one (q, k, v shapes, dtypes and device; mask or none). A call that differs is computed and
ends the replay for the rest of that run. The entries live as long as the checkpoint holds the function: its
part of the autograd graph, freed after the backward (or with the graph, if no backward runs); a second
backward through a retained graph replays them again.

With ``offload_activations`` (tigon.nn.activation_offload) the layer's forward runs inside its offload scope, and
the kept outputs wait in pinned host memory beside the layer's checkpointed input (:meth:`LayerScope.stow
<tigon.nn.activation_offload.LayerScope.stow>`; the masks' biases, shared by the layers, stay): they belong to the
layer's group of offloaded storages, so the backward brings them back with that input, a layer ahead, and at most
two layers' kept outputs are in GPU memory at once instead of every layer's. At Llama-3.1-8B's widths that is
8 KB a token a layer more on the host, as much again as the checkpoints.

Exact: the recompute's q, k and v are the forward's bit for bit (the same products of the same input), and the
kernel's output for them is the one kept (its bytes, where they went to the host and back), so the backward reads
what an uncheckpointed step reads.

Where nothing is kept: a reentrant checkpoint (its first run is without grad, where the node stands aside and
stock attention runs; its recompute computes as without this), torch.compile (the node stands aside), an
attention call outside a checkpoint. :class:`KeepingCheckpoint` wraps a decoder layer's checkpoint function
(tigon.nn.checkpoint_chain) to hand the checkpoint a :class:`KeptCall`; :class:`LayerKeep` is the change that
keeps it wrapped (the ``keep_attention`` switch of ``tigon.patch``).
"""

from __future__ import annotations

import threading

import torch

from tigon.nn import activation_offload
from tigon.nn.checkpoint_chain import CheckpointWrap, CheckpointWrapper

_local = threading.local()  # .holders: this thread's KeptCalls, innermost last


def current() -> KeptCall | None:
    """The KeptCall whose function is running on this thread (the innermost), or None."""
    holders = getattr(_local, "holders", None)
    return holders[-1] if holders else None


def _signature(q, k, v, mask) -> tuple:
    return tuple((t.shape, t.dtype, t.device) for t in (q, k, v)) + (mask is None,)


def _stow(outputs, scope, biases):
    """``outputs`` (a tensor, or tuples and lists of them and other values) with each tensor that the offload
    ``scope`` takes replaced by its handle; the masks' biases, which ``biases`` holds for all the layers, stay."""
    if isinstance(outputs, torch.Tensor):
        return outputs if biases is not None and biases.holds(outputs) else scope.stow(outputs)
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_stow(output, scope, biases) for output in outputs)
    return outputs


def _taken_back(kept):
    """What :func:`_stow` gave, its handles' tensors back on their device."""
    if isinstance(kept, (tuple, list)):
        return type(kept)(_taken_back(output) for output in kept)
    return activation_offload.take_back(kept)


class KeptCall:
    """``function`` as a checkpoint calls it, holding the attention kernels' outputs of its first call for the
    later ones (module docs). ``runs``: how many times it ran; ``entries``: (signature, outputs, stowed) in call order;
    ``biases``: where a masked call's bias is made, shared by the model's layers so that what they keep holds
    one bias per mask, not one a layer."""

    def __init__(self, function, biases=None):
        self.function = function
        self.biases = biases  # a tigon.nn.attention.MaskBiases the layers of a model share, or None
        self.entries: list[tuple] = []  # stowed: outputs is what _stow made of them (the offload is on)
        self.runs = 0
        self.position = 0  # the next entry a replaying run takes
        self.replaying = False

    def __call__(self, *args, **kwargs):
        self.replaying, self.position = self.runs > 0, 0
        self.runs += 1
        holders = getattr(_local, "holders", None)
        if holders is None:
            holders = _local.holders = []
        holders.append(self)
        try:
            return self.function(*args, **kwargs)
        finally:
            holders.pop()

    def attend(self, compute, q, k, v, mask, biases=None):
        """``compute()``'s result (an attention kernel's outputs for q, k, v and mask): computed and recorded in
        the first run, the recorded one in a later run where the call is the same. ``biases``: the
        ``MaskBiases`` whose biases the call's outputs may hold (shared by the layers: never offloaded with
        them); this call's own where None."""
        signature = _signature(q, k, v, mask)
        if not self.replaying:
            outputs = compute()
            if self.runs == 1:
                scope = activation_offload.active_scope()  # the layer's forward offloads: its kept outputs go too
                kept = outputs if scope is None else _stow(outputs, scope, self.biases if biases is None else biases)
                self.entries.append((signature, kept, scope is not None))
            return outputs
        if self.position < len(self.entries) and self.entries[self.position][0] == signature:
            _, kept, stowed = self.entries[self.position]
            self.position += 1
            return _taken_back(kept) if stowed else kept
        self.replaying = False  # the run took another path: compute from here on
        return compute()


def attend(compute, q, k, v, mask, biases=None):
    """The attention kernel's outputs: kept or taken back by the current :class:`KeptCall`, else computed
    (``biases``: :meth:`KeptCall.attend`'s)."""
    holder = current()
    return compute() if holder is None else holder.attend(compute, q, k, v, mask, biases)


class KeepingCheckpoint(CheckpointWrapper):
    """A layer's checkpoint function that hands the checkpoint a :class:`KeptCall` around the layer's forward
    (``owner``: the layer's :class:`LayerKeep`). Not while torch.compile traces."""

    def __call__(self, function, *args, **kwargs):
        if not torch.compiler.is_compiling():
            function = KeptCall(function, self.owner.biases)
        return self.inner(function, *args, **kwargs)


class LayerKeep(CheckpointWrap):
    """The ``keep_attention`` switch on one decoder layer: :class:`KeepingCheckpoint` around its checkpoint
    function (``caller``: the module whose forward calls the layer, which wraps a function set after the
    patch before each forward); ``biases``: the model's masks' biases, one per mask for all its layers (a
    ``tigon.nn.attention.MaskBiases``, or None)."""

    def __init__(self, layer: torch.nn.Module, caller: torch.nn.Module | None = None, biases=None):
        super().__init__(layer, caller)
        self.biases = biases

    def wrapper(self, function) -> KeepingCheckpoint:
        return KeepingCheckpoint(self, function)
