"""End-to-end training benchmark: whole models, one optimizer step after another, on a GPU.

    python benchmarks/e2e.py                               # 3 models x 5 providers (aimed at <= 8 min, H100)
    python benchmarks/e2e.py --models llama --providers stock tigon --steps 10
    python benchmarks/e2e.py --longest-context             # batch 1, Llama-3.2-1B-shaped, stock vs tigon
    python benchmarks/e2e.py --longest-context --providers tigon tigon+recompute --context-start 57344 \
        --context-max 73728                                # the same, from near tigon's limit
    python benchmarks/e2e.py --models qwen2 --providers stock tigon --profile   # where the GPU time goes
    python benchmarks/e2e.py --models qwen3_moe            # MoE: Qwen3-30B-A3B-shaped, 3 layers
    python benchmarks/e2e.py --device cpu --tiny --seq 16 --warmup 1 --steps 1   # pipeline smoke test
    python benchmarks/e2e.py --memory-buys-speed           # Llama-3.2-3B-shaped: stock + checkpointing vs tigon
    python benchmarks/e2e.py --models qwen2_5_vl --providers stock tigon liger   # a VLM (benchmarks/e2e_vlm.py)

What is measured. Models are built from config with random weights (``tigon.bench.models.model_config``,
the same configs ``tigon demo`` trains): Llama-3.2-1B-shaped (V=128256), Qwen2.5-0.5B-shaped
(V=151936, H=896) and Gemma-2-2B-shaped (V=256000, final-logit softcap; its attention-logit softcap
is off, as transformers' sdpa path cannot apply it; batch 2), fp32 weights,
sdpa attention, bf16 autocast, fused AdamW, batch 4 x 2048 of random tokens. A step is forward with
labels (the loss inside the model, as transformers computes it), backward, ``optimizer.step()`` and
``zero_grad(set_to_none=True)``, timed on the host with ``loss.item()`` as the synchronisation, so
the Python overhead an eager model pays is counted. Reported: tokens/s from the median step time of
the timed steps after the warm-up, peak allocated memory over the timed steps, and activation
memory = peak - 16 bytes x parameters (fp32 weights, grads and the two AdamW moments are fixed), plus
each provider's per-step loss against stock's (same seed, same weights, same batches: a
whole-model correctness check at full size) and torch.compile's graph-break count.

Providers: ``stock`` (transformers as shipped), ``tigon`` (``tigon.patch(model)``), ``compile``
(``torch.compile(model)``), ``tigon+compile`` (patch, then compile), ``liger`` (Liger-Kernel's
``apply_liger_kernel_to_<model_type>()`` before the model is built, when ``liger_kernel`` imports),
and on request ``tigon+graphs`` (``tigon.patch(model, cuda_graphs=True)``: each decoder layer's
training forward and backward replayed as CUDA graphs), ``tigon+recompute`` (``tigon.patch(model,
recompute_norms=True)``: norm outputs and the joins' sums remade in the backward, not saved),
``liger+compile``, and ``+ckpt`` after any of them (``stock+ckpt``, ``tigon+ckpt``): transformers'
gradient checkpointing (``gradient_checkpointing_enable``, non-reentrant) on every decoder layer. Each (model, provider)
runs in a fresh Python process, so no allocator cache, compiled graph or monkey patch leaks into the
next measurement; the next process is started while the current one runs and waits, imports done,
for its job (hiding start-up time).

Profile (``--profile``): after its timed steps, each job trains ``PROFILE_STEPS`` more steps under
``torch.profiler`` (the timed measurement is untouched), and sums the device time of every kernel,
per step, into the categories of ``KERNEL_CATEGORIES`` (matmul, attention, norm, rope, activation,
loss, optimizer, copies and casts, other elementwise, Inductor's fused kernels, other Triton, other)
by its name. Reported per provider: those sums, the GPU busy time (all kernels), the timed step's
wall time and busy / wall (well below 1: the host does not keep the GPU fed), and the top kernels.
On the CPU (``--device cpu``) the profile sums each operator's self CPU time instead: the
interpreter runs the Triton kernels on the host, so it only tests the pipeline.

MoE (``--models qwen3_moe``): Qwen3-30B-A3B's shape (H=2048, 128 experts of width 768, top-8,
32 query / 4 key-value heads of 128, V=151936, untied head) with 3 of its 48 layers (``MOE_SHAPES``):
2.5B parameters, 40 GB of fp32 weights, gradients and AdamW moments, which leaves room on one 80 GB
H100 for stock's 8192 x 151936 logits (~15 GB with their fp32 copies and gradient) and the experts'
activations (8192 tokens x 8 routed copies). GPT-OSS-20B (21B parameters) cannot train with AdamW on
one H100, and two of its layers, its 201088-token vocabulary and untied head would make as large a
model; Qwen3-MoE also has a Liger patch and runs transformers' sdpa attention (GPT-OSS's attention
sinks do not). The experts run transformers' default implementation (grouped_mm), the same for
every provider; tigon fuses their gate (tigon.ops.moe_glu).

Longest context (``--longest-context``): at batch 1, the largest sequence length, in steps of 2048,
that trains without running out of memory: two full steps, since the first ``optimizer.step()``
allocates the AdamW moments that every later step's peak includes. Found by doubling from 8192 then
bisecting, one fresh process per probe.

Memory buys speed (``--memory-buys-speed``): a Llama-3.2-3B-shaped model (3.2B parameters: 51 GB of
fp32 weights, gradients and AdamW moments; the 13 GB of gradients fill in during the backward as the
activations go) at batch 1 x ``MEMORY_SPEED_SEQ`` (12288) tokens, where stock runs out of memory and
fits only with gradient checkpointing: ``stock`` (the out-of-memory it is expected to hit is
reported, verifying the premise), ``stock+ckpt``, ``tigon`` and ``tigon+recompute``, each of the
last two without checkpointing, timed as the throughput mode times them; reported as tokens/s
against stock + checkpointing. Why 12288: the longest multiple of 4096 at which, by the saved bytes
per token (``python -m tigon.bench.saved`` scaled to 3B's widths, 28 layers; docs/memory.md), every
provider but stock fits an 80 GB H100 with a margin: tigon ~2.4 MB a token (limit ~17K tokens),
tigon with recompute_norms ~1.9 MB (~22K), stock + checkpointing ~1.9 MB, most of it the fp32 logits
and their gradient at the loss (~22K), stock without checkpointing ~9 MB (~3K). ``--seq`` and
``--batch`` override it; ``--find-seq [PROVIDER]`` first finds the longest sequence (multiples of
``--context-step`` from ``--context-start``, as ``--longest-context`` does) at which that provider
(default ``tigon``) trains two steps, and compares there: ``--find-seq tigon+recompute`` is the
longest context at which tigon trains without checkpointing.

Results go to ``benchmarks/results/e2e-<device>-<date>.{json,md,png}`` (``e2e-context-...`` for the
longest-context mode); the markdown is printed last (without the top-kernel lists, which are in
the files). Each run (but a ``--tiny`` or ``--device cpu`` smoke run) is appended as one line to
``benchmarks/results/history.jsonl`` (``--history PATH``: another file; ``tigon.bench.history``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tigon.bench import history
from tigon.bench.models import GPU_BATCH_OVERRIDES, model_config

MODELS = ("llama", "qwen2", "gemma2")
PROVIDERS = ("stock", "tigon", "compile", "tigon+compile", "liger")
OPTIONAL_PROVIDERS = ("tigon+graphs", "tigon+recompute", "liger+compile", "stock+ckpt", "tigon+ckpt",
                      "tigon+recompute+ckpt")
PROVIDER_TITLES = {
    "stock": "stock",
    "tigon": "tigon",
    "compile": "torch.compile(model)",
    "tigon+compile": "tigon + compile",
    "tigon+graphs": "tigon (cuda_graphs)",
    "liger": "Liger-Kernel",
    "liger+compile": "Liger + compile",
    "tigon+recompute": "tigon (recompute_norms)",
    "stock+ckpt": "stock + checkpointing",
    "tigon+ckpt": "tigon + checkpointing",
    "tigon+recompute+ckpt": "tigon (recompute_norms) + checkpointing",
}
BATCH = 4
BATCH_OVERRIDES = GPU_BATCH_OVERRIDES  # Gemma-2-2B-shaped: batch 2
SEQ = 2048
WARMUP = 3
STEPS = 5
LR = 1e-4
SEED = 0
OPTIMIZER_BYTES_PER_PARAM = 16  # fp32 weight + grad + two AdamW moments
GIB = 2**30
JOB_TIMEOUT_S = 420
CONTEXT_STEP = 2048
CONTEXT_START = 8192
CONTEXT_MAX = 131072
CONTEXT_STEPS = 2  # the second step's peak includes the AdamW moments the first one created
RESULT_MARK = "E2E-RESULT "
TRACE_FRAMES = 8  # innermost traceback frames a failed job reports (error_trace)
PROFILE_STEPS = 2  # profiled steps after the timed ones (a two-step trace is small)
TOP_KERNELS = 15
KERNEL_NAME_CHARS = 160  # kernel names are cut here in the report (C++ template names run to thousands)
OUT = Path(__file__).resolve().parent / "results"
# --memory-buys-speed: Llama-3.2-3B as published (rope scaling aside), batch 1 x MEMORY_SPEED_SEQ
LLAMA_3_2_3B = dict(
    vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
SHAPES = {"llama-3b": ("Llama-3.2-3B-shaped", LLAMA_3_2_3B)}
MEMORY_SPEED_SHAPE = "llama-3b"
MEMORY_SPEED_SEQ = 12288  # see the module docs
MEMORY_SPEED_PROVIDERS = ("stock", "stock+ckpt", "tigon", "tigon+recompute")
MEMORY_SPEED_WARMUP = 2
MEMORY_SPEED_STEPS = 3
MEMORY_SPEED_REFERENCE = "stock+ckpt"  # what the speed-ups are against


# ------------------------------------------------------------------------------------------- args


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", help=f"model_types (default: {' '.join(MODELS)}; "
                        "with --longest-context: llama)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS + OPTIONAL_PROVIDERS,
                        help="default: all of stock tigon compile tigon+compile, and liger when it imports; "
                        "with --longest-context: stock tigon")
    parser.add_argument("--batch", type=int, help=f"sequences per step (default {BATCH}; Gemma-2 2)")
    parser.add_argument("--seq", type=int, help=f"tokens per sequence (default {SEQ}; --memory-buys-speed "
                        f"{MEMORY_SPEED_SEQ})")
    parser.add_argument("--warmup", type=int, help=f"untimed steps (compilation, autotuning; default {WARMUP}, "
                        f"--memory-buys-speed {MEMORY_SPEED_WARMUP})")
    parser.add_argument("--steps", type=int, help=f"timed steps (default {STEPS}, --memory-buys-speed "
                        f"{MEMORY_SPEED_STEPS})")
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the JSON, markdown and plot")
    history.add_argument(parser)
    parser.add_argument("--timeout", type=int, default=JOB_TIMEOUT_S, help="seconds per (model, provider)")
    parser.add_argument("--longest-context", action="store_true",
                        help="find the longest trainable sequence at batch 1 instead")
    parser.add_argument("--memory-buys-speed", action="store_true",
                        help="Llama-3.2-3B-shaped at a length where stock needs checkpointing: stock + "
                        "checkpointing against tigon without")
    parser.add_argument("--find-seq", nargs="?", const="tigon", default=None, metavar="PROVIDER",
                        help="with --memory-buys-speed: first find the longest sequence PROVIDER (default "
                        "tigon) trains without running out of memory, and compare there")
    parser.add_argument("--context-start", type=int, default=CONTEXT_START, help="first length probed")
    parser.add_argument("--context-max", type=int, default=CONTEXT_MAX, help="longest length probed")
    parser.add_argument("--context-step", type=int, default=CONTEXT_STEP, help="lengths are multiples of it")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke test of the pipeline under Triton's interpreter (no real numbers)")
    parser.add_argument("--tiny", action="store_true", help="tiny configs instead of the published shapes")
    parser.add_argument("--profile", action="store_true",
                        help=f"after the timed steps, profile {PROFILE_STEPS} more: GPU time by kernel category")
    parser.add_argument("--worker", nargs="?", const="", default=None, metavar="READY_PATH",
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return args

    from tigon.patching import supported_models

    if args.longest_context and args.memory_buys_speed:
        parser.error("--longest-context and --memory-buys-speed are two modes: pick one")
    if args.find_seq is not None and not args.memory_buys_speed:
        parser.error("--find-seq belongs to --memory-buys-speed")
    speed = args.memory_buys_speed
    args.seq = args.seq if args.seq is not None else (MEMORY_SPEED_SEQ if speed else SEQ)
    args.warmup = args.warmup if args.warmup is not None else (MEMORY_SPEED_WARMUP if speed else WARMUP)
    args.steps = args.steps if args.steps is not None else (MEMORY_SPEED_STEPS if speed else STEPS)
    if speed and args.batch is None:
        args.batch = 1
    default_models = ("llama",) if args.longest_context or speed else MODELS
    args.models = list(args.models or default_models)
    unknown = sorted(set(args.models) - set(supported_models()))
    if unknown:
        parser.error(f"unknown model_type(s) {unknown}; supported: {supported_models()}")
    args.skipped = {}
    if args.providers is None:
        args.providers = (["stock", "tigon"] if args.longest_context else list(MEMORY_SPEED_PROVIDERS) if speed
                          else list(PROVIDERS))
    if any("liger" in p for p in args.providers) and not liger_available():
        args.skipped.update({p: "liger_kernel is not installed" for p in args.providers if "liger" in p})
        args.providers = [p for p in args.providers if "liger" not in p]
    for name in ("seq", "steps", "context_step", "context_start", "context_max"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.batch is not None and args.batch < 1:
        parser.error("--batch must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.profile and args.longest_context:
        parser.error("--profile profiles the throughput jobs, not --longest-context")
    if args.find_seq is not None and args.find_seq not in PROVIDERS + OPTIONAL_PROVIDERS:
        parser.error(f"--find-seq: unknown provider {args.find_seq!r}")
    return args


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def _vlm_module():
    """benchmarks/e2e_vlm.py, imported as this file is (a package module, or beside the script)."""
    try:
        from benchmarks import e2e_vlm
    except ImportError:
        import e2e_vlm
    return e2e_vlm


def batch_for(model_type: str, batch: int | None) -> int:
    e2e_vlm = _vlm_module()
    return batch if batch is not None else {**BATCH_OVERRIDES, **e2e_vlm.BATCH}.get(model_type, BATCH)


# MoE rows: a published MoE shape with fewer layers, so that it trains on one GPU (module docstring).
MOE_SHAPES = {
    "qwen3_moe": ("Qwen3-30B-A3B-shaped, 3 of 48 layers", dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=3,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )),
}


def model_spec(model_type: str, *, tiny: bool = False, shape: str | None = None):
    """The benchmark's model: the published shape ``tigon demo`` uses on a GPU (``MOE_SHAPES``' for a
    MoE family), or one of ``SHAPES`` (``shape``; its family's tiny config with ``tiny``)."""
    if model_type in MOE_SHAPES and not tiny:
        import copy

        import transformers

        from tigon.bench.models import ModelSpec

        label, moe_shape = MOE_SHAPES[model_type]
        return ModelSpec(model_type, label, transformers.AutoConfig.for_model(model_type, **copy.deepcopy(moe_shape)))
    spec = model_config(model_type, tiny=tiny)
    if shape is None or tiny:
        return spec
    label, keywords = SHAPES[shape]
    import copy

    config = copy.deepcopy(spec.config)
    for name, value in copy.deepcopy(keywords).items():
        setattr(config, name, value)
    return type(spec)(spec.model_type, label, config)


def jobs_for(args) -> list[dict]:
    shape = MEMORY_SPEED_SHAPE if getattr(args, "memory_buys_speed", False) else None
    return [
        {"model": m, "provider": p, "batch": batch_for(m, args.batch), "seq": args.seq,
         "warmup": args.warmup, "steps": args.steps, "device": args.device, "tiny": args.tiny,
         "profile_steps": PROFILE_STEPS if args.profile else 0, "shape": shape}
        for m in args.models
        for p in args.providers
    ]


# ---------------------------------------------------------------------------------------- profile

# Where a kernel's time goes: the first pattern (case-insensitive ``re.search``) that matches its
# name names its category. Order matters: flash-attention and fmha kernels have "cutlass" in their
# names, Inductor's kernels are named after the ops they fuse (``triton_red_fused__to_copy_add_mean_0``),
# Adam's functor is templated on ``false`` (hence ``lse`` only as a word), and a bare identifier (no C++
# namespace or template) left at the end is a Triton kernel: Triton names kernels after their Python
# functions (tigon's cross-entropy helpers are listed by name under "loss").
# On the CPU the names are operators and autograd functions (``aten::mm``, ``rms_norm_function``), hence
# the ``aten::`` entries.
KERNEL_CATEGORIES = (
    ("inductor fused", r"^triton_(poi|red|per)_"),
    ("attention", r"flash|fmha|sdpa|attention"),
    ("dequantize", r"dequantiz"),  # bitsandbytes' 4-bit bases (QLoRA), dequantized for their products
    ("matmul", r"gemm|gemv|cutlass|cublas|xmma|nvjet|wgmma|splitKreduce|^triton_tem_|^sum_round_tiles_kernel$"
               r"|^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$"),
    ("loss", r"cross_?entropy|nll_loss|log_?softmax|logsumexp|(?<![a-z])lse(?![a-z])|fused_linear"
             r"|element_mul_kernel|kl_?div|jsd|tvd|divergence|logprobs|^reduction_scales_kernel$|^scale_rows_kernel$"),
    ("norm", r"rms_?norm|layer_?norm|group_?norm|norm_join|GammaBeta|^partial_rows_sum_kernel$"),
    ("rope", r"(?<![a-z])m?rope(?![a-z])|rotary"),
    ("activation/glu", r"glu|gelu|silu|swish|relu"),
    ("optimizer", r"multi_tensor_apply|adam|_foreach_"),
    ("copy/cast", r"copy|memcpy|memset|CatArray|FillFunctor"),
    ("elementwise/reduce", r"elementwise|reduce|vectorized"),
    ("triton other", r"^\w+$"),
)
OTHER = "other"
CATEGORIES = tuple(name for name, _ in KERNEL_CATEGORIES) + (OTHER,)
_CATEGORY_PATTERNS = tuple((name, re.compile(pattern, re.IGNORECASE)) for name, pattern in KERNEL_CATEGORIES)


@functools.cache
def classify(kernel_name: str) -> str:
    """The category of ``KERNEL_CATEGORIES`` a kernel (or, on the CPU, an operator) belongs to."""
    return next((name for name, pattern in _CATEGORY_PATTERNS if pattern.search(kernel_name)), OTHER)


def summarise_profile(kernels, *, steps: int, wall_ms: float) -> dict:
    """Per-step device time by category, the busy total and the top kernels, from the profiled
    steps' ``(kernel name, microseconds)`` pairs; ``wall_ms`` is one step's wall time."""
    per_name = {}  # kernel name -> [microseconds, calls] over all profiled steps
    for name, us in kernels:
        total = per_name.setdefault(name, [0.0, 0])
        total[0] += us
        total[1] += 1
    categories = dict.fromkeys(CATEGORIES, 0.0)
    for name, (us, _) in per_name.items():
        categories[classify(name)] += us / 1e3 / steps
    busy_ms = sum(categories.values())
    top = sorted(per_name.items(), key=lambda item: item[1][0], reverse=True)[:TOP_KERNELS]
    return {
        "steps": steps, "busy_ms": busy_ms, "wall_ms": wall_ms, "busy_fraction": busy_ms / wall_ms,
        "categories": categories,
        "top_kernels": [{"name": name[:KERNEL_NAME_CHARS], "category": classify(name), "ms": us / 1e3 / steps,
                         "calls": calls / steps} for name, (us, calls) in top],
    }


def profiled_kernels(prof, cuda: bool) -> list[tuple[str, float]]:
    """``(name, microseconds)`` of every kernel, memcpy and memset the GPU ran (not the record_function
    ranges kineto mirrors onto the GPU timeline); on the CPU, every operator's self time (its time less
    its children's, so nothing is counted twice)."""
    from torch.autograd import DeviceType

    if cuda:
        return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    return [(e.name, e.self_cpu_time_total) for e in prof.events()
            if e.device_type == DeviceType.CPU and not e.is_async]


# ----------------------------------------------------------------------------------------- worker


def apply_liger(model_type: str) -> None:
    """Liger-Kernel's class-level patch for the family (before the model is built)."""
    import liger_kernel.transformers as liger

    apply = getattr(liger, f"apply_liger_kernel_to_{model_type}", None)
    if apply is None:
        raise ValueError(f"Liger-Kernel has no apply_liger_kernel_to_{model_type}")
    apply()


def graph_break_stats() -> dict:
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {"graph_breaks": sum(breaks.values()),
            "graph_break_reasons": [str(reason)[:200] for reason in list(breaks)[:5]],
            "unique_graphs": counters["stats"].get("unique_graphs", 0)}


def run_job(job: dict) -> dict:
    """Build, patch/compile, train ``warmup + steps`` steps; runs inside a fresh worker process.

    ``job["device"]`` and ``job["tiny"]`` exist so that the pipeline can be smoke-tested on a CPU;
    the benchmark itself runs the published shapes on the GPU.
    """
    import torch

    import tigon
    from tigon.bench.models import build_model, parameter_count

    e2e_vlm = _vlm_module()
    parts = set(job["provider"].split("+"))
    device = torch.device(job.get("device", "cuda"))
    cuda = device.type == "cuda"
    vision_language = job["model"] in e2e_vlm.SPECS  # a VLM row: e2e_vlm builds the model and its batches
    if vision_language:
        spec = e2e_vlm.model_spec(job["model"], tiny=job.get("tiny", False))
        vocab = spec.vocab_size
    else:
        spec = model_spec(job["model"], tiny=job.get("tiny", False), shape=job.get("shape"))
        vocab = spec.config.vocab_size
    out = {**job, "label": spec.label, "vocab": vocab,
           "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    if "liger" in parts:
        apply_liger(job["model"])
    torch.manual_seed(SEED)
    model = (e2e_vlm.build_model if vision_language else build_model)(spec.config, device=device)
    out["params"] = parameter_count(model)
    if "tigon" in parts:
        tigon.patch(model, cuda_graphs="graphs" in parts, recompute_norms="recompute" in parts)
    if "ckpt" in parts:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    step_model = torch.compile(model) if "compile" in parts else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=cuda)
    batch, seq, warmup, steps = job["batch"], job["seq"], job["warmup"], job["steps"]
    gen = torch.Generator(device=device).manual_seed(SEED)
    if vision_language:
        data = e2e_vlm.batches(spec, warmup + steps, batch, seq, device=device, generator=gen,
                               tiny=job.get("tiny", False))
    else:
        data = torch.randint(vocab, (warmup + steps, batch, seq), device=device, generator=gen)

    def train_step(ids) -> float:
        inputs = ids if vision_language else {"input_ids": ids, "labels": ids}
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # synchronises: the step time is the device's

    losses, seconds = [], []
    for step in range(warmup + steps):
        if step == warmup:
            wait_until_quiet(job.get("quiet_path"))
        if step == warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        losses.append(train_step(data[step]))
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds[warmup:])
    out.update(losses=losses, step_seconds=seconds, median_step_s=median, tokens_per_s=batch * seq / median)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        out.update(peak_bytes=peak, activation_bytes=peak - OPTIMIZER_BYTES_PER_PARAM * out["params"],
                   reserved_bytes=torch.cuda.max_memory_reserved())
    if "compile" in parts:
        out.update(graph_break_stats())
    if job.get("profile_steps"):
        batches = [data[warmup + i % steps] for i in range(job["profile_steps"])]  # the timed steps' data again
        try:
            out["profile"] = profile_steps(train_step, batches, cuda=cuda, timed_step_s=median)
        except Exception as exc:  # keep the timed result when only the profile fails
            out["profile_error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    return out


def profile_steps(train_step, batches, *, cuda: bool, timed_step_s: float) -> dict:
    """Train on ``batches`` under the profiler, after the timed steps (so it cannot disturb them)."""
    from torch.profiler import ProfilerActivity, profile

    # CPU activity on the GPU too: kernel events have gone missing from CUDA-only traces
    # (meta-pytorch/tritonbench#401); it slows the host, which profiled_wall_ms shows, not the kernels.
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # TIGON_PROFILE_STACK=1 records Python calls as host events too (the profiler's Python tracer), so
    # a gap during which the host ran plain Python (no aten op, no CUDA call) says which function. The
    # tracer slows the host a lot: on Gemma-2's compiled step (2026-11-23) it made its own gaps
    # (350 ms of idle a step) and hid the ones it was meant to explain; use it on short host gaps only.
    with profile(activities=activities, with_stack=os.environ.get("TIGON_PROFILE_STACK") == "1") as prof:
        start = time.perf_counter()
        for ids in batches:
            train_step(ids)
        profiled_s = time.perf_counter() - start
    summary = summarise_profile(profiled_kernels(prof, cuda), steps=len(batches), wall_ms=timed_step_s * 1e3)
    if cuda:
        summary["idle"] = idle_gaps(prof, steps=len(batches))
    return {**summary, "activity": "cuda" if cuda else "cpu", "profiled_wall_ms": profiled_s * 1e3 / len(batches)}


IDLE_GAP_US = 20.0  # a gap between two kernels longer than this is the GPU waiting on the host
TOP_GAPS = 8
# Host events that cover at least this fraction of a gap are what the host was doing meanwhile (a
# guard check, a custom op's Python, a synchronising read); longer than HOST_SPAN_MAX_US they span a
# whole phase (the compiled region, the step) and say nothing.
HOST_COVER_FRACTION = 0.3
HOST_SPAN_MAX_US = 10_000.0
TOP_HOST_EVENTS = 3


def idle_gaps(prof, *, steps: int) -> dict:
    """Where the GPU waited, in the profiled steps: the summed gaps between kernels (longer than
    IDLE_GAP_US) per step, and the longest gaps with the kernels on either side and the host events
    that ran through them (``host``: name and µs of the gap covered). The profiler slows the host, so
    the gaps are longer than in the timed steps; where they fall is what they show. Measured so on
    Gemma-2 with tigon + compile (2026-11-23): the 3.6 ms gap at each step's start was 1.4 ms of
    "TorchDynamo Cache Lookup" (the guards), against none worth listing for compile alone."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    gaps, end, last = [], None, None
    for start, stop, name in spans:
        if end is not None and start - end > IDLE_GAP_US:
            gaps.append((start - end, end, start, last, name))
        if end is None or stop > end:
            end, last = stop, name
    gaps.sort(reverse=True)
    host = [(e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type == DeviceType.CPU and e.time_range.end - e.time_range.start <= HOST_SPAN_MAX_US]
    return {
        "idle_ms": sum(g[0] for g in gaps) / 1e3 / steps, "gaps": len(gaps) / steps,
        "longest": [{"us": round(us, 1), "after": a[:KERNEL_NAME_CHARS], "before": b[:KERNEL_NAME_CHARS],
                     "host": _host_during(host, gap_start, gap_end)}
                    for us, gap_start, gap_end, a, b in gaps[:TOP_GAPS]],
    }


def _host_during(host, gap_start: float, gap_end: float) -> list:
    """The host events covering at least HOST_COVER_FRACTION of the gap, most covering first."""
    covering = []
    for start, stop, name in host:
        overlap = min(stop, gap_end) - max(start, gap_start)
        if overlap >= HOST_COVER_FRACTION * (gap_end - gap_start):
            covering.append((overlap, stop - start, name))
    # most covering first; of events covering as much, the shortest (the innermost of nested calls)
    covering.sort(key=lambda c: (-round(c[0]), c[1]))
    return [{"name": name[:KERNEL_NAME_CHARS], "us": round(overlap, 1)}
            for overlap, _span, name in covering[:TOP_HOST_EVENTS]]


def _is_oom(exc: BaseException) -> bool:
    import torch

    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


QUIET_TIMEOUT_S = 300


def wait_until_quiet(path: str | None) -> None:
    """Before the timed steps: wait until the spare worker has finished importing (it touches ``path``).

    The pool starts the next job's process while this one runs, so that its imports (torch,
    transformers, tigon: seconds of CPU) overlap this job's model build and warm-up. They must not
    overlap the timed steps: an eager step is bound by the host at some shapes (Qwen-0.5B), and a
    second busy process slowed it by up to a third.
    """
    if path is None:
        return
    deadline = time.perf_counter() + QUIET_TIMEOUT_S
    while not os.path.exists(path) and time.perf_counter() < deadline:
        time.sleep(0.05)


def error_trace(exc: BaseException, frames: int = TRACE_FRAMES) -> list[str]:
    """Where ``exc`` was raised: its traceback's innermost ``frames`` frames as ``folder/file.py:line function``,
    innermost last, so that a probe's error row says which library failed and where."""
    import traceback

    return [f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in traceback.extract_tb(exc.__traceback__)[-frames:]]


