"""The fused attention node (tigon.patching.fused_attention, the ``fused_attention`` switch): the whole
attention module as one autograd node where it computes what the attention's own forward would.

Compared against the same patch with the switch off (q/k/v as the shared-cast node, tigon's rotary,
transformers' sdpa interface, o_proj; tested against stock in test_shared_cast.py and
test_families.py) and against stock transformers in fp64. On the CPU the node is off by default
(``DEVICES``): these tests add the CPU to run it under the interpreter.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tigon
from tests.helpers import DEVICE, ON_GPU, assert_close, stride0_like
from tests.patching.tiny import VOCAB, tiny_model
from tigon.patching import fused_attention

# (model_type, config overrides): GQA without biases, q/k/v biases with GQA, heads not grouped; the families
# whose attention forward is Llama's with another dropout expression and a softcap argument (Gemma-2: its
# attention softcap off, as sdpa requires; sliding and full layers, the window wider than the tests' sequences,
# so no mask) or with a residual dropout after o_proj (Starcoder2: biases and LayerNorm; Seed-OSS), or whose
# rotary is applied only where the layer uses one (SmolLM3: here the second layer has none)
MODELS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "llama-mha": ("llama", {"num_key_value_heads": 4, "head_dim": 16, "hidden_size": 48}),
    "gemma2": ("gemma2", {"attn_logit_softcapping": None, "sliding_window": 64}),
    "starcoder2": ("starcoder2", {"sliding_window": 64}),
    "seed_oss": ("seed_oss", {}),
    "smollm3": ("smollm3", {"no_rope_layers": [1, 0]}),
}
# (weights' dtype, autocast dtype or None)
MODES = {
    "autocast-bf16": (torch.float32, torch.bfloat16),
    "autocast-fp16": (torch.float32, torch.float16),
    "bf16": (torch.bfloat16, None),
    "fp16": (torch.float16, None),
}


@pytest.fixture(autouse=True)
def _node_on_this_device(monkeypatch):
    monkeypatch.setattr(fused_attention, "DEVICES", ("cuda", "cpu"))


@pytest.fixture
def node_calls(monkeypatch):
    calls = []
    apply = fused_attention.APPLY_NODE

    def counting(*args):  # the nodes made (not those given up for sdpa's backend, _NotCalledHere)
        result = apply(*args)
        calls.append(args)
        return result

    monkeypatch.setattr(fused_attention, "APPLY_NODE", counting)
    return calls


def _sdpa_model(name, dtype=torch.float32, **overrides):
    model_type, extra = MODELS[name]
    torch.manual_seed(0)
    model = tiny_model(model_type, **{**extra, **overrides}).to(DEVICE, dtype)
    model.config._attn_implementation = "sdpa"
    return model


def _pair(name, dtype=torch.float32, **overrides):
    """(fused, unfused): one tiny sdpa model patched with and without the switch, the same weights."""
    base = _sdpa_model(name, dtype, **overrides)
    fused, unfused = copy.deepcopy(base), copy.deepcopy(base)
    tigon.patch(fused)
    tigon.patch(unfused, fused_attention=False)
    return base, fused, unfused


def _ids(seed=0, batch=3, seq=13):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=gen).to(DEVICE)


def _step(model, ids, autocast, **kwargs):
    with torch.autocast(DEVICE.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()  # not autograd.grad: reentrant checkpointing refuses it
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out, grads


def _compute_dtype(mode):
    weights, autocast = MODES[mode]
    return autocast or weights


# every model, every precision, the cache on and off (each at least once; not the whole product, which the
# interpreter makes slow)
MATCH_CASES = (("llama", "autocast-bf16", True), ("qwen2", "autocast-bf16", False),
               ("llama-mha", "autocast-fp16", True), ("qwen2", "bf16", True), ("llama", "fp16", False),
               ("llama-mha", "bf16", False), ("gemma2", "autocast-bf16", True), ("gemma2", "fp16", False),
               ("starcoder2", "autocast-bf16", True), ("seed_oss", "autocast-fp16", False),
               ("smollm3", "autocast-bf16", True), ("smollm3", "bf16", False))


@pytest.mark.parametrize("name,mode,use_cache", MATCH_CASES)
def test_node_matches_the_unfused_patch_and_fp64_stock(name, mode, use_cache, node_calls):
    weights, autocast = MODES[mode]
    dtype = _compute_dtype(mode)
    base, fused, unfused = _pair(name, weights)
    ids = _ids()
    out_f, grads_f = _step(fused, ids, autocast, use_cache=use_cache)
    assert len(node_calls) == fused.config.num_hidden_layers
    out_u, grads_u = _step(unfused, ids, autocast, use_cache=use_cache)
    assert len(node_calls) == fused.config.num_hidden_layers  # the unfused patch never runs it
    assert_close(out_f.loss, out_u.loss, dtype, "loss")
    for n, g in grads_u.items():
        assert grads_f[n].dtype == g.dtype, n
        assert_close(grads_f[n], g, dtype, n)
    # stock transformers in fp64: the roundings of the compute dtype are all the difference
    stock = copy.deepcopy(base).double()
    out_s = stock(input_ids=ids, labels=ids, use_cache=False)
    assert_close(out_f.loss, out_s.loss, dtype, "loss vs fp64 stock")
    if use_cache:  # the cache holds what the attention's own forward gives it (keys rounded once to dtype)
        for got, want in zip(out_f.past_key_values.layers, out_u.past_key_values.layers, strict=True):
            assert got.keys.shape == want.keys.shape and not got.keys.requires_grad
            assert_close(got.keys, want.keys.to(got.keys.dtype), dtype, "cached keys")
            assert torch.equal(got.values, want.values)


@pytest.mark.parametrize("reentrant", (True, False))
def test_gradient_checkpointing_recomputes_the_node(reentrant, node_calls):
    _, fused, _ = _pair("qwen2")
    checkpointed = copy.deepcopy(fused)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = _ids(1)
    out, grads = _step(fused, ids, torch.bfloat16, use_cache=False)
    calls = len(node_calls)
    out_c, grads_c = _step(checkpointed, ids, torch.bfloat16, use_cache=False)
    # reentrant checkpointing runs the forward without grad (the attention's own forward), then the node in
    # the recompute; the non-reentrant one runs the node in both, its saved tensors going through the hooks
    layers = fused.config.num_hidden_layers
    assert len(node_calls) == calls + (layers if reentrant else 2 * layers)
    for n, g in {"loss": out.loss, **grads}.items():
        assert torch.equal(out_c.loss if n == "loss" else grads_c[n], g), n


def test_recompute_norms_remakes_the_nodes_input(node_calls):
    """recompute_norms hands the node's saved input (the input norm's output) a recipe: the same values."""
    base = _sdpa_model("llama")
    fused, recomputed = copy.deepcopy(base), copy.deepcopy(base)
    tigon.patch(fused)
    tigon.patch(recomputed, recompute_norms=True)
    ids = _ids(4)
    out, grads = _step(fused, ids, torch.bfloat16, use_cache=False)
    out_r, grads_r = _step(recomputed, ids, torch.bfloat16, use_cache=False)
    assert len(node_calls) == 2 * base.config.num_hidden_layers
    for n, g in {"loss": out.loss, **grads}.items():
        assert torch.equal(out_r.loss if n == "loss" else grads_r[n], g), n


@pytest.mark.parametrize("name,mode", [("qwen2", mode) for mode in MODES] + [("llama-mha", "autocast-bf16")]
                         + [("smollm3", "autocast-bf16"), ("gemma2", "bf16")])  # layer 1: SmolLM3's has no rotary
def test_module_call_against_fp64_stock_noncontiguous_input_stride0_gradient(name, mode, node_calls):
    """One attention module called as a decoder layer calls it, on a non-contiguous input with a stride-0
    gradient, against stock's module in fp64 and the unfused patch's."""
    weights, autocast = MODES[mode]
    dtype = _compute_dtype(mode)
    base, fused, unfused = _pair(name, weights)
    stock = copy.deepcopy(base).double()
    hidden = fused.config.hidden_size
    x = torch.randn(3, hidden * 2, 11, device=DEVICE, dtype=dtype).transpose(1, 2)[..., ::2]
    assert not x.is_contiguous()
    positions = torch.arange(11, device=DEVICE)[None].expand(3, -1)
    results = []
    for model in (fused, unfused, stock):
        attn = model.model.layers[1].self_attn
        leaf = x.detach().to(torch.float64 if model is stock else dtype).requires_grad_()
        cos, sin = model.model.rotary_emb(leaf, positions)
        autocast_on = autocast is not None and model is not stock
        with torch.autocast(DEVICE.type, dtype=autocast or torch.bfloat16, enabled=autocast_on):
            y, attention_weights = attn(hidden_states=leaf, position_embeddings=(cos, sin), attention_mask=None)
        assert attention_weights is None
        if not results:
            grad = stride0_like(y)
        y.backward(grad.to(y.dtype))
        results.append((y, leaf.grad, {n: p.grad for n, p in attn.named_parameters()}))
    assert len(node_calls) == 1
    (y_f, dx_f, dp_f), *others = results
    for y, dx, dp in others:
        assert_close(y_f, y, dtype, "output")
        assert_close(dx_f, dx, dtype, "input gradient")
        for n, g in dp.items():
            assert dp_f[n].dtype == weights
            assert_close(dp_f[n], g, dtype, n)


def _padding_mask(ids):
    """Left padding in the first sequence (its first queries attend to no key), right padding in the last."""
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[-1, -2:] = 0
    return mask


@pytest.mark.parametrize("name,mode", (("qwen2", "autocast-bf16"), ("llama-mha", "bf16"), ("qwen2", "fp16")))
def test_padding_mask_matches_the_unfused_patch_and_fp64_stock(name, mode, node_calls):
    """A batch with padding: transformers hands sdpa a boolean mask and k, v repeated to the query heads; the
    node makes the same call (tigon.nn.attention.attend) and sums the repeated heads' gradients."""
    weights, autocast = MODES[mode]
    dtype = _compute_dtype(mode)
    base, fused, unfused = _pair(name, weights, head_dim=16)  # 16: a head size every GPU backend takes
    ids = _ids(5)
    mask = _padding_mask(ids)
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    saved = []
    for model in (fused, unfused):
        with (torch.autocast(DEVICE.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None),
              torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)):
            out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        results.append((out.loss, {n: p.grad for n, p in model.named_parameters()}))
        if model is fused:  # every layer's node saved one bias, the same tensor (tigon.nn.attention.MaskBiases)
            seq = ids.shape[1]
            biases = [t for t in saved if t.dim() == 4 and t.shape[1:] == (1, seq, seq) and t.dtype == dtype]
            assert len(biases) == fused.config.num_hidden_layers
            assert len({t.data_ptr() for t in biases}) == 1
    assert len(node_calls) == fused.config.num_hidden_layers
    (loss_f, grads_f), (loss_u, grads_u) = results
    assert_close(loss_f, loss_u, dtype, "loss")
    for n, g in grads_u.items():
        assert_close(grads_f[n], g, dtype, n)
    stock = copy.deepcopy(base).double()
    want = stock(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    assert_close(loss_f, want, dtype, "loss vs fp64 stock")


class _Wrapped(nn.Module):
    """A projection wrapped as an adapter library would (not an nn.Linear)."""

    def __init__(self, linear):
        super().__init__()
        self.base = linear

    def forward(self, x):
        return self.base(x)


@pytest.mark.parametrize("case", ("float-mask", "no-grad", "eager", "hooked", "global-hook", "wrapped", "dropout",
                                  "filled-cache", "output-attentions", "switch-off", "rope-off", "math-backend"))
def test_the_attention_forward_runs_where_the_node_would_not(case, node_calls):
    switches = {"fused_attention": False} if case == "switch-off" else {"rope": False} if case == "rope-off" else {}
    model = _sdpa_model("qwen2")
    reference = copy.deepcopy(model)
    tigon.patch(model, **switches)
    tigon.patch(reference, fused_attention=False, **({"rope": False} if case == "rope-off" else {}))
    ids = _ids(2)
    kwargs = {"use_cache": False}
    handles = []
    if case == "float-mask":  # a 4-D additive mask, which transformers hands sdpa as it is
        allowed = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=DEVICE).tril()
        allowed = allowed[None, None] & _padding_mask(ids).bool()[:, None, None, :]
        kwargs["attention_mask"] = torch.zeros(allowed.shape, device=DEVICE).masked_fill(~allowed, float("-inf"))
    elif case == "eager":
        for m in (model, reference):
            m.config._attn_implementation = "eager"
    elif case == "hooked":
        handles.append(model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, i, o: None))
    elif case == "global-hook":
        handles.append(nn.modules.module.register_module_forward_pre_hook(lambda m, i: None))
    elif case == "wrapped":
        for m in (model, reference):
            for layer in m.model.layers:
                layer.self_attn.v_proj = _Wrapped(layer.self_attn.v_proj)
    elif case == "dropout":
        for m in (model, reference):
            for layer in m.model.layers:
                layer.self_attn.attention_dropout = 0.5
    elif case == "output-attentions":
        kwargs["output_attentions"] = True
    if case == "math-backend":  # sdpa's math backend, which the node does not call
        from torch.nn.attention import SDPBackend, sdpa_kernel

        handles.append(sdpa_kernel(SDPBackend.MATH))
        handles[-1].__enter__()
    try:
        for m in (model, reference):
            torch.manual_seed(3)  # dropout draws the same
            autocast = torch.autocast(DEVICE.type, dtype=torch.bfloat16)
            autocast.__enter__()
            if case == "no-grad":
                with torch.no_grad():
                    out = m(input_ids=ids, labels=ids, **kwargs)
            elif case == "filled-cache":  # a second forward reads the first one's keys and values
                past = m(input_ids=ids[:, :5], use_cache=True).past_key_values
                out = m(input_ids=ids[:, 5:], labels=ids[:, 5:], past_key_values=past, use_cache=True)
            else:
                out = m(input_ids=ids, labels=ids, **kwargs)
            autocast.__exit__(None, None, None)
            if m is model:
                loss = out.loss
        want = out.loss
    finally:
        for h in handles:
            h.__exit__(None, None, None) if case == "math-backend" else h.remove()
    # the first forward of "filled-cache" fills an empty cache: that one is the node's; a hook on one
    # layer's projection keeps that layer's attention its own
    layers = model.config.num_hidden_layers
    assert len(node_calls) == {"filled-cache": layers, "hooked": layers - 1}.get(case, 0), case
    assert torch.equal(loss, want)


