"""The long-context switches through ``tigon.patch``: ``tiled_mlp`` and ``offload_activations`` compute
what stock computes (fp32 on the CPU, bf16 on the GPU), with gradient checkpointing of both kinds, with
``recompute_norms``, with PEFT LoRA and with each other, report themselves, and revert cleanly."""

from __future__ import annotations

import copy

import pytest
import torch

import tigon
from tests.helpers import LOSS_TOLERANCE, TOLERANCE
from tests.patching.tiny import DEVICE, assert_grads_close, batch, forced_offload, grads, rel, tiny_model
from tigon.nn.activation_offload import OffloadConfig, ScopedCheckpoint, piece_sizes
from tigon.nn.checkpoint_chain import CHECKPOINT_ATTR
from tigon.nn.tiled_mlp import TiledForward
from tigon.patching.parts import long_context

# Only the new switch: the stock parts stay (no kernels under the interpreter: fast, and bitwise stock
# wherever the switch changes nothing).
PLAIN = dict(rope=False, rms_norm=False, mlp=False, fused_linear_cross_entropy=False)
CHECKPOINTING = [None, {"use_reentrant": True}, {"use_reentrant": False}]
CHECKPOINT_IDS = ["no-checkpointing", "reentrant", "non-reentrant"]


def _model(**overrides):
    torch.manual_seed(0)
    return tiny_model("llama", **overrides).to(DEVICE)


def _step(model, *, seq=12, checkpointing=None, autocast=False):
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    ids, labels = batch(0, seq=seq)
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), grads(model)


def _mlps(model):
    return [m for m in model.modules() if isinstance(vars(m).get("forward"), TiledForward)]


def _small_chunks(model, tokens=7):
    """Chunks of ``tokens`` rows (24 rows a batch: 4 chunks, the last one short) instead of the default
    policy's ≥ 256, so that the tiny models run tiled at the tiny batch."""
    for mlp in _mlps(model):
        mlp.forward.chunk_tokens = tokens
    return model


def _assert_matches(got, want, dtype=torch.float32):
    (loss, g), (want_loss, want_g) = got, want
    assert rel(loss, want_loss) <= LOSS_TOLERANCE[dtype]
    assert_grads_close(g, want_g, TOLERANCE[dtype])


def test_both_switches_are_off_by_default():
    from tigon.patching.engine import SWITCHES

    assert SWITCHES["offload_activations"] is False and SWITCHES["tiled_mlp"] is False
    model = _model()
    handle = tigon.patch(model)
    assert not any("offload" in line or "tiled" in line for line in handle.replaced)
    assert _mlps(model) == [] and long_context.offloader_of(model) is None


@pytest.mark.parametrize("checkpointing", CHECKPOINTING, ids=CHECKPOINT_IDS)
def test_tiled_mlp_matches_stock_at_the_default_chunks(checkpointing):
    """320 tokens in chunks of 256 (the default policy at hidden 32): two chunks, the second short."""
    stock = _model(max_position_embeddings=256)
    patched = copy.deepcopy(stock)
    tigon.patch(patched, tiled_mlp=True, **PLAIN)
    calls = []
    patched.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, y: calls.append(a[0].shape[0]))
    got = _step(patched, seq=160, checkpointing=checkpointing)
    want = _step(stock, seq=160, checkpointing=checkpointing)
    _assert_matches(got, want)
    forwards = 1 if checkpointing is None else 2  # the checkpoint's recompute runs the tiled forward again
    assert calls == [256, 64] * (forwards + 1)  # + the backward's recompute of each chunk


@pytest.mark.parametrize("checkpointing", CHECKPOINTING, ids=CHECKPOINT_IDS)
def test_both_switches_compose_with_tigons_mlp_recompute_norms_and_checkpointing(checkpointing):
    stock = _model()
    patched = copy.deepcopy(stock)
    tigon.patch(patched, recompute_norms=True, tiled_mlp=True, offload_activations=True)
    offloader = forced_offload(_small_chunks(patched))
    got = _step(patched, checkpointing=checkpointing)
    want = _step(stock, checkpointing=checkpointing)
    _assert_matches(got, want)
    assert offloader.host_bytes > 0 and offloader.pool.in_use_bytes == 0


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_with_checkpointing_each_layers_input_is_what_goes(reentrant):
    model = _model()
    offloader = forced_offload(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids, labels = batch(0)
    loss = model(input_ids=ids, labels=labels).loss
    hidden = ids.numel() * model.config.hidden_size * 4  # fp32 hidden states, one a layer
    assert offloader.pool.in_use_bytes == len(model.model.layers) * sum(piece_sizes(hidden, offloader.config))
    loss.backward()
    assert offloader.pool.in_use_bytes == 0


def test_lora_on_the_mlp_projections_trains_as_stock_peft():
    from peft import LoraConfig, get_peft_model

    def lora(model):
        torch.manual_seed(1)
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj",
                                                                                          "down_proj", "q_proj"]))
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.2)  # B = 0 at init would hide A's gradient
        return peft_model

    stock = lora(_model())
    patched = lora(_model())
    tigon.patch(patched, tiled_mlp=True, **PLAIN)
    offloader = forced_offload(_small_chunks(patched.get_base_model()))
    got, want = _step(patched), _step(stock)
    _assert_matches(got, want)
    assert any("lora_A" in name and "mlp" in name for name in got[1])
    assert offloader.host_bytes > 0


