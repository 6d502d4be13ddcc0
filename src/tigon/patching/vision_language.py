"""Vision-language models (``...ForConditionalGeneration``): where a row's parts sit, and what the engine
checks before it patches them.

Such a model is ``<vlm>.model.language_model`` (the decoder; SmolVLM's ``text_model``), the vision side
(every other child of ``<vlm>.model``: the vision tower and the projector) and ``<vlm>.lm_head``. The engine patches

- the language model as the text family's row says: the row's own text parts (Qwen-VL, Gemma-3, Mllama
  name theirs in the VLM's modeling module), or, for a row with ``text_from_config`` (LLaVA, PaliGemma,
  SmolVLM, InternVL, whose decoder transformers builds with ``AutoModel.from_config(config.text_config)``),
  the parts of the row of ``config.text_config.model_type``;
- the vision side with the row's :class:`~tigon.patching.families.Vision` parts, as a row of its own
  (:func:`vision_family`): its norms, its gated MLPs, and the attention whose forward calls the
  module-level ``apply_rotary_pos_emb_vision`` (only where that function is transformers' upcasting
  one, :func:`matches_source`);
- the loss in the ``ForConditionalGeneration`` forward, through loss_forward.py's generic forward: every VLM
  forward of 5.17 to 5.25 runs ``self.model``, takes ``outputs[0]``, projects it with ``lm_head`` and
  calls ``self.loss_function`` as the CausalLMs do; the differences are the output class (the one the
  stock forward returns, :func:`returned_class`), ``labels`` handed to ``self.model`` (Gemma-3's
  builds its bidirectional image mask from them) and PaliGemma's final-logit softcapping.

The two halves are patched over disjoint subtrees (:class:`Subtrees`), so a norm class shared by the
decoder and the vision tower (Qwen2.5-VL's) is planned once in each place.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

from torch import nn

from tigon.patching import decorator_chains
from tigon.patching.families import Family

VISION_ROTARY = "apply_rotary_pos_emb_vision"


def vision_family(family: Family) -> Family:
    """The row's vision side as a row of its own (no loss; its block as the decoder layer, for the
    projection norms and the residual joins): what the parts' norm, MLP and rope planners read."""
    vision = family.vision
    return Family(
        model_type=f"{family.model_type} (vision)", package=family.package, causal_lm=None, model=None,
        norm=vision.norm, mlp=vision.mlp, attention=vision.attention, layer_norm=vision.layer_norm,
        rotary=VISION_ROTARY, decoder_layer=vision.block, projection_norms=vision.projection_norms,
        joined_layer=vision.joined_block,
    )


def _statements(fn_node) -> str:
    statements = fn_node.body
    if statements and isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
        statements = statements[1:]
    args = fn_node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    return repr(names) + "".join(ast.dump(s) for s in statements)


def matches_source(fn, source: str) -> bool:
    """Whether ``fn``'s body is, statement for statement, the function written in ``source`` (argument
    names and statements; annotations, defaults, docstring and comments aside)."""
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(decorator_chains.body(fn)))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    return isinstance(node, ast.FunctionDef) and _statements(node) == _statements(ast.parse(source).body[0])


def returned_class(forward):
    """The output class the stock forward's body returns (``return SomeOutput(...)``), looked up in its
    module; None if it returns anything else, or more than one class."""
    inner = decorator_chains.body(forward)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inner)))
    except (OSError, TypeError, SyntaxError):
        return None
    names = {
        node.value.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
    }
    if len(names) != 1:
        return None
    cls = inner.__globals__.get(names.pop())
    return cls if isinstance(cls, type) and dataclasses.is_dataclass(cls) else None


def language_model(model, family: Family, base_cls):
    """``(base, decoder)``: the VLM's base model (``<vlm>.model``, or the model itself) and its language
    model (the row's ``language_model`` attribute of it)."""
    base = model if isinstance(model, base_cls) else getattr(model, "model", None)
    decoder = getattr(base, family.language_model, None)
    if not isinstance(base, base_cls) or not isinstance(decoder, nn.Module):
        raise ValueError(
            f"{family.model_type}: {type(model).__name__} has no .model.{family.language_model} module under a "
            f"{base_cls.__name__}: not the layout tigon knows"
        )
    return base, decoder


class Subtrees:
    """The part of a module tree outside some subtrees, as ``sites.sites`` walks a root: ``modules()``
    and ``named_modules()`` of ``root`` without those under ``exclude`` (the vision side of a VLM: its
    ``.model`` without the language model)."""

    def __init__(self, root: nn.Module, exclude: nn.Module, prefix: str = "model"):
        self.root, self.exclude, self.prefix = root, exclude, prefix

    def named_modules(self, remove_duplicate: bool = True):
        skip = {id(m) for m in self.exclude.modules()}
        seen = set()
        for name, module in self.root.named_modules(remove_duplicate=False):
            if id(module) in skip or (remove_duplicate and id(module) in seen):
                continue
            seen.add(id(module))
            yield (f"{self.prefix}.{name}" if name else self.prefix), module

    def modules(self):
        for _, module in self.named_modules():
            yield module
