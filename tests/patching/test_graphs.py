"""Decoder layers as CUDA graphs (the cuda_graphs switch), and a layer forward that honours gradient
checkpointing in every transformers version (layer_forward.py).

On the CPU the switch must change nothing (every call runs eagerly). On the GPU a graphed model must
train exactly as the same patch without graphs: the replays run the same kernels on the same data, so
losses, gradients and weights agree to fp32 rounding (cuBLAS may pick another algorithm on the capture
stream), through the cases where a graph must stand aside: a second forward before the backward,
gradient accumulation, a forward without backward, new shapes, eval mode and no_grad.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tigon
from tests.helpers import ON_GPU, one_rank_group
from tests.patching.tiny import DEVICE, batch, grads, rel, sdpa_config_overrides, tiny_model, train
from tigon.patching import graphs
from tigon.patching.layer_forward import LayerForward

GPU_SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, vocab_size=512, max_position_embeddings=256)
TIGHT = 1e-5


def _pair(model_type, *, attn="sdpa", **overrides):
    """A tiny model patched without graphs and a deep copy patched with them (same weights); with sdpa,
    the config as sdpa takes it on every transformers release (Gemma-2 without its attention softcap)."""
    torch.manual_seed(0)
    if attn == "sdpa":
        overrides = {**sdpa_config_overrides(model_type), **overrides}
    plain = tiny_model(model_type, **overrides)
    plain.config._attn_implementation = attn
    plain.to(DEVICE)
    graphed = copy.deepcopy(plain)
    tigon.patch(plain)
    handle = tigon.patch(graphed, cuda_graphs=True)
    return plain, graphed, handle


def _replays(model) -> int:
    return sum(layer.forward.graphs.replays for layer in model.model.layers)


def _batch(seed, vocab, seq=64, batch_size=2):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch_size, seq), generator=gen).to(DEVICE)
    labels = ids.clone()
    labels[:, :5] = -100
    return ids, labels


# ---------------------------------------------------------------------------------------------- CPU


def test_cuda_graphs_switch_is_reported_and_reverted():
    torch.manual_seed(0)
    model = tiny_model("llama")
    before = [vars(layer).get("forward") for layer in model.model.layers]
    handle = tigon.patch(model, cuda_graphs=True)
    assert any("CUDA graphs" in line for line in handle.replaced)
    for layer in model.model.layers:
        assert isinstance(layer.forward, LayerForward) and layer.forward.graphs is not None
        assert isinstance(layer.forward.inner, LayerForward)  # the joins' forward runs inside
    assert not tigon.patch(model, cuda_graphs=True).replaced  # patched already: nothing more
    handle.revert()
    assert [vars(layer).get("forward") for layer in model.model.layers] == before


def test_cuda_graphs_reach_a_vision_language_models_decoder():
    """A VLM's language model layers take the switch (the vision tower's blocks do not); revert undoes it."""
    from tests.patching import tiny_vlm

    model = tiny_vlm.tiny_vlm("qwen2_5_vl")
    handle = tigon.patch(model, cuda_graphs=True)
    assert any("Qwen2_5_VLDecoderLayer" in line and "CUDA graphs" in line for line in handle.replaced)
    assert all(layer.forward.graphs is not None for layer in model.model.language_model.layers)
    # the vision blocks run their joined forward (rms_norm), eagerly
    assert all(isinstance(vars(block).get("forward"), LayerForward) for block in model.model.visual.blocks)
    assert all(block.forward.graphs is None for block in model.model.visual.blocks)
    handle.revert()
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.skipif(ON_GPU, reason="CPU semantics; on the GPU the tests below train with graphs on")
def test_cuda_graphs_off_the_gpu_changes_nothing():
    """Without CUDA tensors every call runs eagerly: bitwise the patch without graphs."""
    torch.manual_seed(0)
    plain = tiny_model("qwen2")
    graphed = copy.deepcopy(plain)
    tigon.patch(plain)
    tigon.patch(graphed, cuda_graphs=True)
    plain.cpu()
    graphed.cpu()
    ids, labels = batch(0, device="cpu")
    want = plain(input_ids=ids, labels=labels).loss
    got = graphed(input_ids=ids, labels=labels).loss
    want.backward()
    got.backward()
    assert torch.equal(got, want)
    for (name, g), w in zip(grads(graphed).items(), grads(plain).values(), strict=True):
        assert torch.equal(g, w), name
    assert sum(layer.forward.graphs.replays for layer in graphed.model.layers) == 0


def test_fsdp2_sharded_model_keeps_its_layers_eager():
    """FSDP2 swaps gathered plain tensors into a layer for its forward, so the parameters alone do not
    show the sharding: the model is recognised from its fully_shard-ed modules."""
    from torch.distributed.fsdp import fully_shard

    with one_rank_group("gloo"):
        torch.manual_seed(0)
        model = tiny_model("llama")
        tigon.patch(model, cuda_graphs=True)
        gathered = tuple(model.model.layers[0].parameters())  # plain tensors, as in the forward
        assert graphs._foreign_parameters(gathered, model) is None
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert graphs._foreign_parameters(gathered, model) == "FSDP2 (fully_shard) parameters"
        sharded = tuple(model.model.layers[0].parameters())  # DTensors outside the forward
        assert graphs._foreign_parameters(sharded, None) == "FSDP2 (DTensor) parameters"


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "olmo2"])
def test_joined_layers_are_checkpointed(model_type):
    """model.gradient_checkpointing_enable() recomputes a joined layer in the backward, whichever
    transformers checkpoints (in __call__, or in the class's forward that the instance forward replaces)."""
    torch.manual_seed(0)
    plain = tiny_model(model_type).to(DEVICE)
    patched = copy.deepcopy(plain)
    tigon.patch(plain)
    tigon.patch(patched)
    patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = []
    for layer in patched.model.layers:
        inner = layer.forward.inner

        def counted(*args, _inner=inner, **kwargs):
            calls.append(torch.is_grad_enabled())
            return _inner(*args, **kwargs)

        layer.forward.inner = counted
    ids, labels = batch(0)
    want = plain(input_ids=ids, labels=labels).loss
    got = patched(input_ids=ids, labels=labels).loss
    n = len(patched.model.layers)
    assert len(calls) == n  # the forward ran each layer once ...
    want.backward()
    got.backward()
    assert len(calls) == 2 * n  # ... and the backward ran it again: checkpointed
    assert rel(got, want) <= 1e-6
    for (name, g), w in zip(grads(patched).items(), grads(plain).values(), strict=True):
        assert rel(g, w) <= 1e-5, name


# ---------------------------------------------------------------------------------------------- GPU


def _steps(model, batches, *, accumulate=1, autocast=True, set_to_none=True):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for group in batches:
        for ids, labels in group:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=labels).loss / accumulate
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return torch.stack(losses)


