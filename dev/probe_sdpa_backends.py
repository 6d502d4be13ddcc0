"""tigon.nn.attention against F.scaled_dot_product_attention on the GPU: for each backend (forced with
sdpa_kernel, and sdpa's own choice), a decoder's two calls (causal without a mask, grouped heads native; a boolean
padding mask with k and v repeated), whether attend / attend_backward give sdpa's output and gradients bit for bit,
and which backend sdpa picks by default.

    PYTHONPATH=src python dev/probe_sdpa_backends.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tigon.nn.attention import attend, attend_backward, repeat_heads

torch.manual_seed(0)
BACKENDS = (None, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)

for (B, Hq, Hk, T, D) in [(4, 14, 2, 2048, 64), (4, 32, 8, 2048, 64), (2, 8, 8, 301, 128), (3, 14, 2, 77, 64)]:
    s = D ** -0.5
    qkv = torch.randn(B, T, Hq + 2 * Hk, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = [t.transpose(1, 2) for t in qkv.split_with_sizes((Hq, Hk, Hk), dim=2)]
    keys = torch.ones(B, T, dtype=torch.bool, device="cuda")
    keys[0, : T // 3] = False
    keys[-1, -5:] = False
    mask = torch.ones(T, T, dtype=torch.bool, device="cuda").tril()[None, None] & keys[:, None, None, :]
    for masked in (False, True):
        groups = Hq // Hk if masked else 1
        kk, vv = (repeat_heads(k, groups), repeat_heads(v, groups)) if groups > 1 else (k, v)
        gqa = not masked and Hk != Hq
        for backend in BACKENDS:
            with sdpa_kernel(backend) if backend is not None else torch.enable_grad():
                try:
                    choice = torch._fused_sdp_choice(q, kk, vv, mask if masked else None, 0.0, not masked, scale=s,
                                                     enable_gqa=gqa)
                except RuntimeError as e:  # the forced backend cannot take this call
                    print((B, Hq, Hk, T, D), "masked" if masked else "causal", backend, "no kernel:", str(e)[:60])
                    continue
                leaves = [t.detach().requires_grad_() for t in (q, kk, vv)]
                try:
                    ref = F.scaled_dot_product_attention(*leaves, attn_mask=mask if masked else None,
                                                         is_causal=not masked, scale=s, enable_gqa=gqa)
                except RuntimeError as e:
                    print((B, Hq, Hk, T, D), "masked" if masked else "causal", backend, "sdpa refuses:", str(e)[:60])
                    continue
                dout = torch.randn_like(ref)
                ref_grads = torch.autograd.grad(ref, leaves, dout)
                ref_again = torch.autograd.grad(
                    F.scaled_dot_product_attention(*leaves, attn_mask=mask if masked else None, is_causal=not masked,
                                                   scale=s, enable_gqa=gqa), leaves, dout)
                result = attend(q, kk, vv, s, gqa=gqa, mask=mask if masked else None)
                call = "masked" if masked else "causal"
                tag = f"{(B, Hq, Hk, T, D)} {call} forced={getattr(backend, 'name', None)} choice={choice} " \
                      f"({type(ref.grad_fn).__name__})"
                if result is None:
                    print(tag, "-> not called here")
                    continue
                out, saved, sizes = result
                grads = attend_backward(dout, q, kk, vv, out, saved, sizes, s)
                print(tag, "out equal", torch.equal(out, ref), "grads equal",
                      [torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True)],
                      "sdpa twice equal", [torch.equal(a, b) for a, b in zip(ref_again, ref_grads, strict=True)],
                      f"dq max diff {(grads[0].float() - ref_grads[0].float()).abs().max().item():.2e}")
