"""The rotary functions a patched attention calls in place of transformers' module-level ones, over
``tigon.ops.rope`` (parts/attention.py gives each attention a copy of its class's forward whose globals name one
of these, decorator_chains.with_globals).

- :func:`apply_rotary_pos_emb`: transformers' rotate-half ``apply_rotary_pos_emb``, its output in the autocast
  dtype where that is exact;
- :func:`apply_rotary_pos_emb_stock_dtypes`: the same in transformers' dtypes, for an attention whose rotated
  q/k feed something other than attention (HunYuan's query/key norms);
- :func:`apply_rotary_pos_emb_half_angles`: GPT-OSS's, whose cos/sin hold one angle per rotated pair;
- :func:`apply_rotary_pos_emb_vision`: the Qwen-VL vision towers' (:data:`VISION_ROTARY_SOURCE`).
"""

from __future__ import annotations

import torch


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` over ``tigon.ops.rope``.

    Module level and closure-free, so that torch.compile guards it like any global function.

    Under autocast, q and k come from the projections in the autocast dtype while cos/sin are fp32
    (the rotary embedding takes the fp32 residual stream's dtype), so transformers' result is fp32,
    and attention (sdpa, flash, or eager's matmuls: every interface the patched attention calls)
    casts it to the autocast dtype before any arithmetic. rope writes that copy itself where it is
    exact (:func:`rope_output_dtype`): the values attention reads are the same, rounded once from
    the same fp32 math, and their gradients arrive in that dtype, as the cast's backward would have
    widened them exactly. Saved: the fp32 outputs written and read again by the cast in the forward,
    and the gradients widened to fp32 in the backward (Gemma-2-2B, 4096 tokens: ~130 MB and two
    launches a layer for q). One visible difference: where k is written in the autocast dtype (no
    GQA), a KV cache filled in that forward holds the keys in it, as it holds the values.
    """
    from tigon.ops.rope import rope

    return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, output_dtype=rope_output_dtype(q, k, unsqueeze_dim))


def rope_output_dtype(q, k, unsqueeze_dim):
    """Output dtypes for rope in a patched attention: ``(q's, k's)``, None for transformers' own.

    q's: the autocast dtype when autocast is on and q is in it already (a q that a norm made fp32,
    as Qwen3's q_norm does, keeps transformers' dtype). k's the same, but only when k has as many
    heads as q: with fewer (GQA), eager attention and masked sdpa repeat k's heads before their
    cast (transformers' ``repeat_kv``), and the backward sums the repeats' gradients in k's dtype,
    fp32 in transformers; in the autocast dtype that sum would round once more.
    """
    device_type = q.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    q_dtype = dtype if q.dtype == dtype else None
    heads = 1 if unsqueeze_dim == 1 else 2
    k_dtype = dtype if k.dtype == dtype and k.shape[heads] == q.shape[heads] else None
    return q_dtype, k_dtype


def apply_rotary_pos_emb_half_angles(q, k, cos, sin, unsqueeze_dim=1):
    """A family's ``apply_rotary_pos_emb`` whose cos/sin hold one angle per rotated pair (GPT-OSS).

    GPT-OSS's rotary embedding returns ``cos(freqs)``, ``sin(freqs)`` of width ``D/2`` and its
    ``_apply_rotary_emb`` rotates the two halves of q and k::

        first  = x1 * cos - x2 * sin
        second = x2 * cos + x1 * sin

    which is rotate-half, ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``, element for element.
    So tigon's rope runs on the duplicated angles (``[B, T, D]``, a small copy beside q and k).
    """
    cos = torch.cat((cos, cos), dim=-1)  # (B, T, D)
    sin = torch.cat((sin, sin), dim=-1)
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def apply_rotary_pos_emb_stock_dtypes(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' ``apply_rotary_pos_emb`` over ``tigon.ops.rope``, results in transformers' dtypes.

    For an attention whose rotated q and k go into something other than attention first: HunYuan
    normalises them (``query_layernorm`` / ``key_layernorm``) after the rotation. Under autocast
    transformers' rotation gives fp32 there (fp32 cos/sin), and the norm reads that fp32 value; a bf16
    copy (:func:`apply_rotary_pos_emb`'s autocast output) would round it before the norm.
    """
    from tigon.ops.rope import rope

    return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def tigon_rotary(*, half_angles: bool = False, autocast_output: bool = True):
    """The rotary function a patched attention calls (families.Family.rotary_half_angles and
    rope_autocast_output)."""
    if half_angles:
        if not autocast_output:
            raise ValueError("a family row with rotary_half_angles must keep rope_autocast_output")
        return apply_rotary_pos_emb_half_angles
    return apply_rotary_pos_emb if autocast_output else apply_rotary_pos_emb_stock_dtypes


# transformers' ``apply_rotary_pos_emb_vision`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL vision towers), 5.17 to 5.24:
# q, k ``[S, H, D]`` and cos, sin ``[S, D]`` upcast to fp32, rotated (rotate_half), each rounded once to
# q's / k's dtype. parts/vision.py patches a vision attention only where its module's function is this one.
VISION_ROTARY_SOURCE = '''
def apply_rotary_pos_emb_vision(q, k, cos, sin):
    orig_q_dtype = q.dtype
    orig_k_dtype = k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    q_embed = q_embed.to(orig_q_dtype)
    k_embed = k_embed.to(orig_k_dtype)
    return q_embed, k_embed
'''


def apply_rotary_pos_emb_vision(q, k, cos, sin):
    """transformers' ``apply_rotary_pos_emb_vision`` (:data:`VISION_ROTARY_SOURCE`) over ``tigon.ops.rope``.

    The packed patches of a vision tower are one sequence of ``S`` positions: ``[1, S, H, D]`` with
    ``unsqueeze_dim=2``. rope computes in fp32 and rounds once to the output dtype, which is asked to be
    q's and k's, as the transformers function's upcast and cast back do.
    """
    from tigon.ops.rope import rope

    q_out, k_out = rope(q[None], k[None], cos, sin, unsqueeze_dim=2, output_dtype=(q.dtype, k.dtype))
    return q_out[0], k_out[0]


# The module-level rotary functions an attention forward may call, and tigon's stand-in for each.
ROTARIES = {"apply_rotary_pos_emb": apply_rotary_pos_emb, "apply_rotary_pos_emb_vision": apply_rotary_pos_emb_vision}
# Those whose transformers source is checked first (parts/attention.py's check_rotary); the text one is
# transformers' canonical rotate-half.
ROTARY_SOURCES = {"apply_rotary_pos_emb_vision": VISION_ROTARY_SOURCE}
