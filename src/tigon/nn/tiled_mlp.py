r"""Tiled MLP: a token-wise MLP run over chunks of tokens, forward and backward.

A gated MLP over M tokens makes ``(M, I)`` intermediates (gate, up, their product; I ≈ 3.5–4·H), and
its autograd node keeps some of them for the backward: at M = 65,536 tokens and Llama-3.2-1B's
I = 8192 one bf16 ``(M, I)`` tensor is 1 GiB, several are alive at the MLP's backward, and gradient
checkpointing does not help (the recompute makes them all again, at once). Every output row of the
MLP depends on its own input row only, so the MLP can run on row chunks:

Forward, x ``(M, H)`` split into chunks x_c of C rows, under ``no_grad``::

    y_c = mlp(x_c)          (C, H)      written into y; the chunk's (C, I) intermediates freed at once

saving x only. Backward, from dy::

    for each chunk c:   y_c = mlp(x_c)  again, with gradients on, then
                        dx_c, dθ_c = ∂(y_c · dy_c)/∂(x_c, θ)     torch.autograd.grad on the chunk's graph
    dx = [dx_c],  dθ = Σ_c dθ_c        (summed in fp32, rounded once to θ's dtype)

so only one chunk's intermediates exist at any time. The parameters θ (every parameter of the module
that requires a gradient: the projections' weights and biases, a LoRA adapter's A and B) are inputs
of the node, and their gradients leave it as its outputs: autograd accumulates them as it accumulates
any gradient (``.grad``, ``torch.autograd.grad``, gradient hooks and FSDP/DDP reductions see them as
usual). The module's forward runs per chunk exactly as it runs whole (tigon's GLU node, the stock one,
a PEFT-wrapped projection), under the autocast state of the forward, with the random-number state of
the forward restored before the backward's recompute (a dropout draws the same masks).

Chunk size: ``tokens_per_hidden · H`` rows (:class:`TiledMLPConfig`), so that one chunk's ``(C, I)``
intermediate holds C·I = k·H·I values, as many as one of the MLP's weight matrices: the memory of the
MLP's activations no longer grows with the sequence. An input of at most one chunk runs the module's
forward as it is (nothing to gain, and no recompute to pay).

Exact: each output row is computed by the same per-row operations; on the GPU a matmul of C rows may
pick another kernel than one of M rows (another summation order within a row, within the dtype's
rounding), and the parameter gradients are sums of the chunks' products instead of one product. Cost:
the MLP's forward once more in the backward (with gradient checkpointing, the layer's recompute runs
the tiled forward, then the backward recomputes each chunk again).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TiledMLPConfig:
    """The chunk policy: chunks of ``tokens_per_hidden · hidden_size`` tokens (at least ``min_tokens``)."""

    tokens_per_hidden: float = 1.0
    min_tokens: int = 256  # small hidden sizes: chunks long enough to keep the matmuls efficient

    def __post_init__(self):
        if isinstance(self.tokens_per_hidden, bool) or not (
                isinstance(self.tokens_per_hidden, (int, float)) and self.tokens_per_hidden > 0):
            raise ValueError(f"tokens_per_hidden must be a positive number, got {self.tokens_per_hidden!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 1:
            raise ValueError(f"min_tokens must be a positive integer, got {self.min_tokens!r}")

    def chunk_tokens(self, hidden_size: int) -> int:
        return max(self.min_tokens, int(self.tokens_per_hidden * hidden_size))


def _rng_state(device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _autocast_state(device):
    kind = device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, names, chunk_tokens, x, *params):
        rows = x.reshape(-1, x.shape[-1])  # (M, H)
        ctx.module, ctx.names, ctx.chunk_tokens = module, names, chunk_tokens
        ctx.params = params  # the parameter objects themselves, as the module holds them: not saved tensors
        ctx.rng = _rng_state(x.device)
        ctx.autocast = _autocast_state(x.device)
        out = None
        with torch.no_grad():
            for start in range(0, rows.shape[0], chunk_tokens):
                y = module(rows[start : start + chunk_tokens])  # (C, H)
                if out is None:
                    out = y.new_empty(rows.shape[0], y.shape[-1])  # (M, H)
                out[start : start + y.shape[0]] = y
        ctx.save_for_backward(x)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        module, chunk_tokens = ctx.module, ctx.chunk_tokens
        rows = x.detach().reshape(-1, x.shape[-1])
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        want_x = ctx.needs_input_grad[3]
        wanted = [(name, p) for name, p, need in zip(ctx.names, ctx.params, ctx.needs_input_grad[4:], strict=True)
                  if need]
        grad_x = torch.empty_like(rows) if want_x else None
        sums = [None] * len(wanted)  # fp32 sums of the chunks' parameter gradients
        device_type, autocast_on, autocast_dtype = ctx.autocast
        cpu_rng, cuda_rng = ctx.rng
        devices = [x.device] if cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, x.device)
            for start in range(0, rows.shape[0], chunk_tokens):
                chunk = rows[start : start + chunk_tokens].detach().requires_grad_(want_x)
                # Each chunk differentiates detached aliases of the parameters: the parameters' own
                # gradient hooks see only the sum this node returns, once.
                aliases = {name: p.detach().requires_grad_() for name, p in wanted}
                with torch.enable_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                    # A view, not the leaf itself, goes in: autocast caches the casts of leaves that require
                    # a gradient, and would then sum the projections' input gradients in bf16 where the
                    # stock graph (whose MLP input is an activation) casts once per projection.
                    y = torch.func.functional_call(module, aliases, (chunk.view_as(chunk),), strict=False)
                inputs = ([chunk] if want_x else []) + list(aliases.values())
                grads = torch.autograd.grad(y, inputs, grad_rows[start : start + chunk.shape[0]], allow_unused=True)
                if want_x:
                    grad_x[start : start + chunk.shape[0]] = grads[0]
                    grads = grads[1:]
                for i, g in enumerate(grads):
                    if g is not None:
                        sums[i] = g.float() if sums[i] is None else sums[i].add_(g)
        param_grads = iter(None if s is None else s.to(p.dtype) for s, (_, p) in zip(sums, wanted, strict=True))
        out = [next(param_grads) if need else None for need in ctx.needs_input_grad[4:]]
        grad_x = grad_x.view(x.shape) if want_x else None
        return None, None, None, grad_x, *out


def _trained(module):
    """The names and objects of ``module``'s parameters that take a gradient now."""
    if not torch.is_grad_enabled():
        return (), ()
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    return tuple(name for name, _ in named), tuple(p for _, p in named)


