"""LoRA and QLoRA fine-tuning steps on a GPU: stock PEFT, tigon on the PeftModel, and Liger-Kernel with PEFT.

    python benchmarks/lora.py                              # Llama-3.1-8B-shaped, 8 of its 32 layers (~5 min, H200)
    python benchmarks/lora.py --layers 32 --providers peft+ckpt tigon+ckpt
    python benchmarks/lora.py --providers peft+4bit tigon+4bit             # QLoRA
    python benchmarks/lora.py --device cpu --tiny --warmup 0 --steps 1    # pipeline smoke test (CPU)

What is measured. A Llama-3.1-8B-shaped model (hidden 4096, intermediate 14336, 32 query / 8 key-value
heads of 128, vocabulary 128256, untied head; rope scaling aside, which changes no cost) with
``--layers`` of its 32 decoder layers (default 8: the step's time and memory scale with the layers,
the head's aside), random weights in bf16 (``--weights``), sdpa attention. PEFT's
``get_peft_model`` with ``LoraConfig(r=16, lora_alpha=32, lora_dropout=0, target_modules=`` the seven
projections ``)``: fp32 adapters (PEFT's ``autocast_adapter_dtype``), the base frozen. Every weight
is drawn from a generator seeded by its name, so every provider trains the same model; B is random
(not PEFT's zeros), so that both adapter gradients count from the first step. A step at batch 2 x
4096 random tokens (``--batch``, ``--seq``)::

    with torch.autocast("cuda", dtype=torch.bfloat16):   # as HF Trainer / TRL with bf16=True
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)   # fused AdamW, adapters only
    loss.item()                                           # synchronises

timed on the host: the median of ``--steps`` (3) after ``--warmup`` (2, which compile tigon's kernels).

Providers: ``peft`` (stock transformers + PEFT), ``tigon`` (``tigon.patch`` on the PeftModel),
``liger`` (Liger-Kernel's ``apply_liger_kernel_to_llama()`` before the model is built: its RMSNorm,
rope, SwiGLU and fused linear cross-entropy, PEFT's LoRA forwards), each also with ``+ckpt``:
transformers' gradient checkpointing (non-reentrant) on every decoder layer; ``tigon+ckpt+kept`` adds
``keep_attention=True`` (the recompute takes the attention kernel's outputs of the forward back),
``tigon+ckpt+offload`` (also ``+4bit``) ``offload_activations=True`` (each layer's checkpointed input waits in
pinned host memory, as Unsloth's offloaded checkpointing keeps it).
QLoRA: ``peft+4bit``, ``tigon+4bit`` and ``liger+4bit`` (each also ``+ckpt``) train the same model with its decoder
projections bitsandbytes 4-bit (:func:`tigon.bench.models.quantize_4bit`: nf4, double quant, bf16 compute,
what ``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16))`` makes, quantized from the same bf16
weights) after ``peft.prepare_model_for_kbit_training`` (fp32 norms, embeddings and head; its checkpointing left to
``+ckpt``), compared with ``peft+4bit``; with ``--kbit-rest bf16`` the norms, embeddings and head stay bf16 (no
``prepare_model_for_kbit_training``), as Unsloth's 4-bit loader keeps them. ``unsloth`` (also ``+4bit``,
``+ckpt``): Unsloth's ``FastLanguageModel`` on the same weights, saved and loaded through its ``from_pretrained``
(4-bit: its nf4 load of them), its LoRA on the same projections, ``+ckpt`` its offloaded checkpointing
(``use_gradient_checkpointing="unsloth"``); it runs where ``--unsloth-site`` holds Unsloth and its pinned
requirements (benchmarks/unsloth_models.py) and is left out of the default providers otherwise. Each runs in a
fresh process (benchmarks/e2e.py's worker pool).

Reported: tokens/s; achieved TFLOP/s, the model's flops a step over the median step time, against a
bf16 ``--matmul-size``³ matmul timed in the same process (the rate the device's large products reach);
peak allocated memory over the timed steps; agreement with an fp32 reference: the relative difference of
the first step's loss, and ‖g − g_fp32‖ / ‖g_fp32‖ of all adapter gradients of the first step, concatenated.
The reference (``peft+fp32``; ``peft+4bit+fp32`` on 4-bit bases) is stock PEFT computing the same model in
fp32: fp32 base weights holding the values the providers' bases hold (drawn, rounded to ``--weights``, cast),
fp32 adapters, no autocast (4-bit: the same nf4 weights, bitsandbytes' compute dtype fp32), the same data; one
untimed step, checkpointed (recomputing gives the same values and keeps fp32 activations within the device's
memory). A run adds it for each kind of bases (plain, 4-bit) whose stock PEFT run it makes; it is no row of the
table and no ``--providers`` choice. Through a whole bf16 model rounding moves the gradients further than one
op's bound, and two exact implementations that round differently are about as far from each other as each is
from fp32; so a row is judged by its distance from fp32 next to stock PEFT's own. It agrees when its first loss
is within BF16_TOLERANCE (3e-2, the ops' bf16 bound in docs/api/README.md) of fp32's and its gradients within
max(BF16_TOLERANCE, PEFT_SLACK (1.25) × stock PEFT's bf16 gradients' distance from fp32's) (:func:`agrees`).
Where stock PEFT's bf16 run gives no distance (it ran out of memory, or was not asked for) while the fp32
reference ran, its distance comes from the newest record in the checkout's history file with the same model,
data and reference (:func:`peft_distances_from`), marked † on the page with the record named.

Model flops a step (:func:`step_flops`), N = batch·seq tokens, L layers, H hidden, T = seq::

    P_base = L·(H·q + 2·H·kv + q·H + 3·H·I) + V·H  the frozen linear weights a token passes through
                                                  (q = heads·head_dim, kv = kv_heads·head_dim: the four
                                                  attention projections, the MLP's three, the head)
    base       = 2·N·P_base (forward) + 2·N·P_base (backward, input gradients only: the base is frozen)
    adapters   = 3 · 2·N·Σ r·(in + out)           forward x Aᵀ, (x Aᵀ) Bᵀ; backward twice that (dA, dB
                                                  and the input gradient)
    attention  = 3 · 4·N·T·q·L                    Q Kᵀ and P V over the full T×T square forward (PaLM's
                                                  convention: causal attention computes about half),
                                                  the backward twice the forward

The recomputed forward under checkpointing is not counted (it is the same model's work done twice),
nor the norms, rotary, activation, softmax and optimizer, nor QLoRA's dequantizations.

Profile (``--profile``): after its timed steps, each job trains ``e2e.PROFILE_STEPS`` more under
``torch.profiler`` and the page gets benchmarks/e2e.py's "where the time goes" section: GPU time per step
by kernel category (matmul, attention, 4-bit dequantization, norm, ...), busy / wall, the top kernels; what
a target missed is explained from.

A run too long for one GPU job is split by provider, each part with the stock PEFT run it is compared with
(``peft`` or ``peft+4bit``, which brings its fp32 reference), and ``--merge`` gives the later part the earlier
parts' result files: one page with every row (a provider measured again replaces its earlier row; an earlier
row keeps the agreement it was given in its own run).

Results: ``--out`` (default benchmarks/results/) gets ``lora-<device>-<date>.{json,md}``, and one line
goes to ``benchmarks/results/history.jsonl`` (``--history PATH``; none for a smoke run); the markdown
is printed last.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is on the path, the repository is not
    sys.path.insert(0, str(ROOT))

from benchmarks import e2e, unsloth_models  # noqa: E402  (worker pool, OOM detection, formatting; Unsloth)
from tigon.bench import history  # noqa: E402
from tigon.bench.models import quantize_4bit  # noqa: E402

# Llama-3.1-8B as published (rope scaling aside)
LLAMA_3_1_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
TINY = dict(vocab_size=160, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROVIDERS = ("peft", "tigon", "liger", "peft+ckpt", "tigon+ckpt", "tigon+ckpt+kept", "tigon+ckpt+offload",
             "liger+ckpt", "peft+4bit", "tigon+4bit", "liger+4bit", "peft+4bit+ckpt", "tigon+4bit+ckpt",
             "tigon+4bit+ckpt+offload", "liger+4bit+ckpt")
UNSLOTH_PROVIDERS = ("unsloth", "unsloth+ckpt", "unsloth+4bit", "unsloth+4bit+ckpt")
PROVIDER_TITLES = {"peft": "stock PEFT", "tigon": "tigon.patch(PeftModel)", "liger": "Liger-Kernel + PEFT",
                   "unsloth": "Unsloth"}
VARIANT_TITLES = {"4bit": " on 4-bit nf4 bases (QLoRA)", "ckpt": " + checkpointing", "kept": " + kept attention",
                  "offload": " + offloaded activations",
                  "fp32": " in fp32"}
REFERENCE = "peft"
FP32 = "fp32"  # the variant of REFERENCE that is the fp32 reference (added by the run, not a --providers choice)
LAYERS = 8
BATCH = 2
SEQ = 4096
TINY_SEQ = 16
RANK = 16
ALPHA = 32
WARMUP = 2
STEPS = 3
LR = 1e-4
SEED = 0
WEIGHT_STD = 0.02
MATMUL_SIZE = 8192
TINY_MATMUL_SIZE = 128
MATMUL_REPS = 20
JOB_TIMEOUT_S = 300
BF16_TOLERANCE = 3e-2  # docs/api/README.md's bf16 bound: on the first loss, and the least bound on the gradients
# How much further from fp32 a row's adapter gradients may be than stock PEFT's bf16 run's: bf16 rounding through
# a whole model, not one op, sets their distance, and an exact implementation rounds differently, not less.
PEFT_SLACK = 1.25
RESULT_MARK = e2e.RESULT_MARK  # e2e.Worker.run reads the result line by it


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=LAYERS, help="decoder layers of the 32 (default %(default)s)")
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--seq", type=int, default=None, help=f"tokens a row (default {SEQ}; {TINY_SEQ} with --tiny)")
    p.add_argument("--rank", type=int, default=RANK)
    p.add_argument("--alpha", type=float, default=ALPHA)
    p.add_argument("--providers", nargs="+", default=None, choices=PROVIDERS + UNSLOTH_PROVIDERS,
                   metavar="PROVIDER", help=f"of {', '.join(PROVIDERS + UNSLOTH_PROVIDERS)} (default: all; Unsloth's "
                   "where --unsloth-site holds it)")
    p.add_argument("--unsloth-site", type=Path, default=Path(unsloth_models.SITE),
                   help="a folder with Unsloth and its pinned requirements, put first on its workers' PYTHONPATH "
                   "(default %(default)s)")
    p.add_argument("--weights", choices=("bf16", "fp32"), default="bf16", help="the base weights' dtype")
    p.add_argument("--kbit-rest", choices=("fp32", "bf16"), default="fp32",
                   help="QLoRA: the norms, embeddings and head in fp32 (peft.prepare_model_for_kbit_training, as "
                        "TRL prepares a 4-bit model; the default) or left bf16 (as Unsloth's loader keeps them)")
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--matmul-size", type=int, default=None,
                   help=f"the reference matmul's size (default {MATMUL_SIZE}; {TINY_MATMUL_SIZE} with --tiny)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama (pipeline smoke test)")
    p.add_argument("--timeout", type=int, default=JOB_TIMEOUT_S, help="seconds per job")
    p.add_argument("--merge", nargs="+", type=Path, default=[], metavar="JSON",
                   help="earlier runs' result files whose rows join this run's page (a run split over GPU jobs)")
    p.add_argument("--profile", action="store_true",
                   help=f"after the timed steps, profile {e2e.PROFILE_STEPS} more: GPU time by kernel category")
    p.add_argument("--out", type=Path, default=e2e.OUT, help="folder for the JSON and markdown")
    history.add_argument(p)
    args = p.parse_args(argv)
    if args.seq is None:
        args.seq = TINY_SEQ if args.tiny else SEQ
    for name in ("layers", "batch", "seq", "rank", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.matmul_size is None:
        args.matmul_size = TINY_MATMUL_SIZE if args.tiny else MATMUL_SIZE
    if args.providers is None:
        has_unsloth = (args.unsloth_site / "unsloth" / "__init__.py").is_file()
        args.providers = list(PROVIDERS + (UNSLOTH_PROVIDERS if has_unsloth else ()))
    if len(set(args.providers)) != len(args.providers):
        p.error("--providers: each at most once")
    return args


def is_reference(provider: str) -> bool:
    """Whether ``provider`` is an fp32 reference (one untimed step, no row of the table)."""
    return FP32 in provider.split("+")


def shape(job: dict) -> dict:
    """The config keywords of the job's model."""
    base = {**LLAMA_3_1_8B, **TINY} if job["tiny"] else dict(LLAMA_3_1_8B)
    return {**base, "num_hidden_layers": job["layers"]}


