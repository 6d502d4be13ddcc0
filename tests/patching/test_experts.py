"""MoE experts (patching/parts/experts.py, patching/experts_forwards.py): the fused gate in every experts
implementation transformers has.

Patched against stock in fp32 (loss and every gradient within 1e-4) for Mixtral and Qwen3-MoE whole
(tiny.py's configs), under each of transformers' experts implementations: the eager loop (replaced by
tigon's, the same loop through the fused gate), grouped_mm and batched_mm (transformers' own, calling
the fused ``_apply_gate``); a spy proves the kernel ran. GPT-OSS's experts (interleaved gate/up,
clamped swiglu, biases, transposed weights) module by module, with a row made here (the gpt_oss family
row is added to the table separately). Then what the patch-time checks refuse, and that revert
restores.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

import tigon
import tigon.ops  # noqa: F401  (the op module, by its sys.modules name below)
from tests.helpers import DEVICE
from tests.patching.tiny import assert_same_grads, batch, grads, rel, stock_and_patched, tiny_model
from tigon.patching import decorator_chains, engine, experts_forwards
from tigon.patching.families import Experts, Family
from tigon.patching.parts.experts import plan_experts
from tigon.patching.patch_handle import Plan, apply_plan

moe = pytest.importorskip("transformers.integrations.moe")

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
MOE_FAMILIES = ("mixtral", "qwen3_moe")
EXPERTS_CLASS = {"mixtral": "MixtralExperts", "qwen3_moe": "Qwen3MoeExperts"}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts moe_glu's registered-op calls (what the fused gate launches)."""
    module = sys.modules["tigon.ops.moe_glu"]
    calls = []
    op = module.MOE_GLU

    def counting(*args):
        calls.append(args[2])  # the activation
        return op(*args)

    monkeypatch.setattr(module, "MOE_GLU", counting)
    return calls


def _experts_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_moe_model_matches_stock_in_every_experts_implementation(model_type, implementation, kernel_calls):
    stock, patched, handle = stock_and_patched(model_type, config_overrides={"experts_implementation": implementation})
    assert patched.config._experts_implementation == implementation
    assert any(line.startswith(f"{EXPERTS_CLASS[model_type]}._apply_gate -> tigon.ops.moe_glu")
               for line in handle.replaced)
    ids, labels = batch(1)
    want = stock(input_ids=ids, labels=labels)
    got = patched(input_ids=ids, labels=labels)
    assert rel(got.loss, want.loss) <= 1e-4
    want.loss.backward()
    got.loss.backward()
    assert_same_grads(patched, stock)
    assert kernel_calls and set(kernel_calls) == {"silu"}


def test_dispatch_follows_the_config_at_call_time(kernel_calls):
    """The experts implementation chosen after patching is the one that runs (transformers' dispatch)."""
    stock, patched, _ = stock_and_patched("mixtral")
    ids, _ = batch(2)
    for implementation in IMPLEMENTATIONS:
        for model in (stock, patched):
            model.config._experts_implementation = implementation
        kernel_calls.clear()
        with torch.no_grad():
            assert rel(patched(input_ids=ids).logits, stock(input_ids=ids).logits) <= 1e-5
        # the eager loop calls the gate once per expert hit, the matmul implementations once per layer
        layers = patched.config.num_hidden_layers
        assert len(kernel_calls) > layers if implementation == "eager" else len(kernel_calls) == layers


