"""QLoRA inside the gated MLP node: bitsandbytes 4-bit bases (``Linear4bit``, nf4 and fp4, with and without
double quant) read as tigon.nn.quantized_base.QuantizedWeight, their products bitsandbytes' own (bitwise: the
same dequantized weights, forward and backward), and SwiGLUMLP / GEGLUMLP adopting PEFT's bnb ``Linear4bit``
layers computing what stock PEFT + bitsandbytes compute (output, dx, every adapter's dA and dB) in one node
that keeps no dequantized weight; what cannot be exact keeps its own forward, and says why. On the CPU
(bitsandbytes' CPU backend), fp32 and bf16 compute; on the GPU in bf16 besides."""

import copy

import pytest
import torch
from torch import nn

from tests.helpers import DEVICE, assert_close, node_names, randn
from tigon.nn import quantized_base
from tigon.nn.lora import adapter_lines, lora_projection
from tigon.nn.lora_mlp import lora_gated_mlp, lora_gated_mlp_reference
from tigon.nn.mlp import GEGLUMLP, SwiGLUMLP, gated_mlp
from tigon.nn.quantized_base import QuantizedWeight, read_linear4bit

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

HIDDEN, INTER, TOKENS = 64, 128, 7  # in_features multiples of bitsandbytes' 64-value blocks, and not
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def linear_4bit(linear: nn.Linear, quant_type="nf4", compute=torch.float32, nested=True, source=None):
    """``linear`` quantized by bitsandbytes on the CPU (as ``.to(device)`` quantizes it), from its weight in
    ``source`` (the dtype the state records, S; default the weight's)."""
    layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=compute, compress_statistics=nested, quant_type=quant_type)
    layer.weight = bnb.nn.Params4bit(linear.weight.data.to(source or linear.weight.dtype), requires_grad=False,
                                     quant_type=quant_type, compress_statistics=nested, module=layer)
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
    return layer.to(DEVICE).train()


class Holder(nn.Module):
    """A model around one transformers MLP, for get_peft_model (marked as transformers marks a 4-bit model)."""

    def __init__(self, module):
        super().__init__()
        self.mlp = module
        self.is_loaded_in_4bit = True

    def forward(self, x):
        return self.mlp(x)


