"""TRL's fused LM head on tigon's op: ``tigon.patch_trl()``.

TRL (1.x) gives a model a fused LM head with ``trl.trainer.utils.add_fused_lm_head``: called with
``fused_lm_head=True``, the model runs its backbone and scores each next-token label through
``_ChunkedLogProbFunction`` (trl/kernels/chunked_logprob.py) without holding the ``[N, V]`` logits.
The SFT, DPO, KTO, GRPO and RLOO trainers (and the experimental async GRPO) all score tokens that
way. The head's forward (``_fused_forward``, a closure made by ``add_fused_lm_head``) looks the
function up in ``trl.trainer.utils``' globals on every call, inside the contexts that set up the
head's weight::

    with autocast_ctx, maybe_gather_lm_head_ctx(weight, bias):
        per_token = _ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature,
                                                  chunk_size, final_logit_softcapping, logit_scale, outputs)
    log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = per_token

``patch_trl()`` replaces that one global with ``TigonLogProbHead``, whose ``apply`` takes the same
arguments and computes with ``tigon.ops.fused_linear_logprobs``' pass
(``fused_linear_token_stats``). Only the computation changes: TRL still picks the tokens (on
CUDA/XPU only those with a label, elsewhere every position with its label clamped to 0, masked
afterwards), casts the hidden states to fp32 and turns autocast off for ``cast_lm_head_to_fp32``,
gathers the FSDP2 head into a plain tensor, gathers a ZeRO-3 head around the call, and scatters the
per-token results back into ``[B, T]`` with zeros where the label is -100. Heads added before the call
and after it both read the global at call time, so both compute with tigon; ``revert()`` puts TRL's
function back.

The arguments and outputs, with ``z = softcap·tanh(logit_scale·(h·Wᵀ + b) / softcap) / temperature``
(the softcap step only when ``final_logit_softcapping`` is set), as TRL defines them:

=================================== ==========================================================
TRL                                  tigon
=================================== ==========================================================
``hidden [N, H]``, ``weight [V, H]``  ``input``, ``linear_weight``; without autocast TRL computes
``bias [V]``                          in the hidden states' dtype, so a weight of another dtype is
                                      cast to it (under autocast both go to the autocast dtype, as
                                      ``F.linear`` casts them)
``targets [N]``                       ``target`` (never -100: TRL has dropped or clamped those)
``temperature``                       ``temperature``
``chunk_size``                        unused: tigon tiles the vocabulary itself
``final_logit_softcapping``           ``softcap`` (TRL reads a falsy cap as 1.0 when it is not None)
``logit_scale``                       ``logit_scale`` (applied before the softcap)
``log_probs``                         ``logprobs = log_softmax(z)[target]``, fp32, with gradient
``entropy``                           ``−Σ_v p_v log p_v``, fp32, with gradient
``log_sum_sq_probs``                  ``log Σ_v p_v²``, fp32, detached
``mean_logits``                       ``Σ_v z_v / V`` of the temperature-scaled logits, detached
``is_top1``                           bool: the target is the first index of ``max_v z_v``
                                      (a tie with an earlier token does not count), detached
=================================== ==========================================================

A field not in ``outputs`` is None, as in TRL; ``log_probs`` is always computed.

ZeRO-3: TRL's function gathers the partitioned head again in its backward, which recomputes the
logits, since DeepSpeed may have released the weight's data after the call. tigon's op recomputes
its chunks from the weight it saved, so for a partitioned weight (a ``ds_id`` attribute) the op runs
inside ``_GatheredInBackward``, whose backward enters TRL's ``maybe_gather_lm_head_ctx`` and runs
the op's own backward inside it: the weight is gathered exactly when TRL's function would have it
gathered. (DeepSpeed 0.19 also registers a weight read outside its module with the running root
module, which keeps it gathered through that module's backward; the re-gather does not rely on it.)
The op's graph there starts at the hidden states detached, so that its backward's gradient to a weight
tied to the input embedding is the head's part only (the backbone's part is the outer backward's).
Other weights (plain ones, FSDP2's gathered ``full_tensor()``) go to the op directly.

Recognising the head: ``patch_trl`` reads TRL's source (through ``inspect.unwrap``, so decorators do
not hide it) and requires the statements above and those that define each output, as TRL 1.16
writes them (``RECOGNISED``); a TRL whose head differs raises ValueError naming what it did not
find, and nothing is patched.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import sys
import textwrap

import torch

from tigon.ops.fused_linear_logprobs import fused_linear_token_stats
from tigon.patching.patch_handle import Patch, Plan, SetAttr, apply_plan

logger = logging.getLogger("tigon.patching")

TRL_UTILS = "trl.trainer.utils"
HEAD_GLOBAL = "_ChunkedLogProbFunction"
HEAD_CALLER = "_fused_forward"
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
OPTIONAL_OUTPUTS = OUTPUTS[1:]
IGNORE_INDEX = -100  # the label TRL masks (hard-coded in add_fused_lm_head)
APPLY_PARAMETERS = ("ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                    "final_logit_softcapping", "logit_scale", "outputs")

# What patch_trl requires of TRL's source, function by function: statements as ``ast.unparse``
# writes them (comments and formatting do not count), each of which must appear in that function.
# They are TRL 1.16's: the head's call and the order of its outputs, then what each output means
# (the transform of the logits, the compute dtype, the definitions of the five fields).
RECOGNISED = {
    "add_fused_lm_head": (
        "with autocast_ctx, maybe_gather_lm_head_ctx(weight, bias):\n"
        "    per_token = _ChunkedLogProbFunction.apply(hidden_states[mask] if compact else "
        "hidden_states.reshape(-1, hidden_states.size(-1)), weight, bias, labels[mask] if compact else "
        "labels.clamp(min=0).reshape(-1), temperature, _CHUNKED_LOGPROB_CHUNK_SIZE, final_logit_softcapping, "
        "logit_scale, outputs)",
        "log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = per_token",
        "mask = labels != -100",
    ),
    "ChunkedLogProbFunction.forward": (
        "compute_dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) "
        "else hidden.dtype",
        "kernel_args = {'logit_scale': logit_scale, 'softcap': final_logit_softcapping or 1.0, "
        "'inv_t': 1 / temperature, 'HAS_SOFTCAP': final_logit_softcapping is not None}",
        "log_z = running_max + torch.log(sum_exp)",
        "logprobs = target_logit - log_z",
        "entropy = log_z - x_sum_exp / sum_exp if 'entropy' in outputs else None",
        "log_sum_sq_probs = torch.log(sq_sum_exp) - 2 * torch.log(sum_exp) if 'log_sum_sq_probs' in outputs "
        "else None",
        "mean_logits = z_sum / vocab if 'mean_logits' in outputs else None",
        "is_top1 = (target_logit >= running_max) & (target_logit > max_before_target) if 'is_top1' in outputs "
        "else None",
        "ctx.mark_non_differentiable(*(x for x in (log_sum_sq_probs, mean_logits, is_top1) if x is not None))",
        "return (logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1)",
    ),
    "_forward_tile": (
        "z = _torch_transform(tile.float(), logit_scale, softcap, inv_t, HAS_SOFTCAP)",
        "z_sum += z.sum(-1)",
        "before_target = torch.arange(n_cols, device=z.device) < local.unsqueeze(-1)",
        "max_before_target.copy_(torch.maximum(max_before_target, z.masked_fill(~before_target, -math.inf)"
        ".amax(-1)))",
    ),
    "_torch_transform": (
        "z = z * logit_scale",
        "z = softcap * torch.tanh(z / softcap)",
        "return z * inv_t",
    ),
}


# ------------------------------------------------------------------------------------------ the head


def _token_stats(hidden, weight, bias, targets, temperature, softcap, logit_scale, outputs):
    """``fused_linear_token_stats`` with TRL's arguments, as TRL's five fields (None where not asked)."""
    if not torch.is_autocast_enabled(hidden.device.type) and weight.dtype != hidden.dtype:
        # TRL multiplies in the hidden states' dtype outside autocast (cast_lm_head_to_fp32 included)
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
    extras = any(name in outputs for name in OPTIONAL_OUTPUTS[1:])
    stats = fused_linear_token_stats(
        hidden, weight, targets, linear_bias=bias, temperature=temperature, softcap=softcap,
        logit_scale=logit_scale, ignore_index=IGNORE_INDEX, entropy="entropy" in outputs, extras=extras,
    )
    return tuple(value if name == "log_probs" or name in outputs else None
                 for name, value in zip(OUTPUTS, stats, strict=True))


class _GatheredInBackward(torch.autograd.Function):
    """The op on a ZeRO-3 partitioned head: its graph is built in the forward (where TRL has gathered
    the weight), and its backward runs inside ``maybe_gather_lm_head_ctx`` again, as TRL's own
    function re-gathers for its backward. The op saved the ``Parameter`` itself, whose data
    DeepSpeed swaps back in there."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, *args):
        ctx.set_materialize_grads(False)
        # The inner graph starts at a detached copy of the hidden states: built on ``hidden`` itself, it
        # would reach back through the backbone, and with tied embeddings (the head's weight also the
        # embedding's) the backward's ``autograd.grad`` to the weight would run the whole backbone's
        # backward inside this node (freeing its graph before the outer backward gets there).
        hidden = hidden.detach().requires_grad_(hidden.requires_grad)
        with torch.enable_grad():
            ctx.outputs = _token_stats(hidden, weight, bias, *args)
        ctx.inputs = (hidden, weight, bias)
        fields = tuple(None if x is None else x.detach() for x in ctx.outputs)
        ctx.mark_non_differentiable(*(x for x in fields[2:] if x is not None))
        return fields

    @staticmethod
    def backward(ctx, *grads):
        # log_probs and entropy carry gradients; the other fields are detached
        live = [(out, g) for out, g in zip(ctx.outputs[:2], grads[:2], strict=True) if g is not None]
        outs, out_grads = [out for out, _ in live], [g for _, g in live]
        needed = [need and x is not None for x, need in zip(ctx.inputs, ctx.needs_input_grad[:3], strict=True)]
        wanted = [x for x, need in zip(ctx.inputs, needed, strict=True) if need]
        found = iter(())
        if outs and wanted:
            gather = importlib.import_module(TRL_UTILS).maybe_gather_lm_head_ctx
            with gather(*ctx.inputs[1:]):
                found = iter(torch.autograd.grad(outs, wanted, out_grads, allow_unused=True))
        in_grads = [next(found, None) if need else None for need in needed]
        ctx.outputs = ctx.inputs = None
        return (*in_grads, *(None,) * (len(ctx.needs_input_grad) - 3))


