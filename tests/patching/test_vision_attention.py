"""The Qwen-VL vision attention over all its segments in one call (tigon/nn/vision_attention.py,
patching/parts/vision.py: the ``vision_attention`` switch).

``segment_attention`` against an fp64 per-segment reference in every dtype (segments of one length and
of several, empty ones, non-contiguous q/k/v as the packed qkv projection gives them, a stride-0
gradient; on the GPU in fp16/bf16 the one flash call), its bad inputs; then the three Qwen-VL rows
under sdpa, patched against stock, with windows of several sizes and two images of different sizes in
one batch; the fallback for other attention implementations, the switch, and a forward that differs
from transformers'.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import textwrap

import pytest
import torch
import torch.nn.functional as F
import transformers

import tigon
from tests.helpers import DEVICE, DTYPES, TOLERANCE, assert_close, rel_err, stride0_like
from tests.patching import tiny_vlm
from tests.patching.tiny import grads, rel
from tigon.nn import vision_attention
from tigon.nn.vision_attention import segment_attention

QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
HEADS, HEAD_DIM = 3, 8
PACKED_LINE = "one call over every image or window"


def _per_segment(q, k, v, cu_seqlens, scale):
    """What transformers' sdpa branch computes: one sdpa call a segment, concatenated."""
    bounds = cu_seqlens.tolist()
    outs = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=scale).transpose(0, 1)
            for a, b in itertools.pairwise(bounds) if b > a]
    return torch.cat(outs)


def _packed_qkv(total, dtype):
    """q, k, v as the vision attention has them: views of one ``[S, 3, heads, head_dim]`` projection."""
    qkv = torch.randn(total, 3, HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    q, k, v = (t.detach().requires_grad_() for t in qkv.permute(1, 0, 2, 3).unbind(0))
    assert not q.is_contiguous()
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", [[5, 5, 5], [7, 5, 0, 8, 6], [13], [3, 21, 3, 0, 3, 5]],
                         ids=["equal", "padded", "one", "by-length"])
def test_segment_attention_matches_fp64_per_segment(lengths, dtype):
    cu_seqlens = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).int()
    total, scale = sum(lengths), HEAD_DIM ** -0.5
    q, k, v = _packed_qkv(total, dtype)
    out = segment_attention(q, k, v, cu_seqlens, scale=scale)
    grad = torch.randn_like(out)
    out.backward(grad)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _per_segment(*leaves, cu_seqlens, scale)
    want.backward(grad.double())
    assert out.dtype == dtype and out.shape == (total, HEADS, HEAD_DIM)
    assert_close(out, want, dtype)
    for name, got, leaf in zip("qkv", (q, k, v), leaves, strict=True):
        assert_close(got.grad, leaf.grad, dtype, what=f"d{name}")

    if dtype != torch.float32:  # no worse than transformers' per-segment calls in the same dtype
        stock = _per_segment(q.detach(), k.detach(), v.detach(), cu_seqlens, scale)
        assert rel_err(out, want) <= 2 * rel_err(stock, want) + 1e-3


