"""tigon.ops.rope against transformers' apply_rotary_pos_emb (fp64, partial-rotary aware).

rope.py has two tilings (its docstring), and the `tiling` fixture runs each correctness test under
both by forcing the choice (rope_launch uncached, its constants patched): the head-block tiling
everywhere, or the token tiling everywhere (with a tile that holds one position of every shape
here), and check_rope asserts the launch config picked the forced one. test_rope_launch_rule and
test_rope_launch_shipped check the choice itself.

Regimes. Head-block: heads per program = largest power of two dividing both head counts (32/8 -> 8
heads, 5/1 -> 1 head, 12/4 -> 4), positions fill the rest of the tile (T=1 gives a tile of heads
only, T=33 several position blocks). Token: every head of q and k per program, padded to a power
of two (5 + 1 -> 8 rows, 2 masked; 32 + 8 -> 64), one position per program at 64 heads of 128 and
several position blocks at T=33. Both: head dims 2 (one rotated pair), 64, 96 (padded half-tile)
and 128; partial rotary with a power-of-two and a non-power-of-two half and with a pass-through
part. cos/sin are random (not cat(freqs, freqs)), so the backward is checked in its general form,
not only as "rotate by -sin".
"""

import dataclasses
import importlib

import pytest
import torch

from tests.helpers import (
    DEVICE,
    DTYPES,
    ON_GPU,
    assert_close,
    fp64_reference,
    noncontiguous,
    randn,
    stride0_like,
)
from tigon._kernels import next_power_of_2
from tigon.ops.rope import rope, rope_reference

rope_mod = importlib.import_module("tigon.ops.rope")  # the module: tigon.ops.rope, the attribute, is rope()

TILINGS = ("head_block", "token")
# token_tile_elements while the token tiling is forced: one position of the largest shape here
# (32 + 8 heads padded to 64, 2·64 dims each) fills it exactly.
FORCED_TOKEN_TILE = 64 * 2 * 64

# (batch, q heads, k heads, positions, head dim, rotary dim)
SHAPES = (
    (1, 1, 1, 1, 2, 2),
    (2, 32, 8, 3, 128, 128),
    (2, 5, 1, 7, 64, 64),
    (1, 12, 4, 33, 96, 32),
    (3, 2, 2, 9, 16, 10),
)


def qk_shape(batch, heads, seq_len, head_dim, unsqueeze_dim):
    return (batch, heads, seq_len, head_dim) if unsqueeze_dim == 1 else (batch, seq_len, heads, head_dim)


@pytest.fixture(params=TILINGS)
def tiling(request, monkeypatch):
    """Force one tiling (see the module docstring) through the module's default config (the
    launch geometry's cache keys on it), and nothing leaks into other tests."""
    if request.param == "head_block":
        forced = dataclasses.replace(rope_mod.CONFIG, token_tiling_below_block_h=0)
    else:
        forced = dataclasses.replace(rope_mod.CONFIG, token_tiling_below_block_h=rope_mod.CONFIG.max_block_h + 1,
                                     token_tile_elements=FORCED_TOKEN_TILE)
    monkeypatch.setattr(rope_mod, "CONFIG", forced)
    return request.param


def launch_of(q, k, cos, unsqueeze_dim=1):
    """The launch config rope() uses for these inputs (forward and backward alike)."""
    t_dim = 3 - unsqueeze_dim
    return rope_mod.rope_launch(
        q.shape[t_dim], q.shape[unsqueeze_dim], k.shape[unsqueeze_dim], cos.shape[-1], q.shape[3],
        q.dtype == k.dtype,
    )


