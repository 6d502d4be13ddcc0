"""MoE experts: transformers' experts dispatch, with the gated activation fused (``tigon.ops.moe_glu``).

transformers 5 holds a MoE layer's experts as 3-D weights (``gate_up_proj`` ``[E, 2I, H]``, or
``[E, H, 2I]`` transposed as GPT-OSS's) in one module whose class is decorated with
``@use_experts_implementation`` (``transformers/integrations/moe.py``, the same in 5.17 to 5.25). The
decorator replaces the class's ``forward`` with a dispatch: ``config._experts_implementation`` picks
``grouped_mm`` (the default), ``batched_mm``, or ``"eager"``, the class's own loop over experts. The
matmul implementations hand the packed gate/up output ``[S, 2I]`` to ``self._apply_gate`` (the
decorator's ``act_fn(gate) * up`` on ``chunk(2)``, unless the class has its own, as GPT-OSS's
clamped, interleaved one). The class's eager loop either calls ``self._apply_gate`` too (GPT-OSS) or
computes ``self.act_fn(gate) * up`` inline (Mixtral, Qwen3-MoE and the rows written as theirs).

What tigon sets on each experts module (instance attributes, reverted by the patch handle):

- ``_apply_gate``: ``tigon.ops.moe_glu`` with the row's layout and the module's activation. Every
  implementation that calls ``self._apply_gate`` (grouped_mm, batched_mm, a loop that calls it) runs
  the fused kernel; the matmuls, routing and sums around it stay transformers' own.
- ``forward``, only where the eager loop computes the gate inline: the class's dispatch wrapper
  (copied, decorator_chains.rewrapped) around :func:`eager_experts_forward`, the same loop statement for
  statement but with the gate through ``self._apply_gate``. The dispatch itself is transformers':
  whatever implementation the config names at call time is the one that runs.
- ``forward`` of every experts module, around the class's (or the one above):
  :func:`autocast_weights`. Under ``torch.autocast`` the experts' 3-D weights (and biases) are cast
  to the autocast dtype for the call, as autocast casts an ``nn.Linear``'s weight: transformers'
  ``grouped_mm`` casts its input to the *weight's* dtype because ``torch._grouped_mm`` has no
  autocast rule, so with fp32 master weights (bf16 autocast, as the HF Trainer trains with
  ``bf16=True``) stock runs every expert matmul in fp32 on the CUDA cores (a per-expert loop of
  SIMT sgemm, measured as most of a step for Qwen3-30B-A3B-shaped layers; docs/tuning.md,
  "Timings quoted in the source"). Outside autocast,
  and while torch.compile traces, the call is the class's own.

Each function is built from a recipe (instance_methods.py) by :func:`fused_gate` and :func:`experts_forward`;
what is checked before they are set, and where, is the experts part's (parts/experts.py).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
import torch.nn.functional as F
from torch import nn

from tigon.patching import decorator_chains

GATE_ATTR = "_apply_gate"
ACT_FN = "act_fn"
CLAMPED_SWIGLU = "clamped_swiglu"
KERNEL_ACTIVATIONS = {("swiglu", None): "silu", ("geglu", "tanh"): "gelu_tanh", ("geglu", "none"): "gelu"}

# The eager loop of Mixtral / Qwen3-MoE (and the rows written as theirs), as transformers 5.24 has it;
# 5.17 to 5.2x one-hot encode with ``num_classes=self.num_experts`` (no expert-parallel sentinel class).
INLINE_LOOP = '''
def forward(self, hidden_states, top_k_index, top_k_weights):
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()

    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))

    return final_hidden_states
'''
INLINE_LOOP_VARIANTS = {
    "5.24": INLINE_LOOP,
    "5.17": INLINE_LOOP.replace("num_classes=self.num_experts + 1", "num_classes=self.num_experts"),
}


def eager_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """:data:`INLINE_LOOP` with the gate through ``self._apply_gate`` (tigon's fused one).

    One-hot over ``num_experts + 1`` classes as 5.24 (an expert-parallel sentinel index lands in the
    extra class and is skipped); for the indices 5.17 takes, the same experts in the same order.
    """
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)  # (E + 1, top_k, tokens)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()

    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]  # (S_e, H)
        gate_up = F.linear(current_state, self.gate_up_proj[expert_idx])  # (S_e, 2I)
        current_hidden_states = self._apply_gate(gate_up)  # (S_e, I)
        current_hidden_states = F.linear(current_hidden_states, self.down_proj[expert_idx])  # (S_e, H)
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))

    return final_hidden_states


# ------------------------------------------------------------------------------ autocast weights

# The experts' parameters that the implementations read (3-D weights, 2-D biases).
WEIGHT_ATTRS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


class _CastView:
    """The experts module as its implementations see it, with some parameters replaced by their casts
    (every other attribute read from the module itself)."""

    def __init__(self, module, casts):
        self._tigon_module, self._tigon_casts = module, casts

    def __getattr__(self, name):
        casts = self.__dict__["_tigon_casts"]
        if name in casts:
            return casts[name]
        return getattr(self.__dict__["_tigon_module"], name)


def autocast_weights(forward):
    """``forward`` (a function of the module) run, under ``torch.autocast``, on the module's weights
    cast to the autocast dtype (differentiable casts: the gradients reach the parameters in their own
    dtype, as through autocast's casts). Each cast is made once a call, from the parameter as it is
    then."""

    def experts_forward(self, hidden_states, *args, **kwargs):
        device = hidden_states.device.type
        if not torch.compiler.is_compiling() and torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            casts = {}
            for name in WEIGHT_ATTRS:
                param = getattr(self, name, None)
                if isinstance(param, torch.Tensor) and param.is_floating_point() and param.dtype != dtype:
                    casts[name] = param.to(dtype)
            if casts:
                return forward(_CastView(self, casts), hidden_states, *args, **kwargs)
        return forward(self, hidden_states, *args, **kwargs)

    experts_forward._tigon = True
    return experts_forward


# ----------------------------------------------------------------------------------- class checks


@functools.cache
def _dispatch_code():
    """The code object of ``use_experts_implementation``'s dispatching ``forward`` (every decorated
    class's forward is a closure of it), or None where transformers has no experts dispatch."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    probe = type("_DispatchProbe", (nn.Module,), {"forward": lambda self: None})
    return moe.use_experts_implementation(probe).forward.__code__


def _default_gate():
    from transformers.integrations import moe

    return getattr(moe, "_default_apply_gate", None)


def _shape(source_or_fn) -> str | None:
    from tigon.patching.residual_joins import statement_shape

    try:
        source = source_or_fn if isinstance(source_or_fn, str) else inspect.getsource(source_or_fn)
        node = ast.parse(textwrap.dedent(source)).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return statement_shape(node) if isinstance(node, ast.FunctionDef) else None


@functools.cache
def _known_loop_shapes():
    return {_shape(source) for source in INLINE_LOOP_VARIANTS.values()}


def eager_kind(cls) -> str | None:
    """How the class's eager loop (the dispatch's body) gates: "gate" (it calls ``self._apply_gate``),
    "inline" (the known loop: :data:`INLINE_LOOP`), or None (neither: tigon leaves it running)."""
    loop = decorator_chains.body(cls.forward)
    if GATE_ATTR in loop.__code__.co_names:
        return "gate"
    return "inline" if _shape(loop) in _known_loop_shapes() else None


def check_class(family, cls) -> str | None:
    """Class-level checks (raise ValueError); returns :func:`eager_kind`."""
    spec = family.experts
    where = f"{family.model_type}: experts: {cls.__name__}"
    code = _dispatch_code()
    if code is None or getattr(cls.forward, "__code__", None) is not code:
        raise ValueError(
            f"{where}.forward is not transformers' experts dispatch (use_experts_implementation): this "
            "version does not match tigon's table; pass mlp=False to patch the rest"
        )
    try:
        kind = eager_kind(cls)
    except decorator_chains.WrapperMismatch as err:
        raise ValueError(f"{where}.forward: {err}") from err
    gate = getattr(cls, GATE_ATTR, None)
    if spec.activation == ACT_FN and gate is not _default_gate():
        raise ValueError(
            f"{where}.{GATE_ATTR} is not transformers' default act_fn(gate) * up: this version does not "
            "match tigon's table; pass mlp=False to patch the rest"
        )
    return kind


# ---------------------------------------------------------------------------------- the forwards


def fused_gate(layout, activation, alpha=None, limit=None):
    """The ``_apply_gate`` tigon sets: ``moe_glu`` on the packed projection. GPT-OSS's α and limit are
    read from the module at each call (as its own gate reads them)."""
    from tigon.ops.moe_glu import moe_glu

    if activation == CLAMPED_SWIGLU:
        def apply_gate(self, gate_up):
            return moe_glu(gate_up, layout=layout, activation=activation, alpha=self.alpha, limit=self.limit)
    else:
        def apply_gate(self, gate_up):
            return moe_glu(gate_up, layout=layout, activation=activation)

    apply_gate._tigon = True
    return apply_gate


def experts_forward(cls, inline_loop: bool):
    """The forward tigon sets on an experts module of class ``cls``: the class's dispatch (around
    :func:`eager_experts_forward` where the class's eager loop gates inline) under :func:`autocast_weights`."""
    inner = decorator_chains.rewrapped(cls.forward, eager_experts_forward) if inline_loop else cls.forward
    return autocast_weights(inner)
