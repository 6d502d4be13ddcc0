"""One autocast copy of the attention input, shared by ``q_proj``, ``k_proj`` and ``v_proj``.

Under ``torch.autocast`` the residual stream and the norm's output stay fp32 (fp32 weights), and
each of the three projections casts that same input to the autocast dtype on its own: autocast
caches casts of weights only. Each linear saves its own cast for the backward, so every decoder
layer keeps three identical (tokens, hidden) copies in bf16: 2 × 32 MB per layer more than needed at
Llama-3.2-1B's 8192 tokens × 2048 (1 GB over its 16 layers).

Here the projections' forwards make the cast once and hand each projection its own autograd view
of it (:class:`_SharedCast`), so the saved copies are one storage. Each view's backward converts its
gradient to fp32 on its own, and autograd sums the three in fp32 exactly as for the stock casts:
losses and gradients are bitwise those of the stock projections. Nothing changes outside autocast,
without grad, under torch.compile (Inductor plans its own buffers), or for a projection that is not
a plain ``nn.Linear`` (a LoRA wrapper keeps its own forward).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F


class _SharedCast(torch.autograd.Function):
    """x → a view of ``cast`` (x already cast to the autocast dtype); the gradient goes back as x's dtype."""

    @staticmethod
    def forward(ctx, x, cast):
        ctx.dtype = x.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


class CastCache:
    """The last input the projections of one attention module saw, and its cast (both held weakly:
    the linears' saved views keep the cast alive exactly as long as the backward needs it)."""

    def __init__(self):
        self._input = self._cast = None
        self._version = self._dtype = None

    def cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self._input is not None and self._input() is x and self._version == x._version and self._dtype == dtype:
            cast = self._cast()
            if cast is not None:
                return cast
        cast = x.detach().to(dtype)
        self._input, self._cast = weakref.ref(x), weakref.ref(cast)
        self._version, self._dtype = x._version, dtype
        return cast

    def __getstate__(self):  # pickling or deep-copying a patched model drops the references
        return {}

    def __setstate__(self, state):
        self.__init__()


CACHE_ATTR = "_tigon_cast_cache"


def shared_cast_linear(self, input):
    """``nn.Linear.forward`` whose autocast cast of ``input`` is shared with its sibling projections."""
    device_type = input.device.type
    if (
        torch.compiler.is_compiling()
        or not torch.is_grad_enabled()
        or device_type not in ("cuda", "cpu")
        or not torch.is_autocast_enabled(device_type)
    ):
        return F.linear(input, self.weight, self.bias)
    dtype = torch.get_autocast_dtype(device_type)
    if input.dtype != torch.float32 or dtype == torch.float32:  # what autocast would not cast
        return F.linear(input, self.weight, self.bias)
    shared = _SharedCast.apply(input, getattr(self, CACHE_ATTR).cast(input, dtype))
    return F.linear(shared, self.weight, self.bias)


shared_cast_linear._tigon = True