def check_rope(q, k, cos, sin, dq_out=None, dk_out=None, *, unsqueeze_dim=1, tiling=None):
    """Forward and both gradients against the fp64 reference; output dtype and layout as eager's.
    With ``tiling``, first that the launch config picks it for these inputs."""
    if tiling is not None:
        assert launch_of(q, k, cos, unsqueeze_dim).token_tiling == (tiling == "token")
    out_dtype = torch.promote_types(q.dtype, torch.promote_types(cos.dtype, sin.dtype))
    q_out, k_out = rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    assert q_out.dtype == out_dtype and k_out.dtype == out_dtype
    dq_out = randn(*q_out.shape, dtype=out_dtype) if dq_out is None else dq_out
    dk_out = randn(*k_out.shape, dtype=out_dtype) if dk_out is None else dk_out
    (ref_q, ref_k), grads = fp64_reference(
        rope_reference, {"q": q, "k": k, "cos": cos, "sin": sin}, (dq_out, dk_out),
        unsqueeze_dim=unsqueeze_dim, io_dtype=out_dtype,
    )
    tol_dtype = q.dtype
    assert_close(q_out, ref_q, tol_dtype, "q_out")
    assert_close(k_out, ref_k, tol_dtype, "k_out")
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    assert dq.dtype == q.dtype and dk.dtype == k.dtype
    assert_close(dq, grads["q"], tol_dtype, "dq")
    assert_close(dk, grads["k"], tol_dtype, "dk")
    return q_out, k_out, dq, dk


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hk{}-T{}-D{}-Dr{}".format(*s))
def test_rope_sizes(dtype, shape, tiling):
    batch, hq, hk, seq_len, head_dim, rot_dim = shape
    q = randn(batch, hq, seq_len, head_dim, dtype=dtype, requires_grad=True)
    k = randn(batch, hk, seq_len, head_dim, dtype=dtype, requires_grad=True)
    cos, sin = randn(batch, seq_len, rot_dim, dtype=dtype), randn(batch, seq_len, rot_dim, dtype=dtype)
    check_rope(q, k, cos, sin, tiling=tiling)


