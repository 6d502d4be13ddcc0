"""Worker for tests/patching/test_trl_distributed.py, run by ``torchrun --nproc_per_node 2``: TRL's
DPO and GRPO trainers on two ranks, stock TRL against a tigon-patched model with ``tigon.patch_trl()``.

``python -m torch.distributed.run --nproc_per_node 2 trl_distributed_worker.py GROUP OUT``, GROUP one of:

``fsdp2``
    FSDP2 (``fully_shard`` on each decoder layer, then the root, as accelerate's FSDP2 plugin wraps a
    transformers model; the reference model ``fully_shard``-ed whole, as TRL's ``prepare_fsdp`` does).
    accelerate turns its FSDP plugin on only for GPU-like devices (its ``MULTI_CPU`` state never becomes
    ``FSDP``), so on the CPU no Trainer can drive FSDP2; the step is driven by hand with TRL's own code
    instead: the real ``DPOTrainer`` and ``GRPOTrainer`` are built (which adds TRL's fused LM head to
    the policy and the reference), the models are sharded, and each step calls the trainer's own
    ``_prepare_inputs`` (GRPO: generation, rewards, group advantages gathered over the ranks, the
    reference's log-probs) and ``compute_loss`` on the sharded model, then ``backward`` (FSDP2 reduces
    the gradients) and an SGD step. Saved per run: each step's loss averaged over the ranks, each
    step's gradients (``full_tensor()`` of the sharded ones), the trainer's logged metrics (rewards,
    entropy, token accuracy, …) and, for GRPO, the completions each rank generated.
``zero3``
    DeepSpeed ZeRO-3: ``DPOTrainer.train()`` with a stage-3 config (every parameter partitioned; the
    reference model prepared by TRL as a ZeRO-3 inference engine), on the tiny Llama (and, on the GPU,
    on one with tied embeddings). Saved per run: the logged losses and metrics, and the final weights (gathered).

``fsdp2_trainer`` (GPU only: accelerate's FSDP plugin is for GPU-like devices)
    ``DPOTrainer.train()`` with accelerate's FSDP2 plugin. Saved per run: the logged losses and metrics,
    and the final weights (gathered).

Each group trains the stock tiny Llama with TRL's own head (run ``trl``) and a copy patched with
``tigon.patch`` under ``tigon.patch_trl()`` (run ``tigon``), from the same weights on the same data.

CPU and gloo with the Triton interpreter, fp32. With ``TIGON_DIST_DEVICE=cuda`` each rank takes its own
GPU under NCCL, with tigon's compiled kernels and TRL's Triton head, in bf16: the FSDP2 losses under
``torch.autocast`` (the reference's and GRPO's scoring under accelerate's, as ``bf16=True`` sets it;
GRPO's generation in the models' fp32, so that both runs sample the same completions), the ZeRO-3
Trainer with ``bf16=True`` (DeepSpeed's bf16 weights). Every run saves its steps' wall time and token
counts.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard

import tigon
from tests.patching import worker_exit
from tests.patching.tiny import VOCAB, tiny_model
from tigon._interpreter import apply_interpreter_fixes

apply_interpreter_fixes()  # the parent sets TRITON_INTERPRET=1 on a machine without CUDA

ON_CUDA = os.environ.get("TIGON_DIST_DEVICE") == "cuda"
STEPS = 2
PAIRS = 2  # DPO pairs per rank and step (four sequences a forward)
LR = 1e-2
# bookkeeping whose value is not computed by the head
SKIPPED_METRICS = ("num_tokens", "step_time")
# logged by the Trainer, not computed by the head
TRAINER_BOOKKEEPING = ("epoch", "learning_rate", "train_", "num_tokens")
# the tokens a step runs through the model: DPO's sequences, GRPO's prompts and completions
MASKS = ("attention_mask", "prompt_mask", "completion_mask")
# ZeRO-3 as tests/patching/hf_deepspeed_worker.py configures it: every parameter partitioned and
# gathered only for its use; the Trainer fills in the batch sizes and the clipping.
ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "bf16": {"enabled": "auto"},
}


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if ON_CUDA else torch.device("cpu")


def autocast():
    """bf16 autocast on the GPU, as a bf16 Trainer runs its steps; fp32 on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if ON_CUDA else contextlib.nullcontext()


def _words(gen, n):
    return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=gen))


def preference_rows():
    """Every rank's pairs of every step: step s, rank r has rows ``(s·world + r)·PAIRS ...``."""
    gen = torch.Generator().manual_seed(3)
    count = STEPS * dist.get_world_size() * PAIRS
    return [{"prompt": _words(gen, 4), "chosen": _words(gen, 5), "rejected": _words(gen, 4 + i % 3)}
            for i in range(count)]