def _assert_same_training(graphed, plain, tolerance=TIGHT):
    for (name, p), q in zip(graphed.named_parameters(), plain.parameters(), strict=True):
        assert rel(p, q) <= tolerance, f"{name} after training: {rel(p, q):.2e}"


def _assert_trains_alike(plain, graphed, batches, *, run=None, **options):
    """The same steps on both models (``run``: what trains the graphed one, e.g. its DDP wrapper): the
    same losses and, after them, the same weights."""
    want = _steps(plain, batches, **options)
    got = _steps(run or graphed, batches, **options)
    assert rel(got, want) <= TIGHT
    _assert_same_training(graphed, plain)


def _assert_two_forwards_alike(plain, graphed, pairs, weight):
    """Per pair of batches (a, b): loss(a) + weight * loss(b) in one backward, on both models: the same
    losses and gradients."""
    for (a, la), (b, lb) in pairs:
        results = []
        for model in (plain, graphed):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=a, labels=la).loss + weight * model(input_ids=b, labels=lb).loss
            loss.backward()
            results.append((loss.detach(), grads(model)))
            model.zero_grad(set_to_none=True)
        (want, want_grads), (got, got_grads) = results
        assert rel(got, want) <= TIGHT
        for name, g in got_grads.items():
            assert rel(g, want_grads[name]) <= TIGHT, name


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_graphed_training_matches_eager(model_type, attn):
    plain, graphed, _ = _pair(model_type, attn=attn, **GPU_SIZES)
    vocab = GPU_SIZES["vocab_size"]
    batches = [[_batch(step, vocab)] for step in range(4)]
    _assert_trains_alike(plain, graphed, batches)
    assert _replays(graphed) == 4 * len(graphed.model.layers)  # every layer replayed, every step


