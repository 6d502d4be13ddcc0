"""tigon.ops.post_norm_join / sandwich_norm_join against the fp64 transformers-equivalent reference.

Sizes: hidden 1 (the exact dx form), 7 and 96 (several rows a tile), 1000 (non-power of two), 4096
(one row a tile) and MAX_FUSED_HIDDEN + 1 (not fused: three ops). The dtypes that matter most are the
mixed ones of autocast training (bf16 x joining an fp32 residual stream, fp32 weights), where the
sum is fp32 and the first norm's gradient is rounded to bf16 on its way back.
"""

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
    repeatable_grads,
    stride0_like,
)
from tigon.ops import post_norm_join, sandwich_norm_join
from tigon.ops.norm_joins import CONFIG, post_norm_join_reference, sandwich_norm_join_reference

MAX_FUSED_HIDDEN = CONFIG.max_fused_hidden

HIDDEN_SIZES = (1, 7, 96, 1000, 4096, MAX_FUSED_HIDDEN + 1)
NAMES = ("x", "residual", "weight", "next_weight")


def _dtypes(x, residual, weight, next_weight=None):
    return {"x": x.dtype, "residual": residual.dtype, "weight": getattr(weight, "dtype", None),
            "next_weight": getattr(next_weight, "dtype", None)}


def check_join(x, residual, weight, next_weight, *, with_next=True, grads=("y", "s"), tolerance_dtype=None,
               eps=1e-6, next_eps=None, offset=0.0, casting="llama", out_dtype=None, y_grad=None, s_grad=None):
    """Run the op, check outputs and every input gradient against the fp64 reference.

    ``grads``: which outputs get a gradient (the others are left out of the backward, as an unused
    output is). ``tolerance_dtype``: the dtype whose tolerance applies (default x's).
    """
    dtype = tolerance_dtype or x.dtype
    tensors = {"x": x, "residual": residual, "weight": weight}
    dtypes = _dtypes(x, residual, weight, next_weight)
    if with_next:
        tensors["next_weight"] = next_weight
        y, s = sandwich_norm_join(
            x, residual, weight, next_weight, eps, next_eps=next_eps, offset=offset, casting=casting,
            out_dtype=out_dtype,
        )
        dy = y_grad if y_grad is not None else randn(*y.shape, dtype=y.dtype)
        ds = s_grad if s_grad is not None else randn(*s.shape, dtype=s.dtype)
        outs, grad_outs = [], []
        if "y" in grads:
            outs.append(y)
            grad_outs.append(dy)
        if "s" in grads:
            outs.append(s)
            grad_outs.append(ds)
        (ref_y, ref_s), _ = fp64_reference(
            sandwich_norm_join_reference, tensors, None, eps=eps, next_eps=next_eps, offset=offset,
            casting=casting, out_dtype=out_dtype, dtypes=dtypes,
        )
        _, ref_grads = fp64_reference(
            sandwich_norm_join_reference, tensors,
            (dy if "y" in grads else torch.zeros_like(dy), ds if "s" in grads else torch.zeros_like(ds)),
            eps=eps, next_eps=next_eps, offset=offset, casting=casting, out_dtype=out_dtype, dtypes=dtypes,
        )
        assert y.dtype == (out_dtype or ref_y_dtype(s.dtype, next_weight, casting))
        assert_close(y, ref_y, dtype, "y")
    else:
        s = post_norm_join(x, residual, weight, eps, offset=offset, casting=casting)
        ds = s_grad if s_grad is not None else randn(*s.shape, dtype=s.dtype)
        outs, grad_outs = [s], [ds]
        ref_s, ref_grads = fp64_reference(
            post_norm_join_reference, tensors, ds, eps=eps, offset=offset, casting=casting, dtypes=dtypes
        )
    n_dtype = ref_y_dtype(x.dtype, weight, casting)
    assert s.dtype == torch.promote_types(residual.dtype, n_dtype)
    assert_close(s, ref_s, dtype, "s")
    names = [n for n, t in tensors.items() if t is not None and t.requires_grad]
    got = torch.autograd.grad(outs, [tensors[n] for n in names], grad_outs, allow_unused=True)
    for name, grad in zip(names, got, strict=True):
        assert grad is not None, name
        assert grad.dtype == tensors[name].dtype, name
        assert_close(grad, ref_grads[name], dtype, f"d{name}")


