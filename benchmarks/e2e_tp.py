"""Tensor-parallel training on the GPUs of one host: stock vs tigon, transformers' ``tp_plan="auto"``.

    python benchmarks/e2e_tp.py                                         # Llama-3.2-1B-shaped, 2 GPUs
    python benchmarks/e2e_tp.py --models llama qwen2 --gpus 2 --steps 10
    python benchmarks/e2e_tp.py --device cpu --tiny --warmup 1 --steps 1   # pipeline smoke test (gloo)

What is measured. The benchmark's model (``tigon.bench.models``: the shapes ``benchmarks/e2e.py``
trains, random weights with the same seed) is saved once, then each provider is one ``torchrun``
launch of ``--gpus`` processes that load it with ``from_pretrained(path, tp_plan="auto")``: the
attention and MLP projections split by columns and rows over the ranks, the LM head split by
classes (transformers' ``colwise_gather_output``). ``stock`` trains it as loaded; ``tigon`` patches it
first (``tigon.patch(model)``): under tensor parallelism the split projections keep their own
forwards, the norms, joins, rotary and activations are tigon's, and the loss runs over each rank's
classes of the head (``tigon.ops.vocab_parallel_cross_entropy``) where stock gathers every rank's
logits onto every rank. Every rank trains on the same batch (tensor parallelism splits the model, not
the data): fp32 weights, bf16 autocast, fused AdamW (the DTensor and the plain parameters in two
groups), batch × seq tokens a step. Reported: tokens/s from the median step time after the warm-up
(each step synchronised by ``loss.item()``), the largest peak allocated memory over the ranks, and the
per-step losses of tigon against stock's.

Results go to ``benchmarks/results/e2e-tp-<device>-<date>.{json,md}``, and one line to
``benchmarks/results/history.jsonl`` (``--history PATH``; none for a smoke run); the markdown is
printed last.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks.e2e import LR, SEED, batch_for, model_spec  # noqa: E402
from tigon.bench import history  # noqa: E402

MODELS = ("llama",)
PROVIDERS = ("stock", "tigon")
SEQ = 2048
WARMUP = 3
STEPS = 10
RESULT_MARK = "E2E-TP-RESULT "
JOB_TIMEOUT_S = 600
GIB = 2**30
OUT = ROOT / "benchmarks" / "results"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="model_types (default: llama)")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--gpus", type=int, default=2, help="ranks (one GPU each; processes on the CPU)")
    parser.add_argument("--batch", type=int, help="sequences per step (default: e2e.py's, Gemma-2 2)")
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny configs instead of the published shapes")
    parser.add_argument("--out", type=Path, default=OUT)
    history.add_argument(parser)
    parser.add_argument("--worker", nargs=2, metavar=("JOB_JSON", "MODEL_DIR"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------- worker


def run_worker(job: dict, model_dir: str) -> None:
    """One rank of one (model, provider): load split, train, report (rank 0) on stdout."""
    import torch
    import torch.distributed as dist

    cuda = job["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        from tigon._interpreter import apply_interpreter_fixes

        apply_interpreter_fixes()
    import transformers

    import tigon

    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
    model.train()
    if job["provider"] == "tigon":
        tigon.patch(model)
    # Split projections hold DTensors, the norms plain tensors: one fused AdamW launch takes one kind,
    # so each kind is its own parameter group.
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [{"params": [p for p in params if isinstance(p, DTensor)]},
              {"params": [p for p in params if not isinstance(p, DTensor)]}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=LR, fused=cuda)
    batch, seq, warmup, steps = job["batch"], job["seq"], job["warmup"], job["steps"]
    gen = torch.Generator(device=device).manual_seed(SEED)
    data = torch.randint(job["vocab"], (warmup + steps, batch, seq), device=device, generator=gen)
    losses, seconds = [], []
    for step in range(warmup + steps):
        if step == warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=data[step], labels=data[step]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds[warmup:])
    peak = torch.tensor(float(torch.cuda.max_memory_allocated() if cuda else 0), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        result = {**job, "losses": losses, "step_seconds": seconds, "median_step_s": median,
                  "tokens_per_s": batch * seq / median, "peak_bytes": peak.item(),
                  "gpu": torch.cuda.get_device_name(device) if cuda else "cpu"}
        print(RESULT_MARK + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- parent


def save_model(model_type: str, tiny: bool, path: Path):
    import torch

    from tigon.bench.models import build_model

    spec = model_spec(model_type, tiny=tiny)
    torch.manual_seed(SEED)
    model = build_model(spec.config, device="cpu")
    model.save_pretrained(path)
    return spec


def launch(job: dict, model_dir: Path, gpus: int) -> dict:
    path = os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    if job["device"] == "cpu":
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus), "--master_addr",
           "127.0.0.1", "--master_port", str(_free_port()), str(Path(__file__).resolve()), "--worker",
           json.dumps(job), str(model_dir)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    return {**job, "error": (done.stderr or done.stdout)[-3000:]}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def markdown(result: dict) -> str:
    lines = [f"# Tensor-parallel training, {result['gpus']} ranks ({result['gpu']})", "",
             f"{result['versions']}; {result['date']}. Batch × seq tokens a step on every rank (the same batch); "
             "fp32 weights, bf16 autocast, AdamW; median of the timed steps.", "",
             "| model | provider | tokens/s | × stock | step ms | peak GiB (largest rank) | max loss diff vs stock |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for model in result["models"]:
        rows = {r["provider"]: r for r in result["rows"] if r["model"] == model}
        stock = rows.get("stock")
        for provider, row in rows.items():
            if "error" in row:
                lines.append(f"| {row['label']} | {provider} | error: {row['error'].splitlines()[-1][:120]} | | | | |")
                continue
            speed = (f"{row['tokens_per_s'] / stock['tokens_per_s']:.2f}×"
                     if stock and "error" not in stock else "—")
            diff = (max(abs(a - b) / abs(b) for a, b in zip(row["losses"], stock["losses"], strict=True))
                    if stock and "error" not in stock else float("nan"))
            lines.append(f"| {row['label']}, {row['batch']} × {row['seq']} | {provider} "
                         f"| {row['tokens_per_s'] / 1e3:.1f}k | {speed} | {row['median_step_s'] * 1e3:.1f} "
                         f"| {row['peak_bytes'] / GIB:.1f} | {diff:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(json.loads(args.worker[0]), args.worker[1])
        return 0
    import torch
    import transformers

    rows = []
    with tempfile.TemporaryDirectory(prefix="tigon-tp-") as tmp:
        for model_type in args.models:
            path = Path(tmp) / model_type
            spec = save_model(model_type, args.tiny, path)
            for provider in args.providers:
                job = {"model": model_type, "label": spec.label, "provider": provider, "vocab": spec.config.vocab_size,
                       "batch": batch_for(model_type, args.batch), "seq": args.seq, "warmup": args.warmup,
                       "steps": args.steps, "device": args.device}
                row = launch(job, path, args.gpus)
                rows.append(row)
                print(f"{model_type} {provider}: " + (f"{row['tokens_per_s']:.0f} tokens/s, peak "
                      f"{row['peak_bytes'] / GIB:.1f} GiB" if "error" not in row else row["error"][-500:]), flush=True)
    date = _dt.date.today().isoformat()
    gpu = next((r["gpu"] for r in rows if "gpu" in r), args.device)
    result = {"date": date, "gpus": args.gpus, "gpu": gpu, "models": args.models, "rows": rows,
              "versions": f"torch {torch.__version__}, transformers {transformers.__version__}"}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"e2e-tp-{args.device}-{date}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    stem.with_suffix(".md").write_text(text)
    target = history.script_path(args)
    if target is not None:
        history.append(result, benchmark="e2e-tp", path=target)
        print(f"appended the run to {target}")
    print(text)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
