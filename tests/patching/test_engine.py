"""The engine: switches, errors, atomicity, double patch, class patch, PEFT, AutoModelForCausalLM."""

from __future__ import annotations

import copy
import inspect
import logging
import re

import pytest
import torch
import transformers
from torch import nn
from transformers.models.llama import modeling_llama

import tigon
from tests.patching.tiny import (
    DEVICE,
    assert_same_grads,
    batch,
    rel,
    stock_and_patched,
    tiny_config,
    tiny_model,
)
from tigon.nn import RMSNorm
from tigon.patching import engine
from tigon.patching.engine import SWITCHES

LOSS_TOLERANCE = 1e-4


def _module_state(model):
    """Types of every module and every forward set on an instance: what a patch may change."""
    return [(name, type(m), vars(m).get("forward")) for name, m in model.named_modules()], vars(model).get(
        "_loss_function"
    )


def _loss_and_grads_match(stock, patched, seed=0):
    ids, labels = batch(seed)
    want = stock(input_ids=ids, labels=labels)
    got = patched(input_ids=ids, labels=labels)
    assert rel(got.loss, want.loss) <= LOSS_TOLERANCE
    want.loss.backward()
    got.loss.backward()
    assert_same_grads(patched, stock)
    return got


# ------------------------------------------------------------------------------------- switches


def test_supported_models_lists_the_table():
    models = tigon.supported_models()
    assert models == sorted(models)
    for model_type in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2",
                       "gemma3_text", "phi3", "olmo2", "olmo3", "granite", "smollm3", "glm4"):
        assert model_type in models


def test_switch_defaults_are_the_contract():
    # API.md's switches with their defaults, and tigon's own additions: those that change what a step keeps
    # or how it launches off by default (keep_attention: GPU memory for the recompute's attention); the band
    # attention of sliding-window layers (the same softmax terms, summed in another order, as any two sdpa
    # kernels) and the Qwen-VL vision attention's segments in one sdpa call (the same per-segment attention)
    # on, and the attention as one node (the same products and sdpa call) on; Triton's compiler key hashed
    # ahead (the same key) on.
    assert SWITCHES == {"rope": True, "rms_norm": True, "layer_norm": True, "mlp": True,
                        "cross_entropy": False, "fused_linear_cross_entropy": True, "cuda_graphs": False,
                        "recompute_norms": False, "sliding_window": True, "vision_attention": True,
                        "fused_attention": True, "offload_activations": False, "tiled_mlp": False,
                        "keep_attention": False, "prehash": True}


def test_unknown_model_type_lists_supported():
    with pytest.raises(ValueError, match="supported") as info:
        tigon.patch("gpt2")
    assert "llama" in str(info.value)
    model = tiny_model("llama")
    model.config.model_type = "not_a_family"
    before = _module_state(model)
    with pytest.raises(ValueError, match="llama"):
        tigon.patch(model)
    assert _module_state(model) == before


def test_unknown_switch_and_bad_values():
    model = tiny_model("llama")
    before = _module_state(model)
    with pytest.raises(ValueError, match="fused_linear_cross_entropy"):  # the message lists the switches
        tigon.patch(model, swiglu=True)
    with pytest.raises(ValueError, match="exclusive"):
        tigon.patch(model, cross_entropy=True, fused_linear_cross_entropy=True)
    with pytest.raises(TypeError, match="rope"):
        tigon.patch(model, rope="yes")
    with pytest.raises(ValueError, match="unknown switch"):
        tigon.patch("llama", layernorm=True)
    assert _module_state(model) == before