def ref_y_dtype(x_dtype, weight, casting):
    """A norm's output dtype: llama promotes with the weight, gemma keeps the input's."""
    return torch.promote_types(x_dtype, weight.dtype) if (casting == "llama" and weight is not None) else x_dtype


# (rows, hidden): one row and 37 (several tiles, bands of several rows) of each fused size; the
# unfused size (three ops, each tested in test_rms_norm.py) at 3 rows.
SIZE_CASES = [(rows, hidden) for hidden in HIDDEN_SIZES[:-1] for rows in (1, 37)] + [(3, HIDDEN_SIZES[-1])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden", SIZE_CASES)
@pytest.mark.parametrize("with_next", (True, False), ids=("add_norm", "add"))
def test_sizes(dtype, rows, hidden, with_next):
    x = randn(rows, hidden, dtype=dtype, requires_grad=True)
    r = randn(rows, hidden, dtype=dtype, requires_grad=True)
    w = randn(hidden, dtype=dtype, requires_grad=True)
    w2 = randn(hidden, dtype=dtype, requires_grad=True)
    check_join(x, r, w, w2, with_next=with_next)


@pytest.mark.parametrize("x_dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("casting, offset", (("gemma", 1.0), ("llama", 0.0)))
@pytest.mark.parametrize("with_next", (True, False), ids=("add_norm", "add"))
def test_autocast_dtypes(x_dtype, casting, offset, with_next):
    """A half-precision sublayer output joining an fp32 residual stream, fp32 weights: the sum is fp32;
    y in the half dtype (the autocast copy), as the patched Gemma-2 layer asks."""
    x = randn(2, 9, 160, dtype=x_dtype, requires_grad=True)  # 3-D: leading dims are rows
    r = randn(2, 9, 160, dtype=torch.float32, requires_grad=True)
    w = randn(160, dtype=torch.float32, scale=0.5, requires_grad=True)
    w2 = randn(160, dtype=torch.float32, scale=0.5, requires_grad=True)
    check_join(x, r, w, w2, with_next=with_next, offset=offset, casting=casting, out_dtype=x_dtype)


@pytest.mark.parametrize("casting, offset", (("gemma", 1.0), ("llama", 0.0)))
@pytest.mark.parametrize("weights", ("none", "first", "next"))
def test_weights_none(casting, offset, weights):
    x = randn(11, 72, dtype=torch.bfloat16, requires_grad=True)
    r = randn(11, 72, dtype=torch.bfloat16, requires_grad=True)
    w = randn(72, dtype=torch.bfloat16, requires_grad=True) if weights == "first" else None
    w2 = randn(72, dtype=torch.bfloat16, requires_grad=True) if weights == "next" else None
    check_join(x, r, w, w2, offset=offset, casting=casting)
    if w2 is None:
        check_join(x, r, w, None, with_next=False, offset=offset, casting=casting)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_noncontiguous_and_stride0_grads(dtype):
    x = noncontiguous(randn(13, 100, dtype=dtype)).requires_grad_()
    r = noncontiguous(randn(13, 100, dtype=torch.float32)).requires_grad_()
    w = randn(100, dtype=torch.float32, requires_grad=True)
    w2 = randn(100, dtype=torch.float32, requires_grad=True)
    y_dtype = ref_y_dtype(torch.float32, w2, "llama")
    dy = stride0_like(torch.empty(13, 100, dtype=y_dtype, device=DEVICE))
    ds = noncontiguous(randn(13, 100, dtype=torch.float32))
    check_join(x, r, w, w2, y_grad=dy, s_grad=ds, tolerance_dtype=dtype)
    check_join(x, r, w, w2, with_next=False, s_grad=stride0_like(ds), tolerance_dtype=dtype)


@pytest.mark.parametrize("grads", (("y",), ("s",)), ids=("only_y", "only_s"))
def test_one_output_used(grads):
    """An output left out of the backward: with y unused, next_weight's gradient is zero."""
    x = randn(21, 64, dtype=torch.bfloat16, requires_grad=True)
    r = randn(21, 64, dtype=torch.float32, requires_grad=True)
    w = randn(64, dtype=torch.float32, requires_grad=True)
    w2 = randn(64, dtype=torch.float32, requires_grad=True)
    check_join(x, r, w, w2, grads=grads, casting="gemma", offset=1.0, out_dtype=torch.bfloat16,
               tolerance_dtype=torch.bfloat16)


def test_eps_of_each_norm():
    x = randn(7, 48, dtype=torch.float32, scale=1e-3, requires_grad=True)
    r = randn(7, 48, dtype=torch.float32, scale=1e-3, requires_grad=True)
    w = randn(48, requires_grad=True)
    w2 = randn(48, requires_grad=True)
    check_join(x, r, w, w2, eps=1e-5, next_eps=1e-2)  # tiny rows: each eps shows


def test_gradients_repeatable():
    """The dw partial rows are summed in a fixed order: bitwise the same gradients on every run."""
    x = randn(300, 96, dtype=torch.bfloat16, requires_grad=True)
    r = randn(300, 96, dtype=torch.float32, requires_grad=True)
    w = randn(96, requires_grad=True)
    w2 = randn(96, requires_grad=True)
    dy, ds = randn(300, 96, dtype=torch.float32), randn(300, 96, dtype=torch.float32)
    repeatable_grads(lambda: sandwich_norm_join(x, r, w, w2), (x, r, w, w2), (dy, ds))


def test_empty_rows():
    x = randn(0, 32, requires_grad=True)
    r = randn(0, 32, requires_grad=True)
    w, w2 = randn(32, requires_grad=True), randn(32, requires_grad=True)
    y, s = sandwich_norm_join(x, r, w, w2)
    assert y.shape == s.shape == (0, 32)
    dx, dr, dw, dw2 = torch.autograd.grad((y.sum() + s.sum()), (x, r, w, w2))
    assert dx.shape == (0, 32) and torch.equal(dw, torch.zeros_like(w)) and torch.equal(dw2, torch.zeros_like(w2))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(residual=lambda: randn(4, 9)), ValueError, "residual has shape"),
        (dict(residual=lambda: torch.ones(4, 8, dtype=torch.int64, device=DEVICE)), TypeError, "residual has dtype"),
        (dict(weight=lambda: randn(9)), ValueError, "does not match weight's size 9"),
        (dict(next_weight=lambda: randn(9)), ValueError, "does not match next_weight's size 9"),
        (dict(next_weight=lambda: torch.ones(8, dtype=torch.int32, device=DEVICE)), TypeError, "next_weight has dtype"),
        (dict(x=lambda: torch.ones(4, 8, dtype=torch.int64, device=DEVICE)), TypeError, "x has dtype"),
        (dict(casting="mistral"), ValueError, "casting"),
        (dict(eps=-1.0), ValueError, "eps"),
        (dict(next_eps=-1.0), ValueError, "next_eps"),
        (dict(next_eps="1e-6"), TypeError, "next_eps"),
        (dict(eps=None), TypeError, "eps"),
        (dict(offset=float("inf")), ValueError, "offset"),
        (dict(out_dtype=torch.int32), TypeError, "out_dtype"),
    ],
)
def test_bad_inputs(kwargs, error, match):
    args = {"x": randn(4, 8), "residual": randn(4, 8), "weight": randn(8), "next_weight": randn(8)}
    for name in NAMES:
        if name in kwargs:
            args[name] = kwargs.pop(name)()
    before = {n: t.clone() for n, t in args.items()}
    with pytest.raises(error, match=match):
        sandwich_norm_join(args["x"], args["residual"], args["weight"], args["next_weight"], **kwargs)
    if "next" not in match and "out_dtype" not in match:
        with pytest.raises(error, match=match):
            post_norm_join(args["x"], args["residual"], args["weight"], **{k: v for k, v in kwargs.items()})
    for name, t in args.items():
        assert torch.equal(t, before[name]), name


