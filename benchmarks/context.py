"""Context-length benchmark: the longest sequence each provider trains, and its speed there, on a GPU.

    python benchmarks/context.py                                        # every model, every provider
    python benchmarks/context.py --models llama-1b --providers stock tigon tigon+long --max-tokens 131072
    python benchmarks/context.py --models llama-8b-qlora --gpu-memory 79 --max-tokens 393216   # as an 80 GB GPU
    python benchmarks/context.py --device cpu --tiny --step 64 --max-tokens 128   # pipeline smoke test

What is measured. Three models, random weights, sdpa attention, batch 1 of random tokens, a step being
forward with labels (the loss inside the model), backward, ``optimizer.step()`` and
``zero_grad(set_to_none=True)``, synchronised by ``loss.item()``:

- ``llama-1b``: Llama-3.2-1B-shaped full fine-tuning (``tigon.bench.models``' shape): fp32 weights,
  bf16 autocast, fused AdamW on every parameter.
- ``llama-8b-lora``: Llama-3.1-8B-shaped LoRA: bf16 base weights (frozen), PEFT LoRA r=16,
  lora_alpha=32, on every linear layer of the decoder (q/k/v/o, gate/up/down), bf16 autocast, fused
  AdamW on the adapters.
- ``llama-8b-qlora``: the same model as QLoRA, the setting of Unsloth's published context lengths: the
  decoder's projections bitsandbytes 4-bit (nf4, double quant, bf16 compute: benchmarks/lora.py's
  ``quantize_4bit`` of the bf16 weights, then ``peft.prepare_model_for_kbit_training``), LoRA r=32,
  lora_alpha=64 on the same layers.

Providers: ``stock`` (transformers and PEFT as shipped), ``stock+ckpt`` (transformers' gradient
checkpointing, non-reentrant, on every decoder layer), ``liger+ckpt`` (Liger-Kernel's
``apply_liger_kernel_to_llama()`` before the model is built, with checkpointing; when ``liger_kernel``
imports), ``tigon`` (``tigon.patch(model)``), ``tigon+long`` (``tigon.patch(model, offload_activations=True,
tiled_mlp=True)`` with checkpointing: each layer's input waits in pinned host memory, the MLP runs over
chunks of tokens), ``tigon+tiled`` (the same without the offload: ``tiled_mlp=True`` with checkpointing; at 32K
tokens ``tigon+long`` against it is what the offload costs, printed under each model's table), ``tigon+offload``
(checkpointing and the offload without the tiled MLP: the switches of Unsloth's ``unsloth+ckpt``),
``tigon+offload+kept`` and ``tigon+long+kept`` (``tigon+offload`` and ``tigon+long`` with ``keep_attention=True``:
the recompute takes the attention kernel's outputs of the forward back instead of running the kernel again; with
the offload they wait in pinned host memory beside each layer's input). Unsloth (benchmarks/unsloth_models.py), on
the same weights saved to a folder once per run and loaded as Unsloth's users load a model,
``FastLanguageModel.from_pretrained`` (the LoRA rows: bf16, or 4-bit nf4 for QLoRA, then its ``get_peft_model``
with the row's rank on the same layers; ``llama-1b``:
``full_finetuning=True``, bf16 loaded and every parameter upcast to fp32 by its ``float32_mixed_precision``):
``unsloth`` (no checkpointing), ``unsloth+ckpt`` (its offloaded checkpointing,
``use_gradient_checkpointing="unsloth"``), ``unsloth+long`` (that and its tiled MLP, ``unsloth_tiled_mlp=True``;
with LoRA, Unsloth 2026.10.9 raises in the first backward: its tiled MLP's backward reruns the MLP on views of
the saved input made with grad mode off, and its fused LoRA MLP writes the input gradient into its input in
place; ``unsloth+ckpt`` is its long-context row for the LoRA models).
Unsloth pins other transformers/TRL versions and patches them when imported, so its probes run with
``--unsloth-site`` (a folder of Unsloth and its pinned requirements) first on their path and import it
first; its providers join the default list only where that folder holds Unsloth (it needs a CUDA GPU).

Longest: the largest multiple of ``--step`` (8192) up to ``--max-tokens`` that trains two full steps
(the second step's peak includes the AdamW moments the first one allocates), found by doubling from
``--start`` then bisecting (``e2e.search_longest``), each length in a fresh process (an ``e2e.Worker``,
with no spare one importing alongside: Unsloth initialises CUDA when it is imported, and what a second
process holds on the GPU would be missing from the probe's), so that an out-of-memory error cannot poison
the next try. An error is a result: a provider that cannot
run a model gets a row with its error. ``--gpu-memory`` caps each probe's PyTorch allocations
(``torch.cuda.set_per_process_memory_fraction``) to compare with figures from a smaller GPU. Reported per
length that trained: the second step's tokens/s, the peak allocated GPU memory, and for ``tigon+long*`` the
pinned host memory its offloader holds. tokens/s at 32K is the 32,768-token probe's (doubling from 8192
passes it); at the longest, the longest probe's ("≥" where ``--max-tokens`` itself trained).

Published, not measured here: Unsloth's own figures for Llama 3.1 (8B) QLoRA (:data:`PUBLISHED`), printed
under the ``llama-8b-qlora`` table.

A run too long for one GPU job is split by model or provider; ``--merge`` gives the later part the earlier
parts' result files, for one page with every row (a model and provider searched again replaces its earlier row).
``--combine`` writes one page from earlier runs without running anything: their result files, or the runs of
one day in a history file (``--combine benchmarks/results/history.jsonl --date 2026-12-06 --models
llama-1b``; ``--models`` keeps those models' runs). The runs may have probed different lengths (one length a
run, where a step takes minutes): each model and provider's probes from all of them make its row. A run's row
that carries ``"superseded"`` (a note: how the code it measured differs from the code tigon runs) joins no row; the
page lists it under its table with the note.

Results: ``<out>/context-<device>-<date>.{json,md,png}``; the plot draws tokens/s against the sequence
length, one line per provider, its longest marked. The run (its own rows, not the merged ones) appends one line
to ``benchmarks/results/history.jsonl`` (``--history PATH``; none for a ``--tiny`` or ``--device cpu`` smoke run).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import functools
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is on the path, the repository is not
    sys.path.insert(0, str(ROOT))

from benchmarks import e2e, unsloth_models  # noqa: E402  (probes, the search, OOM detection; Unsloth)
from tigon.bench import history  # noqa: E402

PROVIDERS = ("stock", "stock+ckpt", "liger+ckpt", "tigon", "tigon+tiled", "tigon+offload", "tigon+offload+kept",
             "tigon+long", "tigon+long+kept")
UNSLOTH_PROVIDERS = ("unsloth", "unsloth+ckpt", "unsloth+long")
PROVIDER_TITLES = {
    "stock": "stock",
    "stock+ckpt": "stock + checkpointing",
    "liger+ckpt": "Liger-Kernel + checkpointing",
    "tigon": "tigon",
    "tigon+tiled": "tigon + checkpointing + tiled MLP",
    "tigon+offload": "tigon + checkpointing + offload",
    "tigon+offload+kept": "tigon + checkpointing + offload + kept attention",
    "tigon+long": "tigon + checkpointing + offload + tiled MLP",
    "tigon+long+kept": "tigon + checkpointing + offload + tiled MLP + kept attention",
    "unsloth": "Unsloth",
    "unsloth+ckpt": "Unsloth + offloaded checkpointing",
    "unsloth+long": "Unsloth + offloaded checkpointing + tiled MLP",
}
COLOURS = {"stock": "tab:gray", "stock+ckpt": "tab:cyan", "liger+ckpt": "tab:green", "tigon": "tab:orange",
           "tigon+tiled": "tab:olive", "tigon+offload": "gold", "tigon+offload+kept": "navy",
           "tigon+long": "tab:red", "tigon+long+kept": "tab:blue", "unsloth": "tab:purple",
           "unsloth+ckpt": "tab:pink", "unsloth+long": "tab:brown"}
LLAMA_3_1_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
    tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
SHAPES = {"llama-3.2-1b": None, "llama-3.1-8b": LLAMA_3_1_8B}  # keywords over the family's config (None: its own)
MODELS = {
    # name -> (label, shape, how it is trained: "full", "lora" (bf16 bases) or "qlora" (4-bit nf4 bases))
    "llama-1b": ("Llama-3.2-1B-shaped, full fine-tuning", "llama-3.2-1b", "full"),
    "llama-8b-lora": ("Llama-3.1-8B-shaped, LoRA r=16 on all linear layers", "llama-3.1-8b", "lora"),
    "llama-8b-qlora": ("Llama-3.1-8B-shaped, QLoRA (4-bit nf4 bases) r=32 on all linear layers", "llama-3.1-8b",
                       "qlora"),
}
ADAPTERS = {"lora": (16, 32), "qlora": (32, 64)}  # (rank, lora_alpha)
UNSLOTH_PACKAGES = ("unsloth", "unsloth_zoo", "transformers", "peft", "bitsandbytes")
# Unsloth's docs (UNSLOTH_DOCS), "Llama 3.1 (8B) max. context length": QLoRA r=32 on all linear layers, batch 1,
# A100/H100; GPU memory (GB) -> (tokens with Unsloth, tokens with Hugging Face + Flash Attention 2 or None).
UNSLOTH_DOCS = "https://unsloth.ai/docs/basics/unsloth-benchmarks"
PUBLISHED = {80: (342733, 28454), 48: (191728, None), 40: (153977, None)}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEP = 8192
START = 8192
MAX_TOKENS = 262144
THROUGHPUT_SEQ = 32768
STEPS = 2
OFFLOAD_COST_TARGET = 0.90  # tigon+long's tokens/s at 32K over tigon+tiled's: the offload costs at most 10%
LR = 1e-4
SEED = 0
PROBE_TIMEOUT_S = 300
GIB = 2**30
OUT = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------------------------------- args


def has_unsloth(site: Path) -> bool:
    return (Path(site) / "unsloth" / "__init__.py").is_file()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS + UNSLOTH_PROVIDERS, default=None,
                        help="default: all (Unsloth's where --unsloth-site holds it); liger+ckpt is skipped (and "
                        "reported so) where liger_kernel does not import")
    parser.add_argument("--unsloth-site", type=Path, default=Path(unsloth_models.SITE),
                        help="a folder with Unsloth and its pinned requirements, put first on its probes' PYTHONPATH "
                        "(default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="longest length probed")
    parser.add_argument("--start", type=int, default=START, help="first length probed")
    parser.add_argument("--step", type=int, default=STEP, help="lengths are multiples of it")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="cap each probe's PyTorch GPU memory at GIB (default: the whole device)")
    parser.add_argument("--timeout", type=int, default=PROBE_TIMEOUT_S, help="seconds per probe")
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the JSON, markdown and plot")
    parser.add_argument("--merge", nargs="+", type=Path, default=[], metavar="JSON",
                        help="earlier runs' result files whose rows join this run's page (a run split over device "
                             "calls)")
    parser.add_argument("--combine", nargs="+", type=Path, default=[], metavar="JSON",
                        help="write one page from earlier runs (result files, or a history file's runs of --date), "
                             "which may have probed different lengths, and run nothing")
    parser.add_argument("--date", default=None, help="with --combine and a history file: the day whose context "
                                                     "runs it combines (YYYY-MM-DD)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny configs instead of the published shapes")
    history.add_argument(parser)
    args = parser.parse_args(argv)
    if args.step < 1 or args.start < 1 or args.max_tokens < args.step:
        parser.error("--step and --start must be positive and --max-tokens at least --step")
    if args.date is not None and not args.combine:
        parser.error("--date goes with --combine (the day of a history file's runs)")
    if args.gpu_memory is not None and args.gpu_memory <= 0:
        parser.error("--gpu-memory must be positive")
    if args.providers is None:
        args.providers = list(PROVIDERS + (UNSLOTH_PROVIDERS if has_unsloth(args.unsloth_site) else ()))
    if len(set(args.providers)) != len(args.providers):
        parser.error("--providers: each at most once")
    args.skipped = []
    if "liger+ckpt" in args.providers and importlib.util.find_spec("liger_kernel") is None:
        args.providers = [p for p in args.providers if p != "liger+ckpt"]
        args.skipped.append("liger+ckpt (liger_kernel does not import)")
    args.unsloth_dir = None  # main's folder of the models saved for Unsloth, one per weights
    return args


# ------------------------------------------------------------------------------------------- a probe


def model_config(name: str, *, tiny: bool):
    """The row's label, its transformers config, and how it is trained (``MODELS``)."""
    from tigon.bench.models import model_config as family_config

    label, shape, kind = MODELS[name]
    spec = family_config("llama", tiny=tiny)
    config = copy.deepcopy(spec.config)
    if SHAPES[shape] is not None and not tiny:
        for key, value in copy.deepcopy(SHAPES[shape]).items():
            setattr(config, key, value)
    return (f"tiny {name}" if tiny else label), config, kind