@pytest.mark.gpu
def test_graphed_gradient_accumulation_and_fp32():
    """Two micro-batches a step (AccumulateGrad adds the replayed gradients into .grad), no autocast."""
    plain, graphed, _ = _pair("qwen2", **GPU_SIZES)
    vocab = GPU_SIZES["vocab_size"]
    batches = [[_batch(2 * step, vocab), _batch(2 * step + 1, vocab)] for step in range(3)]
    _assert_trains_alike(plain, graphed, batches, accumulate=2, autocast=False)
    assert _replays(graphed) == 6 * len(graphed.model.layers)


@pytest.mark.gpu
def test_graphed_gradients_zeroed_in_place():
    """zero_grad(set_to_none=False): .grad, adopted from the graph's memory, is zeroed in place and
    must be moved out before the next replay writes that memory."""
    plain, graphed, _ = _pair("llama", **GPU_SIZES)
    vocab = GPU_SIZES["vocab_size"]
    batches = [[_batch(2 * step, vocab), _batch(2 * step + 1, vocab)] for step in range(3)]
    _assert_trains_alike(plain, graphed, batches, accumulate=2, set_to_none=False)


@pytest.mark.gpu
def test_second_forward_before_backward_runs_eagerly():
    """A preference loss's pattern: two forwards, one backward of their sum. The second forward must
    not overwrite the first one's graph buffers: it runs eagerly, and the gradients are exact."""
    plain, graphed, _ = _pair("llama", **GPU_SIZES)
    vocab = GPU_SIZES["vocab_size"]
    pairs = [(_batch(10 + step, vocab), _batch(20 + step, vocab)) for step in range(3)]
    _assert_two_forwards_alike(plain, graphed, pairs, weight=-0.5)
    assert _replays(graphed) == 3 * len(graphed.model.layers)  # the first forward of each step only


@pytest.mark.gpu
def test_two_shapes_before_one_backward():
    """Two graphed forwards (two signatures) of every layer before one backward: each replay's
    gradients must reach autograd intact although the replays share their gradient buffers."""
    plain, graphed, _ = _pair("qwen2", **GPU_SIZES)
    vocab = GPU_SIZES["vocab_size"]
    pairs = [(_batch(30 + step, vocab, seq=32), _batch(40 + step, vocab, seq=48)) for step in range(3)]
    _assert_two_forwards_alike(plain, graphed, pairs, weight=2.0)
    assert _replays(graphed) == 6 * len(graphed.model.layers)


@pytest.mark.gpu
def test_forward_without_backward_then_training():
    plain, graphed, _ = _pair("qwen2", **GPU_SIZES)
    vocab = GPU_SIZES["vocab_size"]
    for model in (plain, graphed):
        ids, labels = _batch(5, vocab)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(input_ids=ids, labels=labels)  # train mode, graph built, never backpropagated
    batches = [[_batch(step, vocab)] for step in range(3)]
    _assert_trains_alike(plain, graphed, batches)


@pytest.mark.gpu
def test_new_shapes_are_captured_then_run_eagerly(recwarn):
    plain, graphed, _ = _pair("llama", **GPU_SIZES)
    vocab = GPU_SIZES["vocab_size"]
    seqs = [32, 48, 32, 80, 48]  # a third signature, past MAX_SIGNATURES = 2, runs eagerly
    batches = [[_batch(step, vocab, seq=seq)] for step, seq in enumerate(seqs)]
    _assert_trains_alike(plain, graphed, batches)
    n = len(graphed.model.layers)
    assert _replays(graphed) == 4 * n
    assert all(len(layer.forward.graphs.entries) == graphs.MAX_SIGNATURES for layer in graphed.model.layers)
    assert any("input signatures" in str(w.message) for w in recwarn)