class TiledForward:
    """``module.forward`` run by :class:`_TiledMLP` over chunks of tokens; ``inner``: the forward it
    tiles (bound to ``module``: its class's, or one set on the instance), which each chunk's call of the
    module reaches (a chunk is short enough to run whole)."""

    _tigon = True

    def __init__(self, module: torch.nn.Module, inner, hidden_size: int, config: TiledMLPConfig | None = None):
        self.module, self.inner = module, inner
        self.config = config or TiledMLPConfig()
        self.chunk_tokens = self.config.chunk_tokens(hidden_size)

    def __getstate__(self):
        # The inner forward as its function: pickling the bound method would look ``forward`` up on the
        # module again when it is loaded, and find this object there.
        inner = self.inner
        bound = isinstance(inner, types.MethodType) and inner.__self__ is self.module
        return {**vars(self), "inner": inner.__func__ if bound else inner, "bound": bound}

    def __setstate__(self, state):
        bound = state.pop("bound")
        vars(self).update(state)
        if bound:
            self.inner = types.MethodType(self.inner, self.module)

    def __call__(self, x, *args, **kwargs):
        if (args or kwargs or not isinstance(x, torch.Tensor) or x.dim() == 0
                or x.numel() // max(x.shape[-1], 1) <= self.chunk_tokens or torch.compiler.is_compiling()):
            return self.inner(x, *args, **kwargs)
        names, params = _trained(self.module)
        return _TiledMLP.apply(self.module, names, self.chunk_tokens, x, *params)


def tiled(module: torch.nn.Module, x: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """``module(x)`` over chunks of ``chunk_tokens`` tokens (what :class:`TiledForward` runs); ``module``
    maps each token's row on its own (an MLP)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise TypeError(f"x must be a tensor with a last (hidden) dim, got {type(x).__name__}")
    names, params = _trained(module)
    return _TiledMLP.apply(module, names, chunk_tokens, x, *params)