def worker_main(ready_path: str | None = None, run=None, imports: tuple[str, ...] = ()) -> int:
    """Import ``imports`` (first, in order: a library that patches transformers when it is imported, such as
    Unsloth, must come before it), then everything else, say so (``ready_path``), wait for one job on stdin,
    run it with ``run`` (this file's :func:`run_job` by default), print the result line."""
    import importlib

    for name in imports:
        importlib.import_module(name)

    import torch  # noqa: F401
    import transformers  # noqa: F401

    import tigon.patching  # noqa: F401  (imports tigon.ops)
    from tigon._interpreter import apply_interpreter_fixes

    apply_interpreter_fixes()  # --device cpu: the parent set TRITON_INTERPRET=1

    if ready_path:
        Path(ready_path).touch()
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # a spare worker nobody needed
    job = json.loads(line)
    started = time.perf_counter()
    try:
        result = (run or run_job)(job)
    except Exception as exc:  # an error is a result (e.g. a provider that cannot run this model)
        oom = _is_oom(exc)
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        message = "out of memory" if oom else f"{type(exc).__name__}: {first_line}"
        result = {**job, "error": message, "oom": oom, "trace": error_trace(exc)}
    result["wall_s"] = time.perf_counter() - started
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


# ----------------------------------------------------------------------------------------- parent


