"""The attention patch (the ``rope`` switch) also makes q/k/v projections save one autocast cast of
their input instead of three, and the projections save no bf16 weight copies, with bitwise the same
loss and gradients (on the GPU, the fp32 products unrounded); nothing changes outside autocast;
revert restores. Compared against the same patch with the projections' own forwards taken back off
(the stock ``nn.Linear`` under autocast)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tigon
from tests.helpers import DEVICE, assert_close
from tests.patching.tiny import VOCAB, tiny_model
from tigon.nn import shared_cast_linear
from tigon.patching.parts.attention import OUTPUT_PROJECTION, QKV_PROJECTIONS

PROJECTIONS = (*QKV_PROJECTIONS, OUTPUT_PROJECTION)

AUTOCAST = torch.bfloat16


def _ids(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (2, 12), generator=gen).to(DEVICE)


def _step(model, ids, *, autocast=True):
    """Loss, gradients by parameter name, the storages of every bf16 tensor the autograd graph
    saved with the attention input's shape, and the shapes of the bf16 weight-shaped ones."""
    hidden = model.config.hidden_size
    weight_shapes = {tuple(sorted(p.shape)) for p in model.parameters() if p.dim() == 2}  # saved as Wᵀ too
    saved, weights = [], []

    def pack(t):
        if t.dtype == AUTOCAST and t.numel() == ids.numel() * hidden and t.shape[-1] == hidden:
            saved.append(t.untyped_storage().data_ptr())
        elif t.dtype == AUTOCAST and tuple(sorted(t.shape)) in weight_shapes:
            weights.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(DEVICE.type, dtype=AUTOCAST, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    names = [n for n, _ in model.named_parameters()]
    return loss.detach(), dict(zip(names, grads, strict=True)), saved, weights


@pytest.fixture(params=("llama", "qwen2"))  # qwen2: q/k/v with biases
def models(request):
    torch.manual_seed(0)
    base = tiny_model(request.param).to(DEVICE)
    shared, separate = copy.deepcopy(base), copy.deepcopy(base)
    tigon.patch(shared, fused_attention=False)
    tigon.patch(separate, fused_attention=False)
    for model in (shared, separate):  # fp32 attention inputs, as OLMo-2 feeds its raw residual stream
        for m in model.modules():
            if getattr(m, "autocast_output", False):
                m.autocast_output = False
    for layer in separate.model.layers:
        for name in PROJECTIONS:
            projection = getattr(layer.self_attn, name)
            del projection.forward, projection._tigon_cast_cache  # back to nn.Linear.forward
    return shared, separate


def _assert_same_gradients(got, want, *, autocast=True):
    """Bitwise the stock gradients. On the GPU under autocast the projections' fp32 gradients (of
    their weights and their fp32 input) are the matmuls' unrounded fp32 products
    (tigon._kernels.matmul_to), of which the stock ones are the bf16 roundings: every gradient
    upstream of them moves by about bf16's rounding, and the projections' weight gradients are no
    longer bf16 values."""
    on_gpu = autocast and DEVICE.type == "cuda"
    for name, g in want.items():
        if not on_gpu:
            assert torch.equal(got[name], g), name
            continue
        assert_close(got[name], g, torch.bfloat16, name)
        if name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
            assert not torch.equal(got[name], g), f"{name}: the fp32 gradient was rounded to bf16"


def _assert_same_loss(got, want):
    """Bitwise on the CPU; on the GPU q, k and v are one stacked matmul (shared_cast_linear.STACKED_DEVICES),
    which cuBLAS may sum in another order than the separate ones: within bf16 rounding."""
    if DEVICE.type == "cuda":
        assert_close(got, want, torch.bfloat16, "loss")
    else:
        assert torch.equal(got, want)


def test_one_saved_cast_no_weight_copies_and_bitwise_the_same_gradients(models):
    shared, separate = models
    ids = _ids()
    loss_s, grads_s, saved_s, weights_s = _step(shared, ids)
    loss_p, grads_p, saved_p, weights_p = _step(separate, ids)
    _assert_same_loss(loss_s, loss_p)
    _assert_same_gradients(grads_s, grads_p)
    layers = shared.config.num_hidden_layers
    # Three casts of each layer's attention input saved without sharing, one with it.
    assert len(set(saved_p)) - len(set(saved_s)) == 2 * layers
    # The stock projections save a bf16 copy of each of their 4 weights; these save none.
    assert len(weights_p) - len(weights_s) == 4 * layers


def test_nothing_changes_outside_autocast_or_without_grad(models):
    shared, separate = models
    ids = _ids(1)
    loss_s, grads_s, _, _ = _step(shared, ids, autocast=False)
    loss_p, grads_p, _, _ = _step(separate, ids, autocast=False)
    assert torch.equal(loss_s, loss_p)
    _assert_same_gradients(grads_s, grads_p, autocast=False)
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=AUTOCAST):
        assert torch.equal(shared(input_ids=ids).logits, separate(input_ids=ids).logits)


