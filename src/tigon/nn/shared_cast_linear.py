"""Attention projections under autocast: one cast of the input for q/k/v, no saved weight copies.

Under ``torch.autocast`` the residual stream and the norm's output stay fp32 (fp32 weights), and
each of ``q_proj``, ``k_proj``, ``v_proj`` casts that same input to the autocast dtype on its own:
autocast caches casts of weights only. Each linear saves its own cast for the backward, so every
decoder layer keeps three identical (tokens, hidden) copies in bf16: 2 × 32 MB per layer more than
needed at Llama-3.2-1B's 8192 tokens × 2048 (1 GB over its 16 layers). Each linear also saves the
bf16 copy of its weight that autocast made, until the backward: 2 bytes per projection parameter
(0.34 GB at Llama-3.2-1B, 0.74 GB at Gemma-2-2B) while the fp32 weights are there anyway.

Here q, k and v run as one node (:class:`_AutocastQKV`; on the GPU one stacked matmul, its
backward two and a sum) and ``o_proj`` as :class:`_AutocastLinear`:
the input is cast once per attention module (:class:`CastCache`) and that one cast is what the node
saves; the weights are cast in the forward and again in the backward instead of being saved (all of a
node's casts by one launch: :func:`tigon._kernels.cast_all`). The
backward makes the same products as the stock linears' (``dy·W`` for the input, ``dyᵀ·x`` for the
weight, ``Σ dy`` for the bias, in the autocast dtype) and returns them in the dtypes of input, weight
and bias as autocast's casts do. The three input gradients are summed by the matmuls into one
buffer, in the order and the dtype autograd summed the stock casts' (fp32), so that losses and
gradients are bitwise the stock ones on the CPU; no (tokens, hidden) gradient is written three times
and added twice. When the norm before the attention gives its output in bf16 already (the default
patch: ``tigon.nn.RMSNorm.autocast_output``) there is no cast at all, and the input gradient is
summed in bf16, each sum rounded once. On the GPU the fp32 gradients (of an fp32 input, of an fp32
weight or bias) are written in fp32 by the matmuls and sums themselves
(:func:`tigon._kernels.matmul_to`, ``sum_rows_to``): their accumulators are not rounded to bf16
first, so those gradients, and every gradient upstream of them, are nearer the exact ones than the
stock's, and a cast kernel per product is saved. Nothing changes
outside autocast, without grad, under torch.compile (Inductor plans its own buffers), or for a
projection that is not a plain ``nn.Linear`` (a LoRA wrapper keeps its own forward).

Under DeepSpeed ZeRO-3 the projections are not grouped (each is an :class:`_AutocastLinear` with
the shared cast): a ZeRO-3 parameter exists only while its own module runs, and ZeRO-3's hooks hand
each projection a new tensor for its input, so a group made by q_proj would gather k_proj's and
v_proj's weights early and be made again by each of them (:meth:`CastCache.take`).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from tigon._kernels import cast_all, cast_stacked, function_apply, matmul_accumulate, matmul_to, sum_rows_to


class _AutocastLinear(torch.autograd.Function):
    """``F.linear(cast, weight.to(dtype), bias.to(dtype))`` with ``cast`` = x in the autocast dtype
    (made by the caller, shared); saves ``cast`` and the weight itself, not its cast."""

    @staticmethod
    def forward(ctx, x, cast, weight, bias, dtype):
        ctx.save_for_backward(cast, weight)
        ctx.x_dtype, ctx.dtype = x.dtype, dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        weight_cast, bias_cast = cast_all((weight, bias), dtype)
        return F.linear(cast, weight_cast, bias_cast)

    @staticmethod
    def backward(ctx, dy):
        cast, weight = ctx.saved_tensors
        need_x, _, need_w, need_b, _ = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])                           # (M, O)
        dx = dw = db = None
        if need_x:
            dx = matmul_to(dy2, weight.to(ctx.dtype), ctx.x_dtype).reshape(cast.shape)   # (..., I)
        if need_w:
            dw = matmul_to(dy2.t(), cast.reshape(-1, cast.shape[-1]), weight.dtype)   # (O, I)
        if need_b:
            db = sum_rows_to(dy2, ctx.bias_dtype)
        return dx, None, dw, db, None


# Devices on which q, k and v run as one stacked matmul (below). Not the CPU: there the three
# matmuls are kept, so that the patched model's losses and gradients stay bitwise the stock ones;
# tests add "cpu" to run the stacked path under the interpreter.
STACKED_DEVICES = ("cuda",)


class _AutocastQKV(torch.autograd.Function):
    """q, k and v of one attention module as one node: each ``F.linear(cast, W.to(dtype), b.to(dtype))``.

    On the GPU the three projections are one matmul: their weights are cast into one stacked
    ``(Oq + Ok + Ov, I)`` matrix (and the biases into one vector) by one launch, ``x·[Wq; Wk; Wv]ᵀ``
    is one product, and q, k and v are its column blocks (views). With grouped-query attention k and
    v are narrow (Qwen2.5-0.5B: 896 → 128 beside q's 896 → 896): two small matmuls, each a launch
    and a tile grid of its own, become columns of one wide product. The backward stacks
    ``[dq | dk | dv]`` (one copy of the three gradients) and takes the input gradient
    ``[dq | dk | dv]·[Wq; Wk; Wv]``, the stacked weight gradient and the stacked bias gradient as one
    product and one sum each: where the per-projection form took six matmuls and three sums.

    Elsewhere (and when an output gets no gradient) the projections are separate products: the input
    gradient ``dv·Wv + dk·Wk + dq·Wq`` is summed by the matmuls themselves into one buffer
    (:func:`tigon._kernels.matmul_accumulate`) instead of written three times and added by autograd
    (two addition kernels of the whole activation): v, k, q, the order autograd summed the separate
    nodes' gradients in. In the autocast dtype (a bf16 input: the norm gave it in bf16) each sum is
    rounded once, the products are not; an fp32 input's gradient is summed in fp32 (on the CPU
    bitwise as autograd summed the separate nodes').
    """

    @staticmethod
    def forward(ctx, x, cast, dtype, q_weight, q_bias, k_weight, k_bias, v_weight, v_bias):
        ctx.set_materialize_grads(False)  # an unused output gets no gradient, not a zero one
        weights, biases = (q_weight, k_weight, v_weight), (q_bias, k_bias, v_bias)
        ctx.save_for_backward(cast, *weights)
        ctx.x_dtype, ctx.dtype = x.dtype, dtype
        ctx.bias_dtypes = (q_bias.dtype if q_bias is not None else None, k_bias.dtype if k_bias is not None else None,
                           v_bias.dtype if v_bias is not None else None)
        ctx.stacked = _stackable(cast, weights, biases)
        if ctx.stacked:
            weight, bias, _ = cast_stacked(weights, biases, dtype)               # one launch
            out = F.linear(cast, weight, bias)                                    # (..., Oq + Ok + Ov)
            return out.split_with_sizes([w.shape[0] for w in weights], dim=-1)
        casts = cast_all((q_weight, q_bias, k_weight, k_bias, v_weight, v_bias), dtype)  # one launch
        return tuple(F.linear(cast, casts[2 * i], casts[2 * i + 1]) for i in range(3))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cast, *weights = ctx.saved_tensors
        dys = (dq, dk, dv)
        if ctx.stacked and all(dy is not None for dy in dys):
            return _stacked_backward(ctx, cast, weights, dys)
        needs = ctx.needs_input_grad  # x, cast, dtype, then (weight, bias) of q, k, v
        grads = [None] * len(needs)
        cast2 = cast.reshape(-1, cast.shape[-1])                                  # (M, I)
        # the weights the input gradient needs, cast by one launch
        wanted = [w if needs[0] and dy is not None else None for w, dy in zip(weights, dys, strict=True)]
        weight_casts = cast_all(wanted, ctx.dtype)
        dx = None
        for i in (2, 1, 0):  # v, k, q
            dy = dys[i]
            if dy is None:
                continue
            dy2 = dy.reshape(-1, dy.shape[-1])                                    # (M, O)
            if needs[0]:
                first = dx is None
                if first:
                    dx = torch.empty(cast2.shape, dtype=ctx.x_dtype, device=cast.device)
                matmul_accumulate(dx, dy2, weight_casts[i], first=first)          # (M, I)
            weight_casts[i] = None
            if needs[3 + 2 * i]:
                grads[3 + 2 * i] = matmul_to(dy2.t(), cast2, weights[i].dtype)    # (O, I)
            if needs[4 + 2 * i]:
                grads[4 + 2 * i] = sum_rows_to(dy2, ctx.bias_dtypes[i])
        grads[0] = dx.view(cast.shape) if dx is not None else None
        return tuple(grads)


def _stackable(cast, weights, biases) -> bool:
    """Whether q, k and v can run as one stacked matmul: on a device listed in STACKED_DEVICES, not
    under torch.compile (which plans its own), weights of one dtype and input size, and biases all
    present (in one dtype) or all absent."""
    if cast.device.type not in STACKED_DEVICES or torch.compiler.is_compiling():
        return False
    q, k, v = weights
    if not (q.dim() == k.dim() == v.dim() == 2 and q.dtype == k.dtype == v.dtype
            and q.shape[1] == k.shape[1] == v.shape[1]):
        return False
    q_bias, k_bias, v_bias = biases
    if q_bias is None:
        return k_bias is None and v_bias is None
    return k_bias is not None and v_bias is not None and q_bias.dtype == k_bias.dtype == v_bias.dtype


def _stacked_backward(ctx, cast, weights, dys):
    """The gradients of the stacked projection: d = [dq | dk | dv] (M, O), dx = d·W, dW = dᵀ·x and
    db = Σ d, each one product or sum; the weight and bias gradients come back as row blocks."""
    needs = ctx.needs_input_grad  # x, cast, dtype, then (weight, bias) of q, k, v
    grads = [None] * len(needs)
    sizes = [w.shape[0] for w in weights]
    d = torch.cat([dy.reshape(-1, dy.shape[-1]) for dy in dys], dim=1)           # (M, O)
    cast2 = cast.reshape(-1, cast.shape[-1])                                      # (M, I)
    if needs[0]:
        weight, _, _ = cast_stacked(weights, (None, None, None), ctx.dtype)       # one launch
        grads[0] = matmul_to(d, weight, ctx.x_dtype).view(cast.shape)             # (M, I)
        weight = None
    if any(needs[3:9:2]):
        for i, dw in enumerate(matmul_to(d.t(), cast2, weights[0].dtype).split_with_sizes(sizes)):  # (O, I)
            grads[3 + 2 * i] = dw if needs[3 + 2 * i] else None
    if any(needs[4:9:2]):
        for i, db in enumerate(sum_rows_to(d, ctx.bias_dtypes[0]).split_with_sizes(sizes)):
            grads[4 + 2 * i] = db if needs[4 + 2 * i] else None
    return tuple(grads)


class CastCache:
    """The last input the projections of one attention module saw, and its cast (both held weakly:
    the nodes that saved the cast keep it alive exactly as long as the backward needs it).

    ``group`` (set by the patch): the module's q, k and v projections, computed as one node
    (:class:`_AutocastQKV`) by whichever of them sees an input first; the other two outputs wait
    here for their own projection's call on the same input (same tensor, same version), which takes
    them. A call on another input drops what waits.
    """

    def __init__(self, group=None):
        self._input = self._cast = None
        self._version = self._dtype = None
        self.group = group
        self._pending = {}
        self._pending_input = self._pending_version = None

    def put(self, x: torch.Tensor, outputs: dict) -> None:
        self._pending = outputs
        self._pending_input, self._pending_version = weakref.ref(x), x._version

    def take(self, projection, x: torch.Tensor):
        """The output made for ``projection`` from this very input, or None.

        A projection whose output waits here but that is called on another tensor stops the
        grouping for good: something between the attention module and its projections hands each
        of them an input of its own (a forward pre-hook that returns new tensors), and every call
        would make q, k and v again.
        """
        if self._pending and self._pending_input() is x and self._pending_version == x._version:
            return self._pending.pop(projection, None)
        if projection in self._pending:
            self.group = None
        self._pending = {}
        return None

    def cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self._input is not None and self._input() is x and self._version == x._version and self._dtype == dtype:
            cast = self._cast()
            if cast is not None:
                return cast
        cast = x.detach().to(dtype)
        self._input, self._cast = weakref.ref(x), weakref.ref(cast)
        self._version, self._dtype = x._version, dtype
        return cast

    def __getstate__(self):  # pickling or deep-copying a patched model drops the tensors
        return {"group": self.group}

    def __setstate__(self, state):
        self.__init__(state.get("group"))


CACHE_ATTR = "_tigon_cast_cache"


def shared_cast_linear(self, input):
    """``nn.Linear.forward`` under autocast without saved copies: the input's cast is shared with
    the sibling projections of the same attention module, the weight is cast again in the backward."""
    device_type = input.device.type
    if (
        torch.compiler.is_compiling()
        or not torch.is_grad_enabled()
        or device_type not in ("cuda", "cpu")
        or not torch.is_autocast_enabled(device_type)
    ):
        return F.linear(input, self.weight, self.bias)
    dtype = torch.get_autocast_dtype(device_type)
    # Eligible: input, weight and bias each in fp32 or dtype (what autocast casts to dtype, or leaves
    # as it is). Each parameter is read once (a module attribute goes through nn.Module.__getattr__).
    weight, bias = self.weight, self.bias
    eligible = (torch.float32, dtype)
    input_dtype = input.dtype
    if (dtype == torch.float32 or input_dtype not in eligible or weight.dtype not in eligible
            or (bias is not None and bias.dtype not in eligible)):
        return F.linear(input, weight, bias)
    cache = getattr(self, CACHE_ATTR)
    group = cache.group
    # DeepSpeed ZeRO-3 (its parameters carry a ds_id) gathers each projection's weight in that
    # projection's own call and hands each call an input of its own: no grouping there.
    in_group = group is not None and self in group and not hasattr(weight, "ds_id")
    if in_group:
        output = cache.take(self, input)
        if output is not None:
            return output
    cast = input if input_dtype == dtype else cache.cast(input, dtype)
    # Autocast stays on: the nodes hand F.linear operands already in its dtype, so it casts nothing
    # (switching it off would cost a context manager's host time a call: docs/tuning.md).
    if in_group:
        parameters = [t for p in group for t in ((weight, bias) if p is self else (p.weight, p.bias))]
        if all(t is None or t.dtype in eligible for t in parameters):
            outputs = _QKV_APPLY(input, cast, dtype, *parameters)
            cache.put(input, {p: out for p, out in zip(group, outputs, strict=True) if p is not self})
            return outputs[group.index(self)]
    return _LINEAR_APPLY(input, cast, weight, bias, dtype)


# The nodes' apply, with less Python per call (the forward above runs four times a decoder layer).
_QKV_APPLY = function_apply(_AutocastQKV)
_LINEAR_APPLY = function_apply(_AutocastLinear)


shared_cast_linear._tigon = True
