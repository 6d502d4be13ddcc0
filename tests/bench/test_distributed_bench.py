"""``benchmarks/distributed.py``: FSDP2 and FSDP2 × tensor parallel end to end on the CPU (two gloo ranks
under torchrun, the interpreter, a tiny Llama, fp32), the rows of two invocations merged into one page,
and the report's arithmetic. The timed runs are on 1 to 8 GPUs (benchmarks/results/latest/README.md)."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks import distributed

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
# Both providers train the same fp32 weights on the same tokens; tigon's norms, rotary and loss differ from
# stock's by fp32 rounding only.
LOSS_TOLERANCE = 1e-5
BF16_LOSS_TOLERANCE = 1e-2


def _torchrun(out: Path, *options: str, ranks: int = 2, device: str = "cpu") -> None:
    path = os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    precision = "bf16"
    if device == "cpu":
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        precision = "fp32"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(ROOT / "benchmarks" / "distributed.py"), "--device",
           device, "--model", "tiny", "--precision", precision, "--providers", "stock", "tigon", "--warmup", "1",
           "--steps", "1", "--seq", "16", "--out", str(out), *options]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    # a provider that failed on every rank exits 1 after printing the page: its row's line says why
    errors = [text for text in done.stdout.splitlines() if " error: " in text and not text.startswith("|")]
    assert done.returncode == 0, (errors, done.stdout[-3000:], done.stderr[-3000:])


def _rows(out: Path) -> tuple[dict, Path]:
    (saved,) = out.glob("distributed-*.json")
    rows = {(r["tp"], r["provider"]): r for r in json.loads(saved.read_text())["rows"]}
    for row in rows.values():
        assert "error" not in row, row.get("error")
        assert math.isfinite(row["tokens_per_s_per_gpu"]) and row["tokens_per_s_per_gpu"] > 0
        assert len(row["losses"]) == 2 and row["state_bytes"] > 0
    return rows, saved


def test_fsdp2_and_2d_on_two_gloo_ranks(tmp_path):
    _torchrun(tmp_path)
    _torchrun(tmp_path, "--tp", "2")  # the same page: its rows merged with the first run's
    rows, saved = _rows(tmp_path)
    assert rows.keys() == {(1, "stock"), (1, "tigon"), (2, "stock"), (2, "tigon")}
    assert all(row["world"] == 2 for row in rows.values())
    for tp in (1, 2):
        for got, want in zip(rows[tp, "tigon"]["losses"], rows[tp, "stock"]["losses"], strict=True):
            assert abs(got - want) <= LOSS_TOLERANCE * abs(want), (tp, got, want)
        assert rows[tp, "tigon"]["max_loss_rel_diff"] <= LOSS_TOLERANCE
    text = saved.with_suffix(".md").read_text()
    assert "## tiny Llama, 1 × 16 tokens per GPU, FSDP2, fp32" in text
    assert "## tiny Llama, 1 × 16 tokens per tensor-parallel group, FSDP2 × TP 2, fp32" in text
    assert text.count("`torchrun --nproc-per-node 2 benchmarks/distributed.py --device cpu") == 2
    if saved.with_suffix(".png").exists():
        assert saved.with_suffix(".png").stat().st_size > 5_000


@pytest.mark.gpu
def test_nccl_ranks_measure_memory(tmp_path):
    """The CUDA path before a timed run: one rank, then two (FSDP2 and FSDP2 × TP 2 where there are two GPUs),
    bf16 parameters, NCCL, the compiled kernels; the memory columns filled."""
    import torch

    _torchrun(tmp_path, ranks=1, device="cuda")
    if torch.cuda.device_count() >= 2:
        _torchrun(tmp_path, ranks=2, device="cuda")
        _torchrun(tmp_path, "--tp", "2", ranks=2, device="cuda")
    (saved,) = tmp_path.glob("distributed-*.json")
    rows = json.loads(saved.read_text())["rows"]
    assert len(rows) == (6 if torch.cuda.device_count() >= 2 else 2)
    for row in rows:
        assert "error" not in row, row.get("error")
        assert row["peak_bytes"] > row["state_bytes"] > 0 and row["activation_bytes"] > 0
        assert row["matmul_tflops"] > 0
        if row["provider"] == "tigon":
            # bf16 parameters: tigon's and stock's products round differently (as tests/bench/test_e2e_tp.py).
            assert row["max_loss_rel_diff"] <= BF16_LOSS_TOLERANCE


@pytest.mark.parametrize("api", ["plan", "model"])
def test_tensor_parallel_on_either_transformers_api(monkeypatch, api):
    """``apply_tensor_parallel`` on one gloo rank (a "tp" mesh of 1): the split weights become DTensors holding the
    weights the rank built, and the model computes the same loss. transformers' ``apply_tensor_parallelism``
    takes the plan expanded to the layers in 5.25 ("plan"); 5.17's reads the model's plan itself ("model",
    played here by a function of its signature over the installed one)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers.distributed import tensor_parallel

    from tests.helpers import one_rank_group
    from tigon.bench.models import build_model

    installed = tensor_parallel.apply_tensor_parallelism
    if api == "model":
        if "tp_plan" not in inspect.signature(installed).parameters:
            pytest.skip("the installed transformers (5.17's API) has the model-plan function itself: the plan "
                        "case runs it; this case runs where transformers 5.25's is installed")

        def model_plan(model, tp_mesh):  # 5.17's signature
            model._mesh_manager = None
            return installed(model, tp_mesh, model._expand_parallel_plan(dict(model.tp_plan)))

        monkeypatch.setattr(tensor_parallel, "apply_tensor_parallelism", model_plan)
    torch.manual_seed(0)
    model = build_model(distributed.model_config("tiny"), device="cpu")
    ids = torch.randint(model.config.vocab_size, (1, 16))
    want = model(input_ids=ids, labels=ids).loss
    weight = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    with one_rank_group("gloo"):
        distributed.apply_tensor_parallel(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
        split = model.model.layers[0].self_attn.q_proj.weight
        assert isinstance(split, DTensor) and torch.equal(split.full_tensor(), weight)
        assert torch.allclose(model(input_ids=ids, labels=ids).loss, want, rtol=1e-6)


def test_options():
    args = distributed.parse_args([])
    assert (args.model, args.batch, args.seq, args.tp, args.ckpt, args.precision) == ("llama-8b", 1, 8192, 1, False,
                                                                                        "bf16")
    assert set(args.providers) | {"liger"} == set(distributed.PROVIDERS)
    ordered = distributed.parse_args(["--providers", "tigon", "stock", "--batch", "2", "--seq", "4096"])
    assert ordered.providers == ["stock", "tigon"] and (ordered.batch, ordered.seq) == (2, 4096)
    with pytest.raises(SystemExit):
        distributed.parse_args(["--warmup", "0"])  # the first step makes the optimizer state the memory split needs
    with pytest.raises(SystemExit):
        distributed.parse_args(["--model", "llama-70b"])


def test_flops_per_token_of_the_8b_shape():
    config = distributed.model_config("llama-8b")
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size) == (
        4096, 32, 14336, 128256)
    flops = distributed.flops_per_token(config, 8192)
    per_layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336
    assert flops["matmul_params"] == 32 * per_layer + 128256 * 4096  # 7.50e9
    assert flops["total"] == 6 * flops["matmul_params"] + 12 * 32 * 4096 * 8192  # 5.79e10


