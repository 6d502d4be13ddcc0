r"""Decoder layers replayed as CUDA graphs (the ``cuda_graphs`` switch, off by default).

Why. A small model's training step is bound by the host, not the GPU: at Qwen2.5-0.5B's shapes, 4 × 2048
tokens, Python, the dispatcher and autograd measured longer issuing a step's ~1000 launches than the GPU
took to run them (docs/tuning.md, "Timings quoted in the source", "Whole-model steps").
A CUDA graph issues a layer's whole
forward, or its whole backward, as one launch: the host then costs one replay a layer and direction,
whatever the layer holds.

What. With the switch on, each decoder layer's forward (tigon's, from residual_joins.py, or the class's) runs,
in a training-mode forward that builds a graph for autograd on CUDA tensors, as an autograd node
(:class:`_Replay`) whose forward replays a captured forward graph and whose backward replays a
captured backward graph. Everything else (embeddings, final norm, loss, optimizer) stays eager.

How, for one layer and one input signature (shapes, strides, dtypes of the tensor arguments and the
values of the others; the autocast state), as ``torch.cuda.make_graphed_callables`` does:

1. Static inputs: the hidden states (the only argument that needs a gradient) are copied into a buffer
   of the layer's own, except where they are the previous layer's graph output: then that output *is*
   the input (no copy; the layers chain). The other tensor arguments (mask, cos/sin, position ids) go
   to buffers shared by the layers that receive the same tensor: the first layer of a step copies it
   and the others see it is there already (``_Slot``).
2. Warm-up: the layer's forward and backward run twice eagerly on a side stream, exactly as they will
   be captured (Triton compiles and loads its kernels, cuBLAS sets up; nothing touches ``.grad``).
3. Capture of the forward, then of the backward (``autograd.grad`` of the captured outputs over the
   input and aliases of the parameters: a parameter's own accumulator node remembers the default
   stream, which a capture must not touch), into the model's graph memory pool, with autocast's
   weight cache off (a cached cast would be read, not redone, by a replay). The backward is captured
   with ``retain_graph=True``: the captured forward's saved activations stay allocated for good.

Memory. The layers' graphs of one signature share a pool, captured layer by layer (forward, backward)
in the order a step replays them. A block that a graph holds past its replay (an output, a saved
activation) is owned for good, so no graph captured later can use it; one captured earlier can (its
temporaries), but it replays only before that block's content matters or after its last use. Each
signature has its own pool, since the graphs of two signatures replay interleaved within one pass. A
gradient that outlives the backward pass (a ``.grad``) must not sit in a pool at all: the graphs
captured before it would write their temporaries over it.

Gradients. The layer's input gradient goes to a buffer shared by all the layers (``GraphState.shared``)
that is also every layer's incoming-gradient buffer: layer i's backward replay writes it and layer
i-1's reads it in place. The parameters' gradients reach autograd as inputs of the node, so
``AccumulateGrad`` handles them as usual (gradient accumulation, DDP's hooks), from one buffer per
parameter outside the pools that the backward graph copies them into. ``AccumulateGrad`` adopts that
buffer as ``.grad`` when there is none (``zero_grad(set_to_none=True)``), so the layers' gradients
exist once; a ``.grad`` still holding it at the next backward (accumulation, or zeroed in place) is
moved out before the replay overwrites it.

The static buffers of a replay stay in use until its backward. A second forward of a layer before that
backward (a preference loss's chosen and rejected passes) runs eagerly, or replays another signature's
graphs, and the pass's gradients are then cloned out of the shared buffers (``GraphState.mixed``). A
layer whose shared input changed while another layer's backward still needs it runs eagerly too, as
does every call a graph cannot stand for: no gradient, eval mode, gradient checkpointing,
torch.compile tracing, hooks on the layer's submodules, a model sharded by FSDP2 or DeepSpeed ZeRO-3, a
key/value cache that holds past tokens, or a signature past the ``MAX_SIGNATURES`` a layer keeps
(warned once). Parameters replaced by new tensors (``.to()``, a checkpoint loaded with ``assign=True``)
drop the layer's graphs, which are captured again. A capture that fails leaves the model's layers eager
(warned once).

Costs and limits:
- Memory: the buffers above (the parameter gradients' stay allocated between steps, as with
  ``zero_grad(set_to_none=False)``), one input copy, and per signature the graphs' temporaries.
- GPU time: the copy of the parameter gradients into their buffers (8 bytes a parameter in fp32).
- A ``.grad`` kept past the next backward (a reference held across steps) is overwritten by it:
  clone it to keep it.
- The graph-replayed layers do not add their keys and values to a key/value cache passed empty (a
  training forward's, which nothing reads), as transformers does under gradient checkpointing.
- A second backward through the same forward (``retain_graph=True``) with another forward between
  them reads the later forward's activations; graphs assume one backward per forward.
- The first step of each signature runs each layer four times (warm-up, capture, replay) and
  synchronises the device around each capture.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from tigon.patching.layer_forward import CACHE_KWARGS

MAX_SIGNATURES = 2
WARMUP_RUNS = 2


class _Token:
    """One replay's claim on its entry's buffers, until its backward ran (``done``) or autograd freed it."""

    __slots__ = ("done", "__weakref__")

    def __init__(self):
        self.done = False


def _pending(ref) -> bool:
    token = ref() if ref is not None else None
    return token is not None and not token.done


def _buffer_like(tensor):
    """A buffer for ``tensor``'s values: its layout, or a dense one where it is broadcast (stride 0: a
    copy cannot write into memory that several elements share)."""
    if any(st == 0 and n > 1 for st, n in zip(tensor.stride(), tensor.shape, strict=True)):
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=tensor.device)


def _write(buffer, source):
    """Copy ``source`` into a static buffer without bumping its version counter: the captured forward's
    autograd graph saved the buffer, and autograd would take the copy for an in-place change of a saved
    tensor when the backward is captured."""
    with torch.autograd._unsafe_preserve_version_counter(buffer):
        buffer.detach().copy_(source)


class _Slot:
    """A static input buffer, shared by the layers that receive the same tensor in one step."""

    def __init__(self, tensor):
        self.buffer = _buffer_like(tensor)
        self.source, self.version, self.readers = None, -1, []
        self.fill(tensor)

    def holds(self, tensor) -> bool:
        source = self.source() if self.source is not None else None
        return source is tensor and tensor._version == self.version

    def fill(self, tensor) -> bool:
        """Make the buffer hold ``tensor``; False (nothing written) while a pending replay still reads it."""
        if self.holds(tensor):
            return True
        if any(_pending(ref) for ref in self.readers):
            return False
        _write(self.buffer, tensor)
        self.source, self.version, self.readers = weakref.ref(tensor), tensor._version, []
        return True


def _meta(t):
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


class GraphState:
    """What the layers of one model share: the memory pools (one per signature), the capture stream, the
    shared input and gradient buffers, and which tensors are graph outputs (so that layers chain)."""

    def __init__(self, root=None):
        self.root_ref = weakref.ref(root) if root is not None else (lambda: None)  # the patched model
        self.pools: dict = {}  # signature -> graph memory pool (see the module docs)
        self.stream = None
        self.slots: dict = {}
        self.outputs: dict = {}  # data_ptr of a graph output -> (its entry, the tensor)
        self.broken = None  # why a capture failed: its pool may be left mid-capture, so none follow
        self.grad_buffers: dict = {}
        self.tokens: list = []  # the replays whose backward has not run
        self.mixed = False  # a layer ran twice in this pass (see LayerGraphs.__call__)
        self.warned: set = set()

    def __reduce__(self):
        """A copy of the model (pickle, deepcopy) shares nothing captured: its layers capture their own graphs."""
        return type(self), (self.root_ref(),)

    def warn_once(self, key, message):
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(f"tigon cuda_graphs: {message}", stacklevel=4)

    def ready(self, signature):
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        if signature not in self.pools:
            self.pools[signature] = torch.cuda.graph_pool_handle()
        return self.pools[signature]

    def shared(self, key, like):
        """The gradient buffer ``key`` for tensors like ``like``, one for all the model's layers (see
        the module docs: each replay's gradients are consumed before the next replay writes them)."""
        key = (*key, _meta(like)[:4])
        buffer = self.grad_buffers.get(key)
        if buffer is None:
            buffer = self.grad_buffers[key] = _buffer_like(like)
        return buffer

    def slot_for(self, tensor) -> _Slot:
        """The shared buffer that holds ``tensor`` now, or a new one."""
        key = (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)
        slots = self.slots.setdefault(key, [])
        for slot in slots:
            if slot.holds(tensor):
                return slot
        slot = _Slot(tensor)
        slots.append(slot)
        return slot

    def chained(self, tensor):
        """(entry, output) when ``tensor`` is a graph output (same memory and layout), else None."""
        found = self.outputs.get(tensor.data_ptr())
        if found is not None:
            buffer = found[1]
            if buffer.shape == tensor.shape and buffer.stride() == tensor.stride() and buffer.dtype == tensor.dtype:
                return found
        return None