def step_flops(shape: dict, *, batch: int, seq: int, rank: int, targets=TARGETS) -> dict:
    """The model's flops in one LoRA training step (module docs), by term."""
    tokens = batch * seq
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    projections = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                   "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    base_params = layers * sum(i * o for i, o in projections.values()) + shape["vocab_size"] * hidden
    adapter_width = layers * sum(i + o for name, (i, o) in projections.items() if name in targets)
    out = {"base": 2 * 2 * tokens * base_params,
           "adapters": 3 * 2 * tokens * rank * adapter_width,
           "attention": 3 * 4 * tokens * seq * q * layers}
    out["total"] = sum(out.values())
    return out


# ----------------------------------------------------------------------------------------- worker


def matmul_tflops(device, size: int) -> float:
    """TFLOP/s of a bf16 ``size``³ matmul (median of MATMUL_REPS after a warm-up), on this device."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    times = []
    for i in range(MATMUL_REPS + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e12


def init_by_name(model, names=None) -> None:
    """Every parameter (of ``names``, else all) drawn from a generator seeded by its name: matrices
    normal(0, WEIGHT_STD), vectors (norm weights) ones; the same values for every provider."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if names is not None and name not in names:
                continue
            if p.dim() == 1:
                p.fill_(1.0)
                continue
            gen = torch.Generator(device=p.device).manual_seed(SEED * 2**32 + zlib.crc32(name.encode()))
            values = torch.empty(p.shape, dtype=torch.float32, device=p.device).normal_(0.0, WEIGHT_STD, generator=gen)
            p.copy_(values)


