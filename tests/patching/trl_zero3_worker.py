"""Worker for tests/patching/test_trl_head.py: TRL's fused LM head under DeepSpeed ZeRO-3, one process
on the CPU, with TRL's own function and with ``tigon.patch_trl()``.

Under ZeRO-3 the head's weight exists only inside TRL's ``maybe_gather_lm_head_ctx``: it is gathered
for the forward call, released when the call returns, and must be gathered again for the backward.
A tiny Llama with TRL's head (every output, a temperature) trains STEPS SGD steps through
``deepspeed.initialize`` (stage 3, every parameter partitioned and released after each use) on a
loss that uses log_probs and entropy. Writes each run's per-step losses, per-token outputs and
final weights (gathered) to the file named on the command line.

The same again with tied embeddings (the head's weight is the embedding's, which ZeRO-3 keeps gathered
through the embedding's use, so TRL's gather is a no-op): the head's gradient to it is one of two, and
tigon's re-gathering backward must add only its own part, leaving the backbone to the outer backward.

A process of its own: transformers' ZeRO-3 switch (``HfDeepSpeedConfig``, which TRL's gather reads)
stays on while it lives. The models are built before it, so not under ``zero.Init``.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys

import torch

import tigon
from tests.patching.tiny import batch, tiny_model
from tigon._interpreter import apply_interpreter_fixes

apply_interpreter_fixes()  # the parent sets TRITON_INTERPRET=1: this worker runs on the CPU

STEPS = 2
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
ZERO3 = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_allow_untested_optimizer": True,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                          "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
                          "stage3_prefetch_bucket_size": 0},
}


def train(model) -> dict:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=ZERO3)
    losses, fields = [], []
    for step in range(STEPS):
        ids, labels = batch(step)
        out = engine(input_ids=ids, labels=labels, fused_lm_head=True)
        loss = out.loss - 0.1 * out.entropy.sum() / out.label_mask.sum()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        fields.append({name: getattr(out, name).detach().clone() for name in OUTPUTS})
    params = list(model.parameters())
    assert all(p.numel() == 0 for p in params), "the model is not partitioned: ZeRO-3 did not run"
    with deepspeed.zero.GatheredParameters(params):
        state = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "fields": fields, "state": state}


def main(out_path: str) -> None:
    import trl.trainer.utils
    from transformers.integrations import HfDeepSpeedConfig

    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    models = {}
    for suffix, tied in (("", False), ("_tied", True)):
        torch.manual_seed(0)
        models["trl" + suffix] = tiny_model("llama", tie_word_embeddings=tied)
        models["tigon" + suffix] = copy.deepcopy(models["trl" + suffix])
    for model in models.values():
        trl.trainer.utils.add_fused_lm_head(model, temperature=0.8, outputs=OUTPUTS)
    zero3 = HfDeepSpeedConfig(ZERO3)  # noqa: F841 (transformers' ZeRO-3 switch, on while it lives)
    results = {}
    for name, model in models.items():
        with tigon.patch_trl() if name.startswith("tigon") else contextlib.nullcontext():
            results[name] = train(model)
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
