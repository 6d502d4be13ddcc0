"""The ``recompute_norms`` switch: a decoder layer keeps its residual stream, not its norms' outputs.

What a patched pre-norm layer (Llama's) saves for the backward, per token, at Llama-3.2-1B's widths
under bf16 autocast (``python -m tigon.bench.saved``; hidden H = 2048, intermediate I = 8192)::

    input_layernorm          h, the layer's input (fp32)                  4·H    8 KB
    q/k/v projections        y₁ = input_layernorm(h) (bf16)                2·H    4 KB   recomputed
    attention (sdpa)         q, k, v, lse; its output (o_proj's input)            10 KB
    add_rms_norm             s = h + o, o the attention's output (fp32)   4·H    8 KB   recomputed
    MLP                      y₂ = post_attention_layernorm(s) (bf16)       2·H    4 KB   recomputed
                             gate, up (bf16)                               4·I   32 KB
                                                                                 67.8 KB

y₁ and y₂ are one norm pass away from what is saved anyway: y₁ = rms_norm(h), y₂ = the first output
of add_rms_norm(o, h). And s, which the fused join saves in fp32, is o + h, with o in bf16. So inside
the layer's forward a ``saved_tensors_hooks`` scope hands autograd, instead of y₁, y₂ and s, a small
recipe that holds what they are made from (h, saved by the input norm anyway; o, 2·H bytes; a copy
of the norm's weight, H values) and makes them again when the backward unpacks them: the same kernel
on the same inputs, so bitwise the same tensors. s is remade by torch's add, which is the kernel's
add: both widen o and h to fp32 and add once, rounded once to s's dtype. Saved per token per layer:
4 + 4 + 8 − 4 (o) = 12 KB less (55.5 KB measured, 18%; 16 layers: 197 KB a token, 12 GiB at 65,536
tokens).

Cost: in the backward, per layer, one rms_norm pass over h (reads 4·H, writes 2·H bytes a token),
one add_rms_norm pass (reads 6·H, writes 6·H) and one add (reads 6·H, writes 4·H): about 34·H bytes
a token, against the layer's ~4 GB of matmul operands at 8192 tokens: a fraction of a percent of a
step, more where memory-bound kernels dominate (small hidden sizes, short sequences). The
remade tensors live only while the node that unpacks them runs its backward.

Where the scope stays off (and the layer saves what it always saves): no gradient; torch.compile
(Inductor's partitioner makes its own recompute decisions); another ``saved_tensors_hooks`` already
active around the layer (gradient checkpointing, CPU offloading: theirs apply, not ours); the layer's
gradient checkpointing on. A recipe checks, when it is unpacked, that h and o were not modified in
place since the forward (the version counters), as autograd does for a saved tensor, and raises
autograd's error if they were. The norm weights are copied in the forward (H values each), so a
parameter that FSDP or DeepSpeed ZeRO-3 frees between forward and backward is never read again.
"""

from __future__ import annotations

import weakref

import torch

from tigon.ops.rms_norm import add_rms_norm, rms_norm

ADD_RMS_NORM_NODE = "add_rms_norm"  # the name of add_rms_norm's backward node starts so


def _hooks_active() -> bool:
    """Whether a saved_tensors_hooks context is active on this thread (checkpointing, offloading)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        return top(True) is not None  # True: report hooks even while dynamo traces
    except TypeError:  # pragma: no cover - another signature, or none: assume the worst, stay off
        return True


class _Recipe:
    """``compute()`` remade from ``inputs``; raises as autograd does if an input changed in place."""

    def __init__(self, compute, inputs):
        self.compute, self.inputs = compute, inputs
        self.versions = tuple(t._version for t in inputs)
        self.made = None  # weakref to the last tensor made: two unpacks while it lives share it

    def value(self) -> torch.Tensor:
        for t, version in zip(self.inputs, self.versions, strict=True):
            if t._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: a tensor of shape {tuple(t.shape)} the recompute_norms switch remakes a "
                    f"norm's output from is at version {t._version}; expected version {version} instead"
                )
        made = self.made() if self.made is not None else None
        if made is None:
            with torch.no_grad():
                made = self.compute()
            self.made = weakref.ref(made)
        return made


class _Packed:
    """What autograd holds instead of a saved tensor: its recipe and the saved view's geometry."""

    __slots__ = ("recipe", "shape", "stride", "offset")

    def __init__(self, recipe, t):
        self.recipe, self.shape, self.stride, self.offset = recipe, t.shape, t.stride(), t.storage_offset()

    def unpack(self) -> torch.Tensor:
        made = self.recipe.value()
        if made.shape == self.shape and made.stride() == self.stride and self.offset == 0:
            return made
        return made.as_strided(self.shape, self.stride, self.offset)


def _norm_args(norm, x):
    """The keywords the tigon RMSNorm module ``norm`` gives rms_norm / add_rms_norm for input x (its
    out_dtype read now: it depends on the autocast state of the forward), with a copy of its weight."""
    weight = norm.weight.detach().clone() if norm.weight is not None else None
    return weight, dict(eps=norm.variance_epsilon, offset=norm.offset, casting=norm.casting,
                        out_dtype=norm.output_dtype(x))


