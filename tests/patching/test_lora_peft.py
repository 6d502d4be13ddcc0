"""tigon.patch on PEFT LoRA models: the attention's adapters inside tigon's attention node (and the MLP's
inside its node) equal stock PEFT (loss and every adapter gradient, fp32 under the interpreter); what
cannot be fused keeps PEFT's forward and ``Patch.replaced`` says so; ``modules_to_save=["lm_head"]`` keeps
the fused loss over the active copy; ``merge_and_unload()`` gives back a plain transformers model.

The node runs in fp16/bf16 on the GPU only (fused_attention.DEVICES, its dtypes): these tests add the CPU
and fp32, to compare it with stock PEFT in fp32 (under the interpreter on the CPU). On the GPU the tiny models
have as many k/v heads as query heads: sdpa's fp32 backend there (the memory-efficient one) takes no grouped
heads, and for them sdpa would choose its math fallback, which the node does not call."""

import copy

import pytest
import torch
from torch import nn

import tigon
from tests.helpers import DEVICE, ON_GPU
from tests.patching.tiny import assert_grads_close, batch, grads, rel, tiny_config, tiny_model, train
from tests.patching.tiny_lora import node_in_fp32_here, step
from tigon.patching import fused_attention

peft = pytest.importorskip("peft")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True)
def _node_in_fp32_on_this_device(monkeypatch):
    node_in_fp32_here(monkeypatch)


@pytest.fixture
def node_calls(monkeypatch):
    calls = []
    apply = fused_attention.APPLY_NODE

    def counting(*args):
        result = apply(*args)
        calls.append(args)
        return result

    monkeypatch.setattr(fused_attention, "APPLY_NODE", counting)
    return calls


def base_model(model_type="llama"):
    torch.manual_seed(0)
    heads = {"num_key_value_heads": tiny_config(model_type).num_attention_heads} if ON_GPU else {}
    model = tiny_model(model_type, **heads).to(DEVICE)
    model.config._attn_implementation = "sdpa"
    return model


def lora(model, r=4, targets=ALL, seed=1, **kwargs):
    torch.manual_seed(seed)  # the adapters' init: the same draw for stock and patched
    config = peft.LoraConfig(r=r, lora_alpha=8, target_modules=targets, init_lora_weights=False, **kwargs)
    return peft.get_peft_model(model, config)


def assert_matches(patched, stock, seed=0):
    loss, got = step(patched, seed)
    loss_stock, want = step(stock, seed)
    assert rel(loss, loss_stock) <= 1e-5
    assert_grads_close(got, want, 1e-4)
    return got


CASES = {  # (rank, targets, LoraConfig extras, model type)
    "r1-all": (1, ALL, {}, "llama"),
    "r5-rslora-qwen2-biases": (5, ALL, {"use_rslora": True}, "qwen2"),
    "r16-q-v-only": (16, ["q_proj", "v_proj"], {}, "llama"),
    "r5-o-only": (5, ["o_proj"], {}, "llama"),
}


@pytest.mark.parametrize("case,order", [(case, "patch_after_wrap") for case in CASES]
                         + [("r5-rslora-qwen2-biases", "patch_before_wrap")])
def test_attention_adapters_inside_the_node_match_peft(case, order, node_calls):
    r, targets, extras, model_type = CASES[case]
    base = base_model(model_type)
    stock = lora(copy.deepcopy(base), r, targets, **extras)
    if order == "patch_after_wrap":
        patched = lora(base, r, targets, **extras)
        handle = tigon.patch(patched)
    else:
        handle = tigon.patch(base)
        patched = lora(base, r, targets, **extras)
    got = assert_matches(patched, stock)
    assert len(node_calls) == base.config.num_hidden_layers
    assert {n.split("lora_")[-1].split(".")[0] for n in got} == {"A", "B"}
    if order == "patch_after_wrap":
        fused = "/".join(t for t in ATTENTION if t in targets)
        assert f"LoRA adapters (r={r}) of {fused} run inside the attention node (2 modules)" in handle.replaced
        if targets is ALL:
            assert f"LoRA adapters (r={r}) of gate_proj/up_proj/down_proj run inside the MLP node (2 modules)" \
                in handle.replaced


