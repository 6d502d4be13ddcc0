"""A patched model's training step holds nothing that grows past O(T) in the tokens T (batch 1, no padding).

The CPU tests record the storage behind every op's output (forward and backward, under a
``TorchDispatchMode``) of tiny patched models at T = 256 tokens: hidden 32, intermediate 48, 4 query and 2
key/value heads of 8, vocab 64. The largest tensors a linear step legitimately makes are the fused gate and
up products ``(T, 2·48)``, the logits ``(T, 64)``, q/k/v ``(H, T, 8)`` and the rotary tables ``(T, 8)``:
all at most ``4·hidden·T = 128·T`` elements, while one ``T × T`` mask or score matrix is ``T² = 2·128·T``.
The sliding-window band runs in row blocks of 32 queries (the frozen config swapped for the test, as
test_sliding_window.py does), so a rectangle of its mask is ``32 × (32 + W - 1)`` elements.

Models: Llama (causal: sdpa's ``is_causal``, no mask tensor), Mistral (every layer sliding), Gemma-3
(sliding and full layers, a final-logit softcap) and Qwen2 (its sliding window on from the second layer);
without a padding mask, with an all-ones one, and with ``position_ids`` given (CASES). Gemma-2 is not among
them: transformers 5.25's Gemma-2 refuses sdpa (its attention-logit softcap), and eager attention builds
the ``(B, H, T, T)`` scores by design (flash_attention_2 applies the softcap and window in O(T)).

On the GPU these models run fp32, where sdpa's kernels for grouped key/value heads without a mask are flash and
cuDNN (fp16/bf16 only) and, left to sdpa, its math kernel with the ``(B·H, T, T)`` scores: the patched model hands
sdpa the heads repeated instead (band_attention.py, "Grouped heads"); a CPU test replays that choice.

The GPU tests measure the peak memory of a Llama-3.1-8B-shaped and a Mistral-shaped (4096-token window)
attention at 65,536 tokens, forward and backward, against a linear bound far below the 8 GiB a bf16
``T × T`` mask bias takes there.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers.masking_utils import create_sliding_window_causal_mask, sdpa_mask, sliding_window_causal_mask_function

import tigon
from tests.helpers import DEVICE
from tests.patching.tiny import assert_same_grads, rel, tiny_config
from tigon.ops.fused_linear_cross_entropy import chunk_plan
from tigon.patching import band_attention
from tigon.patching.causal_mask import BandMask

TOKENS = 256
VOCAB = 64
HIDDEN = 32
LINEAR = 4 * HIDDEN  # elements per token the largest linear tensor may hold (module docs)
BLOCK = 32
WINDOW = 8

MODELS = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
    "gemma3_text": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
}


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(band_attention, "CONFIG", band_attention.BandConfig(block_rows=BLOCK, min_blocks=2))


class LargestStorage(TorchDispatchMode):
    """The largest storage (in elements) behind any op's output while the mode is on, with the op and the
    output's shape. A :class:`BandMask` holds no storage: what is made of it is recorded as it is made."""

    def __init__(self):
        super().__init__()
        self.largest = (0, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and type(t) is not BandMask:
                elements = t.untyped_storage().nbytes() // t.element_size()
                if elements > self.largest[0]:
                    self.largest = (elements, func, tuple(t.shape))
        return out


def _sdpa_model(model_type, **overrides):
    config = tiny_config(model_type, vocab_size=VOCAB, max_position_embeddings=TOKENS,
                         **{**MODELS[model_type], **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train().to(DEVICE)


def _inputs(variant, seq, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, seq), generator=gen).to(DEVICE)
    inputs = {"input_ids": ids}
    if variant in ("ones", "positions"):
        inputs["attention_mask"] = torch.ones_like(ids)
    if variant == "positions":  # as SFT without packing hands them
        inputs["position_ids"] = torch.arange(seq, device=DEVICE)[None]
    return inputs


# each model without a padding mask, with an all-ones one, or with position_ids too; every case for Mistral's
# all-sliding layers (the mask path the three take differently), a share of them for the others
CASES = [("llama", "none"), ("llama", "positions"), ("mistral", "none"), ("mistral", "ones"), ("mistral", "positions"),
         ("gemma3_text", "ones"), ("gemma3_text", "positions"), ("qwen2", "none")]


@pytest.mark.parametrize(("model_type", "variant"), CASES)
def test_a_training_step_holds_nothing_quadratic(small_blocks, model_type, variant):
    """Forward and backward of a patched tiny model at T tokens: no output of any op holds more than
    ``LINEAR·T`` elements (a ``T × T`` mask would hold ``2·LINEAR·T``)."""
    model = _sdpa_model(model_type)
    tigon.patch(model)
    inputs = _inputs(variant, TOKENS)
    with LargestStorage() as largest:
        logits = model(**inputs).logits                                          # (1, T, V)
        logits.float().square().mean().backward()
    elements, func, shape = largest.largest
    assert elements <= LINEAR * TOKENS, f"{func} made {shape}: {elements} elements > {LINEAR}·T"


def test_the_fused_loss_heads_step_holds_nothing_quadratic():
    """The same with labels: the loss head (fused linear cross-entropy, its chunk of logits inside)."""
    model = _sdpa_model("llama")
    tigon.patch(model)
    inputs = _inputs("none", TOKENS)
    with LargestStorage() as largest:
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
    elements, func, shape = largest.largest
    assert elements <= LINEAR * TOKENS, f"{func} made {shape}: {elements} elements > {LINEAR}·T"


def _cuda_fp32_choice(query, key, value, dropout, causal, scale):
    """torch 2.11's sdpa choice for a maskless fp32 call on an H100/H200 (``sdp_utils.cpp``): flash and cuDNN take
    fp16/bf16 only, the memory-efficient kernel takes fp32 but no grouped heads, so a grouped call falls to math."""
    return band_attention.MATH if key.shape[1] != query.shape[1] else SDPBackend.EFFICIENT_ATTENTION.value


def _flash_choice(query, key, value, dropout, causal, scale):
    """A choice that takes grouped heads (flash in fp16/bf16 on the GPU, or in fp32 on the CPU)."""
    return SDPBackend.FLASH_ATTENTION.value


@pytest.mark.parametrize("variant", ["none", "positions"])
def test_grouped_heads_leave_sdpas_math_kernel(monkeypatch, variant):
    """The GPU's fp32 case on any device, through the choice the sdpa wrapper asks (``_cuda_fp32_choice``): a
    patched model's maskless grouped calls reach transformers' sdpa function with k and v repeated to the 4 query
    heads (sdpa then runs the memory-efficient kernel over them, not math's ``(B·H, T, T)`` scores), with stock's
    loss and gradients. Under a choice that takes grouped heads (``_flash_choice``) the patched model, and an
    unpatched one beside it under any choice, hand it the 2 key/value heads as they are."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    stock = _sdpa_model("llama")
    patched = copy.deepcopy(stock)
    tigon.patch(patched)
    heads = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        heads.append((key.shape[1], value.shape[1], attention_mask))
        return original(module, query, key, value, attention_mask, **kwargs)

    installed = ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"]
    original = getattr(installed, band_attention._ORIGINAL_KEY)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", band_attention._wrap(recording))
    inputs = _inputs(variant, 41, seed=1)
    layers = patched.config.num_hidden_layers
    monkeypatch.setattr(band_attention, "_sdpa_choice", _flash_choice)
    patched(**inputs)
    assert heads == [(2, 2, None)] * layers
    heads.clear()
    monkeypatch.setattr(band_attention, "_sdpa_choice", _cuda_fp32_choice)
    loss = patched(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    assert heads == [(4, 4, None)] * layers
    heads.clear()
    want = stock(**inputs, labels=inputs["input_ids"]).loss  # not marked: transformers' call as it is
    want.backward()
    assert heads == [(2, 2, None)] * layers
    assert rel(loss, want) <= 1e-5
    assert_same_grads(patched, stock, 1e-5)


def test_stock_sliding_window_models_do_build_the_square():
    """The audit's reason: unpatched, a sliding-window model's sdpa mask is ``T × T`` at these sizes."""
    model = _sdpa_model("mistral")
    with LargestStorage() as largest:
        model(**_inputs("none", TOKENS)).logits.float().square().mean().backward()
    assert largest.largest[0] >= TOKENS * TOKENS


@pytest.mark.parametrize("variant", ["none", "ones", "positions", "padded"])
@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text"])
def test_band_masks_train_as_stock(monkeypatch, model_type, variant):
    """Without building the mask, the patched model's loss and every gradient are stock's (fp32), with a
    :class:`BandMask` handed to the sliding layers."""
    monkeypatch.setattr(band_attention, "CONFIG", band_attention.BandConfig(block_rows=8, min_blocks=2))
    stock = _sdpa_model(model_type, sliding_window=5)
    patched = copy.deepcopy(stock)
    tigon.patch(patched)
    inputs = _inputs("ones" if variant == "padded" else variant, 41, seed=1)
    if variant == "padded":
        inputs["attention_mask"][0, :4] = 0
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100) if variant == "padded" else None
    made = []
    create = BandMask.__init__
    monkeypatch.setattr(BandMask, "__init__", lambda self, *a: (made.append(1), create(self, *a))[1])
    loss = patched(**inputs, labels=inputs["input_ids"] if labels is None else labels).loss
    loss.backward()
    want = stock(**inputs, labels=inputs["input_ids"] if labels is None else labels).loss
    want.backward()
    assert made
    assert rel(loss, want) <= 1e-5
    assert_same_grads(patched, stock, 1e-5)


@pytest.mark.parametrize("padded", [False, True])
def test_band_mask_rectangles_and_ops_read_transformers_mask(padded):
    """Each rectangle is the block of transformers' dense mask; any op on the mask reads the dense mask;
    a detached mask (gradient checkpointing's) is still a BandMask."""
    length, window, batch = 37, 6, 2
    padding = torch.ones(batch, length, dtype=torch.bool)
    if padded:
        padding[1, :5] = False
    arguments = dict(batch_size=batch, q_length=length, kv_length=length, q_offset=0, kv_offset=0,
                     mask_function=sliding_window_causal_mask_function(window),
                     attention_mask=padding if padded else None, local_size=window, allow_is_causal_skip=True)
    want = sdpa_mask(**{**arguments, "allow_is_causal_skip": False})
    mask = BandMask(sdpa_mask, arguments)
    assert mask.shape == (batch, 1, length, length) and mask.dtype == torch.bool
    for start, end, first in [(0, 8, 0), (8, 16, 3), (32, 37, 27)]:
        assert torch.equal(mask.rectangle(start, end, first, end), want[:, :, start:end, first:end])
    assert torch.equal(mask[:, :, 3:9], want[:, :, 3:9])
    assert torch.equal(mask.logical_not(), want.logical_not())
    assert type(mask.detach()) is BandMask


def test_a_declined_band_mask_reaches_transformers_as_the_dense_mask(small_blocks):
    """Where a guard keeps the dense call (dropout here), transformers' function gets the plain dense mask."""
    length, window = 2 * BLOCK + 5, 6
    arguments = dict(batch_size=1, q_length=length, kv_length=length, q_offset=0, kv_offset=0,
                     mask_function=sliding_window_causal_mask_function(window), attention_mask=None,
                     local_size=window, allow_is_causal_skip=True)
    received = []

    def original(module, query, key, value, attention_mask, **kwargs):
        received.append(attention_mask)
        return query.transpose(1, 2), None

    config = transformers.MistralConfig(sliding_window=window)
    change = band_attention.MarkConfig(config)
    change.apply()
    try:
        q = torch.randn(1, 2, length, 4)
        module = torch.nn.Module()
        module.config = config
        band_attention._wrap(original)(module, q, q, q, BandMask(sdpa_mask, arguments), dropout=0.1,
                                       sliding_window=window)
    finally:
        change.undo()
    assert len(received) == 1 and type(received[0]) is torch.Tensor
    assert torch.equal(received[0], sdpa_mask(**{**arguments, "allow_is_causal_skip": False}))


def test_only_the_plain_sliding_pattern_becomes_a_band_mask(small_blocks):
    """A custom pattern (an or_mask_function; packed sequences alike) keeps transformers' dense mask."""
    model = _sdpa_model("mistral")
    tigon.patch(model)
    embeds = torch.randn(1, 2 * BLOCK, HIDDEN, device=DEVICE)
    plain = create_sliding_window_causal_mask(model.config, embeds, None, None)
    custom = create_sliding_window_causal_mask(model.config, embeds, None, None,
                                               or_mask_function=lambda b, h, q, kv: kv == 0)
    assert type(plain) is BandMask
    assert type(custom) is torch.Tensor and custom.shape == (1, 1, 2 * BLOCK, 2 * BLOCK)


@pytest.mark.parametrize(("hidden", "vocab"), [(4096, 128256), (2048, 128256)])  # Llama-3.1-8B, Llama-3.2-1B
@pytest.mark.parametrize("tokens", [32768, 65536, 131072, 262144])
@pytest.mark.parametrize("dw_size", [2, 4])
def test_the_loss_heads_chunk_of_logits_stays_within_its_inputs(hidden, vocab, tokens, dw_size):
    """The fused loss head's chunk of logits (by tokens ``size × V``, by classes ``N × size``) holds no more
    elements than the hidden states and the head's weight it reads, ``(N + V)·H``: O(T), never ``N × V``."""
    plan = chunk_plan(tokens, vocab, hidden, 2, dw_size=dw_size)
    chunk = plan.size * vocab if plan.by_tokens else tokens * plan.size
    assert chunk <= (tokens + vocab) * hidden
    assert chunk < tokens * vocab / 4


# ----------------------------------------------------------------------------------------------- GPU

LONG = 65536
GIB = 2**30


def _layer_config(model_type, **overrides):
    """A one-layer model of Llama-3.1-8B's attention shape: hidden 4096, 32 query and 8 key/value heads of 128."""
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[model_type]
    config = cls(vocab_size=256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=1,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=LONG,
                 **overrides)
    config._attn_implementation = "sdpa"
    return config


def _attention_peak(model_type, tokens, **overrides):
    """Peak bytes allocated above the parameters by the patched layer's attention module, forward and backward,
    at ``tokens`` tokens, batch 1, bf16, no padding (the mask transformers makes for that layer)."""
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(_layer_config(model_type, **overrides)).to("cuda", torch.bfloat16)
    model.train()
    tigon.patch(model)
    attention = model.layers[0].self_attn
    x = torch.randn(1, tokens, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(tokens, device="cuda")[None]
    cos, sin = model.rotary_emb(x, positions)                                 # (1, T, 128) each
    mask_function = transformers.masking_utils.create_causal_mask if model_type == "llama" \
        else create_sliding_window_causal_mask
    grad = torch.randn(1, tokens, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    mask = mask_function(model.config, x, None, None, position_ids=positions)  # measured too
    out = attention(x, position_embeddings=(cos, sin), attention_mask=mask)[0]
    out.backward(grad)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return peak, mask


@pytest.mark.gpu
def test_llama_8b_attention_at_64k_tokens_is_linear():
    """bf16 causal sdpa without a mask at 65,536 tokens: transformers hands sdpa ``is_causal=True`` and no mask
    (nothing O(T²) exists), and sdpa's choice for it (flash on an H100/H200; cuDNN where preferred) keeps
    O(T) memory: the peak of forward and backward stays under ``14·T·hidden·2`` bytes (7 GiB: q/k/v, the
    attention output, o_proj's output, their gradients and flash's fp32 dq accumulator come to about 9
    tensors of ``T·hidden·2`` bytes), where a ``T × T`` bf16 bias alone is 8 GiB. The peak at T/2 is at least
    0.4 of it (linear: 0.5 and more; a square would give 0.25)."""
    from torch.nn.attention import SDPBackend

    peak, mask = _attention_peak("llama", LONG)
    assert mask is None
    # sdpa's choice for the call (the node and transformers' interface make the same one), observed, not forced
    q = torch.empty(1, 32, LONG, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.empty(1, 8, LONG, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    choice = torch._fused_sdp_choice(q, kv, kv, None, 0.0, True, scale=128**-0.5, enable_gqa=True)
    del q, kv
    assert choice in (SDPBackend.FLASH_ATTENTION.value, SDPBackend.CUDNN_ATTENTION.value), SDPBackend(choice)
    assert peak < 14 * LONG * 4096 * 2, f"{peak / GIB:.2f} GiB"
    half, _ = _attention_peak("llama", LONG // 2)
    assert half >= 0.4 * peak, f"{half / GIB:.2f} GiB at T/2, {peak / GIB:.2f} GiB at T"


@pytest.mark.gpu
def test_sliding_window_attention_at_64k_tokens_is_linear():
    """A Mistral-shaped layer (window 4096) at 65,536 tokens: the layer gets a BandMask (no ``T × T`` mask;
    stock builds a 4 GiB bool mask and an 8 GiB bf16 bias from it), the band path runs masked sdpa
    (memory-efficient: flash takes no mask) on rectangles of 4096 × 8191 and keeps each block's repeated
    keys and values and its rectangle's bias for the backward: ~16 × (128 + 64) MiB at this size; with
    the projections, the rotary outputs and the gradients (each block's query, key and value gradient a
    full-length tensor while it is summed) about 8 GiB, under ``24·T·hidden·2`` bytes (12 GiB), which
    stock's mask and bias alone take. The peak at T/2 is at least 0.4 of it."""
    peak, mask = _attention_peak("mistral", LONG, sliding_window=4096)
    assert type(mask) is BandMask
    assert peak < 24 * LONG * 4096 * 2, f"{peak / GIB:.2f} GiB"
    half, _ = _attention_peak("mistral", LONG // 2, sliding_window=4096)
    assert half >= 0.4 * peak, f"{half / GIB:.2f} GiB at T/2, {peak / GIB:.2f} GiB at T"