def test_segment_attention_takes_a_stride0_gradient():
    cu_seqlens = torch.tensor([0, 4, 9, 11], device=DEVICE)
    q, k, v = _packed_qkv(11, torch.float32)
    out = segment_attention(q, k, v, cu_seqlens, scale=0.3)
    grad = stride0_like(out)
    out.backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _per_segment(*leaves, cu_seqlens, 0.3).backward(grad.double())
    for got, leaf in zip((q, k, v), leaves, strict=True):
        assert_close(got.grad, leaf.grad, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("grad_kind", ["random", "stride0"])
def test_segments_run_as_one_flash_call_on_the_gpu(dtype, grad_kind, monkeypatch):
    """fp16/bf16 on the GPU: the segments (windows of four sizes, an empty one; Qwen's head size 80) are
    one flash call, no sdpa call; against the fp64 per-segment reference, and no less accurate than the
    padded sdpa call the other dtypes and devices take."""
    import dataclasses

    heads, head_dim, lengths = 4, 80, [64, 32, 0, 32, 16, 64, 5]
    cu_seqlens = torch.tensor([0] + lengths, device="cuda").cumsum(0).int()
    total, scale = sum(lengths), head_dim ** -0.5
    qkv = torch.randn(total, 3, heads, head_dim, device="cuda").to(dtype)
    q, k, v = (t.detach().requires_grad_() for t in qkv.permute(1, 0, 2, 3).unbind(0))
    sdpa_calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: sdpa_calls.append(1) or sdpa(*a, **kw))
    out = segment_attention(q, k, v, cu_seqlens, scale=scale)
    grad = torch.randn_like(out) if grad_kind == "random" else stride0_like(out)
    out.backward(grad)
    assert not sdpa_calls and out.dtype == dtype and out.shape == (total, heads, head_dim)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _per_segment(*leaves, cu_seqlens, scale)
    want.backward(grad.double())
    assert_close(out, want, dtype)
    for name, got, leaf in zip("qkv", (q, k, v), leaves, strict=True):
        assert_close(got.grad, leaf.grad, dtype, what=f"d{name}")

    monkeypatch.setattr(vision_attention, "CONFIG", dataclasses.replace(vision_attention.CONFIG, flash=False))
    padded = [t.detach().requires_grad_() for t in (q, k, v)]
    out_padded = segment_attention(*padded, cu_seqlens, scale=scale)
    out_padded.backward(grad)
    assert sdpa_calls
    assert rel_err(out, want) <= 2 * rel_err(out_padded, want) + 1e-3
    for got, other, leaf in zip((q, k, v), padded, leaves, strict=True):
        assert rel_err(got.grad, leaf.grad) <= 2 * rel_err(other.grad, leaf.grad) + 1e-3


@pytest.mark.parametrize("bounds", [[0, 4, 10], [1, 4, 11], [0, 6, 4, 11], []],
                         ids=["short", "start", "falls", "empty"])
def test_segment_attention_refuses_bad_segments(bounds):
    q, k, v = _packed_qkv(11, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        segment_attention(q, k, v, torch.tensor(bounds, dtype=torch.int32, device=DEVICE), scale=1.0)
    assert q.grad is None


def test_segment_attention_refuses_mismatched_shapes():
    q, k, v = _packed_qkv(6, torch.float32)
    with pytest.raises(ValueError, match="heads, head_dim"):
        segment_attention(q, k[:5], v, torch.tensor([0, 6], device=DEVICE), scale=1.0)


# --------------------------------------------------------------------------------------------- models

def _sdpa_pair(model_type, **switches):
    torch.manual_seed(0)
    stock = tiny_vlm.tiny_vlm(model_type, attention="sdpa").to(DEVICE)
    patched = copy.deepcopy(stock)
    return stock, patched, tigon.patch(patched, **switches)


def _two_image_batch(model_type, config, seed=0):
    """Two sequences of 19 tokens: a 4 x 4-patch image (4 tokens) and a 6 x 6-patch one (9 tokens), so
    the images and (Qwen2.5-VL) the windows come in several lengths."""
    gen = torch.Generator().manual_seed(seed)
    vision = config.vision_config
    features = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    grids = [4, 6]
    rows = []
    for grid in grids:
        image = [tiny_vlm.VISION_START] + [tiny_vlm.IMAGE] * (grid * grid // 4) + [tiny_vlm.VISION_END]
        text = torch.randint(3, tiny_vlm.TEXT_TOKENS, (19 - len(image),), generator=gen).tolist()
        rows.append(image + text)
    ids = torch.tensor(rows)
    labels = torch.where(ids >= tiny_vlm.TEXT_TOKENS, -100, ids)
    inputs = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids),
              "pixel_values": torch.randn(sum(g * g for g in grids), features, generator=gen),
              "image_grid_thw": torch.tensor([[1, g, g] for g in grids])}
    if "mm_token_type_ids" in tiny_vlm._forward_parameters(model_type):
        inputs["mm_token_type_ids"] = (ids == tiny_vlm.IMAGE).int()
    return {k: v.to(DEVICE) for k, v in inputs.items()}


