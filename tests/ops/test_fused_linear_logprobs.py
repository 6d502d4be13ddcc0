"""tigon.ops.fused_linear_logprobs / fused_linear_token_stats against float64 references.

The op cuts the vocabulary into class chunks (FusedLinearLogprobsConfig.chunk_classes); tests run
one chunk (the default at these sizes) and several, forced through ``class_chunk`` with blocks of 32
classes so that every row also spans several blocks, the last chunk and block narrower. References
are computed in float64 from the inputs (logits never rounded: the op keeps them in fp32); the
upstream gradients of both outputs are random per token unless a test says otherwise.
"""

import math

import pytest
import torch

from tests.helpers import (
    DEVICE,
    DTYPES,
    TOLERANCE,
    assert_close,
    fp64_reference,
    noncontiguous,
    randn,
    rel_err,
    stride0_like,
)
from tigon.ops import fused_linear_logprobs, fused_linear_token_stats
from tigon.ops.fused_linear_logprobs import (
    FusedLinearLogprobsConfig,
    TokenStats,
    fused_linear_logprobs_reference,
)

ONE_CHUNK = FusedLinearLogprobsConfig()
# 3 chunks at V = 257 (128, 128, 1) or 8 at V = 1000, rows in blocks of 32
CHUNKS = FusedLinearLogprobsConfig(class_chunk=128, block_v=32)
CONFIGS = {"one_chunk": ONE_CHUNK, "chunks": CHUNKS}
# 8 chunks at V = 1000 in one block a row (quicker under the interpreter)
WIDE_BLOCKS = FusedLinearLogprobsConfig(class_chunk=128, block_v=128)
ALL_OPTIONS = dict(temperature=0.7, softcap=4.0, logit_scale=1.3)
# The tile kernel (_kernels/logprob_tiles.py), wherever the operands allow it (bf16/fp16, H·2 a multiple of 16),
# with small tiles: several row and class tiles a chunk, several chunks (at V = 300: 3 of 128 classes,
# 4 class tiles each, the last chunk 44 wide: one full tile and one of 12 classes)
TILES = FusedLinearLogprobsConfig(tiles=True, class_chunk=128, tile_m=16, tile_n=32, tile_k=16)
# one chunk of every class tile (19 at V = 300): the combine folds its partials 16 tiles at a time, the last
# block short
TILES_ONE_CHUNK = FusedLinearLogprobsConfig(tiles=True, tile_m=16, tile_n=16, tile_k=16)
TILE_DTYPES = (torch.bfloat16, torch.float16)
# the epilogue on two halves of each tile (16 classes each), merged before the partials are stored
TILES_SPLIT = FusedLinearLogprobsConfig(tiles=True, class_chunk=128, tile_m=16, tile_n=32, tile_k=16,
                                        tile_epilogue_split=2)


def make_inputs(tokens_shape, hidden, vocab, dtype, *, bias=False, scale=2.0):
    x = randn(*tokens_shape, hidden, dtype=dtype, requires_grad=True)
    w = randn(vocab, hidden, scale=hidden**-0.5 * scale, dtype=dtype, requires_grad=True)
    b = randn(vocab, dtype=dtype, requires_grad=True) if bias else None
    return x, w, b


def make_target(shape, vocab, *, ignored=1):
    target = torch.randint(0, vocab, shape, device=DEVICE)
    target.view(-1)[:ignored] = -100
    target.view(-1)[-1] = vocab - 1  # the last class: in the last, narrowest chunk
    return target


