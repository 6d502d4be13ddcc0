"""GPU only: mixed-precision training agreement and torch.compile of a patched model.

bf16 autocast (fp32 master weights, as Trainer runs it): 20 AdamW steps whose per-step losses stay
within 2e-2 of the stock model's under the same autocast; both sides round differently (tigon
rounds once per fused op), so the tolerance is bf16's, not fp32's. Larger than the CPU configs
(hidden 256, vocab 4096, 4 x 128 tokens) so that the kernels run with several programs and chunks.
"""

from __future__ import annotations

import pytest
import torch

from tests.patching.tiny import DEVICE, rel, stock_and_patched

pytestmark = pytest.mark.gpu

BF16_TOLERANCE = 2e-2
STEPS = 20
GPU_SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=32, vocab_size=4096, max_position_embeddings=256)


def _batch(step, vocab, batch_size=4, seq=128):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(3, vocab, (batch_size, seq), generator=gen)
    labels = ids.clone()
    labels[:, :7] = -100  # a prompt that is not trained on
    return ids.to(DEVICE), labels.to(DEVICE)


def _autocast_losses(model, steps, vocab):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        ids, labels = _batch(step, vocab)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "phi3", "qwen3"])
def test_bf16_autocast_training_matches_stock(model_type):
    stock, patched, _ = stock_and_patched(model_type, config_overrides=GPU_SIZES)
    vocab = GPU_SIZES["vocab_size"]
    want = _autocast_losses(stock, STEPS, vocab)
    got = _autocast_losses(patched, STEPS, vocab)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) / abs(w) <= BF16_TOLERANCE, f"step {step}: {g} vs stock {w}"


def test_bf16_weights_loss_matches_stock():
    """A model cast to bf16 (no autocast): losses agree, gradients reach every parameter."""
    stock, patched, _ = stock_and_patched("llama", config_overrides=GPU_SIZES)
    stock.to(torch.bfloat16)
    patched.to(torch.bfloat16)
    for step in range(3):
        ids, labels = _batch(step, GPU_SIZES["vocab_size"])
        want = stock(input_ids=ids, labels=labels).loss
        got = patched(input_ids=ids, labels=labels).loss
        assert rel(got.float(), want.float()) <= BF16_TOLERANCE
        got.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in patched.parameters())
        patched.zero_grad()


def test_torch_compile_of_a_patched_model():
    stock, patched, _ = stock_and_patched("llama", config_overrides=GPU_SIZES)
    torch._dynamo.reset()
    compiled = torch.compile(patched, fullgraph=True)  # tigon causes no graph break
    ids, labels = _batch(0, GPU_SIZES["vocab_size"])
    want = stock(input_ids=ids, labels=labels).loss
    got = compiled(input_ids=ids, labels=labels).loss  # the fused loss: the fallback would warn (a break)
    assert rel(got, want) <= 1e-4
    want.backward()
    got.backward()
    for (name, p), (_, q) in zip(patched.named_parameters(), stock.named_parameters(), strict=True):
        assert rel(p.grad, q.grad) <= 1e-4, name