@pytest.mark.parametrize("heads", ((1, 1), (3, 1), (4, 2), (7, 7), (14, 2), (28, 4), (32, 32), (9, 3)))
def test_rope_head_counts(heads, tiling):
    hq, hk = heads
    q = randn(2, hq, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    k = randn(2, hk, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    check_rope(q, k, randn(5, 8, dtype=torch.bfloat16), randn(5, 8, dtype=torch.bfloat16), tiling=tiling)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unsqueeze_dim", (1, 2))
@pytest.mark.parametrize("cos_batch", ("batched", "one", "shared"))
def test_rope_layouts_and_cos_shapes(dtype, unsqueeze_dim, cos_batch, tiling):
    batch, hq, hk, seq_len, head_dim, rot_dim = 2, 4, 2, 6, 32, 24
    q = randn(*qk_shape(batch, hq, seq_len, head_dim, unsqueeze_dim), dtype=dtype, requires_grad=True)
    k = randn(*qk_shape(batch, hk, seq_len, head_dim, unsqueeze_dim), dtype=dtype, requires_grad=True)
    cos_shape = {
        "batched": (batch, seq_len, rot_dim), "one": (1, seq_len, rot_dim), "shared": (seq_len, rot_dim)
    }
    cos, sin = randn(*cos_shape[cos_batch], dtype=dtype), randn(*cos_shape[cos_batch], dtype=dtype)
    check_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, tiling=tiling)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_transposed_projection_read_in_place(dtype, tiling):
    """q, k as Llama makes them: proj(x).view(B, T, H, D).transpose(1, 2). Outputs and gradients
    keep that memory layout (no copy on the way in, none on the way back through the transpose)."""
    batch, seq_len, hq, hk, head_dim = 2, 7, 6, 2, 64
    qkv = randn(batch, seq_len, (hq + 2 * hk) * head_dim, dtype=dtype)
    q_proj, k_proj, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    q = q_proj.reshape(batch, seq_len, hq, head_dim).transpose(1, 2).detach().requires_grad_()
    k = k_proj.reshape(batch, seq_len, hk, head_dim).transpose(1, 2).detach().requires_grad_()
    assert not q.is_contiguous()
    cos, sin = randn(batch, seq_len, head_dim, dtype=dtype), randn(batch, seq_len, head_dim, dtype=dtype)
    q_out, k_out, dq, dk = check_rope(q, k, cos, sin, tiling=tiling)
    assert q_out.stride() == torch.empty(batch, seq_len, hq, head_dim).transpose(1, 2).stride()
    assert dq.transpose(1, 2).is_contiguous() and dk.transpose(1, 2).is_contiguous()


def test_rope_q_and_k_in_different_layouts(tiling):
    """q the transpose of a projection, k contiguous [B, H, T, D]: every stride but the dims' differs
    between them and between their outputs, which one token tile reads and writes side by side."""
    batch, seq_len, hq, hk, head_dim = 2, 5, 6, 2, 32
    q = randn(batch, seq_len, hq, head_dim, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = randn(batch, hk, seq_len, head_dim, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = randn(seq_len, 24, dtype=torch.bfloat16), randn(seq_len, 24, dtype=torch.bfloat16)
    q_out, k_out, dq, dk = check_rope(q, k, cos, sin, tiling=tiling)
    assert q_out.transpose(1, 2).is_contiguous() and dq.transpose(1, 2).is_contiguous()
    assert k_out.is_contiguous() and dk.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("strided", ("q", "q_and_k"))
def test_rope_noncontiguous_inputs_and_stride0_grads(dtype, strided, tiling):
    """Dims at stride 2 in q only (q's and k's dim strides differ within one token tile) or in both."""
    q = noncontiguous(randn(2, 3, 5, 16, dtype=dtype, requires_grad=True))
    k = randn(2, 1, 5, 16, dtype=dtype, requires_grad=True)
    k = noncontiguous(k) if strided == "q_and_k" else k
    cos, sin = noncontiguous(randn(2, 5, 12, dtype=dtype)), randn(2, 5, 12, dtype=dtype)
    dq_out, dk_out = stride0_like(q.detach()), stride0_like(k.detach())
    check_rope(q, k, cos, sin, dq_out, dk_out, tiling=tiling)


def test_rope_broadcast_input(tiling):
    """q expanded over the batch (stride 0): outputs and gradients come out dense, D innermost."""
    q = randn(1, 3, 4, 16).expand(2, 3, 4, 16).detach().requires_grad_()
    k = randn(2, 1, 4, 16, requires_grad=True)
    q_out, _, dq, _ = check_rope(q, k, randn(4, 16), randn(4, 16), tiling=tiling)
    assert q_out.is_contiguous() and dq.is_contiguous()


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_rope_fp32_cos_sin_promote(dtype, tiling):
    """fp32 cos/sin with half q (autocast-style): outputs fp32 as transformers', gradients in q's dtype."""
    q = randn(1, 4, 6, 32, dtype=dtype, requires_grad=True)
    k = randn(1, 2, 6, 32, dtype=dtype, requires_grad=True)
    check_rope(q, k, randn(6, 32), randn(6, 32), tiling=tiling)


def test_rope_mixed_dtypes_take_head_blocks():
    """q and k of different dtypes (so different output dtypes too): the token tiling's pointer
    select needs one type, so even 14 / 2 heads go to the head-block tiling, and stay exact."""
    q = randn(2, 14, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    k = randn(2, 2, 5, 16, dtype=torch.float32, requires_grad=True)
    cos, sin = randn(5, 16, dtype=torch.bfloat16), randn(5, 16, dtype=torch.bfloat16)
    assert not launch_of(q, k, cos).token_tiling
    assert launch_of(q, k.to(torch.bfloat16), cos).token_tiling
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out.dtype == torch.bfloat16 and k_out.dtype == torch.float32
    dq_out, dk_out = randn(*q_out.shape, dtype=q_out.dtype), randn(*k_out.shape, dtype=k_out.dtype)
    (ref_q, ref_k), grads = fp64_reference(rope_reference, {"q": q, "k": k, "cos": cos, "sin": sin}, (dq_out, dk_out))
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    for got, ref, dtype, name in (
        (q_out, ref_q, torch.bfloat16, "q_out"), (k_out, ref_k, torch.float32, "k_out"),
        (dq, grads["q"], torch.bfloat16, "dq"), (dk, grads["k"], torch.float32, "dk"),
    ):
        assert got.dtype == dtype
        assert_close(got, ref, dtype, name)


@pytest.mark.parametrize(
    "heads,dims,same_dtypes,token",
    [
        ((14, 2), (64, 64), True, True),  # gcd 2: 2 heads per head block < 4; 16 rows × 64 = 1024 fit
        ((5, 1), (64, 64), True, True),  # gcd 1; 6 heads padded to 8 rows
        ((12, 4), (64, 64), True, False),  # gcd 4: head blocks of 4, not below the threshold
        ((32, 8), (64, 64), True, False),  # head blocks of 8
        ((30, 2), (64, 64), True, True),  # 32 rows × 64 = 2048: fills the token tile exactly
        ((31, 2), (64, 64), True, False),  # 33 heads pad to 64 rows: 4096 > 2048, no token tile
        ((14, 2), (128, 128), True, True),  # 16 rows × 128 = 2048 fit ...
        ((14, 2), (128, 96), True, False),  # ... but a pass-through part pads the row to 2·64 + 32
        ((3, 1), (2, 2), True, True),  # D = 2: rows of one rotated pair
        ((14, 2), (64, 64), False, False),  # q and k of different dtypes
    ],
    ids=str,
)
def test_rope_launch_rule(heads, dims, same_dtypes, token):
    """The choice between the tilings, at its boundaries, with the config pinned (so that a retune
    of the shipped one does not move the cases)."""
    pinned = rope_mod.RopeConfig(
        tile_elements=2048, max_block_h=16, token_tiling_below_block_h=4, token_tile_elements=2048,
        token_elements_per_warp=256, token_max_warps=8,
    )
    (hq, hk), (head_dim, rot_dim) = heads, dims
    cfg = rope_mod.rope_launch(2048, hq, hk, rot_dim, head_dim, same_dtypes, config=pinned)
    assert cfg.token_tiling == token
    row = 2 * cfg.block_half + (cfg.block_pass if cfg.has_pass else 0)
    if token:
        assert cfg.block_h == next_power_of_2(hq + hk) and cfg.block_h * cfg.block_t * row == 2048
        assert cfg.num_warps == 8
    else:
        assert hq % cfg.block_h == 0 and hk % cfg.block_h == 0


def test_rope_launch_shipped():
    """With the shipped constants, the benchmark's Qwen2.5-0.5B (14 / 2 heads of 64, where the
    head-block tiling reached 77% of SOL on the H100) takes the token tiling, and Llama-3-8B (32 / 8
    heads of 128, 92% with head blocks) keeps the head-block tiling. Update together with the
    config when dev/tune_rope.py says otherwise."""
    qwen = rope_mod.rope_launch(2048, 14, 2, 64, 64, True)
    assert qwen.token_tiling and qwen.block_h == 16
    llama = rope_mod.rope_launch(2048, 32, 8, 128, 128, True)
    assert not llama.token_tiling and llama.block_h == 8


def test_rope_matches_transformers_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64
    )
    rotary = LlamaRotaryEmbedding(config)
    q = randn(2, 4, 11, 64, requires_grad=True)
    k = randn(2, 2, 11, 64, requires_grad=True)
    position_ids = torch.arange(11, device=DEVICE).expand(2, -1)
    cos, sin = rotary(q, position_ids)
    q_out, k_out = rope(q, k, cos, sin)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert_close(q_out, ref_q, torch.float32, "q_out")
    assert_close(k_out, ref_k, torch.float32, "k_out")
    dq_out, dk_out = randn(*q_out.shape), randn(*k_out.shape)
    got = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    want = torch.autograd.grad((ref_q, ref_k), (q, k), (dq_out, dk_out))
    for g, w, name in zip(got, want, ("dq", "dk"), strict=True):
        assert_close(g, w, torch.float32, name)


def test_rope_one_output_used(tiling):
    q = randn(2, 4, 3, 8, requires_grad=True)
    k = randn(2, 2, 3, 8, requires_grad=True)
    cos, sin = randn(3, 8), randn(3, 8)
    assert launch_of(q, k, cos).token_tiling == (tiling == "token")
    q_out, _ = rope(q, k, cos, sin)
    q_out.sum().backward()
    _, grads = fp64_reference(lambda **kw: rope_reference(**kw)[0], {"q": q, "k": k, "cos": cos, "sin": sin})
    assert_close(q.grad, grads["q"], torch.float32, "dq")
    assert torch.equal(k.grad, torch.zeros_like(k))


def test_rope_registered_op_autograd():
    """The torch op (what torch.compile traces) differentiates like the eager path, including an
    output that gets no gradient (None reaches the backward there, not zeros)."""
    q = randn(2, 4, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    k = randn(2, 2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = randn(3, 8), randn(3, 8)
    q_out, k_out = torch.ops.tigon.rope(q, k, cos, sin, 1)
    eager_q, eager_k = rope(q, k, cos, sin)
    assert torch.equal(q_out, eager_q) and torch.equal(k_out, eager_k)
    dq_out = randn(*q_out.shape)
    dq, dk = torch.autograd.grad(q_out, (q, k), dq_out)
    ref_dq, ref_dk = torch.autograd.grad((eager_q, eager_k), (q, k), (dq_out, torch.zeros_like(eager_k)))
    assert torch.equal(dq, ref_dq) and torch.equal(dk, ref_dk)
    assert not dk.any()


@pytest.mark.parametrize("layout", ("shared", "batched_bthd"))
@pytest.mark.parametrize("out_dtype", (torch.bfloat16, torch.float16), ids=str)
def test_rope_output_dtype_is_the_promoted_output_cast_once(tiling, layout, out_dtype):
    """output_dtype: each output is the promoted (fp32) output rounded once to that dtype, and the
    gradients from grads in that dtype are those of the fp32 outputs given the same grads widened
    (what attention's autocast cast and its backward do). Bitwise, in both tilings and layouts."""
    unsqueeze_dim = 1 if layout == "shared" else 2
    shape_q, shape_k = ((2, 4, 5, 16), (2, 2, 5, 16)) if unsqueeze_dim == 1 else ((2, 5, 4, 16), (2, 5, 2, 16))
    q = randn(*shape_q, dtype=out_dtype, requires_grad=True)
    k = randn(*shape_k, dtype=out_dtype, requires_grad=True)
    cos, sin = (randn(5, 12), randn(5, 12)) if layout == "shared" else (randn(2, 5, 12), randn(2, 5, 12))
    promoted = rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    assert all(t.dtype == torch.float32 for t in promoted)
    g = (randn(*shape_q, dtype=out_dtype), randn(*shape_k, dtype=out_dtype))
    want_grads = torch.autograd.grad(promoted, (q, k), tuple(t.float() for t in g))
    for asked in (out_dtype, (out_dtype, None), (None, out_dtype)):
        dtypes = asked if isinstance(asked, tuple) else (asked, asked)
        narrow = rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, output_dtype=asked)
        registered = torch.ops.tigon.rope(q, k, cos, sin, unsqueeze_dim, *dtypes)
        for got, op_got, want, dtype in zip(narrow, registered, promoted, dtypes, strict=True):
            dtype = dtype or torch.float32
            assert got.dtype == dtype and torch.equal(got, want.to(dtype)) and torch.equal(op_got, got)
        grads_in = tuple(t if dtype else t.float() for t, dtype in zip(g, dtypes, strict=True))
        got_grads = torch.autograd.grad(narrow, (q, k), grads_in)
        assert all(a.dtype == out_dtype and torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))


def test_rope_output_dtype_bad():
    q, k, cos = randn(1, 2, 3, 8), randn(1, 2, 3, 8), randn(3, 8)
    for bad in (torch.int32, "bfloat16", (torch.bfloat16, torch.int64), (torch.bfloat16,) * 3):
        with pytest.raises(TypeError, match="output_dtype must be None, a floating torch.dtype or a pair"):
            rope(q, k, cos, cos, output_dtype=bad)


def test_rope_no_grad_to_cos_sin():
    q, k = randn(1, 2, 3, 8, requires_grad=True), randn(1, 2, 3, 8, requires_grad=True)
    cos, sin = randn(3, 8, requires_grad=True), randn(3, 8, requires_grad=True)
    q_out, k_out = rope(q, k, cos, sin)
    (q_out.sum() + k_out.sum()).backward()
    assert cos.grad is None and sin.grad is None and q.grad is not None


def test_rope_empty_batch():
    q, k = randn(0, 2, 3, 8, requires_grad=True), randn(0, 1, 3, 8, requires_grad=True)
    q_out, k_out = rope(q, k, randn(3, 8), randn(3, 8))
    assert q_out.shape == (0, 2, 3, 8) and k_out.shape == (0, 1, 3, 8)


def _bad(q_shape=(2, 4, 5, 16), k_shape=(2, 2, 5, 16), cos_shape=(2, 5, 16), sin_shape=None, **kw):
    q, k = randn(*q_shape), randn(*k_shape)
    cos, sin = randn(*cos_shape), randn(*(sin_shape or cos_shape))
    return (q, k, cos, sin), kw


@pytest.mark.parametrize(
    "args,error,match",
    [
        (_bad(cos_shape=(2, 5, 15)), ValueError, "must be even"),
        (_bad(cos_shape=(2, 5, 18)), ValueError, "must be even and in"),
        (_bad(cos_shape=(2, 6, 16)), ValueError, "cos has shape"),
        (_bad(cos_shape=(3, 5, 16)), ValueError, "cos has shape"),
        (_bad(cos_shape=(5,)), ValueError, "cos must be"),
        (_bad(cos_shape=(1, 2, 5, 16)), ValueError, "cos must be"),
        (_bad(sin_shape=(2, 5, 8)), ValueError, "sin has shape"),
        (_bad(k_shape=(2, 2, 5, 8)), ValueError, "k has shape"),
        (_bad(k_shape=(1, 2, 5, 16)), ValueError, "k has shape"),
        (_bad(q_shape=(4, 5, 16), k_shape=(2, 5, 16)), ValueError, "q must be 4-D"),
        (_bad(unsqueeze_dim=3), ValueError, "unsqueeze_dim"),
        (_bad(unsqueeze_dim=True), TypeError, "unsqueeze_dim"),
        (_bad(unsqueeze_dim="1"), TypeError, "unsqueeze_dim"),
        (_bad(k_shape=(2, 4, 2, 16), unsqueeze_dim=2), ValueError, "cos has shape"),
    ],
)
def test_rope_bad_shapes(args, error, match):
    (q, k, cos, sin), kw = args
    before = [t.clone() for t in (q, k, cos, sin)]
    with pytest.raises(error, match=match):
        rope(q, k, cos, sin, **kw)
    assert all(torch.equal(t, b) for t, b in zip((q, k, cos, sin), before, strict=True))


def test_rope_bad_types():
    q, k, cos = randn(1, 2, 3, 8), randn(1, 2, 3, 8), randn(3, 8)
    with pytest.raises(TypeError, match="q has dtype"):
        rope(q.to(torch.int32), k, cos, cos)
    with pytest.raises(TypeError, match="sin has dtype"):
        rope(q, k, cos, cos.double())
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        rope(q, k.tolist(), cos, cos)
    with pytest.raises(ValueError, match="cos is on meta"):
        rope(q, k, torch.empty(3, 8, device="meta"), cos)


@pytest.mark.gpu
@pytest.mark.parametrize("output_dtype", (None, torch.bfloat16), ids=("promoted", "bf16_output"))
@pytest.mark.parametrize("unsqueeze_dim", (1, 2))
def test_rope_torch_compile_fullgraph(unsqueeze_dim, tiling, output_dtype):
    batch, seq_len, hq, hk, head_dim = 2, 128, 8, 2, 128
    x_q = randn(batch, seq_len, hq * head_dim, dtype=torch.bfloat16, requires_grad=True)
    x_k = randn(batch, seq_len, hk * head_dim, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = randn(batch, seq_len, head_dim), randn(batch, seq_len, head_dim)

    def f(x_q, x_k):
        q = x_q.view(batch, seq_len, hq, head_dim)
        k = x_k.view(batch, seq_len, hk, head_dim)
        if unsqueeze_dim == 1:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        q_out, k_out = rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, output_dtype=output_dtype)
        return q_out.float().square().sum() + k_out.float().sum()

    cfg = rope_mod.rope_launch(seq_len, hq, hk, head_dim, head_dim, True)
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
def test_rope_int64_offsets(tiling):
    """q past 2**31 elements: the last positions of the last heads are rotated right."""
    head_dim, hq, hk = 128, 32, 8
    seq_len = 2**31 // (hq * head_dim) + 64
    q = torch.randn(1, hq, seq_len, head_dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, hk, seq_len, head_dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    cos = torch.randn(seq_len, head_dim, device=DEVICE, dtype=torch.bfloat16)
    sin = torch.randn(seq_len, head_dim, device=DEVICE, dtype=torch.bfloat16)
    assert launch_of(q, k, cos).token_tiling == (tiling == "token")
    q_out, k_out = rope(q, k, cos, sin)
    tail = slice(seq_len - 64, seq_len)
    q_tail, k_tail = q[:, :, tail].detach().double(), k[:, :, tail].detach().double()
    ref_q, ref_k = rope_reference(q_tail, k_tail, cos[tail].double(), sin[tail].double())
    assert_close(q_out[:, :, tail], ref_q, torch.bfloat16, "q_out tail")
    assert_close(k_out[:, :, tail], ref_k, torch.bfloat16, "k_out tail")
    dq_out = q_out.detach()
    dq, _ = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, torch.zeros_like(k_out)))
    qt = q[:, :, tail].detach().double().requires_grad_()
    ref_q, _ = rope_reference(qt, k[:, :, tail].detach().double(), cos[tail].double(), sin[tail].double())
    (ref_dq,) = torch.autograd.grad(ref_q, qt, dq_out[:, :, tail].double())
    assert_close(dq[:, :, tail], ref_dq, torch.bfloat16, "dq tail")


@pytest.mark.skipif(ON_GPU, reason="on a GPU, CPU tensors are simply the wrong device")
def test_rope_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA tensors"):
        rope(randn(1, 2, 3, 8), randn(1, 2, 3, 8), randn(3, 8), randn(3, 8))
