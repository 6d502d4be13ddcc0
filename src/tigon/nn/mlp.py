r"""Gated MLPs (SwiGLU, GeGLU) as one autograd node that recomputes instead of saving.

Forward, x ``[..., H]``, weights as ``nn.Linear`` stores them::

    gate = x Wgᵀ + bg        (M, I)     saved
    up   = x Wuᵀ + bu        (M, I)     saved
    h    = r(act(gate)) · up (M, I)     tigon.ops.glu kernel; freed at once
    y    = h Wdᵀ + bd        (M, H)

Backward, from dy::

    dh  = dy Wd                              (M, I)
    dgate, dup, h = glu_backward(dh, gate, up)          one pass over gate, up: dgate over dh,
                                                        dup, and h = r(act(gate)) · up recomputed
    dWd = dyᵀ h,  dbd = Σ dy                            h freed
    dx  = dgate Wg + dup Wu
    dWg = dgateᵀ x,  dWu = dupᵀ x,  dbg = Σ dgate,  dbu = Σ dup

Saved per token: x (H) and gate, up (2·I). The stock ``LlamaMLP`` keeps x plus four intermediate-sized
tensors (gate for the activation, act(gate) and up for the product, h for down_proj); a fused
activation alone drops one of them. The backward allocates one intermediate-sized tensor, dh: the
GLU pass writes dgate over dh, dup over up and h over gate (each element is read by the thread that
then writes it, and neither gate nor up is needed after the pass), so its peak is gate, up + 1·(M, I)
(LlamaMLP with a fused activation: 3 saved + dh + the product's gradient). At the longest contexts
the first backward step is the whole run's peak, so the two (M, I) buffers not allocated there are
2·2·I bytes a token off the peak (32 KB at Llama-3.2-1B). The version counters of gate and up are
bumped, so that a second backward through the same graph (``retain_graph=True``) raises autograd's
in-place error instead of reading the overwritten values. Under torch.compile (Inductor plans the
buffers) the three are separate, as they are for non-contiguous gate, up.

The price of recomputing is one extra write of h, inside the backward's pass over gate and up
(M·I·b bytes, against nine GEMMs of 2·M·H·I flops); recomputing h in a launch of its own would read
gate and up a second time as well (3·M·I·b).

Autocast: as ``nn.Linear`` under ``torch.autocast``, x is cast to the autocast dtype before the node
(the cast stays in the graph), and inside it autocast finds every operand in its dtype already (it
casts nothing there). The weights and biases are cast inside the node (all of them by one launch:
:func:`tigon._kernels.cast_all`; three bias casts and their backward nodes less than autocast's
per-linear casts, which matters where the step is the host's: a vision tower's MLP at a few hundred
patches), and the weights are cast again in the backward rather than saved:
autocast's ``nn.Linear`` keeps a bf16 copy of every weight from the forward to the backward (2 bytes
per MLP parameter: 1.6 GB at Llama-3.2-1B, 3.3 GB at Gemma-2-2B), while the fp32 weights themselves
are there anyway. The weight gradients are the bf16 products in the weights' dtype
(:func:`tigon._kernels.matmul_to`): on the CPU the bf16 product cast, as autocast's cast returns
it (bitwise the same); on the GPU the matmul's fp32 accumulator written as it is (no cast kernel, and
no rounding to bf16 on the way); the bias gradients likewise (:func:`tigon._kernels.sum_rows_to`).

On the GPU, where the weights are cast anyway (fp32 master weights under autocast), gate and up are one
product: the one cast launch writes ``[Wg; Wu]`` stacked, ``G = x·[Wg; Wu]ᵀ`` is one ``(M, 2·I)``
matmul whose two halves the GLU kernel reads in place, and the node saves G (what gate and up took).
The backward's GLU pass writes ``[dgate | dup]`` over G and h over dh, so that ``dx = dG·[Wg; Wu]``,
``[dWg; dWu] = dGᵀ·x`` and ``[dbg; dbu] = Σ dG`` are one product or sum each where the split form
takes two (and an add): one launch less forward and three backward, each a tile grid twice as wide
(the training step of a small model, or of a vision tower at a few hundred patches, is bound by its
host's launches). :func:`_stacked_backward` derives it. Elsewhere (the CPU, whose results stay
bitwise the stock ones; weights already in the compute dtype, which stacking would copy) gate and up
are separate products as above.

LoRA adapters on the projections (PEFT LoRA linears, and QLoRA's bitsandbytes 4-bit bases) run in the
LoRA variant of this node, :mod:`tigon.nn.lora_mlp`, which :class:`SwiGLUMLP` and :class:`GEGLUMLP` call
where :func:`tigon.nn.lora.lora_projection` reads their projections.

Reference: :func:`gated_mlp_reference` (``down_proj(act(gate_proj(x)) * up_proj(x))``, transformers'
``LlamaMLP`` / ``GemmaMLP``); with adapters, :func:`tigon.nn.lora_mlp.lora_gated_mlp_reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tigon._kernels import (
    FLOAT_DTYPES,
    cast_all,
    cast_stacked,
    check_int,
    check_tensor,
    function_apply,
    matmul_to,
    sum_rows_to,
)
from tigon.nn.lora import lora_projections, plain_linear
from tigon.nn.quantized_base import check_weight, compute_dtype_reason
from tigon.ops.glu import (
    ACTIVATIONS,
    GLU,
    activation_reference,
    gelu_activation_name,
    glu,
    glu_backward_into,
    glu_backward_stacked_into,
)


class _GatedMLPFunction(torch.autograd.Function):
    """The whole MLP as one node; saves x, gate, up (and references to the weights, not copies).

    ``dtype`` is the compute dtype: the weights are cast to it here (forward and backward) when they
    are held in another one (fp32 master weights under autocast); their gradients come back in
    their own dtype.
    """

    @staticmethod
    def forward(ctx, x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, activation, dtype):
        ctx.activation, ctx.dtype = activation, dtype
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in (gate_bias, up_bias, down_bias))
        ctx.stacked = _stackable(x, gate_weight, up_weight, gate_bias, up_bias, dtype)
        if ctx.stacked:
            # gate and up as one product over [Wg; Wu] (cast and stacked by the one launch)
            inter = gate_weight.shape[0]
            gate_up_w, gate_up_b, (down_w, down_b) = cast_stacked(
                (gate_weight, up_weight), (gate_bias, up_bias), dtype, (down_weight, down_bias))
            gate_up = F.linear(x, gate_up_w, gate_up_b)             # (..., 2I)
            gate_up_w = None
            h = GLU(gate_up[..., :inter], gate_up[..., inter:], activation)  # (..., I)
            ctx.save_for_backward(x, gate_up, gate_weight, up_weight, down_weight)
            return F.linear(h, down_w, down_b)                      # (..., H)
        gate_w, gate_b, up_w, up_b, down_w, down_b = cast_all(
            (gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias), dtype)  # one launch
        gate = F.linear(x, gate_w, gate_b)                          # (..., I)
        up = F.linear(x, up_w, up_b)                                # (..., I)
        gate_w = up_w = None
        h = GLU(gate, up, activation)                               # (..., I)
        y = F.linear(h, down_w, down_b)                             # (..., H)
        ctx.save_for_backward(x, gate, up, gate_weight, up_weight, down_weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.stacked:
            return _stacked_backward(ctx, dy)
        x, gate, up, gate_weight, up_weight, down_weight = ctx.saved_tensors
        (need_x, need_gate_w, need_gate_b, need_up_w, need_up_b, need_down_w, need_down_b, _, _) = (
            ctx.needs_input_grad
        )
        x2 = x.reshape(-1, x.shape[-1])                             # (M, H)
        dy2 = dy.reshape(-1, dy.shape[-1])                          # (M, H)
        gate2 = gate.reshape(-1, gate.shape[-1])                    # (M, I)
        up2 = up.reshape(-1, up.shape[-1])                          # (M, I)
        dx = d_gate_w = d_gate_b = d_up_w = d_up_b = d_down_w = d_down_b = None

        need_dgate_dup = need_x or need_gate_w or need_gate_b or need_up_w or need_up_b
        # the weights the input gradients need, cast by one launch
        down_w, gate_w, up_w = cast_all(
            (down_weight if need_dgate_dup else None, gate_weight if need_x else None, up_weight if need_x else None),
            ctx.dtype,
        )
        h = None
        if need_dgate_dup:
            dgate = dy2 @ down_w                                    # (M, I): dh, then dgate over it
            down_w = None
            dup, h = _glu_pass(dgate, gate, up, gate2, up2, ctx.activation, need_down_w)
        if need_down_w:
            if h is None:
                h = GLU(gate2, up2, ctx.activation)                 # (M, I)
            d_down_w = matmul_to(dy2.t(), h, down_weight.dtype)     # (H, I)
            h = None
        gate_b_dtype, up_b_dtype, down_b_dtype = ctx.bias_dtypes
        if need_down_b:
            d_down_b = sum_rows_to(dy2, down_b_dtype)
        if need_x:
            dx = dgate @ gate_w                                     # (M, H)
            dx.addmm_(dup, up_w)
            gate_w = up_w = None
            dx = dx.reshape(x.shape)
        if need_gate_w:
            d_gate_w = matmul_to(dgate.t(), x2, gate_weight.dtype)  # (I, H)
        if need_gate_b:
            d_gate_b = sum_rows_to(dgate, gate_b_dtype)
        if need_up_w:
            d_up_w = matmul_to(dup.t(), x2, up_weight.dtype)
        if need_up_b:
            d_up_b = sum_rows_to(dup, up_b_dtype)
        return dx, d_gate_w, d_gate_b, d_up_w, d_up_b, d_down_w, d_down_b, None, None


_GATED_MLP_APPLY = function_apply(_GatedMLPFunction)

# Devices on which gate and up run as one stacked matmul (_stackable). Not the CPU: there the separate
# products are kept, so that the patched models' losses and gradients stay bitwise the stock ones;
# tests add "cpu" to run the stacked path under the interpreter.
STACKED_DEVICES = ("cuda",)


def _stackable(x, gate_weight, up_weight, gate_bias, up_bias, dtype) -> bool:
    """Whether gate and up run as one product over the stacked weights: on a STACKED_DEVICES device in
    eager mode (Inductor plans its own), where the weights are cast to the compute dtype anyway (fp32
    master weights under autocast: stacking weights already in it would copy them for nothing), in one
    dtype and shape, with both biases or neither (of one dtype)."""
    if x.device.type not in STACKED_DEVICES or torch.compiler.is_compiling():
        return False
    if gate_weight.dtype == dtype or up_weight.dtype != gate_weight.dtype or up_weight.shape != gate_weight.shape:
        return False
    if gate_bias is None:
        return up_bias is None
    return up_bias is not None and gate_bias.dtype == up_bias.dtype


def _stacked_backward(ctx, dy):
    """The stacked node's gradients. With G = [gate | up] (M, 2I), as the forward saved it, and its
    gradient dG = [dgate | dup] (written over G by one GLU pass, which also gives h over dh)::

        dh = dy Wd;  dG, h = glu_backward(dh, G)      dWd = dyᵀ h,  dbd = Σ dy
        dx = dG [Wg; Wu]                               (one product: the sum of the two)
        [dWg; dWu] = dGᵀ x,  [dbg; dbu] = Σ dG         (one product, one sum; returned as row blocks)
    """
    x, gate_up, gate_weight, up_weight, down_weight = ctx.saved_tensors
    (need_x, need_gate_w, need_gate_b, need_up_w, need_up_b, need_down_w, need_down_b, _, _) = ctx.needs_input_grad
    gate_b_dtype, _, down_b_dtype = ctx.bias_dtypes
    inter = gate_weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1])                                 # (M, H)
    dy2 = dy.reshape(-1, dy.shape[-1])                              # (M, H)
    gate_up2 = gate_up.view(-1, 2 * inter)                          # (M, 2I)
    dx = d_gate_w = d_gate_b = d_up_w = d_up_b = d_down_w = d_down_b = None
    h = None
    if need_x or need_gate_w or need_gate_b or need_up_w or need_up_b:
        (down_w,) = cast_all((down_weight,), ctx.dtype)
        dh = dy2 @ down_w                                           # (M, I)
        down_w = None
        glu_backward_stacked_into(dh, gate_up2, ctx.activation, store_h=need_down_w)  # dG over G, h over dh
        torch.autograd.graph.increment_version((gate_up,))  # a second backward raises, not misreads
        d_gate_up = gate_up2
        h = dh if need_down_w else None
    if need_down_w:
        if h is None:
            h = GLU(gate_up2[:, :inter], gate_up2[:, inter:], ctx.activation)  # (M, I)
        d_down_w = matmul_to(dy2.t(), h, down_weight.dtype)         # (H, I)
        h = None
    if need_down_b:
        d_down_b = sum_rows_to(dy2, down_b_dtype)
    if need_x:
        gate_up_w, _, _ = cast_stacked((gate_weight, up_weight), (None, None), ctx.dtype)  # one launch
        dx = (d_gate_up @ gate_up_w).reshape(x.shape)               # (M, H)
        gate_up_w = None
    if need_gate_w or need_up_w:
        d_gate_w, d_up_w = matmul_to(d_gate_up.t(), x2, gate_weight.dtype).split_with_sizes([inter, inter])
    if need_gate_b or need_up_b:
        d_gate_b, d_up_b = sum_rows_to(d_gate_up, gate_b_dtype).split_with_sizes([inter, inter])
    return (dx, d_gate_w if need_gate_w else None, d_gate_b if need_gate_b else None,
            d_up_w if need_up_w else None, d_up_b if need_up_b else None, d_down_w, d_down_b, None, None)


def _glu_pass(dh, gate, up, gate2, up2, activation, need_h):
    """One pass over gate and up (saved, and their (M, I) views) gives dgate (over dh), dup and, when
    ``need_h``, the recomputed h: no separate forward launch reading them again. Returns (dup, h)."""
    h = None
    if _reuse_saved(gate2, up2):
        # dup over up and h over gate: each element is read before it is written (module docs)
        dup, h = up2, (gate2 if need_h else None)
        torch.autograd.graph.increment_version((gate, up))  # a second backward raises, not misreads
    else:
        dup = torch.empty_like(up2)
        if need_h:
            h = torch.empty(gate2.shape, dtype=torch.promote_types(gate2.dtype, up2.dtype), device=gate2.device)
    glu_backward_into(dh, gate2, up2, dup, activation, h=h)
    return dup, h


def _reuse_saved(gate, up) -> bool:
    """Whether the backward may write dup over up and h over gate: eager mode (under torch.compile
    Inductor plans the buffers), contiguous and of one dtype (h takes gate's place, in their promoted
    dtype)."""
    return (not torch.compiler.is_compiling() and gate.is_contiguous() and up.is_contiguous()
            and gate.dtype == up.dtype)


def _check_mlp_args(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation,
                    quantized_ok=False):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    check_tensor(x, "x")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the hidden dimension is the last)")
    hidden = x.shape[-1]
    device = x.device
    check_weight(gate_weight, "gate_proj.weight", device, quantized_ok)
    intermediate = gate_weight.shape[0]
    # (a loop over a tuple, not a dict of names: this runs on every MLP call)
    for t, name, shape in (
        (gate_weight, "gate_proj.weight", (intermediate, hidden)),
        (up_weight, "up_proj.weight", (intermediate, hidden)),
        (down_weight, "down_proj.weight", (hidden, intermediate)),
        (gate_bias, "gate_proj.bias", (intermediate,)),
        (up_bias, "up_proj.bias", (intermediate,)),
        (down_bias, "down_proj.bias", (hidden,)),
    ):
        if t is None:
            continue
        if t is not gate_weight:
            check_weight(t, name, device, quantized_ok)
        if t.shape != shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {shape} for x of shape {tuple(x.shape)}"
            )


def _to_autocast(t, dtype):
    return t.to(dtype) if t is not None and t.dtype in FLOAT_DTYPES and t.dtype != dtype else t


def _weight(w, dtype):
    """A weight or bias the node casts itself (fp32 ones, as autocast would); any other dtype is cast
    here."""
    return w if w is None or w.dtype == torch.float32 else _to_autocast(w, dtype)


def gated_mlp(
    x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None, down_bias=None, *, activation="silu"
):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` as one recomputing autograd node.

    Weights and biases as ``nn.Linear`` holds them (gate/up ``[I, H]``, down ``[H, I]``).
    ``activation``: "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU). Respects ``torch.autocast``
    as ``F.linear`` does; outside autocast every tensor must share x's dtype.
    """
    _check_mlp_args(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation)
    device_type = x.device.type
    # cuda, or cpu under the interpreter: the devices tigon runs on (meta tensors have no autocast)
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        # x is cast here; fp32 weights and biases inside the node (module docs)
        # autocast stays on: the node's F.linear operands are all in its dtype, so it casts nothing
        return _GATED_MLP_APPLY(
            _to_autocast(x, dtype), _weight(gate_weight, dtype), _weight(gate_bias, dtype),
            _weight(up_weight, dtype), _weight(up_bias, dtype), _weight(down_weight, dtype),
            _weight(down_bias, dtype), activation, dtype,
        )
    tensors = (x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias)
    _check_one_dtype(tensors)
    return _GATED_MLP_APPLY(*tensors, activation, x.dtype)


