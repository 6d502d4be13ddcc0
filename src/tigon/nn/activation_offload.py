r"""Activation offloading: what a decoder layer saves for its backward waits in host memory.

A training step keeps, for every layer, the tensors its backward reads (at Llama-3.2-1B's widths under
bf16 autocast about 56 KB a token a layer; with gradient checkpointing only the layer's input, 8 KB).
At long contexts those dominate GPU memory, while the host has room and the copy engines sit idle. A
:class:`LayerScope` is a ``saved_tensors_hooks`` scope entered around one layer's forward:

- **pack** (forward, each saved tensor): a CUDA tensor of at least ``min_bytes`` that is not a
  parameter (nor a view of one: the layer's weights are in GPU memory anyway) has the bytes of its
  storage copied into a pinned host buffer, on a side stream that first waits for the compute stream
  (so the copy reads the finished tensor) and runs alongside the next kernels. ``record_stream`` tells
  the caching allocator that the side stream still reads the storage, so that freeing the tensor does
  not hand its memory to a kernel queued before the copy ends. Autograd keeps a small handle instead
  of the tensor, and the GPU memory goes back to the allocator as soon as the forward drops its own
  references. Views of one storage (q, k, v of one projection; a tensor and its transpose) are copied
  once: the handle remembers each view's dtype, shape, strides and offset. A view that covers less
  than half of its storage has only its own span copied.
- **unpack** (backward): the first handle of layer i that the backward unpacks brings all of layer
  i's storages back (if they are not back already) and starts bringing layer i−1's, on the side stream,
  while layer i's backward computes; each unpack then makes the compute stream wait for its storage's
  copy event only. So the backward of layer i overlaps the host-to-device copy of layer i−1, and at
  most two layers' activations are in GPU memory at once.

With gradient checkpointing (either kind) the checkpoint saves only the layer's input inside the
scope (``CheckpointFunction.save_for_backward`` with ``use_reentrant=True``; the
``_NoopSaveInputs`` node with ``use_reentrant=False``) and its own hooks hold everything else: the scope
offloads that input, and the recompute in the backward (no scope is entered while a backward runs)
keeps its tensors on the GPU for the few kernels that read them. Where the checkpoint call is outside
the layer's hooks (transformers 5.17–5.22 checkpoint ``Module.__call__`` itself), :class:`ScopedCheckpoint`
enters the scope around that call instead.

What a layer keeps for its backward outside autograd's saved tensors goes the same way where its keeper asks:
:meth:`LayerScope.stow` during the forward (the scope entered around it is :func:`active_scope`) gives a handle
for the same bytes in the same group, and :func:`take_back` returns the tensor in the backward. With
``keep_attention`` the attention kernel's kept outputs (tigon.nn.kept_attention) wait on the host so, beside the
layer's checkpointed input, and come back with it, a layer ahead.

Exact: the bytes that come back are the bytes that went; a handle's view is rebuilt with the saved
geometry (``Tensor.set_`` on the restored storage), so every backward kernel reads what it would have.

Where the scope stays off (the layer saves what it always saves): no gradient; inside a backward (a
reentrant checkpoint's recompute); torch.compile; another ``saved_tensors_hooks`` already active around
the layer (a checkpoint wrapper around the whole layer, ``save_on_cpu``: theirs apply); a layer input
on a device type not in ``device_types`` (a CPU model: nothing to gain). Tensors that stay: those
under ``min_bytes`` (a norm's per-row statistics: their copies would cost more launches than memory),
parameters and views of them, tensor subclasses (DTensor), non-strided layouts. A weight's autocast copy
that a stock ``nn.Linear`` saves (bf16 of an fp32 weight) is a tensor of its own and goes like an
activation; tigon's patched projections and MLPs cast their weights again in the backward instead of
saving such copies.

Host buffers are pinned (page-locked, so that the copies are asynchronous DMA) and pooled by size.
Pinning is slow (``cudaHostAlloc`` maps pages) and the sizes repeat from step to step, so buffers are
reused; torch's pinned allocator rounds every block up to a power of two, so the pool's sizes are
powers of two and are the memory pinned. One buffer per copy would waste up to half of it (a layer
input of 2.8 GB, 8B widths at 342K tokens, would pin 4 GiB). So a copy of n bytes takes several
buffers (:func:`piece_sizes`): n is rounded up to a multiple of a granule g, a power of two at least
``bucket_bytes`` and at least 2^(⌊log₂ n⌋ − ``piece_bits``), and the set bits of that multiple are the
pieces, the largest first. Unused bytes are under g, at most n / 2^``piece_bits`` (1/16 by default)
beyond the smallest bucket, and a copy takes at most ``piece_bits`` + 1 buffers, one DMA copy each way
a buffer (a 2.8 GB input: 2 GiB + 512 MiB + 128 MiB). A buffer returns to the pool when the last handle
on its bytes is freed (the graph node that saved it ran its backward, or the graph was dropped); its
next writer is a copy on the same side stream, so it is stream-ordered after every read of it.
:attr:`Offloader.host_bytes` is the pinned memory held; :meth:`Offloader.release` frees what the
pool holds unused.

Bandwidth: each offloaded byte crosses PCIe twice (a PCIe 5 x16 link moves about 50 GB/s each way).
With gradient checkpointing that is 2·4·H bytes a token a layer against a layer's recompute and
backward (~6·12·H² flops a token at Llama widths): hidden under compute at any length. Without
checkpointing every saved byte crosses, and a layer's copy can take longer than its compute: the
step then waits for the copies (the side stream is one queue).
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch

from tigon.nn.checkpoint_chain import CheckpointWrap, CheckpointWrapper


@dataclass(frozen=True)
class OffloadConfig:
    """What is offloaded, and how host memory is held."""

    device_types: tuple[str, ...] = ("cuda",)  # tensors on these device types are offloaded
    min_bytes: int = 1 << 20  # smaller saved tensors stay where they are
    bucket_bytes: int = 1 << 21  # the smallest host buffer (rounded up to a power of two)
    piece_bits: int = 4  # a copy of n bytes leaves < n / 2**piece_bits unused, in ≤ piece_bits + 1 buffers
    pin_memory: bool = True  # page-locked host buffers (where CUDA is available; plain ones otherwise)

    def __post_init__(self):
        if not self.device_types or not all(isinstance(d, str) for d in self.device_types):
            raise ValueError(f"device_types must be a non-empty tuple of device type names, got {self.device_types!r}")
        for name, least in (("min_bytes", 0), ("bucket_bytes", 1), ("piece_bits", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer ≥ {least}, got {value!r}")


def piece_sizes(nbytes: int, config: OffloadConfig) -> list[int]:
    """The host buffers a copy of ``nbytes`` takes: powers of two, the largest first, summing to ``nbytes``
    rounded up to a multiple of the granule 2^max(⌊log₂ nbytes⌋ − piece_bits, ⌈log₂ bucket_bytes⌉)."""
    granule_bits = max(max(nbytes, 1).bit_length() - 1 - config.piece_bits, (config.bucket_bytes - 1).bit_length())
    total = -(-max(nbytes, 1) >> granule_bits) << granule_bits  # ceil(nbytes / granule) · granule
    return [1 << bit for bit in range(total.bit_length() - 1, granule_bits - 1, -1) if total >> bit & 1]


_active = threading.local()  # .scopes: this thread's entered LayerScopes, innermost last


def active_scope() -> LayerScope | None:
    """The innermost :class:`LayerScope` entered on this thread and not exited (a layer's forward that
    offloads), or None."""
    scopes = getattr(_active, "scopes", None)
    return scopes[-1] if scopes else None


def take_back(packed):
    """A tensor :meth:`LayerScope.pack` (or :meth:`LayerScope.stow`) gave a handle for, on its device again
    (the copy back started here unless the layer's group was reached already); anything else as it is."""
    if not isinstance(packed, _Handle):
        return packed
    stored = packed.stored
    if not stored.group.reached:
        stored.group.reached = True
        stored.offloader.restore_group(stored.group)
    first, packed.unpacked = not packed.unpacked, True
    device_bytes = stored.take(first)
    view = torch.empty(0, dtype=packed.dtype, device=device_bytes.device)
    return view.set_(device_bytes.untyped_storage(), packed.offset, packed.shape, packed.stride)


def _hooks_active() -> bool:
    """Whether a saved_tensors_hooks scope is active on this thread."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _bytes_of(storage: torch.UntypedStorage, device) -> torch.Tensor:
    """A flat uint8 tensor over ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class HostPool:
    """Host buffers by rounded size; thread-safe (autograd's device threads free handles too)."""

    def __init__(self, config: OffloadConfig):
        self.config = config
        self.free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.host_bytes = 0  # allocated, free or in use
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> list[torch.Tensor]:
        """Buffers for a copy of ``nbytes`` (:func:`piece_sizes`), from the pool where it has them. Where the
        host cannot give a new one, raises a RuntimeError saying how much is held and what to change; the
        pool is as it was."""
        sizes = piece_sizes(nbytes, self.config)
        with self.lock:
            buffers = [self.free[size].pop() if self.free[size] else size for size in sizes]
            new = sum(b for b in buffers if isinstance(b, int))
            self.host_bytes += new
            self.in_use_bytes += sum(sizes)
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        pin = self.config.pin_memory and torch.cuda.is_available()
        try:
            return [self.allocate(b, pin) if isinstance(b, int) else b for b in buffers]
        except (RuntimeError, MemoryError) as error:
            with self.lock:  # the new sizes were never held; the pooled buffers go back as give() returns them
                self.host_bytes -= new
                self.in_use_bytes -= new
            self.give([buffer for buffer in buffers if not isinstance(buffer, int)])
            kind = "pinned " if pin else ""
            raise RuntimeError(
                f"offload_activations: the host could not give {new / 2**30:.2f} GiB more of {kind}memory "
                f"({self.host_bytes / 2**30:.2f} GiB held for offloaded activations): shorten the sequence, turn "
                f"keep_attention off (its kept outputs wait on the host too), or give the job more host memory "
                f"({error})") from error

    @staticmethod
    def allocate(nbytes: int, pin: bool) -> torch.Tensor:
        """A new host buffer of ``nbytes``, page-locked where ``pin``."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def give(self, buffers: list[torch.Tensor]) -> None:
        with self.lock:
            for buffer in buffers:
                self.free[buffer.numel()].append(buffer)
                self.in_use_bytes -= buffer.numel()

    def release(self) -> None:
        with self.lock:
            for buffers in self.free.values():
                self.host_bytes -= sum(b.numel() for b in buffers)
            self.free.clear()


class _Group:
    """The storages one layer's forward offloaded; ``previous``: the layer that ran before it."""

    def __init__(self, previous):
        self.stored: list[weakref.ref] = []
        self.previous = weakref.ref(previous) if previous is not None else None
        self.reached = False  # the backward unpacked one of its handles


class _Stored:
    """One span of one storage on the host, and its copy back on the device while one is live."""

    def __init__(self, offloader, group, source: torch.Tensor, lo: int, hi: int):
        self.offloader, self.group, self.device = offloader, group, source.device
        self.nbytes = hi - lo
        self.host = offloader.pool.take(self.nbytes)
        self.pending = 0  # handles not unpacked yet: the restored copy is held strongly until they are
        self.restored = None  # strong reference (prefetched, awaited by a handle)
        self.restored_weak = None
        self.ready = None  # CUDA event: the restore's copy is done
        offloader.copy(self.pairs(_bytes_of(source.untyped_storage(), source.device)[lo:hi], to_host=True))
        weakref.finalize(self, offloader.pool.give, self.host)

    def pairs(self, device_bytes: torch.Tensor, to_host: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) of each host piece and its span of ``device_bytes``."""
        pairs, start = [], 0
        for piece in self.host:
            n = min(piece.numel(), self.nbytes - start)
            span, held = device_bytes[start: start + n], piece[:n]
            pairs.append((held, span) if to_host else (span, held))
            start += n
        return pairs

    def live_copy(self):
        if self.restored is not None:
            return self.restored
        return self.restored_weak() if self.restored_weak is not None else None

    def restore(self) -> torch.Tensor:
        """Start the copy back (on the side stream), unless a live copy exists; returns the copy."""
        device_bytes = self.live_copy()
        if device_bytes is None:
            device_bytes = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            self.ready = self.offloader.copy(self.pairs(device_bytes, to_host=False))
            self.restored = device_bytes
        return device_bytes

    def take(self, first_unpack: bool) -> torch.Tensor:
        device_bytes = self.restore()
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
        if first_unpack:
            self.pending -= 1
            if self.pending <= 0 and self.restored is not None:
                self.restored_weak, self.restored = weakref.ref(self.restored), None
        return device_bytes


class _Handle:
    """What autograd holds instead of a saved tensor: its bytes' record and its view's geometry."""

    __slots__ = ("stored", "dtype", "shape", "stride", "offset", "unpacked", "__weakref__")

    def __init__(self, stored: _Stored, t: torch.Tensor, offset: int):
        self.stored, self.dtype, self.shape, self.stride, self.offset = stored, t.dtype, t.shape, t.stride(), offset
        self.unpacked = False
        stored.pending += 1


class Offloader:
    """The offloading state of one model: config, host pool, side streams, the layer chain."""

    def __init__(self, config: OffloadConfig | None = None):
        self.config = config or OffloadConfig()
        self.pool = HostPool(self.config)
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.last_group = None  # weakref to the group of the layer that ran last
        self.live: dict[int, tuple[weakref.ref, int, int, int, weakref.ref]] = {}  # see LayerScope.pack
        self.lock = threading.Lock()

    def __getstate__(self):  # a copied or pickled model starts with its own empty pool and streams
        return {"config": self.config}

    def __setstate__(self, state):
        self.__init__(state["config"])

    @property
    def host_bytes(self) -> int:
        """Host memory held by the pool (in use or free), in bytes."""
        return self.pool.host_bytes

    @property
    def peak_host_bytes(self) -> int:
        """The most host memory in use at once, in bytes."""
        return self.pool.peak_in_use_bytes

    def release(self) -> None:
        """Free the host buffers the pool holds unused."""
        self.pool.release()

    def side_stream(self, device) -> torch.cuda.Stream:
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = torch.cuda.Stream(device)
        return stream

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        """``dst.copy_(src)`` for each (dst, src) pair, all between the host and one device (the pieces
        of one span); to or from a CUDA device on the side stream, after the compute stream's work so far,
        returning the event that marks the end of the last (None for plain copies)."""
        dst, src = pairs[0]
        device = dst.device if dst.device.type == "cuda" else src.device
        if device.type != "cuda":
            for dst, src in pairs:
                dst.copy_(src)
            return None
        compute, side = torch.cuda.current_stream(device), self.side_stream(device)
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        # The allocator may hand the device block to another tensor only after the side stream's copies
        # (the spans are views of one block: recording one records the block).
        (src if src.device.type == "cuda" else dst).record_stream(side)
        return done

    def group(self) -> _Group:
        previous = self.last_group() if self.last_group is not None else None
        group = _Group(previous)
        self.last_group = weakref.ref(group)
        return group

    def restore_group(self, group: _Group) -> None:
        """The backward reached ``group``'s layer: bring it back, and start on the layer before it."""
        for ref in group.stored:
            stored = ref()
            if stored is not None:
                stored.restore()
        previous = group.previous() if group.previous is not None else None
        if previous is not None:
            for ref in previous.stored:
                stored = ref()
                if stored is not None:
                    stored.restore()


class LayerScope(torch.autograd.graph.saved_tensors_hooks):
    """One forward of one layer: its saved tensors go to the host through ``offloader``."""

    def __init__(self, offloader: Offloader, layer: torch.nn.Module):
        self.offloader, self.layer = offloader, layer
        self.group = offloader.group()
        self.parameter_storages = None
        super().__init__(self.pack, self.unpack)

    def close(self) -> None:
        """Drop the scope's references once the forward is done (its bound hooks make a cycle)."""
        self.layer = self.group = None
        self.pack_hook = self.unpack_hook = None

    def offloadable(self, t) -> bool:
        config = self.offloader.config
        if (type(t) is not torch.Tensor or t.layout != torch.strided or t.device.type not in config.device_types
                or t.numel() == 0 or t.untyped_storage().nbytes() < config.min_bytes):
            return False
        pointer = t.untyped_storage().data_ptr()
        if self.parameter_storages is None or pointer not in self.parameter_storages:
            # Read again before a tensor is offloaded: FSDP2 unshards the layer's parameters in a pre-forward
            # hook, DeepSpeed ZeRO-3 gathers each submodule's just before that submodule runs.
            self.parameter_storages = {p.untyped_storage().data_ptr() for p in self.layer.parameters()
                                       if type(p) is torch.nn.Parameter}
        return pointer not in self.parameter_storages

    def pack(self, t):
        if not self.offloadable(t):
            return t
        offloader, storage = self.offloader, t.untyped_storage()
        size = t.element_size()
        span_lo = t.storage_offset() * size
        span_hi = span_lo + (sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) * size
        whole = 2 * (span_hi - span_lo) >= storage.nbytes()
        key = storage.data_ptr()
        with offloader.lock:
            entry = offloader.live.get(key)
        stored = None
        if entry is not None:
            # The same storage packed before (a view of it, or by another layer: rotary tables): its bytes
            # are on the host already if the tensor then packed is still alive (so the storage is the same
            # allocation; a temporary view that died meanwhile makes the bytes go again) and nothing wrote
            # to it since (views share the version counter), and if they cover this view's span.
            ref, version, lo, hi, stored_ref = entry
            before = ref()
            covered = lo <= span_lo and span_hi <= hi
            if before is not None and before._version == version == t._version and covered:
                stored = stored_ref()
        if stored is None:
            lo, hi = (0, storage.nbytes()) if whole else (span_lo, span_hi)
            stored = _Stored(offloader, self.group, t, lo, hi)
            self.group.stored.append(weakref.ref(stored))
            with offloader.lock:
                offloader.live[key] = (weakref.ref(t), t._version, lo, hi, weakref.ref(stored))
        else:
            _, _, lo, hi, _ = entry
        return _Handle(stored, t, t.storage_offset() - lo // size)

    def unpack(self, packed):
        return take_back(packed)

    def stow(self, t):
        """What the layer keeps for its backward outside autograd's saved tensors (kept attention outputs,
        tigon.nn.kept_attention): a handle whose bytes wait on the host with the layer's saved tensors and come
        back with them, a layer ahead in the backward (:func:`take_back`), or ``t`` itself where it stays."""
        return self.pack(t)

    def __enter__(self):
        super().__enter__()
        scopes = getattr(_active, "scopes", None)
        if scopes is None:
            scopes = _active.scopes = []
        scopes.append(self)
        return self

    def __exit__(self, *exc):
        scopes = getattr(_active, "scopes", [])
        for i in range(len(scopes) - 1, -1, -1):  # the innermost entry of this scope
            if scopes[i] is self:
                del scopes[i]
                break
        super().__exit__(*exc)
        with self.offloader.lock:  # forget storages whose tensors are gone
            live = self.offloader.live
            for key in [k for k, (ref, *_rest) in live.items() if ref() is None]:
                del live[key]


class ScopedCheckpoint(CheckpointWrapper):
    """A layer's checkpoint function that runs the checkpoint call inside the layer's scope (its ``owner``: the
    layer's :class:`LayerOffload`).

    transformers 5.17–5.22 checkpoint in ``GradientCheckpointingLayer.__call__``, around
    ``Module.__call__``: the layer's forward hooks (where :class:`LayerOffload` enters its scope) run inside
    the checkpoint, and the checkpoint saves the layer's input before them, outside any scope. Entering
    the scope around the checkpoint call offloads that input. From 5.23 the checkpoint runs inside
    ``forward``, after the pre-hook: the scope is active already and this wrapper only calls through."""

    def __call__(self, function, *args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        scope = None if torch.compiler.is_compiling() else self.owner.scope_for(hidden)
        if scope is None:
            return self.inner(function, *args, **kwargs)
        scope.__enter__()
        try:
            return self.inner(function, *args, **kwargs)
        finally:
            scope.__exit__(None, None, None)
            scope.close()


class LayerOffload(CheckpointWrap):
    """The switch on one layer: a scope around each of its training forwards (forward hooks, the
    pre-hook prepended so that it runs before any other scope's, recompute_norms' included, which then
    stays off), and around the checkpoint call where transformers checkpoints outside the hooks
    (:class:`ScopedCheckpoint`, kept around the layer's checkpoint function by :class:`CheckpointWrap`:
    ``caller``, the module whose forward calls the layer, gets a pre-hook that wraps the function
    ``gradient_checkpointing_enable()`` sets after the patch). ``apply`` registers the hooks, ``undo`` removes
    them and unwraps."""

    def __init__(self, layer: torch.nn.Module, offloader: Offloader, caller: torch.nn.Module | None = None):
        super().__init__(layer, caller)
        self.offloader = offloader
        self.scopes = threading.local()

    def __getstate__(self):  # the per-thread scope stacks are not copied (between forwards they are empty)
        return {k: v for k, v in vars(self).items() if k != "scopes"}

    def __setstate__(self, state):
        vars(self).update(state)
        self.scopes = threading.local()

    def wrapper(self, function) -> ScopedCheckpoint:
        return ScopedCheckpoint(self, function)

    def apply(self):
        self.handles = [
            self.layer.register_forward_pre_hook(self.enter, with_kwargs=True, prepend=True),
            self.layer.register_forward_hook(self.exit, always_call=True),
        ]
        super().apply()

    def scope_for(self, hidden) -> LayerScope | None:
        """A new scope for a forward of the layer on ``hidden``, or None where it stays off."""
        on = (torch.is_grad_enabled() and not _in_backward() and not _hooks_active()
              and isinstance(hidden, torch.Tensor) and hidden.device.type in self.offloader.config.device_types)
        return LayerScope(self.offloader, self.layer) if on else None

    def _stack(self) -> list:
        stack = getattr(self.scopes, "stack", None)
        if stack is None:
            stack = self.scopes.stack = []
        return stack

    def enter(self, layer, args, kwargs):
        if torch.compiler.is_compiling():
            return
        scope = self.scope_for(args[0] if args else kwargs.get("hidden_states"))
        self._stack().append(scope)
        if scope is not None:
            scope.__enter__()

    def exit(self, layer, args, output):
        if torch.compiler.is_compiling():
            return
        stack = self._stack()
        scope = stack.pop() if stack else None
        if scope is not None:
            scope.__exit__(None, None, None)
            scope.close()
