"""PEFT LoRA with tigon where users train it: TRL's SFTTrainer given a ``peft_config``, gradient checkpointing,
and a ``PeftModel`` made on either side of the patch or loaded from saved adapters. Each equals stock PEFT
(fp32 under the interpreter; losses within 1e-5, adapter gradients within 1e-4) with the adapters inside
tigon's attention and MLP nodes (the nodes' calls counted).

- SFTTrainer: (a) ``tigon.patch(base)``, then ``SFTTrainer(model=base, peft_config=...)``, which wraps it in a
  ``PeftModel`` and adds TRL's fused LM head; (b) the trainer first, then ``tigon.patch(trainer.model)``: the
  CausalLM's forward is TRL's head by then, which the patch keeps (``Patch.replaced`` says so) with the
  backbone patched beneath it. TRL turns gradient checkpointing on (non-reentrant, its default) and the
  input's gradient (``enable_input_require_grads``) for a PEFT model: each node runs in each layer's forward
  and again in its recompute. DPOTrainer likewise, its reference model the adapters disabled.
- Gradient checkpointing, non-reentrant and reentrant (transformers 4's default, which training scripts still
  pass), with the input's gradient that PEFT's ``prepare_model_for_kbit_training`` and TRL turn on, enabled
  before or after the patch: the backward's recompute runs the nodes.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tigon
from tests.helpers import DEVICE
from tests.patching.test_frameworks import _word_tokenizer
from tests.patching.tiny import SEQ, VOCAB, batch, rel
from tests.patching.tiny_lora import (
    RANK,
    assert_step_matches,
    base_model,
    count_node_calls,
    lora,
    lora_config,
    node_in_fp32_here,
)

peft = pytest.importorskip("peft")

LAYERS = 2  # tiny.py's num_hidden_layers
STEPS = 2
BATCH = 2


@pytest.fixture(autouse=True)
def _node_in_fp32_here(monkeypatch):
    node_in_fp32_here(monkeypatch)


@pytest.fixture
def node_calls(monkeypatch):
    return count_node_calls(monkeypatch)


def _lora_lines():
    return [f"LoRA adapters (r={RANK}) of q_proj/k_proj/v_proj/o_proj run inside the attention node "
            f"({LAYERS} modules)",
            f"LoRA adapters (r={RANK}) of gate_proj/up_proj/down_proj run inside the MLP node ({LAYERS} modules)"]


# ------------------------------------------------------------------------------------- TRL's SFTTrainer


def _sft_trainer(model, out_dir):
    """TRL's SFTTrainer on ``model`` with a LoRA ``peft_config`` (TRL's defaults otherwise: gradient
    checkpointing on), fp32 on the test device, a constant learning rate, a loss logged each step, nothing
    saved. The trainer moves the model to its own device, so ``use_cpu`` only where the tests run on the CPU: on a
    GPU machine it would move the model to the CPU, whose tensors tigon's compiled kernels refuse."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, VOCAB, (STEPS * BATCH, SEQ), generator=gen)
    args = trl.SFTConfig(
        output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-2,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=DEVICE.type == "cpu", bf16=False, fp16=False, seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True, max_length=SEQ,
    )
    torch.manual_seed(1)  # the adapters' init (TRL's get_peft_model): the same draw for stock and patched
    return trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": ids.tolist()}),
                          processing_class=_word_tokenizer(), peft_config=lora_config())


def _train(trainer):
    """The logged losses and the trained adapters."""
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("order", ["patch_then_trainer", "trainer_then_patch"])
def test_sft_trainer_with_peft_config_matches_stock(order, tmp_path, node_calls):
    base = base_model()
    stock = _sft_trainer(copy.deepcopy(base), tmp_path / "stock")
    assert isinstance(stock.model, peft.PeftModel) and stock.args.gradient_checkpointing
    want, want_adapters = _train(stock)
    assert node_calls == {"attention": 0, "MLP": 0}

    if order == "patch_then_trainer":
        tigon.patch(base)
        trainer = _sft_trainer(base, tmp_path / "tigon")
    else:
        trainer = _sft_trainer(base, tmp_path / "tigon")
        handle = tigon.patch(trainer.model)
        assert set(_lora_lines()) <= set(handle.replaced)
        assert ("LlamaForCausalLM.forward is TRL's fused LM head (trl add_fused_lm_head): kept, the training loss "
                "TRL's (tigon.patch_trl() computes it with tigon)") in handle.replaced
    got, adapters = _train(trainer)

    assert len(got) == len(want) == STEPS and want[0] != want[1]
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= 1e-5 * abs(w), (step, g, w)
    assert adapters.keys() == want_adapters.keys() and all("lora_" in name for name in adapters)
    for name, w in want_adapters.items():
        assert rel(adapters[name], w) <= 1e-4, name
    # each step: every layer's forward, and its recompute in the backward (gradient checkpointing)
    assert node_calls == {"attention": 2 * LAYERS * STEPS, "MLP": 2 * LAYERS * STEPS}
    if order == "trainer_then_patch":
        causal_lm = trainer.model.get_base_model()
        head = vars(causal_lm)["forward"]
        handle.revert()  # TRL's head stays
        assert vars(causal_lm)["forward"] is head and not any(type(m).__module__.startswith("tigon")
                                                               for m in causal_lm.modules())


