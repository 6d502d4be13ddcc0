"""A patched model inside the training frameworks users run: TRL's SFTTrainer and DPOTrainer,
transformers' Trainer with a DeepSpeed ZeRO-3 config, and Lightning's Trainer train it to the same
losses and weights as the stock model (fp32, so the comparison is tight).

TRL (1.x) replaces the CausalLM's forward with its own fused LM head (``trl.trainer.utils.
add_fused_lm_head``: per-token log-probabilities in tiles, no logits), so under TRL tigon's
backbone (norms, rotary, MLP, joined residual adds) runs beneath TRL's head, and tigon's fused loss
is not used; the test checks that the two compose. Lightning calls the model from its own loop;
the test checks that nothing in the patch depends on transformers' Trainer.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tigon
from tests.helpers import DEVICE, free_port
from tests.patching.tiny import SEQ, VOCAB, rel, tiny_model

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
BATCH = 2
LOSS_TOLERANCE = 1e-4  # the patching tests' bound for fp32 losses over optimizer steps
WEIGHT_TOLERANCE = 1e-4


def _models():
    torch.manual_seed(0)
    stock = tiny_model("llama").to(DEVICE)
    patched = copy.deepcopy(stock)
    tigon.patch(patched)
    return stock, patched


def _sequences(count):
    gen = torch.Generator().manual_seed(11)
    return torch.randint(3, VOCAB, (count, SEQ), generator=gen)


def _assert_same_training(got, want, patched, stock):
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= LOSS_TOLERANCE * abs(w), (step, g, w)
    assert want[-1] != want[0]
    for (name, p), (_, q) in zip(patched.named_parameters(), stock.named_parameters(), strict=True):
        assert rel(p, q) <= WEIGHT_TOLERANCE, name
    assert type(patched.model.layers[0].mlp).__module__.startswith("tigon")


def _word_tokenizer():
    """A tokenizer over the tiny vocabulary (token i is the word ``t<i>``), made offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def _trl_args(out_dir) -> dict:
    """The TRL configs' shared arguments: fp32 on the test device, constant learning rate, a loss logged
    each step, nothing saved or reported."""
    return dict(
        output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-2,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=DEVICE.type == "cpu", bf16=False, fp16=False, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )


def _logged_losses(trainer) -> list[float]:
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _check_against_stock(train):
    """``train(model, name)`` (logged losses) on the stock model and on its patched copy."""
    stock, patched = _models()
    want = train(stock, "stock")
    got = train(patched, "tigon")
    _assert_same_training(got, want, patched, stock)


def test_trl_sft_trainer_matches_stock(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")

    rows = [{"input_ids": ids.tolist()} for ids in _sequences(STEPS * BATCH)]

    def train(model, name):
        args = trl.SFTConfig(**_trl_args(tmp_path / name), max_length=SEQ)
        return _logged_losses(trl.SFTTrainer(
            model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
            processing_class=_word_tokenizer(),
        ))

    _check_against_stock(train)


def test_trl_dpo_trainer_matches_stock(tmp_path):
    """DPO: the policy and its frozen reference (a deep copy of the same model, patched with it)
    both score the chosen and rejected completions through TRL's fused head."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    gen = torch.Generator().manual_seed(3)

    def words(n):
        return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=gen))

    rows = [{"prompt": words(4), "chosen": words(5), "rejected": words(5)} for _ in range(STEPS * BATCH)]

    def train(model, name):
        return _logged_losses(trl.DPOTrainer(
            model=model, ref_model=copy.deepcopy(model), args=trl.DPOConfig(**_trl_args(tmp_path / name)),
            train_dataset=datasets.Dataset.from_list(rows), processing_class=_word_tokenizer(),
        ))

    _check_against_stock(train)


def test_trainer_with_deepspeed_zero3_config_matches_stock(tmp_path):
    """transformers' Trainer with a ZeRO-3 config (DeepSpeed through accelerate) and gradient
    accumulation, in a process of its own (tests/patching/hf_deepspeed_worker.py)."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "results.pt"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
        "MASTER_PORT": str(free_port()),
    }
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "patching" / "hf_deepspeed_worker.py"), str(out)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    runs = torch.load(out)
    want, got = runs["stock"], runs["tigon"]
    assert len(got["losses"]) == len(want["losses"]) == 3
    for step, (g, w) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert abs(g - w) <= LOSS_TOLERANCE * abs(w), (step, g, w)
    assert want["losses"][-1] != want["losses"][0]
    for name, w in want["state"].items():
        assert rel(got["state"][name], w) <= WEIGHT_TOLERANCE, name


def test_lightning_trainer_matches_stock(tmp_path):
    lightning = pytest.importorskip("lightning")

    class CausalLM(lightning.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def train(model, name):
        module = CausalLM(model)
        trainer = lightning.Trainer(
            max_steps=STEPS, accelerator="gpu" if DEVICE.type == "cuda" else "cpu", devices=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=str(tmp_path / name),
        )
        loader = torch.utils.data.DataLoader(_sequences(STEPS * BATCH), batch_size=BATCH)
        trainer.fit(module, loader)
        return module.losses

    _check_against_stock(train)
