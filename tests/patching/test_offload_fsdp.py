"""``offload_activations`` under FSDP2 (``fully_shard`` on each decoder layer and the root): each rank
offloads what its own layers save, so the switch composes with the sharding. A group of one rank in this
process (NCCL on the GPU, gloo on the CPU): the model patched with the switch, then sharded, trains
bitwise as the same model sharded without it (offloading copies bytes to the host and back, nothing
else), with and without gradient checkpointing; on the GPU the host pool shows the offload happened, on
the CPU the patch says nothing is offloaded and nothing is. ``keep_attention`` under FSDP2 on the CPU: bitwise, and
the recompute launches no attention kernel."""

from __future__ import annotations

import copy

import pytest
import torch

import tigon
from tests.helpers import one_rank_group
from tests.patching.tiny import batch, tiny_model
from tigon.patching.parts import long_context

# Only the switch on the CPU: the stock parts stay (no kernels under the interpreter: fast).
PLAIN = dict(rope=False, rms_norm=False, mlp=False, fused_linear_cross_entropy=False)
CHECKPOINTING = [None, {"use_reentrant": False}]
CHECKPOINT_IDS = ["no-checkpointing", "non-reentrant"]
STEPS = 2
LR = 1e-3


def _shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _full(tensor) -> torch.Tensor:
    """A parameter or gradient of the sharded model as one plain tensor (a DTensor's whole value)."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def _train(model, *, seq, autocast, checkpointing, on_backward=None) -> list[dict]:
    """``STEPS`` AdamW steps on fresh batches; per step the loss and every gradient (taken before the
    optimizer steps), and after the last step the parameters."""
    if checkpointing is not None:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        ids, labels = batch(step, seq=seq, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=labels).loss
        if on_backward is not None:
            on_backward()
        loss.backward()
        steps.append({"loss": loss.detach().clone(),
                      "grads": {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    steps.append({"params": {n: _full(p) for n, p in model.named_parameters()}})
    return steps


def _assert_bitwise(got: list[dict], want: list[dict]) -> None:
    assert len(want[0]["grads"]) == len(want[-1]["params"])  # every parameter trained
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        if "loss" in w:
            assert torch.equal(g["loss"], w["loss"]), f"step {step}: loss {g['loss']} != {w['loss']}"
        for key in ("grads", "params"):
            if key in w:
                assert g[key].keys() == w[key].keys()
                for name, tensor in w[key].items():
                    assert torch.equal(g[key][name], tensor), f"step {step}: {key} of {name} differ"


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", CHECKPOINTING, ids=CHECKPOINT_IDS)
def test_offload_under_fsdp2_trains_bitwise_as_without_it_on_the_gpu(checkpointing):
    """4 layers at hidden 256, 2 x 1024 tokens, fp32 weights under bf16 autocast, eager attention (its
    backward is deterministic, so two runs may be compared bit for bit), tigon's default patch on both
    sides. The layers' fp32 inputs (2 MiB) and their largest saved activations pass the default 1 MiB
    floor: the host pool holds them between the forward and the backward, and gives them all back."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with one_rank_group("nccl"):
        torch.manual_seed(0)
        plain = tiny_model("llama", hidden_size=256, intermediate_size=688, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, num_hidden_layers=4,
                           max_position_embeddings=2048).to(device)
        plain.config._attn_implementation = "eager"
        offloaded = copy.deepcopy(plain)
        tigon.patch(plain)
        handle = tigon.patch(offloaded, offload_activations=True)
        assert any("offload_activations" in line for line in handle.replaced)
        assert long_context.CPU_LINE not in handle.replaced
        offloader = long_context.offloader_of(offloaded)
        held = []

        def in_use():  # between the forward and the backward: what waits on the host
            torch.cuda.synchronize()
            held.append(offloader.pool.in_use_bytes)

        got = _train(_shard(offloaded), seq=1024, autocast=True, checkpointing=checkpointing, on_backward=in_use)
        want = _train(_shard(plain), seq=1024, autocast=True, checkpointing=checkpointing)
        layer_input = 2 * 1024 * 256 * 4  # fp32 hidden states of the batch, one a layer
        assert len(held) == STEPS and all(b >= 4 * layer_input for b in held), held
        assert offloader.peak_host_bytes >= 4 * layer_input and offloader.pool.in_use_bytes == 0
        assert offloader.host_bytes >= offloader.peak_host_bytes
        _assert_bitwise(got, want)


@pytest.mark.parametrize("checkpointing", CHECKPOINTING, ids=CHECKPOINT_IDS)
def test_offload_on_a_cpu_model_under_fsdp2_on_gloo_changes_nothing_and_says_so(checkpointing):
    with one_rank_group("gloo"):
        torch.manual_seed(0)
        stock = tiny_model("llama")
        patched = copy.deepcopy(stock)
        handle = tigon.patch(patched, offload_activations=True, **PLAIN)
        assert long_context.CPU_LINE in handle.replaced
        got = _train(_shard(patched), seq=12, autocast=False, checkpointing=checkpointing)
        want = _train(_shard(stock), seq=12, autocast=False, checkpointing=checkpointing)
        _assert_bitwise(got, want)
        offloader = long_context.offloader_of(patched)
        assert offloader.host_bytes == 0 and offloader.peak_host_bytes == 0


def test_keep_attention_under_fsdp2_on_gloo_trains_bitwise_and_keeps(monkeypatch):
    """``keep_attention`` composes with the sharding too: each rank's layers hand their checkpoints a KeptCall (on
    the CPU through transformers' sdpa call, tigon.nn.kept_sdpa), the recompute launches no attention kernel, and
    two AdamW steps are bitwise those of the same model sharded without it."""
    from tigon.nn import attention

    calls = []
    attend = attention.attend
    monkeypatch.setattr(attention, "attend", lambda *a, **k: calls.append(1) or attend(*a, **k))
    with one_rank_group("gloo"):
        torch.manual_seed(0)
        stock = tiny_model("llama")
        stock.config._attn_implementation = "sdpa"
        kept = copy.deepcopy(stock)
        tigon.patch(kept, keep_attention=True, **PLAIN)
        got = _train(_shard(kept), seq=12, autocast=False, checkpointing={"use_reentrant": False})
        assert len(calls) == STEPS * len(kept.model.layers)  # the forwards' only
        want = _train(_shard(stock), seq=12, autocast=False, checkpointing={"use_reentrant": False})
        _assert_bitwise(got, want)