class _LayerScope(torch.autograd.graph.saved_tensors_hooks):
    """One forward of one decoder layer: which tensors made in it are remade, and their recipes."""

    def __init__(self, layer_input):
        self.layer_input = layer_input
        self.attention_output = None
        self.recipes = {}  # storage data_ptr -> (weakref to the tensor, its recipe)
        super().__init__(self._pack, self._unpack)

    def close(self):
        """Drop what the scope holds once the layer's forward is done. The recipes live on in the
        graph's saved entries, which hold them directly; the scope itself refers to its own bound
        methods (its hooks), a cycle that only the garbage collector would free, and with it the
        layer's input and attention output of the step before (12 KB a token a layer at Llama-1B's
        widths: as much as the switch saves)."""
        self.layer_input = self.attention_output = None
        self.recipes = {}
        self.pack_hook = self.unpack_hook = None

    def remake(self, t, recipe):
        self.recipes[t.untyped_storage().data_ptr()] = (weakref.ref(t), recipe, t._version, t.dtype)

    def _pack(self, t):
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.device.type == "meta":
            return t  # parameters, tensor subclasses (DTensor), sparse: kept as they are
        entry = self.recipes.get(t.untyped_storage().data_ptr())
        if entry is not None:
            ref, recipe, version, dtype = entry
            if ref() is not None and t._version == version and t.dtype == dtype:
                return _Packed(recipe, t)
        recipe = self._sum_recipe(t)
        return t if recipe is None else _Packed(recipe, t)

    @staticmethod
    def _unpack(packed):
        return packed.unpack() if isinstance(packed, _Packed) else packed

    def _sum_recipe(self, t):
        """s = o + h as add_rms_norm saves it (its second output), when o is narrower than s: o + h."""
        o, h = self.attention_output, self.layer_input
        node = t.grad_fn
        if (o is None or node is None or t.output_nr != 1 or not node.name().startswith(ADD_RMS_NORM_NODE)
                or not _made_from(node, o, h) or o.element_size() >= t.element_size()
                or t.dtype != torch.promote_types(o.dtype, h.dtype) or t.shape != h.shape):
            return None
        return _Recipe(lambda: torch.add(o, h), (o, h))


def _edge(t):
    """The node a tensor's gradient flows into: its grad_fn, or the leaf's AccumulateGrad (None when
    it needs none)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0] if t.requires_grad else None


def _made_from(node, o, h) -> bool:
    """Whether ``node`` (add_rms_norm's) took o as x and h as residual."""
    (first, _), (second, _) = node.next_functions[:2]
    return first is _edge(o) and second is _edge(h)


class LayerRecompute:
    """The switch on one pre-norm decoder layer: hooks on the layer (the scope around its forward), on
    its input norm (y₁), its attention (o) and its MLP (y₂); ``apply`` registers them, ``undo``
    removes them."""

    def __init__(self, layer):
        self.layer, self.handles, self.scopes = layer, [], []

    def apply(self):
        layer = self.layer
        self.handles = [
            layer.register_forward_pre_hook(self._enter, with_kwargs=True),
            layer.register_forward_hook(self._exit, always_call=True),
            layer.input_layernorm.register_forward_hook(self._input_norm),
            layer.self_attn.register_forward_hook(self._attention),
            layer.mlp.register_forward_pre_hook(self._mlp_input),
        ]

    def undo(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _active(self):
        if torch.compiler.is_compiling() or not self.scopes:
            return None
        return self.scopes[-1]

    def _enter(self, layer, args, kwargs):
        if torch.compiler.is_compiling():
            return  # traced as a no-op: nothing pushed, nothing for _exit to pop
        hidden = args[0] if args else kwargs.get("hidden_states")
        on = (torch.is_grad_enabled() and not _hooks_active()
              and not (layer.training and getattr(layer, "gradient_checkpointing", False))
              and isinstance(hidden, torch.Tensor) and hidden.requires_grad)
        scope = _LayerScope(hidden) if on else None
        self.scopes.append(scope)
        if scope is not None:
            scope.__enter__()

    def _exit(self, layer, args, output):
        if torch.compiler.is_compiling():
            return
        scope = self.scopes.pop() if self.scopes else None
        if scope is not None:
            scope.__exit__(None, None, None)
            scope.close()

    def _input_norm(self, norm, args, y):
        scope = self._active()
        h = args[0] if args else None
        if scope is None or h is not scope.layer_input or not isinstance(y, torch.Tensor):
            return
        weight, keywords = _norm_args(norm, h)
        scope.remake(y, _Recipe(lambda: rms_norm(h, weight, **keywords), (h,)))

    def _attention(self, attention, args, output):
        scope = self._active()
        if scope is not None:
            o = output[0] if isinstance(output, tuple) else output
            scope.attention_output = o if isinstance(o, torch.Tensor) else None

    def _mlp_input(self, mlp, args):
        scope = self._active()
        y = args[0] if args else None
        if scope is None or not isinstance(y, torch.Tensor) or y.grad_fn is None or y.output_nr != 0:
            return
        o, h, node = scope.attention_output, scope.layer_input, y.grad_fn
        if o is None or not node.name().startswith(ADD_RMS_NORM_NODE) or not _made_from(node, o, h):
            return
        weight, keywords = _norm_args(self.layer.post_attention_layernorm, h)
        scope.remake(y, _Recipe(lambda: add_rms_norm(o, h, weight, **keywords)[0], (o, h)))