@pytest.mark.skipif(ON_GPU, reason="CPU-only (CI): on a GPU, CPU tensors are the wrong device, tested below")
def test_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA tensors"):
        post_norm_join(randn(2, 8), randn(2, 8), randn(8))


@pytest.mark.gpu
def test_residual_on_another_device():
    with pytest.raises(ValueError, match="residual is on"):
        post_norm_join(randn(2, 8), torch.randn(2, 8), randn(8))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", (2304, MAX_FUSED_HIDDEN + 5))  # fused; three ops
def test_torch_compile_fullgraph(hidden):
    x = randn(64, hidden, dtype=torch.bfloat16, requires_grad=True)
    r = randn(64, hidden, dtype=torch.float32, requires_grad=True)
    w = randn(hidden, dtype=torch.float32, requires_grad=True)
    w2 = randn(hidden, dtype=torch.float32, requires_grad=True)

    def f(x, r, w, w2):
        y, s = sandwich_norm_join(x, r, w, w2, casting="gemma", offset=1.0, out_dtype=torch.bfloat16)
        s2 = post_norm_join(y, s, w, casting="gemma", offset=1.0)
        return y.float().square().sum() + s2.sin().sum()

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(x, r, w, w2)
    grads = torch.autograd.grad(loss, (x, r, w, w2))
    ref_loss = f(x, r, w, w2)
    ref_grads = torch.autograd.grad(ref_loss, (x, r, w, w2))
    assert_close(loss, ref_loss, torch.float32, "loss")
    for g, rg in zip(grads, ref_grads, strict=True):
        assert_close(g, rg, torch.bfloat16, "grad")


