"""Test set-up: without a CUDA device every kernel runs on CPU tensors through Triton's interpreter.

TRITON_INTERPRET must be set before the first ``@triton.jit`` decorator runs, i.e. before anything
imports ``tigon.ops``; pytest imports this file before any test module, so setting it here is early
enough (``use_interpreter_without_gpu`` also applies tigon's fixes to the interpreter). On a GPU
machine nothing is set and the same tests compile the kernels for real.
"""

import pytest
import torch

from tigon._interpreter import use_interpreter_without_gpu

use_interpreter_without_gpu()


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