def qlora_mlp(quantize=PROJECTIONS, targets=PROJECTIONS, *, act="silu", dtype=torch.float32, bias=False,
              quant_type="nf4", compute=torch.float32, nested=True, hidden=HIDDEN, inter=INTER, **lora):
    """Stock PEFT over a LlamaMLP whose ``quantize`` projections are bitsandbytes Linear4bit, and a deep copy
    whose MLP is tigon's adopting the same projection modules (what tigon.patch does)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=4, num_key_value_heads=2,
                         hidden_act=act, mlp_bias=bias)
    module = LlamaMLP(config).to(DEVICE, dtype)
    with torch.no_grad():  # unit-scale outputs
        for p in module.parameters():
            p.copy_(randn(*p.shape, scale=p.shape[-1] ** -0.5 if p.dim() == 2 else 0.5))
    for name in quantize:
        setattr(module, name, linear_4bit(getattr(module, name), quant_type, compute, nested))
    stock = Holder(module)
    if targets:  # (none: a 4-bit model without adapters)
        config = peft.LoraConfig(target_modules=list(targets), init_lora_weights=False, **{"r": 4, "lora_alpha": 8,
                                                                                        **lora})
        stock = peft.get_peft_model(stock, config)
    ours = copy.deepcopy(stock)
    holder = ours.get_base_model() if targets else ours
    old = holder.mlp
    new = SwiGLUMLP(hidden, inter, device="meta") if act == "silu" else GEGLUMLP(hidden, inter, device="meta")
    for name in PROJECTIONS:
        setattr(new, name, getattr(old, name))
    holder.mlp = new
    return stock, ours, new


def run(model, x, dy):
    x = x.detach().clone().requires_grad_()
    y = model(x)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(y, [x, *params.values()], dy)
    return y, dict(zip(["x", *params], grads, strict=True))


def assert_matches_stock(stock, ours, x, dy, dtype=torch.float32):
    y_stock, want = run(stock, x, dy)
    y, got = run(ours, x, dy)
    assert y.dtype == y_stock.dtype
    assert_close(y, y_stock, dtype, "y")
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert got[name].dtype == g.dtype, name
        assert_close(got[name], g, dtype, f"d{name}")
    return got


# ------------------------------------------------------------------------------ bitsandbytes' products


@pytest.mark.parametrize("quant_type", ("nf4", "fp4"))
@pytest.mark.parametrize("nested", (False, True))
@pytest.mark.parametrize(("source", "compute"), ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)))
def test_dequantized_weights_are_bitsandbytes_products(quant_type, nested, source, compute):
    """Linear4bit's output and input gradient, bitwise: ``F.linear(x.to(C), forward_weight(C), b.to(C))`` and
    ``dy·backward_weight(C)`` (a state quantized from bf16 with fp32 compute dequantizes differently forward and
    backward);
    and under CPU autocast (the product in bf16)."""
    linear = nn.Linear(HIDDEN + 32, 40, device=DEVICE)  # 96 inputs: one and a half 64-value blocks a row
    layer = linear_4bit(linear, quant_type, compute, nested, source)
    weight, bias = read_linear4bit(layer)
    assert isinstance(weight, QuantizedWeight) and weight.shape == (40, HIDDEN + 32) and weight.dtype == compute
    assert weight.state.dtype == source and weight.state.nested == nested
    x = randn(3, 5, HIDDEN + 32, requires_grad=True)
    dy = randn(3, 5, 40)
    for autocast in (False, True):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
            want = torch.nn.functional.linear(x.to(compute), weight.forward_weight(compute), bias.to(compute))
        assert torch.equal(y, want.to(x.dtype))
        (dx,) = torch.autograd.grad(y, x, dy)
        product = torch.bfloat16 if autocast else compute
        assert torch.equal(dx, (dy.to(product) @ weight.backward_weight(product)).to(compute).to(x.dtype))
    if (source, compute) == (torch.bfloat16, torch.float32):  # the backward's rounds W to S first
        assert not torch.equal(weight.forward_weight(compute), weight.backward_weight(compute))


def test_read_linear4bit_reasons():
    """What bitsandbytes' forward would change or compute otherwise keeps its forward, and says why."""
    linear = nn.Linear(HIDDEN, 32, device=DEVICE)
    unquantized = bnb.nn.Linear4bit(HIDDEN, 32, compute_dtype=torch.float32, quant_type="nf4")
    assert "not quantized yet" in read_linear4bit(unquantized)
    layer = linear_4bit(linear, compute=None)
    assert read_linear4bit(layer) == "bitsandbytes compute dtype not set (its first forward sets it)"
    layer = linear_4bit(linear)
    handle = layer.register_forward_hook(lambda *args: None)
    assert "hooks" in read_linear4bit(layer)
    handle.remove()
    layer.weight.quant_state.state2.blocksize = 128  # a nested state bitsandbytes' matmul refuses
    assert read_linear4bit(layer) == "bitsandbytes nested quant_state with blocksize 128"
    layer = linear_4bit(linear).eval()
    if layer.support_avx512bf16_for_cpu and DEVICE.type == "cpu":  # its forward repacks the weight there
        assert read_linear4bit(layer) == "bitsandbytes' CPU inference kernel (eval mode)"
    else:
        assert isinstance(read_linear4bit(layer), tuple)
    eight = bnb.nn.Linear8bitLt(HIDDEN, 32, has_fp16_weights=False).to(DEVICE)
    assert lora_projection(eight) == "bitsandbytes 8-bit Linear8bitLt"
    holder = Holder(eight)
    holder.is_loaded_in_8bit = True
    wrapped = peft.get_peft_model(holder, peft.LoraConfig(r=2, target_modules=["mlp"])).get_base_model().mlp
    assert type(wrapped).__name__ == "Linear8bitLt" and type(wrapped).__module__ == "peft.tuners.lora.bnb"
    assert lora_projection(wrapped) == "base layer is bitsandbytes 8-bit Linear8bitLt"
    assert adapter_lines({"mlp": wrapped}, "MLP", "fallback") == [
        "mlp: PEFT's forward (base layer is bitsandbytes 8-bit Linear8bitLt); fallback"]