@pytest.mark.gpu
@pytest.mark.bigmem
def test_int64_offsets():
    """More than 2**31 elements: offsets in 64 bit, so the last rows are right, forward and backward."""
    hidden = 4096
    rows = (2**31 // hidden) + 64
    x = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    s = post_norm_join(x, r, w, casting="gemma", offset=1.0)
    tail = slice(rows - 128, rows)
    xt = x[tail].detach().double().requires_grad_()
    dtypes = {"x": torch.bfloat16, "residual": torch.bfloat16, "weight": torch.bfloat16}
    ref = post_norm_join_reference(xt, r[tail].detach().double(), w.detach().double(), casting="gemma", offset=1.0,
                                 dtypes=dtypes)
    assert_close(s[tail], ref, torch.bfloat16, "s tail")
    ds = torch.randn((), device=DEVICE, dtype=torch.bfloat16).expand_as(s)
    dx, dr = torch.autograd.grad(s, (x, r), ds)
    (ref_dx,) = torch.autograd.grad(ref, (xt,), ds[tail].double())
    assert_close(dx[tail], ref_dx, torch.bfloat16, "dx tail")
    assert torch.equal(dr[tail], ds[tail])


def test_strided_weights_read_their_strides():
    """weight and next_weight with stride 2 or 0 give what their contiguous copies give."""
    x, r = randn(5, 24, requires_grad=True), randn(5, 24)
    w, w2 = randn(24, requires_grad=True), randn(24, requires_grad=True)

    def run(weight, next_weight):
        y, s = sandwich_norm_join(x, r, weight, next_weight)
        s_post = post_norm_join(x, r, weight)
        return (y, s, s_post, *torch.autograd.grad((y.sum() + s.sum() + s_post.sum()), (x, weight, next_weight)))

    for weight, next_weight in ((noncontiguous(w), noncontiguous(w2)), (w[:1].expand(24), w2[:1].expand(24))):
        got = run(weight, next_weight)
        want = run(weight.detach().contiguous().requires_grad_(), next_weight.detach().contiguous().requires_grad_())
        assert all(torch.equal(g, h) for g, h in zip(got, want, strict=True))
