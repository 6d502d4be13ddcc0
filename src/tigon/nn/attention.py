"""A decoder's self-attention as one autograd node, and sdpa's backends called directly.

The node (:class:`AttentionNode`): q/k/v, rotary, sdpa and o_proj in eager training.

Why: a small model's eager step is bound by the host that launches it, not by the GPU (Qwen2.5-0.5B,
4 × 2048 tokens on the H100: ~43 ms of host forward and ~57 ms of backward a step against ~85 ms of
GPU work, ``benchmarks/results/2026-11-26/host_profile-qwen2-stacked-*.log``), and stock attention is
the densest part of that host work. transformers' attention forward makes ~14 autograd nodes a layer:
the projections, a ``view`` and a ``transpose`` of each of q, k and v, the rotary, sdpa, and a
transpose, copy and view of its output before ``o_proj``; each is built in the forward and run by the
engine in the backward, around a handful of kernels. Here the whole module is one node, whose forward
and backward launch only the kernels::

    forward    W = [Wq; Wk; Wv] (cast and stacked by one launch, Wo's cast with it)
               qkv = x Wᵀ + b                      one matmul, (B, T, (Hq + 2 Hk) D)
               q, k ← rope(q, k)                   in place, inside qkv (rope_into)
               a = sdpa(q, k, v, causal)           sdpa's chosen backend, on views of qkv
               y = a Woᵀ + bo
    backward   da = dy Wo,  dWo = dyᵀ a,  dbo = Σ dy
               dq, dk, dv = that backend's backward (da)
               dqkv = [rope⁻¹(dq) | rope⁻¹(dk) | dv]   (the rotation's transpose, into one buffer)
               dx = dqkv W,  dW = dqkvᵀ x,  db = Σ dqkv  (one product or sum each; row blocks back)

The values are stock's: the projections are the same products (stacked, as the ``rope`` switch's
shared-cast node already makes them on the GPU), the rotation computes in fp32 and rounds once to the
compute dtype (what sdpa under autocast reads of stock's fp32 rotary output), and attention is what
``torch.nn.functional.scaled_dot_product_attention`` computes for transformers' sdpa interface's call:
without a mask, causal with ``enable_gqa``; with its boolean mask (padding, or a window the mask
encodes), the mask with k and v repeated to the query heads first. The node makes that call through
sdpa's chosen backend, whose aten forward and backward it calls itself (:func:`attend`), so
its saved tensors are all ``save_for_backward``'s and saved-tensor hooks see them: checkpointing of
either kind recomputes the node, ``recompute_norms`` remakes its input, ``cuda_graphs`` captures it.
Rotating in place also saves the rotated copies of q and k that stock keeps for the backward, and the
layers share one mask bias where sdpa makes and keeps one a layer (:class:`MaskBiases`).

LoRA. Where q, k, v and o are PEFT LoRA linears (:func:`tigon.nn.lora.lora_projection`: one active
adapter, dropout 0, no variant), each projection p computes ``x Wₚᵀ + bₚ + sₚ·(x Aₚᵀ) Bₚᵀ``, and the node
adds the low-rank products to the base ones (:mod:`tigon.nn.lora`'s stacked products; a projection
without an adapter adds none). q, k and v read one input, so their A's stack into one
``[A_q; A_k; A_v]`` (R, H), R = r_q + r_k + r_v::

    forward    Ũ = x̃ Aᵀ, block p scaled by sₚ        (M, R), one product; x̃ the cast input
               qkv[:, p] += Ũₚ Bₚᵀ                   into each column block, before the rotary
               Ũ_o = s_o · a A_oᵀ,  y += Ũ_o B_oᵀ    a the attention output o_proj reads
    backward   P_o = s_o · dy B_o,   da += P_o A_o
               dA_o = P_oᵀ a,        dB_o = dyᵀ Ũ_o
               Pₚ = sₚ · dqkvₚ Bₚ  (P = [P_q | P_k | P_v]),  dx += P A   (before dx's cast)
               dA = Pᵀ x̃ (split into the A_p),  dBₚ = dqkvₚᵀ Ũₚ

(the chain rule on ``yₚ = sₚ·(x Aₚᵀ) Bₚᵀ``: ``dBₚ = sₚ·dyₚᵀ (x Aₚᵀ)``, ``dAₚ = sₚ·(dyₚ Bₚ)ᵀ x``,
``dx = sₚ·(dyₚ Bₚ) Aₚ``; the scales ride on Ũ and P). The rotary and sdpa see q, k, v with their deltas,
so dqkv is the gradient of the projections' sums as before; x̃ and a are saved already, Ũ and Ũ_o
(R and r_o columns) and the cast adapters are saved besides. The base weights get dW where they are
trainable, as without adapters. Precision as in :mod:`tigon.nn.lora`: the products in the compute dtype,
fp32 adapters cast to it, their gradients back in their own dtype.

QLoRA. A projection over a bitsandbytes 4-bit base comes as a :class:`~tigon.nn.quantized_base.QuantizedWeight`
(the packed weight and its state) in Wₚ's place, and the node computes what bitsandbytes computes: Wₚ
dequantized in the layer's compute dtype C (cast to the node's: autocast's, where C is fp32) for the forward's
product, dequantized again in the backward for dx (as bitsandbytes' backward: from the dtype it was quantized
from, cast to the gradient's), no dWₚ. Nothing dequantized is kept from the forward to the backward; each
dequantized weight lives for the product that reads it. The three of q, k, v are dequantized and stacked into
the one W as plain weights are: the output column of row j of W is the same dot product over H, ``x·Wⱼ``, as
in bitsandbytes' product over Wₚ alone, and dx = dqkv W is Σₚ dqkvₚ Wₚ, which stock sums over the three
projections' gradients (the sums' order, and a GEMM's blocking chosen by the output's width, within the
compute dtype's rounding; in fp32 within 1e-4 of PEFT + bitsandbytes, tests/patching/test_qlora_peft.py).
``tigon.patching.fused_attention`` runs the node where C is the node's dtype (x's without autocast, fp32 or
the autocast dtype under it).

Where it runs is decided by ``tigon.patching.fused_attention`` (the ``fused_attention`` switch), at each call.

The backends (:func:`attend`, :func:`attend_backward`): ``torch.nn.functional.scaled_dot_product_attention``
as two calls, forward and backward, for a node that runs attention inside its own autograd Function (the node
above).

sdpa picks a backend with ``torch._fused_sdp_choice`` (its arguments, the user's
``torch.nn.attention.sdpa_kernel`` choices, the hardware), prepares the mask for it and calls that
backend's aten forward; its autograd formula (``derivatives.yaml``) then calls the backend's aten
backward with what the forward saved. :func:`attend` and :func:`attend_backward` make the same calls
on the same arguments, so they compute the same values as sdpa with the same kernels (cuDNN's
backward sums dq with atomics: bitwise only up to their order, as between two sdpa calls), and the
caller saves every tensor the backward reads through ``save_for_backward``, where saved-tensor hooks
(checkpointing, offloading) see it.

Under non-reentrant gradient checkpointing with the ``keep_attention`` switch, the node's backend call goes through
:func:`tigon.nn.kept_attention.attend`: the forward's outputs are kept, and the recompute in the backward takes
them back instead of calling the backend again.

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

import functools
import weakref

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from tigon._kernels import cast_stacked, function_apply, matmul_to, sum_rows_to
from tigon.nn import kept_attention
from tigon.nn.lora import Adapters, adapters_forward, adapters_input_grads, adapters_weight_grads, cast_adapters
from tigon.nn.quantized_base import backward_weights, forward_weight, forward_weights, joined, split_saved, unquantized
from tigon.ops.rope import rope_into

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

    def __getstate__(self):  # a copy starts empty: its entries are the original's masks' (weak references)
        return {}

    def __setstate__(self, state):
        self.entries = {}

    def holds(self, tensor) -> bool:
        """Whether ``tensor`` is a bias made here (one that the layers share)."""
        return any(entry[2] is tensor for entry in self.entries.values())

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


class AttentionNode(torch.autograd.Function):
    """A decoder's self-attention module as one node (module docs, "The node"). ``dtype``: the compute dtype
    (autocast's, or that of the weights and the input); weights and biases come back in their own dtypes, the
    input's gradient in the input's. ``q_lora_a`` ... ``o_lora_b``: each projection's LoRA A and B (None: no
    adapter), ``scalings`` their s (module docs, "LoRA"). A weight may be a bitsandbytes 4-bit base's
    :class:`~tigon.nn.quantized_base.QuantizedWeight` (module docs, "QLoRA"): kept on the context, not saved."""

    @staticmethod
    def forward(ctx, x, cos, sin, mask, dtype, shape, q_weight, q_bias, k_weight, k_bias, v_weight, v_bias,
                o_weight, o_bias, cache, cache_arguments, biases, q_lora_a=None, q_lora_b=None, k_lora_a=None,
                k_lora_b=None, v_lora_a=None, v_lora_b=None, o_lora_a=None, o_lora_b=None, scalings=(0.0,) * 4):
        heads, kv_heads, head_dim, scale = shape
        batch, seq = x.shape[0], x.shape[1]
        cast = x if x.dtype == dtype else x.to(dtype)
        weight, bias, (o_w, o_b) = cast_stacked(                                # one launch
            forward_weights((q_weight, k_weight, v_weight), dtype), (q_bias, k_bias, v_bias), dtype,
            (*unquantized((o_weight,)), o_bias))
        qkv = F.linear(cast, weight, bias).view(batch, seq, heads + 2 * kv_heads, head_dim)
        weight = bias = None
        widths = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        lora = ((q_lora_a, q_lora_b), (k_lora_a, k_lora_b), (v_lora_a, v_lora_b))
        which = tuple(i for i, (lora_a, _) in enumerate(lora) if lora_a is not None)  # q, k, v with adapters
        qkv_adapters = o_adapters = u_qkv = u_o = None
        if which:  # before the rotary, which reads q and k with their deltas
            qkv_adapters, (o_cast_a, o_cast_b) = cast_adapters(                          # one launch, o's with them
                [lora[i][0] for i in which], [lora[i][1] for i in which], [scalings[i] for i in which], dtype,
                (o_lora_a, o_lora_b))
            outs = qkv.view(batch * seq, -1).split_with_sizes(widths, dim=1)   # (M, O_p) column views
            u_qkv = adapters_forward(cast.reshape(-1, cast.shape[-1]), qkv_adapters, [outs[i] for i in which])
            if o_cast_a is not None:
                o_adapters = Adapters(o_cast_a, (o_cast_b,), (o_cast_a.shape[0],), (scalings[3],))
        elif o_lora_a is not None:
            o_adapters, _ = cast_adapters([o_lora_a], [o_lora_b], [scalings[3]], dtype)
        q, k, v = qkv.split_with_sizes((heads, kv_heads, kv_heads), dim=2)     # (B, T, H, D) views
        if cos is not None:                                                     # a layer with a rotary
            rope_into(q, k, q, k, cos, sin)                                     # in place
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)     # (B, H, T, D) views
        # transformers' two sdpa calls: without a mask, causal, grouped heads as they are; with one, k and v
        # repeated to the query heads first (repeat_kv; the cache takes them as they were)
        groups = heads // kv_heads if mask is not None else 1
        k_attended, v_attended = (k, v) if groups == 1 else (repeat_heads(k, groups), repeat_heads(v, groups))
        # under gradient checkpointing with keep_attention, the recompute takes the forward's kernel outputs back
        compute = functools.partial(attend, q, k_attended, v_attended, scale, gqa=mask is None and kv_heads != heads,
                                    mask=mask, biases=biases)
        attended = kept_attention.attend(compute, q, k_attended, v_attended, mask, biases)
        if attended is None:
            raise NotCalledHere  # before any side effect: the caller runs the attention's own forward
        out, saved, sizes = attended                                            # (B, Hq, T, D)
        if cache is not None:  # empty before (the caller checked): it keeps its own copies of k and v
            cache_update(cache, k, v, cache_arguments)
        # (B, T, Hq D): a view, the backends writing out as (B, T, Hq, D); the backward views it back
        a = out.transpose(1, 2).reshape(batch, seq, heads * head_dim)
        out = None
        y = F.linear(a, forward_weight(o_weight, o_w, dtype), o_b)
        o_w = None
        if o_adapters is not None:
            u_o = adapters_forward(a.reshape(-1, a.shape[-1]), o_adapters, [y.view(-1, y.shape[-1])])
        lora_saved = [t for adapters, u in ((qkv_adapters, u_qkv), (o_adapters, u_o)) if adapters is not None
                      for t in (adapters.lora_a, *adapters.lora_bs, u)]
        base_weights, ctx.quantized = split_saved((q_weight, k_weight, v_weight, o_weight))
        ctx.save_for_backward(cast, a, cos, sin, *base_weights, q, k_attended, v_attended, *saved, *lora_saved)
        ctx.meta = (x.dtype, dtype, shape, tuple(None if b is None else b.dtype for b in (q_bias, o_bias)), sizes,
                    groups)
        ctx.lora = (which, o_adapters is not None, len(saved), tuple(scalings),
                    tuple(None if t is None else t.dtype for t in (q_lora_a, q_lora_b, k_lora_a, k_lora_b, v_lora_a,
                                                                   v_lora_b, o_lora_a, o_lora_b)))
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        cast, a, cos, sin, q_weight, k_weight, v_weight, o_weight, q, k, v, *saved = ctx.saved_tensors
        q_weight, k_weight, v_weight, o_weight = joined((q_weight, k_weight, v_weight, o_weight), ctx.quantized)
        x_dtype, dtype, (heads, kv_heads, head_dim, scale), (qkv_bias_dtype, o_bias_dtype), sizes, groups = ctx.meta
        which, o_lora, n_saved, scalings, lora_dtypes = ctx.lora
        saved, lora_saved = saved[:n_saved], saved[n_saved:]
        qkv_adapters = o_adapters = u_qkv = u_o = None
        if which:
            lora_a, *lora_bs, u_qkv = lora_saved[:len(which) + 2]
            lora_saved = lora_saved[len(which) + 2:]
            qkv_adapters = Adapters(lora_a, tuple(lora_bs), tuple(b.shape[1] for b in lora_bs),
                                    tuple(scalings[i] for i in which))
        if o_lora:
            lora_a, lora_b, u_o = lora_saved
            o_adapters = Adapters(lora_a, (lora_b,), (lora_b.shape[1],), (scalings[3],))
        # x, cos, sin, mask, dtype, shape, (weight, bias) of q, k, v, o, cache, its arguments, the mask biases,
        # (A, B) of q, k, v, o, their scalings
        needs = ctx.needs_input_grad
        batch, seq = cast.shape[0], cast.shape[1]
        dy2 = dy.reshape(-1, dy.shape[-1]).to(dtype)                             # (M, H)
        weight, _, (o_w,) = cast_stacked(backward_weights((q_weight, k_weight, v_weight), dtype), (None, None, None),
                                         dtype, backward_weights((o_weight,), dtype))
        grads = [None] * len(needs)
        if needs[12]:
            grads[12] = matmul_to(dy2.t(), a.view(-1, a.shape[-1]), o_weight.dtype)   # (H, Hq D)
        if needs[13]:
            grads[13] = sum_rows_to(dy2, o_bias_dtype)
        da = dy2 @ o_w                                                          # (M, Hq D)
        o_w = None
        if o_adapters is not None:
            p_o = adapters_input_grads([dy2], o_adapters)                        # (M, r_o)
            da.addmm_(p_o, o_adapters.lora_a)
            (grads[23],), (grads[24],) = adapters_weight_grads(
                p_o, a.reshape(-1, a.shape[-1]), u_o, [dy2], o_adapters, lora_dtypes[6:7], lora_dtypes[7:8],
                needs[23:24], needs[24:25])
            p_o = u_o = None
        da = da.view(batch, seq, heads, head_dim)                                 # (B, T, Hq, D)
        out = a.view(batch, seq, heads, head_dim).transpose(1, 2)                # (B, Hq, T, D)
        dq, dk, dv = attend_backward(da.transpose(1, 2), q, k, v, out, saved, sizes, scale)  # (B, H, T, D)
        q = k = v = out = da = saved = None
        if groups > 1:  # repeat_kv's gradient: each group's heads summed
            dk, dv = sum_heads(dk, groups), sum_heads(dv, groups)
        dqkv = torch.empty((batch, seq, heads + 2 * kv_heads, head_dim), dtype=dtype, device=cast.device)
        dq_out, dk_out, dv_out = dqkv.split_with_sizes((heads, kv_heads, kv_heads), dim=2)
        if cos is not None:
            rope_into(dq.transpose(1, 2), dk.transpose(1, 2), dq_out, dk_out, cos, sin, backward=True)
        else:
            dq_out.copy_(dq.transpose(1, 2))
            dk_out.copy_(dk.transpose(1, 2))
        dv_out.copy_(dv.transpose(1, 2))
        dq = dk = dv = None
        d2 = dqkv.view(batch * seq, -1)                                           # (M, Oq + Ok + Ov)
        cast2 = cast.reshape(-1, cast.shape[-1])                                 # (M, H)
        widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        p = None
        if qkv_adapters is not None:
            douts = d2.split_with_sizes(widths, dim=1)
            douts = [douts[i] for i in which]                                     # (M, O_p) column views
            p = adapters_input_grads(douts, qkv_adapters)                         # (M, R)
            need_a = [needs[17 + 2 * i] for i in which]
            need_b = [needs[18 + 2 * i] for i in which]
            grads_a, grads_b = adapters_weight_grads(
                p, cast2, u_qkv, douts, qkv_adapters, [lora_dtypes[2 * i] for i in which],
                [lora_dtypes[2 * i + 1] for i in which], need_a, need_b)
            for i, g_a, g_b in zip(which, grads_a, grads_b, strict=True):
                grads[17 + 2 * i], grads[18 + 2 * i] = g_a, g_b
            douts = u_qkv = None
        if needs[0]:
            if p is None:
                grads[0] = matmul_to(d2, weight, x_dtype).view(cast.shape)  # (B, T, H), dense
            else:  # P A added in the compute dtype, then one cast
                dx = d2 @ weight
                dx.addmm_(p, qkv_adapters.lora_a)
                grads[0] = dx.to(x_dtype).view(cast.shape)
        weight = p = None
        if any(needs[6:12:2]):
            for i, dw in enumerate(matmul_to(d2.t(), cast2, q_weight.dtype).split_with_sizes(widths)):
                grads[6 + 2 * i] = dw if needs[6 + 2 * i] else None
        if any(needs[7:12:2]):
            for i, db in enumerate(sum_rows_to(d2, qkv_bias_dtype).split_with_sizes(widths)):
                grads[7 + 2 * i] = db if needs[7 + 2 * i] else None
        return tuple(grads)


def cache_update(cache, k, v, arguments):
    """``cache.update(k, v, ...)`` as the attention forward calls it, for a layer with nothing cached yet."""
    layer_idx, kwargs = arguments
    shape = k.shape
    k, v = cache.update(k, v, layer_idx, **kwargs)
    if k.shape != shape or v.shape != shape:
        raise RuntimeError(f"tigon: the key/value cache's layer {layer_idx} held entries the fused attention did "
                           "not expect; patch with fused_attention=False")


class NotCalledHere(Exception):
    """sdpa would choose a backend the node does not call (:func:`attend`): raised before any side effect, so
    that the caller runs the attention's own forward."""



# The node's apply, with less Python per call.
ATTENTION_NODE = function_apply(AttentionNode)