@pytest.mark.parametrize(
    "model_type, switch, changed",
    [
        ("llama", "rms_norm", ["LlamaRMSNorm -> tigon.nn.RMSNorm(casting='llama', offset=0.0)",
                               "LlamaDecoderLayer.forward -> residual joins as tigon.ops.add_rms_norm (instance"]),
        ("gemma", "rms_norm", ["GemmaRMSNorm -> tigon.nn.RMSNorm(casting='gemma', offset=1.0)",
                               "GemmaDecoderLayer.forward -> residual joins as tigon.ops.add_rms_norm"]),
        ("olmo2", "rms_norm", ["Olmo2RMSNorm -> tigon.nn.RMSNorm(casting='gemma', offset=0.0)",
                               "Olmo2DecoderLayer.forward -> residual joins as tigon.ops.post_norm_join (instance"]),
        ("gemma2", "rms_norm", ["Gemma2RMSNorm -> tigon.nn.RMSNorm(casting='gemma', offset=1.0)",
                                "Gemma2DecoderLayer.forward -> residual joins as tigon.ops.sandwich_norm_join"]),
        ("olmo3", "rms_norm", ["Olmo3RMSNorm -> tigon.nn.RMSNorm(casting='gemma', offset=0.0)",
                               "Olmo3DecoderLayer.forward -> residual joins as tigon.ops.post_norm_join"]),
        ("llama", "mlp", ["LlamaMLP -> tigon.nn.SwiGLUMLP()"]),
        ("gemma", "mlp", ["GemmaMLP -> tigon.nn.GEGLUMLP(approximate='tanh')"]),
        ("phi3", "mlp", ["Phi3MLP.forward -> tigon.ops.swiglu on gate_up_proj"]),
        ("qwen3_moe", "mlp", ["Qwen3MoeMLP -> tigon.nn.SwiGLUMLP()",  # the dense layer
                              "Qwen3MoeExperts._apply_gate -> tigon.ops.moe_glu"]),  # and the experts
        ("llama", "rope", ["LlamaAttention: apply_rotary_pos_emb -> tigon.ops.rope"]),
        ("phi3", "rope", ["Phi3Attention: apply_rotary_pos_emb -> tigon.ops.rope"]),  # partial rotary
        ("llama", "cross_entropy", ["LlamaForCausalLM.loss_function -> tigon.ops.cross_entropy"]),
        ("llama", "fused_linear_cross_entropy", ["LlamaForCausalLM.forward -> tigon generic forward",
                                                 "lm_head.forward -> nn.Linear, or tigon.ops.fused_linear"]),
        ("glm4", "rope", []),  # interleaved rotary: not rotate-half, keeps its own
        ("stablelm", "layer_norm", ["LayerNorm -> tigon.nn.LayerNorm"]),  # incl. per-head qk norms
        ("llama", "layer_norm", []),  # Llama has no LayerNorm
        ("mixtral", "mlp", ["MixtralExperts._apply_gate -> tigon.ops.moe_glu"]),  # experts only
    ],
)
def test_each_switch_alone(model_type, switch, changed):
    off = {name: False for name in SWITCHES}
    stock, patched, handle = stock_and_patched(model_type, **{**off, switch: True})
    assert len(handle.replaced) == len(changed), handle.replaced
    for line, expected in zip(handle.replaced, changed, strict=True):
        assert line.startswith(expected), (line, expected)
    _loss_and_grads_match(stock, patched)


def test_all_switches_off_is_stock():
    stock, patched, handle = stock_and_patched("llama", **{name: False for name in SWITCHES})
    assert handle.replaced == [] and not handle.active
    ids, labels = batch(0)
    assert torch.equal(patched(input_ids=ids, labels=labels).loss, stock(input_ids=ids, labels=labels).loss)


def test_prehash_is_handed_the_patched_models_device_unless_switched_off(monkeypatch):
    # Whether that device starts the hash is triton_key's to decide (tests/ops/test_triton_key.py); a patch
    # that replaces nothing starts nothing, since no tigon kernel will run.
    devices = []
    monkeypatch.setattr(engine, "prehash_triton_key", devices.append)
    model = tiny_model("llama")
    handle = tigon.patch(model)
    assert devices == [next(model.parameters()).device]
    tigon.patch(model)  # already patched: nothing to replace
    handle.revert()
    tigon.patch(model, prehash=False)
    assert len(devices) == 1


def test_replacements_are_logged_once_at_info(caplog):
    model = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="tigon.patching"):
        handle = tigon.patch(model)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    for line in handle.replaced:
        assert sum(line in message for message in logged) == 1, line
    assert len(handle.replaced) == 7  # norms, layer joins, MLPs, rope, the attention node, forward, lm_head
    assert "(5 modules)" in handle.replaced[0]  # 2 layers x 2 + the final norm