def apply_liger() -> None:
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama()


def build(job: dict, device):
    """The PeftModel of the job (provider's patches applied), in train mode. The fp32 reference
    (``+fp32``) is the same model held and computed in fp32, checkpointed."""
    import peft
    import torch
    import transformers

    import tigon

    parts = job["provider"].split("+")
    reference = is_reference(job["provider"])
    if "liger" in parts:
        apply_liger()
    config = transformers.LlamaConfig(**shape(job))
    config.use_cache = False
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[job["weights"]]
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    init_by_name(model)
    if "unsloth" in parts:
        return unsloth_lora(job, model)
    if "4bit" in parts:  # quantized from the same weights: the same nf4 values, dequantized to the compute dtype
        quantize_4bit(model, device, torch.float32 if reference else torch.bfloat16,
                      prepare=job.get("kbit_rest", "fp32") == "fp32")
    elif reference:  # cast after drawing: the providers' model, its weights rounded to --weights, held in fp32
        model.float()
    lora = peft.LoraConfig(r=job["rank"], lora_alpha=job["alpha"], lora_dropout=0.0, target_modules=list(TARGETS))
    model = peft.get_peft_model(model, lora)
    init_by_name(model, {n for n, p in model.named_parameters() if p.requires_grad})
    if "tigon" in parts:
        tigon.patch(model, keep_attention="kept" in parts, offload_activations="offload" in parts)
    # The reference is checkpointed whatever the runs it is compared with do: recomputing gives the same values,
    # and it keeps the fp32 activations of many layers within the memory that the bf16 runs fit in.
    if "ckpt" in parts or reference:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def unsloth_lora(job: dict, model):
    """Unsloth's PEFT model of ``model``'s weights (benchmarks/unsloth_models.py), its adapters drawn by name."""
    import torch

    parts = job["provider"].split("+")
    with tempfile.TemporaryDirectory(prefix="tigon-lora-unsloth-") as folder:
        unsloth_models.save_model(model, Path(folder))
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        peft_model = unsloth_models.load_lora(Path(folder), seq=job["seq"], qlora="4bit" in parts,
                                              checkpointing="ckpt" in parts, rank=job["rank"], alpha=job["alpha"],
                                              targets=TARGETS, seed=SEED)
    init_by_name(peft_model, {n for n, p in peft_model.named_parameters() if p.requires_grad})
    return peft_model.train()


