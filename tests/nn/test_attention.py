"""sdpa as two calls (tigon.nn.attention): attend / attend_backward against
torch.nn.functional.scaled_dot_product_attention itself, for the two calls transformers' sdpa interface makes for
a decoder (causal without a mask, grouped heads native; a boolean mask, k and v repeated), on the CPU (flash) and
on the GPU (each backend forced with sdpa_kernel). Same kernels on the same arguments: outputs, dk and dv bitwise;
dq bitwise on the CPU, and on the GPU within bf16's rounding (cuDNN and flash sum it with atomics, so that two sdpa
calls already differ)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.helpers import ON_GPU, assert_close
from tigon.nn.attention import MaskBiases, attend, attend_backward, repeat_heads, sum_heads

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _inputs(device, dtype, batch=3, heads=6, kv_heads=2, seq=13, dim=16, seed=0):
    """q, k, v as views of one projection output (a decoder's layout), and a boolean mask with left padding in the
    first sequence (its first queries attend to no key) and right padding in the last."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, seq, heads + 2 * kv_heads, dim, generator=gen).to(device, dtype)
    q, k, v = (t.transpose(1, 2) for t in qkv.split_with_sizes((heads, kv_heads, kv_heads), dim=2))
    keys = torch.ones(batch, seq, dtype=torch.bool)
    keys[0, :4], keys[-1, -3:] = False, False
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None] & keys[:, None, None, :]
    dout = torch.randn(batch, seq, heads, dim, generator=gen).to(device, dtype).transpose(1, 2)  # sdpa's layout
    return q, k, v, mask.to(device), dout


def _sdpa(q, k, v, dout, scale, mask, gqa):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
    return out, torch.autograd.grad(out, leaves, dout)


def _check(q, k, v, dout, scale, mask, gqa, dq_exact=True):
    want_out, want_grads = _sdpa(q, k, v, dout, scale, mask, gqa)
    result = attend(q, k, v, scale, gqa=gqa, mask=mask)
    assert result is not None, "sdpa chose a backend attend does not call"
    out, saved, sizes = result
    grads = attend_backward(dout, q, k, v, out, saved, sizes, scale)
    assert torch.equal(out, want_out)
    assert torch.equal(grads[1], want_grads[1]) and torch.equal(grads[2], want_grads[2])
    if dq_exact:
        assert torch.equal(grads[0], want_grads[0])
    else:
        assert_close(grads[0], want_grads[0], torch.bfloat16, "dq")
    return sizes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", (False, True), ids=("causal", "padding-mask"))
def test_cpu_flash_matches_sdpa(dtype, masked):
    q, k, v, mask, dout = _inputs("cpu", dtype)
    if masked:  # transformers repeats k and v to the query heads before a masked call
        k, v = repeat_heads(k, 3), repeat_heads(v, 3)
    sizes = _check(q, k, v, dout, 0.3, mask if masked else None, gqa=not masked)
    assert sizes[0] == SDPBackend.FLASH_ATTENTION.value


def test_repeated_heads_and_their_gradient_are_repeat_kv_and_autograds():
    from transformers.integrations.sdpa_attention import repeat_kv

    k = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    repeated = repeat_kv(k, 4)
    assert torch.equal(repeat_heads(k.detach(), 4), repeated.detach())
    grad = torch.randn_like(repeated)
    (want,) = torch.autograd.grad(repeated, k, grad)
    assert torch.equal(sum_heads(grad, 4), want)


def test_mask_biases_one_bias_per_mask_remade_after_an_in_place_change_dropped_with_the_mask():
    import gc

    q, k, v, mask, dout = _inputs("cpu", torch.bfloat16)
    k, v = repeat_heads(k, 3), repeat_heads(v, 3)
    biases = MaskBiases()
    first = attend(q, k, v, 0.3, mask=mask, biases=biases)
    second = attend(q, k, v, 0.3, mask=mask, biases=biases)
    assert first[1][-1] is second[1][-1]  # the saved bias: one tensor for both calls
    assert torch.equal(first[0], second[0])
    mask[1, 0, 5, :] = False  # in place: the bias is made again
    third = attend(q, k, v, 0.3, mask=mask, biases=biases)
    assert third[1][-1] is not first[1][-1]
    want_out, want_grads = _sdpa(q, k, v, dout, 0.3, mask, False)
    assert torch.equal(third[0], want_out)
    assert all(torch.equal(a, b) for a, b in zip(attend_backward(dout, q, k, v, *third, 0.3), want_grads, strict=True))
    other = attend(q.half(), k.half(), v.half(), 0.3, mask=mask, biases=biases)  # another dtype: another bias
    assert other[1][-1].dtype == torch.float16
    del mask, first, second, third, other
    gc.collect()
    assert not biases.entries


def test_a_backend_not_called_here_gives_none():
    q, k, v, mask, _ = _inputs("cpu", torch.float32)
    with sdpa_kernel(SDPBackend.MATH):
        assert attend(q, k, v, 0.3, gqa=True) is None
        assert attend(q, repeat_heads(k, 3), repeat_heads(v, 3), 0.3, mask=mask) is None


# (backend, key/value heads, sequence length, masked); 301 is not a multiple of 8 (the memory-efficient
# backend's bias is then padded); the memory-efficient backend takes no grouped heads
GPU_CASES = [(backend, kv_heads, seq, masked)
             for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
             for kv_heads in (2, 8) for seq in (301, 256) for masked in (False, True)
             if not (backend == "FLASH_ATTENTION" and masked)
             and not (backend == "EFFICIENT_ATTENTION" and kv_heads == 2 and not masked)]


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (sdpa's GPU backends): runs in scripts/gpu-check.sh")
@pytest.mark.parametrize("backend,kv_heads,seq,masked", GPU_CASES)
def test_gpu_backends_match_sdpa(backend, kv_heads, seq, masked):
    q, k, v, mask, dout = _inputs("cuda", torch.bfloat16, batch=2, heads=8, kv_heads=kv_heads, seq=seq, dim=64)
    if masked and kv_heads != 8:
        k, v = repeat_heads(k, 8 // kv_heads), repeat_heads(v, 8 // kv_heads)
    with sdpa_kernel(getattr(SDPBackend, backend)):
        sizes = _check(q, k, v, dout, 0.125, mask if masked else None, gqa=not masked and kv_heads != 8,
                       dq_exact=False)
    assert sizes[0] == getattr(SDPBackend, backend).value