def new_model(config, kind: str, device):
    """The row's transformers model, its weights drawn from ``SEED`` (fp32 for full fine-tuning, bf16 bases
    otherwise)."""
    import torch
    import transformers

    torch.manual_seed(SEED)
    dtype = torch.float32 if kind == "full" else torch.bfloat16
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.train()


def build(job: dict):
    """The job's model (LoRA-wrapped, on 4-bit bases, where its row says so), patched and checkpointed as its
    provider says, and its optimizer."""
    import torch

    import tigon

    parts = set(job["provider"].split("+"))
    device = torch.device(job["device"])
    label, config, kind = model_config(job["model"], tiny=job["tiny"])
    if "unsloth" in parts:
        model = unsloth_model(job, config, kind, device)
    else:
        if "liger" in parts:
            e2e.apply_liger("llama")
        model = new_model(config, kind, device)
        if kind == "qlora":
            from tigon.bench.models import quantize_4bit

            quantize_4bit(model, device)
        if kind != "full":
            from peft import LoraConfig, get_peft_model

            rank, alpha = ADAPTERS[kind]
            model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=LORA_TARGETS))
        if "tigon" in parts:
            long = "long" in parts
            tigon.patch(model, offload_activations=long or "offload" in parts, tiled_mlp=long or "tiled" in parts,
                        keep_attention="kept" in parts)
        if parts & {"ckpt", "long", "tiled", "offload"}:
            model.config.use_cache = False
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, fused=device.type == "cuda")
    return label, model, optimizer