def test_revert_restores_the_experts():
    stock, patched, handle = stock_and_patched("qwen3_moe")
    modules = _experts_modules(patched)
    assert modules and all("_apply_gate" in vars(m) and "forward" in vars(m) for m in modules)
    assert all(m._apply_gate.__func__._tigon for m in modules)
    again = tigon.patch(patched)  # patching what is patched is a no-op
    assert not any("Experts" in line for line in again.replaced)
    handle.revert()
    assert not any("_apply_gate" in vars(m) or "forward" in vars(m) for m in modules)
    assert all(type(m)._apply_gate is moe._default_apply_gate for m in modules)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_autocast_runs_the_experts_in_the_autocast_dtype(monkeypatch, implementation):
    """Under bf16 autocast the experts' fp32 weights reach every implementation cast to bf16 (stock hands
    grouped_mm its fp32 parameters: torch._grouped_mm has no autocast rule), as a bf16 copy of the
    experts would compute them; the gradients reach the fp32 parameters, in fp32. Without autocast the
    implementation sees the parameters themselves."""
    _, patched, _ = stock_and_patched("qwen3_moe", config_overrides={"experts_implementation": implementation})
    module = _experts_modules(patched)[0]
    reference = copy.deepcopy(module)
    for name in ("_apply_gate", "forward"):
        vars(reference).pop(name)
    reference.to(torch.bfloat16)
    seen = []
    spied = moe.ALL_EXPERTS_FUNCTIONS.get_interface(implementation, type(module).forward) \
        if implementation != "eager" else None
    if spied is not None:
        def spy(self, *args, **kwargs):
            if self is not reference:
                seen.append(self.gate_up_proj.dtype)
            return spied(self, *args, **kwargs)
        monkeypatch.setitem(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, implementation, spy)
    gen = torch.Generator().manual_seed(0)
    tokens, hidden = 7, module.gate_up_proj.shape[-1]
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    top_k = torch.stack([torch.randperm(module.num_experts, generator=gen)[:2] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, 2, generator=gen).to(DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        got = module(x, top_k, weights)
        want = reference(x.to(torch.bfloat16), top_k, weights.to(torch.bfloat16))
    assert rel(got.float(), want.float()) <= 1e-2
    grad = torch.randn(got.shape, generator=gen).to(DEVICE)
    got.float().backward(grad)
    want.float().backward(grad)
    assert module.gate_up_proj.grad.dtype == torch.float32 and module.down_proj.grad.dtype == torch.float32
    assert rel(module.gate_up_proj.grad, reference.gate_up_proj.grad.float()) <= 3e-2
    assert rel(module.down_proj.grad, reference.down_proj.grad.float()) <= 3e-2
    if spied is not None:
        module(x, top_k, weights)
        assert seen == [torch.bfloat16, torch.float32]


def test_class_patch_lists_the_experts():
    with tigon.patch("mixtral") as handle:
        assert any(line.startswith("MixtralExperts._apply_gate -> tigon.ops.moe_glu (halves layout")
                   for line in handle.replaced)
        model = tiny_model("mixtral")
        assert all("_apply_gate" in vars(m) for m in _experts_modules(model))


# --------------------------------------------------------------------------------- what is refused


def _refused(model, match, **switches):
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    with pytest.raises(ValueError, match=match):
        tigon.patch(model, **switches)
    assert {name: dict(vars(m)) for name, m in model.named_modules()} == before  # untouched


def test_custom_activation_is_refused_and_mlp_false_patches_the_rest():
    model = tiny_model("mixtral")
    _experts_modules(model)[1].act_fn = nn.ReLU()
    _refused(model, "act_fn is ReLU")
    handle = tigon.patch(model, mlp=False)
    assert handle.replaced and not any("Experts" in line for line in handle.replaced)


def test_a_class_gate_other_than_transformers_default_is_refused(monkeypatch):
    cls = type(_experts_modules(tiny_model("mixtral"))[0])
    monkeypatch.setattr(cls, "_apply_gate", lambda self, gate_up: gate_up[..., ::2] * gate_up[..., 1::2])
    _refused(tiny_model("mixtral"), "_apply_gate is not transformers' default")


def test_a_forward_that_is_not_the_dispatch_is_refused(monkeypatch):
    cls = type(_experts_modules(tiny_model("mixtral"))[0])
    monkeypatch.setattr(cls, "forward", decorator_chains.body(cls.forward))  # the eager loop, no dispatch
    _refused(tiny_model("mixtral"), "not transformers' experts dispatch")


def test_an_unknown_eager_loop_stays_stock_with_a_warning(monkeypatch, kernel_calls):
    cls = type(_experts_modules(tiny_model("mixtral"))[0])
    stock_loop = decorator_chains.body(cls.forward)

    def other_loop(self, hidden_states, top_k_index, top_k_weights):
        return stock_loop(self, hidden_states, top_k_index, top_k_weights)

    monkeypatch.setattr(cls, "forward", decorator_chains.rewrapped(cls.forward, other_loop))
    torch.manual_seed(0)
    stock = tiny_model("mixtral", experts_implementation="eager").to(DEVICE)
    patched = copy.deepcopy(stock)
    with pytest.warns(UserWarning, match="eager loop is not the one tigon knows"):
        handle = tigon.patch(patched)
    assert any("the eager loop (not the one tigon knows) stays stock" in line for line in handle.replaced)
    ids, _ = batch(0)
    with torch.no_grad():
        assert rel(patched(input_ids=ids).logits, stock(input_ids=ids).logits) <= 1e-5
        assert not kernel_calls  # eager: stock loop
        patched.config._experts_implementation = "grouped_mm"
        patched(input_ids=ids)
        assert kernel_calls  # grouped_mm: fused


# The experts classes of MoE families whose rows are added to the table separately: each passes the
# class checks with one keyword, ``experts=Experts()`` (GPT-OSS: its layout and activation).
OTHER_MOE_EXPERTS = {
    "qwen2_moe": ("Qwen2MoeExperts", "inline"), "olmoe": ("OlmoeExperts", "inline"),
    "granitemoe": ("GraniteMoeExperts", "inline"), "glm4_moe": ("Glm4MoeExperts", "inline"),
    "deepseek_v3": ("DeepseekV3Experts", "inline"), "qwen3_next": ("Qwen3NextExperts", "inline"),
    "gpt_oss": ("GptOssExperts", "gate"),
}


@pytest.mark.parametrize("package", sorted(OTHER_MOE_EXPERTS))
def test_experts_classes_of_other_moe_families_check_out(package):
    module = pytest.importorskip(f"transformers.models.{package}.modeling_{package}")
    cls_name, eager = OTHER_MOE_EXPERTS[package]
    spec = (Experts(cls_name, layout="interleaved", activation="clamped_swiglu") if package == "gpt_oss"
            else Experts(cls_name))
    family = Family(model_type=package, package=package, causal_lm="", model="", norm=None, mlp=None,
                    attention=None, experts=spec)
    assert experts_forwards.check_class(family, getattr(module, cls_name)) == eager


# ------------------------------------------------------------------------------------------ GPT-OSS


GPT_OSS = Family(
    model_type="gpt_oss", package="gpt_oss", causal_lm="GptOssForCausalLM", model="GptOssModel", norm=None,
    mlp=None, attention=None, experts=Experts("GptOssExperts", layout="interleaved", activation="clamped_swiglu"),
)


def _gpt_oss_experts(implementation, *, limit=1.5):
    """A GPT-OSS experts module (4 experts, hidden 16, intermediate 12) with random weights and a small
    limit, so that the clamps bite; its input, routing indices and weights."""
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    import transformers

    config = transformers.GptOssConfig(hidden_size=16, intermediate_size=12, num_local_experts=4,
                                       num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=8, vocab_size=32)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    module = modeling.GptOssExperts(config).to(DEVICE)
    module.limit = limit
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5)
    tokens = 10
    hidden = torch.randn(tokens, 16, device=DEVICE) * 2
    logits = torch.randn(tokens, 4, device=DEVICE)
    weights, index = torch.topk(logits.softmax(-1), 2, dim=-1)
    return module, hidden, index, weights


def _plan_experts(root, family):
    plan = Plan()
    plan_experts(plan, root, family, engine.resolve(family), {})
    return apply_plan(plan, "experts", 10)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gpt_oss_experts_match_stock(implementation, kernel_calls):
    stock, hidden, index, weights = _gpt_oss_experts(implementation)
    root = nn.ModuleDict({"experts": copy.deepcopy(stock)})
    handle = _plan_experts(root, GPT_OSS)
    assert handle.replaced == [
        "GptOssExperts._apply_gate -> tigon.ops.moe_glu (interleaved layout, clamped_swiglu with each module's "
        "alpha and limit) in every experts implementation; under autocast the experts' weights in the "
        "autocast dtype (instance attributes)"
    ]
    # its eager loop calls _apply_gate itself: the forward set is the class's, behind the autocast casts
    assert vars(root["experts"])["forward"].__func__._tigon
    x_stock, x_patched = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    want = stock(x_stock, index, weights)
    got = root["experts"](x_patched, index, weights)
    assert rel(got, want) <= 1e-5
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad)
    assert rel(x_patched.grad, x_stock.grad) <= 1e-4
    assert_same_grads(root["experts"], stock)
    assert kernel_calls and set(kernel_calls) == {"clamped_swiglu"}
    handle.revert()
    assert "_apply_gate" not in vars(root["experts"])


