"""LoRA adapters inside the attention node (tigon.nn.attention.AttentionNode, module docs "LoRA"): q, k, v and
o each ``x Wᵀ + b + s·(x Aᵀ) Bᵀ`` (PEFT's LoRA linear), the rotary, sdpa and o_proj, against the same attention
in float64 from PEFT's formula (tigon.nn.lora.lora_linear_reference): output, input gradient, every adapter's
dA and dB and the base weights' gradients. The reference rounds to the compute dtype where the node rounds, and
the gradients there in the backward (API.md, Precision; :func:`_reference`). Called directly on the test device
(on the CPU: flash attention, the rotary under the interpreter), in fp32 and in bf16; on the GPU in bf16 at a
real-ish shape besides."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import DEVICE, ON_GPU, assert_close, stride0_like
from tigon.nn.attention import ATTENTION_NODE
from tigon.nn.lora import lora_linear_reference

NAMES = ("q", "k", "v", "o")


def _rotate_half(t):
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def _tensors(device, dtype, ranks, *, batch=2, seq=11, heads=4, kv_heads=2, head_dim=8, hidden=24, bias=True,
             seed=0):
    """Input (non-contiguous), cos/sin, base weights (biases on q, k, v), adapters of the projections whose rank is
    not None (fp32, as PEFT keeps them), scalings."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dt)

    x = rand(batch, hidden * 2, seq).transpose(1, 2)[..., ::2]                         # (B, T, H), non-contiguous
    positions = torch.arange(seq, dtype=torch.float64)[:, None]
    angles = positions / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.cat((angles, angles), dim=-1)[None]                               # (1, T, D)
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    outs = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim, "o": hidden}
    ins = {"q": hidden, "k": hidden, "v": hidden, "o": heads * head_dim}
    base, adapters = {}, {}
    for name in NAMES:
        base[name] = (rand(outs[name], ins[name], scale=ins[name] ** -0.5),
                      rand(outs[name], scale=0.1) if bias and name != "o" else None)
        r = ranks[name]
        adapters[name] = (None, None) if r is None else (
            rand(r, ins[name], scale=ins[name] ** -0.5, dt=torch.float32), rand(outs[name], r, scale=0.3,
                                                                             dt=torch.float32))
    return x, cos, sin, base, adapters, (heads, kv_heads, head_dim, head_dim ** -0.5)


