"""Residual joins: a decoder layer's residual adds run fused with the norms next to them, as tigon ops.

Three layer layouts do it, named in the family table (``joined_layer``):

- **pre_norm** (Llama, Mistral, Qwen2/3, Gemma, SmolLM3, Qwen3-MoE): the attention's output joins the
  residual stream and the MLP's pre-norm reads the sum at once::

      hidden_states = residual + hidden_states
      residual = hidden_states
      hidden_states = self.post_attention_layernorm(hidden_states)

  :func:`pre_norm_layer_forward` runs the two as :func:`tigon.ops.add_rms_norm` (the sum in torch's
  promotion: a bf16 attention output joins an fp32 stream in fp32, as the add does). The layer's
  last add feeds the next layer's input norm, which another layer's forward calls: it stays an add.
- **sandwich** (Gemma-2, Gemma-3): a pre-norm before each sublayer and a post-norm after it, so the
  first join is followed at once by the MLP's pre-norm::

      hidden_states = self.post_attention_layernorm(hidden_states)
      hidden_states = residual + hidden_states
      residual = hidden_states
      hidden_states = self.pre_feedforward_layernorm(hidden_states)
      ...
      hidden_states = self.post_feedforward_layernorm(hidden_states)
      hidden_states = residual + hidden_states

  :func:`sandwich_layer_forward` runs the first join and its norm as
  :func:`tigon.ops.sandwich_norm_join` and the second as :func:`tigon.ops.post_norm_join`.
- **post_norm** (OLMo-2, OLMo-3): post-norms only; both joins are :func:`tigon.ops.post_norm_join`
  (:func:`post_norm_layer_forward`).
- **vision_pre_norm** (Qwen2.5-VL's vision blocks, RMSNorm): pre-norm with the adds written inline,
  ``hidden_states = hidden_states + self.attn(self.norm1(hidden_states), ...)`` then
  ``hidden_states + self.mlp(self.norm2(hidden_states))``; the first add and norm2 run as
  :func:`tigon.ops.add_rms_norm` (:func:`vision_block_forward`). In a vision tower the GPU work of a
  block is a few µs a kernel (784 patches of 1280 for a 392 x 392 image), so what a join saves there
  is chiefly the host's launch and autograd node, forward and backward.

With the norms swapped for tigon's, each add stays a kernel of its own, as do, in the backward,
autograd's sum of the residual stream's two gradients (sandwich, pre_norm) and its cast of the add's
gradient to the norm's dtype (Gemma-2-2B, 4096 tokens under autocast: ~0.3 GB moved and five launches
a layer). Fused, the norm's backward adds the stream's own gradient in the kernel.

The norms part (parts/norms.py) installs the forward on a layer instance (with the ``rms_norm`` switch) only when the
class's forward, seen through its decorators, is statement for statement transformers' own in one of
the known releases (:func:`matched_variant`, on the AST, so comments and annotations do not matter;
the releases differ in the name of the cache argument, :data:`CACHE_NAMES`; a docstring does not
count). The decorators of the class forward stay around tigon's (parts/norms.py rewraps it), so 5.24's
``@deprecate_kwarg`` still takes the old name. A transformers version that changed the layer keeps its
own forward, joins unfused, and ``patch`` warns: it never runs another version's layer.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

from tigon.ops.norm_joins import post_norm_join, sandwich_norm_join
from tigon.ops.rms_norm import add_rms_norm
from tigon.patching import decorator_chains

# The body of transformers' LlamaDecoderLayer.forward, and of Mistral's, Qwen2/3's, Gemma's, SmolLM3's
# and Qwen3-MoE's (5.17 to 5.24; CACHE stands for the key/value cache's argument).
PRE_NORM_FORWARD = '''
def forward(self, hidden_states, attention_mask=None, position_ids=None, CACHE=None, use_cache=False,
            position_embeddings=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    # Self Attention
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        CACHE=CACHE,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = residual + hidden_states

    # Fully Connected
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
'''

# Qwen3-VL's text decoder layer (Qwen3VLTextDecoderLayer, 5.17 to 5.24): the same statements, with the
# rotary embeddings as the second parameter.
PRE_NORM_ROPE_SECOND_FORWARD = PRE_NORM_FORWARD.replace(
    "def forward(self, hidden_states, attention_mask=None, position_ids=None, CACHE=None, use_cache=False,\n"
    "            position_embeddings=None, **kwargs):",
    "def forward(self, hidden_states, position_embeddings, attention_mask=None, position_ids=None, CACHE=None,\n"
    "            use_cache=False, **kwargs):",
)

# The body of transformers' Gemma2DecoderLayer.forward / Gemma3DecoderLayer.forward (5.17 to 5.24).
SANDWICH_FORWARD = '''
def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
            CACHE=None, **kwargs):
    residual = hidden_states

    hidden_states = self.input_layernorm(hidden_states)

    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        position_embeddings=position_embeddings,
        attention_mask=attention_mask,
        position_ids=position_ids,
        CACHE=CACHE,
        **kwargs,
    )
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = residual + hidden_states

    residual = hidden_states
    hidden_states = self.pre_feedforward_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = self.post_feedforward_layernorm(hidden_states)
    hidden_states = residual + hidden_states

    return hidden_states
'''
# The body of transformers' Olmo2DecoderLayer.forward / Olmo3DecoderLayer.forward (5.17 to 5.24).
POST_NORM_FORWARD = '''
def forward(self, hidden_states, attention_mask=None, position_ids=None, CACHE=None, use_cache=False,
            position_embeddings=None, **kwargs):
    residual = hidden_states
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        CACHE=CACHE,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = residual + hidden_states

    # Fully Connected
    residual = hidden_states
    hidden_states = self.mlp(hidden_states)
    hidden_states = self.post_feedforward_layernorm(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
'''

# The body of transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision block forward (5.17 to 5.24): pre-norm,
# with both residual adds written inline.
VISION_BLOCK_FORWARD = '''
def forward(self, hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
    hidden_states = hidden_states + self.attn(
        self.norm1(hidden_states),
        cu_seqlens=cu_seqlens,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = hidden_states + self.mlp(self.norm2(hidden_states))
    return hidden_states
'''


# What the key/value cache argument is called, by transformers release: the one difference between the
# releases in the layer forwards above (5.24 renamed it, with @deprecate_kwarg taking the old name).
CACHE_NAMES = {"past_key_values": "5.17 to 5.23", "cache": "5.24 and later"}


def statement_shape(fn_node: ast.FunctionDef) -> str:
    """What must match: the argument names and the statements, without annotations or defaults."""
    args = fn_node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    rest = (args.vararg.arg if args.vararg else None, args.kwarg.arg if args.kwarg else None)
    statements = fn_node.body
    if statements and isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
        statements = statements[1:]  # a docstring (the Qwen-VL layers document their arguments)
    return repr((names, rest)) + "".join(ast.dump(statement) for statement in statements)


def matched_variant(forward, source) -> str | None:
    """The cache argument name under which ``forward`` (a decoder layer class's, seen through its
    decorators) is the forward written in ``source`` (or in one of the sources of a tuple); None when
    it is none of the known variants.

    A decorator whose wrapper does not call the function it names raises (decorator_chains.WrapperMismatch).
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(decorator_chains.body(forward))))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef):
        return None
    shape = statement_shape(node)
    for text in (source,) if isinstance(source, str) else source:
        for name in CACHE_NAMES:
            if shape == statement_shape(ast.parse(text.replace("CACHE", name)).body[0]):
                return name
    return None


