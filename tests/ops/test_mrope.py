"""tigon.ops.mrope against transformers' multimodal rotary embedding (fp64, partial-rotary aware).

mrope runs rope's two tilings with the cos/sin columns read from their streams' planes, so the
`tiling` fixture forces each (as test_rope.py does, through mrope's config) and check_mrope asserts
the launch picked it. The rest of rope's regimes carry over (test_rope.py's docstring); what is new
here is the stream of each frequency, so the sections are chosen at its boundaries: an empty stream
([2, 4, 0], [1, 0, 0]), a stream whose interleaved range runs past the rotary half (3·4 > 6 for
[2, 4, 0]: the height stream gets only 2 of its 4 frequencies, as transformers' recomposition does),
sections that split a padded half-tile (half 12 in a 16-wide tile), and the real Qwen2.5-VL
[16, 24, 24] and Qwen3-VL [24, 20, 20] layouts at head dim 128. cos/sin are random, with different
values in each stream plane and in each half, so a column read from the wrong plane, or the second
half read at the first's stream, shows.
"""

import dataclasses
import importlib

import pytest
import torch

from tests.helpers import DEVICE, DTYPES, assert_close, fp64_reference, noncontiguous, randn, stride0_like
from tigon.ops.mrope import _trig_vector, mrope, mrope_cos_sin, mrope_reference

mrope_mod = importlib.import_module("tigon.ops.mrope")

TILINGS = ("head_block", "token")
# token_tile_elements while the token tiling is forced: one position of the largest shape here (the
# GPU compile test's 8 + 2 heads padded to 16 rows of 128) fills it exactly.
FORCED_TOKEN_TILE = 16 * 128

# (batch, q heads, k heads, positions, head dim, rotary dim, mrope_section)
SHAPES = (
    (1, 1, 1, 1, 2, 2, (1, 0, 0)),  # one rotated pair, every frequency temporal
    (2, 4, 2, 3, 32, 32, (4, 6, 6)),  # Qwen2-VL's proportions
    (2, 5, 1, 7, 64, 64, (8, 12, 12)),
    (1, 3, 1, 9, 40, 24, (6, 3, 3)),  # partial rotary, half 12 in a 16-wide tile, 16 dims passed through
    (3, 2, 2, 5, 16, 12, (2, 4, 0)),  # no width stream; interleaved height range 3·4 > half = 6
    (1, 2, 1, 2, 128, 128, (24, 20, 20)),  # Qwen3-VL's sections
)


def qk_shape(batch, heads, seq_len, head_dim, unsqueeze_dim):
    return (batch, heads, seq_len, head_dim) if unsqueeze_dim == 1 else (batch, seq_len, heads, head_dim)


@pytest.fixture(params=TILINGS)
def tiling(request, monkeypatch):
    """Force one tiling through mrope's config (the launch geometry's cache keys on it)."""
    rope_config = mrope_mod.CONFIG.rope
    if request.param == "head_block":
        forced = dataclasses.replace(rope_config, token_tiling_below_block_h=0)
    else:
        forced = dataclasses.replace(rope_config, token_tiling_below_block_h=rope_config.max_block_h + 1,
                                     token_tile_elements=FORCED_TOKEN_TILE)
    monkeypatch.setattr(mrope_mod, "CONFIG", mrope_mod.MropeConfig(rope=forced))
    return request.param


def launch_of(q, k, cos, unsqueeze_dim=1):
    """The launch config mrope() uses for these inputs (forward and backward alike)."""
    t_dim = 3 - unsqueeze_dim
    return mrope_mod.rope_launch(
        q.shape[t_dim], q.shape[unsqueeze_dim], k.shape[unsqueeze_dim], cos.shape[-1], q.shape[3],
        q.dtype == k.dtype, config=mrope_mod.CONFIG.rope,
    )


