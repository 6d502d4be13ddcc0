"""transformers' sdpa attention call as one autograd node whose kernel outputs a checkpoint's recompute takes back:
``keep_attention`` (tigon.nn.kept_attention) for attention that does not run as tigon's attention node.

Families whose attention forward is not Llama's (Qwen3's and OLMo-2's q/k norms, Phi-3's fused qkv projection,
Gemma-3, ...) or a patch with ``fused_attention=False`` reach sdpa through transformers' ``"sdpa"`` attention
function, which tigon's wrapper of it (tigon.patching.band_attention) stands in front of. Inside a
:class:`~tigon.nn.kept_attention.KeptCall` (a checkpointed decoder layer under ``keep_attention``) the wrapper hands
the two calls transformers makes for a decoder's self-attention to :func:`kept_sdpa`:

- no mask: ``sdpa(q, k, v, is_causal=True, scale, enable_gqa=Hk < Hq)`` (transformers passes grouped heads as
  they are where the head size is at most 256, ``use_gqa_in_sdpa``);
- a boolean mask ``(B or 1, 1, T, T)``: ``sdpa(q, repeat_kv(k), repeat_kv(v), attn_mask, is_causal=False, scale)``.

:class:`KeptSdpa` makes the same backend calls as sdpa through ``tigon.nn.attention.attend`` (forward) and
``attend_backward`` (its backward, the one sdpa's autograd formula calls), with the forward's call going through
``kept_attention.attend``: the same values as sdpa and its backward, and no kernel in a recompute that finds the
forward's outputs kept. The repeat of k and v and, under autocast, the casts of sdpa's inputs
(:func:`_as_sdpa_casts`) stay outside the node: the same differentiable operations, in the same order, as
transformers' and autocast's, so that the backward sums the repeated heads' gradients after the cast back, as
stock's does. Where sdpa would choose a backend ``attend`` does not call (its math fallback), or the call is
another one (a float mask, a position bias, dropout, queries and keys of different lengths, no gradient),
:func:`kept_sdpa` returns None and transformers' function runs.
"""

from __future__ import annotations

import functools

import torch

from tigon.nn import attention, kept_attention

# the largest key/value head size with which transformers' sdpa function hands sdpa grouped heads without a mask
# (use_gqa_in_sdpa, 5.17 to 5.25); above it, it repeats k and v itself
GQA_HEAD_DIM = 256


def transformers_causal(module, kwargs) -> bool:
    """Whether transformers' sdpa function calls sdpa causal where it gets no mask: ``is_causal`` from the
    keywords, else the module's (true for every decoder layer)."""
    is_causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)


class _NotCalled(Exception):
    """sdpa would choose a backend ``attend`` does not call: raised before any side effect."""


class KeptSdpa(torch.autograd.Function):
    """sdpa over q ``(B, Hq, T, D)`` and k, v ``(B, Hk, T, D)``: causal, the heads grouped where ``gqa``, where
    ``mask`` is None, else over the boolean ``mask`` (k and v repeated to the query heads already, by the caller,
    as transformers repeats them), its bias made by ``biases`` (a ``MaskBiases``: one bias per mask for all the
    layers) or here; returns ``(B, Hq, T, D)``."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, gqa, biases):
        compute = functools.partial(attention.attend, q, k, v, scale, gqa=gqa, mask=mask, biases=biases)
        attended = kept_attention.attend(compute, q, k, v, mask, biases)
        if attended is None:
            raise _NotCalled
        out, saved, sizes = attended
        ctx.save_for_backward(q, k, v, out, *saved)
        ctx.meta = (scale, sizes)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, *saved = ctx.saved_tensors
        scale, sizes = ctx.meta
        return (*attention.attend_backward(dout, q, k, v, out, saved, sizes, scale), None, None, None, None)


def _as_sdpa_casts(query, key, value):
    """q, k and v in the dtype sdpa computes the call in: under autocast, cast as autocast casts sdpa's inputs (a
    floating-point input other than fp64 in another dtype goes to autocast's; the same differentiable copy), or
    None where they would still differ (sdpa refuses such a call)."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) if t.is_floating_point() and t.dtype not in (dtype, torch.float64) else t
                             for t in (query, key, value))
    return (query, key, value) if query.dtype == key.dtype == value.dtype else None


def kept_sdpa(module, query, key, value, attention_mask, kwargs) -> torch.Tensor | None:
    """transformers' ``sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)`` output
    ``(B, T, Hq, D)`` computed by :class:`KeptSdpa`, for the two calls of the module docs; None for any other."""
    groups = getattr(module, "num_key_value_groups", 1)
    length = query.shape[2] if query.dim() == 4 else -1
    causal = transformers_causal(module, kwargs)
    if (not torch.is_grad_enabled() or not isinstance(groups, int) or isinstance(groups, bool) or groups < 1
            or length < 2 or key.dim() != 4 or value.shape != key.shape
            or key.shape[2] != length or key.shape[0] != query.shape[0] or key.shape[1] * groups != query.shape[1]
            or not query.shape[-1] == key.shape[-1] == value.shape[-1]
            or kwargs.get("dropout", 0.0) or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("output_attentions", False)):
        return None
    mask = attention_mask
    if mask is None:
        if not causal or (groups > 1 and query.shape[-1] > GQA_HEAD_DIM):
            return None
    elif (type(mask) is not torch.Tensor or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1
          or mask.shape[0] not in (1, query.shape[0]) or tuple(mask.shape[2:]) != (length, length)):
        return None
    if mask is not None and groups > 1:  # transformers' repeat_kv, then autocast's casts: stock's graph
        key, value = attention.repeat_heads(key, groups), attention.repeat_heads(value, groups)
    inputs = _as_sdpa_casts(query, key, value)
    if inputs is None:
        return None
    try:
        holder = kept_attention.current()
        out = KeptSdpa.apply(*inputs, mask, kwargs.get("scaling"), mask is None and groups > 1,      # (B, Hq, T, D)
                             None if holder is None else holder.biases)
    except _NotCalled:
        return None
    return out.transpose(1, 2).contiguous()                                            # (B, T, Hq, D)
