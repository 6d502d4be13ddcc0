"""transformers' Trainer with gradient accumulation: a patched model logs the same losses and ends
with the same weights as the stock one.

The labels leave a different number of tokens out of each sequence, so the Trainer's
``num_items_in_batch`` (the count over the whole accumulated batch, passed to the model's forward)
decides the loss scale: a loss path that ignored it, or averaged per micro-batch, would differ.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tigon
from tests.helpers import DEVICE
from tests.patching.tiny import PromptMaskedSamples, rel, tiny_model

transformers = pytest.importorskip("transformers")

STEPS = 3
MICRO_BATCH = 2
ACCUMULATION = 2
LOSS_TOLERANCE = 1e-4  # the patching tests' bound for fp32 losses over optimizer steps
WEIGHT_TOLERANCE = 1e-4


def _train(model, out_dir):
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=ACCUMULATION, learning_rate=1e-3, lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=DEVICE.type == "cpu",
        dataloader_num_workers=0, seed=0, data_seed=0, disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=PromptMaskedSamples(STEPS * MICRO_BATCH * ACCUMULATION),
    )
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_gradient_accumulation_matches_stock(tmp_path):
    torch.manual_seed(0)
    stock = tiny_model("llama").to(DEVICE)
    patched = copy.deepcopy(stock)
    tigon.patch(patched)
    want = _train(stock, tmp_path / "stock")
    got = _train(patched, tmp_path / "tigon")
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= LOSS_TOLERANCE * abs(w), (step, g, w)
    for (name, p), (_, q) in zip(patched.named_parameters(), stock.named_parameters(), strict=True):
        assert rel(p, q) <= WEIGHT_TOLERANCE, name
    assert want[-1] != want[0]