def test_gpt_oss_gate_that_differs_is_refused(monkeypatch):
    module, *_ = _gpt_oss_experts("grouped_mm")
    cls = type(module)

    def without_up_clamp(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    monkeypatch.setattr(cls, "_apply_gate", without_up_clamp)
    with pytest.raises(ValueError, match="does not compute clamped_swiglu on the interleaved layout"):
        _plan_experts(nn.ModuleDict({"experts": module}), GPT_OSS)
    assert "_apply_gate" not in vars(module)


def test_layout_that_differs_is_refused():
    module, *_ = _gpt_oss_experts("grouped_mm")
    halves = Family(**{**GPT_OSS.__dict__, "experts": Experts("GptOssExperts", activation="clamped_swiglu")})
    with pytest.raises(ValueError, match="is_concatenated does not match the halves layout"):
        _plan_experts(nn.ModuleDict({"experts": module}), halves)


# ---------------------------------------------------------------------------------------------- GPU

GPU_MOE_SIZES = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=32, vocab_size=4096, max_position_embeddings=256)


def _gpu_batch(step, vocab, batch_size=4, seq=128):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(3, vocab, (batch_size, seq), generator=gen).to(DEVICE)
    return ids, ids.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_bf16_weights_moe_matches_stock_on_gpu(model_type, implementation, kernel_calls):
    """bf16 weights (grouped_mm's own dtype on the GPU), several programs per launch.

    In bf16 the router's top-k flips for tokens whose expert scores are within a rounding of each
    other, and a flipped token sends its gradient through other experts: stock in bf16 and the
    patched model in bf16 can each be far from the fp32 model there (the embedding rows of such
    tokens), in different places. So both are measured against the fp32 model with the same
    (bf16-rounded) weights, and the patched model must be as close to it as stock is.
    """
    overrides = {**GPU_MOE_SIZES, "experts_implementation": implementation}
    if model_type == "mixtral":
        overrides.pop("moe_intermediate_size")
    stock, patched, _ = stock_and_patched(model_type, config_overrides=overrides)
    stock.to(torch.bfloat16)
    patched.to(torch.bfloat16)
    reference = copy.deepcopy(stock).float()
    ids, labels = _gpu_batch(0, GPU_MOE_SIZES["vocab_size"])
    losses = {}
    for name, model in (("reference", reference), ("stock", stock), ("patched", patched)):
        losses[name] = model(input_ids=ids, labels=labels).loss
        losses[name].backward()
    assert kernel_calls
    loss_error = {name: rel(losses[name], losses["reference"]) for name in ("stock", "patched")}
    assert loss_error["patched"] <= max(1.5 * loss_error["stock"], 1e-2), loss_error
    want, stock_grads = grads(reference), grads(stock)
    for name, g in grads(patched).items():
        patched_error = rel(g, want[name])
        stock_error = rel(stock_grads[name], want[name])
        assert patched_error <= max(1.5 * stock_error, 3e-2), (name, patched_error, stock_error)


@pytest.mark.gpu
def test_torch_compile_of_a_patched_moe_model_matches_eager():
    """torch.compile over the patched experts (grouped_mm, bf16 weights): the registered moe_glu op is traced."""
    _, patched, _ = stock_and_patched("qwen3_moe", config_overrides={**GPU_MOE_SIZES,
                                                                     "experts_implementation": "grouped_mm"})
    patched.to(torch.bfloat16)
    ids, labels = _gpu_batch(1, GPU_MOE_SIZES["vocab_size"])
    want = patched(input_ids=ids, labels=labels).loss
    got = torch.compile(patched)(input_ids=ids, labels=labels).loss
    assert rel(got, want) <= 2e-2