def test_gradient_checkpointing_matches(models):
    shared, separate = models
    for m in (shared, separate):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = _ids(2)
    loss_s, grads_s, _, _ = _step(shared, ids)
    loss_p, grads_p, _, _ = _step(separate, ids)
    assert torch.equal(loss_s, loss_p)
    _assert_same_gradients(grads_s, grads_p)


def test_revert_and_replaced_line_and_deepcopy():
    model = tiny_model("llama").to(DEVICE)
    handle = tigon.patch(model, fused_attention=False)
    lines = [line for line in handle.replaced if "q_proj/k_proj/v_proj" in line]
    assert len(lines) == 1 and "tigon.ops.rope" in lines[0] and "(2 modules)" in lines[0]
    projections = [getattr(model.model.layers[0].self_attn, n) for n in PROJECTIONS]
    assert all("forward" in vars(p) for p in projections)
    copy.deepcopy(model)  # the caches' weak references do not travel
    handle.revert()
    assert all("forward" not in vars(p) and "_tigon_cast_cache" not in vars(p) for p in projections)


def test_wrapped_projection_is_left_alone():
    model = tiny_model("llama").to(DEVICE)
    attention = model.model.layers[0].self_attn
    attention.q_proj = nn.Sequential(attention.q_proj)  # as an adapter wrapper would
    tigon.patch(model, fused_attention=False)
    assert all("forward" not in vars(getattr(attention, n)) for n in ("k_proj", "v_proj"))
    other = model.model.layers[1].self_attn
    assert all("forward" in vars(getattr(other, n)) for n in PROJECTIONS)


