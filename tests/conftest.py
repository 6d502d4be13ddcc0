"""Test set-up: without a CUDA device every kernel runs on CPU tensors through Triton's interpreter.

TRITON_INTERPRET must be set before the first ``@triton.jit`` decorator runs, i.e. before anything
imports ``tigon.ops``; pytest imports this file before any test module, so setting it here is early
enough (``use_interpreter_without_gpu`` also applies tigon's fixes to the interpreter). On a GPU
machine nothing is set and the same tests compile the kernels for real.
"""

import os

import pytest
import torch

from tigon._interpreter import use_interpreter_without_gpu

use_interpreter_without_gpu()

# pytest-xdist runs one worker per core (`-n 2` on CI's two): each worker's torch then takes its share
# of the cores. torch's default, a thread per core in every worker, oversubscribes them: on the 2-core
# CI machine the suite ran 1.4-1.8x slower so.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 0:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: runs in scripts/gpu-check.sh on the H100")
    for item in items:
        if "gpu" in item.keywords or "bigmem" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
