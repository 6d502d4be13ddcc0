"""The ``keep_attention`` switch (tigon.nn.kept_attention): under non-reentrant gradient checkpointing the recompute
takes the attention kernel's outputs of the forward back instead of running the kernel again, and the step is
bitwise the one without the switch: in tigon's attention node, and through transformers' sdpa function where the
node stands aside (tigon.nn.kept_sdpa).

On the CPU the attention node is off by default (fused_attention.DEVICES, its dtypes): the node's tests add the CPU
and fp32 to run it under the interpreter, with sdpa's CPU flash kernel. On the GPU the same tests run the tiny model
in bf16 (DTYPE): there sdpa has no fused kernel for grouped heads in fp32, only its math fallback, which the node does
not call (so nothing would be kept). At 16 tokens each backward kernel sums over one block of keys, so the GPU runs
are bitwise too. The GPU test at the end counts the kernels launched at a training shape."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch

import tigon
from tests.helpers import ON_GPU
from tests.patching.tiny import DEVICE, batch, forced_offload, grads, tiny_model
from tests.patching.tiny_lora import node_in_fp32_here
from tigon.nn import attention, kept_attention
from tigon.nn.activation_offload import ScopedCheckpoint, _Handle
from tigon.nn.checkpoint_chain import CHECKPOINT_ATTR
from tigon.nn.kept_attention import KeepingCheckpoint, KeptCall

# the tiny model's dtype: one the device has a fused sdpa kernel for, with grouped heads (module docs)
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
# kernels alone: nothing but the attention patched (the norms, MLP and loss head stay stock)
ONLY_ATTENTION = dict(rms_norm=False, mlp=False, fused_linear_cross_entropy=False)
NON_REENTRANT = {"use_reentrant": False}


@pytest.fixture
def kernel_calls(monkeypatch):
    """The node on this device, and a list that gets one entry per attention kernel the node launches."""
    node_in_fp32_here(monkeypatch)
    calls = []
    attend = attention.attend

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return attend(*args, **kwargs)

    monkeypatch.setattr(attention, "attend", counting)
    return calls


def _patched(layers=3, **switches):
    """A tiny sdpa Llama with only its attention patched (and ``switches``), and the Patch."""
    torch.manual_seed(0)
    model = tiny_model("llama", num_hidden_layers=layers).to(DEVICE, DTYPE)
    model.config._attn_implementation = "sdpa"
    return model, tigon.patch(model, **ONLY_ATTENTION, **switches)


def _model(layers=3, **switches):
    return _patched(layers, **switches)[0]


def _step(model, checkpointing=NON_REENTRANT, *, backwards=1):
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    ids, labels = batch(0, seq=16)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    for i in range(backwards):
        loss.backward(retain_graph=i + 1 < backwards)
    return loss.detach(), grads(model)


def _assert_equal(got, want):
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys() and all(torch.equal(got[1][n], g) for n, g in want[1].items())


def test_the_recompute_takes_the_kernels_outputs_back_bitwise(kernel_calls):
    want = _step(_model(), None)  # no checkpointing: one kernel a layer
    assert len(kernel_calls) == 3
    kernel_calls.clear()
    checkpointed = _step(_model())
    assert len(kernel_calls) == 6  # forward and recompute
    kernel_calls.clear()
    got = _step(_model(keep_attention=True))
    assert len(kernel_calls) == 3  # forward only
    _assert_equal(got, checkpointed)
    _assert_equal(got, want)


def test_a_reentrant_checkpoint_keeps_nothing_and_computes_the_same(kernel_calls):
    """Its first run is without grad, where the node stands aside (stock attention runs): the recompute's node
    finds nothing kept and runs its kernel."""
    want = _step(_model(), {"use_reentrant": True})
    calls = len(kernel_calls)
    kernel_calls.clear()
    got = _step(_model(keep_attention=True), {"use_reentrant": True})
    assert len(kernel_calls) == calls == 3
    _assert_equal(got, want)


def test_a_second_backward_through_a_retained_graph_replays_again(kernel_calls):
    want = _step(_model(), backwards=2)
    kernel_calls.clear()
    got = _step(_model(keep_attention=True), backwards=2)
    assert len(kernel_calls) == 3
    _assert_equal(got, want)


def test_what_is_kept_goes_with_the_graph(kernel_calls, monkeypatch):
    """The kept outputs live as long as the checkpoint holds the function: after the backward they are freed,
    though the loss (and its graph's nodes) is still referenced."""
    kept = []
    record = KeptCall.attend

    def watching(self, compute, *args):
        outputs = record(self, compute, *args)
        kept.append(weakref.ref(outputs[0]))
        return outputs

    monkeypatch.setattr(KeptCall, "attend", watching)
    model = _model(keep_attention=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    ids, labels = batch(0, seq=16)
    loss = model(input_ids=ids, labels=labels).loss
    assert len(kept) == 3 and all(ref() is not None for ref in kept)
    loss.backward()
    gc.collect()
    assert all(ref() is None for ref in kept)
    loss = model(input_ids=ids, labels=labels).loss
    del loss  # no backward: freed with the graph
    gc.collect()
    assert all(ref() is None for ref in kept[3:])


def test_a_replay_that_meets_another_call_computes_from_there():
    computed = []

    def compute(name):
        computed.append(name)
        return (name,)

    q = torch.zeros(2, 3)
    other = torch.zeros(2, 4)

    def layer(first_shape):
        a = kept_attention.attend(lambda: compute("a"), first_shape, first_shape, first_shape, None)
        b = kept_attention.attend(lambda: compute("b"), q, q, q, None)
        return a + b

    call = KeptCall(layer)
    assert call(q) == ("a", "b") and computed == ["a", "b"]
    assert call(q) == ("a", "b") and computed == ["a", "b"]  # replayed: nothing computed
    assert call(other) == ("a", "b") and computed == ["a", "b", "a", "b"]  # diverged at the first: both computed
    assert len(call.entries) == 2 and kept_attention.current() is None
    assert kept_attention.attend(lambda: compute("c"), q, q, q, None) == ("c",)  # no holder: computed


def test_the_switch_composes_with_offload_and_reverts(kernel_calls):
    want = _step(_model(layers=2))
    model, handle = _patched(layers=2, keep_attention=True, offload_activations=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    function = vars(model.model.layers[0])[CHECKPOINT_ATTR]  # transformers' (the patch came before it)
    kernel_calls.clear()
    got = _step(model, None)  # checkpointing already on; the first forward wraps each layer's function
    assert len(kernel_calls) == 2  # on the CPU the offload's scope stays off; keep_attention keeps
    _assert_equal(got, want)
    for layer in model.model.layers:
        chain, wrapper = [], vars(layer)[CHECKPOINT_ATTR]
        while isinstance(wrapper, (KeepingCheckpoint, ScopedCheckpoint)):
            chain.append(type(wrapper).__name__)
            wrapper = wrapper.inner
        assert sorted(chain) == ["KeepingCheckpoint", "ScopedCheckpoint"] and wrapper is function
    handle.revert()
    assert all(vars(layer)[CHECKPOINT_ATTR] is function for layer in model.model.layers)
    assert not any(k.startswith("_tigon") for layer in model.model.layers for k in vars(layer))


def _check_stowed(kept, padded):
    """Each of the 3 layers' KeptCalls holds one entry, stowed: the output and log-sum-exp as handles in the
    group of that layer's offloaded storages, beside its input; the bias of a padded batch as the tensor the
    layers share."""
    assert len(kept) == 3 and all(len(entries) == 1 and entries[0][2] for entries in kept)
    groups = []
    for (_, (out, saved, _), _), in kept:
        lse, bias = saved[0], saved[-1]
        assert isinstance(out, _Handle) and isinstance(lse, _Handle) and out.stored.group is lse.stored.group
        group = out.stored.group
        live = {id(ref()) for ref in group.stored if ref() is not None}
        assert {id(out.stored), id(lse.stored)} < live  # and the layer's input
        groups.append(group)
        assert bias is None if not padded else (type(bias) is torch.Tensor and bias is kept[0][0][1][1][-1])
    assert len({id(group) for group in groups}) == 3


@pytest.mark.parametrize("padded, backwards, switches", [(False, 1, {}), (True, 1, {}), (False, 2, {}),
                                                      (False, 1, {"tiled_mlp": True})],
                         ids=["causal", "padded", "retained-graph", "tiled-mlp"])
def test_with_the_offload_the_kept_outputs_wait_on_the_host(kernel_calls, monkeypatch, padded, backwards, switches):
    """With the offload's scope around each layer's forward, what a layer keeps (the kernel's output and
    log-sum-exp) becomes handles in that layer's group of offloaded storages, beside its checkpointed input; the
    recompute takes them back, and the step is bitwise the one without either switch (``switches`` on in both).
    A padded batch's bias, made once for all the layers, stays as it is. After the backward nothing is left on the
    host."""
    made = []
    init = KeptCall.__init__
    monkeypatch.setattr(KeptCall, "__init__", lambda self, *a, **k: init(self, *a, **k) or made.append(self))

    def run(keep, offload):
        model = _model(keep_attention=keep, **switches)
        offloader = forced_offload(model) if offload else None
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
        ids, labels = batch(0, seq=16)
        mask = torch.ones_like(ids)
        if padded:
            mask[0, :5] = 0  # left padding in the first sequence
        made.clear()
        kernel_calls.clear()
        loss = model(input_ids=ids, labels=labels, attention_mask=mask).loss
        if keep and offload:
            _check_stowed([call.entries for call in made], padded)
        peak = offloader.peak_host_bytes if offload else 0
        for i in range(backwards):
            loss.backward(retain_graph=i + 1 < backwards)
        return (loss.detach(), grads(model)), len(kernel_calls), peak, offloader

    want, _, _, _ = run(False, False)
    _, _, inputs_only, _ = run(False, True)
    got, calls, peak, offloader = run(True, True)
    _assert_equal(got, want)
    assert calls == 3  # the forward's kernels only, for every backward
    assert peak > inputs_only
    made.clear()  # this test's references to the checkpoints' functions
    gc.collect()
    assert offloader.pool.in_use_bytes == 0


def test_lora_adapters_in_the_node_train_the_same(kernel_calls):
    """A PEFT LoRA model (adapters on q/k/v/o inside the node), checkpointed: the same step, half the kernels."""
    pytest.importorskip("peft")
    from tests.patching import tiny_lora

    def lora_step(keep):
        model = tiny_lora.lora(tiny_lora.base_model().to(DTYPE))
        tigon.patch(model, keep_attention=keep)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
        kernel_calls.clear()
        return tiny_lora.step(model), len(kernel_calls)

    (want, calls), (got, kept_calls) = lora_step(False), lora_step(True)
    assert (calls, kept_calls) == (4, 2)  # 2 layers
    assert want[1] and all("lora_" in name for name in want[1])
    _assert_equal(got, want)


def test_copies_and_pickles_keep_it(kernel_calls):
    """Copied before checkpointing is enabled (under it, transformers' own input hook is a local function, which
    pickle refuses): the copies' layers wrap their checkpoint functions as the original's do."""
    model = _model(keep_attention=True)
    copies = (copy.deepcopy(model), pickle.loads(pickle.dumps(model)))
    want = _step(model)
    for copied in copies:
        kernel_calls.clear()
        _assert_equal(_step(copied), want)
        assert len(kernel_calls) == 3


@pytest.mark.parametrize("model_type, switches, padded, backwards, autocast", [
    ("qwen3", {}, False, 1, False),                  # q/k norms: no node, transformers' sdpa function
    ("phi3", {}, False, 1, False),                   # one qkv projection: no node
    ("llama", {"fused_attention": False}, False, 1, False),
    ("qwen3", {}, True, 1, False),                   # a padding mask: k and v repeated, the boolean mask
    ("qwen3", {}, True, 2, False),                   # a second backward through the retained graph
    ("qwen3", {}, False, 1, True),                   # bf16 autocast: fp32 q and k cast as autocast casts them
    ("llama", {"fused_attention": False}, True, 1, True),
], ids=["qwen3", "phi3", "llama-unfused", "qwen3-padded", "qwen3-padded-twice", "qwen3-autocast",
        "llama-unfused-padded-autocast"])
def test_outside_the_node_transformers_sdpa_call_is_kept(monkeypatch, model_type, switches, padded, backwards,
                                                         autocast):
    """Where the attention does not run as tigon's node, its sdpa call (through tigon's wrapper of transformers'
    function) is tigon.nn.kept_sdpa's node inside the checkpoint: bitwise what sdpa computes, and its kernel runs
    in the forward only (on the CPU: sdpa's flash kernel, fp32)."""
    calls = []
    attend = attention.attend
    monkeypatch.setattr(attention, "attend", lambda *a, **k: calls.append(1) or attend(*a, **k))

    def run(keep):
        torch.manual_seed(0)
        model = tiny_model(model_type, num_hidden_layers=3).to(DEVICE)
        model.config._attn_implementation = "sdpa"
        tigon.patch(model, keep_attention=keep, **{**ONLY_ATTENTION, **switches})
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
        ids, labels = batch(0, seq=16)
        mask = torch.ones_like(ids)
        if padded:
            mask[0, :5] = 0  # left padding in the first sequence
        model.zero_grad(set_to_none=True)
        calls.clear()
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=labels, attention_mask=mask).loss
        for i in range(backwards):
            loss.backward(retain_graph=i + 1 < backwards)
        return (loss.detach(), grads(model)), len(calls)

    (want, stock_calls), (got, kept_calls) = run(False), run(True)
    assert (stock_calls, kept_calls) == (0, 3)  # stock: sdpa itself; kept: 3 layers' forwards, no recompute
    _assert_equal(got, want)


def test_masked_calls_keep_one_bias_for_all_the_layers(monkeypatch):
    """A padded batch's mask turned into one additive bias for every layer (the model's MaskBiases): what the
    layers keep until the backward holds that one bias, not one a layer."""
    outputs = []
    record = KeptCall.attend

    def watching(self, compute, *args):
        result = record(self, compute, *args)
        outputs.append(result)
        return result

    monkeypatch.setattr(KeptCall, "attend", watching)
    torch.manual_seed(0)
    model = tiny_model("qwen3", num_hidden_layers=3).to(DEVICE)
    model.config._attn_implementation = "sdpa"
    tigon.patch(model, keep_attention=True, **ONLY_ATTENTION)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    ids, labels = batch(0, seq=16)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    model(input_ids=ids, labels=labels, attention_mask=mask).loss.backward()
    biases = [saved[-1] for _, saved, _ in outputs]  # 3 layers' forwards, then their recomputes' (the last first)
    assert len(biases) == 6 and biases[0] is not None and all(b is biases[0] for b in biases)
    assert all(got is kept for got, kept in zip(outputs[3:], reversed(outputs[:3]), strict=True))


def test_what_the_patch_says():
    model = tiny_model("llama")
    model.config._attn_implementation = "sdpa"
    lines = tigon.patch(model, keep_attention=True).replaced
    assert any(line.startswith("LlamaDecoderLayer: under non-reentrant gradient checkpointing") and
               "(tigon's attention node, or transformers' sdpa attention function where the node stands aside)" in line
               for line in lines)
    qwen3 = tigon.patch(tiny_model("qwen3"), keep_attention=True).replaced  # eager attention: nothing kept
    assert any("kept from the forward (transformers' sdpa attention function)" in line for line in qwen3)
    assert "keep_attention: the model's attention implementation is 'eager', not 'sdpa': nothing is kept" in qwen3


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device: runs in scripts/gpu-check.sh on a GPU")
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])  # tigon's attention node; transformers' sdpa function
def test_on_the_gpu_the_recompute_launches_no_attention_kernel(model_type):
    """bf16 autocast, sdpa's GPU kernels (in tigon's node; in tigon.nn.kept_sdpa's for Qwen3): the loss is bitwise
    the one without the switch, the gradients within twice the distance between two runs without the switch
    (cuDNN's and flash's backward sum dq with atomics, in an order that may change between runs; bitwise where
    the two runs are), and the backward launches no attention forward (the profiler counts sdpa's forward ops:
    3 layers, 6 without the switch)."""
    def step(keep):
        torch.manual_seed(0)
        model = tiny_model(model_type, num_hidden_layers=3, hidden_size=256, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, intermediate_size=512,
                           max_position_embeddings=512).cuda()
        model.config._attn_implementation = "sdpa"
        tigon.patch(model, keep_attention=keep)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
        ids, labels = batch(0, seq=512, device="cuda")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
        forwards = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")
                       and e.key.endswith("_attention"))
        return loss.detach(), grads(model), forwards

    def distance(a, b):
        return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)

    (loss, want, forwards), (again_loss, again, _) = step(False), step(False)
    got_loss, got, kept_forwards = step(True)
    assert forwards == 6 and kept_forwards == 3
    assert torch.equal(got_loss, loss) and torch.equal(again_loss, loss)
    assert got.keys() == want.keys() and distance(got, want) <= 2 * distance(again, want)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device: runs in scripts/gpu-check.sh on a GPU")
