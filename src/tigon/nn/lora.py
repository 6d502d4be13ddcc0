r"""LoRA adapters inside tigon's fused nodes: what a PEFT LoRA linear computes, and its low-rank products.

A PEFT LoRA linear (``peft.tuners.lora.layer.Linear``) with one active adapter, dropout 0 (or off) and
no variant computes, x ``[..., in]``::

    y = x Wᵀ + b + s·(x Aᵀ) Bᵀ          PEFT: base_layer(x) + lora_B(lora_A(dropout(x))) * scaling

with A ``[r, in]`` (``lora_A[name].weight``), B ``[out, r]`` (``lora_B[name].weight``) and s its
``scaling[name]``: α/r, or α/√r with rsLoRA (PEFT computes it when the adapter is made and
``set_scale`` changes it; it is read here at every call). :func:`lora_projection` reads a layer into
a :class:`LoraProjection` (W, b, A, B, s) or says why a fused node cannot compute it exactly; it runs
at every forward, because adapters are switched, disabled, merged and unmerged after the model was
patched. A plain ``nn.Linear`` reads as its base alone (A = B = None).

QLoRA: PEFT's ``Linear4bit`` (``peft.tuners.lora.bnb``) over a bitsandbytes ``Linear4bit`` computes the
same sum with the base's product bitsandbytes' (its dequantized weight in the layer's compute dtype), and
reads as a :class:`LoraProjection` whose W is a :class:`~tigon.nn.quantized_base.QuantizedWeight` (the
packed weight and its state, dequantized by the node where it needs it: :mod:`tigon.nn.quantized_base`);
so does a bare ``Linear4bit`` (a projection without adapters in a QLoRA model) as its base alone. PEFT's
``Linear4bit`` differs from its ``Linear`` only in the adapter path's casts (x to A's dtype outside CUDA
autocast, the delta to the base output's dtype before the sum): the same values in fp32, within the
compute dtype's rounding in bf16 (as under "Precision" below).

What cannot be exact keeps PEFT's forward (the reason says which): dropout with p > 0 in training
(PEFT's mask is drawn from the RNG inside its forward); DoRA and the other LoRA variants (their own
forwards); several active adapters; ``lora_bias``; adapters both merged and disabled (PEFT's forward
unmerges them then); a base layer that is neither a plain ``nn.Linear`` nor a bitsandbytes 4-bit one
read exactly (bitsandbytes 8-bit, another quantised or a tensor-parallel linear; the 4-bit cases
:func:`~tigon.nn.quantized_base.read_linear4bit` lists; tigon's shared-cast forward on a plain one, where
PEFT wrapped a patched model's projection, is the same product and counts as plain); hooks on the
layer or its parts (ZeRO-3's parameter gathering, PEFT's mixed-batch ``adapter_names`` hook), which only
PEFT's forward runs. Where PEFT's forward is the base layer's alone, the projection is the base:
adapters disabled (``disable_adapter()``), merged into the base weight, or no active adapter on this layer.

Low-rank products of adapters that read one input z ``[M, in]`` (an MLP's gate and up read x; q, k, v
read the attention's input) are stacked: with ``A = [A_1; A_2; ...]`` ``[R, in]`` (R = Σ r_i)::

    Ũ = z Aᵀ, column block i scaled by s_i          (M, R)   one product; saved (R is small)
    o_i += Ũ_i B_iᵀ                                  into each base output, one addmm each

Backward, from each output's gradient do_i::

    P_i = s_i · do_i B_i                             (M, r_i)  written into P = [P_1 | P_2 | ...]
    dz += P A                                        one product over the stack
    dA = Pᵀ z                                        (R, in)   one product, split into the A_i
    dB_i = do_iᵀ Ũ_i                                 (out_i, r_i)

(dA_i = s_i·(do_i B_i)ᵀ z and dB_i = s_i·do_iᵀ (z A_iᵀ) by the chain rule; the scales ride on P and
Ũ, so each gradient is one product.) These cost 2·M·R·(in + out) flops a direction, against the
base's 2·M·in·out: ~0.4 % at r = 16 on Llama-3.1-8B's projections.

Precision: the products run in the node's compute dtype (the autocast dtype, else x's) with the
adapter weights cast to it, as autocast casts them; their gradients come back in the adapters' own
dtype (fp32 adapters: the product's fp32 accumulator, :func:`tigon._kernels.matmul_to`). PEFT
rounds ``(x Aᵀ)``, ``(x Aᵀ)Bᵀ``, the scaled delta and the sum one by one; here the delta is added to
the base output by the product itself (one rounding of the sum). Without autocast, PEFT's default for
a bf16 model keeps fp32 adapters (``autocast_adapter_dtype``) and runs the adapter path in fp32; here
it runs on bf16 operands with fp32 accumulation: within bf16's rounding of the sum.

torch.compile: Dynamo traces :func:`lora_projection` as it traces any Python, so what it reads of the layers
becomes the compiled graph's guards (switching, disabling, merging an adapter or changing its scaling
recompiles, never reuses a graph made for other adapters), and the MLP node's autograd Function is traced
into the graph with its :class:`~tigon.nn.quantized_base.QuantizedWeight` (a plain object; its dequantization
is bitsandbytes' registered ops): no graph break in tigon's code, PEFT's or bitsandbytes'
(``tests/patching/test_lora_compile.py``). The attention node runs in eager training only
(:mod:`tigon.patching.fused_attention`): in a compiled model q, k, v and o run PEFT's forwards, traced.

Reference: :func:`lora_linear_reference` (PEFT's forward on raw tensors).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from tigon._kernels import PLAIN_TENSORS, cast_all, cast_stacked, matmul_to
from tigon.nn.quantized_base import bitsandbytes_kind, linear_4bit_class, quant_label, quantized, read_linear4bit


class LoraProjection(NamedTuple):
    """``y = x Wᵀ + b + scaling·(x Aᵀ) Bᵀ`` from the tensors a layer holds (not copies)."""

    weight: torch.Tensor                # W (out, in); a QuantizedWeight for a bitsandbytes 4-bit base
    bias: torch.Tensor | None           # b (out,)
    lora_a: torch.Tensor | None         # A (r, in); None: the base alone
    lora_b: torch.Tensor | None         # B (out, r)
    scaling: float                      # s


def plain_linear(projection) -> bool:
    """Whether ``projection`` computes exactly ``F.linear(x, weight, bias)`` from tensors it holds whole,
    so that a fused forward may read them: an ``nn.Linear`` (not a LoRA or quantised subclass), with
    no forward set on the instance (transformers' tensor parallelism sets one that redistributes the
    input and output), its weight a plain tensor (not a DTensor shard)."""
    return (type(projection) is nn.Linear and "forward" not in vars(projection)
            and type(projection.weight) in PLAIN_TENSORS)


def _hooked(module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _global_hooks() -> bool:
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or _module._global_backward_pre_hooks)


def _peft_lora_linear():
    """PEFT's LoRA ``Linear`` class, if PEFT is imported (a model cannot hold one otherwise)."""
    layer = sys.modules.get("peft.tuners.lora.layer")
    return None if layer is None else getattr(layer, "Linear", None)