class TigonLogProbHead:
    """Stands in for ``trl.trainer.utils._ChunkedLogProbFunction``: same ``apply`` arguments, same
    five per-token outputs, computed by ``tigon.ops.fused_linear_token_stats`` (module docstring)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=OPTIONAL_OUTPUTS):
        del chunk_size  # tigon tiles the vocabulary itself
        # TRL: HAS_SOFTCAP = (cap is not None), softcap = cap or 1.0
        softcap = None if final_logit_softcapping is None else (final_logit_softcapping or 1.0)
        args = (targets, temperature, softcap, logit_scale, tuple(outputs))
        if hasattr(weight, "ds_id") and torch.is_grad_enabled():  # ZeRO-3: gathered only while the head runs
            return _GatheredInBackward.apply(hidden, weight, bias, *args)
        return _token_stats(hidden, weight, bias, *args)


# ------------------------------------------------------------------------------------ recognition


def _statements(fn) -> set[str]:
    """Every statement of ``fn`` (nested ones included), as ``ast.unparse`` writes it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    return {ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.stmt)}


def _nested_code(code, name):
    for const in code.co_consts:
        if inspect.iscode(const):
            if const.co_name == name:
                return const
            found = _nested_code(const, name)
            if found is not None:
                return found
    return None


def is_fused_head(forward) -> bool:
    """Whether ``forward`` (a model's instance forward) is TRL's fused LM head: ``add_fused_lm_head``'s
    ``_fused_forward`` bound to the model (a TRL trainer adds it to the model it trains). False where TRL
    is not imported, as no model can hold its head then."""
    code = getattr(getattr(forward, "__func__", None), "__code__", None)
    add_head = getattr(sys.modules.get(TRL_UTILS), "add_fused_lm_head", None)
    if code is None or code.co_name != HEAD_CALLER or add_head is None:
        return False
    add_head = inspect.unwrap(add_head)
    return inspect.isfunction(add_head) and code is _nested_code(add_head.__code__, HEAD_CALLER)