@pytest.mark.gpu
def test_eval_and_no_grad_run_eagerly():
    plain, graphed, _ = _pair("gemma2", **GPU_SIZES)
    ids, labels = _batch(0, GPU_SIZES["vocab_size"])
    for model in (plain, graphed):
        model.eval()
    with torch.no_grad():
        want = plain(input_ids=ids, labels=labels)
        got = graphed(input_ids=ids, labels=labels)
    assert rel(got.loss, want.loss) <= TIGHT and rel(got.logits, want.logits) <= TIGHT
    plain.train()
    graphed.train()
    with torch.no_grad():
        assert rel(graphed(input_ids=ids, labels=labels).loss, plain(input_ids=ids, labels=labels).loss) <= TIGHT
    assert _replays(graphed) == 0


@pytest.mark.gpu
def test_moved_parameters_are_recaptured():
    """Parameters replaced by new tensors (a dtype round trip) drop the graphs made with the old ones."""
    plain, graphed, _ = _pair("llama", **GPU_SIZES)
    vocab = GPU_SIZES["vocab_size"]
    batches = [[_batch(step, vocab)] for step in range(2)]
    _steps(plain, batches)
    _steps(graphed, batches)
    for model in (plain, graphed):
        model.double().float()  # new storage for every parameter
    more = [[_batch(step, vocab)] for step in range(2, 4)]
    _assert_trains_alike(plain, graphed, more)
    assert _replays(graphed) == 4 * len(graphed.model.layers)


@pytest.mark.gpu
def test_graphed_training_matches_stock_loss():
    """Against stock transformers (not only against tigon without graphs): the bf16 tolerance."""
    torch.manual_seed(0)
    stock = tiny_model("llama", **GPU_SIZES)
    stock.config._attn_implementation = "sdpa"
    stock.to(DEVICE)
    graphed = copy.deepcopy(stock)
    tigon.patch(graphed, cuda_graphs=True)
    batches = [[_batch(step, GPU_SIZES["vocab_size"])] for step in range(5)]
    want, got = _steps(stock, batches), _steps(graphed, batches)
    assert ((got - want).abs() / want.abs()).max() <= 2e-2
    losses, _ = train(graphed, 1)  # and a plain fp32 step after the autocast ones
    assert all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.gpu
def test_graphed_training_under_ddp():
    """DistributedDataParallel (one rank, NCCL) over a graphed model: its reducer's hooks on the
    parameters' AccumulateGrad nodes see the replayed gradients as they see eager ones."""
    from torch.nn.parallel import DistributedDataParallel

    with one_rank_group("nccl"):
        plain, graphed, _ = _pair("qwen2", **GPU_SIZES)
        vocab = GPU_SIZES["vocab_size"]
        batches = [[_batch(step, vocab)] for step in range(3)]
        _assert_trains_alike(plain, graphed, batches, run=DistributedDataParallel(graphed))
        assert _replays(graphed) == 3 * len(graphed.model.layers)


@pytest.mark.gpu
def test_graphed_vision_language_decoder_trains_as_eager():
    """A Qwen2.5-VL (M-RoPE positions, image features merged into the embeddings): its language model's
    decoder layers replay as graphs, the vision tower stays eager, and training matches the patch
    without graphs."""
    from tests.patching import tiny_vlm

    torch.manual_seed(0)
    plain = tiny_vlm.tiny_vlm("qwen2_5_vl", attention="sdpa").to(DEVICE)
    graphed = copy.deepcopy(plain)
    tigon.patch(plain)
    handle = tigon.patch(graphed, cuda_graphs=True)
    assert any("CUDA graphs" in line for line in handle.replaced)
    losses = []
    for model in (plain, graphed):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = []
        for step in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**tiny_vlm.vlm_batch("qwen2_5_vl", model.config, seed=step)).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.append(loss.detach())
        losses.append(torch.stack(run))
    layers = graphed.model.language_model.layers
    assert sum(layer.forward.graphs.replays for layer in layers) == 3 * len(layers)
    assert rel(losses[1], losses[0]) <= TIGHT
    _assert_same_training(graphed, plain)
