"""tigon under torch.distributed, launched by torchrun: DDP and FSDP2 (``fully_shard``) on two
processes train a patched model exactly as one process does on the whole batch.

The workers (tests/patching/distributed_worker.py) run on the CPU with gloo and the Triton
interpreter on every machine, so the test checks the composition (patched modules and the fused
loss under the wrappers' hooks, gradient averaging, sharded parameters), the same on CI and on the
GPU. The model is patched before it is wrapped, as the README says.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# Summation order differs (two half-batch gradients averaged vs one whole-batch gradient): fp32
# rounding only (measured ~1e-7).
LOSS_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 1e-5
TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed") / "results.pt"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           str(ROOT / "tests" / "patching" / "distributed_worker.py"), str(out)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("mode", ("ddp", "fsdp2"))
def test_distributed_training_matches_one_process(runs, mode):
    single, run = runs["single"], runs[mode]
    assert len(run["losses"]) == len(single["losses"]) >= 2
    for step, (got, want) in enumerate(zip(run["losses"], single["losses"], strict=True)):
        assert abs(got - want) <= LOSS_TOLERANCE * abs(want), (mode, step, got, want)
    assert run["state"].keys() == single["state"].keys()
    for name, want in single["state"].items():
        assert _rel(run["state"][name], want) <= WEIGHT_TOLERANCE, (mode, name)
    # The weights moved: the comparison is of trained weights, not of the initial ones.
    assert single["losses"][-1] != single["losses"][0]
