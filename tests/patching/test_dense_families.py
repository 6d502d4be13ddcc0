"""The quirks of the dense families added after Llama's kind (families.py, "dense families" block):
what test_families.py's generic checks do not reach.

- Seed-OSS's MLP applies a dropout to its output in training: the patched MLP keeps it (same torch op,
  same random numbers), so with the dropouts on, a seeded step matches stock.
- Falcon-H1's MLP scales the gate and the output by muP multipliers read from the module; Cohere-2 and
  Falcon-H1 multiply the logits by a number read from the model. A patch checks they are numbers.
- HunYuan normalises q and k after the rotation: its patched rope gives transformers' (fp32) dtypes
  under autocast, never a bf16 copy that the norm would read.
- Each switch alone replaces what the row says and nothing else.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import tigon
from tests.helpers import DEVICE
from tests.patching.tiny import assert_same_grads, batch, rel, stock_and_patched, tiny_model
from tigon.patching.engine import SWITCHES

LOSS_TOLERANCE = 1e-5


def _step(model, seed=None):
    ids, labels = batch(0)
    if seed is not None:
        torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach()


def _loss_and_grads_match(stock, patched, seed=None):
    want = _step(stock, seed)
    got = _step(patched, seed)
    assert rel(got, want) <= LOSS_TOLERANCE, (got.item(), want.item())
    assert_same_grads(patched, stock)


def test_seed_oss_dropouts_are_kept():
    dropouts = {"residual_dropout": 0.3, "attention_dropout": 0.2}
    stock, patched, handle = stock_and_patched("seed_oss", config_overrides=dropouts)
    assert any(line.startswith("SeedOssMLP.forward -> tigon.ops.swiglu with stock residual_dropout")
               for line in handle.replaced)
    _loss_and_grads_match(stock, patched, seed=11)
    # and the dropout does act: another draw gives another loss
    assert not torch.equal(_step(patched, seed=12), _step(patched, seed=11))


def test_split_mlp_with_a_wrapped_projection_keeps_its_forward():
    """A projection that is not a plain nn.Linear (a LoRA layer) runs its own forward; the GLU is fused."""

    class Wrapped(nn.Linear):
        calls = 0

        def forward(self, x):
            Wrapped.calls += 1
            return super().forward(x)

    torch.manual_seed(0)
    stock = tiny_model("seed_oss")
    for layer in stock.model.layers:
        old = layer.mlp.up_proj
        layer.mlp.up_proj = Wrapped(old.in_features, old.out_features, bias=old.bias is not None)
        layer.mlp.up_proj.load_state_dict(old.state_dict())
    import copy

    stock.to(DEVICE)
    patched = copy.deepcopy(stock)
    tigon.patch(patched)
    Wrapped.calls = 0
    _loss_and_grads_match(stock, patched)
    assert Wrapped.calls == 2 * len(stock.model.layers)  # stock's forward and the patched one


@pytest.mark.parametrize(
    ("model_type", "where", "attr"),
    [
        ("cohere2", lambda m: m, "logit_scale"),
        ("falcon_h1", lambda m: m.model, "lm_head_multiplier"),
        ("falcon_h1", lambda m: m.model.layers[1].feed_forward, "down_multiplier"),
        ("seed_oss", lambda m: m.model.layers[0].mlp, "residual_dropout"),
    ],
)
def test_a_multiplier_that_is_not_a_number_is_refused(model_type, where, attr):
    model = tiny_model(model_type)
    setattr(where(model), attr, None)
    with pytest.raises(ValueError, match=attr):
        tigon.patch(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_hunyuan_rope_gives_stock_dtypes_under_autocast(monkeypatch):
    """HunYuan's query/key norms read the rotated q and k: under bf16 autocast they stay fp32, as
    transformers' rotation gives them (fp32 cos/sin), and the step is within bf16 autocast's tolerance
    of stock."""
    rope_module = sys.modules["tigon.ops.rope"]
    original = rope_module.rope
    seen = []

    def spy(q, k, cos, sin, **kwargs):
        out = original(q, k, cos, sin, **kwargs)
        seen.append((q.dtype, kwargs.get("output_dtype"), out[0].dtype, out[1].dtype))
        return out

    stock, patched, _ = stock_and_patched("hunyuan_v1_dense")
    monkeypatch.setattr(rope_module, "rope", spy)
    ids, labels = batch(5)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        got = patched(input_ids=ids, labels=labels).loss
        want = stock(input_ids=ids, labels=labels).loss
    assert seen and set(seen) == {(torch.bfloat16, None, torch.float32, torch.float32)}
    assert rel(got, want) <= 2e-3


@pytest.mark.parametrize(
    ("model_type", "switch", "changed"),
    [
        ("falcon_h1", "mlp", ["FalconH1MLP.forward -> tigon.ops.swiglu with stock gate_multiplier, down_multiplier"]),
        ("falcon_h1", "rms_norm", ["FalconH1RMSNorm -> tigon.nn.RMSNorm(casting='llama', offset=0.0); "
                                   "pre_ff_layernorm give"]),
        ("falcon_h1", "rope", ["FalconH1Attention: apply_rotary_pos_emb -> tigon.ops.rope"]),
        ("cohere2", "layer_norm", ["Cohere2LayerNorm -> tigon.nn.LayerNorm"]),
        ("cohere2", "rope", []),  # interleaved rotary: kept
        ("cohere2", "fused_linear_cross_entropy", ["Cohere2ForCausalLM.forward -> tigon generic forward",
                                                   "lm_head.forward -> nn.Linear, or tigon.ops.fused_linear"]),
        ("starcoder2", "mlp", []),  # c_fc / c_proj: not a gated MLP
        ("starcoder2", "layer_norm", ["LayerNorm -> tigon.nn.LayerNorm"]),
        ("ernie4_5", "rope", []),  # interleaved rotary: kept
        ("exaone4", "rms_norm", ["Exaone4RMSNorm -> tigon.nn.RMSNorm(casting='llama', offset=0.0)",
                                 "Exaone4DecoderLayer.forward -> residual joins as tigon.ops.post_norm_join"]),
    ],
)
def test_each_switch_alone(model_type, switch, changed):
    off = {name: False for name in SWITCHES}
    stock, patched, handle = stock_and_patched(model_type, **{**off, switch: True})
    assert len(handle.replaced) == len(changed), handle.replaced
    for line, expected in zip(handle.replaced, changed, strict=True):
        assert line.startswith(expected), (line, expected)
    _loss_and_grads_match(stock, patched)


# ------------------------------------------------------------------------------------------------ GPU

GPU_SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=32, vocab_size=4096, max_position_embeddings=256)


def _gpu_batch(step, vocab, batch_size=4, seq=128):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(3, vocab, (batch_size, seq), generator=gen)
    labels = ids.clone()
    labels[:, :7] = -100
    return ids.cuda(), labels.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["cohere2", "falcon_h1", "starcoder2", "hunyuan_v1_dense", "exaone4"])
def test_bf16_autocast_training_matches_stock_on_gpu(model_type):
    """20 AdamW steps under bf16 autocast at sizes where the kernels run several programs: per-step
    losses within bf16's tolerance of stock's under the same autocast."""
    stock, patched, _ = stock_and_patched(model_type, config_overrides=GPU_SIZES)
    losses = {}
    for name, model in (("stock", stock), ("patched", patched)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[name] = []
        for step in range(20):
            ids, labels = _gpu_batch(step, GPU_SIZES["vocab_size"])
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    for step, (g, w) in enumerate(zip(losses["patched"], losses["stock"], strict=True)):
        assert abs(g - w) / abs(w) <= 2e-2, f"step {step}: {g} vs stock {w}"


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["cohere2", "seed_oss"])
def test_torch_compile_fullgraph_on_gpu(model_type):
    """The logit multiplier and the MLP instance forward (dropout off: Seed-OSS's tiny config) trace
    without a graph break."""
    stock, patched, _ = stock_and_patched(model_type, config_overrides=GPU_SIZES)
    torch._dynamo.reset()
    compiled = torch.compile(patched, fullgraph=True)
    ids, labels = _gpu_batch(0, GPU_SIZES["vocab_size"])
    want = stock(input_ids=ids, labels=labels).loss
    got = compiled(input_ids=ids, labels=labels).loss
    assert rel(got, want) <= 1e-4
    want.backward()
    got.backward()
    assert_same_grads(patched, stock)