def _peft_lora_linear_4bit():
    """PEFT's LoRA ``Linear4bit`` class (over a bitsandbytes ``Linear4bit``), if PEFT imported it (it does
    where bitsandbytes is installed)."""
    bnb = sys.modules.get("peft.tuners.lora.bnb")
    return None if bnb is None else getattr(bnb, "Linear4bit", None)


def _peft_lora(module) -> bool:
    """``module`` is one of PEFT's LoRA linears: its ``Linear``, or a LoRA layer over a bitsandbytes one."""
    if type(module) is _peft_lora_linear():
        return True
    return type(module).__module__ == "peft.tuners.lora.bnb"


def _tigon_forward(module) -> bool:
    """The instance forward of ``module`` is one of tigon's that computes ``F.linear`` (the shared-cast
    linear of a patched attention's projections, which PEFT wraps when a patched model gets adapters)."""
    own = module.__dict__.get("forward")
    return own is not None and getattr(getattr(own, "__func__", own), "_tigon", False)


def _plain_part(module) -> bool:
    """An ``nn.Linear`` the LoRA forward calls: plain (:func:`plain_linear`, or running tigon's
    shared-cast forward: the same product), without hooks, its tensors plain (not ZeRO-3 parameters)."""
    if type(module) is not nn.Linear or ("forward" in module.__dict__ and not _tigon_forward(module)) \
            or _hooked(module):
        return False
    params = module._parameters
    weight, bias = params["weight"], params.get("bias")
    return (type(weight) in PLAIN_TENSORS and not hasattr(weight, "ds_id")
            and (bias is None or type(bias) in PLAIN_TENSORS))


