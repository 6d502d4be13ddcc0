"""``python -m tigon.bench.saved --lora``: what a LoRA layer saves for its backward, stock PEFT against tigon's
nodes (which run here: no module hooks, the attention node let onto the CPU), per token at Llama-3.1-8B's widths."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("peft")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a measurement of the CPU interpreter's saved bytes: runs on machines without a "
                                      "GPU (CI)")
from tigon.bench import saved  # noqa: E402


def test_lora_layer_saves_half_of_what_peft_saves():
    with saved.attention_node_on_the_cpu():
        rows = {patched: saved.per_token_layer_by_node(
            functools.partial(saved.lora_model, patched=patched, qlora=False), 16, scale=saved.SCALE_TO_1B)
            for patched in (False, True)}
    peft_total, tigon_total = (sum(rows[p].values()) for p in (False, True))
    # the nodes ran and hold everything the layer saves: x, gate, up and the adapters' Ũ in the MLP node;
    # x̃, q/k/v, the attention's output and lse in the attention node; the norms' inputs
    assert set(rows[True]) == {"_LoraGatedMLPFunctionBackward", "AttentionNodeBackward", "rms_norm_functionBackward",
                               "add_rms_norm_functionBackward"}
    assert tigon_total <= 0.52 * peft_total, (tigon_total, peft_total)
    # x (4096 bf16) + gate and up (2 x 14336 bf16) + Ũ (48 values) in the MLP node, per token at 8B
    assert rows[True]["_LoraGatedMLPFunctionBackward"] == pytest.approx(2 * (4096 + 2 * 14336 + 48), abs=1)