def check(x, w, target, b=None, *, config=ONE_CHUNK, grads=("lp", "ent"), io_dtype=None, **options):
    """Outputs and gradients of (logprobs, entropy) against the fp64 reference; returns the outputs."""
    io_dtype = io_dtype or x.dtype
    entropy = options.pop("entropy", True)
    lp, ent = fused_linear_logprobs(x, w, target, linear_bias=b, entropy=entropy, config=config, **options)
    tensors = {"input": x, "linear_weight": w, "linear_bias": b}
    g_lp = randn(*target.shape) if "lp" in grads else None
    g_ent = randn(*target.shape) if "ent" in grads and entropy else None
    ref, ref_grads = fp64_reference(
        fused_linear_logprobs_reference, tensors,
        tuple(g if g is not None else torch.zeros(target.shape, device=DEVICE) for g in (g_lp, g_ent)),
        target=target, entropy=entropy, **options,
    )
    assert lp.dtype == torch.float32 and lp.shape == target.shape
    assert_close(lp, ref[0], io_dtype, "logprobs")
    if entropy:
        assert ent.dtype == torch.float32 and ent.shape == target.shape
        assert_close(ent, ref[1], io_dtype, "entropy")
    else:
        assert ent is None
    pairs = [(o, g) for o, g in ((lp, g_lp), (ent, g_ent)) if g is not None]
    leaves = [(n, t) for n, t in tensors.items() if t is not None and t.requires_grad]
    if pairs and leaves:
        computed = torch.autograd.grad([o for o, _ in pairs], [t for _, t in leaves], [g for _, g in pairs])
        for (name, t), grad in zip(leaves, computed, strict=True):
            assert grad.dtype == t.dtype and grad.shape == t.shape, name
            assert_close(grad, ref_grads[name], io_dtype, f"d{name}")
    return lp, ent


# ------------------------------------------------------------------------------------ outputs, grads


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_options_every_dtype(dtype, config):
    """Odd sizes (H = 33, V = 257: three chunks, the last one class wide), bias, every transform."""
    x, w, b = make_inputs((9,), 33, 257, dtype, bias=True)
    check(x, w, make_target((9,), 257, ignored=2), b, config=CONFIGS[config], **ALL_OPTIONS)


@pytest.mark.parametrize(
    "options",
    (dict(), dict(temperature=2.5), dict(softcap=3.0), dict(logit_scale=0.25), dict(logit_scale=-1.5),
     dict(softcap=2.0, logit_scale=-0.8), dict(entropy=False), dict(bias=True)),
    ids=("plain", "temperature", "softcap", "logit_scale", "negative_scale", "softcap_negative_scale",
         "no_entropy", "bias"),
)
def test_each_option(options):
    options = dict(options)
    x, w, b = make_inputs((5,), 72, 1000, torch.float32, bias=options.pop("bias", False), scale=6.0)
    check(x, w, make_target((5,), 1000, ignored=1), b, config=WIDE_BLOCKS, **options)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("grads", (("lp",), ("ent",)), ids=("logprob_grad_only", "entropy_grad_only"))
def test_one_output_gradient(grads, dtype):
    """Only one of the outputs is differentiated (the other's gradient is None in the backward)."""
    x, w, b = make_inputs((7,), 40, 300, dtype, bias=True)
    check(x, w, make_target((7,), 300), b, config=CHUNKS, grads=grads, softcap=5.0)


def test_entropy_of_peaked_logits():
    """Large logits (tens): the entropy, carried relative to the running max, keeps its relative accuracy."""
    x, w, _ = make_inputs((6,), 32, 300, torch.float32, scale=60.0)
    _, ent = check(x, w, make_target((6,), 300, ignored=0), config=CHUNKS)
    assert ent.abs().min() < 1.0  # some rows nearly one-hot


# --------------------------------------------------------------------------------- the tile kernel


def test_tiles_taken_where_the_operands_allow():
    """The tests below must run the tile kernel: bf16/fp16 with H·2 a multiple of 16; fp32, or an H
    whose rows TMA cannot address (33·2 bytes), keep the cuBLAS path (and still give the right answer)."""
    from tigon._kernels import tiles_available

    for dtype in TILE_DTYPES:
        x, w, _ = make_inputs((3,), 40, 100, dtype)
        assert tiles_available(x.detach(), w.detach(), True)
        assert not tiles_available(x.detach(), w.detach(), False)
        hopper = DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE)[0] >= 9
        assert tiles_available(x.detach(), w.detach(), None) == hopper  # the default: GPUs with TMA
        x, w, _ = make_inputs((3,), 33, 100, dtype)
        assert not tiles_available(x.detach(), w.detach(), True)
    x, w, _ = make_inputs((3,), 40, 100, torch.float32)
    assert not tiles_available(x.detach(), w.detach(), True)
    x, w, b = make_inputs((9,), 33, 257, torch.bfloat16, bias=True)
    check(x, w, make_target((9,), 257, ignored=2), b, config=TILES, **ALL_OPTIONS)