def check_mrope(q, k, cos, sin, section, dq_out=None, dk_out=None, *, interleaved=False, unsqueeze_dim=1,
                tiling=None):
    """Forward and both gradients against the fp64 reference; output dtypes as transformers'.
    With ``tiling``, first that the launch config picks it for these inputs."""
    if tiling is not None:
        assert launch_of(q, k, cos, unsqueeze_dim).token_tiling == (tiling == "token")
    out_dtype = torch.promote_types(q.dtype, torch.promote_types(cos.dtype, sin.dtype))
    q_out, k_out = mrope(q, k, cos, sin, section, unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)
    assert q_out.dtype == out_dtype and k_out.dtype == out_dtype
    dq_out = randn(*q_out.shape, dtype=out_dtype) if dq_out is None else dq_out
    dk_out = randn(*k_out.shape, dtype=out_dtype) if dk_out is None else dk_out
    (ref_q, ref_k), grads = fp64_reference(
        mrope_reference, {"q": q, "k": k, "cos": cos, "sin": sin}, (dq_out, dk_out),
        mrope_section=section, unsqueeze_dim=unsqueeze_dim, interleaved=interleaved, io_dtype=out_dtype,
    )
    assert_close(q_out, ref_q, q.dtype, "q_out")
    assert_close(k_out, ref_k, k.dtype, "k_out")
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    assert dq.dtype == q.dtype and dk.dtype == k.dtype
    assert_close(dq, grads["q"], q.dtype, "dq")
    assert_close(dk, grads["k"], k.dtype, "dk")
    return q_out, k_out, dq, dk


def _streams(batch, seq_len, rot_dim, dtype=torch.float32):
    return randn(3, batch, seq_len, rot_dim, dtype=dtype), randn(3, batch, seq_len, rot_dim, dtype=dtype)


