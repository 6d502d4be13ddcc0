r"""LoRA adapters inside the gated MLP node (:mod:`tigon.nn.mlp`), over plain or bitsandbytes 4-bit bases.

LoRA (:func:`lora_gated_mlp`, :class:`~tigon.nn.mlp.SwiGLUMLP`'s forward where its projections are PEFT
LoRA linears that :func:`tigon.nn.lora.lora_projection` reads): each projection p adds its adapter's low-rank product,
``o_p = z W_pᵀ + b_p + s_p·(z A_pᵀ) B_pᵀ`` (z = x for gate and up, h for down; A_p ``[r_p, in]``,
B_p ``[out, r_p]``; a projection without one has no term). With Ũ_p = s_p·z A_pᵀ (M, r_p)::

    Ũgu = x [Ag; Au]ᵀ               (M, rg+ru)  one product, each block scaled; saved
    gate += Ũg Bgᵀ,  up += Ũu Buᵀ               into the base outputs (stacked G or split), addmm
    h = act(gate)·up;  Ũd = s_d·h Adᵀ (M, rd)   saved;  y = h Wdᵀ + bd + Ũd Bdᵀ

Backward, from dy (chain rule through o_p: dz += do_p W_p + s_p·(do_p B_p) A_p, dA_p = s_p·(do_p B_p)ᵀ z,
dB_p = do_pᵀ Ũ_p), with P_p = s_p·do_p B_p::

    Pd = s_d·dy Bd;  dh = dy Wd + Pd Ad;  dgate, dup, h = glu_backward(dh, gate, up)   (one pass, as above)
    dWd = dyᵀ h,  dAd = Pdᵀ h,  dBd = dyᵀ Ũd,  dbd = Σ dy                             h freed
    P = [s_g·dgate Bg | s_u·dup Bu]             (M, rg+ru)
    dx = dgate Wg + dup Wu + P [Ag; Au]         (stacked: dG [Wg; Wu] + P [Ag; Au])
    [dAg; dAu] = Pᵀ x,  dBg = dgateᵀ Ũg,  dBu = dupᵀ Ũu
    dWg, dWu, dbg, dbu as above, where the base is trainable (PEFT freezes it: skipped)

Saved per token: x, gate, up as above, and Ũ (rg+ru+rd values: 48 at r = 16). Stock PEFT on a bf16
model (fp32 adapters, its default) keeps, besides the LlamaMLP's tensors, an fp32 copy of x for each of
gate's and up's lora_A and one of h for down's (4·(2·H + I) bytes a token: 90 KB at Llama-3.1-8B), and
adds the deltas by separate kernels. The products run in the compute dtype with the adapter weights
cast to it (:mod:`tigon.nn.lora`, "Precision"). What :func:`~tigon.nn.lora.lora_projection` cannot read
exactly (dropout, DoRA, several active adapters) leaves the projections' own forwards to run
(:meth:`~tigon.nn.mlp.SwiGLUMLP.unfused_reason` says why).

QLoRA: where a projection's base is a bitsandbytes ``Linear4bit`` (:mod:`tigon.nn.quantized_base`), the node
gets its :class:`~tigon.nn.quantized_base.QuantizedWeight` in W_p's place and computes what bitsandbytes
computes: the forward's product over W_p dequantized in the layer's compute dtype (cast to autocast's), the
backward's dz over W_p dequantized again (in the dtype it was quantized from, cast to the gradient's), no
dW_p. Only the packed weight and its state are kept from the forward to the backward, no dequantized copy;
each dequantized weight lives for its one product. gate and up are then separate products, each the
``F.linear`` bitsandbytes makes, rather than one over a stacked ``[Wg; Wu]``: that one would need both
dequantized into one buffer, and its GEMM over 2·I output columns may split its reduction over H otherwise
than bitsandbytes' over I (the kernel is chosen by shape), so its outputs would be the same sums in
another rounding. A base's bias goes to its compute dtype first (bitsandbytes' ``bias.to(compute_dtype)``).
The compute dtype C must be the node's: x's without autocast (bitsandbytes computes in C and casts the
output to x's dtype; another C is another product, and the module runs PEFT's forward), fp32 or the
autocast dtype under autocast (x and W reach the product in the autocast dtype either way; C = fp16 under
bf16 autocast would round x to fp16 first).

Reference: :func:`lora_gated_mlp_reference` (PEFT's LoRA forward for each projection; a quantized base is
given to it as its dequantized weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tigon._kernels import cast_all, cast_stacked, function_apply, matmul_to, sum_rows_to
from tigon.nn.lora import (
    Adapters,
    LoraProjection,
    adapters_forward,
    adapters_input_grads,
    adapters_weight_grads,
    cast_adapters,
    check_adapter,
    lora_linear_reference,
)
from tigon.nn.mlp import (
    _check_mlp_args,
    _check_one_dtype,
    _glu_pass,
    _stackable,
    _to_autocast,
    _weight,
    gated_mlp,
)
from tigon.nn.quantized_base import (
    backward_weight,
    compute_dtype_reason,
    forward_weight,
    joined,
    quantized,
    split_saved,
    unquantized,
)
from tigon.ops.glu import GLU, activation_reference, glu_backward_stacked_into


class _LoraGatedMLPFunction(torch.autograd.Function):
    """The MLP with LoRA adapters on any of its projections as one node (module docs, "LoRA"): saves x,
    gate and up (or their stacked G) as the plain node does, and the (M, r) products Ũ; A and B as the
    node cast them (they are small), the base weights by reference (a quantized one as its
    :class:`~tigon.nn.quantized_base.QuantizedWeight`, kept on the context: save_for_backward takes tensors).

    Each adapter is its A (r, in), B (out, r) and scaling (None, None, 0.0 where the projection has none).
    """

    @staticmethod
    def forward(ctx, x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias,
                gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b, scalings, activation, dtype):
        ctx.activation, ctx.dtype, ctx.scalings = activation, dtype, scalings
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in (gate_bias, up_bias, down_bias))
        ctx.lora_dtypes = tuple(None if t is None else t.dtype for t in
                                (gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b))
        ctx.stacked = (not (quantized(gate_weight) or quantized(up_weight))
                       and _stackable(x, gate_weight, up_weight, gate_bias, up_bias, dtype))
        inter = gate_weight.shape[0]
        x2 = x.reshape(-1, x.shape[-1])                             # (M, H)

        # the adapters, cast by one launch: gate's and up's A stacked (they read x), down's beside them
        has_gate, has_up = ctx.gate_up_lora = (gate_lora_a is not None, up_lora_a is not None)
        gate_up_lora = [(a, b, s) for a, b, s in ((gate_lora_a, gate_lora_b, scalings[0]),
                                                  (up_lora_a, up_lora_b, scalings[1])) if a is not None]
        down_a = down_b = gate_up_adapters = None
        if gate_up_lora:
            gate_up_adapters, (down_a, down_b) = cast_adapters(
                *zip(*gate_up_lora, strict=True), dtype, (down_lora_a, down_lora_b))
        elif down_lora_a is not None:
            down_a, down_b = cast_all((down_lora_a, down_lora_b), dtype)

        if ctx.stacked:
            gate_up_w, gate_up_b, (down_w, down_b_cast) = cast_stacked(
                (gate_weight, up_weight), (gate_bias, up_bias), dtype, (*unquantized((down_weight,)), down_bias))
            gate = F.linear(x, gate_up_w, gate_up_b)                # (..., 2I): G, saved as "gate"
            gate_up_w, up = None, None
            gate2, up2 = gate.view(-1, 2 * inter).split_with_sizes([inter, inter], dim=1)  # (M, I) views
        else:
            # (a quantized weight is dequantized where its product reads it, and freed after it)
            gate_w, gate_b, up_w, up_b, down_w, down_b_cast = cast_all(
                unquantized((gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias)), dtype)
            gate = F.linear(x, forward_weight(gate_weight, gate_w, dtype), gate_b)  # (..., I)
            up = F.linear(x, forward_weight(up_weight, up_w, dtype), up_b)          # (..., I)
            gate_w = up_w = None
            gate2, up2 = gate.view(-1, inter), up.view(-1, inter)
        u_gate_up = None
        if gate_up_adapters is not None:  # gate += Ũg Bgᵀ, up += Ũu Buᵀ
            outs = [o for o, has in ((gate2, has_gate), (up2, has_up)) if has]
            u_gate_up = adapters_forward(x2, gate_up_adapters, outs)   # (M, rg + ru)
        h = GLU(gate2, up2, activation)                             # (M, I)
        # (..., H), made in that shape: the output is no view of another tensor, so a caller may add into it
        # in place (Llama-4's MoE block adds its routed experts' output into its shared expert's)
        y = F.linear(h.view(*x.shape[:-1], inter), forward_weight(down_weight, down_w, dtype), down_b_cast)
        down_w = None
        u_down = None
        if down_a is not None:  # y += Ũd Bdᵀ
            u_down = adapters_forward(h, Adapters(down_a, (down_b,), (down_a.shape[0],), (scalings[2],)),
                                      [y.view(-1, y.shape[-1])])
        h = None
        gate_up_a = gate_b = up_b = None
        if gate_up_adapters is not None:  # (the cast B of gate and up, None where one has no adapter)
            gate_up_a, lora_bs = gate_up_adapters.lora_a, list(gate_up_adapters.lora_bs)
            gate_b, up_b = (lora_bs.pop(0) if has else None for has in (has_gate, has_up))
        base_weights, ctx.quantized = split_saved((gate_weight, up_weight, down_weight))
        ctx.save_for_backward(x, gate, up, *base_weights, gate_up_a, gate_b, up_b,
                              down_a, down_b, u_gate_up, u_down)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x, gate, up, gate_weight, up_weight, down_weight, gate_up_a, gate_b, up_b, down_a, down_b,
         u_gate_up, u_down) = ctx.saved_tensors
        gate_weight, up_weight, down_weight = joined((gate_weight, up_weight, down_weight), ctx.quantized)
        (need_x, need_gate_w, need_gate_b, need_up_w, need_up_b, need_down_w, need_down_b,
         need_gate_la, need_gate_lb, need_up_la, need_up_lb, need_down_la, need_down_lb) = ctx.needs_input_grad[:13]
        gate_a_dtype, gate_b_dtype, up_a_dtype, up_b_dtype, down_a_dtype, down_b_dtype = ctx.lora_dtypes
        gate_bias_dtype, up_bias_dtype, down_bias_dtype = ctx.bias_dtypes
        has_gate, has_up = ctx.gate_up_lora
        inter = gate_weight.shape[0]
        x2 = x.reshape(-1, x.shape[-1])                             # (M, H)
        dy2 = dy.reshape(-1, dy.shape[-1])                          # (M, H)
        down = None if down_a is None else Adapters(down_a, (down_b,), (down_a.shape[0],), (ctx.scalings[2],))
        gate_up = None
        if gate_up_a is not None:
            lora_bs = tuple(b for b in (gate_b, up_b) if b is not None)
            ranks = tuple(b.shape[1] for b in lora_bs)
            scalings = tuple(s for s, has in zip(ctx.scalings[:2], ctx.gate_up_lora, strict=True) if has)
            gate_up = Adapters(gate_up_a, lora_bs, ranks, scalings)
        need_dgate_dup = (need_x or need_gate_w or need_gate_b or need_up_w or need_up_b
                          or need_gate_la or need_gate_lb or need_up_la or need_up_lb)
        need_h = need_down_w or need_down_la
        dx = d_gate_w = d_gate_b = d_up_w = d_up_b = d_down_w = d_down_b = None

        # down: dh = dy Wd + Pd Ad, with Pd = s_d·dy Bd
        p_down = adapters_input_grads([dy2], down) if down is not None and (need_dgate_dup or need_down_la) else None
        # the base weights the input gradients need, cast by one launch
        # (quantized ones dequantized again, as bitsandbytes' backward reads them)
        down_w, gate_w, up_w = cast_all(unquantized(
            (down_weight if need_dgate_dup else None,
             gate_weight if need_x and not ctx.stacked else None, up_weight if need_x and not ctx.stacked else None)),
            ctx.dtype)
        h = d_gate_up = dgate = dup = None
        if ctx.stacked:
            gate2 = d_gate_up = gate.view(-1, 2 * inter)           # (M, 2I): G, then dG over it
            dgate, dup = gate2.split_with_sizes([inter, inter], dim=1)
            gate2, up2 = dgate, dup
        else:
            gate2, up2 = gate.reshape(-1, inter), up.reshape(-1, inter)
        if need_dgate_dup:
            dh = dy2 @ backward_weight(down_weight, down_w, ctx.dtype)  # (M, I)
            down_w = None
            if p_down is not None:
                dh.addmm_(p_down, down.lora_a)
            if ctx.stacked:
                glu_backward_stacked_into(dh, d_gate_up, ctx.activation, store_h=need_h)  # dG over G, h over dh
                torch.autograd.graph.increment_version((gate,))    # a second backward raises, not misreads
                h = dh if need_h else None
            else:
                dgate = dh                                          # dgate over dh
                dup, h = _glu_pass(dgate, gate, up, gate2, up2, ctx.activation, need_h)
        if need_h and h is None:
            h = GLU(gate2, up2, ctx.activation)                     # (M, I)
        if need_down_w:
            d_down_w = matmul_to(dy2.t(), h, down_weight.dtype)     # (H, I)
        d_down_la = d_down_lb = None
        if down is not None:  # dAd = Pdᵀ h, dBd = dyᵀ Ũd
            (d_down_la,), (d_down_lb,) = adapters_weight_grads(
                p_down, h, u_down, [dy2], down, (down_a_dtype,), (down_b_dtype,), (need_down_la,), (need_down_lb,))
        h = None
        if need_down_b:
            d_down_b = sum_rows_to(dy2, down_bias_dtype)

        # gate and up: dx = dgate Wg + dup Wu + P [Ag; Au], with P = [s_g·dgate Bg | s_u·dup Bu]
        douts = [d for d, has in ((dgate, has_gate), (dup, has_up)) if has]
        p_gate_up = None
        if gate_up is not None and (need_x or need_gate_la or need_up_la):
            p_gate_up = adapters_input_grads(douts, gate_up)        # (M, rg + ru)
        if need_x:
            if ctx.stacked:
                gate_up_w, _, _ = cast_stacked((gate_weight, up_weight), (None, None), ctx.dtype)  # one launch
                dx = d_gate_up @ gate_up_w                          # (M, H)
                gate_up_w = None
            else:
                dx = dgate @ backward_weight(gate_weight, gate_w, ctx.dtype)  # (M, H)
                dx.addmm_(dup, backward_weight(up_weight, up_w, ctx.dtype))
                gate_w = up_w = None
            if p_gate_up is not None:
                dx.addmm_(p_gate_up, gate_up.lora_a)
            dx = dx.reshape(x.shape)
        if ctx.stacked and (need_gate_w or need_up_w):
            d_gate_w, d_up_w = matmul_to(d_gate_up.t(), x2, gate_weight.dtype).split_with_sizes([inter, inter])
        else:
            d_gate_w = matmul_to(dgate.t(), x2, gate_weight.dtype) if need_gate_w else None  # (I, H)
            d_up_w = matmul_to(dup.t(), x2, up_weight.dtype) if need_up_w else None
        if ctx.stacked and (need_gate_b or need_up_b):
            d_gate_b, d_up_b = sum_rows_to(d_gate_up, gate_bias_dtype).split_with_sizes([inter, inter])
        else:
            d_gate_b = sum_rows_to(dgate, gate_bias_dtype) if need_gate_b else None
            d_up_b = sum_rows_to(dup, up_bias_dtype) if need_up_b else None
        lora_grads = [None] * 4  # dAg, dBg, dAu, dBu
        if gate_up is not None:  # dA = Pᵀ x (one product, split), dB_i = do_iᵀ Ũ_i
            which = [i for i, has in enumerate(ctx.gate_up_lora) if has]
            grads_a, grads_b = adapters_weight_grads(
                p_gate_up, x2, u_gate_up, douts, gate_up, [(gate_a_dtype, up_a_dtype)[i] for i in which],
                [(gate_b_dtype, up_b_dtype)[i] for i in which],
                [(need_gate_la, need_up_la)[i] for i in which], [(need_gate_lb, need_up_lb)[i] for i in which])
            for i, g_a, g_b in zip(which, grads_a, grads_b, strict=True):
                lora_grads[2 * i], lora_grads[2 * i + 1] = g_a, g_b
        return (dx, d_gate_w if need_gate_w else None, d_gate_b if need_gate_b else None,
                d_up_w if need_up_w else None, d_up_b if need_up_b else None, d_down_w, d_down_b,
                *lora_grads, d_down_la, d_down_lb, None, None, None)


_LORA_GATED_MLP_APPLY = function_apply(_LoraGatedMLPFunction)


def lora_gated_mlp(x, gate, up, down, *, activation="silu"):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` where each projection is a :class:`LoraProjection`
    (``x Wᵀ + b + s·(x Aᵀ) Bᵀ``; A = B = None for a plain one; W a
    :class:`~tigon.nn.quantized_base.QuantizedWeight` for a bitsandbytes 4-bit base), as one recomputing
    autograd node.

    Respects ``torch.autocast`` as PEFT's LoRA linears under it do (every product in the autocast
    dtype); outside autocast the base weights and biases must share x's dtype (a quantized base: its
    compute dtype), and the adapters are cast to it inside the node (PEFT's default fp32 adapters on a
    bf16 model).
    """
    _check_mlp_args(x, gate.weight, up.weight, down.weight, gate.bias, up.bias, down.bias, activation,
                    quantized_ok=True)
    for projection, name in ((gate, "gate_proj"), (up, "up_proj"), (down, "down_proj")):
        check_adapter(projection, name, x.device)
    weights = (gate.weight, up.weight, down.weight)
    if gate.lora_a is None and up.lora_a is None and down.lora_a is None and not any(map(quantized, weights)):
        return gated_mlp(x, *weights, gate.bias, up.bias, down.bias, activation=activation)
    reason = compute_dtype_reason(x, weights)
    if reason is not None:
        raise TypeError(f"lora_gated_mlp: {reason}")
    # a quantized base's bias in its compute dtype, as bitsandbytes' forward casts it
    gate_bias, up_bias, down_bias = (p.bias.to(p.weight.dtype) if quantized(p.weight) and p.bias is not None
                                     else p.bias for p in (gate, up, down))
    base = (x, gate.weight, gate_bias, up.weight, up_bias, down.weight, down_bias)
    device_type = x.device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        base = (_to_autocast(x, dtype), *(t if quantized(t) else _weight(t, dtype) for t in base[1:]))
    else:
        dtype = x.dtype
        _check_one_dtype(base)
    adapters = [_weight(t, dtype) for p in (gate, up, down) for t in (p.lora_a, p.lora_b)]
    scalings = (gate.scaling, up.scaling, down.scaling)
    return _LORA_GATED_MLP_APPLY(*base, *adapters, scalings, activation, dtype)


# ------------------------------------------------------------------------------------------ reference


def lora_gated_mlp_reference(x, gate: LoraProjection, up: LoraProjection, down: LoraProjection, *,
                             activation="silu", io_dtype=None):
    """The eager MLP over PEFT LoRA linears (:func:`tigon.nn.lora.lora_linear_reference` for each
    projection); ``io_dtype`` rounds gate, up, h and y as :func:`gated_mlp_reference` does."""

    def r(t):
        return t if io_dtype is None else t.to(io_dtype).to(t.dtype)

    gate_out = r(lora_linear_reference(x, *gate))
    up_out = r(lora_linear_reference(x, *up))
    h = r(r(activation_reference(gate_out, activation)) * up_out)
    return r(lora_linear_reference(h, *down))
