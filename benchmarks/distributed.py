"""FSDP2 training on the GPUs of one host: tokens/s and memory per GPU, stock vs tigon vs Liger-Kernel.

    torchrun --nproc-per-node 8 benchmarks/distributed.py                      # Llama-3.1-8B-shaped, 1 x 8192
    torchrun --nproc-per-node 8 benchmarks/distributed.py --model llama-3b --batch 2 --seq 4096
    torchrun --nproc-per-node 8 benchmarks/distributed.py --tp 2               # 2-D: FSDP2 over 4, TP over 2
    torchrun --nproc-per-node 8 benchmarks/distributed.py --ckpt               # gradient checkpointing
    torchrun --nproc-per-node 2 benchmarks/distributed.py --device cpu --model tiny --precision fp32 --seq 16 \
        --warmup 1 --steps 1                                                   # pipeline smoke test (gloo)

One invocation measures one world size (however many ranks torchrun starts); rank 0 merges its rows
into the JSON of the same ``--out``, device and date (keyed by model, world size, tensor-parallel
degree, batch × seq, checkpointing and precision), and writes the page and the plot from every row
there: run it once per world size (1, 2, 4, 8) to fill the page.

What is measured. Every rank builds the model from its config with random weights (the same seed on
every rank and for every provider: the same model), sdpa attention, fp32 weights; then, in this
order, the provider's patch, transformers' gradient checkpointing (``--ckpt``, non-reentrant),
``fully_shard`` on each decoder layer and then the root, with
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (``--precision fp32``: none,
for the CPU smoke test), and AdamW (fused on the GPU) over the fp32 shards. A step is forward with
labels (the loss inside the model), backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``
and ``loss.item()`` (which synchronises): ``--warmup`` untimed steps, then ``--steps`` timed ones.
Each data-parallel rank trains on its own random tokens, ``--batch`` × ``--seq`` a step, the same for
every provider.

2-D (``--tp`` T > 1): ``init_device_mesh(device, (W / T, T), mesh_dim_names=("dp", "tp"))``;
transformers' own tensor-parallel plan for the family (``apply_tensor_parallelism``: the attention
and MLP projections split by columns and rows over "tp", the LM head by classes) before the
provider's patch, then ``fully_shard`` over "dp". The ranks of one "tp" group train on the same batch.

Providers, in this order in every rank's process: ``stock`` (transformers as shipped), ``tigon``
(``tigon.patch(model)`` before ``fully_shard``), ``liger`` (Liger-Kernel's
``apply_liger_kernel_to_llama()`` before the model is built; last, since it replaces the family's
classes' forwards for the rest of the process; skipped, with the reason recorded, where
``liger_kernel`` does not import).

Reported per provider and world size W (see ``DEFINITIONS`` for the page's words):
tokens/s per GPU (median step, and the range over the timed steps), model FLOPs per token
(:func:`flops_per_token`), the fraction of the H200's dense bf16 peak it reaches, scaling efficiency
against the smallest world size measured, the peak allocated memory of the largest rank, the
optimizer state and activation memory per rank, and the per-step losses (averaged over the ranks)
against stock's.

Results: ``<out>/distributed-<device>-<date>.{json,md,png}`` (``--out``, default benchmarks/results/),
the plot tokens/s per GPU against the world size, a line per provider; one line to
``benchmarks/results/history.jsonl`` per invocation (``--history PATH``; none for a smoke run).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib.util
import inspect
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks import e2e  # noqa: E402
from benchmarks.context import LLAMA_3_1_8B  # noqa: E402
from benchmarks.lora import matmul_tflops  # noqa: E402
from tigon.bench import history  # noqa: E402

PROVIDERS = ("stock", "tigon", "liger")  # the order every rank runs them in (Liger's patch is global)
PROVIDER_TITLES = {"stock": "stock", "tigon": "tigon", "liger": "Liger-Kernel"}
COLOURS = {"stock": "tab:gray", "tigon": "tab:orange", "liger": "tab:green"}
MODELS = {
    "llama-8b": ("Llama-3.1-8B-shaped", LLAMA_3_1_8B),
    "llama-3b": ("Llama-3.2-3B-shaped", e2e.LLAMA_3_2_3B),
    "tiny": ("tiny Llama", None),  # tigon.bench.models' tiny shape, untied (transformers' TP plan splits the head)
}
BATCH = 1
SEQ = 8192
WARMUP = 3
STEPS = 10
LR = 1e-4
SEED = 0
GIB = 2**30
RESULT_KIND = "distributed"
OUT = ROOT / "benchmarks" / "results"

# The H200's dense bf16 tensor-core peak: NVIDIA's H200 datasheet gives 1,979 TFLOP/s for BF16 Tensor
# Core "with sparsity" (2:4 structured sparsity doubles the dense rate), so 989.5 dense. The repository
# has no measured H200 large-matmul rate; each run also times a bf16 MATMUL_SIZE³ product on its device
# (benchmarks/lora.py's matmul_tflops) and reports the share of that too.
H200_BF16_DENSE_TFLOPS = 989.5
H200_PEAK_SOURCE = "https://www.nvidia.com/en-us/data-center/h200/"
MATMUL_SIZE = 8192

TORCHTITAN_URL = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
TARGETS = (
    "8 × H200, Llama-3.1-8B-shaped, FSDP2, 8192 tokens per GPU: tigon ≥ 1.3× stock's tokens/s per GPU and "
    "≥ 8,000 tokens/s per GPU in bf16",
    "scaling efficiency from 2 to 8 GPUs ≥ stock's",
    "activation memory per rank ≤ 0.75× Liger-Kernel's",
    f"anchor: torchtitan's published Llama-3.1-8B FSDP figure on 8 × H100 ({TORCHTITAN_URL}, table 1: local "
    "batch 2, selective activation checkpointing, 500 W): 5,762 tokens/s per GPU, 6,667 with torch.compile",
)
DEFINITIONS = (
    "**tokens/s per GPU**: batch × seq ÷ T tokens (the ranks of a tensor-parallel group share a batch) over the "
    "median step time of the timed steps (each step synchronised by `loss.item()`; the slowest rank's "
    "median); the range is the fastest and slowest timed step's.",
    "**model FLOPs per token**: 6·N + 12·L·d·S, N the weights of the matrix products (the decoder's "
    "projections and the LM head; not the embedding), L layers, d = heads × head_dim, S the sequence: "
    "6·N for the products' forward and backward, 12·L·d·S for QKᵀ and PV over the full S × S square "
    "(torchtitan's and PaLM's convention: causal attention computes about half). Checkpointing's "
    "recomputed forward is not counted.",
    f"**of peak**: FLOPs per token × tokens/s per GPU ÷ the H200's dense bf16 peak, {H200_BF16_DENSE_TFLOPS:g} "
    f"TFLOP/s (NVIDIA's datasheet, {H200_PEAK_SOURCE}: 1,979 with sparsity, halved); **of matmul**: ÷ the "
    f"rate a bf16 {MATMUL_SIZE}³ `torch.mm` reached on the same GPU in the same run.",
    "**scaling**: tokens/s per GPU at W ÷ tokens/s per GPU at the smallest world size measured for the same "
    "model, provider and settings (W = 1 where it fits; the column says which).",
    "**state per rank**: the bytes of this rank's shards of the fp32 weights, their gradients and AdamW's "
    "moments (and step counters) after the first step; **activation per rank**: the peak allocated "
    "memory of the timed steps minus the state, i.e. everything else at the peak: tensors saved for the "
    "backward, the all-gathered bf16 layers, logits and loss buffers, communication buffers.",
    "**loss Δ**: the largest relative difference of a step's loss (averaged over the ranks) from stock's, "
    "over every step (same seed, weights and data).",
)


# ------------------------------------------------------------------------------------------- args


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="llama-8b")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS),
                        help="liger is skipped (and reported so) where liger_kernel does not import")
    parser.add_argument("--batch", type=int, default=BATCH, help="sequences per step on each data-parallel rank")
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree inside FSDP2 (1: FSDP2 alone)")
    parser.add_argument("--ckpt", action="store_true", help="gradient checkpointing on every decoder layer")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="FSDP2's parameter dtype (fp32: no MixedPrecisionPolicy)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps (at least 1)")
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: gloo and Triton's interpreter, a smoke test of the pipeline (no real numbers)")
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the JSON, markdown and plot")
    history.add_argument(parser)
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1 (the first step creates AdamW's moments)")
    if args.tp < 1 or args.batch < 1 or args.seq < 1:
        parser.error("--tp, --batch and --seq must be positive")
    args.providers = [p for p in PROVIDERS if p in args.providers]
    args.skipped = []
    if "liger" in args.providers and importlib.util.find_spec("liger_kernel") is None:
        args.providers.remove("liger")
        args.skipped.append("liger (liger_kernel does not import)")
    args.tiny = args.model == "tiny"
    return args


# ------------------------------------------------------------------------------------------- model


def model_config(name: str):
    """The model's transformers config: a published Llama shape over tigon.bench.models' Llama config,
    or its tiny config untied."""
    import copy

    from tigon.bench.models import model_config as family_config

    spec = family_config("llama", tiny=True if name == "tiny" else False)
    config = copy.deepcopy(spec.config)
    _, shape = MODELS[name]
    for key, value in copy.deepcopy(shape or {"tie_word_embeddings": False}).items():
        setattr(config, key, value)
    config.use_cache = False
    return config


def flops_per_token(config, seq: int) -> dict:
    """Model FLOPs per trained token (``DEFINITIONS``)::

        q = heads·head_dim, kv = kv_heads·head_dim, H hidden, I intermediate, V vocabulary, L layers
        N         = L·(H·q + 2·H·kv + q·H + 3·H·I) + V·H   the weights every token passes through a product
                                                         with: q/k/v/o, gate/up/down, the LM head (tied or
                                                         not: one V×H product)
        products  = 6·N                                  2·N forward, 4·N backward (input and weight grads)
        attention = 12·L·q·seq                           QKᵀ and PV, 2·q·seq each a token forward over the full
                                                         square, ×3 with the backward
    """
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    matmul_params = layers * (hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * config.intermediate_size)
    matmul_params += config.vocab_size * hidden
    products, attention = 6 * matmul_params, 12 * layers * q * seq
    return {"matmul_params": matmul_params, "products": products, "attention": attention,
            "total": products + attention}


def apply_tensor_parallel(model, tp_mesh) -> None:
    """transformers' tensor-parallel plan of the model's class over ``tp_mesh`` (what
    ``from_pretrained(tp_plan="auto")`` applies before loading): each weight split as a DTensor (each rank
    keeps its shard of the weights it built: every rank built the same ones), each split module's forward
    set to redistribute.

    transformers changed the function between the releases tigon supports: 5.17's
    ``apply_tensor_parallelism(model, tp_mesh)`` reads ``model.tp_plan`` and matches its wildcards itself;
    5.25's takes the plan, its wildcards expanded to the layers by the caller (``model._expand_parallel_plan``,
    which 5.17 lacks), and reads ``model._mesh_manager``. The function's own parameters say which it is."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    if "tp_plan" not in inspect.signature(apply_tensor_parallelism).parameters:
        apply_tensor_parallelism(model, tp_mesh)
        return
    model._mesh_manager = None  # read by the expert-parallel styles only; the Llama plan has none
    apply_tensor_parallelism(model, tp_mesh, model._expand_parallel_plan(dict(model.tp_plan)))


