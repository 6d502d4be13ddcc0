"""TRL trainer steps, stock against tigon, on a GPU: DPO and GRPO on a fixed batch, and DPO's longest sequence.

    python benchmarks/trl_steps.py steps --models qwen2 llama --trainers dpo grpo --providers trl tigon
    python benchmarks/trl_steps.py longest-dpo --providers trl tigon
    python benchmarks/trl_steps.py steps --device cpu --tiny          # pipeline smoke test (seconds, CPU)
    python benchmarks/trl_steps.py longest-dpo --device cpu --tiny

Providers. ``trl``: TRL 1.16 as shipped; its trainers score tokens with their own fused LM head
(``trl.trainer.utils.add_fused_lm_head``, ``_ChunkedLogProbFunction``: Triton kernels on CUDA).
``tigon``: ``tigon.patch(model)`` on the policy (and on DPO's reference model; ``--no-patch-ref``
leaves it stock) plus ``tigon.patch_trl()``, both before the trainer is built, so TRL's head computes
with ``tigon.ops.fused_linear_logprobs``. Each (model, trainer, provider) runs in a fresh Python
process (benchmarks/e2e.py's worker pool: no allocator cache or monkey patch leaks into the next one).

Models: random weights from config (``model_config(model_type, tiny=False)``: Qwen2.5-0.5B-shaped,
Llama-3.2-1B-shaped; a Gemma-3-1B-shaped config below for ``longest-dpo``), sdpa attention, weights
in bf16 by default (``--weights``): since transformers 5 a Hub checkpoint loads in its own dtype (bf16
for these models), which is what a TRL user who passes a model id trains. The trainer runs with
``bf16=True``. Same seed, same weights and same batch for both providers.

``steps`` — what is timed. The trainer is built as a user would (``DPOTrainer(model, ref_model, ...)``
with a reference model that is a copy of the policy; ``GRPOTrainer(model, reward_funcs, ...)`` with
TRL's defaults: ``beta=0`` hence no reference model, ``loss_type="dapo"``, ``num_iterations=1``),
gradient checkpointing off, ``max_length=None``. Then ONE batch, in the exact form the trainer's
``compute_loss`` receives it, without generation:

* DPO: ``trainer.data_collator`` (``DataCollatorForPreference``) applied to ``--rows/2`` tokenized
  pairs ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` of random tokens: ``input_ids``,
  ``attention_mask``, ``completion_mask`` of ``[rows, prompt + completion]`` (chosen rows, then
  rejected rows). Each step runs the reference model's forward (no grad) and the policy's.
* GRPO: the dict ``_generate_and_score_completions`` returns for ``rows`` completions of one prompt
  group (``num_generations = rows``): ``prompt_ids``/``prompt_mask`` ``[rows, prompt]``,
  ``completion_ids``/``completion_mask`` ``[rows, completion]`` (random tokens, no EOS, all masked
  in), ``advantages`` ``[rows]`` (random rewards normalised within the group, as TRL's
  ``scale_rewards="group"``), ``num_items_in_batch`` (the completion tokens). No
  ``old_per_token_logps`` (TRL omits it for ``num_iterations=1``) and no ``ref_per_token_logps``
  (``beta=0``). GRPO's loss is then ``-Σ adv·mask / N`` with a ratio of exactly 1: its value does
  not depend on the model (≈ 0), so the gradient norm and TRL's logged entropy are the checks.

A step (the same loop for both trainers, Trainer.train's inner step without the data loader)::

    with trainer.accelerator.autocast():              # bf16 autocast, as accelerate wraps forward
        loss = trainer.compute_loss(model, batch)     # TRL's own loss: forward(s), metrics
    loss.backward()
    grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm)   # norm in fp32 (see run_job)
    optimizer.step(); optimizer.zero_grad(set_to_none=True)   # trainer.create_optimizer()
    loss.item(), grad_norm.item()                     # synchronises

timed on the host per step. Default 8 rows x 1024 tokens (prompt 256 + completion 768) = 8192 tokens a
step: DPO 4 pairs, GRPO 8 completions. Reported: tokens/s (rows x tokens / median timed step, the
prompt tokens counted; DPO's reference forward is inside the step), peak allocated memory over the
timed steps, per-step loss, gradient norm (and GRPO's entropy), and their largest differences from
``trl``'s run. ``--warmup`` 2, ``--steps`` 5.

``--padded``: the rows are of random lengths, as real preference pairs and sampled completions are. DPO:
each prompt, chosen and rejected completion uniformly of [half, all] of ``--prompt``/``--completion``
tokens, padded by the collator to the longest; GRPO: each completion's mask ends at such a length
(what TRL masks after a completion's EOS), the group sharing one prompt. transformers then gives sdpa
a boolean padding mask, where without padding it passes none. Tokens/s still count the padded shape.

``longest-dpo``: Gemma-3-1B-shaped (``gemma3_text``: hidden 1152, 26 layers, 4 heads, 1 KV head, head
dim 256, intermediate 6912, vocabulary 262144, no final-logit softcap (Gemma-3's config has
``final_logit_softcapping: null``, transformers' default), sliding window 512, every sixth layer
global), one pair at batch 1 (chosen and rejected of L tokens each: a 128-token prompt and L − 128 of
completion), gradient checkpointing ON (TRL's default; enabled as ``Trainer.train()`` does), one
training step as above (``--context-steps``; a second step would also hold the AdamW moments). The
largest L that completes without running out of memory: from ``--start`` up (or down) in steps of
4096, then bisected by 1024, within [16384, 131072]; one fresh process per probe. TRL's published
figure for its own head on Gemma-3-1B is 59,392 tokens (its attention implementation is not known
here). With sdpa, transformers materialises each sliding-window layer's mask as a ``[2, 1, L, L]``
bool tensor (≈ 2·L² bytes: 7 GB at 59K) for both providers alike; ``--attention flash_attention_2``
(if flash-attn is installed) or ``flex_attention`` avoid it. Each probe is a fresh process of 20–60 s;
``--start tigon=90112`` starts one provider's search elsewhere, and ``--providers tigon`` runs one
provider per invocation where both would not fit a time limit.

Results: ``--out`` (default benchmarks/results/) gets ``trl-steps-<device>-<date>.{json,md}`` or
``trl-longest-dpo-<device>-<date>.{json,md}``, and one line to ``benchmarks/results/history.jsonl``
(``--history PATH``; none for a smoke run); the markdown is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is on the path, the repository is not
    sys.path.insert(0, str(ROOT))

from benchmarks import e2e  # noqa: E402  (worker pool, OOM detection, formatting)
from tigon.bench import history  # noqa: E402

MODELS = ("qwen2", "llama")
TRAINERS = ("dpo", "grpo")
PROVIDERS = ("trl", "tigon")
# Also selectable (--providers): the policy's decoder layers replayed as CUDA graphs
# (tigon.patch(policy, cuda_graphs=True)), for the steps a small model spends bound by its host.
EXTRA_PROVIDERS = ("tigon+graphs",)
ROWS = 8
PROMPT = 256
COMPLETION = 768
WARMUP = 2
STEPS = 5
LR = 1e-4  # large enough that bf16 weights move (TRL's default 1e-6 would leave most unchanged)
SEED = 0
GIB = 2**30
JOB_TIMEOUT_S = 300
RESULT_MARK = e2e.RESULT_MARK  # e2e.Worker.run reads the result line by it
GRAD_NORM_FLOOR = 1e-3  # of trl's first-step gradient norm: the relative gradient-norm check's floor
BF16_TOLERANCE = 3e-2  # API.md's bf16 bound, on the per-step loss (relative, floor 1) and gradient norm

# longest-dpo
LONGEST_MODEL = "gemma3_1b"
LONGEST_PROMPT = 128
COARSE = 4096
FINE = 1024
LONGEST_MIN = 16384
LONGEST_MAX = 131072
LONGEST_START = 57344  # just under TRL's published 59,392: a fit, then a first failure one coarse step up
TRL_PUBLISHED_LONGEST = 59392

# Tiny (CPU smoke) sizes: a few tokens, two steps.
TINY = dict(rows=4, prompt=4, completion=12, warmup=1, steps=2, coarse=32, fine=16, min=32, max=96, start=32,
            longest_prompt=4)

# Gemma-3-1B (google/gemma-3-1b-pt config.json): rope 1e6 global / 1e4 local (transformers' defaults),
# query_pre_attn_scalar 256, every sixth layer global; max_position_embeddings raised to the search's
# ceiling (the checkpoint says 32768; rope is computed for any position).
GEMMA3_1B = dict(
    vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
    final_logit_softcapping=None, attn_logit_softcapping=None, max_position_embeddings=LONGEST_MAX,
    rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
)


def _model_builders():
    """``model_config``, ``build_model``: from tigon.bench.models where they have moved, else tigon.demo."""
    try:
        from tigon.bench.models import build_model, model_config
    except ImportError:
        from tigon.demo import build_model, model_config
    return model_config, build_model


def model_spec(model: str, *, tiny: bool):
    """(label, config) of a benchmark model."""
    import transformers

    model_config, _ = _model_builders()
    if model == LONGEST_MODEL:
        if tiny:
            spec = model_config("gemma3_text", tiny=True)
            spec.config.sliding_window = 8
            return "tiny gemma3_text", spec.config
        return "Gemma-3-1B-shaped", transformers.Gemma3TextConfig(**GEMMA3_1B)
    spec = model_config(model, tiny=tiny)
    return spec.label, spec.config


# ------------------------------------------------------------------------------------------- args


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--providers", nargs="+", choices=PROVIDERS + EXTRA_PROVIDERS, default=list(PROVIDERS))
    common.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke test of the pipeline under Triton's interpreter (no real numbers)")
    common.add_argument("--tiny", action="store_true", help="tiny configs and a few tokens (with --device cpu)")
    common.add_argument("--weights", choices=("bf16", "fp32"), default="bf16",
                        help="dtype of the model's weights (bf16: as a Hub checkpoint loads in transformers 5)")
    common.add_argument("--attention", default="sdpa", help="attn_implementation (sdpa, flash_attention_2, ...)")
    common.add_argument("--no-patch-ref", dest="patch_ref", action="store_false",
                        help="tigon: leave DPO's reference model stock (default: tigon.patch it too)")
    common.add_argument("--out", type=Path, default=e2e.OUT, help="folder for the JSON and markdown")
    history.add_argument(common)
    common.add_argument("--timeout", type=int, default=JOB_TIMEOUT_S, help="seconds per job")

    steps = sub.add_parser("steps", parents=[common], help="tokens/s, memory and losses on a fixed batch")
    steps.add_argument("--models", nargs="+", default=list(MODELS))
    steps.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    steps.add_argument("--rows", type=int, help=f"sequences a step (default {ROWS}; DPO: rows/2 pairs)")
    steps.add_argument("--prompt", type=int, help=f"prompt tokens a row (default {PROMPT})")
    steps.add_argument("--completion", type=int, help=f"completion tokens a row (default {COMPLETION})")
    steps.add_argument("--warmup", type=int, help=f"untimed steps (default {WARMUP})")
    steps.add_argument("--steps", type=int, help=f"timed steps (default {STEPS})")
    steps.add_argument("--profile", type=Path, help="folder for a torch.profiler table of each job's last step")
    steps.add_argument("--padded", action="store_true",
                       help="rows of random lengths, padded to the longest (transformers then passes a mask)")

    longest = sub.add_parser("longest-dpo", parents=[common], help="longest DPO pair at batch 1, Gemma-3-1B")
    longest.add_argument("--start", nargs="+", default=[], metavar="[PROVIDER=]LENGTH",
                         help=f"first length probed, for all providers or one (default {LONGEST_START})")
    longest.add_argument("--min", dest="min_len", type=int, help=f"shortest length (default {LONGEST_MIN})")
    longest.add_argument("--max", dest="max_len", type=int, help=f"longest length (default {LONGEST_MAX})")
    longest.add_argument("--coarse", type=int, help=f"first search step (default {COARSE})")
    longest.add_argument("--fine", type=int, help=f"refinement step (default {FINE})")
    longest.add_argument("--context-steps", type=int, default=1, help="training steps each probe must complete")

    args = parser.parse_args(argv)
    tiny = TINY if args.tiny else {}
    if args.mode == "steps":
        for name, default in (("rows", ROWS), ("prompt", PROMPT), ("completion", COMPLETION),
                              ("warmup", WARMUP), ("steps", STEPS)):
            if getattr(args, name) is None:
                setattr(args, name, tiny.get(name, default))
        if args.rows < 2 or args.rows % 2:
            parser.error("--rows must be even (DPO: pairs; GRPO: at least 2 generations)")
        if args.steps < 1 or args.warmup < 0 or args.prompt < 1 or args.completion < 1:
            parser.error("--steps, --prompt and --completion must be at least 1, --warmup at least 0")
    else:
        starts = {}
        for item in args.start:
            provider, _, length = item.rpartition("=")
            if provider and provider not in PROVIDERS or not length.isdigit():
                parser.error(f"--start takes LENGTH or PROVIDER=LENGTH, not {item!r}")
            starts[provider or None] = int(length)
        args.start = starts.pop(None, None)
        for name, key, default in (("start", "start", LONGEST_START), ("min_len", "min", LONGEST_MIN),
                                   ("max_len", "max", LONGEST_MAX), ("coarse", "coarse", COARSE),
                                   ("fine", "fine", FINE)):
            if getattr(args, name) is None:
                setattr(args, name, tiny.get(key, default))
        if not (0 < args.fine <= args.coarse and args.coarse % args.fine == 0):
            parser.error("--fine must divide --coarse")
        args.starts = {p: starts.get(p, args.start) for p in PROVIDERS}
        if not all(args.min_len <= v <= args.max_len for v in args.starts.values()):
            parser.error("--start must lie in [--min, --max]")
        args.prompt = tiny.get("longest_prompt", LONGEST_PROMPT)
    return args


# ----------------------------------------------------------------------------------------- worker


def _word_tokenizer(size: int = 64):
    """A word-level tokenizer (token i is ``t<i>``), made offline: TRL's trainers want one to build;
    the benchmark's batches are token ids, never text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{f"t{i}": i for i in range(3, size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _checkpointing_name() -> str:
    """transformers 5.24 calls gradient checkpointing "activation checkpointing"; 5.17 to 5.23 do not."""
    import dataclasses

    import transformers

    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def _trainer_args(config_cls, job: dict, out_dir: str, **extra):
    cuda = job["device"] == "cuda"
    extra[_checkpointing_name()] = job["checkpointing"]
    return config_cls(
        output_dir=out_dir, per_device_train_batch_size=job["rows"] // (2 if job["trainer"] == "dpo" else 1),
        learning_rate=LR, lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=not cuda, bf16=True, fp16=False, seed=SEED, data_seed=SEED, dataloader_num_workers=0,
        disable_tqdm=True, **extra,
    )


