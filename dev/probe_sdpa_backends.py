"""Which sdpa backend PyTorch picks for a decoder's causal attention on the qkv projection's views, and whether
calling that backend's aten forward and backward directly gives F.scaled_dot_product_attention's results
(what a fused attention node would need to run sdpa without a graph of its own).

    python dev/probe_sdpa_backends.py
"""
import time

import torch
import torch.nn.functional as F

aten = torch.ops.aten
torch.manual_seed(0)
for (B, Hq, Hk, T, D) in [(4, 14, 2, 2048, 64), (4, 32, 8, 2048, 64), (2, 8, 8, 512, 128)]:
    s = D ** -0.5
    qkv = torch.randn(B, T, Hq + 2 * Hk, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = [t.transpose(1, 2) for t in qkv.split_with_sizes((Hq, Hk, Hk), dim=2)]
    gqa = Hk != Hq
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=s, enable_gqa=gqa)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=s, enable_gqa=gqa)
    dout = torch.randn_like(ref)
    print((B, Hq, Hk, T, D), "choice", choice, "grad_fn", type(ref.grad_fn).__name__,
          [type(n[0]).__name__ for n in ref.grad_fn.next_functions if n[0] is not None])
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    try:
        if choice == 3:
            out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=s)
            g = aten._scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out[0], out[1], out[6], out[7], None,
                                                                  out[2], out[3], out[4], out[5], 0.0, True, scale=s)
        elif choice == 1:
            out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=s)
            g = aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out[0], out[1], out[2], out[3], out[4],
                                                                  out[5], 0.0, True, out[6], out[7], scale=s)
        else:
            print("  other backend")
            continue
        print("  out equal", torch.equal(out[0], ref), "strides", out[0].stride(), ref.stride(),
              "grads equal", [torch.equal(a, b) for a, b in zip(g, ref_grads, strict=True)])
    except Exception as e:
        print("  direct call failed:", repr(e)[:300])
    # host cost: nested autograd.grad against the direct backward
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            r = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=s, enable_gqa=gqa)
        torch.autograd.grad(r, leaves, dout)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"  nested fwd+grad issue {(t1 - t0) / 50 * 1e6:.0f} us/call (GPU-bound at this size)")
