"""Context-length benchmark: the longest sequence each provider trains, and its speed there, on a GPU.

    python benchmarks/context.py                                        # both models, every provider
    python benchmarks/context.py --models llama-1b --providers stock tigon tigon+long --max-tokens 131072
    python benchmarks/context.py --device cpu --tiny --step 64 --max-tokens 128   # pipeline smoke test

What is measured. Two models, random weights, sdpa attention, batch 1 of random tokens, a step being
forward with labels (the loss inside the model), backward, ``optimizer.step()`` and
``zero_grad(set_to_none=True)``, synchronised by ``loss.item()``:

- ``llama-1b``: Llama-3.2-1B-shaped full fine-tuning (``tigon.bench.models``' shape): fp32 weights,
  bf16 autocast, fused AdamW on every parameter.
- ``llama-8b-lora``: Llama-3.1-8B-shaped LoRA: bf16 base weights (frozen), PEFT LoRA r=16,
  lora_alpha=32, on every linear layer of the decoder (q/k/v/o, gate/up/down), bf16 autocast, fused
  AdamW on the adapters.

Providers: ``stock`` (transformers as shipped), ``stock+ckpt`` (transformers' gradient checkpointing,
non-reentrant, on every decoder layer), ``liger+ckpt`` (Liger-Kernel's ``apply_liger_kernel_to_llama()``
before the model is built, with checkpointing; when ``liger_kernel`` imports), ``tigon``
(``tigon.patch(model)``), ``tigon+long`` (``tigon.patch(model, offload_activations=True,
tiled_mlp=True)`` with checkpointing: each layer's input waits in pinned host memory, the MLP runs over
chunks of tokens).

Longest: the largest multiple of ``--step`` (8192) up to ``--max-tokens`` that trains two full steps
(the second step's peak includes the AdamW moments the first one allocates), found by doubling from
``--start`` then bisecting (``e2e.search_longest``), each length in a fresh process, so that an
out-of-memory error cannot poison the next try. Reported per length that trained: the second step's
tokens/s, the peak allocated GPU memory, and for ``tigon+long`` the pinned host memory its offloader
holds. tokens/s at 32K is the 32,768-token probe's (doubling from 8192 passes it); at the longest, the
longest probe's.

Results: ``<out>/context-<device>-<date>.{json,md,png}``; the plot draws tokens/s against the sequence
length, one line per provider, its longest marked.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

try:
    from benchmarks import e2e
except ImportError:  # run as a script: benchmarks/ is on the path
    import e2e

PROVIDERS = ("stock", "stock+ckpt", "liger+ckpt", "tigon", "tigon+long")
PROVIDER_TITLES = {
    "stock": "stock",
    "stock+ckpt": "stock + checkpointing",
    "liger+ckpt": "Liger-Kernel + checkpointing",
    "tigon": "tigon",
    "tigon+long": "tigon + checkpointing + offload + tiled MLP",
}
COLOURS = {"stock": "tab:gray", "stock+ckpt": "tab:cyan", "liger+ckpt": "tab:green", "tigon": "tab:orange",
           "tigon+long": "tab:red"}
LLAMA_3_1_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
    tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
MODELS = {
    # name -> (label, shape keywords over the family's config (None: tigon.bench.models'), LoRA)
    "llama-1b": ("Llama-3.2-1B-shaped, full fine-tuning", None, False),
    "llama-8b-lora": ("Llama-3.1-8B-shaped, LoRA r=16 on all linear layers", LLAMA_3_1_8B, True),
}
LORA_RANK, LORA_ALPHA = 16, 32
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEP = 8192
START = 8192
MAX_TOKENS = 262144
THROUGHPUT_SEQ = 32768
STEPS = 2
LR = 1e-4
SEED = 0
PROBE_TIMEOUT_S = 300
RESULT_MARK = "CONTEXT-RESULT "
GIB = 2**30
OUT = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------------------------------- args


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS),
                        help="liger+ckpt is skipped (and reported so) where liger_kernel does not import")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="longest length probed")
    parser.add_argument("--start", type=int, default=START, help="first length probed")
    parser.add_argument("--step", type=int, default=STEP, help="lengths are multiples of it")
    parser.add_argument("--timeout", type=int, default=PROBE_TIMEOUT_S, help="seconds per probe")
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the JSON, markdown and plot")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny configs instead of the published shapes")
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)  # a probe, in its own process
    args = parser.parse_args(argv)
    if args.step < 1 or args.start < 1 or args.max_tokens < args.step:
        parser.error("--step and --start must be positive and --max-tokens at least --step")
    args.skipped = []
    if "liger+ckpt" in args.providers and importlib.util.find_spec("liger_kernel") is None:
        args.providers = [p for p in args.providers if p != "liger+ckpt"]
        args.skipped.append("liger+ckpt (liger_kernel does not import)")
    return args


# ------------------------------------------------------------------------------------------- a probe


def model_config(name: str, *, tiny: bool):
    from tigon.bench.models import model_config as family_config

    label, shape, lora = MODELS[name]
    spec = family_config("llama", tiny=tiny)
    config = copy.deepcopy(spec.config)
    if shape is not None and not tiny:
        for key, value in copy.deepcopy(shape).items():
            setattr(config, key, value)
    return (f"tiny {name}" if tiny else label), config, lora


def build(job: dict):
    """The job's model (LoRA-wrapped where its row says so), patched and checkpointed as its provider says,
    and its optimizer."""
    import torch
    import transformers

    import tigon

    parts = set(job["provider"].split("+"))
    device = torch.device(job["device"])
    label, config, lora = model_config(job["model"], tiny=job["tiny"])
    if "liger" in parts:
        e2e.apply_liger("llama")
    torch.manual_seed(SEED)
    dtype = torch.bfloat16 if lora else torch.float32
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS))
    if "tigon" in parts:
        long = "long" in parts
        tigon.patch(model, offload_activations=long, tiled_mlp=long)
    if "ckpt" in parts or "long" in parts:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, fused=device.type == "cuda")
    return label, model, optimizer


def run_job(job: dict) -> dict:
    """Train ``job["steps"]`` steps of batch 1 x ``job["seq"]`` tokens; inside a fresh process."""
    import torch

    from tigon.patching.parts.long_context import offloader_of

    device = torch.device(job["device"])
    cuda = device.type == "cuda"
    label, model, optimizer = build(job)
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
    return out


def job_main(line: str) -> int:
    job = json.loads(line)
    started = time.perf_counter()
    try:
        result = run_job(job)
    except Exception as exc:  # an error is a result: out of memory is what the search looks for
        oom = e2e._is_oom(exc)
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        result = {**job, "error": "out of memory" if oom else f"{type(exc).__name__}: {first_line}", "oom": oom}
    result["wall_s"] = time.perf_counter() - started
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


def probe(job: dict, timeout: int) -> dict:
    """Run ``job`` in a fresh Python process; its result line, or the error that ended it."""
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, "--job", json.dumps(job)], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**job, "error": f"timed out after {timeout} s", "wall_s": time.perf_counter() - started}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    errors = done.stderr.strip().splitlines()
    return {**job, "error": f"exited with status {done.returncode}: {' | '.join(errors[-3:])[:400]}",
            "wall_s": time.perf_counter() - started}


# ------------------------------------------------------------------------------------------- search


PROBE_KEYS = ("seq", "error", "oom", "peak_bytes", "tokens_per_s", "host_bytes", "peak_host_bytes", "wall_s",
              "device", "label", "losses")


def search(args, model: str, provider: str, run=probe, log=print) -> dict:
    probes = []

    def trains(seq: int) -> bool:
        job = {"model": model, "provider": provider, "seq": seq, "steps": STEPS, "device": args.device,
               "tiny": args.tiny}
        result = run(job, args.timeout)
        probes.append({k: result.get(k) for k in PROBE_KEYS if k in result})
        log(probe_line(provider, result))
        return "error" not in result

    longest, first_failure = e2e.search_longest(trains, step=args.step, start=args.start, maximum=args.max_tokens)
    by_seq = {p["seq"]: p for p in probes}
    at_longest = by_seq.get(longest, {})
    return {
        "model": model, "provider": provider, "longest_seq": longest, "first_failure": first_failure,
        "failure": by_seq.get(first_failure, {}).get("error"),
        "tokens_per_s_at_32k": by_seq.get(THROUGHPUT_SEQ, {}).get("tokens_per_s"),
        "tokens_per_s_at_longest": at_longest.get("tokens_per_s"),
        "peak_bytes_at_longest": at_longest.get("peak_bytes"),
        "host_bytes_at_longest": at_longest.get("host_bytes"),
        "label": next((p["label"] for p in probes if p.get("label")), model),
        "device": next((p["device"] for p in probes if p.get("device")), None),
        "probes": sorted(probes, key=lambda p: p["seq"]),
    }


def probe_line(provider: str, result: dict) -> str:
    head = f"{result['model']:>14} {provider:>11} {result['seq']:>7} tokens: "
    if "error" in result:
        return head + result["error"]
    line = f"{result['tokens_per_s']:.0f} tokens/s"
    if result.get("peak_bytes") is not None:
        line += f", peak {result['peak_bytes'] / GIB:.1f} GiB"
    if result.get("host_bytes"):
        line += f", host {result['host_bytes'] / GIB:.1f} GiB"
    return head + line + f" ({result.get('wall_s', 0):.0f} s)"


# ------------------------------------------------------------------------------------------- output


def _cell(value, fmt) -> str:
    return "—" if value is None else fmt.format(value)


def markdown(result: dict) -> str:
    lines = [f"# Longest context at batch 1 — {result['device']} — {result['date']}", ""]
    versions = result.get("versions") or {}
    if versions:
        lines += [", ".join(f"{k} {v}" for k, v in versions.items()), ""]
    settings = result.get("settings", {})
    lines += [f"Lengths: multiples of {settings.get('step')} up to {settings.get('max_tokens')}; a length counts "
              f"when {STEPS} optimizer steps train; tokens/s from the second step.", ""]
    for model in dict.fromkeys(r["model"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["model"] == model]
        lines += [f"## {rows[0]['label']}", "",
                  "| provider | longest (tokens) | tokens/s at 32K | tokens/s at longest | peak GPU GiB at longest "
                  "| offload host GiB | first failure |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in rows:
            failure = "—" if r["first_failure"] is None else f"{r['first_failure']}: {r['failure']}"
            lines.append(
                f"| {PROVIDER_TITLES[r['provider']]} | {r['longest_seq'] or 'none'} "
                f"| {_cell(r['tokens_per_s_at_32k'], '{:.0f}')} | {_cell(r['tokens_per_s_at_longest'], '{:.0f}')} "
                f"| {_cell(r['peak_bytes_at_longest'] and r['peak_bytes_at_longest'] / GIB, '{:.1f}')} "
                f"| {_cell(r['host_bytes_at_longest'] and r['host_bytes_at_longest'] / GIB, '{:.1f}')} "
                f"| {failure} |")
        lines.append("")
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
            points = [(p["seq"], p["tokens_per_s"]) for p in row["probes"] if p.get("tokens_per_s")]
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
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
    fig.suptitle(f"tokens/s against context length (★ longest) — {result['device']} — {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(result: dict, out_dir: Path, log=print) -> list[Path]:
    return e2e.write_result(result, out_dir, "context", markdown, plot, log)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.job is not None:
        return job_main(args.job)
    import torch

    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # inherited by the probes, before they import tigon.ops
    elif not torch.cuda.is_available():
        print("benchmarks/context.py needs a CUDA GPU (--device cpu --tiny runs a smoke test of the pipeline).",
              file=sys.stderr)
        return 2
    from tigon.bench.harness import versions

    started = time.perf_counter()
    rows = [search(args, model, provider) for model in args.models for provider in args.providers]
    named = [r["device"] for r in rows if r.get("device") not in (None, "cuda", "cpu")]
    result = {
        "kind": "context", "rows": rows, "device": next(iter(named), args.device),
        "date": _dt.date.today().isoformat(), "versions": versions(),
        "settings": {"models": args.models, "providers": args.providers, "skipped": args.skipped,
                     "step": args.step, "start": args.start, "max_tokens": args.max_tokens, "tiny": args.tiny,
                     "steps": STEPS, "lr": LR, "seed": SEED, "lora": {"r": LORA_RANK, "alpha": LORA_ALPHA,
                                                                       "targets": LORA_TARGETS}},
        "wall_s": time.perf_counter() - started,
    }
    paths = save(result, args.out)
    print(f"\nwrote {', '.join(str(p) for p in paths)} ({result['wall_s']:.0f} s)\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
