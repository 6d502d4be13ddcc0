"""``tigon.patch_trl()`` on two ranks: TRL's DPO and GRPO trainers under FSDP2 and DeepSpeed ZeRO-3
train a tigon-patched model (backbone patched, TRL's fused LM head on tigon's op) exactly as stock TRL
trains the stock model.

The workers (tests/patching/trl_distributed_worker.py, launched by torchrun, one launch per group)
run on the CPU with gloo and the Triton interpreter, fp32:

* FSDP2 (``fully_shard`` per decoder layer, then the root; the reference sharded whole): the real
  ``DPOTrainer`` and ``GRPOTrainer`` build the fused heads, and each step is driven by hand through the
  trainer's own ``_prepare_inputs`` and ``compute_loss`` (accelerate drives FSDP2 on GPUs only, so no
  Trainer can run it on the CPU). GRPO generates 4-token completions, 2 per prompt, with a reference
  model (beta > 0) and a toy reward. Compared: each step's loss, each step's gradients of the sharded
  parameters (gathered), the trainer's metrics, GRPO's sampled completions.
* ZeRO-3: ``DPOTrainer.train()`` with a stage-3 config. Compared: the logged losses and metrics and
  the final weights.

On a machine with two GPUs the same runs go again under NCCL in bf16 (``@pytest.mark.gpu``), with
``DPOTrainer.train()`` under accelerate's FSDP2 plugin besides, compared within the API's bf16
tolerance; each prints its steps' tokens per second (``pytest -s`` shows them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port

pytest.importorskip("trl")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
# fp32: the head and the patched backbone sum in another order than TRL's and transformers' (measured:
# gradients 1.2e-6, losses 1e-7 relative). bf16: the API's tolerance.
TOLERANCE = {"cpu": 1e-5, "cuda": 3e-2}


def _launch(group: str, out: Path, **env_overrides) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        **env_overrides,
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(ROOT / "tests" / "patching" / "trl_distributed_worker.py"), group, str(out)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-6000:]
    return torch.load(out)


def _cpu(group, tmp_path_factory) -> dict:
    return _launch(group, tmp_path_factory.mktemp(f"trl_{group}") / "results.pt",
                   TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")


def _gpu(group, tmp_path_factory, **env) -> dict:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: runs in scripts/gpu-check.sh on a machine with two or more")
    return _launch(group, tmp_path_factory.mktemp(f"trl_{group}_gpu") / "results.pt", TIGON_DIST_DEVICE="cuda",
                   **env)


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory):
    return _cpu("fsdp2", tmp_path_factory)


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    pytest.importorskip("deepspeed", reason="the ZeRO-3 runs need deepspeed, which is not installed")
    return _cpu("zero3", tmp_path_factory)


@pytest.fixture(scope="module")
def gpu_fsdp2_runs(tmp_path_factory):
    # GRPO generates in fp32 in both runs, which must sample the same completions: Triton's fp32 dots
    # in IEEE fp32 (not its default TF32), as cuBLAS computes torch's fp32 matmuls
    return _gpu("fsdp2", tmp_path_factory, TRITON_F32_DEFAULT="ieee")


@pytest.fixture(scope="module")
def gpu_fsdp2_trainer_runs(tmp_path_factory):
    return _gpu("fsdp2_trainer", tmp_path_factory)


@pytest.fixture(scope="module")
def gpu_zero3_runs(tmp_path_factory):
    pytest.importorskip("deepspeed", reason="the ZeRO-3 runs need deepspeed, which is not installed")
    return _gpu("zero3", tmp_path_factory)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _close(got: float, want: float, tolerance: float) -> bool:
    """Within ``tolerance`` of ``want``, relative, or absolute below 1 (a metric that is a difference of
    nearly equal terms, such as a reward of 0.001 from log-probs of -30, is exact only to the terms' scale)."""
    return abs(got - want) <= tolerance * max(abs(want), 1.0)


def _check_metrics(got: dict, want: dict, tolerance: float, what: str) -> None:
    assert got.keys() == want.keys(), (what, got.keys() ^ want.keys())
    for key, values in want.items():
        assert len(got[key]) == len(values), (what, key)
        for step, (g, w) in enumerate(zip(got[key], values, strict=True)):
            assert _close(g, w, tolerance), (what, key, step, g, w)


def _check_sharded_steps(runs, name: str, tolerance: float) -> None:
    got, want = runs[name]["tigon"], runs[name]["trl"]
    assert len(got["losses"]) == len(want["losses"]) == 2
    for step, (g, w) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        # GRPO's loss on its own samples is a sum of advantages that nearly cancel: its scale is 1
        assert _close(g, w, tolerance) if name == "grpo" else abs(g - w) <= tolerance * abs(w), (name, step, g, w)
    for step, (g_step, w_step) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        assert g_step.keys() == w_step.keys()
        for param, w in w_step.items():
            assert w.norm() > 0, (name, step, param)
            assert _rel(g_step[param], w) <= tolerance, (name, step, param, _rel(g_step[param], w))
    # tigon's kernels ran in the patched run: equal within rounding, not bit for bit TRL's
    assert any(not torch.equal(g_step[p], w) for g_step, w_step in zip(got["grads"], want["grads"], strict=True)
               for p, w in w_step.items())
    # the second step's gradients are of trained weights, not of the first step's again
    first, second = want["grads"]
    assert _rel(second["lm_head.weight"], first["lm_head.weight"]) > 1e-3
    _check_metrics(got["metrics"], want["metrics"], tolerance, name)


def _check_trainer_runs(runs, name: str, tolerance: float) -> None:
    """A Trainer's logged loss, gradient norm and metrics every step, and its final weights."""
    got, want = runs[name]["tigon"], runs[name]["trl"]
    assert len(got["logs"]) == len(want["logs"]) == 2
    for step, (g, w) in enumerate(zip(got["logs"], want["logs"], strict=True)):
        assert g.keys() == w.keys() and "grad_norm" in w, step
        assert abs(g["loss"] - w["loss"]) <= tolerance * abs(w["loss"]), (name, step, g["loss"], w["loss"])
        for key, value in w.items():
            assert _close(g[key], value, tolerance), (name, step, key, g[key], value)
    assert want["logs"][1]["loss"] != want["logs"][0]["loss"]
    for param, w in want["state"].items():
        assert _rel(got["state"][param], w) <= tolerance, (name, param)


def _print_throughput(runs, what: str) -> None:
    """Tokens per second of each step (the first includes the kernels' compilation), over both ranks."""
    for name, pair in runs.items():
        for run, result in pair.items():
            rates = ", ".join(f"{t / s:,.0f}" for t, s in zip(result["tokens"], result["seconds"], strict=True))
            print(f"{what} {name} {run}: tokens/s per step (both ranks) {rates}")


# ------------------------------------------------------------------------------------------- the CPU


def test_fsdp2_dpo_matches_trl(fsdp2_runs):
    """DPO with a reference model: the policy's loss, its sharded gradients, and the rewards, log-probs,
    entropy, logits and accuracy metrics TRL computes from the head's five outputs."""
    _check_sharded_steps(fsdp2_runs, "dpo", TOLERANCE["cpu"])
    metrics = fsdp2_runs["dpo"]["trl"]["metrics"]
    assert {"rewards/margins", "logps/chosen", "entropy", "logits/chosen", "mean_token_accuracy"} <= metrics.keys()
    assert metrics["rewards/margins"][1] != 0  # the second step's policy differs from the reference


def test_fsdp2_grpo_matches_trl(fsdp2_runs):
    """GRPO: the same sampled completions (generation through the sharded, patched model), then the
    same loss, gradients, KL to the reference and entropy."""
    got, want = fsdp2_runs["grpo"]["tigon"], fsdp2_runs["grpo"]["trl"]
    assert len(got["completions"]) == len(want["completions"]) == 2
    for g, w in zip(got["completions"], want["completions"], strict=True):
        assert torch.equal(g, w)
    _check_sharded_steps(fsdp2_runs, "grpo", TOLERANCE["cpu"])
    assert want["metrics"]["kl"][1] > 0 and want["metrics"]["reward_std"][0] > 0


def test_zero3_dpo_trainer_matches_trl(zero3_runs):
    """``DPOTrainer.train()`` under ZeRO-3 on two ranks (the worker checks that the model is partitioned):
    the same logged loss, gradient norm and metrics every step, the same final weights. (Tied
    embeddings under ZeRO-3: test_trl_head.py's test_zero3_head, in one process.)"""
    _check_trainer_runs(zero3_runs, "dpo", TOLERANCE["cpu"])


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dpo", "grpo"])
def test_fsdp2_on_two_gpus_matches_trl(gpu_fsdp2_runs, name):
    """NCCL, one GPU a rank, bf16 autocast; tigon's compiled kernels against TRL's Triton head."""
    if name == "grpo":
        for g, w in zip(gpu_fsdp2_runs[name]["tigon"]["completions"], gpu_fsdp2_runs[name]["trl"]["completions"],
                        strict=True):
            assert torch.equal(g, w)
    _check_sharded_steps(gpu_fsdp2_runs, name, TOLERANCE["cuda"])
    _print_throughput({name: gpu_fsdp2_runs[name]}, "FSDP2")


@pytest.mark.gpu
def test_fsdp2_dpo_trainer_on_two_gpus_matches_trl(gpu_fsdp2_trainer_runs):
    """``DPOTrainer.train()`` with accelerate's FSDP2 plugin (which it turns on for GPUs only)."""
    _check_trainer_runs(gpu_fsdp2_trainer_runs, "dpo", TOLERANCE["cuda"])
    _print_throughput(gpu_fsdp2_trainer_runs, "FSDP2 Trainer")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dpo", "dpo_tied"])
def test_zero3_dpo_trainer_on_two_gpus_matches_trl(gpu_zero3_runs, name):
    """``dpo_tied``: the head's weight is the embedding's, so the head's gradient to it is one of two;
    tigon's re-gathering backward (``_GatheredInBackward``) adds only the head's part."""
    _check_trainer_runs(gpu_zero3_runs, name, TOLERANCE["cuda"])
    _print_throughput({name: gpu_zero3_runs[name]}, "ZeRO-3")