def test_lora_projection_reads_peft_linear4bit_and_bare_linear4bit():
    stock, _, _ = qlora_mlp(targets=("up_proj",), quant_type="fp4", nested=False)
    layers = stock.get_base_model().mlp
    up, gate = lora_projection(layers.up_proj), lora_projection(layers.gate_proj)
    assert isinstance(up.weight, QuantizedWeight) and up.weight.packed is layers.up_proj.base_layer.weight
    assert up.lora_a is layers.up_proj.lora_A["default"].weight and up.scaling == 2.0
    assert isinstance(gate.weight, QuantizedWeight) and gate.lora_a is None  # bare Linear4bit: its base alone
    assert adapter_lines({n: getattr(layers, n) for n in PROJECTIONS}, "MLP", "fallback") == [
        "LoRA adapters (r=4) of up_proj run inside the MLP node; bases bitsandbytes 4-bit fp4, compute float32"]
    # a scope after the node's name, its {forwards} the owner of the forwards that run otherwise
    scope = " in some layers ({forwards} elsewhere)"
    assert adapter_lines({n: getattr(layers, n) for n in PROJECTIONS}, "MLP", "fallback", scope) == [
        "LoRA adapters (r=4) of up_proj run inside the MLP node in some layers (PEFT's elsewhere); bases bitsandbytes "
        "4-bit fp4, compute float32"]
    assert adapter_lines({"gate_proj": layers.gate_proj}, "MLP", "fallback", scope) == [
        "gate_proj: bitsandbytes 4-bit fp4, compute float32 bases run inside the MLP node in some layers "
        "(bitsandbytes' elsewhere)"]


# ------------------------------------------------------------------------------ the MLP node against stock


@pytest.mark.parametrize(("rank", "quant_type", "nested", "act"), (
    (1, "nf4", True, "silu"), (16, "fp4", False, "silu"), (16, "nf4", False, "gelu_pytorch_tanh")))
def test_qlora_mlp_matches_peft_bnb(rank, quant_type, nested, act):
    """Every projection 4-bit with an adapter: y, dx and each A, B gradient equal stock PEFT + bitsandbytes'
    (fp32 compute), from one node."""
    stock, ours, module = qlora_mlp(quant_type=quant_type, nested=nested, act=act, r=rank, lora_alpha=2 * rank + 1)
    x, dy = randn(2, TOKENS, HIDDEN), randn(2, TOKENS, HIDDEN)
    got = assert_matches_stock(stock, ours, x, dy)
    assert len(got) == 1 + 6 and module.unfused_reason() is None
    assert "_LoraGatedMLPFunctionBackward" in node_names(ours(x.requires_grad_()))


@pytest.mark.parametrize(("quantize", "targets"), (
    (PROJECTIONS, ("up_proj", "down_proj")),        # gate a bare Linear4bit
    (PROJECTIONS, ("gate_proj",)),
    (("gate_proj", "down_proj"), ("gate_proj", "up_proj")),  # up a plain nn.Linear under PEFT
    (PROJECTIONS, ()),                              # no adapters: the 4-bit bases alone
))
def test_qlora_mlp_subsets(quantize, targets):
    stock, ours, module = qlora_mlp(quantize, targets, r=3)
    x, dy = randn(TOKENS, HIDDEN), randn(TOKENS, HIDDEN)
    got = assert_matches_stock(stock, ours, x, dy)
    assert len(got) == 1 + 2 * len(targets) and module.unfused_reason() is None
    assert "_LoraGatedMLPFunctionBackward" in node_names(ours(x.requires_grad_()))


def test_qlora_mlp_biases_stride0_and_fp32_reference():
    """Biases (bitsandbytes casts them to the compute dtype), the stride-0 gradient of ``.sum()``; and the
    functional form against PEFT's formula in fp64 over the dequantized weights."""
    stock, ours, _ = qlora_mlp(bias=True, r=5)
    x = randn(3, 5, HIDDEN, requires_grad=True)
    grads = []
    for model in (stock, ours):
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        grads.append(torch.autograd.grad(model(x).sum(), [x, *params.values()]))
    for g, want in zip(*grads[::-1], strict=True):
        assert_close(g, want, torch.float32, "grad (stride-0 dy)")
    layers = stock.get_base_model().mlp
    projections = [lora_projection(getattr(layers, n)) for n in PROJECTIONS]
    y = lora_gated_mlp(x, *projections)
    dequantized = [p._replace(weight=p.weight.forward_weight(torch.float32)) for p in projections]
    ref = lora_gated_mlp_reference(x.double(), *[
        p._replace(**{f: getattr(p, f).double() for f in ("weight", "bias", "lora_a", "lora_b")}) for p in dequantized])
    assert_close(y, ref, torch.float32, "y against fp64")