def test_trainable_base_weights_get_their_gradients(node_calls):
    base = base_model()
    stock, patched = lora(copy.deepcopy(base), 3, ATTENTION), lora(base, 3, ATTENTION)
    for model in (stock, patched):
        for name, p in model.named_parameters():
            if "self_attn" in name and "base_layer" in name:
                p.requires_grad_(True)
    tigon.patch(patched)
    got = assert_matches(patched, stock)
    assert any("q_proj.base_layer.weight" in n for n in got) and any("o_proj.base_layer.weight" in n for n in got)
    assert node_calls


def _fallback(kind):
    if kind == "dropout":
        return {"lora_dropout": 0.05}, "dropout 0.05"
    return {"use_dora": True}, "DoRA"


@pytest.mark.parametrize("kind", ["dropout", "dora"])
def test_unfusable_adapters_keep_peft_forward(kind, node_calls):
    extras, reason = _fallback(kind)
    base = base_model()
    stock = lora(copy.deepcopy(base), 4, ATTENTION, **extras)
    patched = lora(base, 4, ATTENTION, **extras)
    handle = tigon.patch(patched)
    assert f"q_proj: PEFT's forward ({reason}); the attention runs its own forward (2 modules)" in handle.replaced
    assert not any(line.startswith("LoRA adapters") for line in handle.replaced)
    torch.manual_seed(7)
    loss_stock, want = step(stock)
    torch.manual_seed(7)
    loss, got = step(patched)
    assert not node_calls
    assert rel(loss, loss_stock) <= 1e-5
    assert_grads_close(got, want, 1e-4)


def test_two_active_adapters_keep_peft_forward(node_calls):
    base = base_model()
    models = []
    for model in (copy.deepcopy(base), base):
        model = lora(model, 4, ATTENTION)
        torch.manual_seed(2)
        model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=4, target_modules=ATTENTION,
                                                    init_lora_weights=False))
        model.base_model.set_adapter(["default", "second"])
        models.append(model)
    stock, patched = models
    handle = tigon.patch(patched)
    assert any(line.startswith("q_proj: PEFT's forward (2 active adapters)") for line in handle.replaced)
    assert_matches(patched, stock)
    assert not node_calls
    patched.base_model.set_adapter("default")  # decided at each call: one adapter runs in the node again
    stock.base_model.set_adapter("default")
    assert_matches(patched, stock, seed=1)
    assert len(node_calls) == base.config.num_hidden_layers


def test_disabled_adapters_run_the_base_in_the_node(node_calls):
    base = base_model()
    stock, patched = lora(copy.deepcopy(base), 4, ATTENTION), lora(base, 4, ATTENTION)
    tigon.patch(patched)
    ids, labels = batch(2)
    with stock.disable_adapter():
        want = stock(input_ids=ids, labels=labels).loss
    with patched.disable_adapter():
        got = patched(input_ids=ids, labels=labels).loss
    assert node_calls and all(a is None for a in node_calls[-1][17:25])
    assert rel(got, want) <= 1e-5


@pytest.mark.parametrize("order", ["patch_after_wrap", "patch_before_wrap"])
def test_modules_to_save_lm_head_keeps_the_fused_loss(order):
    """The loss and the trained lm_head copy's gradient equal stock PEFT's, computed by the fused loss (no
    logits); with the adapters disabled, the original head."""
    base = base_model()
    targets = ["lm_head", "embed_tokens"]
    stock = lora(copy.deepcopy(base), 4, ATTENTION, modules_to_save=targets)
    if order == "patch_after_wrap":
        patched = lora(base, 4, ATTENTION, modules_to_save=targets)
        handle = tigon.patch(patched)
    else:
        handle = tigon.patch(base)
        patched = lora(base, 4, ATTENTION, modules_to_save=targets)
    ids, labels = batch(0)
    assert patched(input_ids=ids, labels=labels).logits is None  # the fused loss
    patched.zero_grad(set_to_none=True)
    got = assert_matches(patched, stock)
    assert any("lm_head.modules_to_save.default.weight" in n for n in got)
    assert any("embed_tokens.modules_to_save.default.weight" in n for n in got)
    ids, labels = batch(3)
    with stock.disable_adapter():
        want = stock(input_ids=ids, labels=labels).loss
    with patched.disable_adapter():
        out = patched(input_ids=ids, labels=labels)
    assert out.logits is None and rel(out.loss, want) <= 1e-5
    handle.revert()