class _ActivationCasts(TorchDispatchMode):
    """Counts fp32 -> bf16 casts of (tokens, hidden) activations."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if src.dtype == torch.float32 and out.dtype == AUTOCAST and out.numel() == self.numel:
                self.count += 1
        return out


def test_bf16_norm_outputs_need_no_casts():
    """With the default patch the attention and MLP input norms give bf16 under autocast
    (RMSNorm.autocast_output), so the forward makes two casts a layer fewer than with fp32 norm
    outputs (the attention input's, shared by q/k/v, and the MLP's)."""
    torch.manual_seed(0)
    model = tiny_model("llama").to(DEVICE)
    tigon.patch(model, fused_attention=False)
    plain = copy.deepcopy(model)
    for m in plain.modules():
        if getattr(m, "autocast_output", False):
            m.autocast_output = False
    ids = _ids(3)
    counts = []
    for m in (model, plain):
        mode = _ActivationCasts(ids.numel() * m.config.hidden_size)
        with mode, torch.autocast(DEVICE.type, dtype=AUTOCAST):
            m(input_ids=ids, labels=ids)
        counts.append(mode.count)
    layers = model.config.num_hidden_layers
    assert counts[1] - counts[0] == 2 * layers


def _qkv_outputs(model, ids):
    attention = model.model.layers[0].self_attn
    outputs = {}
    handles = [
        getattr(attention, name).register_forward_hook(lambda m, a, out, name=name: outputs.__setitem__(name, out))
        for name in QKV_PROJECTIONS
    ]
    with torch.autocast(DEVICE.type, dtype=AUTOCAST):
        loss = model(input_ids=ids, labels=ids).loss
    for handle in handles:
        handle.remove()
    return loss, [outputs[name] for name in QKV_PROJECTIONS]


@pytest.mark.parametrize("norm_output", ("bf16", "fp32"))
def test_qkv_is_one_node_and_nothing_waits_after_the_forward(norm_output):
    """q, k, v come from one node whichever dtype the norm gives (bf16: the default patch; fp32: the
    shared cast), and after the forward nothing is left waiting in the cache."""
    torch.manual_seed(0)
    model = tiny_model("qwen2").to(DEVICE)
    tigon.patch(model, fused_attention=False)
    if norm_output == "fp32":
        for m in model.modules():
            if getattr(m, "autocast_output", False):
                m.autocast_output = False
    loss, (q, k, v) = _qkv_outputs(model, _ids(3))
    assert q.grad_fn is k.grad_fn is v.grad_fn
    assert "AutocastQKV" in type(q.grad_fn).__name__
    cache = model.model.layers[0].self_attn.q_proj._tigon_cast_cache
    assert not cache._pending  # k_proj and v_proj took their outputs
    loss.backward()
    copied = copy.deepcopy(model)  # the group travels, mapped to the copy's own projections
    attention = copied.model.layers[0].self_attn
    assert attention.q_proj._tigon_cast_cache.group == tuple(getattr(attention, n) for n in QKV_PROJECTIONS)


def test_qkv_node_input_gradient_in_bf16_sums_the_products_once():
    """With a bf16 input (the norm's bf16 output) the node's input gradient is dv·Wv + dk·Wk + dq·Wq
    summed by the matmuls: within one bf16 rounding of the fp64 sum; three separate nodes summed
    by autograd round each product first."""
    torch.manual_seed(0)
    model = tiny_model("qwen2").to(DEVICE)
    tigon.patch(model, fused_attention=False)
    attention = model.model.layers[0].self_attn
    hidden = model.config.hidden_size
    x = torch.randn(2, 5, hidden, device=DEVICE, dtype=AUTOCAST, requires_grad=True)
    with torch.autocast(DEVICE.type, dtype=AUTOCAST):
        outs = [getattr(attention, n)(x) for n in QKV_PROJECTIONS]
    assert outs[0].grad_fn is outs[2].grad_fn
    dys = [torch.randn_like(o) for o in outs]
    (dx,) = torch.autograd.grad(outs, (x,), dys)
    assert dx.dtype == AUTOCAST
    want = sum(
        dy.double().reshape(-1, dy.shape[-1]) @ getattr(attention, n).weight.to(AUTOCAST).double()
        for dy, n in zip(dys, QKV_PROJECTIONS, strict=True)
    ).reshape(dx.shape)
    assert_close(dx, want, AUTOCAST, "dx")


def test_sibling_on_another_input_or_alone(models):
    shared, separate = models
    attention = shared.model.layers[0].self_attn
    reference = separate.model.layers[0].self_attn
    hidden = shared.config.hidden_size
    x1 = torch.randn(2, 5, hidden, device=DEVICE, requires_grad=True)
    x2 = torch.randn(2, 5, hidden, device=DEVICE, requires_grad=True)
    cache = attention.q_proj._tigon_cast_cache
    group = cache.group
    with torch.autocast(DEVICE.type, dtype=AUTOCAST):
        q = attention.q_proj(x1)
        k = attention.k_proj(x2)          # not what q_proj's node made k from: computed for x2
        q_ref, k_ref = reference.q_proj(x1), reference.k_proj(x2)
        v_alone = attention.v_proj(x1)    # k_proj's call dropped x1's waiting outputs: computed again
        v_ref = reference.v_proj(x1)
    for out, ref in ((q, q_ref), (k, k_ref), (v_alone, v_ref)):
        assert torch.equal(out, ref) if DEVICE.type != "cuda" else torch.allclose(out, ref, rtol=1e-2, atol=1e-2)
    # k_proj, whose output waited, was called on another tensor: grouping ends (CastCache.take).
    assert cache.group is None and v_alone.grad_fn is not q.grad_fn
    (q.float().sum() + k.float().sum()).backward()  # v and two of the node's outputs unused
    x1.grad = x2.grad = None
    cache.group = group
    with torch.autocast(DEVICE.type, dtype=AUTOCAST):
        attention.q_proj(x1)              # k and v of x1 wait
        with torch.no_grad():
            x1.add_(1.0)                  # a new version of x1: what waits may not be returned
        k = attention.k_proj(x1)
        k_ref = reference.k_proj(x1)
        assert torch.equal(k, k_ref) if DEVICE.type != "cuda" else torch.allclose(k, k_ref, rtol=1e-2, atol=1e-2)


def _grouped_nodes(model, ids):
    """Loss and the number of distinct q/k/v nodes made for layer 0 in one forward."""
    loss, outs = _qkv_outputs(model, ids)
    return loss, len({id(o.grad_fn) for o in outs})


def test_inputs_wrapped_per_projection_end_the_grouping():
    """A forward pre-hook that hands each projection a tensor of its own (ZeRO-3's hooks do) would
    make the q/k/v node once per projection: the first such call ends the grouping, and the losses
    and gradients stay those of separate projections."""
    torch.manual_seed(0)
    model = tiny_model("llama").to(DEVICE)
    tigon.patch(model, fused_attention=False)
    reference = copy.deepcopy(model)
    for layer in reference.model.layers:
        layer.self_attn.q_proj._tigon_cast_cache.group = None
    for layer in model.model.layers:
        for name in QKV_PROJECTIONS:
            getattr(layer.self_attn, name).register_forward_pre_hook(lambda m, args: (args[0].view_as(args[0]),))
    for step in range(2):
        ids = _ids(step)
        loss, nodes = _grouped_nodes(model, ids)
        ref_loss, ref_nodes = _grouped_nodes(reference, ids)
        assert nodes == ref_nodes == 3
        _assert_same_loss(loss, ref_loss)  # step 0's q came from a (GPU: stacked) q/k/v node
        grads = torch.autograd.grad(loss, list(model.parameters()))
        ref_grads = torch.autograd.grad(ref_loss, list(reference.parameters()))
        for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads, strict=True):
            if DEVICE.type == "cuda":
                assert_close(g, r, torch.bfloat16, name)
            else:
                assert torch.equal(g, r), name
    assert all(layer.self_attn.q_proj._tigon_cast_cache.group is None for layer in model.model.layers)


def test_zero3_parameters_are_not_grouped(monkeypatch):
    """DeepSpeed ZeRO-3 parameters (they carry a ds_id) exist only while their own module runs:
    q_proj's call must not read k_proj's and v_proj's weights, so each projection is its own node."""
    torch.manual_seed(0)
    model = tiny_model("llama").to(DEVICE)
    tigon.patch(model, fused_attention=False)
    grouped = []
    monkeypatch.setattr(shared_cast_linear._AutocastQKV, "apply", lambda *a: grouped.append(1))
    for p in model.parameters():
        p.ds_id = 0
    loss, nodes = _grouped_nodes(model, _ids())
    assert nodes == 3 and not grouped
    assert model.model.layers[0].self_attn.q_proj._tigon_cast_cache.group is not None  # only bypassed
    loss.backward()


def test_default_patch_under_gradient_checkpointing_matches():
    """The default patch (bf16 norm outputs, q/k/v as one node) recomputed by non-reentrant
    checkpointing gives the same loss and gradients as without checkpointing: bitwise on the CPU; on
    the GPU within bf16 rounding (the attention backward may sum in another order)."""
    torch.manual_seed(0)
    base = tiny_model("qwen2").to(DEVICE)
    tigon.patch(base, fused_attention=False)
    checkpointed = copy.deepcopy(base)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = _ids(4)
    loss, grads, _, _ = _step(base, ids)
    loss_c, grads_c, _, _ = _step(checkpointed, ids)
    assert torch.equal(loss, loss_c)
    for name, g in grads.items():
        if DEVICE.type == "cuda":
            assert_close(grads_c[name], g, torch.bfloat16, name)
        else:
            assert torch.equal(grads_c[name], g), name


@pytest.mark.parametrize("norm_output", ("bf16", "fp32"))
def test_stacked_projection_matches_the_separate_ones(monkeypatch, models, norm_output):
    """q, k and v as one stacked matmul (the GPU's path, run here on any device): the outputs are
    column blocks of one product, and the loss and every gradient match the stock projections'
    within bf16 rounding (the products are summed in other orders)."""
    monkeypatch.setattr(shared_cast_linear, "STACKED_DEVICES", ("cuda", "cpu"))
    shared, separate = models
    if norm_output == "bf16":  # the default patch: the norm gives its output in bf16
        for model in (shared, separate):
            for layer in model.model.layers:
                layer.input_layernorm.autocast_output = layer.post_attention_layernorm.autocast_output = True
    ids = _ids(5)
    _, (q, k, v) = _qkv_outputs(shared, ids)
    assert q._base is k._base is v._base and q.grad_fn is v.grad_fn
    loss_s, grads_s, saved_s, weights_s = _step(shared, ids)
    loss_p, grads_p, _, weights_p = _step(separate, ids)
    assert_close(loss_s, loss_p, torch.bfloat16, "loss")
    for name, g in grads_p.items():
        assert grads_s[name].dtype == g.dtype, name
        assert_close(grads_s[name], g, torch.bfloat16, name)
    assert len(weights_p) - len(weights_s) == 4 * shared.config.num_hidden_layers  # no weight copies saved


def test_stacked_projection_with_an_unused_output(monkeypatch):
    """An output that gets no gradient (v here) sends the stacked node down the per-projection
    backward; the gradients are those of the used outputs."""
    monkeypatch.setattr(shared_cast_linear, "STACKED_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    model = tiny_model("qwen2").to(DEVICE)
    tigon.patch(model, fused_attention=False)
    attention = model.model.layers[0].self_attn
    x = torch.randn(2, 5, model.config.hidden_size, device=DEVICE, dtype=AUTOCAST, requires_grad=True)
    with torch.autocast(DEVICE.type, dtype=AUTOCAST):
        q, k, _ = (getattr(attention, n)(x) for n in QKV_PROJECTIONS)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    params = [attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight, attention.q_proj.bias]
    dx, dwq, dwk, dwv, dbq = torch.autograd.grad((q, k), (x, *params), (dq, dk), allow_unused=True)
    assert dwv is None
    wq, wk = attention.q_proj.weight.to(AUTOCAST).double(), attention.k_proj.weight.to(AUTOCAST).double()
    x2 = x.double().reshape(-1, x.shape[-1])
    dq2, dk2 = dq.double().reshape(-1, dq.shape[-1]), dk.double().reshape(-1, dk.shape[-1])
    assert_close(dx, (dq2 @ wq + dk2 @ wk).reshape(dx.shape), AUTOCAST, "dx")
    assert_close(dwq, dq2.t() @ x2, AUTOCAST, "dWq")
    assert_close(dwk, dk2.t() @ x2, AUTOCAST, "dWk")
    assert_close(dbq, dq2.sum(0), AUTOCAST, "dbq")