# ------------------------------------------------------------------------ instance isolation


def test_instance_patch_changes_only_that_model():
    module_globals = dict(vars(modeling_llama))
    cross_entropy = torch.nn.functional.cross_entropy
    other = tiny_model("llama")
    model = tiny_model("llama")
    handle = tigon.patch(model)
    later = tiny_model("llama")
    for untouched in (other, later):
        assert type(untouched.model.norm) is modeling_llama.LlamaRMSNorm
        assert not any("forward" in vars(m) for m in untouched.modules())
    assert dict(vars(modeling_llama)) == module_globals  # no module global assigned
    assert torch.nn.functional.cross_entropy is cross_entropy
    assert inspect.unwrap(modeling_llama.LlamaAttention.forward).__globals__ is vars(modeling_llama)
    assert "post_init" not in vars(modeling_llama.LlamaForCausalLM)
    handle.revert()


def test_rope_copy_sees_tigon_only_through_its_own_globals():
    _, patched, handle = stock_and_patched("llama")
    attention = patched.model.layers[0].self_attn
    fn = inspect.unwrap(attention.forward.__func__)  # the body, under the decorators transformers puts on it
    assert fn.__code__ is inspect.unwrap(modeling_llama.LlamaAttention.forward).__code__
    assert fn.__globals__ is not vars(modeling_llama)
    assert fn.__globals__["apply_rotary_pos_emb"] is not modeling_llama.apply_rotary_pos_emb
    assert modeling_llama.apply_rotary_pos_emb.__module__ == modeling_llama.__name__
    handle.revert()


def test_optimizer_made_before_the_patch_keeps_training_the_model():
    stock, patched, handle = stock_and_patched("llama")
    opt_stock = torch.optim.SGD(stock.parameters(), lr=0.1)
    optimizer = torch.optim.SGD(patched.parameters(), lr=0.1)  # made after the patch: same objects anyway
    ids, labels = batch(0)
    for model, opt in ((stock, opt_stock), (patched, optimizer)):
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    assert rel(patched.model.norm.weight, stock.model.norm.weight) <= 1e-5
    gate, stock_gate = patched.model.layers[0].mlp.gate_proj, stock.model.layers[0].mlp.gate_proj
    assert rel(gate.weight, stock_gate.weight) <= 1e-5


# ----------------------------------------------------------------------------- atomic / mismatch


def test_custom_activation_raises_and_leaves_the_model_untouched():
    model = tiny_model("llama", hidden_act="relu")
    before = _module_state(model)
    with pytest.raises(ValueError, match="custom activation"):
        tigon.patch(model)
    assert _module_state(model) == before
    # without the MLP switch the rest patches
    handle = tigon.patch(model, mlp=False)
    assert type(model.model.norm) is RMSNorm
    handle.revert()
    assert _module_state(model) == before


def test_mismatch_deep_in_the_model_leaves_earlier_modules_untouched():
    model = tiny_model("llama")
    model.model.layers[1].mlp.act_fn = nn.Tanh()  # the last MLP: everything before it is planned already
    before = _module_state(model)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp"):
        tigon.patch(model)
    assert _module_state(model) == before


@pytest.mark.parametrize("model_type, layout", [("gemma2", "sandwich"), ("llama", "pre_norm")])
def test_changed_layer_forward_keeps_its_own(monkeypatch, model_type, layout):
    """A transformers version whose joined layer differs (here: one statement added) keeps that
    forward: the patch warns, leaves the joins out, patches everything else, and trains as stock."""
    stock, model = tiny_model(model_type).to(DEVICE), tiny_model(model_type).to(DEVICE)
    model.load_state_dict(stock.state_dict())
    layer_cls = type(model.model.layers[0])
    stock_forward = layer_cls.forward

    def forward(self, hidden_states, *args, **kwargs):
        hidden_states = hidden_states * 1.0
        return stock_forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(layer_cls, "forward", forward)
    with pytest.warns(UserWarning, match=f"not the {layout} forward tigon knows"):
        handle = tigon.patch(model)
    assert not any("DecoderLayer" in line for line in handle.replaced)
    assert any("RMSNorm" in line for line in handle.replaced)
    assert all(layer.forward.__func__ is forward for layer in model.model.layers)
    _loss_and_grads_match(stock, model)
    handle.revert()