class _Entry:
    """One layer's graphs for one signature."""

    def __init__(self, state, pool, params, param_grads):
        self.state, self.pool, self.params, self.param_grads = state, pool, params, param_grads
        self.plan = []  # per argument leaf: ("input", static, producer entry or None) | ("slot", slot) | ("const",)
        self.fwd = self.bwd = None
        self.out_spec = self.out_leaves = None
        self.diff_outs = ()
        self.grad_outs = self.grad_returns = None
        self.token = None
        self.readers = []  # tokens of the entries whose input is this entry's output

    @property
    def inputs(self):
        return tuple(item[1] for item in self.plan if item[0] == "input")

    def pending(self) -> bool:
        return _pending(self.token) or any(_pending(ref) for ref in self.readers)

    # ------------------------------------------------------------------------------------- capture

    def capture_forward(self, layer, inner, leaves, spec):
        state = self.state
        static_leaves = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                self.plan.append(("const",))
                static_leaves.append(leaf)
            elif leaf.requires_grad:
                found = state.chained(leaf)
                if found is not None:
                    producer, buffer = found
                    static = buffer.detach().requires_grad_(True)
                else:
                    producer = None
                    static = _buffer_like(leaf)
                    _write(static, leaf)  # detached: the buffer is a leaf, not a copy node of the caller's graph
                    static.requires_grad_(True)
                self.plan.append(("input", static, producer))
                static_leaves.append(static)
            else:
                slot = state.slot_for(leaf)
                self.plan.append(("slot", slot))
                static_leaves.append(slot.buffer)
        args, kwargs = tree_unflatten(static_leaves, spec)
        # The graphs differentiate with respect to aliases of the parameters (the same memory), not the
        # parameters themselves: autograd runs a leaf's accumulator node on the stream it was made on,
        # and the parameters' were made on the default stream, which a capture must not touch.
        self.aliases = tuple(p.detach().requires_grad_(True) for p in self.params)
        wrt = self.inputs + self.aliases

        # Warm-up, exactly as the captures will run (retain_graph=True included: a backward that may free
        # its saved tensors can take other kernels): every Triton kernel compiled and loaded, cuBLAS set
        # up for this stream, before anything is captured (loading a module mid-capture breaks it).
        torch.cuda.synchronize()
        with torch.cuda.stream(state.stream), _no_autocast_cache(), _swapped(layer, self.params, self.aliases):
            for _ in range(WARMUP_RUNS):
                outs = [o for o in tree_flatten(inner(*args, **kwargs))[0] if isinstance(o, torch.Tensor)]
                needed = [o for o in outs if o.requires_grad]
                if needed:
                    grads = [_buffer_like(o).fill_(1.0) for o in needed]
                    torch.autograd.grad(needed, wrt, grads, retain_graph=True, allow_unused=True)
                del outs, needed
        torch.cuda.synchronize()

        self.fwd = torch.cuda.CUDAGraph()
        with _no_autocast_cache(), _swapped(layer, self.params, self.aliases), torch.cuda.graph(
            self.fwd, pool=self.pool, stream=state.stream, capture_error_mode="thread_local"
        ):
            out = inner(*args, **kwargs)
        self.out_leaves, self.out_spec = tree_flatten(out)
        self.diff_outs = tuple(o for o in self.out_leaves if isinstance(o, torch.Tensor) and o.requires_grad)
        for o in self.diff_outs:
            state.outputs[o.data_ptr()] = (self, o)

    def capture_backward(self):
        state = self.state
        self.grad_outs = tuple(state.shared(("grad", i), out) for i, out in enumerate(self.diff_outs))
        inputs = self.inputs
        targets = [state.shared(("grad", j), x) for j, x in enumerate(inputs)]
        self.bwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.bwd, pool=self.pool, stream=state.stream, capture_error_mode="thread_local"):
            result = torch.autograd.grad(
                self.diff_outs, inputs + self.aliases, self.grad_outs, retain_graph=True, allow_unused=True
            )
            for target, grad in zip(targets + list(self.param_grads), result, strict=True):
                if grad is not None:
                    target.copy_(grad)
        # The input gradients: aliases of the shared buffers, made once and kept, so that autograd, which
        # sees them referenced, never adopts one as a leaf's .grad. The parameter gradients: the layer's
        # buffers outside the pools, handed out as a fresh alias each backward, which AccumulateGrad
        # adopts as .grad when there is none (see backward).
        self.grad_returns = tuple(
            None if g is None else t.detach() for t, g in zip(targets, result[: len(inputs)], strict=True)
        )
        self.param_grads = tuple(None if g is None else t for t, g in zip(self.param_grads, result[len(inputs):],
                                                                          strict=True))

    # --------------------------------------------------------------------------------------- replay

    def load(self, leaves) -> bool:
        """Put this call's arguments into the static buffers; False: the graph cannot stand for it."""
        for item, leaf in zip(self.plan, leaves, strict=True):
            kind = item[0]
            if kind == "slot":
                if not item[1].fill(leaf):
                    return False
            elif kind == "input":
                static, producer = item[1], item[2]
                if leaf.data_ptr() != static.data_ptr():
                    if producer is not None and producer.pending():
                        return False
                    _write(static, leaf)
        return True

    def backward(self, grads):
        for static, grad in zip(self.grad_outs, grads, strict=True):
            if grad.data_ptr() != static.data_ptr():  # the next layer's replay wrote it there already
                _write(static, grad)
        for p, g in zip(self.params, self.param_grads, strict=True):
            if g is not None and p.grad is not None and p.grad.data_ptr() == g.data_ptr():
                # The last backward's gradient, adopted as .grad and not zeroed away (accumulation):
                # move it out before the replay overwrites it.
                p.grad = p.grad.clone()
        self.bwd.replay()
        return self.grad_returns + tuple(None if g is None else g.detach() for g in self.param_grads)