def lora_projection(module) -> LoraProjection | str:
    """What ``module`` computes as a :class:`LoraProjection`, or why a fused node cannot compute it
    exactly (module docs). ``module``: a plain ``nn.Linear``, a PEFT LoRA ``Linear`` or ``Linear4bit``, a
    bitsandbytes ``Linear4bit``.

    This runs at every forward of every projection, so the modules' dicts are read directly (an
    ``nn.Module`` attribute costs a ``__getattr__`` call each)."""
    if type(module) is nn.Linear and plain_linear(module):
        params = module._parameters
        return LoraProjection(params["weight"], params.get("bias"), None, None, 0.0)
    if linear_4bit_class(module):  # a QLoRA model's projection without adapters
        read = read_linear4bit(module)
        return read if isinstance(read, str) else LoraProjection(*read, None, None, 0.0)
    lora_cls, lora_4bit_cls = _peft_lora_linear(), _peft_lora_linear_4bit()
    cls = type(module)
    if cls is not lora_cls and (lora_4bit_cls is None or cls is not lora_4bit_cls):
        base = getattr(module, "base_layer", module) if _peft_lora(module) else module
        kind = bitsandbytes_kind(base)
        if kind is not None:
            return f"{'base layer is ' if base is not module else ''}bitsandbytes {kind} {type(base).__name__}"
        return f"{cls.__name__} is neither nn.Linear nor PEFT's LoRA Linear"
    if "forward" in module.__dict__ or _hooked(module) or _global_hooks():
        return "hooks or a forward set on the layer"
    modules = module._modules
    base = modules["base_layer"]
    if linear_4bit_class(base):  # (PEFT's Linear over one, where the model was not marked 4-bit, adds the same)
        base_read = read_linear4bit(base)
        if isinstance(base_read, str):
            return base_read
    elif cls is lora_cls and _plain_part(base):
        base_read = base._parameters["weight"], base._parameters.get("bias")
    else:
        return f"base layer is {type(base).__name__}, not a plain nn.Linear"
    disabled, merged = module._disable_adapters, bool(module.merged_adapters)
    if disabled and merged:
        return "adapters merged and disabled"
    lora_a_layers = modules["lora_A"]._modules
    active = module.active_adapter
    active = [name for name in ((active,) if isinstance(active, str) else active) if name in lora_a_layers]
    if disabled or merged or not active:  # PEFT's forward is the base layer's
        return LoraProjection(*base_read, None, None, 0.0)
    if len(active) > 1:
        return f"{len(active)} active adapters"
    (name,) = active
    variant = module.lora_variant.get(name)
    if variant is not None:
        return "DoRA" if module.use_dora.get(name) else f"LoRA variant {type(variant).__name__}"
    if module.lora_bias.get(name):
        return "lora_bias"
    dropout = modules["lora_dropout"]._modules[name]
    if type(dropout) is nn.Dropout:
        if dropout.training and dropout.p > 0:
            return f"dropout {dropout.p:g}"
    elif type(dropout) is not nn.Identity:
        return f"dropout {type(dropout).__name__}"
    lora_a, lora_b = lora_a_layers[name], modules["lora_B"]._modules[name]
    if not (_plain_part(lora_a) and _plain_part(lora_b)) or lora_a._parameters.get("bias") is not None \
            or lora_b._parameters.get("bias") is not None:
        return "lora_A / lora_B are not plain bias-free nn.Linear"
    return LoraProjection(*base_read, lora_a._parameters["weight"], lora_b._parameters["weight"],
                          float(module.scaling[name]))