def test_qlora_mlp_saves_no_dequantized_weight():
    """The node keeps x, gate, up and the (M, r) products (and the cast adapters), never a dequantized
    (I, H) weight: the backward dequantizes again."""
    stock, ours, _ = qlora_mlp(r=4)
    tokens = 37
    x = randn(tokens, HIDDEN, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = ours(x)
    assert "_LoraGatedMLPFunctionBackward" in node_names(y)
    float_saved = sorted(t.numel() for t in saved if t.is_floating_point())
    assert float_saved == sorted([tokens * HIDDEN, tokens * INTER, tokens * INTER, tokens * 8, tokens * 4,
                                  8 * HIDDEN, INTER * 4, INTER * 4, 4 * INTER, HIDDEN * 4])
    assert not any(t.numel() == INTER * HIDDEN for t in saved if t.is_floating_point())
    torch.autograd.grad(y, [x], torch.ones_like(y))  # the backward dequantizes again


def test_qlora_mlp_compute_dtype_not_the_inputs_keeps_peft_forward():
    """bf16 compute on an fp32 input without autocast (bitsandbytes rounds x and its output): the module
    runs PEFT's forwards (exactly stock's), the functional form says why."""
    stock, ours, module = qlora_mlp(compute=torch.bfloat16, r=2)
    x, dy = randn(TOKENS, HIDDEN), randn(TOKENS, HIDDEN)
    assert_matches_stock(stock, ours, x, dy)
    assert "_LoraGatedMLPFunctionBackward" not in node_names(ours(x.requires_grad_()))
    layers = stock.get_base_model().mlp
    with pytest.raises(TypeError, match="bitsandbytes computes in torch.bfloat16 for a torch.float32 input"):
        lora_gated_mlp(x, *[lora_projection(getattr(layers, n)) for n in PROJECTIONS])


def test_qlora_mlp_bf16_compute():
    """A bf16 model quantized with bf16 compute (QLoRA's usual setting), PEFT's fp32 adapters, no autocast:
    within bf16 rounding of stock PEFT + bitsandbytes; and fp32 compute under bf16 autocast."""
    stock, ours, _ = qlora_mlp(dtype=torch.bfloat16, compute=torch.bfloat16, r=4)
    x, dy = randn(TOKENS, HIDDEN, dtype=torch.bfloat16), randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
    got = assert_matches_stock(stock, ours, x, dy, torch.bfloat16)
    assert all(g.dtype == torch.float32 for n, g in got.items() if "lora_" in n)
    stock, ours, _ = qlora_mlp(r=4)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y_stock, want = run(stock, x.float(), dy)
        y, got = run(ours, x.float(), dy)
    assert "_LoraGatedMLPFunctionBackward" in node_names(y)
    # stock's Linear4bit gives its output in x's dtype (fp32) under autocast, the node the autocast dtype
    assert_close(y.float(), y_stock, torch.bfloat16, "y (autocast)")
    for name, g in want.items():
        assert_close(got[name], g, torch.bfloat16, f"d{name} (autocast)")


def test_quantized_weight_device_and_shape_checks():
    stock, _, _ = qlora_mlp(r=2)
    layers = stock.get_base_model().mlp
    gate, up, down = (lora_projection(getattr(layers, n)) for n in PROJECTIONS)
    with pytest.raises(ValueError, match="down_proj.weight has shape"):
        lora_gated_mlp(randn(TOKENS, HIDDEN), gate, up, up)
    meta = copy.copy(gate.weight)
    meta.device = torch.device("meta")
    with pytest.raises(ValueError, match="gate_proj.weight is on meta"):
        lora_gated_mlp(randn(TOKENS, HIDDEN), gate._replace(weight=meta), up, down)
    with pytest.raises(TypeError, match="gate_proj.weight must be a torch.Tensor, got QuantizedWeight"):
        gated_mlp(randn(TOKENS, HIDDEN), gate.weight, up.weight, down.weight)
    assert quantized_base.quant_label([gate.weight]) == "bitsandbytes 4-bit nf4, compute float32, double quant"


@pytest.mark.gpu
def test_qlora_mlp_gpu_bf16_training_shape():
    """On the GPU at a training shape (4096 tokens: bitsandbytes dequantizes and calls F.linear there too,
    past its fused kernel's 1536 rows), bf16 base and compute, r = 16: within bf16 rounding of stock."""
    stock, ours, _ = qlora_mlp(dtype=torch.bfloat16, compute=torch.bfloat16, hidden=512, inter=1536, r=16,
                               lora_alpha=32)
    x = randn(2, 2048, 512, dtype=torch.bfloat16)
    dy = randn(2, 2048, 512, dtype=torch.bfloat16)
    assert_matches_stock(stock, ours, x, dy, torch.bfloat16)


# ------------------------------------------------------------------------------------ the attention node


def test_attention_node_over_quantized_weights_is_the_node_over_their_dequantized_ones():
    """tigon.nn.attention.AttentionNode given QuantizedWeights for q, k, v, o (q and v with adapters, k and o
    bare): bitwise the node given the dequantized weights (state quantized from the compute dtype: forward
    and backward read the same W), the adapters' and the input's gradients too; nothing of a weight's shape
    saved. The node computes in fp32 on the CPU (sdpa's CPU flash backend) and in bf16 on the GPU, as under
    autocast: sdpa takes fp32 with grouped heads to its math fallback there, which the node does not call
    (it raises NotCalledHere, and tigon.patching.fused_attention runs the attention's own forward)."""
    from tigon.nn.attention import ATTENTION_NODE

    heads, kv_heads, head_dim, hidden, batch, seq = 4, 2, 16, HIDDEN, 2, 9
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
    outs = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim, "o": hidden}
    ins = {"q": hidden, "k": hidden, "v": hidden, "o": heads * head_dim}
    torch.manual_seed(0)
    quantized = {n: read_linear4bit(linear_4bit(nn.Linear(ins[n], outs[n], bias=n != "o", device=DEVICE),
                                                quant_type="fp4" if n == "k" else "nf4", nested=n != "v"))
                 for n in outs}
    adapters = {n: (randn(3, ins[n], requires_grad=True), randn(outs[n], 3, requires_grad=True)) if n in "qv"
                else (None, None) for n in outs}
    x, dy = randn(batch, seq, hidden), randn(batch, seq, hidden)
    angles = torch.arange(seq, dtype=torch.float32, device=DEVICE)[:, None] / 10 ** torch.arange(
        head_dim // 2, dtype=torch.float32, device=DEVICE)
    cos, sin = torch.cat((angles, angles), -1).cos()[None], torch.cat((angles, angles), -1).sin()[None]
    shape = (heads, kv_heads, head_dim, head_dim ** -0.5)
    lora = [t for n in outs for t in adapters[n]]
    scalings = (2.0, 0.0, 0.5, 0.0)
    results = []
    for dequantize in (False, True):
        params = [t for n in outs for t in (quantized[n][0].forward_weight(torch.float32) if dequantize
                                            else quantized[n][0], quantized[n][1])]
        leaf = x.detach().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            y = ATTENTION_NODE(leaf, cos, sin, None, dtype, shape, *params, None, None, None, *lora, scalings)
        grads = torch.autograd.grad(y, [leaf, *(t for t in lora if t is not None)], dy)
        results.append((y, grads, saved))
    (y, grads, saved), (y_plain, grads_plain, _) = results
    assert torch.equal(y, y_plain)
    for g, want in zip(grads, grads_plain, strict=True):
        assert torch.equal(g, want)
    weight_shapes = {(outs[n], ins[n]) for n in outs} | {(sum(outs[n] for n in "qkv"), hidden)}
    assert not [tuple(t.shape) for t in saved if t.is_floating_point() and tuple(t.shape) in weight_shapes]
