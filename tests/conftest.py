"""Test set-up: without a CUDA device every kernel runs on CPU tensors through Triton's interpreter.

TRITON_INTERPRET must be set before the first ``@triton.jit`` decorator runs, i.e. before anything
imports ``tigon.ops``; pytest imports this file before any test module, so setting it here is early
enough. On a GPU machine nothing is set and the same tests compile the kernels for real.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


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