def lora_projections(modules) -> tuple | str:
    """:func:`lora_projection` of each of ``modules`` (a dict: name -> module), or the first reason
    one of them cannot be fused, prefixed with its name."""
    out = []
    for name, module in modules.items():
        projection = lora_projection(module)
        if isinstance(projection, str):
            return f"{name}: {projection}"
        out.append(projection)
    return tuple(out)


def adapter_lines(modules, node: str, fallback: str, scope: str = "") -> list:
    """For ``Patch.replaced``: which of ``modules`` (a dict: name -> module of one attention or MLP) are
    PEFT LoRA linears whose adapters run inside the ``node`` node, and for each that cannot, why (its
    PEFT forward runs; ``fallback`` says what the module does then); bitsandbytes 4-bit bases that run
    inside it are named with their quant type. What holds at patch time: the node reads the layers
    again at every call. ``scope`` follows "inside the ``node`` node" (which layers or calls run it), its
    ``{forwards}`` the owner of the forwards that run otherwise ("PEFT's", or "bitsandbytes'" for bare
    4-bit bases)."""
    fused, ranks, bases, lines = [], [], {}, []
    for name, module in modules.items():
        peft = _peft_lora(module)
        if not (peft or linear_4bit_class(module)):
            continue
        projection = lora_projection(module)
        if isinstance(projection, str):
            owner = "PEFT's" if peft else "bitsandbytes'"
            lines.append(f"{name}: {owner} forward ({projection}); {fallback}")
            continue
        if projection.lora_a is not None:
            fused.append(name)
            ranks.append(projection.lora_a.shape[0])
        if quantized(projection.weight):
            bases[name] = projection.weight
    label = quant_label(bases.values())
    if fused:
        rank = "/".join(str(r) for r in dict.fromkeys(ranks))
        line = f"LoRA adapters (r={rank}) of {'/'.join(fused)} run inside the {node} node{scope}"
        lines.insert(0, (line if label is None else f"{line}; bases {label}").replace("{forwards}", "PEFT's"))
    elif bases:
        lines.insert(0, f"{'/'.join(bases)}: {label} bases run inside the {node} node{scope}".replace(
            "{forwards}", "bitsandbytes'"))
    return lines


def outside_lines(modules, why: str, joined: bool = False) -> list:
    """For ``Patch.replaced``: one line for each of ``modules`` (a dict: name -> module) that is a PEFT LoRA
    linear, saying its PEFT forward runs and ``why`` (the module's layout has no node that takes adapters,
    or the node does not run); ``joined``: one line naming them all."""
    names = [name for name, module in modules.items() if _peft_lora(module)]
    if joined and len(names) > 1:
        return [f"{'/'.join(names)}: PEFT's forwards ({why})"]
    return [f"{name}: PEFT's forward ({why})" for name in names]


def check_adapter(projection: LoraProjection, name: str, device) -> None:
    """A and B have the shapes the base weight implies and a float dtype on the base's device (ValueError or
    TypeError naming them)."""
    lora_a, lora_b = projection.lora_a, projection.lora_b
    if lora_a is None:
        return
    out_features, in_features = projection.weight.shape
    rank = lora_a.shape[0]
    for t, label, shape in ((lora_a, "lora_A", (rank, in_features)), (lora_b, "lora_B", (out_features, rank))):
        if not t.is_floating_point():
            raise TypeError(f"{name}.{label}.weight has dtype {t.dtype}, expected a float dtype")
        if t.device != device:
            raise ValueError(f"{name}.{label}.weight is on {t.device}, expected {device}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}.{label}.weight has shape {tuple(t.shape)}, expected {shape}")


# ------------------------------------------------------------------- stacked adapters over one input


class Adapters(NamedTuple):
    """The adapters of projections that read one input, cast to the compute dtype, A stacked."""

    lora_a: torch.Tensor                # [A_1; A_2; ...] (R, in)
    lora_bs: tuple                      # B_i (out_i, r_i)
    ranks: tuple                        # r_i
    scalings: tuple                     # s_i