def test_dpo_trainer_with_peft_config_matches_stock(tmp_path, node_calls):
    """DPO: the policy is the PeftModel, its reference the same model with the adapters disabled (PEFT's
    ``disable_adapter``: the base in the nodes). The model patched before the trainer and after it."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    gen = torch.Generator().manual_seed(3)

    def words(n):
        return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=gen))

    rows = datasets.Dataset.from_list([{"prompt": words(4), "chosen": words(5), "rejected": words(5)}
                                       for _ in range(STEPS * BATCH)])

    def trainer(model, name):
        args = trl.DPOConfig(
            output_dir=str(tmp_path / name), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-2,
            lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
            use_cpu=DEVICE.type == "cpu", bf16=False, fp16=False, seed=0, data_seed=0, dataloader_num_workers=0,
            disable_tqdm=True,
        )
        torch.manual_seed(1)
        return trl.DPOTrainer(model=model, args=args, train_dataset=rows, processing_class=_word_tokenizer(),
                              peft_config=lora_config())

    base = base_model()
    want, want_adapters = _train(trainer(copy.deepcopy(base), "stock"))
    assert len(want) == STEPS and want[0] != want[1]
    for order in ("patch_then_trainer", "trainer_then_patch"):
        model = copy.deepcopy(base)
        if order == "patch_then_trainer":
            tigon.patch(model)
            dpo = trainer(model, order)
        else:
            dpo = trainer(model, order)
            tigon.patch(dpo.model)
        node_calls.update(attention=0, MLP=0)
        got, adapters = _train(dpo)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert abs(g - w) <= 1e-5 * abs(w), (order, step, g, w)
        for name, w in want_adapters.items():
            assert rel(adapters[name], w) <= 1e-4, (order, name)
        assert node_calls["attention"] >= 2 * LAYERS * STEPS and node_calls["MLP"] >= 2 * LAYERS * STEPS


# ------------------------------------------------------------------------------------ gradient checkpointing


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("enabled", ["before_patch", "after_patch"])
def test_gradient_checkpointing_adapter_gradients_match_peft(use_reentrant, enabled, monkeypatch):
    """The adapters' gradients with checkpointing equal stock PEFT's with the same checkpointing; in the
    backward, each layer's recompute runs both nodes. ``before_patch``: checkpointing is turned on on the base
    model, before ``get_peft_model`` and the patch, as a PEFT script does; ``after_patch``: on the patched
    PeftModel, as a trainer does when it starts."""
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": use_reentrant}}
    base = base_model()
    models = []
    for model in (copy.deepcopy(base), base):
        if enabled == "before_patch":
            model.gradient_checkpointing_enable(**kwargs)
        model = lora(model)
        model.enable_input_require_grads()  # what PEFT's prepare_model_for_kbit_training and TRL call
        models.append(model)
    stock, patched = models
    handle = tigon.patch(patched)
    assert set(_lora_lines()) <= set(handle.replaced)
    if enabled == "after_patch":
        for model in models:
            model.gradient_checkpointing_enable(**kwargs)
    assert all(layer.gradient_checkpointing for layer in patched.base_model.model.model.layers)
    assert_step_matches(patched, stock)

    calls = count_node_calls(monkeypatch)
    ids, labels = batch(1)
    loss = patched(input_ids=ids, labels=labels).loss
    forward = dict(calls)
    loss.backward()
    assert {node: calls[node] - forward[node] for node in calls} == {"attention": LAYERS, "MLP": LAYERS}


# ----------------------------------------------------------------------------------- PeftModel, saved adapters


def _assert_outputs_match(patched, stock):
    """A training step (loss, adapter gradients), and the eval-mode logits."""
    assert_step_matches(patched, stock)
    ids, _ = batch(2)
    for model in (patched, stock):
        model.eval()
    with torch.no_grad():
        assert rel(patched(input_ids=ids).logits, stock(input_ids=ids).logits) <= 1e-5


@pytest.mark.parametrize("model_type", ["gemma", "mistral"])
@pytest.mark.parametrize("order", ["patch_then_wrap", "wrap_then_patch"])
def test_peft_model_on_either_side_of_the_patch(model_type, order, node_calls):
    base = base_model(model_type)
    stock = lora(copy.deepcopy(base), model_type)
    if order == "patch_then_wrap":
        tigon.patch(base)
        patched = lora(base, model_type)
    else:
        patched = lora(base, model_type)
        tigon.patch(patched)
    _assert_outputs_match(patched, stock)
    assert node_calls["attention"] >= LAYERS and node_calls["MLP"] >= LAYERS


@pytest.mark.parametrize("order", ["patch_then_load", "load_then_patch"])
def test_saved_adapters_load_onto_a_patched_base(order, tmp_path, node_calls):
    """``save_pretrained`` of a trained stock PeftModel, loaded by ``PeftModel.from_pretrained`` (trainable)
    onto a patched base, or onto a plain one patched afterwards: the same outputs as the saved model's."""
    base = base_model()
    stock = lora(copy.deepcopy(base))
    opt = torch.optim.AdamW(stock.parameters(), lr=1e-2)  # adapters that moved from their init
    ids, labels = batch(5)
    stock(input_ids=ids, labels=labels).loss.backward()
    opt.step()
    stock.zero_grad(set_to_none=True)
    stock.save_pretrained(tmp_path)

    if order == "patch_then_load":
        tigon.patch(base)
        patched = peft.PeftModel.from_pretrained(base, tmp_path, is_trainable=True)
    else:
        patched = peft.PeftModel.from_pretrained(base, tmp_path, is_trainable=True)
        handle = tigon.patch(patched)
        assert set(_lora_lines()) <= set(handle.replaced)
    _assert_outputs_match(patched, stock)
    assert node_calls == {"attention": LAYERS, "MLP": 2 * LAYERS}  # the step; the logits' MLPs (no grad)
