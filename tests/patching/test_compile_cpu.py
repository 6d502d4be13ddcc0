"""torch.compile(fullgraph=True) of a patched tiny model on the CPU, forward and backward.

``aot_eager``: Dynamo traces the whole model without a graph break, AOTAutograd propagates fake
tensors through every tigon op and traces the backward; the graphs then run eagerly (the interpreter
runs the kernels). The GPU test (tests/patching/test_gpu.py) compiles with Inductor.
"""

from __future__ import annotations

import pytest
import torch

from tests.patching.tiny import batch, rel, stock_and_patched

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's path; test_gpu.py compiles on a GPU"
)


def test_compiled_patched_model_matches_stock():
    stock, patched, handle = stock_and_patched("llama")
    assert any("fused_linear_cross_entropy" in line for line in handle.replaced)
    torch._dynamo.reset()
    compiled = torch.compile(patched, fullgraph=True, backend="aot_eager")
    ids, labels = batch(0)
    want = stock(input_ids=ids, labels=labels).loss
    got = compiled(input_ids=ids, labels=labels).loss
    assert rel(got, want) <= 1e-5
    want.backward()
    got.backward()
    for (name, p), (_, q) in zip(patched.named_parameters(), stock.named_parameters(), strict=True):
        assert rel(p.grad, q.grad) <= 1e-4, name


def test_compiled_patched_model_recompiles_as_stock_does():
    """New sequence lengths recompile a patched model as they do stock: the first length's graph, then one
    dynamic graph for the lengths between two powers of two (the launches' row tiles below their size;
    from it on, every length), the loss head's chunk loop included (one opaque op)."""
    from torch._dynamo.utils import counters

    stock, patched, _ = stock_and_patched("llama")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(patched, backend="aot_eager", fullgraph=True)
    for seq in (22, 27, 32):
        ids, labels = batch(seq, seq=seq)
        got = compiled(input_ids=ids, labels=labels).loss
        want = stock(input_ids=ids, labels=labels).loss
        assert rel(got, want) <= 1e-5, seq
        got.backward()  # the dynamic graph's backward runs too
    assert counters["stats"]["unique_graphs"] == 2  # stock's count on these lengths