def unsloth_model(job: dict, config, kind: str, device):
    """Unsloth's model of the row's weights: saved to ``job["unsloth_dir"]`` by the first probe that needs them
    (a folder per shape and dtype, written under another name and renamed when complete), then loaded through
    Unsloth (benchmarks/unsloth_models.py) with the provider's checkpointing and tiled MLP."""
    import torch

    parts = set(job["provider"].split("+"))
    dtype = "fp32" if kind == "full" else "bf16"
    folder = Path(job["unsloth_dir"]) / f"{'tiny-' * job['tiny']}{MODELS[job['model']][1]}-{dtype}"
    if not (folder / "config.json").is_file():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model = new_model(config, kind, device)
        unsloth_models.save_model(model, partial)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        partial.rename(folder)
    options = dict(seq=job["seq"], checkpointing="ckpt" in parts or "long" in parts, tiled_mlp="long" in parts,
                   seed=SEED)
    if kind == "full":
        return unsloth_models.load_full(folder, **options)
    rank, alpha = ADAPTERS[kind]
    return unsloth_models.load_lora(folder, qlora=kind == "qlora", rank=rank, alpha=alpha, targets=LORA_TARGETS,
                                    **options)


def run_job(job: dict) -> dict:
    """Train ``job["steps"]`` steps of batch 1 x ``job["seq"]`` tokens; inside a fresh process."""
    import torch

    from tigon.patching.parts.long_context import offloader_of

    device = torch.device(job["device"])
    cuda = device.type == "cuda"
    if cuda and job.get("gpu_memory"):
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, job["gpu_memory"] * GIB / total), device)
    label, model, optimizer = build(job)
    if cuda:  # what building freed (a bf16 weight quantized, a model saved for Unsloth) goes back to the device
        torch.cuda.empty_cache()
    out = {**job, "label": label, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "params": sum(p.numel() for p in model.parameters()),
           "trained_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    vocab = model.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(SEED)
    data = torch.randint(vocab, (job["steps"], 1, job["seq"]), device=device, generator=gen)
    losses, seconds = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for ids in data:
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronises: the step time is the device's
        seconds.append(time.perf_counter() - start)
    out.update(losses=losses, step_seconds=seconds, tokens_per_s=job["seq"] / seconds[-1])
    if cuda:
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
    offloader = offloader_of(model)
    if offloader is not None:
        out.update(host_bytes=offloader.host_bytes, peak_host_bytes=offloader.peak_host_bytes)
    if job["provider"].startswith("unsloth"):  # its site's versions, not the parent's
        out["versions"] = package_versions(UNSLOTH_PACKAGES)
    return out


def package_versions(names) -> dict:
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def probe(job: dict, timeout: int, *, unsloth_site: Path) -> dict:
    """Run ``job`` in a fresh worker process (benchmarks/e2e.py's, this file's :func:`run_job`); an Unsloth
    provider's with ``unsloth_site`` first on its path and Unsloth imported first. Its result, or the error
    that ended it."""
    unsloth = job["provider"].startswith("unsloth")
    if unsloth and not has_unsloth(unsloth_site):
        return {**job, "error": f"Unsloth is not in --unsloth-site {unsloth_site}", "wall_s": 0.0}
    env = unsloth_models.worker_env(unsloth_site, ROOT / "src") if unsloth else None
    return e2e.Worker(__file__, env, ("--unsloth",) if unsloth else ()).run(job, timeout)


# ------------------------------------------------------------------------------------------- search


PROBE_KEYS = ("seq", "error", "oom", "peak_bytes", "tokens_per_s", "host_bytes", "peak_host_bytes", "wall_s",
              "device", "label", "losses", "versions", "trace")


def named_device(probes: list[dict]) -> str | None:
    """The GPU's name as a probe that ran reports it; a probe that failed before it started (out of memory in
    the build) reports only its job's ``"cuda"``."""
    names = [p.get("device") for p in probes]
    return next((d for d in names if d not in (None, "cuda", "cpu")), next((d for d in names if d), None))


def search(args, model: str, provider: str, run=None, log=print) -> dict:
    run = run or functools.partial(probe, unsloth_site=args.unsloth_site)
    probes = []

    def trains(seq: int) -> bool:
        job = {"model": model, "provider": provider, "seq": seq, "steps": STEPS, "device": args.device,
               "tiny": args.tiny, "gpu_memory": args.gpu_memory, "unsloth_dir": args.unsloth_dir}
        result = run(job, args.timeout)
        probes.append({k: result.get(k) for k in PROBE_KEYS if k in result})
        log(probe_line(provider, result))
        return "error" not in result

    longest, first_failure = e2e.search_longest(trains, step=args.step, start=args.start, maximum=args.max_tokens)
    return row_of(model, provider, probes, longest, first_failure)


def row_of(model: str, provider: str, probes: list[dict], longest: int, first_failure: int | None) -> dict:
    """A page's row from a provider's probes. Where a length trained more than once (runs combined), its
    tokens/s is the median of those probes' (their range in ``tokens_per_s_range_at_longest``) and its
    memory the most any of them used; a length that failed more than once shows its latest error."""
    def trained(seq):
        return [p for p in probes if p["seq"] == seq and "error" not in p]

    def speeds_at(seq):
        return [p["tokens_per_s"] for p in trained(seq) if p.get("tokens_per_s") is not None]

    def median(values):
        return statistics.median(values) if values else None

    at_longest = trained(longest)
    speeds = speeds_at(longest)
    failures = [p for p in probes if p["seq"] == first_failure and "error" in p]
    failed = failures[-1] if failures else {}  # runs combined: the latest run's error there
    return {
        "model": model, "provider": provider, "longest_seq": longest, "first_failure": first_failure,
        "failure": failed.get("error"),
        "tokens_per_s_at_32k": median(speeds_at(THROUGHPUT_SEQ)),
        "tokens_per_s_at_longest": median(speeds),
        "tokens_per_s_range_at_longest": [min(speeds), max(speeds)] if len(speeds) > 1 else None,
        "peak_bytes_at_longest": max((p["peak_bytes"] for p in at_longest if p.get("peak_bytes")), default=None),
        "host_bytes_at_longest": max((p["host_bytes"] for p in at_longest if p.get("host_bytes")), default=None),
        "label": next((p["label"] for p in probes if p.get("label")), MODELS[model][0]),
        "device": named_device(probes),
        "versions": next((p["versions"] for p in probes if p.get("versions")), None),
        "probes": sorted(probes, key=lambda p: p["seq"]),
    }


def probe_line(provider: str, result: dict) -> str:
    head = f"{result['model']:>14} {provider:>12} {result['seq']:>7} tokens: "
    if "error" in result:
        trace = "".join(f"\n{'':>16}at {frame}" for frame in result.get("trace") or ())
        return head + result["error"] + trace
    line = f"{result['tokens_per_s']:.0f} tokens/s"
    if result.get("peak_bytes") is not None:
        line += f", peak {result['peak_bytes'] / GIB:.1f} GiB"
    if result.get("host_bytes"):
        line += f", host {result['host_bytes'] / GIB:.1f} GiB"
    return head + line + f" ({result.get('wall_s', 0):.0f} s)"

# ------------------------------------------------------------------------------------------- output


def _cell(value, fmt) -> str:
    return "—" if value is None else fmt.format(value)


def _longest(row: dict) -> str:
    if not row["longest_seq"]:
        return "none"
    # No failure: the search stopped at --max-tokens, which trained; the provider may reach further.
    return f"≥ {row['longest_seq']}" if row["first_failure"] is None else str(row["longest_seq"])


def _speed_at_longest(row: dict) -> str:
    cell = _cell(row["tokens_per_s_at_longest"], "{:.0f}")
    spread = row.get("tokens_per_s_range_at_longest")
    return cell if not spread else f"{cell} ({spread[0]:.0f}–{spread[1]:.0f})"


def _probed(row: dict) -> str:
    """The lengths a row's probes ran, each with how often where more than once and "(failed)" where none trained."""
    seqs = {}
    for p in row["probes"]:
        seqs.setdefault(p["seq"], []).append("error" not in p)
    return ", ".join(f"{seq}" + (f" ×{len(ok)}" if len(ok) > 1 else "") + ("" if any(ok) else " (failed)")
                     for seq, ok in sorted(seqs.items()))


def published_line() -> str:
    """Unsloth's published context lengths (``PUBLISHED``), as the page cites them."""
    figures = "; ".join(f"{gb} GB: {ours:,} tokens with Unsloth" + (f" vs {hf:,} with Hugging Face + FA2" if hf else "")
                        for gb, (ours, hf) in PUBLISHED.items())
    return (f"Published, not measured here: Unsloth's benchmarks ({UNSLOTH_DOCS}), \"Llama 3.1 (8B) max. context "
            f"length\", 4-bit QLoRA r=32 on all linear layers, batch 1, A100/H100 — {figures}.")


def offload_cost(rows: list[dict]) -> float | None:
    """tigon+long's tokens/s at 32K over tigon+tiled's (the same switches without the offload), where both
    were measured."""
    at_32k = {r["provider"]: r["tokens_per_s_at_32k"] for r in rows}
    with_offload, without = at_32k.get("tigon+long"), at_32k.get("tigon+tiled")
    return with_offload / without if with_offload and without else None


def markdown(result: dict) -> str:
    lines = [f"# Longest context at batch 1 — {result['device']} — {result['date']}", ""]
    versions = result.get("versions") or {}
    if versions:
        lines += [", ".join(f"{k} {v}" for k, v in versions.items() if v), ""]
    if result.get("unsloth_versions"):
        lines += ["Unsloth's probes (their own site): "
                  + ", ".join(f"{k} {v}" for k, v in result["unsloth_versions"].items() if v), ""]
    settings = result.get("settings", {})
    cap = f"; GPU memory capped at {settings['gpu_memory']:g} GiB" if settings.get("gpu_memory") else ""
    if settings.get("combined"):
        lengths = (f"Probes of {settings['runs']} runs, combined (`--combine`): a row's longest is the longest length "
                   "that trained in any of them, its first failure the shortest that failed above it (with the latest "
                   "run's error there; the lengths each row probed are listed under its table); where a length "
                   "trained more than once, its tokens/s is the median (the range in brackets)")
    else:
        lengths = f"Lengths: multiples of {settings.get('step')} up to {settings.get('max_tokens')}"
    lines += [f"{lengths}; a length counts when {STEPS} optimizer steps train; tokens/s from the second "
              f"step{cap}.", ""]
    for model in dict.fromkeys(r["model"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["model"] == model]
        lines += [f"## {rows[0]['label']}", "",
                  "| provider | longest (tokens) | tokens/s at 32K | tokens/s at longest | peak GPU GiB at longest "
                  "| offload host GiB | first failure |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in rows:
            failure = "—" if r["first_failure"] is None else f"{r['first_failure']}: {r['failure']}"
            lines.append(
                f"| {PROVIDER_TITLES[r['provider']]} | {_longest(r)} "
                f"| {_cell(r['tokens_per_s_at_32k'], '{:.0f}')} | {_speed_at_longest(r)} "
                f"| {_cell(r['peak_bytes_at_longest'] and r['peak_bytes_at_longest'] / GIB, '{:.1f}')} "
                f"| {_cell(r['host_bytes_at_longest'] and r['host_bytes_at_longest'] / GIB, '{:.1f}')} "
                f"| {failure.replace('|', '/')} |")  # a worker's error joins its last lines with " | "
        lines.append("")
        if settings.get("combined"):
            lines += ["Lengths probed: " + "; ".join(f"{PROVIDER_TITLES[r['provider']]}: {_probed(r)}" for r in rows)
                      + ".", ""]
        left_out = [s for s in settings.get("superseded") or () if s["model"] == model]
        if left_out:
            lines += ["Left out, measured on code that tigon no longer runs: " + "; ".join(
                f"{PROVIDER_TITLES[s['provider']]} in {s['run']} ({s['note']})" for s in left_out) + ".", ""]
        cost = offload_cost(rows)
        if cost is not None:
            verdict = "within" if cost >= OFFLOAD_COST_TARGET else "outside"
            lines += [f"The offload at 32K tokens: {PROVIDER_TITLES['tigon+long']} runs at {cost:.3f}× the tokens/s of "
                      f"{PROVIDER_TITLES['tigon+tiled']} ({verdict} the target of ≥ {OFFLOAD_COST_TARGET:.2f}×).", ""]
        if MODELS[model][2] == "qlora" and not settings.get("tiny"):
            lines += [published_line(), ""]
    if settings.get("skipped"):
        lines += [f"Skipped: {', '.join(settings['skipped'])}.", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for row in (r for r in result["rows"] if r["model"] == model):
            speeds = {}  # a length probed by several runs: their median
            for p in row["probes"]:
                if p.get("tokens_per_s"):
                    speeds.setdefault(p["seq"], []).append(p["tokens_per_s"])
            if not speeds:
                continue
            xs, ys = zip(*((seq, statistics.median(v)) for seq, v in sorted(speeds.items())), strict=True)
            colour = COLOURS[row["provider"]]
            ax.plot([x / 1024 for x in xs], ys, marker="o", ms=3, color=colour, label=PROVIDER_TITLES[row["provider"]])
            if row["tokens_per_s_at_longest"]:
                longest = (row["longest_seq"] / 1024, row["tokens_per_s_at_longest"])
                ax.plot(*longest, marker="*", ms=14, color=colour)
                ax.annotate(f"{row['longest_seq'] / 1024:g}K", longest, textcoords="offset points", xytext=(4, 6),
                            fontsize=8, color=colour)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (K tokens), batch 1")
        ax.set_ylabel("tokens/s")
        ax.set_title(next(r["label"] for r in result["rows"] if r["model"] == model), fontsize=10)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"tokens/s against context length (★ longest)\n{result['device']}, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(result: dict, out_dir: Path, log=print) -> list[Path]:
    return e2e.write_result(result, out_dir, "context", markdown, plot, log)


# What the runs merged into one page must share (--merge): the search and the training step.
MERGE_SAME = ("step", "start", "max_tokens", "tiny", "gpu_memory", "steps", "lr", "seed", "adapters")


def merge(result: dict, earlier) -> None:
    """Earlier runs' rows (``--merge``) into ``result``, one row per model and provider (this run's replacing an
    earlier one); the settings list every model and provider of the page."""
    e2e.merge_runs(result, earlier, key=lambda row: (row["model"], row["provider"]), same=MERGE_SAME)
    settings = result["settings"]
    for name in ("models", "providers"):
        names = [row[name[:-1]] for row in result["rows"]]
        settings[name] = list(dict.fromkeys(names))


# What the runs combined into one page must share (--combine): the model and training step; the lengths each
# searched may differ.
COMBINE_SAME = ("tiny", "gpu_memory", "steps", "lr", "seed", "adapters")


def combined_runs(path: Path, date: str | None) -> list[tuple[str, dict]]:
    """The runs a ``--combine`` file gives, each with the name the page cites it by: a result file's one run, or
    a history file's (``.jsonl``) context runs of ``date``."""
    if path.suffix != ".jsonl":
        return [(path.name, json.loads(path.read_text()))]
    if date is None:
        raise ValueError(f"{path}: a history file needs --date, the day whose context runs it gives")
    runs = [(f"{path.name}, line {number}", run) for number, run in enumerate(history.read(path), 1)
            if run.get("benchmark") == "context" and run.get("date") == date]
    if not runs:
        raise ValueError(f"{path}: no context runs of {date}")
    return runs


def combine(paths, date: str | None = None, models=None) -> dict:
    """One page from earlier runs (``--combine``: result files, or a history file's runs of ``date``), which
    may have probed different lengths: each model and provider's probes from every run, its longest the longest
    length that trained and its first failure the shortest that failed above it. ``models`` (``--models``)
    keeps those models' rows, and the runs that have any: a day's full fine-tunes and LoRA runs make two pages.
    The runs must be on the same device with the same ``COMBINE_SAME`` settings (a ValueError names the first
    that differs). Nothing runs and nothing joins the history: each run's rows are there already."""
    runs = [run for path in paths for run in combined_runs(Path(path), date)]
    if models is not None:
        runs = [(name, {**run, "rows": [r for r in run["rows"] if r["model"] in models]}) for name, run in runs]
        runs = [(name, run) for name, run in runs if run["rows"]]
    if not runs:
        raise ValueError("--combine: no result files" if models is None
                         else f"--combine: no runs of {', '.join(models)}")
    first_path, first = runs[0]
    reference = {**first, "kind": "context"}  # every run, the first included, must be a context run
    probes: dict[tuple, list] = {}
    superseded = []  # rows of code that tigon no longer runs: named on the page, in no row
    for path, run in runs:
        e2e.check_same_kind(path, run, reference, COMBINE_SAME, whose=f"{first_path}'s")
        for row in run["rows"]:
            if row.get("superseded"):
                superseded.append({"model": row["model"], "provider": row["provider"], "run": path,
                                   "note": row["superseded"]})
                continue
            probes.setdefault((row["model"], row["provider"]), []).extend(row["probes"])
    rows = []
    for (model, provider), found in probes.items():
        longest = max((p["seq"] for p in found if "error" not in p), default=0)
        first_failure = min((p["seq"] for p in found if "error" in p and p["seq"] > longest), default=None)
        rows.append(row_of(model, provider, found, longest, first_failure))
    versions: dict = {}
    for _, run in runs:  # a library whose version differs between runs lists each
        for name, version in (run.get("versions") or {}).items():
            seen = versions.setdefault(name, [])
            if version and version not in seen:
                seen.append(version)
    settings = {name: first["settings"].get(name) for name in COMBINE_SAME}
    settings.update(models=list(dict.fromkeys(r["model"] for r in rows)),
                    providers=list(dict.fromkeys(r["provider"] for r in rows)),
                    combined=[name for name, _ in runs], runs=len(runs), superseded=superseded)
    return {"kind": "context", "rows": rows, "device": first["device"],
            "date": max(run["date"] for _, run in runs),
            "versions": {name: " / ".join(seen) or None for name, seen in versions.items()},
            "unsloth_versions": next((run["unsloth_versions"] for _, run in runs if run.get("unsloth_versions")),
                                     None),
            "settings": settings, "wall_s": sum(run.get("wall_s") or 0 for _, run in runs)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # a probe (e2e.Worker): imports, then one job from stdin
        rest = [a for a in argv[1:] if a != "--unsloth"]
        return e2e.worker_main(rest[0] if rest else None, run=run_job,
                               imports=("unsloth",) if "--unsloth" in argv else ())
    args = parse_args(argv)
    if args.combine:
        result = combine(args.combine, args.date, args.models)
        paths = save(result, args.out)
        print(f"wrote {', '.join(str(p) for p in paths)}\n\n{markdown(result)}")
        return 0
    import torch

    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # inherited by the probes, before they import tigon.ops
    elif not torch.cuda.is_available():
        print("benchmarks/context.py needs a CUDA GPU (--device cpu --tiny runs a smoke test of the pipeline).",
              file=sys.stderr)
        return 2
    from benchmarks.lora import versions  # the harness's, with PEFT's, tigon's and bitsandbytes'

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tigon-context-unsloth-") as folder:
        args.unsloth_dir = folder
        rows = [search(args, model, provider) for model in args.models for provider in args.providers]
    named = named_device(rows)  # the rows' GPU, else the one this process sees
    if named in (None, "cuda", "cpu"):
        named = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    result = {
        "kind": "context", "rows": rows, "device": named,
        "date": _dt.date.today().isoformat(), "versions": versions(),
        "unsloth_versions": next((r["versions"] for r in rows if r.get("versions")), None),
        "settings": {"models": args.models, "providers": args.providers, "skipped": args.skipped,
                     "step": args.step, "start": args.start, "max_tokens": args.max_tokens, "tiny": args.tiny,
                     "gpu_memory": args.gpu_memory, "steps": STEPS, "lr": LR, "seed": SEED,
                     "adapters": {kind: {"r": r, "alpha": alpha, "targets": LORA_TARGETS}
                                  for kind, (r, alpha) in ADAPTERS.items()}},
        "wall_s": time.perf_counter() - started,
    }
    target = history.script_path(args)
    if target is not None:  # this run's rows only: merged ones are in the history already
        history.append(result, benchmark="context", path=target)
    if args.merge:
        merge(result, args.merge)
    paths = save(result, args.out)
    print(f"\nwrote {', '.join(str(p) for p in paths)} ({result['wall_s']:.0f} s)\n")
    if target is not None:
        print(f"appended the run to {target}\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