def test_patch_report_revert_and_matching_classes():
    model = _sdpa_model("llama")
    attention = model.model.layers[0].self_attn
    handle = tigon.patch(model)
    assert any("one autograd node" in line for line in handle.replaced)
    assert getattr(vars(attention)["forward"].__func__, "_tigon", False)
    handle.revert()
    assert "forward" not in vars(attention)
    off = tigon.patch(_sdpa_model("llama"), fused_attention=False)
    assert not any("one autograd node" in line for line in off.replaced)
    from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
    from transformers.models.seed_oss.modeling_seed_oss import SeedOssAttention
    from transformers.models.smollm3.modeling_smollm3 import SmolLM3Attention
    from transformers.models.starcoder2.modeling_starcoder2 import Starcoder2Attention

    for attention_class in (LlamaAttention, Qwen2Attention, Gemma2Attention, Starcoder2Attention, SeedOssAttention,
                            SmolLM3Attention):
        assert fused_attention.variant(attention_class) is not None, attention_class.__name__
    assert fused_attention.variant(Qwen3Attention) is None  # q/k norms: another forward


def test_gemma2_attention_softcap_keeps_the_attention_forward(node_calls):
    """With its attention-logit softcap on, Gemma-2's sdpa call is transformers' to answer (5.24's sdpa interface
    raises; earlier releases' ignore the softcap): the node stands aside, and the patched model does what the
    unfused patch does, error or loss."""
    model = _sdpa_model("gemma2", attn_logit_softcapping=5.0)
    reference = copy.deepcopy(model)
    tigon.patch(model)
    tigon.patch(reference, fused_attention=False)
    ids = _ids()
    outcomes = []
    for m in (reference, model):
        try:
            outcomes.append(m(input_ids=ids, labels=ids, use_cache=False).loss)
        except ValueError as err:
            outcomes.append(str(err))
    assert not node_calls
    if isinstance(outcomes[0], str):
        assert "softcap" in outcomes[0] and outcomes[1] == outcomes[0]
    else:
        assert torch.equal(outcomes[1], outcomes[0])


