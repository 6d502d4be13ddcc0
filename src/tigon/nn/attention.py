"""``torch.nn.functional.scaled_dot_product_attention`` as two calls, forward and backward, for a node that
runs attention inside its own autograd Function (tigon.patching.fused_attention).

sdpa picks a backend with ``torch._fused_sdp_choice`` (its arguments, the user's
``torch.nn.attention.sdpa_kernel`` choices, the hardware), prepares the mask for it and calls that
backend's aten forward; its autograd formula (``derivatives.yaml``) then calls the backend's aten
backward with what the forward saved. :func:`attend` and :func:`attend_backward` make the same calls
on the same arguments, so they compute the same values as sdpa with the same kernels (cuDNN's
backward sums dq with atomics: bitwise only up to their order, as between two sdpa calls), and the
caller saves every tensor the backward reads through ``save_for_backward``, where saved-tensor hooks
(checkpointing, offloading) see it.

Two calls are made here, the two transformers' sdpa interface makes for a decoder's self-attention
over ``T ≥ 2`` queries:

- no mask: ``sdpa(q, k, v, is_causal=True, scale, enable_gqa=Hk < Hq)``;
- a boolean mask (padding, or a sliding window): ``sdpa(q, k, v, attn_mask, is_causal=False, scale)``
  with k and v already repeated to the query heads (transformers' ``repeat_kv``).

Backends called: cuDNN's and flash's on the GPU, the memory-efficient one on the GPU, flash's on the
CPU. Where sdpa would choose another (its math fallback) :func:`attend` returns None. The mask is
turned into the additive bias each backend takes as sdpa turns it (PyTorch 2.11's
``aten/src/ATen/native/transformers/attention.cpp``):

- cuDNN: ``where(~mask, -65504, 0)`` in q's dtype (a finite fill: cuDNN mishandles −∞ there);
- memory-efficient: ``where(~mask, −∞, 0)``, its rows' strides padded to a multiple of 8 elements
  where they are not (a copy, of which a view of the mask's width is taken), then expanded over
  (B, H, T, S);
- CPU flash: ``where(~mask, −∞, 0)``.

Flash on the GPU with a head size that is not a multiple of 8 is left to sdpa (it pads q, k and v
first); so is a masked call to flash, which sdpa never chooses.

One bias for all the layers. transformers makes one mask a forward pass and hands every layer the same
tensor; sdpa turns it into a bias in each layer, and each layer's backward keeps its own: ``B·T²`` elements a
layer (at 4 × 8192 tokens in bf16, 512 MB a layer, 12 GB for 24 layers). With a :class:`MaskBiases` the bias is
made once per mask tensor and bias kind, and every layer's node saves that one tensor (the same values: the same
operation on the same mask). A mask changed in place (its version counter) is turned again; the entry goes when
the mask does. Not while a CUDA graph is captured (a replay runs no Python to turn a changed mask again).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

aten = torch.ops.aten

# the ids torch._fused_sdp_choice returns
CUDNN = SDPBackend.CUDNN_ATTENTION.value
FLASH = SDPBackend.FLASH_ATTENTION.value
EFFICIENT = SDPBackend.EFFICIENT_ATTENTION.value

# cuDNN's fill for masked-out scores (attention.cpp's convert_boolean_attn_mask_cudnn)
CUDNN_MASKED = -65504.0
# the memory-efficient kernel's alignment of a bias's row strides, in elements (attention.cpp's preprocess_mask)
EFFICIENT_BIAS_ALIGNMENT = 8


def _additive(mask, fill, dtype):
    """``where(~mask, fill, 0)`` in ``dtype``, as sdpa turns a boolean mask into the bias it adds."""
    return torch.where(mask.logical_not(), fill, torch.zeros((), dtype=dtype, device=mask.device))


def _efficient_bias(bias, q, k):
    """The bias as the memory-efficient backend takes it: row strides aligned, expanded to (B, H, T, S)."""
    if any(bias.stride(i) % EFFICIENT_BIAS_ALIGNMENT for i in range(bias.dim() - 1)):
        width = bias.shape[-1]
        bias = F.pad(bias, (0, EFFICIENT_BIAS_ALIGNMENT - width % EFFICIENT_BIAS_ALIGNMENT))[..., :width]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


class MaskBiases:
    """The bias each backend adds for a boolean mask, made once per mask tensor (module docs): by the mask's
    identity, checked against its version and the bias's kind, dtype and shape; dropped with the mask."""

    def __init__(self):
        self.entries: dict[int, tuple] = {}

    def get(self, mask, signature, make):
        """``make()``, or what it made for this mask and ``signature`` before."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return make()
        key = id(mask)
        signature = (mask._version, *signature)
        entry = self.entries.get(key)
        if entry is not None and entry[0]() is mask and entry[1] == signature:
            return entry[2]
        bias = make()
        self.entries[key] = (weakref.ref(mask, lambda _, key=key: self.entries.pop(key, None)), signature, bias)
        return bias


def _bias(biases, mask, signature, make):
    """None without a mask (the causal call); else ``make()``, or the bias ``biases`` (a :class:`MaskBiases`,
    or None) made for this mask before."""
    if mask is None:
        return None
    return make() if biases is None else biases.get(mask, signature, make)


def attend(q, k, v, scale, *, gqa=False, mask=None, biases=None):
    """sdpa's forward without autograd, for the two calls of the module docs: ``(out, saved, sizes)`` where
    ``saved`` (tensors, some None) and ``sizes`` (ints and flags) are what :func:`attend_backward` takes,
    or None where sdpa would choose a backend not called here.

    q ``(B, Hq, T, D)``; k, v ``(B, Hk, T, D)`` with ``gqa`` (no mask), else ``(B, Hq, T, D)``; ``mask``
    boolean, broadcastable to ``(B, 1, T, T)``, True where a query attends to a key; ``biases`` a
    :class:`MaskBiases` that makes its bias once for all the calls with this mask (None: made here)."""
    causal = mask is None
    choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, causal, scale=scale, enable_gqa=gqa)
    signature = (q.dtype, q.shape, k.shape[2])
    if q.is_cuda:
        if choice == CUDNN:
            bias = _bias(biases, mask, (CUDNN, *signature), lambda: _additive(mask, CUDNN_MASKED, q.dtype))
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
                q, k, v, bias, True, 0.0, causal, False, scale=scale)
            return out, (lse, cum_q, cum_k, seed, offset, bias), (CUDNN, causal, max_q, max_k)
        if choice == FLASH and causal and q.shape[-1] % 8 == 0:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, True, False, scale=scale)
            return out, (lse, cum_q, cum_k, seed, offset, None), (FLASH, causal, max_q, max_k)
        if choice == EFFICIENT and not gqa:
            bias = _bias(biases, mask, (EFFICIENT, *signature),
                         lambda: _efficient_bias(_additive(mask, float("-inf"), q.dtype), q, k))
            out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, 0.0, causal, scale=scale)
            return out, (lse, None, None, seed, offset, bias), (EFFICIENT, causal)
        return None
    if choice == FLASH and q.device.type == "cpu":
        bias = _bias(biases, mask, (FLASH, *signature), lambda: _additive(mask, float("-inf"), q.dtype))
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, (lse, None, None, None, None, bias), (FLASH, causal)
    return None


def attend_backward(dout, q, k, v, out, saved, sizes, scale):
    """sdpa's backward of :func:`attend`'s call: ``(dq, dk, dv)``, each in its input's shape."""
    lse, cum_q, cum_k, seed, offset, bias = saved
    choice, causal, *maxima = sizes
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    if choice == CUDNN:
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, *maxima, 0.0, causal, scale=scale)
    if choice == FLASH:
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, *maxima, 0.0, causal, seed, offset, scale=scale)
    return aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)[:3]


def repeat_heads(t, groups):
    """``(B, Hk, T, D) → (B, Hk·groups, T, D)``, each head repeated ``groups`` times in place, as
    transformers' ``repeat_kv`` makes it (a copy); its gradient is :func:`sum_heads`."""
    batch, heads, length, dim = t.shape
    return t[:, :, None].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


def sum_heads(grad, groups):
    """The gradient of :func:`repeat_heads`: each group's heads summed (what autograd's expand backward sums)."""
    batch, heads, length, dim = grad.shape
    return grad.reshape(batch, heads // groups, groups, length, dim).sum(2)
