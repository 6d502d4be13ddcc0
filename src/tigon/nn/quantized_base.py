r"""bitsandbytes 4-bit base weights (QLoRA) for tigon's fused nodes: what a ``Linear4bit`` computes, read
into a :class:`QuantizedWeight` that the nodes dequantize when they need it, forward and backward.

A ``bitsandbytes.nn.Linear4bit`` (and its ``LinearNF4`` / ``LinearFP4`` subclasses) holds W ``(out, in)``
packed two 4-bit codes a byte (``Params4bit``, ``[(out·in + 1) // 2, 1]``) and a ``QuantState``: the code
book (nf4 or fp4), one absmax per block of ``blocksize`` values (with double quant, "nested", those absmax
are themselves 8-bit codes with their own fp32 absmax per 256 and an offset), W's shape and the dtype S
it was quantized from. bitsandbytes 0.50's forward (``matmul_4bit`` through its ``gemm_4bit`` op, with or
without grad; its CPU inference path aside, below), with C the layer's ``compute_dtype``::

    Wc = dequantize_4bit(W, state) in C          the ``gemm_4bit`` op: absmax resolved, codes × absmax in C
    y  = F.linear(x.to(C), Wc, b.to(C)).to(x.dtype)                         (``MatMul4Bit.forward``)
    dx = dy · (dequantize_4bit(W, state) in S).to(dy.dtype)                 (``MatMul4Bit.backward``)

and no gradient for W (the codes are integers). Under autocast the product inside is autocast's:
``F.linear`` casts x, Wc and b to the autocast dtype D. :meth:`QuantizedWeight.forward_weight` and
:meth:`QuantizedWeight.backward_weight` make exactly those two weights with bitsandbytes' own
``bitsandbytes.functional.dequantize_4bit`` (the forward's with the state's dtype read as C, which is
what the ``gemm_4bit`` op passes the same dequantizer; S = C, the usual case, makes the two one), cast to
the product's dtype as the forward and the backward cast them. A node keeps the :class:`QuantizedWeight`
(the packed parameter and its state: 0.52 bytes a weight with double quant, 0.56 without) from its
forward to its backward and dequantizes again there: never the dequantized weight, which would be a whole
2-byte copy of the model's base weights kept through the step, what QLoRA exists to avoid. The price is
one more dequantization a weight a step (a read of 0.5 byte and a write of 2 a weight, against the
products' 2·M flops a weight a direction).

On the GPU bitsandbytes runs its own fused 4-bit kernel instead of dequantize + ``F.linear`` for inputs
of up to 1536 rows, as its per-architecture table decides (``backends/cuda/ops.py``); the nodes always
dequantize, so there the base product is within the compute dtype's rounding of bitsandbytes' (bitwise
the same from 1537 rows on, training shapes; and on the CPU at any size).

What is read exactly, else why not (:func:`read_linear4bit` returns the reason, and PEFT's or the
layer's own forward runs): a ``Linear4bit`` without hooks or an instance forward, its weight quantized
(moved to its device) with a state whose shape is ``(out, in)`` (bitsandbytes' ``[K, N]`` legacy
orientation is not) and whose nested blocks are bitsandbytes' 256 (the only ones its matmul takes),
its compute dtype set (``compute_dtype=None`` is set from the first input by bitsandbytes' first
forward), not repacked for bitsandbytes' CPU inference kernel and not in eval mode on a CPU that has
that kernel (its forward repacks the weight there). 8-bit ``Linear8bitLt`` is not read: its
int8 matmul with outlier columns in fp16 is not a dequantized product.

bitsandbytes is optional: without it imported no model holds a ``Linear4bit``, and nothing here imports it
until a node dequantizes.
"""

from __future__ import annotations

import copy
import sys

import torch

from tigon._kernels import PLAIN_TENSORS, check_tensor

# the block size of nested (double-quant) absmax that bitsandbytes' 4-bit matmul takes
NESTED_BLOCKSIZE = 256
QUANT_TYPES = ("nf4", "fp4")
_LINEAR_4BIT_NAMES = ("Linear4bit", "LinearNF4", "LinearFP4")


