"""Matmuls into a chosen dtype and fused casts, shared by the ops that call cuBLAS around their
kernels (nn/mlp.py, the fused linear losses) and by the patching's shared casts."""

from __future__ import annotations

import torch

HAS_MM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def fp32_product_in_place(a: torch.Tensor) -> bool:
    """Whether a matmul of ``a`` (bf16/fp16) can write or accumulate an fp32 result itself."""
    return HAS_MM_OUT_DTYPE and a.is_cuda and a.dtype != torch.float32 and not torch.compiler.is_compiling()


def matmul_to(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` returned in ``dtype``: the gradient of a tensor (an fp32 master weight, an fp32
    input) that autocast cast to the operands' dtype.

    Stock autograd makes it the bf16 product cast to fp32: the matmul rounds its fp32 accumulator
    to bf16, then a cast kernel reads that and writes fp32. On the GPU the matmul writes its fp32
    accumulator itself instead: no cast kernel (2 bytes read and 2 written less per element, one
    launch less) and no rounding to bf16 on the way, so the gradient is nearer the exact product.
    """
    if dtype == a.dtype:
        return a @ b
    if dtype == torch.float32 and fp32_product_in_place(a):
        out = torch.empty((a.shape[0], b.shape[1]), dtype=dtype, device=a.device)
        return torch.addmm(out, a, b, beta=0.0, out_dtype=dtype, out=out)
    return (a @ b).to(dtype)


def matmul_accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool) -> None:
    """out = a @ b (``first``) or out += a @ b, summed in ``out``'s dtype, in place.

    In the operands' dtype the matmul adds its product to ``out`` itself (beta = 1): each sum is
    rounded once and no product is written on its own. An fp32 ``out`` (the gradient of an fp32
    tensor) is summed in fp32: on the GPU by the matmul itself (``out_dtype``); elsewhere as autograd
    sums the products of separate nodes, each rounded to the operands' dtype and widened.
    """
    beta = 0.0 if first else 1.0
    if out.dtype == a.dtype:
        out.addmm_(a, b, beta=beta)
    elif out.dtype == torch.float32 and fp32_product_in_place(a):
        torch.addmm(out, a, b, beta=beta, out_dtype=out.dtype, out=out)
    elif first:
        out.copy_(a @ b)
    else:
        out += a @ b


def cast_all(tensors, dtype: torch.dtype) -> list:
    """``[t.to(dtype) for t in tensors]`` (None stays None), the casts made by one launch.

    Why: a node that casts its fp32 weights (and biases) to the autocast dtype, as ``nn.Linear``
    under autocast does, made one cast kernel each, and in eager mode each ``.to`` costs the host a
    dispatch, an allocation and a launch (docs/tuning.md, "Timings quoted in the source"): 17 of them
    a Qwen2.5-0.5B layer,
    forward and backward, 400 a step that was bound by its host. Here the outputs are allocated as
    ``.to`` allocates them (``empty_like``: same sizes and strides) and filled by one
    ``torch._foreach_copy_``, which converts the dtype in one multi-tensor kernel on the GPU (and
    copies one by one elsewhere): the same values, bit for bit, as the separate casts. Under
    torch.compile the plain casts are left to Inductor, which fuses them itself.
    """
    out = list(tensors)
    todo = [i for i, t in enumerate(tensors) if t is not None and t.dtype != dtype]
    if len(todo) < 2 or torch.compiler.is_compiling():
        for i in todo:
            out[i] = tensors[i].to(dtype)
        return out
    sources = [tensors[i] for i in todo]
    casts = [torch.empty_like(t, dtype=dtype) for t in sources]
    torch._foreach_copy_(casts, sources)
    for i, cast in zip(todo, casts, strict=True):
        out[i] = cast
    return out


def cast_stacked(weights, biases, dtype: torch.dtype, others=()):
    """``[W1; W2; ...]`` and ``[b1; b2; ...]`` (None where the biases are) in ``dtype``, and each of
    ``others`` cast to it as :func:`cast_all` casts (None stays None): all written by one multi-tensor
    copy, each weight and bias into its row block, so the stacking costs no pass of its own.

    Why: projections that read one input (q, k, v; an MLP's gate and up) run as one matmul over the
    stacked weights, a launch and a tile grid instead of several, where the weights are cast anyway
    (fp32 master weights under autocast).
    """
    sizes = [w.shape[0] for w in weights]
    first = weights[0]
    weight = torch.empty((sum(sizes), *first.shape[1:]), dtype=dtype, device=first.device)
    # split_with_sizes: what Tensor.split calls for a list of sizes, without its Python wrapper
    targets, sources = list(weight.split_with_sizes(sizes)), list(weights)
    bias = None
    if biases[0] is not None:
        bias = torch.empty(sum(sizes), dtype=dtype, device=first.device)
        targets += bias.split_with_sizes(sizes)
        sources += biases
    casts = []
    for t in others:
        if t is not None and t.dtype != dtype:
            cast = torch.empty_like(t, dtype=dtype)
            targets.append(cast)
            sources.append(t)
            t = cast
        casts.append(t)
    torch._foreach_copy_(targets, sources)
    return weight, bias, casts


def sum_rows_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.sum(0)`` returned in ``dtype``: the gradient of a bias that autocast cast to ``t``'s dtype.

    Stock autograd rounds the (fp32-accumulated) sum to ``t``'s dtype and casts it back; on the GPU
    the reduction writes its fp32 accumulator in ``dtype`` itself (one kernel less, and no rounding
    on the way, as :func:`matmul_to` does for the weights). Elsewhere it is the stock's, bit for bit.
    """
    if dtype == torch.float32 and t.dtype != dtype and t.is_cuda and not torch.compiler.is_compiling():
        return t.sum(0, dtype=dtype)
    return t.sum(0).to(dtype)