_BASE_NAMES = ("x", "gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias", "down_proj.weight",
               "down_proj.bias")


def _check_one_dtype(tensors):
    """Outside autocast, x and the base weights and biases share x's dtype (TypeError naming the first
    that does not), as ``nn.Linear`` requires."""
    x = tensors[0]
    for name, t in zip(_BASE_NAMES, tensors, strict=True):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype}, expected x's {x.dtype} (mixed dtypes need torch.autocast, "
                "as for nn.Linear)"
            )


def projections_node(x, gate_proj, up_proj, down_proj, activation):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` as one recomputing node, or None where a projection's own
    forward must run. Plain ``nn.Linear`` projections: :func:`gated_mlp`. PEFT LoRA linears and bitsandbytes
    4-bit bases (and plain ones beside them): the adapters inside :func:`tigon.nn.lora_mlp.lora_gated_mlp`,
    where every projection reads exactly and a quantized base's compute dtype is the node's for this input."""
    if plain_linear(gate_proj) and plain_linear(up_proj) and plain_linear(down_proj):
        return gated_mlp(x, gate_proj.weight, up_proj.weight, down_proj.weight, gate_proj.bias, up_proj.bias,
                         down_proj.bias, activation=activation)
    projections = lora_projections({"gate_proj": gate_proj, "up_proj": up_proj, "down_proj": down_proj})
    if isinstance(projections, str) or compute_dtype_reason(x, [p.weight for p in projections]) is not None:
        return None
    from tigon.nn.lora_mlp import lora_gated_mlp  # (it imports this module)

    return lora_gated_mlp(x, *projections, activation=activation)


class _GatedMLP(nn.Module):
    """Shared body of SwiGLUMLP and GEGLUMLP: the three projections and the fused forward."""

    def __init__(self, hidden_size, intermediate_size, activation, bias, device, dtype):
        super().__init__()
        for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if check_int(size, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {size}")
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be True or False, got {bias!r}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype)

    def forward(self, x):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"x has last dim {x.shape[-1]} (shape {tuple(x.shape)}), which does not match hidden_size "
                f"{self.hidden_size}"
            )
        gate_proj, up_proj, down_proj = self.gate_proj, self.up_proj, self.down_proj
        y = projections_node(x, gate_proj, up_proj, down_proj, self.activation)
        if y is not None:
            return y
        # A projection that cannot be read exactly (a LoRA adapter with dropout, DoRA; an 8-bit linear)
        # or is split across ranks (tensor parallel): its own forward must run, so only the activation
        # is fused here.
        return down_proj(glu(gate_proj(x), up_proj(x), self.activation))

    def unfused_reason(self) -> str | None:
        """None when :meth:`forward` runs one node now; else why the projections run their own forwards
        (e.g. ``"up_proj: dropout 0.05"``). Adapters can be switched, so this holds for the next call; a
        bitsandbytes 4-bit base whose compute dtype is not the call's (tigon.nn.lora_mlp) is decided there."""
        projections = lora_projections({"gate_proj": self.gate_proj, "up_proj": self.up_proj,
                                        "down_proj": self.down_proj})
        return projections if isinstance(projections, str) else None

    def extra_repr(self) -> str:
        return f"{self.hidden_size} -> {self.intermediate_size}, activation={self.activation!r}"


class SwiGLUMLP(_GatedMLP):
    """Drop-in for transformers' ``LlamaMLP`` (``hidden_act="silu"``): ``down(silu(gate(x)) * up(x))``.

    Parameters ``gate_proj``, ``up_proj``, ``down_proj`` (``nn.Linear``), so checkpoints load
    unchanged. Saves x, gate and up only; the activation and down_proj's input are recomputed.
    """

    def __init__(self, hidden_size, intermediate_size, *, bias=False, device=None, dtype=None):
        super().__init__(hidden_size, intermediate_size, "silu", bias, device, dtype)


class GEGLUMLP(_GatedMLP):
    """Drop-in for transformers' ``GemmaMLP``: ``down(gelu(gate(x), approximate) * up(x))``.

    ``approximate="tanh"`` is ``gelu_pytorch_tanh`` (Gemma); ``"none"`` the erf GELU.
    """

    def __init__(
        self, hidden_size, intermediate_size, *, approximate="tanh", bias=False, device=None, dtype=None
    ):
        activation = gelu_activation_name(approximate)
        super().__init__(hidden_size, intermediate_size, activation, bias, device, dtype)
        self.approximate = approximate


# ------------------------------------------------------------------------------------------ reference


def gated_mlp_reference(
    x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None, down_bias=None, *,
    activation="silu", io_dtype=None,
):
    """The eager MLP (transformers' ``LlamaMLP`` / ``GemmaMLP`` forward) on raw weights.

    ``io_dtype`` (tests pass fp64 tensors) rounds each intermediate (gate, up, act, h, y) where the
    eager MLP in that dtype rounds.
    """

    def r(t):
        return t if io_dtype is None else t.to(io_dtype).to(t.dtype)

    gate = r(F.linear(x, gate_weight, gate_bias))
    up = r(F.linear(x, up_weight, up_bias))
    h = r(r(activation_reference(gate, activation)) * up)
    return r(F.linear(h, down_weight, down_bias))