def _add_and_norm(norm, hidden_states, residual):
    """``s = residual + hidden_states`` and ``norm(s)``, as the add and the tigon RMSNorm module would."""
    return add_rms_norm(
        hidden_states, residual, norm.weight, norm.variance_epsilon, offset=norm.offset, casting=norm.casting,
        out_dtype=norm.output_dtype(residual),
    )


def _join(post, hidden_states, residual):
    """``residual + post(hidden_states)``, as the tigon RMSNorm module ``post`` and the add would."""
    return post_norm_join(
        hidden_states, residual, post.weight, post.variance_epsilon, offset=post.offset, casting=post.casting
    )


def _join_and_norm(post, pre, hidden_states, residual):
    """``s = residual + post(hidden_states)`` and ``pre(s)``, as the two tigon RMSNorm modules would."""
    return sandwich_norm_join(
        hidden_states, residual, post.weight, pre.weight, post.variance_epsilon, next_eps=pre.variance_epsilon,
        offset=post.offset, casting=post.casting, out_dtype=pre.output_dtype(residual),
    )


class AttentionArguments:
    """What each layer forward above hands its attention: every named argument of the layer's forward
    but ``hidden_states``, given or defaulted, plus the extra keywords. (The sources show it: each
    passes all of them on, and nothing else.) Read from the class forward's own signature, so the
    tigon forwards below need not name the cache argument, which moved between releases."""

    def __init__(self, forward):
        self.positional, self.defaults = decorator_chains.named_parameters(forward, skip=2)  # after self, hidden_states

    def __call__(self, args, kwargs):
        return decorator_chains.bind(self.positional, self.defaults, args, kwargs)