class _Rounded(torch.autograd.Function):
    """``t`` rounded to ``dtype`` (kept in its own), and its gradient rounded to ``dtype`` in the backward: an
    intermediate the node holds in the compute dtype, forward and backward."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = dtype
        return t.to(dtype).to(t.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).to(grad.dtype), None


def _reference(x, cos, sin, base, adapters, scalings, shape, dtype):
    """PEFT's LoRA linears around transformers' attention (rotate-half rotary, causal sdpa with grouped heads),
    rounded to ``dtype`` where the node rounds, and the gradients there in the backward: each projection's base
    product, ``z Aᵀ``, ``Ũ = s·(z Aᵀ)`` and the sum with ``Ũ Bᵀ``; the rotated q and k; the attention's output.
    With the large logits of these adapters' deltas a softmax turns one rounding of q or k more or less into
    errors of a few parts in a hundred, so each of these roundings is made where the node makes it."""
    heads, kv_heads, head_dim, scale = shape
    batch, seq = x.shape[:2]

    def project(name, z):  # the base product rounded; Ũ = s·(z Aᵀ), z Aᵀ and Ũ rounded; Ũ Bᵀ added, rounded
        y = _Rounded.apply(lora_linear_reference(z, *base[name]), dtype)
        lora_a, lora_b = adapters[name]
        if lora_a is not None:
            u = _Rounded.apply(_Rounded.apply(F.linear(z, lora_a), dtype) * scalings[NAMES.index(name)], dtype)
            y = y + F.linear(u, lora_b)
        return _Rounded.apply(y, dtype)

    q, k, v = (project(n, x).view(batch, seq, -1, head_dim).transpose(1, 2) for n in "qkv")
    cos, sin = cos[:, None], sin[:, None]
    q, k = (_Rounded.apply(t * cos + _rotate_half(t) * sin, dtype) for t in (q, k))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=kv_heads != heads)
    return project("o", _Rounded.apply(a, dtype).transpose(1, 2).reshape(batch, seq, heads * head_dim))


def _node(x, cos, sin, base, adapters, scalings, shape, dtype):
    params = [t for name in NAMES for t in base[name]]
    lora = [t for name in NAMES for t in adapters[name]]
    return ATTENTION_NODE(x, cos, sin, None, dtype, shape, *params, None, None, None, *lora, scalings)


def _leaves(tensors):
    return [t.detach().requires_grad_() if t is not None else None for t in tensors]


CASES = {  # ranks of q, k, v, o (None: no adapter), scalings (α/r, or α/√r with rsLoRA)
    "r1-all": ({"q": 1, "k": 1, "v": 1, "o": 1}, (8.0, 8.0, 8.0, 8.0)),
    "r5-rslora": ({"q": 5, "k": 5, "v": 5, "o": 5}, (8 / 5 ** 0.5,) * 4),
    "r16-q-v-only": ({"q": 16, "k": None, "v": 16, "o": None}, (0.5, 0.0, 0.5, 0.0)),
    "mixed-ranks-k-o": ({"q": None, "k": 3, "v": None, "o": 7}, (0.0, 2.0, 0.0, 1.5)),
}


def _check(device, dtype, ranks, scalings, trainable_base, **sizes):
    x, cos, sin, base, adapters, shape = _tensors(device, dtype, ranks, **sizes)
    results = []
    for precision in (dtype, torch.float64):
        # the reference reads the adapters as the node does: cast to the compute dtype (its one rounding of them)
        cast = (lambda t: t) if precision == dtype else (lambda t: None if t is None else t.to(dtype).double())
        leaf_x = cast(x).detach().requires_grad_()
        leaf_base = {n: _leaves(map(cast, base[n])) if trainable_base else [cast(t) for t in base[n]] for n in NAMES}
        leaf_adapters = {n: _leaves(map(cast, adapters[n])) for n in NAMES}
        c, s = cast(cos), cast(sin)
        if precision == dtype:
            y = _node(leaf_x, c, s, leaf_base, leaf_adapters, scalings, shape, dtype)
            grad = stride0_like(y) if ranks["o"] is None else torch.randn_like(y)
        else:
            y = _reference(leaf_x, c, s, leaf_base, leaf_adapters, scalings, shape, dtype)
        y.backward(grad.to(y.dtype))
        named = {"x": leaf_x}
        for n in NAMES:
            named.update({f"{n}.lora_{ab}": t for ab, t in zip("AB", leaf_adapters[n], strict=True)})
            named.update({f"{n}.{wb}": t for wb, t in zip(("weight", "bias"), leaf_base[n], strict=True)})
        results.append((y, {k: t.grad for k, t in named.items() if t is not None and t.requires_grad}))
    (y, got), (y_ref, want) = results
    assert_close(y, y_ref, dtype, "output")
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert got[name].dtype == (torch.float32 if "lora" in name else dtype), name
        assert_close(got[name], g, dtype, name)
    assert {n for n in got if "lora" in n} == {f"{n}.lora_{ab}" for n in NAMES if ranks[n] is not None for ab in "AB"}


# fp32 on the GPU: sdpa's backend for fp32 is the memory-efficient one, which takes no grouped heads (with them
# sdpa would choose its math fallback, which the node does not call): as many k/v heads as query heads there
FP32_HEADS = {"kv_heads": 4} if ON_GPU else {}


@pytest.mark.parametrize("case", CASES)
def test_fp32_adapters_against_fp64_peft_formula(case):
    ranks, scalings = CASES[case]
    _check(DEVICE, torch.float32, ranks, scalings, trainable_base=case == "r5-rslora", **FP32_HEADS)


def test_bf16_fp32_adapters_cast_by_the_node():
    ranks, scalings = CASES["r5-rslora"]
    _check(DEVICE, torch.bfloat16, ranks, scalings, trainable_base=True, bias=False)


def test_no_adapters_is_the_node_without_lora():
    """All adapters None: the same values as the node called without the LoRA arguments."""
    x, cos, sin, base, adapters, shape = _tensors(DEVICE, torch.float32, dict.fromkeys(NAMES), **FP32_HEADS)
    params = [t for name in NAMES for t in base[name]]
    y = _node(x, cos, sin, base, adapters, (0.0,) * 4, shape, torch.float32)
    assert torch.equal(y, ATTENTION_NODE(x, cos, sin, None, torch.float32, shape, *params, None, None, None))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["r5-rslora", "r16-q-v-only"])
def test_gpu_bf16_adapters_against_fp64_peft_formula(case):
    ranks, scalings = CASES[case]
    _check("cuda", torch.bfloat16, ranks, scalings, trainable_base=True, batch=2, seq=512, heads=16, kv_heads=4,
           head_dim=64, hidden=1024)