class QuantizedWeight:
    """A ``Linear4bit``'s weight as a node reads it: the packed parameter and its quant state (references,
    not copies), ``shape`` ``(out, in)``, ``dtype`` the compute dtype C its product runs in (the nodes'
    dtype checks read it as they read a weight's dtype), ``device``."""

    __slots__ = ("packed", "state", "shape", "dtype", "device", "quant_type")

    def __init__(self, packed, state, dtype):
        self.packed = packed                  # Params4bit [(out·in + 1) // 2, 1], uint8 (or its quant_storage)
        self.state = state                    # bitsandbytes QuantState
        self.shape = torch.Size(state.shape)  # (out, in)
        self.dtype = dtype                    # C
        self.device = packed.device
        self.quant_type = state.quant_type

    def forward_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W as the forward's product reads it, in ``dtype``: dequantized in C (the ``gemm_4bit`` op), then
        cast as autocast casts it where ``dtype`` is not C."""
        from bitsandbytes.functional import dequantize_4bit

        state = self.state
        if state.dtype != self.dtype:  # the op dequantizes straight into C, not into S and then C
            state = copy.copy(state)
            state.dtype = self.dtype
        weight = dequantize_4bit(self.packed.view(-1, 1), state)                 # (out, in), C
        return weight if weight.dtype == dtype else weight.to(dtype)

    def backward_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W as ``MatMul4Bit.backward`` reads it for dx, in ``dtype`` (the gradient's): dequantized in S,
        then cast."""
        from bitsandbytes.functional import dequantize_4bit

        weight = dequantize_4bit(self.packed.view(-1, 1), self.state)            # (out, in), S
        return weight if weight.dtype == dtype else weight.to(dtype)

    def __repr__(self) -> str:
        return (f"QuantizedWeight({self.quant_type}, shape={tuple(self.shape)}, compute_dtype={self.dtype}, "
                f"nested={self.state.nested})")


def linear_4bit_class(module) -> bool:
    """Whether ``module`` is a bitsandbytes ``Linear4bit`` (or ``LinearNF4`` / ``LinearFP4``, the same
    forward); False where bitsandbytes is not imported (no model can hold one then)."""
    modules = sys.modules.get("bitsandbytes.nn.modules")
    if modules is None:
        return False
    return any(type(module) is getattr(modules, name, None) for name in _LINEAR_4BIT_NAMES)


def bitsandbytes_kind(module) -> str | None:
    """"4-bit" or "8-bit" where ``module`` is one of bitsandbytes' quantized linears, else None."""
    if linear_4bit_class(module):
        return "4-bit"
    modules = sys.modules.get("bitsandbytes.nn.modules")
    if modules is not None and type(module) is getattr(modules, "Linear8bitLt", None):
        return "8-bit"
    return None


def _hooked(module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def read_linear4bit(module) -> tuple | str:
    """``(QuantizedWeight, bias)`` of a bitsandbytes ``Linear4bit`` whose forward the nodes compute exactly
    (module docs), else why not. Reads, changes nothing (bitsandbytes' forward sets a compute dtype and
    recovers a lost state on the layer; where it would, this says so and its forward runs)."""
    if "forward" in module.__dict__ or _hooked(module):
        return "hooks or a forward set on the bitsandbytes layer"
    params = module._parameters
    weight, bias = params["weight"], params.get("bias")
    state = getattr(weight, "quant_state", None)
    if not getattr(weight, "bnb_quantized", False) or state is None:
        return "bitsandbytes 4-bit weight not quantized yet (it is on its first .to(device))"
    if not module.compute_type_is_set or module.compute_dtype is None:
        return "bitsandbytes compute dtype not set (its first forward sets it)"
    if getattr(state, "packing_format_for_cpu", False) or (weight.device.type == "cpu" and not module.training
                                                           and getattr(module, "support_avx512bf16_for_cpu", False)):
        return "bitsandbytes' CPU inference kernel (eval mode)"
    if state.quant_type not in QUANT_TYPES:
        return f"bitsandbytes quant_type {state.quant_type!r}"
    if tuple(state.shape) != (module.out_features, module.in_features):
        return f"bitsandbytes quant_state of shape {tuple(state.shape)}, not (out, in)"
    if state.nested and state.state2.blocksize != NESTED_BLOCKSIZE:
        return f"bitsandbytes nested quant_state with blocksize {state.state2.blocksize}"
    if bias is not None and type(bias) not in PLAIN_TENSORS:
        return "a bias that is not a plain tensor"
    return QuantizedWeight(weight, state, module.compute_dtype), bias


def quantized(t) -> bool:
    """Whether a node's weight argument is a :class:`QuantizedWeight`."""
    return type(t) is QuantizedWeight


def compute_dtype_reason(x, weights) -> str | None:
    """Why a node cannot compute the products of ``weights``' quantized ones in its dtype for input ``x``
    (None where it can, or none is quantized): without autocast the node computes in x's dtype, and
    bitsandbytes in the layer's compute dtype C (then casting to x's); under autocast both in the
    autocast dtype D, where C is fp32 or D (x.to(C) is then exact, or the autocast cast itself)."""
    device_type = x.device.type
    autocast = device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type)
    allowed = (torch.float32, torch.get_autocast_dtype(device_type)) if autocast else (x.dtype,)
    for w in weights:
        if type(w) is QuantizedWeight and w.dtype not in allowed:
            within = f"under {allowed[1]} autocast" if autocast else f"for a {x.dtype} input without autocast"
            return f"bitsandbytes computes in {w.dtype} {within}"
    return None


