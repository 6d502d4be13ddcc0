"""tigon under transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")``), launched by
torchrun on two processes: a patched model trains as the stock tensor-parallel model does.

Under tensor parallelism the projections are split over the ranks and carry a forward that
redistributes their input and output; tigon's fused MLP then lets each projection run its own forward
and fuses only the activation, the attention node stands aside (the rotary and the joins stay tigon's),
and the fused loss computes each rank's classes of the split LM head only
(``tigon.ops.vocab_parallel_cross_entropy``): the ranks exchange per-row statistics and one input
gradient, never the logits. The worker (tests/patching/tensor_parallel_worker.py) runs on the CPU with
gloo and the Triton interpreter everywhere, and again under NCCL with two GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port
from tests.patching.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[2]
# llama: the plain case; qwen2: q/k/v biases split with their projections; gemma2: GeGLU, the final
# softcap inside the vocabulary-parallel loss, sandwich norms.
FAMILIES = ("llama", "qwen2", "gemma2")
TIMEOUT_S = 900
# fp32: the same products summed in another order (tigon's input gradient of the head is a sum over
# the ranks' classes): API.md's fp32 tolerances.
LOSS_TOLERANCE = 1e-5
TOLERANCE = 1e-4
# bf16 autocast (GPU run): both sides round to bf16 at the matmuls, in different places, for three SGD
# steps. Losses and logits: API.md's bf16 tolerance. Trained weights against stock's: the gradient
# tolerance test_families.py measured for one autocast step (5e-2: small zero-initialised biases
# are all gradient); and, all weights together, tigon's distance from the fp32 run no more than
# AUTOCAST_EXACTNESS × stock's: tigon is as exact as stock.
AUTOCAST_TOLERANCE = 3e-2
AUTOCAST_WEIGHT_TOLERANCE = 5e-2
AUTOCAST_EXACTNESS = 1.5
# The op against fp64 (API.md).
OP_TOLERANCE = {"torch.float32": 1e-4, "torch.float16": 2e-2, "torch.bfloat16": 3e-2}


def _launch(out, models, **env_overrides) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        **env_overrides,
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(ROOT / "tests" / "patching" / "tensor_parallel_worker.py"), str(out), str(models)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_models")
    for family in FAMILIES:
        torch.manual_seed(0)
        tiny_model(family).save_pretrained(root / family)
    return root


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("tp") / "results.pt", models, TRITON_INTERPRET="1",
                   CUDA_VISIBLE_DEVICES="")


@pytest.fixture(scope="module")
def gpu_runs(models, tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (one rank each): runs in scripts/gpu-check.sh on a two-GPU machine")
    return _launch(tmp_path_factory.mktemp("tp_gpu") / "results.pt", models, TIGON_DIST_DEVICE="cuda")


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check_model(run, tolerance, loss_tolerance):
    assert len(run["losses"]) >= 2 and run["stock_losses"][-1] != run["stock_losses"][0]
    for got, want in zip(run["losses"], run["stock_losses"], strict=True):
        assert abs(got - want) <= loss_tolerance * abs(want), (got, want)
    assert run["state"].keys() == run["stock_state"].keys()
    for name, want in run["stock_state"].items():
        assert _rel(run["state"][name], want) <= tolerance, name
    assert _rel(run["logits"], run["stock_logits"]) <= tolerance
    # Reverted: the stock forwards again (the head's gathering forward included), same logits.
    assert run["head_forward_restored"]
    assert _rel(run["reverted_logits"], run["stock_logits_again"]) <= tolerance


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_training_matches_stock(runs, family):
    run = runs[(family, "fp32")]
    assert any("fused linear cross-entropy" in line for line in run["replaced"])
    assert any(line.startswith("tensor parallel") for line in run["replaced"])
    _check_model(run, TOLERANCE, LOSS_TOLERANCE)


def test_tensor_parallel_after_patching_the_classes(runs):
    """``tigon.patch("llama")`` before ``from_pretrained(..., tp_plan="auto")``: the same."""
    run = runs[("llama", "class")]
    assert any("fused linear cross-entropy" in line for line in run["replaced"])
    _check_model(run, TOLERANCE, LOSS_TOLERANCE)


def test_only_a_head_split_by_tensor_parallelism_takes_the_vocabulary_parallel_loss():
    """FSDP2's shards are DTensors split by rows as well, but FSDP2 gathers the whole weight for the head's call
    (hooks, no forward of its own on the instance): such a head must keep its call, tigon's forward on it or
    not. A head carrying another forward on the instance (transformers' tensor parallelism installs one) takes
    the vocabulary-parallel loss."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tests.helpers import one_rank_group
    from tigon.patching import loss_forward

    with one_rank_group("gloo"):
        mesh = init_device_mesh("cpu", (1,))
        head = nn.Linear(8, 10, bias=False)
        head.weight = nn.Parameter(distribute_tensor(head.weight.detach(), mesh, [Shard(0)]))
        assert not loss_forward.vocab_parallel_head(head) and loss_forward._loss_call(head) is head
        # tigon's own forward on the instance (a model patched before FSDP2 wrapped its head): not split
        head.forward = types.MethodType(loss_forward.linear_or_fused_loss, head)
        assert not loss_forward.vocab_parallel_head(head) and loss_forward._loss_call(head) is head
        head.forward = lambda x: x  # another forward on the instance: transformers' tensor parallelism
        assert loss_forward.vocab_parallel_head(head) and loss_forward._loss_call(head) is not head
        head.weight = nn.Parameter(distribute_tensor(torch.randn(10, 8), mesh, [Replicate()]))
        assert not loss_forward.vocab_parallel_head(head)


def test_vocab_parallel_loss_matches_reference(runs):
    ops = runs["ops"]
    cases = [key for key in ops if isinstance(key, tuple)]
    assert len(cases) == 3 * 5 + 1
    for key in cases:
        tolerance = OP_TOLERANCE.get(key[0], 1e-4)
        for name, (got, want) in ops[key].items():
            assert _rel(got, want) <= (1e-5 if name == "loss" and tolerance == 1e-4 else tolerance), (key, name)


def test_vocab_parallel_loss_bad_input(runs):
    ops = runs["ops"]
    assert ops["replicated_error"] is not None and "Shard(0)" in ops["replicated_error"]
    assert ops["offset_error"] is not None and "vocab_start" in ops["offset_error"]
    assert ops["dtensor_error"] is not None and "vocab_parallel_cross_entropy" in ops["dtensor_error"]


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_on_two_gpus_matches_stock(gpu_runs, family):
    _check_model(gpu_runs[(family, "fp32")], TOLERANCE, LOSS_TOLERANCE)


def _flat(state):
    return torch.cat([t.flatten() for _, t in sorted(state.items())])


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_autocast_on_two_gpus_is_as_exact_as_stock(gpu_runs, family):
    run, exact = gpu_runs[(family, "autocast")], gpu_runs[(family, "fp32")]["stock_state"]
    for got, want in zip(run["losses"], run["stock_losses"], strict=True):
        assert abs(got - want) <= AUTOCAST_TOLERANCE * abs(want), (got, want)
    for name, want in run["stock_state"].items():
        assert _rel(run["state"][name], want) <= AUTOCAST_WEIGHT_TOLERANCE, name
    tigon_error = _rel(_flat(run["state"]), _flat(exact))
    stock_error = _rel(_flat(run["stock_state"]), _flat(exact))
    print(f"{family}: trained weights vs the fp32 run: tigon {tigon_error:.2e}, stock {stock_error:.2e}; "
          f"largest weight difference {max(_rel(run['state'][n], w) for n, w in run['stock_state'].items()):.2e}; "
          f"losses {run['losses']} vs {run['stock_losses']}")
    assert tigon_error <= AUTOCAST_EXACTNESS * stock_error
    assert _rel(run["logits"], run["stock_logits"]) <= AUTOCAST_TOLERANCE
    assert run["head_forward_restored"]
    assert _rel(run["reverted_logits"], run["stock_logits_again"]) <= AUTOCAST_TOLERANCE


@pytest.mark.gpu
def test_vocab_parallel_loss_on_two_gpus_matches_reference(gpu_runs):
    for key in (k for k in gpu_runs["ops"] if isinstance(k, tuple)):
        tolerance = OP_TOLERANCE.get(key[0], 1e-4)
        for name, (got, want) in gpu_runs["ops"][key].items():
            assert _rel(got, want) <= tolerance, (key, name)