def _plain(model):
    for module in model.modules():
        assert not type(module).__module__.startswith(("tigon", "peft")), type(module)
        assert not any(name == "forward" or name.startswith("_tigon") for name in vars(module)), type(module)


@pytest.mark.parametrize("order,extras", [("patch_after_wrap", {}), ("patch_before_wrap", {}),
                                          ("patch_after_wrap", {"modules_to_save": ["lm_head"]})])
def test_merge_and_unload_returns_a_plain_transformers_model(order, extras):
    from transformers import LlamaForCausalLM

    base = base_model()
    if order == "patch_after_wrap":
        patched = lora(base, 4, ALL, **extras)
        handle = tigon.patch(patched)
    else:
        handle = tigon.patch(base)
        patched = lora(base, 4, ALL, **extras)
    train(patched, 2)
    patched.eval()
    ids, _ = batch(4)
    with torch.no_grad():
        want = patched(input_ids=ids).logits
    merged = patched.merge_and_unload()
    if order == "patch_before_wrap":  # PEFT's side cannot tell: the patch's own handle reverts it
        handle.revert()
    assert type(merged) is LlamaForCausalLM
    _plain(merged)
    assert merged.state_dict().keys() == tiny_model("llama").state_dict().keys()
    with torch.no_grad():
        assert rel(merged(input_ids=ids).logits, want) <= 1e-5
    handle.revert()  # a no-op now


def test_unload_and_revert_remove_the_instance_methods():
    patched = lora(base_model(), 4, ATTENTION)
    handle = tigon.patch(patched)
    assert "merge_and_unload" in vars(patched)
    copied = copy.deepcopy(patched)  # a copy's unloading is PEFT's alone
    assert vars(copied)["_tigon_patch"].patch is None
    handle.revert()
    assert "merge_and_unload" not in vars(patched) and "_tigon_patch" not in vars(patched)
    handle = tigon.patch(patched)
    unloaded = patched.unload()
    _plain(unloaded)
    assert isinstance(unloaded.model.layers[0].self_attn.q_proj, nn.Linear)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_gpu_bf16_autocast_attention_adapters_match_peft(dtype, node_calls):
    """At a real-ish shape on the GPU, the node in bf16 under autocast and stock PEFT under the same autocast,
    each against stock PEFT in fp32 (the reference: two bf16 runs compared with each other carry both their
    roundings). The loss within 1e-2 of the reference's; every adapter gradient of the node within bf16's
    tolerance of the reference's (API.md, 3e-2) and no further from it than 1.5 times stock's bf16 error (plus
    1e-3 where stock's is tiny): the node rounds no more often than PEFT's separate products do.

    Weights drawn with transformers' initializer_range 0.02: the tiny models' 0.2 at hidden 512 grows the
    activations ~4.5 times a product, the attention's softmax saturates and bf16's roundings dominate the
    gradients (stock PEFT's own bf16 adapter gradients lie 0.1-0.56 from fp32 there on the CPU; at 0.02
    within 2.3e-2)."""
    torch.manual_seed(0)
    base = tiny_model("llama", hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, num_hidden_layers=2, initializer_range=0.02).to("cuda")
    base.config._attn_implementation = "sdpa"
    stock = lora(copy.deepcopy(base), 16, ALL, use_rslora=True)
    reference = copy.deepcopy(stock)
    patched = lora(base, 16, ALL, use_rslora=True)
    tigon.patch(patched)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, base.config.vocab_size, (4, 512), generator=gen).cuda()
    results = []
    for model, autocast in ((patched, True), (stock, True), (reference, False)):
        with torch.autocast("cuda", dtype=dtype, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), grads(model)))
    assert len(node_calls) == 2
    (loss, got), (loss_stock, want), (loss_ref, ref) = results
    assert got.keys() == want.keys() == ref.keys()
    for name in ref:
        err, err_stock = rel(got[name], ref[name]), rel(want[name], ref[name])
        assert err <= 3e-2, f"grad of {name}: relative error {err:.2e} to fp32 > 3e-02 (stock PEFT's: {err_stock:.2e})"
        assert err <= 1.5 * err_stock + 1e-3, f"grad of {name}: error {err:.2e} to fp32, stock's {err_stock:.2e}"
    assert rel(loss, loss_ref) <= 1e-2