def prompt_rows():
    gen = torch.Generator().manual_seed(6)
    return [{"prompt": _words(gen, 3 + i % 2)} for i in range(STEPS * dist.get_world_size())]


def reward(completions, **_):
    """A toy reward over the tiny vocabulary: the mean token id of the completion's words."""
    return [sum(int(w[1:]) for w in c.split() if w[1:].isdigit()) / VOCAB / max(len(c.split()), 1)
            for c in completions]


def trl_args(config_cls, out_dir, **extra):
    """The configs' shared arguments. bf16 on the GPU (accelerate then runs the reference and GRPO's
    scoring under autocast); off on the CPU, said explicitly, as TRL's configs default to bf16=True on
    every device."""
    return config_cls(
        output_dir=str(out_dir), max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=not ON_CUDA, bf16=ON_CUDA, fp16=False,
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=False, **extra,
    )


def fresh_pair(patched: bool, **config):
    """The policy (tiny Llama with ``config``'s overrides, weights from seed 0, on this rank's device) and
    a copy for the reference; both patched with ``tigon.patch`` for the tigon run."""
    torch.manual_seed(0)
    policy = tiny_model("llama", **config).to(device())
    ref = copy.deepcopy(policy)
    if patched:
        tigon.patch(policy)
        tigon.patch(ref)
    return policy, ref


def shard_policy(model) -> None:
    """``fully_shard`` each decoder layer, then the root; marked as transformers' own FSDP2 wrapping marks
    a model, so that ``generate`` keeps the ranks in step (``synced_gpus``) when one finishes first."""
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model._is_fsdp_managed_module = True


def full_grads(model) -> dict:
    """Every parameter's gradient as a plain tensor (FSDP2's sharded gradients gathered)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().float().cpu().clone()
    return out


def rank_mean(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def logged_metrics(trainer) -> dict:
    return {k: list(v) for k, v in trainer._metrics["train"].items() if not k.startswith(SKIPPED_METRICS)}


def sharded_steps(trainer, model, batches) -> dict:
    """STEPS hand-driven steps of ``trainer`` on the FSDP2-sharded ``model``: the trainer's own
    ``_prepare_inputs`` and ``compute_loss``, ``backward``, SGD."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets for each step
    losses, grads, seconds, tokens, completions = [], [], [], [], []
    for step, rows in enumerate(batches):
        torch.manual_seed(100 + 10 * step + dist.get_rank())  # GRPO's sampling: the same in both runs
        if ON_CUDA:
            torch.cuda.synchronize()
        start = time.perf_counter()
        # GRPO generates here in the models' own dtype (fp32), so that both runs sample the same
        # completions; its scoring runs under accelerate's autocast where the config asks for bf16
        inputs = trainer._prepare_inputs(rows)
        with autocast():
            loss = trainer.compute_loss(model, inputs)
        loss.backward()
        if ON_CUDA:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        tokens.append(rank_mean(sum(inputs[k].sum() for k in MASKS if k in inputs)) * dist.get_world_size())
        if "completion_ids" in inputs:
            completions.append(inputs["completion_ids"].cpu().clone())
        losses.append(rank_mean(loss))
        grads.append(full_grads(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "metrics": logged_metrics(trainer), "seconds": seconds,
            "tokens": tokens, "completions": completions}


def fsdp2_dpo(policy, ref, out_dir: str) -> dict:
    import datasets
    import trl

    from tests.patching.test_frameworks import _word_tokenizer

    rows = preference_rows()
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=trl_args(trl.DPOConfig, out_dir),
                             train_dataset=datasets.Dataset.from_list(rows), processing_class=_word_tokenizer())
    shard_policy(policy)
    fully_shard(trainer.ref_model)  # TRL's prepare_fsdp: the reference sharded whole
    policy.train()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = trainer.train_dataset
    batches = [trainer.data_collator([data[(step * world + rank) * PAIRS + i] for i in range(PAIRS)])
               for step in range(STEPS)]
    return sharded_steps(trainer, policy, batches)


def fsdp2_grpo(policy, ref, out_dir: str) -> dict:
    """GRPO with a reference (beta > 0): each rank generates both completions of its prompt, so that a
    group's rewards sit on one rank and its advantages come from the rewards gathered over the ranks."""
    import datasets
    import trl

    from tests.patching.test_frameworks import _word_tokenizer

    del ref  # GRPOTrainer builds its own
    rows = prompt_rows()
    # TRL builds GRPO's reference model from the policy's path: the initial weights (saved by rank 0;
    # transformers' save_pretrained writes on the main process only)
    initial = os.path.join(out_dir, "initial")
    policy.save_pretrained(initial)
    dist.barrier()
    policy.config._name_or_path = initial
    args = trl_args(trl.GRPOConfig, out_dir, per_device_train_batch_size=2, num_generations=2,
                    max_completion_length=4, beta=0.1, temperature=0.9)
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=reward, args=args,
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=_word_tokenizer())
    shard_policy(policy)
    fully_shard(trainer.ref_model)
    policy.train()
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [[rows[step * world + rank]] * 2 for step in range(STEPS)]
    return sharded_steps(trainer, policy, batches)