def run_job(job: dict) -> dict:
    """Build, train ``warmup + steps`` steps, save the first step's adapter gradients to
    ``job["grads_path"]``; runs inside a fresh worker process (or in-process for a CPU test). The fp32
    reference trains one step without autocast and is not timed: its loss and gradients are what it is for."""
    import torch

    device = torch.device(job["device"])
    cuda = device.type == "cuda"
    reference = is_reference(job["provider"])
    out = {**job, "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    if not reference:
        out["matmul_tflops"] = matmul_tflops(device, job["matmul_size"])
    torch.manual_seed(SEED)
    model = build(job, device)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out["adapter_params"] = sum(p.numel() for _, p in trainable)
    optimizer = torch.optim.AdamW([p for _, p in trainable], lr=LR, fused=cuda)
    batch, seq, warmup, steps = job["batch"], job["seq"], job["warmup"], job["steps"]
    gen = torch.Generator(device=device).manual_seed(SEED)
    data = torch.randint(shape(job)["vocab_size"], (warmup + steps, batch, seq), device=device, generator=gen)

    saved = []  # the first step's gradients, saved once (a profiled step may train on step 0's data again)

    def train_step(step) -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not reference):
            loss = model(input_ids=data[step], labels=data[step]).loss
        loss.backward()
        if not saved and job.get("grads_path"):
            saved.append(step)
            names = [n for n, _ in trainable]
            flat = torch.cat([p.grad.detach().float().flatten() for _, p in trainable]).cpu()
            torch.save({"names": names, "grads": flat}, job["grads_path"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # synchronises: the step time is the device's

    if reference:
        out["losses"] = [train_step(0)]
        return out
    losses, seconds = [], []
    for step in range(warmup + steps):
        if step == warmup:
            e2e.wait_until_quiet(job.get("quiet_path"))
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        losses.append(train_step(step))
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds[warmup:])
    flops = step_flops(shape(job), batch=batch, seq=seq, rank=job["rank"])
    out.update(losses=losses, step_seconds=seconds, median_step_s=median, tokens_per_s=batch * seq / median,
               flops=flops, tflops=flops["total"] / median / 1e12)
    out["matmul_share"] = out["tflops"] / out["matmul_tflops"]
    if cuda:
        out.update(peak_bytes=torch.cuda.max_memory_allocated(), reserved_bytes=torch.cuda.max_memory_reserved())
    if job.get("profile_steps"):
        again = [warmup + i % steps for i in range(job["profile_steps"])]  # the timed steps' data again
        try:
            out["profile"] = e2e.profile_steps(train_step, again, cuda=cuda, timed_step_s=median)
        except Exception as exc:  # keep the timed result when only the profile fails
            out["profile_error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    return out


def worker_main(ready_path: str | None = None, unsloth: bool = False) -> int:
    """benchmarks/e2e.py's worker loop (imports, the ready mark, one job from stdin, its result line), running
    this file's jobs, with PEFT imported ahead (and Unsloth before everything, in an Unsloth worker)."""
    return e2e.worker_main(ready_path, run=run_job, imports=("unsloth", "peft") if unsloth else ("peft",))


# ----------------------------------------------------------------------------------------- parent


# What the runs merged into one page must share (--merge): the model, the step and its measurement.
MERGE_SAME = ("layers", "batch", "seq", "rank", "alpha", "weights", "kbit_rest", "tiny", "warmup", "steps",
              "matmul_size")


def fp32_reference(provider: str) -> str:
    """The fp32 reference ``provider`` is compared with: stock PEFT in fp32 on the same bases (4-bit or not)."""
    return "+".join([REFERENCE, *(["4bit"] if "4bit" in provider.split("+") else []), FP32])


def references_for(providers) -> list[str]:
    """The fp32 references a run adds: one for each kind of bases whose stock PEFT run is among ``providers``."""
    return list(dict.fromkeys(fp32_reference(p) for p in providers if p.split("+")[0] == REFERENCE))


def jobs_for(args, grads_dir: Path) -> list[dict]:
    """The timed providers' jobs, then their fp32 references' (one step, no warm-up, no profile)."""
    def job(provider, **step):
        return {"provider": provider, "device": args.device, "tiny": args.tiny, "layers": args.layers,
                "batch": args.batch, "seq": args.seq, "rank": args.rank, "alpha": args.alpha,
                "weights": args.weights, "kbit_rest": args.kbit_rest, "warmup": args.warmup, "steps": args.steps,
                "matmul_size": args.matmul_size,
                "profile_steps": e2e.PROFILE_STEPS if args.profile else 0,
                "grads_path": str(grads_dir / f"{provider}.pt"), **step}

    return ([job(provider) for provider in args.providers]
            + [job(name, warmup=0, steps=1, profile_steps=0) for name in references_for(args.providers)])


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def reference_names(provider: str) -> tuple:
    """The stock PEFT bf16 runs ``provider`` is compared with, in order: on the same bases (4-bit or not) with the
    same checkpointing, then with the other."""
    variants = provider.split("+")[1:]
    bases = [REFERENCE, *(v for v in variants if v not in ("ckpt", "kept", "offload"))]
    ckpt = "ckpt" in variants
    return "+".join(bases + ["ckpt"] * ckpt), "+".join(bases + ["ckpt"] * (not ckpt))


def grad_bound(peft_grad_rel: float | None) -> float:
    """The most a row's adapter gradients may differ from fp32's (relative): BF16_TOLERANCE, or PEFT_SLACK times
    stock PEFT's bf16 run's distance where that is more; BF16_TOLERANCE where stock PEFT's is unknown."""
    return BF16_TOLERANCE if peft_grad_rel is None else max(BF16_TOLERANCE, PEFT_SLACK * peft_grad_rel)


def agrees(loss_rel: float, grad_rel: float, peft_grad_rel: float | None = None) -> bool:
    """The agreement rule: the first loss within BF16_TOLERANCE of fp32's (relative), and the first step's
    adapter gradients within :func:`grad_bound` of fp32's."""
    return loss_rel <= BF16_TOLERANCE and grad_rel <= grad_bound(peft_grad_rel)


def add_agreement(rows: list[dict], references: list[dict]) -> None:
    """Each row's first loss and first-step adapter gradients against the fp32 reference on its bases (``against``,
    ``loss_rel``, ``grad_rel``), the same distance of stock PEFT's bf16 run with the same bases and
    checkpointing (or, when that one failed, the other checkpointing; ``peft``, ``peft_grad_rel``), and the
    verdict of :func:`agrees` (``agrees``; a row whose gradients could not be compared disagrees)."""
    import torch

    done = {r["provider"]: r for r in references if "losses" in r}
    for row in rows:
        ref = done.get(fp32_reference(row["provider"]))
        if "losses" not in row or ref is None:
            continue
        row["against"] = ref["provider"]
        row["loss_rel"] = abs(row["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0])
        paths = [Path(r.get("grads_path", "")) for r in (row, ref)]
        if all(p.is_file() for p in paths):
            got, want = (torch.load(p) for p in paths)
            if got["names"] == want["names"]:
                row["grad_rel"] = rel(got["grads"], want["grads"])
    compared = {r["provider"]: r for r in rows if "grad_rel" in r}
    for row in rows:
        if "loss_rel" not in row:
            continue
        peft = next((compared[n] for n in reference_names(row["provider"]) if n in compared), None)
        if peft is not None:
            row["peft"], row["peft_grad_rel"] = peft["provider"], peft["grad_rel"]
        row["agrees"] = agrees(row["loss_rel"], row.get("grad_rel", math.inf), row.get("peft_grad_rel"))


# What another run must share for its stock PEFT distance to stand in for this run's: the model and the first
# step's data (its fp32 reference's first loss must match too).
AGREEMENT_SAME = ("layers", "batch", "seq", "rank", "alpha", "weights", "kbit_rest", "tiny")


def peft_distances_from(runs: list[dict], result: dict) -> None:
    """Rows compared with fp32 whose own run has no stock PEFT bf16 distance (stock PEFT ran out of memory, or was
    not among the providers) take it from the newest of ``runs`` (history records, oldest first) with the same
    ``AGREEMENT_SAME`` settings whose fp32 reference on the same bases had the same first loss: the same model,
    data and reference, so the same distance. Stock PEFT's run with the same checkpointing is preferred, in any
    record, to one with the other, as :func:`add_agreement` prefers it; ``peft_from`` names the record (its
    1-based line, date and device), and the verdict is taken again."""
    losses = {r["provider"]: r["losses"][0] for r in result.get("references", []) if r.get("losses")}
    settings = result["settings"]
    for row in result["rows"]:
        if "loss_rel" not in row or row.get("peft_grad_rel") is not None:
            continue
        reference = fp32_reference(row["provider"])
        if reference not in losses:
            continue
        found = None
        for name in reference_names(row["provider"]):  # the same checkpointing first, in any run, then the other
            for line, run in reversed(list(enumerate(runs, 1))):
                theirs = run.get("settings") or {}
                if run.get("benchmark") != "lora" or any(theirs.get(k) != settings.get(k) for k in AGREEMENT_SAME):
                    continue
                their_loss = next((r["losses"][0] for r in run.get("references", [])
                                   if r.get("provider") == reference and r.get("losses")), None)
                if their_loss is None or not math.isclose(their_loss, losses[reference], rel_tol=1e-6):
                    continue
                found = next(((line, run, r) for r in run.get("rows", []) if r.get("provider") == name
                              and r.get("against") == reference and r.get("grad_rel") is not None), None)
                if found:
                    break
            if found:
                break
        if found:
            line, run, peft = found
            row["peft"], row["peft_grad_rel"] = peft["provider"], peft["grad_rel"]
            row["peft_from"] = {"line": line, "date": run.get("date"), "device": run.get("device")}
            row["agrees"] = agrees(row["loss_rel"], row.get("grad_rel", math.inf), row["peft_grad_rel"])


def run(args, log=print) -> dict:
    with tempfile.TemporaryDirectory() as grads_dir:
        jobs = jobs_for(args, Path(grads_dir))
        # Unsloth's jobs last, in workers of their own (its pinned packages first on their path)
        jobs.sort(key=lambda job: job["provider"].startswith("unsloth"))
        pools, rows, references = {}, [], []
        try:
            for job in jobs:
                unsloth = job["provider"].startswith("unsloth")
                if unsloth not in pools:
                    if False in pools:  # the other providers are done: their spare worker goes
                        pools.pop(False).close()
                    env = unsloth_models.worker_env(args.unsloth_site, ROOT / "src") if unsloth else None
                    pools[unsloth] = e2e.WorkerPool(args.timeout, __file__, env, ("--unsloth",) if unsloth else ())
                row = pools[unsloth].run(job)
                (references if is_reference(job["provider"]) else rows).append(row)
                log(row_line(row))
        finally:
            for pool in pools.values():
                pool.close()
        add_agreement(rows, references)
    for row in rows + references:
        row.pop("grads_path", None)
    for ref in references:  # the history drops it from rows only: a temporary file of this run
        ref.pop("quiet_path", None)
    return {"kind": "lora", "rows": rows, "references": references}


def row_line(row: dict) -> str:
    head = f"{row['provider']:<11}"
    if "error" in row:
        return f"{head} {row['error']}"
    if is_reference(row["provider"]):
        return f"{head} fp32 reference (untimed)  loss {row['losses'][0]:.5g}"
    return (f"{head} {e2e._si(row['tokens_per_s']):>7} tok/s  {row['tflops']:.0f} TFLOP/s "
            f"({row['matmul_share']:.0%} of {row['matmul_tflops']:.0f})  peak {e2e._gib(row.get('peak_bytes'))} GiB  "
            f"loss {row['losses'][0]:.5g}")


def _title(provider: str) -> str:
    base, *variants = provider.split("+")
    return PROVIDER_TITLES[base] + "".join(VARIANT_TITLES[v] for v in variants)


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(result: dict) -> str:
    s = result["settings"]
    rows = result["rows"]
    layers = s["layers"]
    model = "tiny Llama" if s["tiny"] else f"Llama-3.1-8B-shaped, {layers} of 32 layers"
    matmul = [r["matmul_tflops"] for r in rows if "matmul_tflops" in r]
    lines = [
        f"# LoRA fine-tuning steps — {result['device']} — {result['date']}", "",
        f"Versions: {', '.join(f'{k} {v}' for k, v in result['versions'].items() if v)}.",
        f"{model}, {s['weights']} base weights, LoRA r={s['rank']} α={s['alpha']:g} (fp32 adapters) on the seven "
        f"projections, batch {s['batch']} x {s['seq']}, bf16 autocast, fused AdamW on the adapters; median of "
        f"{s['steps']} steps after {s['warmup']}. TFLOP/s: the model's flops a step (benchmarks/lora.py: base forward "
        "and input gradients, adapters, attention over the full square; no recompute) over the step time; "
        f"matmul: a bf16 {s['matmul_size']}³ product in the same process"
        + (f" ({min(matmul):.0f}–{max(matmul):.0f} TFLOP/s)" if matmul else "") + "; vs PEFT: tokens/s over stock "
        "PEFT's with the same bases and checkpointing (QLoRA: nf4, double quant, bf16 compute; "
        + ("norms, embeddings and head fp32, peft.prepare_model_for_kbit_training" if s.get("kbit_rest", "fp32")
           == "fp32" else "norms, embeddings and head bf16") + ", Unsloth's rows as its loader leaves them). "
        "Each run in a fresh process.", "",
        "Agreement, against the fp32 reference: stock PEFT on the same bases computing the same model in fp32 "
        "(fp32 base weights holding the same values, fp32 adapters, no autocast; 4-bit: the same nf4 weights "
        "with fp32 compute), one untimed step on the same data. Loss Δ: the first step's loss, relative; grad Δ: "
        "all adapter gradients of the first step, ‖g − g_fp32‖ / ‖g_fp32‖; PEFT's grad Δ: stock PEFT's bf16 "
        "run's grad Δ (same bases and checkpointing). "
        f"A row agrees when its loss Δ is at most {BF16_TOLERANCE:g} and its grad Δ at most max({BF16_TOLERANCE:g}, "
        f"{PEFT_SLACK:g} × PEFT's grad Δ) ({BF16_TOLERANCE:g} where PEFT's is not known), and is marked "
        "**disagrees** otherwise.", "",
        "| provider | tokens/s | vs PEFT | TFLOP/s | of matmul | step ms | peak GiB | loss Δ vs fp32 | "
        "grad Δ vs fp32 | PEFT's grad Δ vs fp32 | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    speeds = {r["provider"]: r["tokens_per_s"] for r in rows if "tokens_per_s" in r}
    for row in rows:
        if "error" in row:
            lines.append(f"| {_title(row['provider'])} | — | — | — | — | — | — | — | — | — | {row['error']} |")
            continue
        ref = speeds.get(reference_names(row["provider"])[0])
        speed = f"{row['tokens_per_s'] / ref:.2f}x" if ref else "—"
        # A merged row that was compared with stock PEFT's bf16 run, not with fp32, has none of these columns.
        agreement = row if is_reference(row.get("against", "")) else {}
        note = "" if agreement.get("agrees", True) else "**disagrees**"
        lines.append(
            f"| {_title(row['provider'])} | {row['tokens_per_s']:.0f} | {speed} | {row['tflops']:.0f} | "
            f"{row['matmul_share']:.0%} | {row['median_step_s'] * 1e3:.0f} | {e2e._gib(row.get('peak_bytes'))} | "
            f"{_fmt(agreement.get('loss_rel'), '.1e')} | {_fmt(agreement.get('grad_rel'), '.1e')} | "
            f"{_fmt(agreement.get('peft_grad_rel'), '.1e')}{' †' if agreement.get('peft_from') else ''} | {note} |")
    borrowed = sorted({(f["line"], f["date"], f["device"], r["peft"]) for r in rows if (f := r.get("peft_from"))})
    if borrowed:
        runs = "; ".join(f"{history.FILE_NAME} line {line} ({date}, {device}, {_title(name)})"
                         for line, date, device, name in borrowed)
        lines += ["", "† Stock PEFT's distance from another run with the same model, data and fp32 reference, as "
                  f"this run's stock PEFT gave none: {runs}."]
    references = [f"{_title(r['provider'])}: " + (r["error"] if "error" in r else f"first loss {r['losses'][0]:.6g}")
                  for r in result.get("references", [])]
    lines += ["", "fp32 references: " + ("; ".join(references) if references else
                                          "none (no stock PEFT run on these bases: no agreement)") + "."]
    flops = next((r["flops"] for r in rows if "flops" in r), None)
    if flops:
        lines += ["", "Flops a step: " + ", ".join(f"{k} {v / 1e12:.1f} T" for k, v in flops.items()) + "."]
    lines += e2e.profile_markdown([{**r, "model": model} for r in rows if "error" not in r],
                                  titles={r["provider"]: _title(r["provider"]) for r in rows})
    return "\n".join(lines) + "\n"


def versions(providers=(), unsloth_site: Path | None = None) -> dict:
    """The harness's versions, PEFT's, tigon's and bitsandbytes' (where installed), and Unsloth's from its site
    where a provider ran it."""
    from importlib import metadata

    from tigon.bench.harness import versions as base

    out = base()
    for name in ("peft", "tigon", "bitsandbytes"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    if unsloth_site is not None and any(p.startswith("unsloth") for p in providers):
        out.update(unsloth_models.versions(unsloth_site))
    return out


def save(result: dict, out_dir: Path) -> list[Path]:
    return e2e.write_result(result, out_dir, "lora", markdown)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        rest = [a for a in argv[1:] if a != "--unsloth"]
        return worker_main(rest[0] if rest else None, unsloth="--unsloth" in argv)
    args = parse_args(argv)
    import torch

    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # inherited by the workers, before they import tigon.ops
    elif not torch.cuda.is_available():
        print("benchmarks/lora.py needs a CUDA GPU and this machine has none (--device cpu --tiny runs a smoke "
              "test of the pipeline).", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = run(args)
    settings = {k: ([str(p) for p in v] if k == "merge" else str(v) if isinstance(v, Path) else v)
                for k, v in vars(args).items()}
    result.update(device=next((r["device"] for r in result["rows"] if "error" not in r), "unknown-GPU"),
                  date=_dt.date.today().isoformat(), versions=versions(args.providers, args.unsloth_site),
                  settings=settings,
                  wall_s=time.perf_counter() - started)
    known = history.default_path()  # stock PEFT's distance, where this run's did not give it
    if known is not None and known.is_file():
        peft_distances_from(history.read(known), result)
    target = history.script_path(args)
    if target is not None:  # this run's rows only: the merged ones are in the history already
        history.append(result, benchmark="lora", path=target)
    if args.merge:
        # the fp32 references too: the page lists them (the earlier rows keep their own agreement)
        e2e.merge_runs(result, args.merge, key=lambda row: row["provider"], same=MERGE_SAME,
                       fields=("rows", "references"))
    paths = save(result, args.out)
    print(f"\nwrote {', '.join(str(p) for p in paths)} ({result['wall_s']:.0f} s)\n")
    if target is not None:
        print(f"appended the run to {target}\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