def _differences(utils, original) -> list[str]:
    """What in this TRL differs from the head tigon recognises (empty: recognised)."""
    kernels = importlib.import_module(original.__module__)
    add_head = inspect.unwrap(getattr(utils, "add_fused_lm_head", None))
    found = []
    if not inspect.isfunction(add_head):
        return [f"{TRL_UTILS}.add_fused_lm_head is missing or not a function"]
    if add_head.__globals__ is not vars(utils):
        found.append(f"add_fused_lm_head is not defined in {TRL_UTILS}, whose {HEAD_GLOBAL} tigon replaces")
    caller = _nested_code(add_head.__code__, HEAD_CALLER)
    if caller is None or HEAD_GLOBAL not in caller.co_names:
        found.append(f"add_fused_lm_head's {HEAD_CALLER} does not look up the global {HEAD_GLOBAL} at call time")
    parameters = tuple(inspect.signature(original.forward).parameters)
    if parameters != APPLY_PARAMETERS:
        found.append(f"{original.__name__}.forward takes {parameters}, not {APPLY_PARAMETERS}")
    if tuple(getattr(kernels, "OPTIONAL_OUTPUTS", ())) != OPTIONAL_OUTPUTS:
        found.append(f"{kernels.__name__}.OPTIONAL_OUTPUTS is not {OPTIONAL_OUTPUTS}")
    functions = {
        "add_fused_lm_head": add_head,
        "ChunkedLogProbFunction.forward": original.forward,
        "_forward_tile": getattr(kernels, "_forward_tile", None),
        "_torch_transform": getattr(kernels, "_torch_transform", None),
    }
    for where, statements in RECOGNISED.items():
        fn = functions[where]
        try:
            present = _statements(fn)
        except (TypeError, OSError, SyntaxError) as err:
            found.append(f"cannot read the source of {where}: {err}")
            continue
        found += [f"{where} lacks `{s}`" for s in statements if s not in present]
    return found