def test_remote_code_like_model_is_refused():
    class RemoteLlama(nn.Module):  # what trust_remote_code gives: transformers' model_type, other classes
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.norm = modeling_llama.LlamaRMSNorm(config.hidden_size)

    model = RemoteLlama(tiny_config("llama"))
    before = _module_state(model)
    with pytest.raises(ValueError, match="remote code"):
        tigon.patch(model)
    assert _module_state(model) == before


def test_subclass_with_its_own_forward_is_refused():
    class CustomNorm(modeling_llama.LlamaRMSNorm):
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    model = tiny_model("llama")
    model.model.norm = CustomNorm(model.config.hidden_size)
    before = _module_state(model)
    with pytest.raises(ValueError, match="overrides"):
        tigon.patch(model)
    assert _module_state(model) == before


def test_not_a_model():
    with pytest.raises(ValueError, match="transformers model"):
        tigon.patch(nn.Linear(2, 2))


# ------------------------------------------------------------------------------------ double patch


def test_double_patch_is_harmless():
    stock, patched, first = stock_and_patched("gemma2")
    second = tigon.patch(patched)
    assert second.replaced == [] and not second.active
    _loss_and_grads_match(stock, patched)
    second.revert()
    assert type(patched.model.norm) is RMSNorm  # the first patch still stands
    first.revert()
    assert type(patched.model.norm).__name__ == "Gemma2RMSNorm"


def test_second_patch_adds_parts_and_reverts_only_its_own():
    off = {name: False for name in SWITCHES}
    stock, patched, first = stock_and_patched("llama", **{**off, "rms_norm": True})
    second = tigon.patch(patched, **{**off, "mlp": True, "rope": True})
    assert len(second.replaced) == 2
    _loss_and_grads_match(stock, patched)
    second.revert()
    assert type(patched.model.layers[0].mlp) is modeling_llama.LlamaMLP
    assert type(patched.model.norm) is RMSNorm
    first.revert()
    assert type(patched.model.norm) is modeling_llama.LlamaRMSNorm


def test_conflicting_loss_modes_are_refused():
    _, patched, first = stock_and_patched("llama")
    before = _module_state(patched)
    with pytest.raises(ValueError, match="already patched"):
        tigon.patch(patched, cross_entropy=True, fused_linear_cross_entropy=False)
    assert _module_state(patched) == before
    first.revert()


# ------------------------------------------------------------------------------------ class patch


def test_class_patch_then_build():
    torch.manual_seed(0)
    built_before = tiny_model("llama").to(DEVICE)
    handle = tigon.patch("llama")
    try:
        assert any("LlamaRMSNorm" in line for line in handle.replaced)
        torch.manual_seed(0)
        patched = tiny_model("llama").to(DEVICE)
        assert type(patched.model.norm) is RMSNorm
        assert type(patched.model.layers[0].mlp).__name__ == "SwiGLUMLP"
        assert "forward" in vars(patched) and "forward" in vars(patched.model.layers[0].self_attn)
        # the model built before is not touched, and the weights are the same random init
        assert type(built_before.model.norm) is modeling_llama.LlamaRMSNorm
        _loss_and_grads_match(built_before, patched)
        # patching the type twice is harmless; different switches are refused
        assert tigon.patch("llama").replaced == []
        with pytest.raises(ValueError, match="revert"):
            tigon.patch("llama", rope=False)
    finally:
        handle.revert()
    assert "post_init" not in vars(modeling_llama.LlamaForCausalLM)
    assert "post_init" not in vars(modeling_llama.LlamaModel)
    after = tiny_model("llama")
    assert type(after.model.norm) is modeling_llama.LlamaRMSNorm
    assert not any("forward" in vars(m) for m in after.modules())