class StepTimer(transformers.TrainerCallback):
    """Each optimizer step's wall time (forward, backward and step on this rank)."""

    def __init__(self):
        self.seconds, self.start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        if ON_CUDA:
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if ON_CUDA:
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self.start)


def zero3_dpo(policy, ref, out_dir: str) -> dict:
    import datasets
    import deepspeed
    import trl

    from tests.patching.test_frameworks import _word_tokenizer

    rows = preference_rows()
    args = trl_args(trl.DPOConfig, out_dir, per_device_train_batch_size=PAIRS, deepspeed=ZERO3)
    timer = StepTimer()
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=_word_tokenizer(), callbacks=[timer])
    trainer.train()
    params = list(policy.parameters())
    assert all(p.numel() == 0 for p in params), "the model is not partitioned: ZeRO-3 did not run"
    with deepspeed.zero.GatheredParameters(params):
        state = {name: p.detach().float().cpu().clone() for name, p in policy.named_parameters()}
    return {**trainer_logs(trainer), "state": state, "seconds": timer.seconds}


def trainer_logs(trainer) -> dict:
    """The logged values of each step, and each step's tokens over the ranks (TRL logs the running total)."""
    entries = [entry for entry in trainer.state.log_history if "loss" in entry]
    logs = [{k: v for k, v in entry.items() if isinstance(v, float) and not k.startswith(TRAINER_BOOKKEEPING)}
            for entry in entries]
    seen = [0.0] + [float(entry["num_tokens"]) for entry in entries]
    return {"logs": logs, "tokens": [b - a for a, b in zip(seen, seen[1:], strict=False)]}


def fsdp2_trainer_dpo(policy, ref, out_dir: str) -> dict:
    """GPU only: ``DPOTrainer.train()`` with accelerate's FSDP2 plugin (decoder layers wrapped, then the
    root; the reference sharded by TRL's ``prepare_fsdp``)."""
    import datasets
    import trl

    from tests.patching.test_frameworks import _word_tokenizer

    rows = preference_rows()
    fsdp_config = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    args = trl_args(trl.DPOConfig, out_dir, per_device_train_batch_size=PAIRS, fsdp=True, fsdp_config=fsdp_config)
    timer = StepTimer()
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=_word_tokenizer(), callbacks=[timer])
    trainer.train()
    assert trainer.is_fsdp_enabled and any(hasattr(p, "full_tensor") for p in trainer.model.parameters()), \
        "the model is not sharded: FSDP2 did not run"
    state = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
             for name, p in trainer.model.named_parameters()}
    return {**trainer_logs(trainer), "state": state, "seconds": timer.seconds}


# group -> run name -> (run, the model's config overrides). ``dpo_tied`` (GPU only; on the CPU
# tests/patching/trl_zero3_worker.py trains a tied head under ZeRO-3 in one process): the head's weight
# is the embedding's, which ZeRO-3 keeps gathered through the embedding's use (TRL's gather is then a no-op).
GROUPS = {
    "fsdp2": {"dpo": (fsdp2_dpo, {}), "grpo": (fsdp2_grpo, {})},
    "zero3": {"dpo": (zero3_dpo, {}), **({"dpo_tied": (zero3_dpo, {"tie_word_embeddings": True})} if ON_CUDA else {})},
    "fsdp2_trainer": {"dpo": (fsdp2_trainer_dpo, {})},
}


def main(group: str, out_path: str) -> None:
    if ON_CUDA:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # accelerate (inside the trainers) takes this process group over
    dist.init_process_group("nccl" if ON_CUDA else "gloo")
    out_dir = os.path.dirname(out_path)
    # Every model is built before the first Trainer: a ZeRO-3 Trainer leaves transformers' ZeRO-3 switch
    # on, under which a model built later would be built partitioned (zero.Init).
    models = {(name, patched): fresh_pair(patched, **config)
              for name, (_, config) in GROUPS[group].items() for patched in (False, True)}
    results = {}
    for name, (run, _) in GROUPS[group].items():
        results[name] = {"trl": run(*models[name, False], os.path.join(out_dir, f"{name}_trl"))}
        with tigon.patch_trl():
            results[name]["tigon"] = run(*models[name, True], os.path.join(out_dir, f"{name}_tigon"))
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    worker_exit.leave()  # results written, group destroyed