class Worker:
    """A worker process of ``script`` (a benchmark file whose ``--worker`` runs one job read from stdin),
    started early so that its imports overlap the job before it; ``env``: its environment (the parent's if
    None), and ``args``: more arguments after ``--worker READY_PATH``."""

    def __init__(self, script: str = __file__, env: dict | None = None, args: tuple[str, ...] = ()):
        self.stdout = tempfile.TemporaryFile(mode="w+")
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self._ready_dir = tempfile.TemporaryDirectory()
        self.ready_path = os.path.join(self._ready_dir.name, "imported")
        self.proc = subprocess.Popen([sys.executable, script, "--worker", self.ready_path, *args],
                                     stdin=subprocess.PIPE, stdout=self.stdout, stderr=self.stderr, text=True, env=env)

    def run(self, job: dict, timeout: int) -> dict:
        started = time.perf_counter()
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self._close_files()
            return {**job, "error": f"timed out after {timeout} s", "wall_s": time.perf_counter() - started}
        except BrokenPipeError:  # the worker died before reading its job
            self.proc.wait()
        self.stdout.seek(0)
        self.stderr.seek(0)
        lines, errors = self.stdout.read().splitlines(), self.stderr.read().strip().splitlines()
        self._close_files()
        for line in lines:
            if line.startswith(RESULT_MARK):
                return json.loads(line[len(RESULT_MARK):])
        return {**job, "error": f"worker exited with status {self.proc.returncode}: "
                f"{' | '.join(errors[-3:])[:400]}", "wall_s": time.perf_counter() - started}

    def _close_files(self) -> None:
        self.stdout.close()
        self.stderr.close()
        self._ready_dir.cleanup()

    def discard(self) -> None:
        """Stop an unused worker (it holds no GPU memory: it has only imported modules)."""
        self.proc.stdin.close()
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait()
        self._close_files()