def _length(full: int, job: dict, gen) -> int:
    """A row's length: ``full``, or with ``--padded`` one drawn uniformly from [full/2, full]."""
    import torch

    if not job.get("padded"):
        return full
    return int(torch.randint(max(1, full // 2), full + 1, (1,), generator=gen))


def _dpo(job, model, ref_model, out_dir, gen):
    import datasets
    import torch
    import trl

    rows = [{"prompt": "t3 t4", "chosen": "t5 t6", "rejected": "t7"}]
    trainer = trl.DPOTrainer(model=model, ref_model=ref_model,
                             args=_trainer_args(trl.DPOConfig, job, out_dir, max_length=None),
                             train_dataset=datasets.Dataset.from_list(rows), processing_class=_word_tokenizer())
    vocab = model.config.vocab_size
    pairs = []
    for _ in range(job["rows"] // 2):
        prompt, chosen, rejected = (torch.randint(3, vocab, (_length(n, job, gen),), generator=gen).tolist()
                                    for n in (job["prompt"], job["completion"], job["completion"]))
        pairs.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
    return trainer, trainer.data_collator(pairs)


def _grpo(job, model, out_dir, gen):
    import datasets
    import torch
    import trl

    rows = job["rows"]
    args = _trainer_args(trl.GRPOConfig, job, out_dir, num_generations=rows,
                         max_completion_length=job["completion"])
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                              args=args, train_dataset=datasets.Dataset.from_list([{"prompt": "t3 t4"}] * rows),
                              processing_class=_word_tokenizer())
    vocab = model.config.vocab_size
    rewards = torch.randn(rows, generator=gen)
    # each completion ends where it ends (--padded: at a random length, the rest masked out, as TRL masks what
    # follows a completion's EOS); one group shares its prompt
    completion_mask = torch.zeros(rows, job["completion"], dtype=torch.long)
    for row in range(rows):
        completion_mask[row, :_length(job["completion"], job, gen)] = 1
    batch = {
        "prompt_ids": torch.randint(3, vocab, (rows, job["prompt"]), generator=gen),
        "prompt_mask": torch.ones(rows, job["prompt"], dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (rows, job["completion"]), generator=gen),
        "completion_mask": completion_mask,
        # one group of `rows` generations, rewards scaled within it (TRL's scale_rewards="group")
        "advantages": (rewards - rewards.mean()) / (rewards.std() + 1e-4),
        "num_items_in_batch": completion_mask.sum(),
    }
    return trainer, batch


def _write_profile(profiler, job: dict) -> None:
    """The last timed step's operators by host time and by device time (``--profile``; the profiler's
    own cost makes that step slower than the others)."""
    name = f"{job['model']}-{job['trainer']}-{job['provider']}"
    averages = profiler.key_averages()
    with open(Path(job["profile"]) / f"trl-step-profile-{name}.txt", "w") as f:
        for key in ("cpu_time_total", "self_cpu_time_total", "device_time_total"):
            f.write(f"== {name}, sorted by {key}\n")
            f.write(averages.table(sort_by=key, row_limit=40, max_name_column_width=90) + "\n")


def _allocator_counts(cuda: bool) -> dict:
    """The caching allocator's cumulative counts: device allocations and frees (cudaMalloc/cudaFree,
    which synchronise the device when a request finds no cached block) and retries (a failed
    request that freed the cache and tried again). Per-step differences are recorded: a step time
    that grows from step to step while these grow points at the allocator, not the kernels."""
    import torch

    if not cuda:
        return {}
    stats = torch.cuda.memory_stats()
    return {key: stats.get(key, 0) for key in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def run_job(job: dict) -> dict:
    """Build model(s), patch (tigon), build the trainer and its batch, train ``warmup + steps`` steps."""
    import torch

    import tigon

    device = torch.device(job["device"])
    cuda = device.type == "cuda"
    _, build_model = _model_builders()
    label, config = model_spec(job["model"], tiny=job["tiny"])
    dtype = torch.bfloat16 if job["weights"] == "bf16" else torch.float32
    out = {**job, "label": label, "vocab": config.vocab_size,
           "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    torch.manual_seed(SEED)
    model = build_model(config, device=device, attention=job["attention"]).to(dtype)
    out["params"] = sum(p.numel() for p in model.parameters())
    ref_model = copy.deepcopy(model).eval() if job["trainer"] == "dpo" else None
    trl_patch = None
    if job["provider"].startswith("tigon"):
        tigon.patch(model, cuda_graphs=job["provider"] == "tigon+graphs")
        if ref_model is not None and job.get("patch_ref", True):
            tigon.patch(ref_model)
        trl_patch = tigon.patch_trl()
    try:
        return _train(job, out, model, ref_model, device)
    finally:
        if trl_patch is not None:  # global; reverted so that a later job in this process runs stock TRL
            trl_patch.revert()


def _train(job, out, model, ref_model, device):
    import torch

    cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(SEED)
    with tempfile.TemporaryDirectory() as out_dir:
        if job["trainer"] == "dpo":
            trainer, batch = _dpo(job, model, ref_model, out_dir, gen)
        else:
            trainer, batch = _grpo(job, model, out_dir, gen)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    out["batch_shapes"] = {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    out["tokens_per_step"] = sum(batch[k].numel() for k in ("input_ids", "prompt_ids", "completion_ids")
                                 if k in batch)
    # the tokens that are not padding (--padded): DPO's attention mask, GRPO's prompt and completion masks
    masks = ("attention_mask",) if "attention_mask" in batch else ("prompt_mask", "completion_mask")
    out["real_tokens_per_step"] = int(sum(batch[k].sum() for k in masks))
    if job["checkpointing"]:  # what Trainer.train() does with activation_checkpointing=True
        name = _checkpointing_name()
        kwargs = dict(getattr(trainer.args, f"{name}_kwargs") or {})
        if name == "activation_checkpointing":
            every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None,
                                                  every_n_layers=every_n_layers, offload=offload)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
    model.train()
    out["activation_checkpointing"] = bool(getattr(model, "is_activation_checkpointing",
                                                   getattr(model, "is_gradient_checkpointing", False)))
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train()'s loop; GRPO's loss reads it
    optimizer = trainer.create_optimizer()
    out["optimizer"] = type(optimizer).__name__
    params = [p for p in model.parameters() if p.requires_grad]

    def train_step():
        with trainer.accelerator.autocast():
            loss = trainer.compute_loss(model, batch)
        loss.backward()
        # clip_grad_norm_'s computation, with the norm accumulated in fp32 (torch's would be bf16 for bf16
        # grads: too coarse to compare the providers by)
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, dtype=torch.float32)))
        torch.nn.utils.clip_grads_with_norm_(params, trainer.args.max_grad_norm, grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), grad_norm.item()

    losses, grad_norms, entropies, seconds, allocator = [], [], [], [], []
    warmup, steps = job["warmup"], job["steps"]
    for step in range(warmup + steps):
        if step == warmup:
            e2e.wait_until_quiet(job.get("quiet_path"))
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
        before = _allocator_counts(cuda)
        profiling = job.get("profile") and step == warmup + steps - 1
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        profiler = torch.profiler.profile(activities=activities) if profiling else contextlib.nullcontext()
        with profiler:
            start = time.perf_counter()
            loss, grad_norm = train_step()
            seconds.append(time.perf_counter() - start)
        if profiling:
            _write_profile(profiler, job)
        allocator.append({k: v - before[k] for k, v in _allocator_counts(cuda).items()})
        losses.append(loss)
        grad_norms.append(grad_norm)
        logged = trainer._metrics["train"].get("entropy")
        if logged:
            entropies.append(logged[-1])
    median = statistics.median(seconds[warmup:])
    out.update(losses=losses, grad_norms=grad_norms, step_seconds=seconds, median_step_s=median,
               tokens_per_s=out["tokens_per_step"] / median, allocator_per_step=allocator)
    if entropies:
        out["entropies"] = entropies
    if cuda:
        out.update(peak_bytes=torch.cuda.max_memory_allocated(), reserved_bytes=torch.cuda.max_memory_reserved())
    return out


def worker_main(ready_path: str | None = None) -> int:
    """Import everything, say so, wait for one job on stdin, run it, print the result line."""
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import trl  # noqa: F401

    import tigon.patching  # noqa: F401

    if ready_path:
        Path(ready_path).touch()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    job = json.loads(line)
    started = time.perf_counter()
    try:
        result = run_job(job)
    except Exception as exc:  # an error is a result (OOM is the expected one in longest-dpo)
        oom = e2e._is_oom(exc)
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        result = {**job, "error": "out of memory" if oom else f"{type(exc).__name__}: {first_line}", "oom": oom}
        if not oom:
            import traceback

            result["traceback"] = traceback.format_exc()[-3000:]
    result["wall_s"] = time.perf_counter() - started
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


# ----------------------------------------------------------------------------------------- parent


def _job(args, model, trainer, provider, **extra) -> dict:
    return {"model": model, "trainer": trainer, "provider": provider, "device": args.device, "tiny": args.tiny,
            "weights": args.weights, "attention": args.attention, "patch_ref": args.patch_ref,
            "checkpointing": False, **extra}


def row_line(row: dict) -> str:
    seq = row["prompt"] + row["completion"]
    head = f"{row['model']:>9} {row['trainer']:<4} {row['provider']:<5} {row['rows']} x {seq:<6}"
    if "error" in row:
        return f"{head} ERROR {row['error']}  ({row.get('wall_s', 0):.0f} s)"
    return (f"{head} {e2e._si(row['tokens_per_s']):>7} tok/s  peak {e2e._gib(row.get('peak_bytes'))} GiB  "
            f"losses {' '.join(f'{x:.4g}' for x in row['losses'])}  ({row['wall_s']:.0f} s)")


def steps_mode(args, log=print) -> dict:
    pool = e2e.WorkerPool(args.timeout, __file__)
    rows = []
    try:
        for model in args.models:
            for trainer in args.trainers:
                for provider in args.providers:
                    job = _job(args, model, trainer, provider, rows=args.rows, prompt=args.prompt,
                               completion=args.completion, warmup=args.warmup, steps=args.steps,
                               profile=str(args.profile) if args.profile else None, padded=args.padded)
                    row = pool.run(job)
                    rows.append(row)
                    log(row_line(row))
                    if "traceback" in row:
                        log(row["traceback"])
    finally:
        pool.close()
    add_agreement(rows)
    return {"kind": "steps", "rows": rows}


def _max_rel(got, want, floor: float) -> float:
    return max(abs(a - b) / max(abs(b), floor) for a, b in zip(got, want, strict=True))


def add_agreement(rows: list[dict]) -> None:
    """Against ``trl``'s run of the same (model, trainer): the largest per-step difference of the loss
    (relative, with a floor of 1: GRPO's loss is ≈ 0 by construction), of the gradient norm (relative,
    with a floor of 1e-3 of trl's first-step norm: at LR 1e-4 a DPO pair's loss saturates after one
    step and the later norms fall to ~1e-14, where bf16 leaves only rounding to compare) and of GRPO's
    logged entropy (relative), and whether all are within bf16's 3e-2."""
    ref = {(r["model"], r["trainer"]): r for r in rows if r["provider"] == "trl" and "losses" in r}
    for row in rows:
        want = ref.get((row["model"], row["trainer"]))
        if want is None or "losses" not in row or row["provider"] == "trl":
            continue
        row["loss_diff"] = _max_rel(row["losses"], want["losses"], 1.0)
        row["grad_norm_diff"] = _max_rel(row["grad_norms"], want["grad_norms"],
                                         max(GRAD_NORM_FLOOR * abs(want["grad_norms"][0]), 1e-12))
        diffs = [row["loss_diff"], row["grad_norm_diff"]]
        if "entropies" in row and "entropies" in want:
            row["entropy_diff"] = _max_rel(row["entropies"], want["entropies"], 1e-12)
            diffs.append(row["entropy_diff"])
        row["agrees"] = max(diffs) <= BF16_TOLERANCE


def search_longest(probe, *, start: int, minimum: int, maximum: int, coarse: int, fine: int):
    """Largest multiple of ``fine`` in [minimum, maximum] for which ``probe`` is True (success monotone
    in the length): from ``start`` in coarse steps that double while they succeed (or halve the
    length's distance to ``minimum`` while they fail), bisection on the coarse grid, then on the fine
    grid. Returns (longest or 0, first failing length or None)."""
    results = {}

    def ok(length):
        if length not in results:
            results[length] = probe(length)
        return results[length]

    lo = hi = None
    length = start - start % coarse
    if ok(length):
        lo, step = length, coarse
        while hi is None and lo < maximum:
            nxt = min(lo + step, maximum)
            if ok(nxt):
                lo, step = nxt, 2 * step
            else:
                hi = nxt
    else:
        hi, step = length, coarse
        while lo is None and hi > minimum:
            nxt = max(hi - step, minimum)
            if ok(nxt):
                lo = nxt
            else:
                hi, step = nxt, 2 * step
        if lo is None:
            return 0, hi
    for grid in (coarse, fine):
        while hi is not None and hi - lo > grid:
            mid = lo + ((hi - lo) // 2) // grid * grid
            if mid <= lo:
                break
            if ok(mid):
                lo = mid
            else:
                hi = mid
    return lo, hi


def longest_mode(args, log=print) -> dict:
    pool = e2e.WorkerPool(args.timeout, __file__)
    rows = []
    try:
        for provider in args.providers:
            probes = []

            def probe(length, provider=provider, probes=probes):
                job = _job(args, LONGEST_MODEL, "dpo", provider, rows=2, prompt=args.prompt,
                           completion=length - args.prompt, warmup=0, steps=args.context_steps,
                           checkpointing=True)
                result = pool.run(job)
                probes.append({k: result.get(k) for k in ("completion", "error", "oom", "peak_bytes", "wall_s",
                                                          "losses", "device", "label",
                                                          "activation_checkpointing")} | {"seq": length})
                log(row_line(result))
                if "traceback" in result:
                    log(result["traceback"])
                return "error" not in result

            longest, first_fail = search_longest(probe, start=args.starts[provider], minimum=args.min_len,
                                                 maximum=args.max_len, coarse=args.coarse, fine=args.fine)
            failure = next((p["error"] for p in probes if p["seq"] == first_fail), None)
            rows.append({
                "model": LONGEST_MODEL, "provider": provider, "longest_seq": longest, "first_failure": first_fail,
                "failure": failure,
                "peak_bytes_at_longest": next((p["peak_bytes"] for p in probes if p["seq"] == longest), None),
                "label": next((p["label"] for p in probes if p.get("label")), LONGEST_MODEL),
                "device": next((p["device"] for p in probes if p.get("device")), None),
                "probes": probes,
            })
    finally:
        pool.close()
    return {"kind": "longest_dpo", "rows": rows}


# ----------------------------------------------------------------------------------------- output


def versions() -> dict:
    from importlib import metadata

    from tigon.bench.harness import versions as base

    out = {k: v for k, v in base().items() if k != "liger-kernel"}
    for name in ("trl", "tigon"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _diff(row, key) -> str:
    return f"{row[key]:.1e}" if key in row else "—"


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"# TRL trainer steps, stock vs tigon — {result['device']} — {result['date']}", "",
             f"Versions: {', '.join(f'{k} {v}' for k, v in result['versions'].items() if v)}.",
             f"Weights {s['weights']}, bf16=True, {s['attention']} attention; tigon = tigon.patch(policy"
             f"{' and DPO reference' if s['patch_ref'] else ''}) + tigon.patch_trl(); trl = TRL's own fused "
             "LM head; tigon+graphs = the same with the policy's decoder layers replayed as CUDA graphs "
             "(cuda_graphs=True). Each run in a fresh process (benchmarks/trl_steps.py documents what is timed)."]
    rows = result["rows"]
    if result["kind"] == "longest_dpo":
        starts = ", ".join(f"{v} ({k})" for k, v in s["starts"].items() if k in s["providers"])
        lines += [
            f"Longest DPO pair at batch 1 (chosen and rejected of L tokens each, prompt {s['prompt']}), "
            f"gradient checkpointing on, {s['context_steps']} training step(s) (compute_loss, backward, clip, "
            f"AdamW); searched from {starts} by {s['coarse']}, refined by {s['fine']}, within "
            f"[{s['min']}, {s['max']}]. TRL's published figure for its own head on Gemma-3-1B: "
            f"{TRL_PUBLISHED_LONGEST:,} tokens.", "",
            "| model | provider | longest L | first failure | peak GiB at longest | probes |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for row in rows:
            fail = "—" if row["first_failure"] is None else f"{row['first_failure']} ({row['failure']})"
            tried = ", ".join(f"{p['seq']}{'' if p.get('error') is None else ' ✗'}" for p in row["probes"])
            lines.append(f"| {row['label']} | {row['provider']} | {row['longest_seq'] or 'none'} | {fail} | "
                         f"{e2e._gib(row['peak_bytes_at_longest'])} | {tried} |")
        return "\n".join(lines) + "\n"

    lines += [
        f"Fixed batch of {s['rows']} rows x {s['prompt'] + s['completion']} tokens (prompt {s['prompt']} + "
        f"completion {s['completion']}; DPO {s['rows'] // 2} pairs, GRPO {s['rows']} completions), median of "
        f"{s['steps']} steps after {s['warmup']} warm-up steps"
        + (f"; padded: each row of a random length in [half, full] (prompt, chosen and rejected apart for DPO, the "
           f"completion for GRPO), padded to the longest, tokens/s counting the padded shape "
           f"({_real_share(rows)} of it real tokens)" if s.get("padded") else "")
        + ". Loss Δ: largest per-step |Δ| / max(|trl|, 1); "
        "grad-norm Δ: relative, floor 1e-3 of trl's first-step norm; entropy Δ: relative; ok: all ≤ 3e-2 (bf16).", "",
        "| model | trainer | provider | tokens/s | vs trl | step ms | peak GiB | loss Δ | grad-norm Δ "
        "| entropy Δ | ok | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ref = {(r["model"], r["trainer"]): r for r in rows if r["provider"] == "trl" and "tokens_per_s" in r}
    for row in rows:
        name = row.get("label", row["model"])
        if "error" in row:
            lines.append(f"| {name} | {row['trainer']} | {row['provider']} | — | — | — | — | — | — | — | — | "
                         f"{row['error']} |")
            continue
        base = ref.get((row["model"], row["trainer"]))
        speed = f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "—"
        ok = {True: "yes", False: "**no**"}.get(row.get("agrees"), "—")
        lines.append(
            f"| {name} | {row['trainer']} | {row['provider']} | {row['tokens_per_s']:.0f} | {speed} | "
            f"{row['median_step_s'] * 1e3:.1f} | {e2e._gib(row.get('peak_bytes'))} | {_diff(row, 'loss_diff')} | "
            f"{_diff(row, 'grad_norm_diff')} | {_diff(row, 'entropy_diff')} | {ok} | |")
    lines += ["", "Per-step losses (and gradient norms):", ""]
    for row in rows:
        if "losses" in row:
            lines.append(f"- {row['model']} {row['trainer']} {row['provider']}: loss "
                         f"{', '.join(f'{x:.6g}' for x in row['losses'])}; grad norm "
                         f"{', '.join(f'{x:.6g}' for x in row['grad_norms'])}")
    return "\n".join(lines) + "\n"


def _real_share(rows) -> str:
    shares = [r["real_tokens_per_step"] / r["tokens_per_step"] for r in rows if r.get("real_tokens_per_step")]
    return f"{min(shares):.0%}–{max(shares):.0%}" if shares else "—"


def save(result: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = "trl-longest-dpo" if result["kind"] == "longest_dpo" else "trl-steps"
    stem = f"{kind}-{result['device'].replace(' ', '-')}-{result['date']}"
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps(result, indent=1))
    paths[1].write_text(markdown(result))
    return paths


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1] if len(argv) > 1 else None)
    args = parse_args(argv)
    import torch

    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # inherited by the workers, before they import tigon.ops
    elif not torch.cuda.is_available():
        print("benchmarks/trl_steps.py needs a CUDA GPU and this machine has none (--device cpu --tiny runs a "
              "smoke test of the pipeline).", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = steps_mode(args) if args.mode == "steps" else longest_mode(args)
    devices = [r.get("device") for r in result["rows"]] + [p.get("device") for r in result["rows"]
                                                           for p in r.get("probes", [])]
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    if args.mode == "longest-dpo":
        settings.update(min=args.min_len, max=args.max_len)
    result.update(device=next((d for d in devices if d), "unknown-GPU"), date=_dt.date.today().isoformat(),
                  versions=versions(), settings=settings, wall_s=time.perf_counter() - started,
                  env={k: v for k, v in os.environ.items() if k.startswith("PYTORCH_CUDA")})
    paths = save(result, args.out)
    print(f"\nwrote {', '.join(str(p) for p in paths)} ({result['wall_s']:.0f} s)\n")
    target = history.script_path(args)
    if target is not None:
        kind = "trl-longest-dpo" if result["kind"] == "longest_dpo" else "trl-steps"
        history.append(result, benchmark=kind, path=target)
        print(f"appended the run to {target}\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