class _Replay(torch.autograd.Function):
    """One layer's forward and backward as graph replays; the inputs are the hidden states and the
    parameters, so that autograd routes their gradients."""

    @staticmethod
    def forward(ctx, entry, token, *inputs):
        entry.fwd.replay()
        ctx.entry, ctx.token = entry, token
        return tuple(o.detach() for o in entry.diff_outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        returns = ctx.entry.backward(grads)
        ctx.token.done = True
        if ctx.entry.state.mixed:
            returns = tuple(None if g is None else g.clone() for g in returns)
        return (None, None) + returns


class _swapped:
    """``layer``'s submodules hold ``aliases`` in place of ``params`` (by identity) while inside."""

    def __init__(self, layer, params, aliases):
        self.layer, self.map = layer, {id(p): a for p, a in zip(params, aliases, strict=True)}

    def __enter__(self):
        self.undo = []
        for module in self.layer.modules():
            for name, value in module._parameters.items():
                alias = self.map.get(id(value))
                if alias is not None:
                    self.undo.append((module, name, value))
                    module._parameters[name] = alias

    def __exit__(self, *exc):
        for module, name, value in self.undo:
            module._parameters[name] = value


class _no_autocast_cache:
    """Autocast as it is, without its weight-cast cache, for warm-up and capture."""

    def __enter__(self):
        self.ctx = None
        if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
            self.ctx = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def _foreign_parameters(params, root) -> str | None:
    """Why these parameters cannot be baked into a graph (sharded, gathered anew each call), or None.

    FSDP2 shows in two ways. Outside its forward a sharded module's parameters are DTensors; but a
    layer's forward runs after FSDP2's pre-forward hook has gathered them and swapped the module's
    parameters for plain unsharded tensors, so the model (``root``) is searched for a module that
    ``fully_shard`` wrapped as well (whether the layers or only the root were sharded).
    """
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch built without distributed
        DTensor = FSDPModule = ()
    for p in params:
        if hasattr(p, "ds_id"):
            return "DeepSpeed ZeRO-3 parameters"
        if isinstance(p, DTensor):
            return "FSDP2 (DTensor) parameters"
    if root is not None and any(isinstance(m, FSDPModule) for m in root.modules()):
        return "FSDP2 (fully_shard) parameters"
    return None


class LayerGraphs:
    """The cuda_graphs runner of one decoder layer (called by layer_forward.LayerForward)."""

    def __init__(self, layer, state: GraphState):
        self.layer_ref = weakref.ref(layer)
        self.state = state
        self.entries: dict = {}
        self.params = None
        self.submodules = None
        self.disabled = None
        self.replays = 0
        self.param_grads = None  # the layer's parameter gradients as its graphs hand them to autograd

    def __reduce__(self):
        """A copy of the layer (pickle, deepcopy) starts without graphs, as the layer did when patched."""
        return type(self), (self.layer_ref(), self.state)

    def _eligible(self, layer) -> bool:
        if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not layer.training:
            return False
        if getattr(layer, "gradient_checkpointing", False) or self.disabled is not None or self.state.broken:
            return False
        if self.submodules is None:
            self.submodules = [m for m in layer.modules() if m is not layer]
        return not any(
            m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
            for m in self.submodules
        )

    def _drop(self):
        """Forget this layer's graphs (their buffers stay allocated while another layer's graph reads them)."""
        state = self.state
        for entry in self.entries.values():
            for out in entry.diff_outs:
                state.outputs.pop(out.data_ptr(), None)
        self.entries.clear()
        self.submodules = None
        self.param_grads = None

    def __call__(self, inner, args, kwargs):
        layer = self.layer_ref()
        if layer is None or not self._eligible(layer):
            return inner(*args, **kwargs)
        state = self.state
        if not any(_pending(ref) for ref in state.tokens):  # mid-pass, the first token is pending: one check
            state.tokens.clear()
            state.mixed = False  # a new pass, every earlier backward done
        if any(entry.pending() for entry in self.entries.values()):
            # This layer runs again before the backward of its replay: two gradients of its parameters
            # meet in autograd's buffers, so the replays' gradients cannot stay in the shared buffers.
            state.mixed = True
        for name in CACHE_KWARGS:
            cache = kwargs.get(name)
            if cache is not None:
                if not hasattr(cache, "get_seq_length") or cache.get_seq_length() != 0:
                    return inner(*args, **kwargs)
                kwargs = {**kwargs, name: None}
        leaves, spec = tree_flatten((args, kwargs))
        signature = [spec, torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if not leaf.is_cuda:
                    return inner(*args, **kwargs)
                signature.append(_meta(leaf))
            else:
                signature.append(leaf)
        try:
            signature = tuple(signature)
            hash(signature)
        except TypeError:
            return inner(*args, **kwargs)
        params = self._parameters(layer)
        if params is None:
            return inner(*args, **kwargs)
        entry = self.entries.get(signature)
        if entry is None:
            if len(self.entries) >= MAX_SIGNATURES:
                self.state.warn_once(("signatures", type(layer)), (
                    f"{type(layer).__name__} was called with more than {MAX_SIGNATURES} input signatures (shapes, "
                    "dtypes); the others run eagerly. Pad batches to a few fixed shapes to keep them graphed."))
                return inner(*args, **kwargs)
            entry = self._capture(layer, inner, leaves, spec, params, signature)
            if entry is None:
                return inner(*args, **kwargs)
        elif entry.pending() or not entry.load(leaves):
            return inner(*args, **kwargs)
        token = _Token()
        entry.token = weakref.ref(token)
        ref = entry.token
        state.tokens.append(ref)
        for item in entry.plan:
            if item[0] == "slot":
                item[1].readers.append(ref)
            elif item[0] == "input" and item[2] is not None:
                producer = item[2]
                producer.readers = [r for r in producer.readers if _pending(r)] + [ref]
        # The node's inputs are the caller's tensors (their history leads to the previous layers), not
        # the static buffers they were copied into.
        inputs = [leaf for item, leaf in zip(entry.plan, leaves, strict=True) if item[0] == "input"]
        outs = iter(_Replay.apply(entry, token, *inputs, *entry.params))
        self.replays += 1
        result = [next(outs) if isinstance(o, torch.Tensor) and o.requires_grad else o for o in entry.out_leaves]
        return tree_unflatten(result, entry.out_spec)

    def _parameters(self, layer):
        """The layer's trainable parameters, after dropping graphs made with other tensors; None: none can be made."""
        params = tuple(p for p in layer.parameters() if p.requires_grad)
        if self.params is not None and (
            len(params) != len(self.params)
            or any(p is not q or p.data_ptr() != ptr for p, q, ptr in zip(params, self.params, self.ptrs, strict=True))
        ):
            self._drop()
            self.params = None
        if self.params is None:
            why = _foreign_parameters(params, self.state.root_ref())
            if why is not None or any(not p.is_cuda for p in params):
                self.disabled = why or "parameters off the GPU"
                self.state.warn_once(("foreign", why), f"{why}: decoder layers run eagerly")
                return None
            self.params, self.ptrs = params, tuple(p.data_ptr() for p in params)
        return self.params

    def _capture(self, layer, inner, leaves, spec, params, signature):
        pool = self.state.ready(signature)
        if self.param_grads is None:  # outside the pools: .grad may hold them across replays
            self.param_grads = tuple(torch.empty_like(p) for p in params)
        entry = _Entry(self.state, pool, params, self.param_grads)
        try:
            entry.capture_forward(layer, inner, leaves, spec)
            entry.capture_backward()
        except Exception as exc:  # an op that cannot be captured: the model's layers stay eager
            self.state.broken = f"{type(exc).__name__}: {exc}"
            self.state.warn_once("capture", (
                f"{type(layer).__name__} could not be captured ({self.state.broken}); the layers run eagerly"))
            return None
        self.entries[signature] = entry
        return entry
