"""LoRA inside the gated MLP node: tigon.nn.SwiGLUMLP / GEGLUMLP adopting PEFT LoRA linears computes what
stock PEFT computes (output, x's gradient, every adapter's A and B, a trainable base), in one node; what
cannot be read exactly keeps PEFT's forward. tigon.nn.lora reads the layers."""

import copy

import pytest
import torch
from torch import nn

from tests.helpers import DEVICE, assert_close, fp64_reference, node_names, noncontiguous, randn
from tigon.nn import mlp
from tigon.nn.lora import LoraProjection, lora_projection
from tigon.nn.lora_mlp import lora_gated_mlp, lora_gated_mlp_reference
from tigon.nn.mlp import GEGLUMLP, SwiGLUMLP

peft = pytest.importorskip("peft")

HIDDEN, INTER, TOKENS = 24, 40, 7
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ACTIVATIONS = {"silu": (SwiGLUMLP, {}), "gelu_pytorch_tanh": (GEGLUMLP, {"approximate": "tanh"})}


class Holder(nn.Module):
    """A model around one transformers MLP, for get_peft_model."""

    def __init__(self, module):
        super().__init__()
        self.mlp = module

    def forward(self, x):
        return self.mlp(x)


def stock_mlp(act="silu", bias=False, dtype=torch.float32, hidden=HIDDEN, inter=INTER):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=4, num_key_value_heads=2,
                         hidden_act=act, mlp_bias=bias)
    module = LlamaMLP(config).to(DEVICE)
    with torch.no_grad():  # unit-scale outputs: nn.Linear's init is tiny at these sizes
        for p in module.parameters():
            p.copy_(randn(*p.shape, scale=p.shape[-1] ** -0.5 if p.dim() == 2 else 0.5))
    return Holder(module.to(dtype))


def lora_config(targets=PROJECTIONS, **kwargs):
    # init_lora_weights=False: B is random, not zero, so that the delta and every gradient count
    return peft.LoraConfig(target_modules=list(targets), init_lora_weights=False, **{"r": 4, "lora_alpha": 8, **kwargs})


def adopt(model, act="silu"):
    """Swap the LlamaMLP inside ``model`` for tigon's module adopting its projections (what tigon.patch does)."""
    holder = model.get_base_model() if hasattr(model, "get_base_model") else model
    old = holder.mlp
    cls, kwargs = ACTIVATIONS[act]
    new = cls(old.gate_proj.in_features, old.gate_proj.out_features, device="meta", **kwargs)
    for name in PROJECTIONS:
        setattr(new, name, getattr(old, name))
    holder.mlp = new
    return new


def pair(targets=PROJECTIONS, *, act="silu", bias=False, dtype=torch.float32, trainable_base=(), hidden=HIDDEN,
         inter=INTER, **kwargs):
    """Stock PEFT over a LlamaMLP, and a deep copy whose MLP is tigon's (same parameters' values)."""
    torch.manual_seed(0)
    stock = peft.get_peft_model(stock_mlp(act, bias, dtype, hidden, inter), lora_config(targets, **kwargs))
    for name in trainable_base:
        for p in getattr(stock.get_base_model().mlp, name).get_base_layer().parameters():
            p.requires_grad_(True)
    ours = copy.deepcopy(stock)
    module = adopt(ours, act)
    return stock, ours, module