def _trl_head():
    """``trl.trainer.utils`` and TRL's own head function (its ``ChunkedLogProbFunction``)."""
    utils = importlib.import_module(TRL_UTILS)
    kernels = importlib.import_module("trl.kernels.chunked_logprob")
    return utils, getattr(kernels, "ChunkedLogProbFunction", None)


def patch_trl() -> Patch:
    """Make TRL's fused LM head (``add_fused_lm_head``) compute with tigon's fused log-prob op.

    Returns a ``Patch``; ``revert()`` restores TRL's ``_ChunkedLogProbFunction``. Patching twice is a
    no-op (an empty ``Patch``). Raises ValueError, patching nothing, when this TRL's head is not the
    one tigon recognises or when something else has already replaced TRL's function.
    """
    utils, original = _trl_head()
    version = getattr(importlib.import_module("trl"), "__version__", "?")
    current = vars(utils).get(HEAD_GLOBAL)
    target = f"TRL {version} fused LM head"
    if current is TigonLogProbHead:
        logger.info("tigon: %s: nothing to replace (already patched)", target)
        return Patch(target, [], [])
    if original is None or current is not original:
        raise ValueError(
            f"tigon.patch_trl: {TRL_UTILS}.{HEAD_GLOBAL} is {current!r}, not TRL's ChunkedLogProbFunction "
            f"(another patch replaced it, or TRL {version} moved it); nothing was patched")
    differences = _differences(utils, original)
    if differences:
        raise ValueError(
            f"tigon.patch_trl: TRL {version}'s fused LM head is not the one tigon recognises (TRL 1.16's); "
            "nothing was patched. Differences:\n  " + "\n  ".join(differences))
    plan = Plan()
    plan.add(SetAttr(utils, HEAD_GLOBAL, TigonLogProbHead),
             f"{TRL_UTILS}.{HEAD_GLOBAL} -> tigon.ops.fused_linear_logprobs "
             "(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)")
    return apply_plan(plan, target, logging.INFO)