class WorkerPool:
    """Runs jobs one at a time, each in a fresh process of ``script`` (``env`` and ``args``: :class:`Worker`'s),
    with the next process already warming up."""

    def __init__(self, timeout: int, script: str = __file__, env: dict | None = None, args: tuple[str, ...] = ()):
        self.timeout, self.script, self.env, self.args = timeout, script, env, args
        self.spare = Worker(script, env, args)

    def run(self, job: dict) -> dict:
        current, self.spare = self.spare, Worker(self.script, self.env, self.args)
        # The job times its steps only once the new spare has imported everything (wait_until_quiet).
        return current.run({**job, "quiet_path": self.spare.ready_path}, self.timeout)

    def close(self) -> None:
        self.spare.discard()


def throughput(args, log=print) -> dict:
    jobs = jobs_for(args)
    pool = WorkerPool(args.timeout)
    rows = []
    try:
        for job in jobs:
            row = pool.run(job)
            rows.append(row)
            log(row_line(row))
    finally:
        pool.close()
    add_loss_agreement(rows)
    return {"kind": "throughput", "rows": rows}


def add_loss_agreement(rows: list[dict], reference: str = "stock") -> None:
    """Per-step relative loss difference against the ``reference`` provider's run of the same model
    (same data)."""
    stock = {r["model"]: r for r in rows if r["provider"] == reference and "losses" in r}
    for row in rows:
        ref = stock.get(row["model"])
        if ref is None or "losses" not in row or row["provider"] == reference:
            continue
        row["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], ref["losses"],
                                                                            strict=True))