def test_offload_on_a_cpu_model_changes_nothing_and_says_so():
    if DEVICE.type != "cpu":
        pytest.skip("a CPU model")
    stock = _model()
    patched = copy.deepcopy(stock)
    handle = tigon.patch(patched, offload_activations=True, **PLAIN)
    assert long_context.CPU_LINE in handle.replaced
    assert any("offload_activations" in line and "LlamaDecoderLayer" in line for line in handle.replaced)
    got, want = _step(patched), _step(stock)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(got[1][name], g) for name, g in want[1].items())
    assert long_context.offloader_of(patched).host_bytes == 0


def test_recompute_norms_stays_on_on_a_cpu_model_with_offload():
    from tigon.bench.saved import saved_bytes

    def saved(**switches):
        model = _model()
        tigon.patch(model, recompute_norms=True, **switches)
        ids, labels = batch(0)
        loss = model(input_ids=ids, labels=labels).loss
        return saved_bytes(loss, list(model.parameters())).total

    if DEVICE.type != "cpu":
        pytest.skip("a CPU model")
    assert saved(offload_activations=True) == saved()


def test_revert_restores_the_stock_modules_and_patching_twice_is_a_no_op():
    model = _model()
    handle = tigon.patch(model, tiled_mlp=True, offload_activations=True)
    assert tigon.patch(model, tiled_mlp=True, offload_activations=True).replaced == []
    layer = model.model.layers[0]
    assert len(_mlps(model)) == 2 and layer._forward_pre_hooks and long_context.offloader_of(model) is not None
    handle.revert()
    assert _mlps(model) == [] and "forward" not in vars(layer.mlp)
    assert type(layer.mlp).__name__ == "LlamaMLP"
    assert not layer._forward_pre_hooks and not layer._forward_hooks
    assert long_context.OFFLOAD_ATTR not in vars(layer) and long_context.offloader_of(model) is None


def test_the_checkpoint_function_is_wrapped_once_pickles_and_reverts():
    """``gradient_checkpointing_enable()`` after the patch: the next forward wraps each layer's checkpoint
    function (transformers 5.17–5.22 call it outside the layer's hooks), once; a deep copy keeps it
    working (pickle: transformers' own input hook under checkpointing is a local function), and the
    revert puts transformers' function back."""
    model = _model()
    handle = tigon.patch(model, offload_activations=True, **PLAIN)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    function = vars(model.model.layers[0])[CHECKPOINT_ATTR]
    want = _step(model)
    _step(model)
    for layer in model.model.layers:
        wrapper = vars(layer)[CHECKPOINT_ATTR]
        assert isinstance(wrapper, ScopedCheckpoint) and not isinstance(wrapper.inner, ScopedCheckpoint)
    got = _step(copy.deepcopy(model))
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[1][n], g) for n, g in want[1].items())
    handle.revert()
    assert all(vars(layer)[CHECKPOINT_ATTR] is function for layer in model.model.layers)


def test_copies_pickles_and_saved_models_train_as_the_original():
    import io
    import pickle

    model = _small_chunks(_model())
    tigon.patch(model, tiled_mlp=True, offload_activations=True, **PLAIN)
    want = _step(copy.deepcopy(model))

    def saved_and_loaded(m):
        buffer = io.BytesIO()
        torch.save(m, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    for clone in (copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m)), saved_and_loaded):
        copied = clone(model)
        assert len(_mlps(copied)) == 2 and all(m.forward.module is m for m in _mlps(copied))
        assert long_context.offloader_of(copied) is not long_context.offloader_of(model)
        got = _step(copied)
        if DEVICE.type == "cpu":  # bitwise (on the GPU the embedding's backward sums in any order)
            assert torch.equal(got[0], want[0]) and all(torch.equal(got[1][n], g) for n, g in want[1].items())
        _assert_matches(got, want)