def check_weight(t, name: str, device, quantized_ok: bool = True) -> None:
    """:func:`tigon._kernels.check_tensor` of a weight, or a :class:`QuantizedWeight`'s device (where
    ``quantized_ok``; else it is refused as any non-tensor is)."""
    if quantized_ok and type(t) is QuantizedWeight:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} (all inputs on one device)")
        return
    check_tensor(t, name, device=device)


def unquantized(weights) -> list:
    """``weights`` with None in each :class:`QuantizedWeight`'s place: what a node casts by one launch
    (:func:`tigon._kernels.cast_all`), the quantized ones dequantized one at a time where they are used."""
    return [None if type(w) is QuantizedWeight else w for w in weights]


def forward_weight(weight, cast, dtype: torch.dtype):
    """The weight a forward product reads in ``dtype``: ``weight`` dequantized (forward) where it is a
    :class:`QuantizedWeight`, else ``cast`` (the tensor weight as the node cast it)."""
    return weight.forward_weight(dtype) if type(weight) is QuantizedWeight else cast


def backward_weight(weight, cast, dtype: torch.dtype):
    """As :func:`forward_weight`, for an input gradient's product (dequantized as bitsandbytes' backward does)."""
    return weight.backward_weight(dtype) if type(weight) is QuantizedWeight else cast


def forward_weights(weights, dtype: torch.dtype) -> list:
    """``weights`` with each :class:`QuantizedWeight` dequantized as the forward reads it (others as they are)."""
    return [w.forward_weight(dtype) if type(w) is QuantizedWeight else w for w in weights]


def backward_weights(weights, dtype: torch.dtype) -> list:
    """``weights`` with each :class:`QuantizedWeight` dequantized as the backward reads it."""
    return [w.backward_weight(dtype) if type(w) is QuantizedWeight else w for w in weights]


def split_saved(weights) -> tuple:
    """``(tensors, quantized)``: what ``save_for_backward`` takes (None in a quantized weight's place) and
    what the node keeps on its context instead (the :class:`QuantizedWeight`, None elsewhere)."""
    return (tuple(None if type(w) is QuantizedWeight else w for w in weights),
            tuple(w if type(w) is QuantizedWeight else None for w in weights))


def joined(saved, quantized_weights) -> tuple:
    """The weights again from :func:`split_saved`'s two halves."""
    return tuple(s if q is None else q for s, q in zip(saved, quantized_weights, strict=True))


def quant_label(weights) -> str | None:
    """``"bitsandbytes 4-bit nf4"`` (the quant types and compute dtypes of ``weights``' quantized ones, with
    "double quant" where nested), or None where none is."""
    found = [w for w in weights if type(w) is QuantizedWeight]
    if not found:
        return None
    kinds = dict.fromkeys(w.quant_type for w in found)
    dtypes = dict.fromkeys(str(w.dtype).removeprefix("torch.") for w in found)
    label = f"bitsandbytes 4-bit {'/'.join(kinds)}, compute {'/'.join(dtypes)}"
    nested = [w.state.nested for w in found]
    return label + (", double quant" if all(nested) else ", double quant on some" if any(nested) else "")