def memory_buys_speed(args, log=print) -> dict:
    """``--memory-buys-speed``: the throughput jobs of the 3B shape at ``args.seq`` (after finding it
    with ``--find-seq``), losses compared with stock + checkpointing's (stock runs out of memory)."""
    search = None
    if args.find_seq is not None:
        pool = WorkerPool(args.timeout)
        probes = []

        def probe(seq):
            job = {"model": args.models[0], "provider": args.find_seq, "batch": args.batch, "seq": seq,
                   "warmup": 0, "steps": CONTEXT_STEPS, "device": args.device, "tiny": args.tiny,
                   "shape": MEMORY_SPEED_SHAPE}
            result = pool.run(job)
            probes.append({k: result.get(k) for k in ("seq", "error", "oom", "peak_bytes", "wall_s", "trace")})
            log(row_line(result))
            return "error" not in result

        try:
            longest, first_fail = search_longest(probe, step=args.context_step, start=args.context_start,
                                                 maximum=args.context_max)
        finally:
            pool.close()
        search = {"provider": args.find_seq, "longest_seq": longest, "first_failure": first_fail,
                  "probes": probes}
        if not longest:
            return {"kind": "memory_speed", "rows": [], "search": search, "reference": MEMORY_SPEED_REFERENCE}
        args.seq = longest
    result = throughput(args, log)
    for row in result["rows"]:
        row.pop("max_loss_rel_diff", None)  # throughput's, against stock
    add_loss_agreement(result["rows"], reference=MEMORY_SPEED_REFERENCE)
    return {**result, "kind": "memory_speed", "search": search, "reference": MEMORY_SPEED_REFERENCE}