def test_class_patch_covers_the_base_model_and_from_pretrained(tmp_path):
    torch.manual_seed(0)
    stock = tiny_model("qwen3")
    stock.save_pretrained(tmp_path)
    with tigon.patch("qwen3", fused_linear_cross_entropy=False):
        base = transformers.AutoModel.from_config(tiny_config("qwen3"))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).train()
    assert type(base.norm) is RMSNorm
    assert type(loaded.model.norm) is RMSNorm
    assert torch.equal(loaded.model.norm.weight, stock.model.norm.weight)
    _loss_and_grads_match(stock.to(DEVICE), loaded.to(DEVICE))


# --------------------------------------------------------------------------------------------- PEFT


def _lora(model):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                             target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("order", ["patch_after_wrap", "patch_before_wrap"])
def test_peft_lora(order):
    torch.manual_seed(0)
    base = tiny_model("llama").to(DEVICE)
    stock_base = copy.deepcopy(base)
    torch.manual_seed(1)
    stock = _lora(stock_base)
    if order == "patch_after_wrap":
        torch.manual_seed(1)
        patched = _lora(base)
        handle = tigon.patch(patched)
    else:
        handle = tigon.patch(base)
        torch.manual_seed(1)
        patched = _lora(base)
    assert type(patched.get_base_model().model.norm) is RMSNorm
    trainable = [n for n, p in patched.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    got = _loss_and_grads_match(stock, patched)
    assert got.logits is None
    handle.revert()
    assert type(patched.get_base_model().model.norm) is modeling_llama.LlamaRMSNorm


# ------------------------------------------------------------------------------------------- auto


def test_auto_model_from_config_and_from_pretrained(tmp_path):
    config = tiny_config("mistral")
    model = tigon.AutoModelForCausalLM.from_config(config, rope=False)
    assert type(model.model.norm) is RMSNorm
    assert "forward" not in vars(model.model.layers[0].self_attn)
    torch.manual_seed(0)
    stock = tiny_model("mistral")
    stock.save_pretrained(tmp_path)
    loaded = tigon.AutoModelForCausalLM.from_pretrained(tmp_path).train()
    assert type(loaded.model.norm) is RMSNorm
    assert type(stock.model.norm) is not RMSNorm
    _loss_and_grads_match(stock.to(DEVICE), loaded.to(DEVICE))
    with pytest.raises(TypeError):
        tigon.AutoModelForCausalLM()


@pytest.mark.parametrize("model_type", ("llama", "gemma2", "phi3", "stablelm"))
def test_patch_while_parameters_are_partitioned(model_type):
    """A model built under ``deepspeed.zero.Init`` (transformers builds one so under a ZeRO-3 config)
    is patched while every parameter is an empty placeholder, its shape in ``ds_shape``: the patch
    reads the shapes from there, and once the parameters hold their values again (as ZeRO-3 gathers
    them for a forward) the model computes what the stock one does. StableLM's LayerNorms, Gemma-2's
    offset norms and Phi-3's fused gate_up cover the other shape checks."""
    torch.manual_seed(0)
    stock = tiny_model(model_type).to(DEVICE)
    model = copy.deepcopy(stock)
    values = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        values[name] = p.data
        p.ds_id, p.ds_shape = i, p.shape
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    handle = tigon.patch(model)
    assert handle.replaced
    for name, p in model.named_parameters():
        p.data = values[name]
        del p.ds_id, p.ds_shape
    ids, labels = batch(0)
    loss = model(input_ids=ids, labels=labels).loss
    want = stock(input_ids=ids, labels=labels).loss
    assert rel(loss, want) <= 1e-5
    loss.backward()
    want.backward()
    assert_same_grads(model, stock)


def test_patch_docstring_names_every_switch_with_its_default_and_no_other():
    doc = tigon.patching.patch.__doc__
    defaults = doc.split("Switches (defaults): ", 1)[1].split(". ", 1)[0]
    listed = dict(re.findall(r"(\w+)=(True|False)", defaults))
    assert listed == {name: str(value) for name, value in SWITCHES.items()}
    described = set()
    for bullet in re.findall(r"^\s*- (.*)$", doc, flags=re.MULTILINE):
        described |= set(re.findall(r"``(\w+)``", bullet.split(":", 1)[0]))
    assert described == set(SWITCHES)