def test_on_the_gpu_with_the_offload_the_kept_outputs_leave_the_gpu():
    """The offload on a CUDA model (pinned host memory, its side stream), bf16 autocast, 4,096 tokens: after the
    forward the kept outputs (4 MiB a layer) are not held on the GPU, where keep_attention alone holds them; the loss
    is bitwise keep_attention's alone, the gradients within twice the distance between two of its runs (cuDNN's and
    flash's backward sum dq with atomics: the GPU test above)."""
    def step(keep, offload):
        torch.manual_seed(0)
        model = tiny_model("llama", num_hidden_layers=3, hidden_size=256, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, intermediate_size=512,
                           max_position_embeddings=4096).cuda()
        model.config._attn_implementation = "sdpa"
        tigon.patch(model, keep_attention=keep, offload_activations=offload)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
        ids, labels = batch(0, seq=4096, device="cuda")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # frees the blocks the side stream's copies read (their events are done)
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), grads(model), held

    def distance(a, b):
        return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)

    loss, want, kept_held = step(True, False)
    again_loss, again, _ = step(True, False)
    got_loss, got, kept_offloaded_held = step(True, True)
    _, _, offloaded_held = step(False, True)
    _, _, plain_held = step(False, False)
    kept_bytes = 3 * 2 * 4096 * 4 * 64 * 2  # 3 layers' outputs (B, T, Hq, D) in bf16
    assert kept_held - plain_held >= kept_bytes
    assert kept_offloaded_held - offloaded_held < kept_bytes / 2
    assert torch.equal(got_loss, loss) and torch.equal(again_loss, loss)
    assert got.keys() == want.keys() and distance(got, want) <= 2 * distance(again, want)