def test_cuda_graphs_and_offload_are_exclusive():
    model = _model()
    with pytest.raises(ValueError, match="exclusive"):
        tigon.patch(model, offload_activations=True, cuda_graphs=True)
    assert _mlps(model) == [] and not model.model.layers[0]._forward_pre_hooks
    with pytest.raises(ValueError, match="exclusive"):
        tigon.patch("llama", offload_activations=True, cuda_graphs=True)


def test_class_patch_reports_and_applies_both():
    handle = tigon.patch("llama", tiled_mlp=True, offload_activations=True, **PLAIN)
    try:
        assert any("(tiled_mlp)" in line for line in handle.replaced)
        assert any("(offload_activations)" in line for line in handle.replaced)
        model = _model()
        assert len(_mlps(model)) == 2 and long_context.offloader_of(model) is not None
    finally:
        handle.revert()


# ---------------------------------------------------------------------------------------------- GPU


# tigon with both switches against tigon without them, both bf16 under the default patch: offloading is
# bitwise (the bytes that come back are the bytes that went), and the tiled MLP runs each token's MLP as
# the whole MLP does but in GEMMs over 256 rows instead of 1200 (a kernel may pick another tiling of the
# reduction for another row count) and sums the weights' gradients chunk by chunk. So the loss stays
# within one bf16 rounding of itself (2^-8 = 3.9e-3; the loss is an fp32 sum over 1200 tokens, where
# such differences average out), the gradients within a few roundings (their norm-wise error, through
# the backward's bf16 activations gradients and the chunked sums).
SWITCHES_LOSS_TOLERANCE, SWITCHES_GRAD_TOLERANCE = 4e-3, 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", CHECKPOINTING, ids=CHECKPOINT_IDS)
def test_both_switches_match_tigon_without_them_in_bf16_on_the_gpu(checkpointing):
    """bf16 weights and activations, 2 x 600 tokens (chunks of 256: 5, the last short). No saved tensor of
    the tiny model reaches the default 1 MiB: the layers offload everything (min_bytes=0).

    The switches' own claim (exact) is checked against the same default patch in the same bf16 without
    them, at the tolerances above; both are checked against the model in fp32 (the same bf16-rounded
    weights, computed in fp32) at the bf16 tolerance of the API, so that neither drifts from the math."""
    unswitched = _model(max_position_embeddings=1024).to(torch.bfloat16)
    reference = copy.deepcopy(unswitched).float()
    switched = copy.deepcopy(unswitched)
    tigon.patch(unswitched)
    tigon.patch(switched, tiled_mlp=True)
    offloader = forced_offload(switched, OffloadConfig(min_bytes=0))
    got = _step(switched, seq=600, checkpointing=checkpointing)
    assert offloader.host_bytes > 0 and offloader.pool.in_use_bytes == 0
    want = _step(unswitched, seq=600, checkpointing=checkpointing)
    assert rel(got[0], want[0]) <= SWITCHES_LOSS_TOLERANCE
    assert_grads_close(got[1], want[1], SWITCHES_GRAD_TOLERANCE)
    fp32 = _step(reference, seq=600, checkpointing=checkpointing)
    _assert_matches(got, fp32, torch.bfloat16)
    _assert_matches(want, fp32, torch.bfloat16)


@pytest.mark.gpu
def test_both_switches_with_checkpointing_lower_the_peak_on_the_gpu():
    """Llama-shaped, 4 layers at hidden 1024, 2 x 8192 tokens, bf16 autocast, non-reentrant checkpointing:
    the layers' inputs (fp32, 64 MiB each) wait on the host but for the two the backward holds, and the
    recomputed MLP's (tokens, 4096) bf16 intermediates (128 MiB each) exist a chunk at a time."""
    def peak(**switches):
        torch.manual_seed(0)
        model = tiny_model("llama", hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
                           num_key_value_heads=8, head_dim=128, num_hidden_layers=4,
                           max_position_embeddings=16384).to(DEVICE)
        model.config._attn_implementation = "sdpa"
        tigon.patch(model, **switches)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for _ in range(2):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            _step(model, seq=8192, autocast=True)
            torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    assert peak(offload_activations=True, tiled_mlp=True) < peak() - 3 * 2 * 8192 * 1024 * 4