@pytest.mark.parametrize("interleaved", (False, True), ids=("sectioned", "interleaved"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hk{}-T{}-D{}-Dr{}-{}_{}_{}".format(*s[:6], *s[6]))
def test_mrope_sizes(dtype, shape, interleaved, tiling):
    batch, hq, hk, seq_len, head_dim, rot_dim, section = shape
    q = randn(batch, hq, seq_len, head_dim, dtype=dtype, requires_grad=True)
    k = randn(batch, hk, seq_len, head_dim, dtype=dtype, requires_grad=True)
    cos, sin = _streams(batch, seq_len, rot_dim, dtype)
    check_mrope(q, k, cos, sin, list(section), interleaved=interleaved, tiling=tiling)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unsqueeze_dim", (1, 2))
@pytest.mark.parametrize("cos_batch", ("batched", "one"))
def test_mrope_layouts_and_cos_shapes(dtype, unsqueeze_dim, cos_batch, tiling):
    """[B, H, T, D] and [B, T, H, D]; cos/sin per batch element or shared ([3, 1, T, Dr], batch stride 0)."""
    batch, hq, hk, seq_len, head_dim, rot_dim = 2, 4, 2, 6, 32, 24
    q = randn(*qk_shape(batch, hq, seq_len, head_dim, unsqueeze_dim), dtype=dtype, requires_grad=True)
    k = randn(*qk_shape(batch, hk, seq_len, head_dim, unsqueeze_dim), dtype=dtype, requires_grad=True)
    cos, sin = _streams(batch if cos_batch == "batched" else 1, seq_len, rot_dim, dtype)
    for interleaved in (False, True):
        check_mrope(q, k, cos, sin, (2, 5, 5), interleaved=interleaved, unsqueeze_dim=unsqueeze_dim, tiling=tiling)


def test_mrope_transposed_projection_read_in_place(tiling):
    """q, k as Qwen2-VL makes them: proj(x).view(B, T, H, D).transpose(1, 2). Outputs and gradients
    keep that memory layout."""
    batch, seq_len, hq, hk, head_dim = 2, 7, 6, 2, 64
    qkv = randn(batch, seq_len, (hq + 2 * hk) * head_dim, dtype=torch.bfloat16)
    q_proj, k_proj, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    q = q_proj.reshape(batch, seq_len, hq, head_dim).transpose(1, 2).detach().requires_grad_()
    k = k_proj.reshape(batch, seq_len, hk, head_dim).transpose(1, 2).detach().requires_grad_()
    assert not q.is_contiguous()
    cos, sin = _streams(batch, seq_len, head_dim, torch.bfloat16)
    q_out, k_out, dq, dk = check_mrope(q, k, cos, sin, (8, 12, 12), tiling=tiling)
    assert q_out.transpose(1, 2).is_contiguous() and k_out.transpose(1, 2).is_contiguous()
    assert dq.transpose(1, 2).is_contiguous() and dk.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mrope_noncontiguous_inputs_and_stride0_grads(dtype, tiling):
    """q's dims at stride 2; cos [B, T, 3, Dr] in memory (stream stride Dr) with its dims at stride 2,
    sin contiguous, so cos and sin have different strides in every dim; stride-0 output gradients."""
    batch, seq_len, rot_dim = 2, 5, 12
    q = noncontiguous(randn(batch, 3, seq_len, 16, dtype=dtype, requires_grad=True))
    k = randn(batch, 1, seq_len, 16, dtype=dtype, requires_grad=True)
    cos = noncontiguous(randn(batch, seq_len, 3, rot_dim, dtype=dtype)).permute(2, 0, 1, 3)
    sin = randn(3, batch, seq_len, rot_dim, dtype=dtype)
    assert cos.stride() != sin.stride()
    dq_out, dk_out = stride0_like(q.detach()), stride0_like(k.detach())
    for interleaved in (False, True):
        check_mrope(q, k, cos, sin, (2, 2, 2), dq_out, dk_out, interleaved=interleaved, tiling=tiling)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_mrope_fp32_cos_sin_promote(dtype):
    """fp32 cos/sin with half q: outputs fp32 as transformers', gradients in q's and k's dtypes."""
    q = randn(1, 4, 6, 32, dtype=dtype, requires_grad=True)
    k = randn(1, 2, 6, 32, dtype=dtype, requires_grad=True)
    cos, sin = _streams(1, 6, 32)
    check_mrope(q, k, cos, sin, (4, 6, 6))


def test_mrope_mixed_dtypes():
    """q and k of different dtypes take the head-block tiling (as rope's) and stay exact."""
    q = randn(2, 14, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    k = randn(2, 2, 5, 16, dtype=torch.float32, requires_grad=True)
    cos, sin = _streams(2, 5, 16, torch.bfloat16)
    assert not launch_of(q, k, cos).token_tiling
    q_out, k_out = mrope(q, k, cos, sin, (2, 3, 3))
    assert q_out.dtype == torch.bfloat16 and k_out.dtype == torch.float32
    dq_out, dk_out = randn(*q_out.shape, dtype=q_out.dtype), randn(*k_out.shape, dtype=k_out.dtype)
    (ref_q, ref_k), grads = fp64_reference(
        mrope_reference, {"q": q, "k": k, "cos": cos, "sin": sin}, (dq_out, dk_out), mrope_section=(2, 3, 3)
    )
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    for got, ref, dtype, name in (
        (q_out, ref_q, torch.bfloat16, "q_out"), (k_out, ref_k, torch.float32, "k_out"),
        (dq, grads["q"], torch.bfloat16, "dq"), (dk, grads["k"], torch.float32, "dk"),
    ):
        assert got.dtype == dtype
        assert_close(got, ref, dtype, name)


@pytest.mark.parametrize(
    "section,interleaved,streams",
    [
        ((16, 24, 24), False, [0] * 16 + [1] * 24 + [2] * 24),  # Qwen2-VL / Qwen2.5-VL
        ((24, 20, 20), True, [0] + [1, 2, 0] * 20 + [0] * 3),  # Qwen3-VL: h at 1, 4 .. 58; w at 2, 5 .. 59
        ((2, 4, 0), True, [0, 1, 0, 0, 1, 0]),  # height's range 3·4 runs past half = 6: 2 frequencies
        ((1, 1, 1), True, [0, 1, 2]),
    ],
    ids=str,
)
def test_mrope_stream_of_each_frequency(section, interleaved, streams, tiling):
    """The stream each frequency (and its second-half twin) takes, spelled out. Plane s of cos and sin
    holds s + 10·dim, so a combined row names its source; q = [1 | 0] makes the kernel's output
    [c1 | s2], the combined rows' halves as read (exact in fp32: small integers)."""
    half = len(streams)
    rot_dim = 2 * half
    planes = torch.arange(3.0, device=DEVICE)[:, None] + 10 * torch.arange(float(rot_dim), device=DEVICE)
    cos = planes[:, None, None, :].expand(3, 1, 1, rot_dim)
    expected = torch.tensor(streams * 2, device=DEVICE) + 10 * torch.arange(float(rot_dim), device=DEVICE)
    combined, _ = mrope_cos_sin(cos, cos, list(section), interleaved=interleaved)
    assert torch.equal(combined[0, 0], expected)
    q = torch.cat((torch.ones(half, device=DEVICE), torch.zeros(half, device=DEVICE))).expand(1, 1, 1, rot_dim)
    q_out, k_out = mrope(q, q, cos, cos, list(section), interleaved=interleaved)
    assert torch.equal(q_out[0, 0, 0], expected) and torch.equal(k_out, q_out)


@pytest.mark.parametrize("family", ("qwen2_vl", "qwen3_vl"))
def test_mrope_matches_transformers(family):
    """transformers 5.x combines the streams inside the rotary module and applies plain rope; mrope
    takes the per-stream tables ([3, B, T, D], each stream's cat(freqs, freqs)) and must agree."""
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig as Config
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding as Rotary
        from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb
        section, interleaved = [4, 6, 6], False
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Rotary
        from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb
        section, interleaved = [6, 5, 5], True
    config = Config(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
    )
    rotary = Rotary(config).to(DEVICE)
    batch, seq_len = 2, 7
    position_ids = torch.randint(0, 20, (3, batch, seq_len), device=DEVICE)
    q = randn(batch, 4, seq_len, 32, requires_grad=True)
    k = randn(batch, 2, seq_len, 32, requires_grad=True)
    cos, sin = rotary(q, position_ids)
    freqs = position_ids[..., None].float() * rotary.inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)  # (3, B, T, D)
    q_out, k_out = mrope(q, k, emb.cos(), emb.sin(), section, interleaved=interleaved)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert_close(q_out, ref_q, torch.float32, "q_out")
    assert_close(k_out, ref_k, torch.float32, "k_out")
    dq_out, dk_out = randn(*q_out.shape), randn(*k_out.shape)
    got = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    want = torch.autograd.grad((ref_q, ref_k), (q, k), (dq_out, dk_out))
    for g, w, name in zip(got, want, ("dq", "dk"), strict=True):
        assert_close(g, w, torch.float32, name)


def test_mrope_one_output_used(tiling):
    q = randn(2, 4, 3, 8, requires_grad=True)
    k = randn(2, 2, 3, 8, requires_grad=True)
    cos, sin = _streams(2, 3, 8)
    assert launch_of(q, k, cos).token_tiling == (tiling == "token")
    q_out, _ = mrope(q, k, cos, sin, (2, 1, 1), interleaved=True)
    q_out.sum().backward()
    _, grads = fp64_reference(
        lambda **kw: mrope_reference(**kw)[0], {"q": q, "k": k, "cos": cos, "sin": sin},
        mrope_section=(2, 1, 1), interleaved=True,
    )
    assert_close(q.grad, grads["q"], torch.float32, "dq")
    assert torch.equal(k.grad, torch.zeros_like(k))


def test_mrope_registered_op_autograd():
    """The torch op (what torch.compile traces) differentiates like the eager path, including an
    output that gets no gradient (None reaches the backward there, not zeros)."""
    q = randn(2, 4, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    k = randn(2, 2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = _streams(1, 3, 8)
    q_out, k_out = torch.ops.tigon.mrope(q, k, cos, sin, [2, 1, 1], False, 1)
    eager_q, eager_k = mrope(q, k, cos, sin, [2, 1, 1])
    assert torch.equal(q_out, eager_q) and torch.equal(k_out, eager_k)
    dq_out = randn(*q_out.shape)
    dq, dk = torch.autograd.grad(q_out, (q, k), dq_out)
    ref_dq, ref_dk = torch.autograd.grad((eager_q, eager_k), (q, k), (dq_out, torch.zeros_like(eager_k)))
    assert torch.equal(dq, ref_dq) and torch.equal(dk, ref_dk)
    assert not dk.any()


def test_mrope_no_grad_to_cos_sin():
    q, k = randn(1, 2, 3, 8, requires_grad=True), randn(1, 2, 3, 8, requires_grad=True)
    cos, sin = (t.requires_grad_() for t in _streams(1, 3, 8))
    q_out, k_out = mrope(q, k, cos, sin, (2, 1, 1))
    (q_out.sum() + k_out.sum()).backward()
    assert cos.grad is None and sin.grad is None and q.grad is not None


def test_mrope_empty_batch():
    q, k = randn(0, 2, 3, 8, requires_grad=True), randn(0, 1, 3, 8, requires_grad=True)
    q_out, k_out = mrope(q, k, *_streams(1, 3, 8), (2, 1, 1))
    assert q_out.shape == (0, 2, 3, 8) and k_out.shape == (0, 1, 3, 8)


def _bad(q_shape=(2, 4, 5, 16), k_shape=(2, 2, 5, 16), cos_shape=(3, 2, 5, 16), sin_shape=None, section=(4, 2, 2),
         **kw):
    q, k = randn(*q_shape), randn(*k_shape)
    cos, sin = randn(*cos_shape), randn(*(sin_shape or cos_shape))
    return (q, k, cos, sin, section), kw


@pytest.mark.parametrize(
    "args,match",
    [
        (_bad(section=(4, 2, 1)), r"mrope_section must be 3 non-negative ints .* Dr / 2 = 8"),
        (_bad(section=(4, 4)), "mrope_section must be"),
        (_bad(section=(4, 2, 1, 1)), "mrope_section must be"),
        (_bad(section=(10, -1, -1)), "mrope_section must be"),
        (_bad(section=(4.0, 2, 2)), "mrope_section must be"),
        (_bad(section="422"), "mrope_section must be"),
        (_bad(cos_shape=(3, 2, 5, 12), section=(4, 2, 2)), r"mrope_section must be .* Dr / 2 = 6"),
        (_bad(cos_shape=(2, 5, 16)), r"cos has shape \(2, 5, 16\), expected \[3, 2, 5, Dr\]"),
        (_bad(cos_shape=(2, 2, 5, 16)), "cos has shape"),
        (_bad(cos_shape=(3, 2, 6, 16)), "cos has shape"),
        (_bad(cos_shape=(3, 3, 5, 16)), "cos has shape"),
        (_bad(sin_shape=(3, 1, 5, 16)), "sin has shape"),
        (_bad(cos_shape=(3, 2, 5, 15)), "must be even"),
        (_bad(cos_shape=(3, 2, 5, 18), section=(3, 3, 3)), "must be even and in"),
        (_bad(k_shape=(2, 2, 5, 8)), "k has shape"),
        (_bad(q_shape=(4, 5, 16)), "q must be 4-D"),
        (_bad(unsqueeze_dim=3), "unsqueeze_dim"),
        (_bad(k_shape=(2, 4, 2, 16), unsqueeze_dim=2), "cos has shape"),
    ],
)
def test_mrope_bad_inputs(args, match):
    (q, k, cos, sin, section), kw = args
    before = [t.clone() for t in (q, k, cos, sin)]
    with pytest.raises(ValueError, match=match):
        mrope(q, k, cos, sin, section, **kw)
    assert all(torch.equal(t, b) for t, b in zip((q, k, cos, sin), before, strict=True))


def test_mrope_bad_types():
    q, k, (cos, sin) = randn(1, 2, 3, 8), randn(1, 2, 3, 8), _streams(1, 3, 8)
    with pytest.raises(TypeError, match="q has dtype"):
        mrope(q.to(torch.int32), k, cos, sin, (2, 1, 1))
    with pytest.raises(TypeError, match="sin has dtype"):
        mrope(q, k, cos, sin.double(), (2, 1, 1))
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        mrope(q, k.tolist(), cos, sin, (2, 1, 1))
    with pytest.raises(TypeError, match="unsqueeze_dim"):
        mrope(q, k, cos, sin, (2, 1, 1), unsqueeze_dim=True)
    with pytest.raises(TypeError, match="interleaved"):
        mrope(q, k, cos, sin, (2, 1, 1), interleaved="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", (False, True), ids=("sectioned", "interleaved"))
@pytest.mark.parametrize("unsqueeze_dim", (1, 2))
def test_mrope_torch_compile_fullgraph(unsqueeze_dim, interleaved, tiling):
    batch, seq_len, hq, hk, head_dim = 2, 128, 8, 2, 128
    section = [24, 20, 20] if interleaved else [16, 24, 24]
    x_q = randn(batch, seq_len, hq * head_dim, dtype=torch.bfloat16, requires_grad=True)
    x_k = randn(batch, seq_len, hk * head_dim, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = _streams(batch, seq_len, head_dim)

    def f(x_q, x_k):
        q = x_q.view(batch, seq_len, hq, head_dim)
        k = x_k.view(batch, seq_len, hk, head_dim)
        if unsqueeze_dim == 1:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        q_out, k_out = mrope(q, k, cos, sin, section, unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)
        return q_out.float().square().sum() + k_out.float().sum()

    cfg = mrope_mod.rope_launch(seq_len, hq, hk, head_dim, head_dim, True, config=mrope_mod.CONFIG.rope)
    assert cfg.token_tiling == (tiling == "token")
    loss = torch.compile(f, fullgraph=True)(x_q, x_k)
    grads = torch.autograd.grad(loss, (x_q, x_k))
    ref_loss = f(x_q, x_k)
    ref_grads = torch.autograd.grad(ref_loss, (x_q, x_k))
    assert_close(loss, ref_loss, torch.float32, "loss")
    for g, rg in zip(grads, ref_grads, strict=True):
        assert_close(g, rg, torch.bfloat16, "grad")


@pytest.mark.gpu
@pytest.mark.bigmem
@pytest.mark.parametrize("interleaved", (False, True), ids=("sectioned", "interleaved"))
def test_mrope_int64_offsets(interleaved):
    """q past 2**31 elements: the last positions of the last heads are rotated right, from the
    right stream planes."""
    head_dim, hq, hk = 128, 32, 8
    seq_len = 2**31 // (hq * head_dim) + 64
    section = [24, 20, 20] if interleaved else [16, 24, 24]
    q = torch.randn(1, hq, seq_len, head_dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, hk, seq_len, head_dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    cos = torch.randn(3, 1, seq_len, head_dim, device=DEVICE, dtype=torch.bfloat16)
    sin = torch.randn(3, 1, seq_len, head_dim, device=DEVICE, dtype=torch.bfloat16)
    q_out, k_out = mrope(q, k, cos, sin, section, interleaved=interleaved)
    tail = slice(seq_len - 64, seq_len)
    q_tail = q[:, :, tail].detach().double().requires_grad_()
    k_tail = k[:, :, tail].detach().double()
    ref_q, ref_k = mrope_reference(
        q_tail, k_tail, cos[:, :, tail].double(), sin[:, :, tail].double(), section, interleaved=interleaved
    )
    assert_close(q_out[:, :, tail], ref_q, torch.bfloat16, "q_out tail")
    assert_close(k_out[:, :, tail], ref_k, torch.bfloat16, "k_out tail")
    dq_out = randn(*q_out.shape, dtype=q_out.dtype)
    dq, _ = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, torch.zeros_like(k_out)))
    (ref_dq,) = torch.autograd.grad(ref_q, q_tail, dq_out[:, :, tail].double())
    assert_close(dq[:, :, tail], ref_dq, torch.bfloat16, "dq tail")


def test_mrope_cpu_needs_interpreter(monkeypatch):
    """CPU tensors without the interpreter are refused by name (on a GPU machine too: they are the
    wrong device there)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, cos, sin = (torch.randn(*shape) for shape in ((1, 2, 3, 8), (1, 2, 3, 8), (3, 1, 3, 8), (3, 1, 3, 8)))
    with pytest.raises(ValueError, match="CUDA tensors"):
        mrope(q, k, cos, sin, (2, 1, 1))


def test_trig_vector_only_where_every_stream_run_is_aligned():
    """The cos/sin loads are vectorised only where each run of one stream's columns starts on a
    vector boundary (a wrong hint would load across a section's edge on the GPU)."""
    cos = torch.randn(3, 2, 8, 128)
    assert _trig_vector(cos, cos, [16, 24, 24], False) == 4
    assert _trig_vector(cos.half(), cos.half(), [16, 24, 24], False) == 8
    assert _trig_vector(cos, cos, [16, 24, 24], True) == 1          # interleaved: a new stream each column
    assert _trig_vector(cos, cos, [18, 22, 24], False) == 2         # a boundary at 18
    assert _trig_vector(cos, cos, [17, 23, 24], False) == 1
    odd = torch.randn(3, 2, 8, 130)[..., :128]                      # rows 130 apart
    assert _trig_vector(odd, odd, [16, 24, 24], False) == 2
    assert _trig_vector(cos.transpose(-1, -2).contiguous().transpose(-1, -2), cos, [16, 24, 24], False) == 1