def _segments_seen(monkeypatch):
    seen = []
    inner = vision_attention.segment_attention

    def spy(q, k, v, cu_seqlens, **kwargs):
        seen.append((cu_seqlens[1:] - cu_seqlens[:-1]).tolist())
        return inner(q, k, v, cu_seqlens, **kwargs)

    monkeypatch.setattr(vision_attention, "segment_attention", spy)
    return seen


@pytest.mark.parametrize("model_type", QWEN_VL)
def test_patched_vision_attention_matches_stock_sdpa(model_type, monkeypatch):
    """fp32: loss, every gradient (vision tower included) and eval logits as stock's per-segment sdpa,
    with segments of several lengths in the same call."""
    stock, patched, handle = _sdpa_pair(model_type)
    assert any(PACKED_LINE in line for line in handle.replaced)
    seen = _segments_seen(monkeypatch)
    inputs = _two_image_batch(model_type, stock.config, seed=1)
    want, got = stock(**inputs), patched(**inputs)
    assert seen and any(len(set(lengths)) > 1 for lengths in seen)
    if model_type == "qwen2_5_vl":  # windows of 16, 8 and 4 patches, and the two images
        assert [16, 36] in seen and any(len(lengths) > 2 for lengths in seen)
    assert rel(got.loss, want.loss) <= 1e-5
    want.loss.backward()
    got.loss.backward()
    tiny_vlm.assert_vlm_grads_close(grads(patched), grads(stock))
    stock.eval()
    patched.eval()
    with torch.no_grad():
        assert rel(patched(**inputs).logits, stock(**inputs).logits) <= 1e-5
    handle.revert()
    assert not any("forward" in vars(m) for m in patched.modules())


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", QWEN_VL)
def test_patched_vision_attention_matches_stock_under_bf16_autocast(model_type):
    stock, patched, _ = _sdpa_pair(model_type)
    inputs = _two_image_batch(model_type, stock.config, seed=2)
    losses = []
    for model in (stock, patched):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        losses.append(loss)
    assert rel(losses[1], losses[0]) <= TOLERANCE[torch.bfloat16]
    want = grads(stock)
    for name, g in grads(patched).items():
        assert rel(g, want[name]) <= TOLERANCE[torch.bfloat16], name


def test_other_implementations_run_the_class_forward(monkeypatch):
    """Under eager attention the patched forward is the class's (with tigon's rotary): bitwise the model
    patched with vision_attention=False."""
    stock, packed, _ = _sdpa_pair("qwen2_5_vl")
    unpacked = copy.deepcopy(stock)
    tigon.patch(unpacked, vision_attention=False)
    for model in (packed, unpacked):
        model.model.visual.config._attn_implementation = "eager"
    seen = _segments_seen(monkeypatch)
    inputs = _two_image_batch("qwen2_5_vl", stock.config)
    got, want = packed(**inputs).loss, unpacked(**inputs).loss
    assert not seen and torch.equal(got, want)


def test_switch_off_and_rope_off():
    """vision_attention=False leaves the per-segment loop (the forward is only the rope patch's);
    rope=False keeps the module's own rotary inside the packed forward, which still matches stock."""
    _, patched, handle = _sdpa_pair("qwen2_vl", vision_attention=False)
    assert not any(PACKED_LINE in line for line in handle.replaced)
    assert any("apply_rotary_pos_emb_vision" in line for line in handle.replaced)

    stock, patched, handle = _sdpa_pair("qwen2_vl", rope=False)
    assert any(PACKED_LINE in line for line in handle.replaced)
    assert not any("apply_rotary_pos_emb" in line for line in handle.replaced)
    inputs = _two_image_batch("qwen2_vl", stock.config)
    want, got = stock(**inputs), patched(**inputs)
    assert rel(got.loss, want.loss) <= 1e-5

    _, _, handle = _sdpa_pair("qwen2_vl", rope=False, vision_attention=False)
    assert not any("VisionAttention" in line for line in handle.replaced)