def pre_norm_layer_forward(arguments: AttentionArguments):
    """transformers' pre-norm decoder layer (PRE_NORM_FORWARD) with its first join fused."""

    def forward(self, hidden_states, *args, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **arguments(args, kwargs))
        hidden_states, residual = _add_and_norm(self.post_attention_layernorm, hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states

    return forward


def sandwich_layer_forward(arguments: AttentionArguments):
    """transformers' sandwich decoder layer (SANDWICH_FORWARD) with its residual joins fused."""

    def forward(self, hidden_states, *args, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **arguments(args, kwargs))
        hidden_states, residual = _join_and_norm(
            self.post_attention_layernorm, self.pre_feedforward_layernorm, hidden_states, residual
        )
        hidden_states = self.mlp(hidden_states)
        return _join(self.post_feedforward_layernorm, hidden_states, residual)

    return forward


def post_norm_layer_forward(arguments: AttentionArguments):
    """transformers' post-norm decoder layer (POST_NORM_FORWARD) with its residual joins fused."""

    def forward(self, hidden_states, *args, **kwargs):
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **arguments(args, kwargs))
        residual = _join(self.post_attention_layernorm, hidden_states, residual)
        hidden_states = self.mlp(residual)
        return _join(self.post_feedforward_layernorm, hidden_states, residual)

    return forward


def vision_block_forward(arguments: AttentionArguments):
    """transformers' Qwen-VL vision block (VISION_BLOCK_FORWARD) with its first join fused: the attention's
    output joins the stream (``hidden_states + attn``, the stock add's order) and norm2 reads the sum."""

    def forward(self, hidden_states, *args, **kwargs):
        attended = self.attn(self.norm1(hidden_states), **arguments(args, kwargs))
        normed, hidden_states = _add_and_norm(self.norm2, attended, hidden_states)
        return hidden_states + self.mlp(normed)

    return forward


@dataclass(frozen=True)
class JoinedLayer:
    """A layer layout: transformers' forward (source, with CACHE for the cache argument's name; a tuple
    where the families of one layout write their forwards' parameters in different orders), the norms
    it calls, the maker of tigon's forward for a class forward, and what the patch report says."""

    source: str | tuple
    norms: tuple[str, ...]
    make_forward: object
    ops: str

    def forward_for(self, class_forward):
        """tigon's forward for a layer class whose forward is this layout's (decorators not included)."""
        forward = self.make_forward(AttentionArguments(decorator_chains.body(class_forward)))
        forward._tigon = True
        return forward


LAYOUTS = {
    "pre_norm": JoinedLayer(
        (PRE_NORM_FORWARD, PRE_NORM_ROPE_SECOND_FORWARD), ("input_layernorm", "post_attention_layernorm"),
        pre_norm_layer_forward,
        "tigon.ops.add_rms_norm",
    ),
    "sandwich": JoinedLayer(
        SANDWICH_FORWARD,
        ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
        sandwich_layer_forward, "tigon.ops.sandwich_norm_join / post_norm_join",
    ),
    "post_norm": JoinedLayer(
        POST_NORM_FORWARD, ("post_attention_layernorm", "post_feedforward_layernorm"), post_norm_layer_forward,
        "tigon.ops.post_norm_join",
    ),
    "vision_pre_norm": JoinedLayer(
        VISION_BLOCK_FORWARD, ("norm1", "norm2"), vision_block_forward, "tigon.ops.add_rms_norm",
    ),
}
