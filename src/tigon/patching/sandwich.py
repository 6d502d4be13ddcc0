"""Sandwich-norm decoder layers (Gemma-2, Gemma-3): the residual joins as one tigon op each.

transformers' layer normalises each sublayer's output before adding it to the residual stream, and
normalises the sum again for the MLP::

    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.pre_feedforward_layernorm(hidden_states)
    ...
    hidden_states = self.post_feedforward_layernorm(hidden_states)
    hidden_states = residual + hidden_states

With the norms swapped for tigon's, the adds stay separate kernels, as do, in the backward,
autograd's sum of the residual stream's two gradients and its cast of the add's gradient to the
norm's dtype (Gemma-2-2B, 4096 tokens under autocast: ~0.3 GB moved and five launches a layer).
:func:`sandwich_layer_forward` runs the same layer with :func:`tigon.ops.rms_norm_add_rms_norm` for
the first join and its norm and :func:`tigon.ops.rms_norm_add` for the second.

The engine installs it on a layer instance (with the ``rms_norm`` switch, where the family row says
``sandwich_layer``) only when the class's forward is, statement for statement, the one above
(:func:`matches_sandwich_forward`, on the AST, so comments and annotations do not matter): a
transformers version that changed the layer makes ``patch`` raise rather than run another layer.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from tigon.ops.rms_norm_add import rms_norm_add, rms_norm_add_rms_norm

# The body of transformers' Gemma2DecoderLayer.forward / Gemma3DecoderLayer.forward (5.17 to 5.23).
SANDWICH_FORWARD = '''
def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
            past_key_values=None, **kwargs):
    residual = hidden_states

    hidden_states = self.input_layernorm(hidden_states)

    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        position_embeddings=position_embeddings,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
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
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def _shape(fn_node: ast.FunctionDef) -> str:
    """What must match: the argument names and the statements, without annotations or defaults."""
    args = fn_node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    rest = (args.vararg.arg if args.vararg else None, args.kwarg.arg if args.kwarg else None)
    return repr((names, rest)) + "".join(ast.dump(statement) for statement in fn_node.body)


_EXPECTED = _shape(ast.parse(SANDWICH_FORWARD).body[0])


def matches_sandwich_forward(forward) -> bool:
    """Whether ``forward`` (a decoder layer class's) is transformers' sandwich forward above."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    node = tree.body[0] if tree.body else None
    return isinstance(node, ast.FunctionDef) and _shape(node) == _EXPECTED


def _join_and_norm(post, pre, hidden_states, residual):
    """``s = residual + post(hidden_states)`` and ``pre(s)``, as the two tigon RMSNorm modules would."""
    return rms_norm_add_rms_norm(
        hidden_states, residual, post.weight, pre.weight, post.variance_epsilon, next_eps=pre.variance_epsilon,
        offset=post.offset, casting=post.casting, out_dtype=pre.output_dtype(residual),
    )


def sandwich_layer_forward(
    self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, past_key_values=None,
    **kwargs,
):
    """transformers' sandwich decoder layer (SANDWICH_FORWARD) with its residual joins fused."""
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        position_embeddings=position_embeddings,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        **kwargs,
    )
    hidden_states, residual = _join_and_norm(
        self.post_attention_layernorm, self.pre_feedforward_layernorm, hidden_states, residual
    )
    hidden_states = self.mlp(hidden_states)
    post = self.post_feedforward_layernorm
    return rms_norm_add(
        hidden_states, residual, post.weight, post.variance_epsilon, offset=post.offset, casting=post.casting
    )


sandwich_layer_forward._tigon = True