def trained(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def run(model, x, dy):
    x = x.detach().clone().requires_grad_(x.requires_grad)
    y = model(x)
    params = trained(model)
    names = list(params)
    leaves = ([x] if x.requires_grad else []) + [params[n] for n in names]
    grads = torch.autograd.grad(y, leaves, dy)
    out = dict(zip((["x"] if x.requires_grad else []) + names, grads, strict=True))
    return y, out


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


# ------------------------------------------------------------------------------------------ reading


def lora_layer(**kwargs):
    torch.manual_seed(0)
    model = peft.get_peft_model(stock_mlp(), lora_config(("up_proj",), **kwargs))
    return model, model.get_base_model().mlp.up_proj


@pytest.mark.parametrize(("rslora", "scaling"), ((False, 8 / 4), (True, 8 / 2)))
def test_lora_projection_reads_the_active_adapter(rslora, scaling):
    """A (r, in), B (out, r) and the scaling PEFT computes (α/r; rsLoRA α/√r), the base's W and b; a plain
    nn.Linear reads as its base alone."""
    _, layer = lora_layer(use_rslora=rslora)
    got = lora_projection(layer)
    assert isinstance(got, LoraProjection)
    assert got.weight is layer.base_layer.weight and got.bias is None
    assert got.lora_a is layer.lora_A["default"].weight and got.lora_b is layer.lora_B["default"].weight
    assert got.scaling == pytest.approx(scaling)
    plain = nn.Linear(4, 3, device=DEVICE)
    assert lora_projection(plain) == LoraProjection(plain.weight, plain.bias, None, None, 0.0)


def test_lora_projection_reasons_and_base_only_states():
    """What PEFT's forward computes as the base alone reads as the base; what cannot be exact says why."""
    model, layer = lora_layer(lora_dropout=0.05)
    assert lora_projection(layer) == "dropout 0.05"
    layer.eval()  # dropout is the identity in eval mode
    assert isinstance(lora_projection(layer), LoraProjection)
    layer.train()

    model, layer = lora_layer()
    with model.disable_adapter():
        got = lora_projection(layer)
        assert got.lora_a is None and got.weight is layer.base_layer.weight
    layer.merge()
    assert lora_projection(layer).lora_a is None
    layer.enable_adapters(False)
    assert lora_projection(layer) == "adapters merged and disabled"
    layer.enable_adapters(True)
    layer.unmerge()
    assert lora_projection(layer).lora_a is not None

    model.add_adapter("other", lora_config(("up_proj",)))
    model.base_model.set_adapter(["default", "other"])
    assert lora_projection(layer) == "2 active adapters"
    model.base_model.set_adapter("other")
    assert lora_projection(layer).lora_a is layer.lora_A["other"].weight

    handle = layer.register_forward_pre_hook(lambda m, args: None)
    assert "hooks" in lora_projection(layer)
    handle.remove()

    assert lora_projection(lora_layer(use_dora=True)[1]) == "DoRA"
    assert lora_projection(peft.get_peft_model(stock_mlp(bias=True), lora_config(("up_proj",), lora_bias=True))
                           .get_base_model().mlp.up_proj) == "lora_bias"
    assert "neither" in lora_projection(nn.Conv1d(3, 3, 1))


# ------------------------------------------------------------------------------------- against PEFT


@pytest.mark.parametrize("rank", (1, 5, 16))
@pytest.mark.parametrize("rslora", (False, True))
def test_lora_mlp_matches_peft(rank, rslora):
    """Every projection adapted: output, dx and each A, B gradient equal stock PEFT's, from one node."""
    stock, ours, module = pair(r=rank, lora_alpha=2 * rank + 1, use_rslora=rslora)
    x, dy = randn(2, TOKENS, HIDDEN, requires_grad=True), randn(2, TOKENS, HIDDEN)
    got = assert_matches_stock(stock, ours, x, dy)
    assert len(got) == 1 + 6 and module.unfused_reason() is None
    names = node_names(ours(x))
    assert "_LoraGatedMLPFunctionBackward" in names and "AddmmBackward0" not in names


@pytest.mark.parametrize(("targets", "act", "bias"), (
    (("up_proj", "down_proj"), "silu", False),         # gate plain
    (("gate_proj",), "gelu_pytorch_tanh", True),       # GeGLU with biases, one adapter
    (("down_proj",), "silu", True),
    (("gate_proj", "up_proj"), "gelu_pytorch_tanh", False),
))
def test_lora_mlp_subset_of_projections(targets, act, bias):
    stock, ours, module = pair(targets, act=act, bias=bias, r=3)
    x, dy = randn(TOKENS, HIDDEN, requires_grad=True), randn(TOKENS, HIDDEN)
    got = assert_matches_stock(stock, ours, x, dy)
    assert len(got) == 1 + 2 * len(targets)
    assert "_LoraGatedMLPFunctionBackward" in node_names(ours(x))


@pytest.mark.parametrize("trainable_base", (("down_proj",), ("gate_proj", "up_proj"), PROJECTIONS))
def test_lora_mlp_trainable_base(trainable_base):
    """A base projection with requires_grad (its weight and bias) gets stock's gradient; frozen ones none."""
    stock, ours, _ = pair(bias=True, trainable_base=trainable_base, r=2)
    x, dy = randn(TOKENS, HIDDEN, requires_grad=True), randn(TOKENS, HIDDEN)
    got = assert_matches_stock(stock, ours, x, dy)
    assert sum("base_layer" in n for n in got) == 2 * len(trainable_base)


def test_lora_mlp_scalings_and_ranks_per_projection():
    """rank_pattern / alpha_pattern: gate and up differ in rank and scaling (their stacked blocks)."""
    stock, ours, _ = pair(r=2, rank_pattern={"gate_proj": 3, "down_proj": 5},
                          alpha_pattern={"up_proj": 7, "down_proj": 1})
    x, dy = randn(TOKENS, HIDDEN, requires_grad=True), randn(TOKENS, HIDDEN)
    assert_matches_stock(stock, ours, x, dy)


def test_lora_mlp_frozen_input_noncontiguous_and_stride0():
    """x without grad, a non-contiguous x, and the stride-0 gradient of ``.sum()``."""
    stock, ours, _ = pair(r=3)
    x = noncontiguous(randn(3, 5, HIDDEN))
    y_stock, want = run(stock, x, torch.ones(3, 5, HIDDEN, device=DEVICE).expand(3, 5, HIDDEN))
    y = ours(x)
    got = dict(zip(trained(ours), torch.autograd.grad(y.sum(), list(trained(ours).values())), strict=True))
    assert_close(y, y_stock, torch.float32, "y")
    for name, g in want.items():
        assert_close(got[name], g, torch.float32, f"d{name}")


def test_lora_mlp_matches_fp64_reference():
    """Against PEFT's forward on raw tensors in fp64 (lora_gated_mlp_reference), through the functional form."""
    stock, _, _ = pair(r=5, bias=True, trainable_base=("up_proj",))
    layers = stock.get_base_model().mlp
    projections = [lora_projection(getattr(layers, name)) for name in PROJECTIONS]
    x, dy = randn(TOKENS, HIDDEN, requires_grad=True), randn(TOKENS, HIDDEN)
    y = lora_gated_mlp(x, *projections)
    tensors = {"x": x}
    for name, p in zip(("gate", "up", "down"), projections, strict=True):
        tensors |= {f"{name}_{field}": t for field, t in zip(("w", "b", "a", "lb"), p[:4], strict=True)}

    def reference(x, **t):
        proj = [LoraProjection(t[f"{n}_w"], t[f"{n}_b"], t[f"{n}_a"], t[f"{n}_lb"], p.scaling)
                for n, p in zip(("gate", "up", "down"), projections, strict=True)]
        return lora_gated_mlp_reference(x, *proj)

    ref, grads = fp64_reference(reference, tensors, dy)
    assert_close(y, ref, torch.float32, "y")
    names = [n for n, t in tensors.items() if t.requires_grad]
    for name, g in zip(names, torch.autograd.grad(y, [tensors[n] for n in names], dy), strict=True):
        assert_close(g, grads[name], torch.float32, f"d{name}")


# ------------------------------------------------------------------------------------ bf16, autocast


def test_lora_mlp_bf16_model_fp32_adapters():
    """PEFT's default on a bf16 model: bf16 base, fp32 adapters (autocast_adapter_dtype), no autocast.
    Within bf16 rounding of stock PEFT and of the fp64 reference; the adapters' gradients fp32."""
    stock, ours, _ = pair(dtype=torch.bfloat16, r=4)
    layer = stock.get_base_model().mlp.up_proj
    assert layer.lora_A["default"].weight.dtype == torch.float32
    x, dy = randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True), randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
    got = assert_matches_stock(stock, ours, x, dy, torch.bfloat16)
    assert all(g.dtype == torch.float32 for n, g in got.items() if "lora_" in n)