@pytest.mark.parametrize("name", ("starcoder2", "seed_oss"))
def test_residual_dropout_runs_the_attention_forward_in_training(name, node_calls):
    """A residual dropout with p > 0 draws random numbers in training: the attention's own forward runs (the
    same draws as the unfused patch); in eval mode, or at p = 0 (the other tests), it is an identity."""
    model = _sdpa_model(name, residual_dropout=0.5)
    reference = copy.deepcopy(model)
    tigon.patch(model)
    tigon.patch(reference, fused_attention=False)
    ids = _ids(4)
    losses = []
    for m in (model, reference):
        torch.manual_seed(5)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            losses.append(m(input_ids=ids, labels=ids, use_cache=False).loss)
    assert not node_calls and torch.equal(losses[0], losses[1])


# (backend forced by sdpa_kernel, key/value heads of 8, sequence length, masked): each backend the node calls on
# the GPU, grouped heads or not, without a mask (causal) and with a padding mask (k, v repeated); 300 is not a
# multiple of 8, where the memory-efficient backend's bias is padded
GPU_BACKEND_CASES = (("FLASH_ATTENTION", 2, 300, False), ("FLASH_ATTENTION", 8, 300, False),
                     ("CUDNN_ATTENTION", 2, 300, False), ("CUDNN_ATTENTION", 8, 300, True),
                     ("CUDNN_ATTENTION", 2, 256, True), ("EFFICIENT_ATTENTION", 8, 300, False),
                     ("EFFICIENT_ATTENTION", 2, 300, True), ("EFFICIENT_ATTENTION", 8, 256, True))


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (sdpa's GPU backends): runs in scripts/gpu-check.sh")
@pytest.mark.parametrize("backend,kv_heads,seq,masked", GPU_BACKEND_CASES)
def test_each_gpu_backend_against_sdpa(backend, kv_heads, seq, masked, node_calls):
    """The backends the node calls itself, each chosen by sdpa_kernel, against the unfused patch (which calls
    F.scaled_dot_product_attention with the same choice): the output and v's weight gradient bitwise; the rest
    (cuDNN sums dq with atomics) within bf16's rounding. Head size 64."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _, fused, unfused = _pair("qwen2", hidden_size=512, num_attention_heads=8, num_key_value_heads=kv_heads,
                              head_dim=64)
    x = torch.randn(2, seq, 512, device=DEVICE)
    positions = torch.arange(seq, device=DEVICE)[None].expand(2, -1)
    mask = None
    if masked:  # transformers' sdpa mask for left padding in the first sequence, right padding in the second
        keys = torch.ones(2, seq, dtype=torch.bool, device=DEVICE)
        keys[0, :37], keys[1, -11:] = False, False
        mask = torch.ones(seq, seq, dtype=torch.bool, device=DEVICE).tril()[None, None] & keys[:, None, None, :]
    grad = stride0_like(x.to(torch.bfloat16))
    results = []
    for model in (fused, unfused):
        attn = model.model.layers[0].self_attn
        leaf = x.detach().requires_grad_()
        cos, sin = model.model.rotary_emb(leaf, positions)
        with sdpa_kernel(getattr(SDPBackend, backend)), torch.autocast("cuda", dtype=torch.bfloat16):
            y, _ = attn(hidden_states=leaf, position_embeddings=(cos, sin), attention_mask=mask)
        y.backward(grad)
        results.append((y, leaf.grad, {n: p.grad for n, p in attn.named_parameters()}))
    assert len(node_calls) == 1
    (y_f, dx_f, dp_f), (y_u, dx_u, dp_u) = results
    assert torch.equal(y_f, y_u)
    assert torch.equal(dp_f["v_proj.weight"], dp_u["v_proj.weight"])
    assert_close(dx_f, dx_u, torch.bfloat16, "input gradient")
    for n, g in dp_u.items():
        assert_close(dp_f[n], g, torch.bfloat16, n)


@pytest.mark.skipif(not ON_GPU, reason="the default devices: the node runs on the GPU only")
def test_default_devices(monkeypatch, node_calls):
    monkeypatch.setattr(fused_attention, "DEVICES", ("cuda",))
    _, fused, _ = _pair("llama")
    _step(fused, _ids(), torch.bfloat16)
    assert len(node_calls) == fused.config.num_hidden_layers


def test_runs_beside_a_patched_sliding_window_model(node_calls):
    """A patched model with sliding layers registers tigon's band wrapper as transformers' sdpa function;
    it hands a call without a mask to transformers' own, so the node still runs."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sliding = _sdpa_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0,
                          layer_types=["sliding_attention", "sliding_attention"])
    handle = tigon.patch(sliding)
    try:
        assert getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "_tigon", False)
        _, fused, _ = _pair("llama")
        _step(fused, _ids(), torch.bfloat16)
        assert len(node_calls) == fused.config.num_hidden_layers
        # a masked call of the sliding model itself is the band wrapper's: its attention's own forward
        ids = _ids(6, seq=17)
        sliding(input_ids=ids, attention_mask=_padding_mask(ids), labels=ids).loss.backward()
        assert len(node_calls) == fused.config.num_hidden_layers
    finally:
        handle.revert()