TILE_OPTIONS = {"plain": dict(), "all": ALL_OPTIONS, "softcap_negative_scale": dict(softcap=2.0, logit_scale=-0.8),
                "no_entropy": dict(temperature=2.5, entropy=False)}
# Every option set in bf16; fp16, which differs only in the dtype its tiles load and store (each load upcast to
# fp32), with every option at once.
TILE_CASES = [(name, dtype) for name in TILE_OPTIONS for dtype in TILE_DTYPES
              if dtype == torch.bfloat16 or name == "all"]


@pytest.mark.parametrize("config", ("chunks", "one_chunk", "split"))
@pytest.mark.parametrize("options,dtype", TILE_CASES, ids=[f"{name}-{dtype}" for name, dtype in TILE_CASES])
def test_tiles_every_option(options, dtype, config):
    """37 tokens (three row tiles, the last one short), V = 300 (odd chunks and tiles), bias."""
    options = TILE_OPTIONS[options]
    config = {"chunks": TILES, "one_chunk": TILES_ONE_CHUNK, "split": TILES_SPLIT}[config]
    x, w, b = make_inputs((37,), 40, 300, dtype, bias=True, scale=4.0)
    check(x, w, make_target((37,), 300, ignored=3), b, config=config, **dict(options))


@pytest.mark.parametrize("grads", (("lp",), ("ent",)), ids=("logprob_grad_only", "entropy_grad_only"))
def test_tiles_one_output_gradient(grads):
    x, w, b = make_inputs((7,), 48, 300, torch.bfloat16, bias=True)
    check(x, w, make_target((7,), 300), b, config=TILES, grads=grads, softcap=5.0)


def test_tiles_noncontiguous_input_stride0_grads_and_autocast():
    """A stride-2 input (made contiguous for TMA) with stride-0 upstream gradients; then fp32 master
    weights under autocast (cast to bf16, gradients back in fp32)."""
    x, w, b = make_inputs((2, 3), 40, 257, torch.bfloat16, bias=True)
    x_nc = noncontiguous(x)
    target = make_target((3, 2), 257).t()
    lp, ent = fused_linear_logprobs(x_nc, w, target, linear_bias=b, entropy=True, config=TILES, softcap=3.0)
    g_lp, g_ent = stride0_like(lp), stride0_like(ent)
    grads = torch.autograd.grad((lp, ent), (x_nc, w, b), (g_lp, g_ent))
    ref, ref_grads = fp64_reference(
        fused_linear_logprobs_reference, {"input": x, "linear_weight": w, "linear_bias": b}, (g_lp, g_ent),
        target=target, entropy=True, softcap=3.0,
    )
    assert_close(lp, ref[0], torch.bfloat16, "logprobs")
    assert_close(ent, ref[1], torch.bfloat16, "entropy")
    for name, g in zip(("input", "linear_weight", "linear_bias"), grads, strict=True):
        assert_close(g, ref_grads[name], torch.bfloat16, f"d{name}")

    x, w, b = make_inputs((6,), 24, 300, torch.float32, bias=True)
    target = make_target((6,), 300)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        lp, ent = fused_linear_logprobs(x, w, target, linear_bias=b, entropy=True, config=TILES)
    g = (randn(6), randn(6))
    grads = torch.autograd.grad((lp, ent), (x, w, b), g)
    rounded = {n: t.detach().to(torch.bfloat16).requires_grad_() for n, t in
               (("input", x), ("linear_weight", w), ("linear_bias", b))}
    ref, ref_grads = fp64_reference(fused_linear_logprobs_reference, rounded, g, target=target, entropy=True)
    assert_close(lp, ref[0], torch.bfloat16, "logprobs")
    for name, grad in zip(rounded, grads, strict=True):
        assert grad.dtype == torch.float32
        assert_close(grad, ref_grads[name], torch.bfloat16, f"d{name}")