@pytest.mark.parametrize("stacked", (False, True))
def test_lora_mlp_autocast_fp32_weights(stacked, monkeypatch):
    """fp32 weights and adapters under bf16 autocast, the split products and the stacked [Wg; Wu] ones
    (the GPU's; run here too): within bf16 rounding of stock PEFT under autocast; the node saves x, G
    (or gate, up), the Ũ products and the cast adapters, no base weight copies; a second backward
    raises where the backward wrote over G."""
    monkeypatch.setattr(mlp, "STACKED_DEVICES", ("cuda", "cpu") if stacked else ())
    stock, ours, _ = pair(bias=True, r=3, trainable_base=("gate_proj",))
    x, dy = randn(TOKENS, HIDDEN, requires_grad=True), randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        got = assert_matches_stock(stock, ours, x, dy, torch.bfloat16)
    assert all(g.dtype == torch.float32 for n, g in got.items() if n != "x")

    saved = []
    params = {p.data_ptr() for p in ours.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            y = ours(x)
    large = sorted(t.numel() for t in saved if t.data_ptr() not in params and t.numel() >= TOKENS * HIDDEN)
    assert large == ([TOKENS * HIDDEN, TOKENS * 2 * INTER] if stacked else [TOKENS * HIDDEN] + [TOKENS * INTER] * 2)
    small = sorted(t.numel() for t in saved if t.data_ptr() not in params and t.numel() < TOKENS * HIDDEN)
    rank = 3
    assert small == sorted([TOKENS * 2 * rank, TOKENS * rank, 2 * rank * HIDDEN, INTER * rank, INTER * rank,
                            rank * INTER, HIDDEN * rank])
    leaves = list(trained(ours).values())
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y = ours(x)  # (no saved-tensor hooks: they would hide the version check)
    torch.autograd.grad(y, leaves, dy, retain_graph=True)
    if stacked:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(y, leaves, dy)


# -------------------------------------------------------------------------------------- fallbacks


def test_lora_mlp_falls_back_where_not_exact():
    """Dropout > 0 in training, DoRA and two active adapters keep PEFT's forward (and match it, the
    dropout masks drawn from one seed); disabled and merged adapters run the node on the base."""
    stock, ours, module = pair(lora_dropout=0.2)
    x, dy = randn(TOKENS, HIDDEN, requires_grad=True), randn(TOKENS, HIDDEN)
    assert module.unfused_reason() == "gate_proj: dropout 0.2"
    torch.manual_seed(3)
    y_stock, want = run(stock, x, dy)
    torch.manual_seed(3)
    y, got = run(ours, x, dy)
    assert_close(y, y_stock, torch.float32, "y (dropout)")
    for name, g in want.items():
        assert_close(got[name], g, torch.float32, f"d{name} (dropout)")
    assert "_LoraGatedMLPFunctionBackward" not in node_names(ours(x))

    stock, ours, module = pair(("up_proj",), use_dora=True)
    assert module.unfused_reason() == "up_proj: DoRA"
    assert_matches_stock(stock, ours, x, dy)

    stock, ours, module = pair(("gate_proj", "down_proj"))
    for model in (stock, ours):
        torch.manual_seed(5)
        model.add_adapter("other", lora_config(("gate_proj", "down_proj")))
        model.base_model.set_adapter(["default", "other"])
    assert module.unfused_reason() == "gate_proj: 2 active adapters"
    assert_matches_stock(stock, ours, x, dy)

    stock, ours, module = pair()
    with stock.disable_adapter(), ours.disable_adapter():
        assert module.unfused_reason() is None
        y = ours(x)
        assert "_GatedMLPFunctionBackward" in node_names(y)
        assert_close(y, stock(x), torch.float32, "y (adapters disabled)")
    assert_matches_stock(stock, ours, x, dy)
    for model in (stock, ours):
        model.merge_adapter()
    assert_close(ours(x), stock(x), torch.float32, "y (merged)")


def test_lora_mlp_bad_adapter_shapes():
    stock, _, _ = pair(r=3)
    layers = stock.get_base_model().mlp
    gate, up, down = (lora_projection(getattr(layers, n)) for n in PROJECTIONS)
    x = randn(TOKENS, HIDDEN)
    with pytest.raises(ValueError, match="up_proj.lora_B.weight has shape"):
        lora_gated_mlp(x, gate, up._replace(lora_b=up.lora_b[:, :2]), down)
    with pytest.raises(ValueError, match="down_proj.lora_A.weight has shape"):
        lora_gated_mlp(x, gate, up, down._replace(lora_a=down.lora_a[:, :5]))
    with pytest.raises(TypeError, match="gate_proj.lora_A.weight has dtype"):
        lora_gated_mlp(x, gate._replace(lora_a=gate.lora_a.to(torch.int32)), up, down)


def saved_bytes(model, x):
    """Bytes of the tensors autograd saves for the backward of ``model(x)``, parameters (and views of one
    storage counted once) left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(storages.values())


def test_lora_mlp_saves_less_than_peft():
    """A bf16 model with PEFT's fp32 adapters: stock keeps the LlamaMLP's intermediates and an fp32 copy of
    x for gate's and up's lora_A and of h for down's; the node keeps x, gate, up and the (M, r) products."""
    stock, ours, _ = pair(dtype=torch.bfloat16, r=4)
    x = randn(64, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    got, stock_bytes = saved_bytes(ours, x), saved_bytes(stock, x)
    adapters = 2 * 4 * (HIDDEN + INTER) * 2 + 4 * (INTER + HIDDEN) * 2  # the cast A and B (bf16)
    assert got == 64 * 2 * (HIDDEN + 2 * INTER + 3 * 4) + adapters
    assert stock_bytes >= 64 * 4 * (2 * HIDDEN + INTER) + 64 * 2 * 3 * INTER
    assert got < 0.5 * stock_bytes


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", (False, True))
def test_lora_mlp_gpu_bf16_training_shape(autocast):
    """At a training shape on the GPU (r = 16, 4096 tokens): a bf16 model with fp32 adapters, and fp32
    weights under bf16 autocast (the stacked gate/up product), within bf16 rounding of stock PEFT."""
    hidden = 512
    dtype = torch.float32 if autocast else torch.bfloat16
    stock, ours, _ = pair(dtype=dtype, r=16, lora_alpha=32, hidden=hidden, inter=1536)
    x = randn(2, 2048, hidden, dtype=dtype, requires_grad=True)
    dy = randn(2, 2048, hidden, dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        assert_matches_stock(stock, ours, x, dy, torch.bfloat16)


@pytest.mark.gpu
def test_lora_mlp_torch_compile_fullgraph_autocast():
    """torch.compile(fullgraph=True) traces the reading of the PEFT layers and the node."""
    stock, ours, _ = pair(r=8, hidden=256, inter=704)
    x, dy = randn(4, 64, 256, requires_grad=True), randn(4, 64, 256)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_stock, want = run(stock, x, dy)

    def forward(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return ours(x)

    params = trained(ours)
    y = torch.compile(forward, fullgraph=True)(x)
    got = dict(zip(["x", *params], torch.autograd.grad(y, [x, *params.values()], dy), strict=True))
    assert_close(y, y_stock, torch.bfloat16, "y")
    for name, g in want.items():
        assert_close(got[name], g, torch.bfloat16, f"d{name}")


def test_lora_mlp_stacked_noncontiguous_stride0(monkeypatch):
    """The stacked gate/up product (fp32 weights under autocast) on a non-contiguous x and the stride-0
    gradient of ``.sum()``."""
    monkeypatch.setattr(mlp, "STACKED_DEVICES", ("cuda", "cpu"))
    stock, ours, _ = pair(("gate_proj", "down_proj"), r=2, bias=True)
    x = noncontiguous(randn(3, 5, HIDDEN)).requires_grad_(True)
    grads = []
    for model in (stock, ours):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            out = model(x).float().sum()
        params = trained(model)
        grads.append(dict(zip(["x", *params], torch.autograd.grad(out, [x, *params.values()]), strict=True)))
    for name, g in grads[0].items():
        assert_close(grads[1][name], g, torch.bfloat16, f"d{name}")