def search_longest(probe, *, step: int, start: int, maximum: int):
    """Largest multiple of ``step`` in [step, maximum] for which ``probe(seq)`` is True, assuming
    success is monotone in the length: doubling from ``start``, then bisection. Returns
    (longest or 0, first failing length or None)."""
    top = maximum // step
    k = max(1, min(start // step, top))
    lo, hi = 0, None
    while hi is None:
        if probe(k * step):
            lo = k
            if k == top:
                break
            k = min(2 * k, top)
        else:
            hi = k
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid * step):
            lo = mid
        else:
            hi = mid
    return lo * step, (hi * step if hi is not None else None)


def longest_context(args, log=print) -> dict:
    pool = WorkerPool(args.timeout)
    rows = []
    try:
        for model in args.models:
            for provider in args.providers:
                probes = []

                def probe(seq, model=model, provider=provider, probes=probes):
                    job = {"model": model, "provider": provider, "batch": 1, "seq": seq, "warmup": 0,
                           "steps": CONTEXT_STEPS, "device": args.device, "tiny": args.tiny}
                    result = pool.run(job)
                    probes.append({k: result.get(k) for k in ("seq", "error", "oom", "peak_bytes", "wall_s",
                                                               "tokens_per_s", "device", "label", "trace")})
                    log(row_line(result))
                    return "error" not in result

                longest, first_fail = search_longest(probe, step=args.context_step, start=args.context_start,
                                                     maximum=args.context_max)
                failures = [p for p in probes if p["seq"] == first_fail]
                rows.append({
                    "model": model, "provider": provider, "longest_seq": longest, "first_failure": first_fail,
                    "failure": failures[0]["error"] if failures else None,
                    "peak_bytes_at_longest": next((p["peak_bytes"] for p in probes if p["seq"] == longest),
                                                  None),
                    "label": next((p["label"] for p in probes if p.get("label")), model),
                    "device": next((p["device"] for p in probes if p.get("device")), None),
                    "probes": probes,
                })
    finally:
        pool.close()
    return {"kind": "longest_context", "rows": rows, "context_max": args.context_max}


# ----------------------------------------------------------------------------------------- output


def _si(value) -> str:
    return "—" if value is None else f"{value / 1e3:.1f}k"


def _gib(value) -> str:
    return "—" if value is None else f"{value / GIB:.1f}"


def row_line(row: dict) -> str:
    head = f"{row['model']:>8} {row['provider']:<14} batch {row['batch']} x {row['seq']:<6}"
    if "error" in row:
        return f"{head} ERROR {row['error']}  ({row.get('wall_s', 0):.0f} s)"
    extra = f"  graph breaks {row['graph_breaks']}" if "graph_breaks" in row else ""
    return (f"{head} {_si(row['tokens_per_s']):>7} tok/s  peak {_gib(row.get('peak_bytes'))} GiB  "
            f"activations {_gib(row.get('activation_bytes'))} GiB{extra}  ({row['wall_s']:.0f} s)")


def _model_title(row: dict) -> str:
    return f"{row.get('label', row['model'])} (V={row['vocab']}), batch {row['batch']} x {row['seq']}"


def _headline_cell(row: dict | None, stock: dict | None) -> str:
    if row is None:
        return "—"
    if "error" in row:
        return "OOM" if row.get("oom") else "fails"
    speed = ""
    if stock and "tokens_per_s" in stock:
        speed = f" ({row['tokens_per_s'] / stock['tokens_per_s']:.2f}x)"
    return f"{_si(row['tokens_per_s'])}{speed}, {_gib(row.get('activation_bytes'))} GiB"


def _ms(value) -> str:
    return "—" if value is None else f"{value:.1f}"


def profile_markdown(rows: list[dict], *, top_kernels: bool = True, titles: dict | None = None) -> list[str]:
    """The "where the time goes" section: per model, categories x providers in ms per step, then
    (``top_kernels``) each provider's most expensive kernels; ``titles``: provider -> its column title
    (default PROVIDER_TITLES)."""
    titles = PROVIDER_TITLES if titles is None else titles
    profiled = [r for r in rows if "profile" in r or "profile_error" in r]
    if not profiled:
        return []
    lines = ["", "## Where the time goes (ms of GPU time per step)", "",
             f"Kernel time summed by category (`KERNEL_CATEGORIES` in benchmarks/e2e.py) over "
             f"{profiled[0]['profile_steps']} profiled steps after the timed ones, per step. GPU busy: all "
             "kernels; busy / wall below 1 means the GPU waited for the host (wall: the timed median step)."]
    if any(r.get("profile", {}).get("activity") == "cpu" for r in profiled):
        lines.append("On the CPU these are operators' self CPU times (the interpreter runs Triton kernels on "
                     "the host): a test of the pipeline, not a profile.")
    for model in dict.fromkeys(r["model"] for r in profiled):
        model_rows = [r for r in rows if r["model"] == model]
        profiles = {r["provider"]: r.get("profile") for r in model_rows}
        used = [c for c in CATEGORIES if any(p and p["categories"].get(c) for p in profiles.values())]
        table_rows = [(c, lambda p, c=c: _ms(p["categories"].get(c, 0.0))) for c in used] + [
            ("**GPU busy**", lambda p: f"**{_ms(p['busy_ms'])}**"),
            ("step wall", lambda p: _ms(p["wall_ms"])),
            ("busy / wall", lambda p: f"{p['busy_fraction']:.2f}"),
        ]
        title = _model_title(model_rows[0]) if "vocab" in model_rows[0] else model
        lines += ["", f"### {title}", "",
                  "| ms per step | " + " | ".join(titles[p] for p in profiles) + " |",
                  "| --- |" + " --- |" * len(profiles)]
        for label, cell in table_rows:
            lines.append(f"| {label} | " + " | ".join("—" if p is None else cell(p) for p in profiles.values())
                         + " |")
        failed = [f"{r['provider']} ({r['profile_error']})" for r in model_rows if "profile_error" in r]
        if failed:
            lines += ["", "Profile failed: " + ", ".join(failed) + "."]
        if not top_kernels:
            continue
        for provider, prof in profiles.items():
            if prof is None:
                continue
            lines += ["", f"Top kernels, {model}, {titles[provider]}:", "",
                      "| ms per step | calls per step | category | kernel |", "| --- | --- | --- | --- |"]
            lines += [f"| {k['ms']:.2f} | {k['calls']:g} | {k['category']} | `{k['name'].replace('|', '/')}` |"
                      for k in prof["top_kernels"]]
    return lines


def memory_speed_markdown(result: dict) -> list[str]:
    """The --memory-buys-speed table: each provider's tokens/s against stock + checkpointing's."""
    rows, reference = result["rows"], result["reference"]
    search = result.get("search")
    lines = []
    if search is not None:
        lines.append(f"Longest sequence {PROVIDER_TITLES[search['provider']]} trains (two steps, batch "
                     f"{result['settings']['batch']}): {search['longest_seq'] or 'none'} (first failure: "
                     f"{search['first_failure'] or '—'}).")
    if not rows:
        return lines
    first = next((r for r in rows if r.get("label")), rows[0])  # a row that built its model names it
    ref = next((r for r in rows if r["provider"] == reference and "tokens_per_s" in r), None)
    lines += [f"{first.get('label', first['model'])} (V={first.get('vocab', '?')}), batch {first['batch']} x "
              f"{first['seq']}, bf16 autocast, sdpa, fused AdamW, fp32 weights; median of "
              f"{result['settings']['steps']} steps after {result['settings']['warmup']} warm-up steps, each "
              f"provider in a fresh process.", "",
              f"| provider | tokens/s | x {PROVIDER_TITLES[reference]} | step ms | peak GiB | max loss rel. diff "
              f"vs {reference} |", "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        title = PROVIDER_TITLES[row["provider"]]
        if "error" in row:
            lines.append(f"| {title} | {'out of memory' if row.get('oom') else row['error']} | — | — | — | — |")
            continue
        speed = f"{row['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref else "—"
        diff = f"{row['max_loss_rel_diff']:.1e}" if "max_loss_rel_diff" in row else "—"
        lines.append(f"| {title} | {row['tokens_per_s']:.0f} | {speed} | {row['median_step_s'] * 1e3:.1f} | "
                     f"{_gib(row.get('peak_bytes'))} | {diff} |")
    stock = next((r for r in rows if r["provider"] == "stock"), None)
    if stock is not None:
        lines += ["", "Premise (stock needs checkpointing here): " + (
            "holds, stock without checkpointing runs out of memory." if stock.get("oom") else
            "does not hold, stock trains without checkpointing at this length: pick a longer --seq."
            if "error" not in stock else f"stock failed otherwise ({stock['error']}).")]
    return lines


def markdown(result: dict, *, top_kernels: bool = True) -> str:
    settings = result["settings"]
    lines = [f"# tigon end-to-end training — {result['device']} — {result['date']}", "",
             f"Versions: {', '.join(f'{k} {v}' for k, v in result['versions'].items() if v)}."]
    if result["kind"] == "memory_speed":
        return "\n".join(lines + memory_speed_markdown(result)) + "\n"
    if result["kind"] == "longest_context":
        lines += [
            f"Longest sequence that trains two AdamW steps at batch 1 (bf16 autocast, sdpa, fused AdamW), "
            f"in steps of {settings['context_step']} up to {settings['context_max']}.", "",
            "| model | provider | longest trained | first failure | peak GiB at longest |",
            "| --- | --- | --- | --- | --- |",
        ]
        for row in result["rows"]:
            fail = "—" if row["first_failure"] is None else f"{row['first_failure']} ({row['failure']})"
            longest = row["longest_seq"] or "none"
            lines.append(f"| {row['label']} | {PROVIDER_TITLES[row['provider']]} | {longest} | {fail} | "
                         f"{_gib(row['peak_bytes_at_longest'])} |")
        return "\n".join(lines) + "\n"

    lines.append(
        f"Random-init models, bf16 autocast, sdpa attention, fused AdamW; median of {settings['steps']} "
        f"steps after {settings['warmup']} warm-up steps, each provider in a fresh process. "
        "Cells: tokens/s (x stock), activation memory = peak − 16 B × params."
    )
    if settings.get("skipped"):
        lines.append("Not run: " + ", ".join(f"{p} ({why})" for p, why in settings["skipped"].items()) + ".")
    rows = result["rows"]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))

    def find(model, provider):
        return next((r for r in rows if r["model"] == model and r["provider"] == provider), None)

    lines += ["", "| model | " + " | ".join(PROVIDER_TITLES[p] for p in providers) + " |",
              "| --- |" + " --- |" * len(providers)]
    for model in models:
        stock = find(model, "stock")
        first = next(r for r in rows if r["model"] == model)
        title = _model_title(first) if "vocab" in first else model
        cells = [_headline_cell(find(model, p), stock) for p in providers]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines += ["", "| model | provider | tokens/s | step ms | peak GiB | activation GiB "
              "| max loss rel. diff vs stock | graph breaks | note |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['provider']} | — | — | — | — | — | — | {row['error']} |")
            continue
        diff = f"{row['max_loss_rel_diff']:.1e}" if "max_loss_rel_diff" in row else "—"
        lines.append(
            f"| {row['model']} | {row['provider']} | {row['tokens_per_s']:.0f} | "
            f"{row['median_step_s'] * 1e3:.1f} | {_gib(row.get('peak_bytes'))} | "
            f"{_gib(row.get('activation_bytes'))} | {diff} | "
            f"{row.get('graph_breaks', '—')} | |"
        )
    lines += profile_markdown(rows, top_kernels=top_kernels)
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    if result["kind"] == "longest_context":
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [f"{r['model']}\n{PROVIDER_TITLES[r['provider']]}" for r in rows]
        values = [r["longest_seq"] / 1024 for r in rows]
        ax.bar(labels, values, color=[_colour(r["provider"]) for r in rows])
        for x, v in enumerate(values):
            ax.text(x, v, f"{v:.0f}K", ha="center", va="bottom")
        ax.set_ylabel("longest trainable sequence (K tokens), batch 1")
        ax.set_title(f"longest context — {result['device']}")
    else:
        models = list(dict.fromkeys(r["model"] for r in rows))
        providers = list(dict.fromkeys(r["provider"] for r in rows))
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
        width = 0.8 / max(1, len(providers))
        panels = ((axes[0], "tokens_per_s", 1e3, "k tokens/s"),
                  (axes[1], "activation_bytes", GIB, "activation GiB (peak − 16 B × params)"))
        for ax, key, scale, ylabel in panels:
            for i, provider in enumerate(providers):
                xs, ys = [], []
                for j, model in enumerate(models):
                    row = next((r for r in rows if r["model"] == model and r["provider"] == provider), None)
                    if row is not None and key in row:
                        xs.append(j + i * width)
                        ys.append(row[key] / scale)
                if ys:
                    ax.bar(xs, ys, width, label=PROVIDER_TITLES[provider], color=_colour(provider))
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))])
            ax.set_xticklabels(models)
            ax.set_ylabel(ylabel)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.suptitle(f"end-to-end training — {result['device']} — {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _colour(provider: str) -> str:
    return {"stock": "tab:gray", "tigon": "tab:orange", "compile": "tab:blue", "tigon+compile": "tab:red",
            "liger": "tab:green", "liger+compile": "tab:olive", "tigon+graphs": "tab:purple",
            "tigon+recompute": "tab:brown", "stock+ckpt": "tab:cyan", "tigon+ckpt": "tab:pink",
            "tigon+recompute+ckpt": "tab:pink"}[provider]


# The history file's name of each mode (tigon.bench.history).
BENCHMARKS = {"throughput": "e2e", "longest_context": "e2e-context", "memory_speed": "e2e-memory-speed"}


def write_result(result: dict, out_dir: Path, kind: str, to_markdown, to_plot=None, log=print) -> list[Path]:
    """``<kind>-<device>-<date>.json`` and ``.md`` (and ``.png`` with ``to_plot``, where matplotlib is installed)
    in ``out_dir``: what every benchmark script here writes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{kind}-{result['device'].replace(' ', '-')}-{result['date']}"
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps(result, indent=1))
    paths[1].write_text(to_markdown(result))
    if to_plot is not None:
        try:
            to_plot(result, out_dir / f"{stem}.png")
            paths.append(out_dir / f"{stem}.png")
        except ImportError:
            log("matplotlib not installed: no plot written (pip install 'tigon[demo]')")
    return paths


def check_same_kind(path, other: dict, reference: dict, same: tuple, whose: str = "this run's") -> None:
    """A ValueError naming ``path`` unless the run ``other`` is of ``reference``'s kind, on its device, with the
    same settings named in ``same`` (``whose``: how the message names the reference's)."""
    if other.get("kind") != reference.get("kind") or other.get("device") != reference.get("device"):
        raise ValueError(f"{path}: a {other.get('kind')} run on {other.get('device')}, not a "
                         f"{reference.get('kind')} run on {reference.get('device')}")
    for name in same:
        if other["settings"].get(name) != reference["settings"].get(name):
            raise ValueError(f"{path}: its {name} is {other['settings'].get(name)!r}, {whose} "
                             f"{reference['settings'].get(name)!r}")


def merge_runs(result: dict, earlier, *, key, same: tuple, fields: tuple = ("rows",)) -> None:
    """Rows of earlier runs (their result JSON files, ``earlier``) join ``result``'s, for one page made by several
    runs (a benchmark too long for one GPU job, split by provider or model): the earlier rows first, a row
    of this run replacing an earlier one with the same ``key(row)``, and of earlier rows with one key the first
    file's. Each list named in ``fields`` merges so (a file without it adds none). The runs must be of the same
    kind, on the same device, with the same settings named in ``same``: a ValueError names the first that differs.
    ``result["merged"]`` lists the files."""
    others = []
    for path in earlier:
        other = json.loads(Path(path).read_text())
        check_same_kind(path, other, result, same)
        others.append(other)
    for field in fields:
        mine = {key(row) for row in result.get(field, [])}
        kept, seen = [], set()
        for row in (row for other in others for row in other.get(field, [])):
            if key(row) not in mine and key(row) not in seen:
                kept.append(row)
                seen.add(key(row))
        result[field] = kept + result.get(field, [])
    result["merged"] = [str(path) for path in earlier]


def save(result: dict, out_dir: Path, log=print) -> list[Path]:
    kind = {"longest_context": "e2e-context", "memory_speed": "e2e-memory-speed"}.get(result["kind"], "e2e")
    return write_result(result, out_dir, kind, markdown, plot, log)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker or None)
    import torch

    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # inherited by the workers, before they import tigon.ops
    elif not torch.cuda.is_available():
        print("benchmarks/e2e.py needs a CUDA GPU and this machine has none (--device cpu --tiny runs a "
              "smoke test of the pipeline).", file=sys.stderr)
        return 2
    from tigon.bench.harness import versions

    started = time.perf_counter()
    if args.longest_context:
        result = longest_context(args)
    else:
        result = memory_buys_speed(args) if args.memory_buys_speed else throughput(args)
    devices = [r.get("device") for r in result["rows"]] + [p.get("device") for r in result["rows"]
                                                             for p in r.get("probes", [])]
    # A job that failed before its model was built reports the bare --device ("cuda"): the name of the
    # card comes from a job that ran (the parent never touches the GPU, whose memory the probes measure).
    named = [d for d in devices if d and d not in ("cuda", "cpu")]
    result.update(
        device=next(iter(named), next((d for d in devices if d), "unknown-GPU")),
        date=_dt.date.today().isoformat(),
        versions=versions(),
        settings={"models": args.models, "providers": args.providers, "skipped": args.skipped,
                  "tiny": args.tiny, "device": args.device, "batch": args.batch, "seq": args.seq,
                  "warmup": args.warmup, "steps": args.steps, "context_step": args.context_step,
                  "context_max": args.context_max, "lr": LR, "seed": SEED,
                  "env": {k: v for k, v in os.environ.items() if k.startswith("PYTORCH_CUDA")}},
        wall_s=time.perf_counter() - started,
    )
    paths = save(result, args.out)
    print(f"\nwrote {', '.join(str(p) for p in paths)} ({result['wall_s']:.0f} s)\n")
    target = history.script_path(args)
    if target is not None:
        history.append(result, benchmark=BENCHMARKS[result["kind"]], path=target)
        print(f"appended the run to {target}\n")
    print(markdown(result, top_kernels=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