def test_tiles_logits_not_rounded_and_ignored_rows():
    """Logits 64.25 and 64 from bf16 operands: the fp32 accumulator feeds the epilogue unrounded. Then
    ignored rows (a custom index): zero outputs and gradients, all rows ignored included."""
    x = torch.ones(1, 8, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(2, 8, dtype=torch.bfloat16, device=DEVICE)
    w[:, 0], w[0, 1] = 64.0, 0.25
    lp, _ = fused_linear_logprobs(x, w, torch.tensor([0], device=DEVICE), config=TILES)
    assert abs(lp.item() + math.log1p(math.exp(-0.25))) < 1e-5
    x, w, _ = make_inputs((6,), 16, 300, torch.bfloat16)
    target = torch.randint(0, 300, (6,), device=DEVICE)
    target[[1, 4]] = -7
    stats = fused_linear_token_stats(x, w, target, ignore_index=-7, entropy=True, extras=True, config=TILES)
    for out in stats:
        assert not out[[1, 4]].any()
    dx, = torch.autograd.grad(stats.logprobs.sum() + stats.entropy.sum(), x)
    assert not dx[[1, 4]].any() and dx[[0, 2, 3, 5]].float().abs().sum(-1).min() > 0
    target[:] = -7
    lp, ent = fused_linear_logprobs(x, w, target, ignore_index=-7, entropy=True, config=TILES)
    assert not lp.any() and not ent.any()
    dx, dw = torch.autograd.grad(lp.sum() + ent.sum(), (x, w))
    assert not dx.any() and not dw.any()


def test_tiles_chunked_by_the_workspace():
    """A workspace small enough that the planner itself (no class_chunk) cuts the forward's partials into
    4 chunks and the backward's gradient into 32, every width an integer multiple of class_align."""
    config = FusedLinearLogprobsConfig(tiles=True, workspace_bytes=4096, max_workspace_bytes=4096, class_align=32,
                                       tile_m=16, tile_n=32, tile_k=16)
    assert config.tile_chunks(37, 1000, 2, 0, 3) == (256, 32)
    x, w, b = make_inputs((37,), 40, 1000, torch.bfloat16, bias=True)
    check(x, w, make_target((37,), 1000, ignored=3), b, config=config, **ALL_OPTIONS)


def test_tiles_out_of_range_target_is_nan_before_the_error():
    """The kernels leave a target outside [0, V) NaN (z_t never written); eager mode then raises."""
    x, w, _ = make_inputs((4,), 16, 100, torch.bfloat16)
    target = torch.tensor([1, 2, 100, 3], device=DEVICE)
    with pytest.raises(ValueError, match="target"):
        fused_linear_logprobs(x, w, target, config=TILES)


def test_tile_chunks():
    """Equal chunks of whole 512-class tiles: the forward's partials and the backward's gradient twin
    each within the workspace."""
    config = FusedLinearLogprobsConfig()
    weight = 151936 * 4096 * 2
    forward, backward = config.tile_chunks(8192, 151936, 2, weight, 6)
    assert forward == 151936  # 6 partials per 256 classes: 117 MB, one chunk
    assert backward % 512 == 0 and backward * 8192 * 2 <= config.max_workspace_bytes
    assert -(-151936 // backward) == 3 and 3 * backward - 151936 < 3 * 512
    assert config.tile_chunks(6, 300, 2, 1000, 2) == (300, 300)
    # a long sequence: several forward chunks too (integers: they are range() steps)
    forward, backward = config.tile_chunks(10**6, 151936, 2, weight, 6)
    assert (forward, backward) == (11264, 512) and all(type(c) is int for c in (forward, backward))
    assert 6 * 4 * -(-forward // 256) * 10**6 <= config.max_workspace_bytes
    assert FusedLinearLogprobsConfig(class_chunk=128).tile_chunks(8192, 151936, 2, weight, 6) == (128, 128)


# ------------------------------------------------------------------------------------- TRL's metrics


def trl_token_stats_fp64(x, w, b, target, *, temperature=1.0, softcap=None, logit_scale=1.0, ignore_index=-100):
    """TRL 1.16's definitions (FusedCausalLMOutput), written from the full logits in float64."""
    z = torch.nn.functional.linear(x.double(), w.double(), b.double() if b is not None else None) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = torch.log_softmax(z, -1)
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    lp = log_p.gather(-1, safe[..., None])[..., 0] * valid
    ent = -(log_p.exp() * log_p).sum(-1) * valid
    log_sum_sq = torch.logsumexp(2 * log_p, -1) * valid
    mean = z.mean(-1) * valid
    top1 = (z.argmax(-1) == target) & valid
    return lp, ent, log_sum_sq, mean, top1


@pytest.mark.parametrize("config", (*CONFIGS, "tiles", "tiles_split"), ids=str)
@pytest.mark.parametrize("options", (dict(), ALL_OPTIONS), ids=("plain", "all"))
def test_extras_match_trl_definitions(options, config):
    """log Σ p², the mean scaled logit and argmax == target, with ties: a class duplicated after the
    target's is still top-1 (torch.argmax takes the first maximum), one duplicated before is not.
    The tile kernel in bf16 (its operands; the references from the same bf16 values)."""
    tokens, hidden, vocab = 10, 24, 300
    dtype = torch.bfloat16 if config.startswith("tiles") else torch.float32
    config = {"tiles": TILES, "tiles_split": TILES_SPLIT}.get(config) or CONFIGS[config]
    x, w, b = make_inputs((tokens,), hidden, vocab, dtype, bias=True, scale=4.0)
    with torch.no_grad():
        logits = x.float() @ w.float().t() + b.float()
        target = logits.argmax(-1)                 # every row top-1 ...
        target[3] = logits[3].argsort()[-2]        # ... but these two
        target[4] = 0
        target[0] = -100
        # rows 5, 6: the target's class has a twin (same weights and bias) after it / before it, the
        # row along their weights (logits ≈ 16, the other classes' below ≈ 10: no softcap saturation)
        for row, (first, second) in ((5, (10, 250)), (6, (20, 260))):
            w[second] = w[first]
            b[second] = b[first]
            x[row] = w[first]
        target[5], target[6] = 10, 260
    stats = fused_linear_token_stats(x, w, target, linear_bias=b, entropy=True, extras=True,
                                     config=config, **options)
    assert isinstance(stats, TokenStats)
    ref = trl_token_stats_fp64(x, w, b, target, **options)
    for name, out, expected in zip(TokenStats._fields, stats, ref, strict=True):
        if name == "is_top1":
            assert out.dtype == torch.bool and torch.equal(out, expected), (out, expected)
        else:
            assert out.dtype == torch.float32
            assert_close(out, expected, torch.float32, name)
    assert stats.is_top1[5] and not stats.is_top1[6] and not stats.is_top1[3]
    for extra in stats[2:]:
        assert not extra.requires_grad
    # the extras change nothing in the differentiable outputs: bit for bit in the row kernels; the tile
    # kernel with and without them is two compilations of its epilogue, whose fp32 arithmetic the
    # compiler may contract into FMAs differently (measured on the H100: differences of an ulp or so)
    plain = fused_linear_token_stats(x, w, target, linear_bias=b, entropy=True, config=config, **options)
    assert plain.log_sum_sq_probs is None and plain.mean_logits is None and plain.is_top1 is None
    if config.tiles:
        for a, e in ((plain.logprobs, stats.logprobs), (plain.entropy, stats.entropy)):
            torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(plain.logprobs, stats.logprobs) and torch.equal(plain.entropy, stats.entropy)


def test_extras_match_trl_kernel():
    """The same per-token fields as TRL's own ChunkedLogProbFunction (its torch path on a CPU, fp32)."""
    trl_kernels = pytest.importorskip("trl.kernels.chunked_logprob")
    x, w, b = make_inputs((12,), 24, 300, torch.float32, bias=True)
    target = torch.randint(0, 300, (12,), device=DEVICE)
    options = dict(temperature=0.8, softcap=6.0, logit_scale=1.2)
    theirs = trl_kernels.ChunkedLogProbFunction.apply(
        x, w, b, target, options["temperature"], 128, options["softcap"], options["logit_scale"],
        trl_kernels.OPTIONAL_OUTPUTS,
    )
    ours = fused_linear_token_stats(x, w, target, linear_bias=b, entropy=True, extras=True, config=CHUNKS, **options)
    for name, out, expected in zip(TokenStats._fields, ours, theirs, strict=True):
        if name == "is_top1":
            assert torch.equal(out, expected), name
        else:
            assert_close(out, expected.detach(), torch.float32, name)


# ------------------------------------------------------------------------------ ignored, layouts


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_ignored_rows_zero_output_zero_grad(config):
    x, w, _ = make_inputs((6,), 16, 300, torch.float32)
    target = torch.randint(0, 300, (6,), device=DEVICE)
    target[[1, 4]] = -7
    stats = fused_linear_token_stats(x, w, target, ignore_index=-7, entropy=True, extras=True, config=CONFIGS[config])
    for out in stats:
        assert not out[[1, 4]].any()
    dx, = torch.autograd.grad(stats.logprobs.sum() + stats.entropy.sum(), x)
    assert not dx[[1, 4]].any() and dx[[0, 2, 3, 5]].abs().sum(-1).min() > 0
    # all ignored: zeros, with zero gradients
    target[:] = -7
    lp, ent = fused_linear_logprobs(x, w, target, ignore_index=-7, entropy=True, config=CONFIGS[config])
    assert not lp.any() and not ent.any()
    dx, dw = torch.autograd.grad(lp.sum() + ent.sum(), (x, w))
    assert not dx.any() and not dw.any()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_leading_dims_noncontiguous_and_stride0_grads(dtype):
    """input [2, 3, H] with a stride-2 hidden dim, target transposed, upstream gradients of .sum()."""
    x, w, b = make_inputs((2, 3), 20, 257, dtype, bias=True)
    x_nc = noncontiguous(x)
    target = make_target((3, 2), 257).t()
    assert not target.is_contiguous()
    lp, ent = fused_linear_logprobs(x_nc, w, target, linear_bias=b, entropy=True, config=CHUNKS, softcap=3.0)
    g_lp, g_ent = stride0_like(lp), stride0_like(ent)
    grads = torch.autograd.grad((lp, ent), (x_nc, w, b), (g_lp, g_ent))
    ref, ref_grads = fp64_reference(
        fused_linear_logprobs_reference, {"input": x, "linear_weight": w, "linear_bias": b}, (g_lp, g_ent),
        target=target, entropy=True, softcap=3.0,
    )
    assert lp.shape == (2, 3)
    assert_close(lp, ref[0], dtype, "logprobs")
    assert_close(ent, ref[1], dtype, "entropy")
    for name, g in zip(("input", "linear_weight", "linear_bias"), grads, strict=True):
        assert_close(g, ref_grads[name], dtype, f"d{name}")


def test_int32_target_and_one_token():
    x, w, _ = make_inputs((1,), 8, 50, torch.float32)
    check(x, w, torch.tensor([7], dtype=torch.int32, device=DEVICE))


def test_no_tokens():
    x, w, _ = make_inputs((0,), 8, 50, torch.float32)
    lp, ent = fused_linear_logprobs(x, w, torch.zeros(0, dtype=torch.long, device=DEVICE), entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    dx, dw = torch.autograd.grad(lp.sum() + ent.sum(), (x, w))
    assert dx.shape == (0, 8) and not dw.any()


def test_autocast_bf16():
    """fp32 input and weights under CPU/GPU autocast: operands cast to bf16 as F.linear casts them,
    logits in fp32, gradients back in fp32."""
    x, w, b = make_inputs((6,), 24, 300, torch.float32, bias=True)
    target = make_target((6,), 300)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        lp, ent = fused_linear_logprobs(x, w, target, linear_bias=b, entropy=True, config=CHUNKS)
    g = (randn(6), randn(6))
    grads = torch.autograd.grad((lp, ent), (x, w, b), g)
    rounded = {n: t.detach().to(torch.bfloat16).requires_grad_() for n, t in
               (("input", x), ("linear_weight", w), ("linear_bias", b))}
    ref, ref_grads = fp64_reference(fused_linear_logprobs_reference, rounded, g, target=target, entropy=True)
    assert_close(lp, ref[0], torch.bfloat16, "logprobs")
    assert_close(ent, ref[1], torch.bfloat16, "entropy")
    for name, grad in zip(rounded, grads, strict=True):
        assert grad.dtype == torch.float32
        assert_close(grad, ref_grads[name], torch.bfloat16, f"d{name}")


def test_logits_not_rounded_to_input_dtype():
    """bf16 inputs whose logits differ below bf16's resolution: the log-probs see the difference
    (they would not if the logits were rounded to bf16 before the softmax)."""
    x = torch.ones(1, 2, dtype=torch.bfloat16, device=DEVICE)
    w = torch.tensor([[64.0, 0.25], [64.0, 0.0]], dtype=torch.bfloat16, device=DEVICE)  # logits 64.25, 64
    lp, _ = fused_linear_logprobs(x, w, torch.tensor([0], device=DEVICE))
    expected = -math.log1p(math.exp(-0.25))
    assert abs(lp.item() - expected) < 1e-5, (lp.item(), expected)


def test_no_grad_forward():
    x, w, _ = make_inputs((5,), 16, 100, torch.float32)
    target = make_target((5,), 100)
    with torch.no_grad():
        lp, ent = fused_linear_logprobs(x, w, target, entropy=True)
    assert lp.grad_fn is None and ent.grad_fn is None
    ref = fused_linear_logprobs_reference(x.detach(), w.detach(), target, entropy=True)
    assert_close(lp, ref[0], torch.float32) and assert_close(ent, ref[1], torch.float32)
    lp, ent = fused_linear_logprobs(x, w, target)
    assert ent is None and lp.requires_grad


def test_chunk_classes():
    """The default budget: fp32 logits plus their bf16 gradient twin in twice the weight's bytes, within
    [256 MiB, 1 GiB], whole 512-class tiles."""
    config = FusedLinearLogprobsConfig()
    chunk = config.chunk_classes(8192, 151936, 2)
    assert chunk % 512 == 0 and chunk * 8192 * 6 <= config.workspace_bytes
    assert config.chunk_classes(6, 300, 2) == 300
    assert config.chunk_classes(10**6, 151936, 2) == 512
    assert CHUNKS.chunk_classes(8192, 257, 2) == 128
    # Qwen2.5-0.5B's bf16 head (272 MB): a 544 MB workspace; an H = 4096 one: capped at 1 GiB
    qwen = config.chunk_classes(8192, 151936, 2, 151936 * 896 * 2)
    assert qwen == 10752 and qwen * 8192 * 6 <= 2 * 151936 * 896 * 2 < (qwen + 512) * 8192 * 6
    wide = config.chunk_classes(8192, 151936, 2, 151936 * 4096 * 2)
    assert wide == 21504 and wide * 8192 * 6 <= config.max_workspace_bytes < (wide + 512) * 8192 * 6
    assert config.chunk_classes(8192, 151936, 2, 1000) == chunk  # a small weight: the 256 MiB floor


# -------------------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_naming_the_argument():
    x, w, b = make_inputs((4,), 16, 50, torch.float32, bias=True)
    target = make_target((4,), 50, ignored=0)
    before = (x.detach().clone(), w.detach().clone(), target.clone())
    cases = [
        (dict(linear_weight=w[:, :8]), ValueError, "linear_weight"),
        (dict(linear_bias=b[:10]), ValueError, "linear_bias"),
        (dict(target=target[:3]), ValueError, "target"),
        (dict(target=target.float()), TypeError, "target"),
        (dict(input=x.double()), TypeError, "input"),
        (dict(linear_weight=w.to(torch.bfloat16)), TypeError, "linear_weight"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature="1"), TypeError, "temperature"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(logit_scale=float("nan")), ValueError, "logit_scale"),
        (dict(ignore_index=1.5), TypeError, "ignore_index"),
        (dict(entropy=1), TypeError, "entropy"),
        (dict(input=[1.0]), TypeError, "input"),
    ]
    for override, error, name in cases:
        args = dict(input=x, linear_weight=w, target=target)
        args.update({k: v for k, v in override.items() if k in args})
        kwargs = {k: v for k, v in override.items() if k not in args}
        with pytest.raises(error, match=name):
            fused_linear_logprobs(args["input"], args["linear_weight"], args["target"], **kwargs)
    bad = target.clone()
    bad[2] = 50
    with pytest.raises(ValueError, match="target"):
        fused_linear_logprobs(x, w, bad)
    with pytest.raises(TypeError, match="extras"):
        fused_linear_token_stats(x, w, target, extras="yes")
    assert all(torch.equal(a, c) for a, c in zip(before, (x, w, target), strict=True))


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    x, w, b = make_inputs((4, 256), 512, 32000, torch.bfloat16, bias=True)
    target = make_target((4, 256), 32000, ignored=9)

    def f(x, w, b, t):
        stats = fused_linear_token_stats(x * 1.0, w, t, linear_bias=b, entropy=True, extras=True, **ALL_OPTIONS)
        return stats.logprobs, stats.entropy, stats.log_sum_sq_probs, stats.mean_logits, stats.is_top1

    compiled = torch.compile(f, fullgraph=True)
    out = compiled(x, w, b, target)
    ref = f(x, w, b, target)
    g = (randn(4, 256), randn(4, 256))
    grads = torch.autograd.grad(out[:2], (x, w, b), g)
    ref_grads = torch.autograd.grad(ref[:2], (x, w, b), g)
    for name, o, r in zip(TokenStats._fields, out, ref, strict=True):
        if o.dtype == torch.bool:
            assert (o != r).float().mean() < 1e-3, name
        else:
            assert_close(o, r, torch.float32, name)
    for name, gc, gr in zip(("dx", "dw", "db"), grads, ref_grads, strict=True):
        assert_close(gc, gr, torch.bfloat16, name)


@pytest.mark.gpu
def test_out_of_range_target_is_nan_under_compile():
    x, w, _ = make_inputs((64,), 256, 1000, torch.bfloat16)
    target = make_target((64,), 1000, ignored=0)
    target[7] = 5000
    lp, ent = torch.compile(lambda x, w, t: fused_linear_logprobs(x, w, t, entropy=True), fullgraph=True)(x, w, target)
    assert torch.isnan(lp[7]) and torch.isnan(ent[7]) and torch.isfinite(lp[8:]).all()


@pytest.mark.gpu
@pytest.mark.bigmem
def test_more_than_2_31_logits():
    """N·V = 16384 · 151936 > 2^31 in bf16 (int64 offsets): a few rows and the gradients' norms
    against a chunked float32 torch reference."""
    tokens, hidden, vocab = 16384, 256, 151936
    x = randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = randn(vocab, hidden, scale=hidden**-0.5 * 2, dtype=torch.bfloat16, requires_grad=True)
    target = make_target((tokens,), vocab, ignored=64)
    lp, ent = fused_linear_logprobs(x, w, target, entropy=True)
    g_lp, g_ent = randn(tokens), randn(tokens)
    dx, dw = torch.autograd.grad((lp, ent), (x, w), (g_lp, g_ent))
    ref_dx = torch.zeros(tokens, hidden, dtype=torch.float32, device=DEVICE)
    ref_dw = torch.zeros(vocab, hidden, dtype=torch.float32, device=DEVICE)
    wf = w.detach().float()
    for c0 in range(0, tokens, 2048):
        rows = slice(c0, c0 + 2048)
        xc = x.detach()[rows].float().requires_grad_()
        wc = wf.clone().requires_grad_()
        rlp, rent = fused_linear_logprobs_reference(xc, wc, target[rows], entropy=True)
        gx, gw = torch.autograd.grad((rlp, rent), (xc, wc), (g_lp[rows], g_ent[rows]))
        ref_dx[rows] = gx
        ref_dw += gw
        if c0 in (0, tokens - 2048):
            assert_close(lp[rows], rlp, torch.bfloat16, "logprobs")
            assert_close(ent[rows], rent, torch.bfloat16, "entropy")
    assert rel_err(dx, ref_dx) <= TOLERANCE[torch.bfloat16]
    assert rel_err(dw, ref_dw) <= TOLERANCE[torch.bfloat16]
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()


@pytest.mark.gpu
@pytest.mark.bigmem
def test_benchmark_shape_memory_within_trl():
    """Qwen2.5-0.5B's head at N = 8192 (bf16): forward + backward peak beyond inputs and gradients
    under TRL's 256 MiB tile plus its fp32 dX and dW accumulators."""
    tokens, hidden, vocab = 8192, 896, 151936
    x = randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = randn(vocab, hidden, scale=hidden**-0.5, dtype=torch.bfloat16, requires_grad=True)
    target = make_target((tokens,), vocab, ignored=100)
    lp, ent = fused_linear_logprobs(x, w, target, entropy=True)
    torch.autograd.grad((lp.sum(), ent.sum()), (x, w))  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    lp, ent = fused_linear_logprobs(x, w, target, entropy=True)
    dx, dw = torch.autograd.grad((lp.sum(), ent.sum()), (x, w))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start - (dx.numel() + dw.numel()) * 2
    trl = (256 << 20) + (tokens + vocab) * hidden * 4
    assert peak <= trl, f"peak {peak / 2**20:.0f} MiB > TRL's {trl / 2**20:.0f} MiB"