def test_a_forward_that_differs_is_refused(monkeypatch):
    """A vision attention forward that is not transformers' (one statement changed) raises ValueError
    naming the part, and the model is left as it was."""
    module = inspect.getmodule(transformers.models.qwen2_vl.modeling_qwen2_vl)
    cls = module.VisionAttention
    source = textwrap.dedent(inspect.getsource(cls.forward))
    source = source.replace("attn_output = self.proj(attn_output)", "attn_output = self.proj(attn_output) * 1.0")
    namespace = {}
    exec(compile(source, module.__file__, "exec"), module.__dict__, namespace)  # the module's globals
    stock, _, _ = _sdpa_pair("qwen2_vl", vision_attention=False)
    monkeypatch.setattr(cls, "forward", namespace["forward"])
    model = copy.deepcopy(stock)
    with pytest.raises(ValueError, match="vision_attention"):
        tigon.patch(model)
    assert not any("forward" in vars(m) for m in model.modules())
    assert tigon.patch(model, vision_attention=False).replaced  # the rest still patches


def test_segments_are_read_once_per_tensor():
    """The blocks of a tower share cu_seqlens: the host reads it once; an in-place change reads it again."""
    from tigon.nn.vision_attention import segments_of

    cu_seqlens = torch.tensor([0, 3, 8, 8, 10], device=DEVICE)
    first = segments_of(cu_seqlens, 10, DEVICE)
    assert segments_of(cu_seqlens, 10, DEVICE) is first
    (call,) = first.calls
    assert (call.count, call.length) == (3, 5)
    assert call.index.tolist() == [0, 1, 2, 0, 0, 3, 4, 5, 6, 7, 8, 9, 8, 8, 8]
    assert first.keep.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 10, 11]
    cu_seqlens[1] = 5
    again = segments_of(cu_seqlens, 10, DEVICE)
    assert again is not first and again.calls[0].index.tolist()[:5] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="cu_seqlens"):
        segments_of(cu_seqlens, 11, DEVICE)  # another length: read again, and refused


def test_a_long_segment_beside_short_ones_is_not_padded():
    """Padding 3-position segments to a 21-position one would cost 4x their attention work: one call per
    length instead, their outputs put back in order."""
    from tigon.nn.vision_attention import CONFIG, segments_of

    found = segments_of(torch.tensor([0, 3, 24, 27, 27, 30], device=DEVICE), 30, DEVICE)
    assert [(c.count, c.length, c.valid) for c in found.calls] == [(1, 21, None), (3, 3, None)]
    assert found.calls[0].index.tolist() == list(range(3, 24))
    assert found.calls[1].index.tolist() == [0, 1, 2, 24, 25, 26, 27, 28, 29]
    order = torch.cat([c.index for c in found.calls])
    assert torch.equal(order[found.keep], torch.arange(30, device=DEVICE))
    assert CONFIG.pad_limit == 2.0
    windows = segments_of(torch.tensor([0, 64, 96, 160, 176], device=DEVICE), 176, DEVICE)
    assert len(windows.calls) == 1 and windows.calls[0].valid is not None  # windows: padded, one call


def test_inference_mode():
    """Under torch.inference_mode (generation, evaluation) nothing is kept on cu_seqlens (an inference
    tensor has no version counter) and the patched model gives stock's logits."""
    from tigon.nn.vision_attention import CACHE_ATTR

    with torch.inference_mode():
        cu_seqlens = torch.tensor([0, 2, 7], device=DEVICE)
        q, k, v = (t.detach() for t in _packed_qkv(7, torch.float32))
        out = segment_attention(q, k, v, cu_seqlens, scale=0.5)
    assert not hasattr(cu_seqlens, CACHE_ATTR)
    assert_close(out, _per_segment(q.double(), k.double(), v.double(), cu_seqlens, 0.5), torch.float32)

    stock, patched, _ = _sdpa_pair("qwen2_5_vl")
    inputs = _two_image_batch("qwen2_5_vl", stock.config)
    stock.eval()
    patched.eval()
    with torch.inference_mode():
        assert rel(patched(**inputs).logits, stock(**inputs).logits) <= 1e-5