def build(provider: str, args, device, mesh):
    """The provider's model on ``device``: built, split over "tp", patched, checkpointed, sharded over
    "dp"."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import tigon
    from tigon.bench.models import build_model

    if provider == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    torch.manual_seed(SEED)
    model = build_model(model_config(args.model), device=device)
    if args.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if provider == "tigon":
        tigon.patch(model)
    if args.ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if args.precision == "bf16" else MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    return model


def param_groups(model) -> list[dict]:
    """The parameters grouped by their device mesh: under FSDP2 × TP the split projections' shards live on
    the 2-D ("dp", "tp") mesh and the rest on "dp" alone, and one fused AdamW launch takes DTensors of one
    mesh (each group is its own launch)."""
    groups: dict[object, list] = {}
    for p in model.parameters():
        groups.setdefault(id(getattr(p, "device_mesh", None)), []).append(p)
    return [{"params": params} for params in groups.values()]


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def state_bytes(model, optimizer) -> int:
    """This rank's shards of the weights, of as many gradients, and of the optimizer's state."""
    params = sum(_local_bytes(p) for p in model.parameters())
    moments = sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel"))
    return 2 * params + moments


# ------------------------------------------------------------------------------------------- ranks


def run_provider(provider: str, args, device, mesh) -> dict:
    """Train ``warmup + steps`` steps of the provider's model on this rank; this rank's measurements."""
    import torch
    import torch.distributed as dist

    cuda = device.type == "cuda"
    model = build(provider, args, device, mesh)
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR, fused=cuda)
    dp_rank = mesh["dp"].get_local_rank()
    gen = torch.Generator(device=device).manual_seed(SEED * 1000 + dp_rank)
    vocab = model.config.vocab_size
    data = torch.randint(vocab, (args.warmup + args.steps, args.batch, args.seq), device=device, generator=gen)
    losses, seconds, state = [], [], 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = model(input_ids=data[step], labels=data[step]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # synchronises: the step time is the device's
        seconds.append(time.perf_counter() - start)
        mean = torch.tensor(value, device=device)
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        if step == 0:
            state = state_bytes(model, optimizer)
    out = {"losses": losses, "step_seconds": seconds, "state_bytes": state,
           "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}
    del model, optimizer, data
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def _row(provider: str, args, ranks: list[dict], world: int, config) -> dict:
    """One provider's row from every rank's measurements (rank order)."""
    row = {"model": args.model, "label": MODELS[args.model][0], "provider": provider, "world": world,
           "tp": args.tp, "batch": args.batch, "seq": args.seq, "ckpt": args.ckpt, "precision": args.precision,
           "warmup": args.warmup, "steps": args.steps}
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {**row, "error": errors[0]}
    medians = [statistics.median(r["step_seconds"][args.warmup:]) for r in ranks]
    slowest = max(range(len(ranks)), key=lambda i: medians[i])
    timed = ranks[slowest]["step_seconds"][args.warmup:]
    tokens = args.batch * args.seq / args.tp  # a rank's share of its tensor-parallel group's batch
    flops = flops_per_token(config, args.seq)
    peaks = [r["peak_bytes"] for r in ranks]
    row.update(
        median_step_s=medians[slowest], tokens_per_s_per_gpu=tokens / medians[slowest],
        tokens_per_s_range=[tokens / max(timed), tokens / min(timed)], flops_per_token=flops,
        losses=ranks[0]["losses"], step_seconds=ranks[slowest]["step_seconds"],
        state_bytes=max(r["state_bytes"] for r in ranks),
    )
    row["tflops_per_gpu"] = flops["total"] * row["tokens_per_s_per_gpu"] / 1e12
    if all(p is not None for p in peaks):
        worst = max(range(len(ranks)), key=lambda i: peaks[i])
        row.update(peak_bytes=peaks[worst], activation_bytes=peaks[worst] - ranks[worst]["state_bytes"])
    return row


def run_ranks(args) -> list[dict] | None:
    """Every provider on this rank; rank 0 returns the rows (the others None)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        from tigon._interpreter import apply_interpreter_fixes

        apply_interpreter_fixes()
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    config = model_config(args.model)
    rows = []
    for provider in args.providers:
        try:
            mine = run_provider(provider, args, device, mesh)
        except Exception as exc:  # an out-of-memory on every rank, an unsupported composition: its row says so
            mine = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        gc.collect()  # after the except block: the traceback no longer holds the failed run's model
        if cuda:
            torch.cuda.empty_cache()
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
        rows.append(_row(provider, args, ranks, world, config))
        if dist.get_rank() == 0:
            print(line(rows[-1]), flush=True)
    extra = {"matmul_tflops": matmul_tflops(device, MATMUL_SIZE) if cuda else None,
             "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    for row in rows:
        row.update(extra)
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    return rows if rank == 0 else None


# ------------------------------------------------------------------------------------------- report


def row_key(row: dict) -> tuple:
    """What one measurement is: a later run with the same key replaces the row."""
    return (row["model"], row["provider"], row["world"], row["tp"], row["batch"], row["seq"], row["ckpt"],
            row["precision"])


def group_key(row: dict) -> tuple:
    """The rows one table (and one plot panel) compares: everything but the provider and world size."""
    return (row["model"], row["tp"], row["batch"], row["seq"], row["ckpt"], row["precision"])


def merge(old: dict | None, new: dict) -> dict:
    """``new`` over ``old``: rows replaced by key, commands and skipped providers collected by world size."""
    old = old or {"rows": []}
    rows = {row_key(r): r for r in old["rows"]}
    rows.update({row_key(r): r for r in new["rows"]})
    ordered = sorted(rows.values(), key=lambda r: (group_key(r), r["world"], PROVIDERS.index(r["provider"])))
    add_comparisons(ordered)
    return {**new, "rows": ordered, "commands": {**old.get("commands", {}), **new["commands"]},
            "skipped": sorted(set(old.get("skipped", [])) | set(new.get("skipped", [])))}


COMPARISONS = ("max_loss_rel_diff", "vs_stock", "scaling_base_world", "scaling")


def add_comparisons(rows: list[dict]) -> None:
    """Each row's loss Δ against stock's run of the same key, and its scaling against the smallest world size
    (recomputed over the merged rows)."""
    by_key = {row_key(r): r for r in rows}
    for row in rows:
        for key in COMPARISONS:
            row.pop(key, None)
    for row in rows:
        if "error" in row:
            continue
        stock = by_key.get(row_key({**row, "provider": "stock"}))
        if stock is not None and "losses" in stock and row["provider"] != "stock":
            row["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], stock["losses"],
                                                                                strict=True))
            row["vs_stock"] = row["tokens_per_s_per_gpu"] / stock["tokens_per_s_per_gpu"]
        same = [r for r in rows if group_key(r) == group_key(row) and r["provider"] == row["provider"]
                and "error" not in r]
        base = min(same, key=lambda r: r["world"])
        row["scaling_base_world"] = base["world"]
        row["scaling"] = row["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]


def _gib(value) -> str:
    return "—" if value is None else f"{value / GIB:.1f}"


def line(row: dict) -> str:
    head = f"{row['model']} W={row['world']} tp={row['tp']} {row['provider']}:"
    if "error" in row:
        return f"{head} error: {row['error'][:300]}"
    low, high = row["tokens_per_s_range"]
    return (f"{head} {row['tokens_per_s_per_gpu']:.0f} tokens/s per GPU ({low:.0f}–{high:.0f}), peak "
            f"{_gib(row.get('peak_bytes'))} GiB, activation {_gib(row.get('activation_bytes'))} GiB, "
            f"losses {', '.join(f'{v:.5f}' for v in row['losses'][:3])}")


def _of_peak(row: dict, device: str) -> str:
    return f"{row['tflops_per_gpu'] / H200_BF16_DENSE_TFLOPS:.1%}" if "H200" in device else "—"


def _cells(row: dict, device: str) -> list[str]:
    """A measured row's cells after the provider's."""
    low, high = row["tokens_per_s_range"]
    matmul = row.get("matmul_tflops")
    diff = row.get("max_loss_rel_diff")
    return [f"{row['tokens_per_s_per_gpu']:,.0f} ({low:,.0f}–{high:,.0f})",
            f"{row['vs_stock']:.2f}×" if "vs_stock" in row else "—",
            f"{row['tflops_per_gpu']:.3g}", _of_peak(row, device),
            f"{row['tflops_per_gpu'] / matmul:.1%}" if matmul else "—",
            f"{row['scaling']:.2f} (vs {row['scaling_base_world']})",
            _gib(row.get("peak_bytes")), _gib(row["state_bytes"]), _gib(row.get("activation_bytes")),
            f"{row['losses'][0]:.4f}", "—" if diff is None else f"{diff:.1e}"]


TABLE_HEAD = ("GPUs", "provider", "tokens/s per GPU (range)", "× stock", "TFLOP/s per GPU", "of peak", "of matmul",
              "scaling", "peak GiB", "state GiB", "activation GiB", "first loss", "loss Δ")


def _table(rows: list[dict], device: str) -> list[str]:
    lines = ["| " + " | ".join(TABLE_HEAD) + " |", "|" + " --- |" * len(TABLE_HEAD)]
    for row in rows:
        if "error" in row:
            cells = [f"error: {row['error'].splitlines()[-1][:160]}"] + [""] * (len(TABLE_HEAD) - 3)
        else:
            cells = _cells(row, device)
        lines.append("| " + " | ".join([str(row["world"]), PROVIDER_TITLES[row["provider"]], *cells]) + " |")
    return lines


def target_lines(rows: list[dict]) -> list[str]:
    """What the measured rows say about ``TARGETS``: Llama-3.1-8B-shaped, FSDP2 alone, bf16, no
    checkpointing, 8192 tokens per GPU; a line only where its rows exist."""
    def pick(provider, world):
        return next((r for r in rows if r["model"] == "llama-8b" and r["tp"] == 1 and r["precision"] == "bf16"
                     and not r["ckpt"] and r["batch"] * r["seq"] == 8192 and r["provider"] == provider
                     and r["world"] == world and "error" not in r), None)

    out = []
    stock, tigon, liger = pick("stock", 8), pick("tigon", 8), pick("liger", 8)
    if tigon is not None:
        speed = f"{tigon['vs_stock']:.2f}× stock, " if stock is not None else ""
        out.append(f"8 GPUs: tigon {speed}{tigon['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU")
    pairs = [(p, pick(p, 2), pick(p, 8)) for p in ("stock", "tigon")]
    scaled = [f"{p} {high['tokens_per_s_per_gpu'] / low['tokens_per_s_per_gpu']:.2f}" for p, low, high in pairs
              if low is not None and high is not None]
    if scaled:
        out.append("scaling efficiency 2 → 8 GPUs: " + ", ".join(scaled))
    if tigon is not None and liger is not None and tigon.get("activation_bytes") and liger.get("activation_bytes"):
        out.append(f"activation per rank, 8 GPUs: tigon {tigon['activation_bytes'] / liger['activation_bytes']:.2f}× "
                   "Liger-Kernel's")
    return out


def markdown(result: dict) -> str:
    rows = result["rows"]
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v)
    lines = ["# FSDP2 training on the GPUs of one host", "", "| | |", "| --- | --- |",
             f"| Device | {result['device']} |", f"| Versions | {versions} |", f"| Date | {result['date']} |"]
    for text, world in sorted(result["commands"].items(), key=lambda kv: (kv[1], kv[0])):
        lines.append(f"| Command, {world} GPU{'s' if world > 1 else ''} | `{text}` |")
    lines += ["", "Targets (the plan's):", ""]
    lines += [f"- {t}" for t in TARGETS]
    lines += ["", "Against them, from the rows below:", ""]
    lines += [f"- {t}" for t in target_lines(rows)] or ["- not measured yet (the 8-GPU Llama-3.1-8B-shaped rows)"]
    lines += ["", "`fully_shard` on each decoder layer, then the root; `MixedPrecisionPolicy(param_dtype=bfloat16, "
              "reduce_dtype=float32)` (fp32 rows: none), fp32 weights and AdamW; each data-parallel rank its own "
              "random tokens. Definitions:", ""]
    lines += [f"- {d}" for d in DEFINITIONS]
    for key in dict.fromkeys(group_key(r) for r in rows):
        model, tp, batch, seq, ckpt, precision = key
        group = [r for r in rows if group_key(r) == key]
        title = (f"{group[0]['label']}, {batch} × {seq} tokens per {'tensor-parallel group' if tp > 1 else 'GPU'}"
                 f", {'FSDP2 × TP ' + str(tp) if tp > 1 else 'FSDP2'}, {precision}"
                 + (", gradient checkpointing" if ckpt else ""))
        lines += ["", f"## {title}", ""] + _table(group, result["device"])
    if result.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(result["skipped"]) + "."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """tokens/s per GPU against the world size, a line per provider, a panel per table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(group_key(r) for r in result["rows"]))
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.2), squeeze=False)
    for ax, key in zip(axes[0], groups, strict=True):
        rows = [r for r in result["rows"] if group_key(r) == key and "error" not in r]
        for provider in PROVIDERS:
            points = sorted((r["world"], r["tokens_per_s_per_gpu"]) for r in rows if r["provider"] == provider)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=PROVIDER_TITLES[provider],
                        color=COLOURS[provider])
        worlds = sorted({r["world"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(worlds, [str(w) for w in worlds])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("tokens/s per GPU")
        ax.set_title(f"{key[0]}, {key[2]} × {key[3]}, tp {key[1]}" + (", ckpt" if key[4] else ""), fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"FSDP2 — {result['device']} — {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(result: dict, out_dir: Path, log=print) -> list[Path]:
    """The merged JSON, page and plot (the rows of an earlier run in the same files kept unless replaced)."""
    stem = out_dir / f"{RESULT_KIND}-{result['device'].replace(' ', '-')}-{result['date']}.json"
    old = json.loads(stem.read_text()) if stem.exists() else None
    merged = merge(old, result)
    return e2e.write_result(merged, out_dir, RESULT_KIND, markdown, plot, log)


def command(world: int, argv: list[str] | None = None) -> str:
    """The torchrun line that made this run."""
    argv = sys.argv[1:] if argv is None else argv
    return shlex.join(["torchrun", "--nproc-per-node", str(world), "benchmarks/distributed.py", *argv])


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("benchmarks/distributed.py runs under torchrun: torchrun --nproc-per-node N benchmarks/distributed.py "
              "[options]", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    started = time.perf_counter()
    rows = run_ranks(args)
    if rows is None:
        return 0
    from tigon.bench.harness import versions

    world = rows[0]["world"]
    result = {"kind": RESULT_KIND, "device": rows[0]["device"], "date": _dt.date.today().isoformat(),
              "versions": versions(), "rows": rows, "skipped": args.skipped,
              "commands": {command(world, argv): world}, "wall_s": time.perf_counter() - started}
    paths = save(result, args.out)
    print(f"\nwrote {', '.join(str(p) for p in paths)}\n")
    target = history.script_path(args)
    if target is not None:
        history.append(result, benchmark=RESULT_KIND, command=command(world, argv), path=target)
        print(f"appended the run to {target}\n")
    print(paths[1].read_text())
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
