"""Worker for tests/patching/test_frameworks.py: transformers' Trainer with a DeepSpeed ZeRO-3 config,
one process on the CPU, trains the stock tiny Llama and a tigon-patched copy with gradient
accumulation (the fused loss's ``num_items_in_batch`` path under ZeRO-3's gather-on-use). Writes each
run's logged losses and final weights (gathered) to the file named on the command line.

A process of its own: a Trainer with a DeepSpeed config leaves DeepSpeed's process group and
transformers' ZeRO-3 switch (models built while it lives are built under ``zero.Init``) behind.
The models are built before the TrainingArguments, so neither is built under ``zero.Init`` (which
DeepSpeed 0.19 cannot do on torch 2.13; test_distributed covers it on the GPU).
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import transformers

import tigon
from tests.patching.tiny import PromptMaskedSamples, tiny_model
from tigon._interpreter import apply_interpreter_fixes

apply_interpreter_fixes()  # the parent sets TRITON_INTERPRET=1 on a machine without CUDA

STEPS = 3
ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    # every parameter partitioned and gathered only for its use
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def train(model, out_dir) -> tuple[list[float], dict]:
    import deepspeed

    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, deepspeed=ZERO3, seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=PromptMaskedSamples(STEPS * 4))
    trainer.train()
    params = list(model.parameters())
    assert all(p.numel() == 0 for p in params), "the model is not partitioned: ZeRO-3 did not run"
    with deepspeed.zero.GatheredParameters(params):
        state = {name: p.detach().clone() for name, p in model.named_parameters()}
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], state


def main(out_path: str) -> None:
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    torch.manual_seed(0)
    stock = tiny_model("llama")
    patched = copy.deepcopy(stock)
    tigon.patch(patched)
    results = {}
    for name, model in (("stock", stock), ("tigon", patched)):
        losses, state = train(model, os.path.join(os.path.dirname(out_path), name))
        results[name] = {"losses": losses, "state": state}
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