def cast_adapters(lora_as, lora_bs, scalings, dtype, others=()):
    """:class:`Adapters` of the given A_i, B_i, s_i in ``dtype`` (the A_i stacked, all cast by one
    launch), and ``others`` cast as :func:`tigon._kernels.cast_all` casts them."""
    ranks = tuple(a.shape[0] for a in lora_as)
    if len(lora_as) == 1:
        a, *rest = cast_all((lora_as[0], *lora_bs, *others), dtype)
    else:
        a, _, rest = cast_stacked(lora_as, (None,) * len(lora_as), dtype, (*lora_bs, *others))
    return Adapters(a, tuple(rest[:len(lora_bs)]), ranks, tuple(scalings)), rest[len(lora_bs):]


def _scale_blocks(t: torch.Tensor, ranks, scalings) -> None:
    """Column block i of ``t`` (M, R) times s_i, in place."""
    if all(s == scalings[0] for s in scalings):
        if scalings[0] != 1.0:
            t.mul_(scalings[0])
        return
    start = 0
    for rank, s in zip(ranks, scalings, strict=True):
        if s != 1.0:
            t[:, start:start + rank].mul_(s)
        start += rank


def blocks(t: torch.Tensor, ranks) -> list:
    """The column blocks of ``t`` (M, R), one per adapter."""
    return list(t.split_with_sizes(list(ranks), dim=1))


def adapters_forward(z2: torch.Tensor, adapters: Adapters, outs2) -> torch.Tensor:
    """Ũ = z Aᵀ (block i scaled by s_i), and o_i += Ũ_i B_iᵀ into each of ``outs2`` in place; returns
    Ũ (M, R), which the backward needs."""
    u = z2 @ adapters.lora_a.t()                                    # (M, R)
    _scale_blocks(u, adapters.ranks, adapters.scalings)
    for out2, u_i, lora_b in zip(outs2, blocks(u, adapters.ranks), adapters.lora_bs, strict=True):
        out2.addmm_(u_i, lora_b.t())                                # (M, out_i)
    return u


def adapters_input_grads(douts2, adapters: Adapters) -> torch.Tensor:
    """P = [s_1·do_1 B_1 | s_2·do_2 B_2 | ...] (M, R): what dz (+= P A) and dA (= Pᵀ z) are made of."""
    if len(douts2) == 1:
        p = douts2[0] @ adapters.lora_bs[0]                         # (M, r)
    elif torch.compiler.is_compiling():  # dynamo traces no ``out=`` into a column view: the blocks, then one copy
        p = torch.cat([do_i @ lora_b for do_i, lora_b in zip(douts2, adapters.lora_bs, strict=True)], dim=1)
    else:
        p = torch.empty((douts2[0].shape[0], sum(adapters.ranks)), dtype=adapters.lora_a.dtype,
                        device=adapters.lora_a.device)
        for p_i, do_i, lora_b in zip(blocks(p, adapters.ranks), douts2, adapters.lora_bs, strict=True):
            torch.mm(do_i, lora_b, out=p_i)
    _scale_blocks(p, adapters.ranks, adapters.scalings)
    return p


def adapters_weight_grads(p, z2, u, douts2, adapters: Adapters, a_dtypes, b_dtypes, need_a, need_b):
    """dA_i (from dA = Pᵀ z, one product) and dB_i = do_iᵀ Ũ_i, each in its tensor's dtype (None where
    ``need_a`` / ``need_b`` says it is not wanted)."""
    grads_a = [None] * len(need_a)
    if any(need_a):
        d_a = matmul_to(p.t(), z2, a_dtypes[0])                     # (R, in)
        grads_a = [g.to(dtype) if want else None for g, dtype, want in
                   zip(d_a.split_with_sizes(list(adapters.ranks)), a_dtypes, need_a, strict=True)]
    grads_b = [matmul_to(do_i.t(), u_i, dtype) if want else None for do_i, u_i, dtype, want in
               zip(douts2, blocks(u, adapters.ranks), b_dtypes, need_b, strict=True)]
    return grads_a, grads_b


# ------------------------------------------------------------------------------------------ reference


def lora_linear_reference(x, weight, bias=None, lora_a=None, lora_b=None, scaling=1.0):
    """PEFT's LoRA forward on raw tensors: ``F.linear(x, W, b) + F.linear(F.linear(x, A), B) * s``."""
    y = F.linear(x, weight, bias)
    if lora_a is None:
        return y
    return y + F.linear(F.linear(x, lora_a), lora_b) * scaling
