"""Attention projections under autocast: one cast of the input for q/k/v, no saved weight copies.

Under ``torch.autocast`` the residual stream and the norm's output stay fp32 (fp32 weights), and
each of ``q_proj``, ``k_proj``, ``v_proj`` casts that same input to the autocast dtype on its own:
autocast caches casts of weights only. Each linear saves its own cast for the backward, so every
decoder layer keeps three identical (tokens, hidden) copies in bf16: 2 × 32 MB per layer more than
needed at Llama-3.2-1B's 8192 tokens × 2048 (1 GB over its 16 layers). Each linear also saves the
bf16 copy of its weight that autocast made, until the backward: 2 bytes per projection parameter
(0.34 GB at Llama-3.2-1B, 0.74 GB at Gemma-2-2B) while the fp32 weights are there anyway.

Here each projection (``o_proj`` too) runs :class:`_AutocastLinear`: the input is cast once per
attention module (:class:`CastCache`) and that one cast is what the three nodes save; the weight is
cast in the forward and again in the backward instead of being saved. The backward makes the same
products as the stock linear's (``dy·W`` for the input, ``dyᵀ·x`` for the weight, ``Σ dy`` for the
bias, in the autocast dtype) and casts them back to the dtypes of input, weight and bias as
autocast's casts do; each node returns its own fp32 input gradient and autograd sums the three in
fp32 as for the stock casts: losses and gradients are bitwise the stock ones. On the GPU the fp32
gradients (of an fp32 input, of an fp32 weight) are written in fp32 by the matmuls themselves
(:func:`tigon.ops._common.matmul_to`): their accumulators are not rounded to bf16 first, so those
gradients, and every gradient upstream of them, are nearer the exact ones than the stock's, and a
cast kernel per product is saved. Nothing changes
outside autocast, without grad, under torch.compile (Inductor plans its own buffers), or for a
projection that is not a plain ``nn.Linear`` (a LoRA wrapper keeps its own forward).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from tigon.ops._common import matmul_to


class _AutocastLinear(torch.autograd.Function):
    """``F.linear(cast, weight.to(dtype), bias.to(dtype))`` with ``cast`` = x in the autocast dtype
    (made by the caller, shared); saves ``cast`` and the weight itself, not its cast."""

    @staticmethod
    def forward(ctx, x, cast, weight, bias, dtype):
        ctx.save_for_backward(cast, weight)
        ctx.x_dtype, ctx.dtype = x.dtype, dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return F.linear(cast, weight.to(dtype), bias.to(dtype) if bias is not None else None)

    @staticmethod
    def backward(ctx, dy):
        cast, weight = ctx.saved_tensors
        need_x, _, need_w, need_b, _ = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])                           # (M, O)
        dx = dw = db = None
        if need_x:
            dx = matmul_to(dy2, weight.to(ctx.dtype), ctx.x_dtype).reshape(cast.shape)   # (..., I)
        if need_w:
            dw = matmul_to(dy2.t(), cast.reshape(-1, cast.shape[-1]), weight.dtype)   # (O, I)
        if need_b:
            db = dy2.sum(0).to(ctx.bias_dtype)
        return dx, None, dw, db, None


class CastCache:
    """The last input the projections of one attention module saw, and its cast (both held weakly:
    the nodes that saved the cast keep it alive exactly as long as the backward needs it)."""

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
    """``nn.Linear.forward`` under autocast without saved copies: the input's cast is shared with
    the sibling projections of the same attention module, the weight is cast again in the backward."""
    device_type = input.device.type
    if (
        torch.compiler.is_compiling()
        or not torch.is_grad_enabled()
        or device_type not in ("cuda", "cpu")
        or not torch.is_autocast_enabled(device_type)
    ):
        return F.linear(input, self.weight, self.bias)
    dtype = torch.get_autocast_dtype(device_type)
    eligible = (torch.float32, dtype)  # what autocast casts to dtype (or leaves as it is)
    if dtype == torch.float32 or input.dtype not in eligible or self.weight.dtype not in eligible or (
        self.bias is not None and self.bias.dtype not in eligible
    ):
        return F.linear(input, self.weight, self.bias)
    cast = input if input.dtype == dtype else getattr(self, CACHE_ATTR).cast(input, dtype)
    with torch.autocast(device_type, enabled=False):
        return _AutocastLinear.apply(input, cast, self.weight, self.bias, dtype)


shared_cast_linear._tigon = True