def _row(provider, world, tokens, *, activation=None, losses=(2.0, 1.5), error=None):
    row = {"model": "llama-8b", "label": "Llama-3.1-8B-shaped", "provider": provider, "world": world, "tp": 1,
           "batch": 1, "seq": 8192, "ckpt": False, "precision": "bf16"}
    if error:
        return {**row, "error": error}
    return {**row, "tokens_per_s_per_gpu": tokens, "tokens_per_s_range": [tokens * 0.9, tokens * 1.1],
            "tflops_per_gpu": tokens * 5.79e10 / 1e12, "matmul_tflops": 800.0, "losses": list(losses),
            "state_bytes": 16 * 2**30, "peak_bytes": 16 * 2**30 + (activation or 0),
            "activation_bytes": activation, "device": "NVIDIA H200"}


def _result(rows, command):
    return {"kind": "distributed", "device": "NVIDIA H200", "date": "2026-12-04", "versions": {"torch": "2.13.0"},
            "rows": rows, "skipped": [], "commands": {command: rows[0]["world"]}}


def test_pages_merge_by_world_size(tmp_path):
    pytest.importorskip("matplotlib")
    two = _result([_row("stock", 2, 5000.0, activation=40 * 2**30), _row("tigon", 2, 7000.0, activation=20 * 2**30),
                   _row("liger", 2, 6000.0, activation=30 * 2**30)], "torchrun --nproc-per-node 2 x")
    distributed.save(two, tmp_path, log=lambda line: None)
    eight = _result([_row("stock", 8, 4000.0, activation=40 * 2**30),
                     _row("tigon", 8, 6300.0, activation=20 * 2**30, losses=(2.0, 1.5 * (1 + 2e-3))),
                     _row("liger", 8, 0, error="Traceback\ntorch.OutOfMemoryError: CUDA out of memory")],
                    "torchrun --nproc-per-node 8 x")
    paths = distributed.save(eight, tmp_path, log=lambda line: None)
    assert [p.suffix for p in paths] == [".json", ".md", ".png"]
    rows = {(r["provider"], r["world"]): r for r in json.loads(paths[0].read_text())["rows"]}
    assert len(rows) == 6
    assert rows["tigon", 8]["scaling"] == pytest.approx(0.9) and rows["tigon", 8]["scaling_base_world"] == 2
    assert rows["tigon", 8]["vs_stock"] == pytest.approx(1.575)
    assert rows["tigon", 8]["max_loss_rel_diff"] == pytest.approx(2e-3)
    text = paths[1].read_text()
    assert text.index("nproc-per-node 2 x") < text.index("nproc-per-node 8 x")
    # 6300 tokens/s x 57.9 GFLOP a token = 365 TFLOP/s: 36.9% of 989.5, 45.6% of the 800 TFLOP/s matmul.
    assert ("| 8 | tigon | 6,300 (5,670–6,930) | 1.57× | 365 | 36.9% | 45.6% | 0.90 (vs 2) | 36.0 | 16.0 | 20.0 "
            "| 2.0000 | 2.0e-03 |") in text
    assert "| 8 | Liger-Kernel | error: torch.OutOfMemoryError: CUDA out of memory |" in text
    assert "- 8 GPUs: tigon 1.57× stock, 6,300 tokens/s per GPU" in text
    assert "- scaling efficiency 2 → 8 GPUs: stock 0.80, tigon 0.90" in text
    assert "5,762 tokens/s per GPU" in text and distributed.TORCHTITAN_URL in text
