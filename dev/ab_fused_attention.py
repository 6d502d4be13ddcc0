"""The fused attention node (tigon.patching.fused_attention) against the same patch without it, on the GPU:
the numbers of a few training steps, then host and GPU time per step of the e2e benchmark's models.

    PYTHONPATH=src:. python dev/ab_fused_attention.py [--models qwen2 llama] [--steps 12] [--check-only]

Numbers: tiny Qwen2- and Llama-shaped models (GQA and not, head sizes 64 and 128, with and without q/k/v
biases), bf16 autocast with fp32 weights and bf16 weights, a DynamicCache on and off: the loss and every
gradient of the fused patch against the unfused one (both tigon; the unfused path is tested against
stock elsewhere), relative to the gradient's largest element, and the cached keys and values.

Time: each model of benchmarks/e2e.py with both patches in one process, steps alternating between them
(the host's speed drifts within a run): the host's forward and backward time (no profiler; the GPU
runs behind) and the step's wall time, medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tigon
from tigon.patching import fused_attention


def _tiny(kind, *, kv_heads, head_dim, bias, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    heads = 4
    common = dict(hidden_size=heads * head_dim, intermediate_size=160, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, num_hidden_layers=2, vocab_size=300, head_dim=head_dim,
                  attn_implementation="sdpa")
    if kind == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        config, cls = LlamaConfig(**common, attention_bias=bias), LlamaForCausalLM
    torch.manual_seed(0)
    return cls(config).to("cuda", dtype)


def check() -> bool:
    ok = True
    for kind, kv_heads, head_dim, bias in (("qwen2", 2, 64, True), ("llama", 4, 128, False), ("llama", 1, 64, True)):
        for weights, autocast in ((torch.float32, True), (torch.bfloat16, False)):
            for use_cache in (True, False):
                models = [_tiny(kind, kv_heads=kv_heads, head_dim=head_dim, bias=bias, dtype=weights) for _ in range(2)]
                models[1].load_state_dict(models[0].state_dict())
                tigon.patch(models[0], fused_attention=True)
                tigon.patch(models[1], fused_attention=False)
                ids = torch.randint(300, (3, 37), device="cuda")
                outs = []
                for model in models:
                    model.train()
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                        out = model(input_ids=ids, labels=ids, use_cache=use_cache)
                    out.loss.backward()
                    outs.append(out)
                worst = max(
                    ((a.grad - b.grad).abs().max() / b.grad.abs().max()).item()
                    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True)
                )
                loss_diff = abs(outs[0].loss.item() - outs[1].loss.item())
                cache_diff = 0.0
                if use_cache:
                    for la, lb in zip(outs[0].past_key_values.layers, outs[1].past_key_values.layers, strict=True):
                        cache_diff = max(cache_diff, (la.keys.float() - lb.keys.float()).abs().max().item(),
                                         (la.values.float() - lb.values.float()).abs().max().item())
                good = worst < 2e-2 and loss_diff < 1e-2 and cache_diff < 2e-2
                ok &= good
                print(f"{kind} kv {kv_heads} D {head_dim} bias {bias} weights {weights} autocast {autocast} "
                      f"cache {use_cache}: loss {outs[0].loss.item():.6f} vs {outs[1].loss.item():.6f}, "
                      f"worst grad {worst:.2e}, cache {cache_diff:.2e} {'ok' if good else 'FAIL'}")
    return ok


def timing(model_names, steps):
    from benchmarks.e2e import LR, SEED, batch_for, model_spec

    from tigon.bench.models import build_model

    for name in model_names:
        spec = model_spec(name)
        batch = batch_for(name, None)
        runs = {}
        for fused in (True, False):
            torch.manual_seed(SEED)
            model = build_model(spec.config, device=torch.device("cuda"))
            tigon.patch(model, fused_attention=fused)
            runs[fused] = (model, torch.optim.AdamW(model.parameters(), lr=LR, fused=True))
        ids = torch.randint(spec.config.vocab_size, (batch, 2048), device="cuda")
        times = {True: [], False: []}
        for i in range(steps + 2):
            for fused in (True, False):
                model, optimizer = runs[fused]
                torch.cuda.synchronize()
                start = time.perf_counter()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                forward = time.perf_counter()
                loss.backward()
                backward = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                loss.item()
                end = time.perf_counter()
                if i >= 2:
                    times[fused].append(((forward - start) * 1e3, (backward - forward) * 1e3, (end - start) * 1e3))
        for fused in (True, False):
            rows = times[fused]
            med = [statistics.median(r[j] for r in rows) for j in range(3)]
            print(f"{name} fused_attention={fused}: host forward {med[0]:.1f} ms, backward {med[1]:.1f} ms; "
                  f"step {med[2]:.1f} ms (min {min(r[2] for r in rows):.1f}) over {len(rows)} steps")
        del runs
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen2", "llama"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--check-only", action="store_true")
    args = parser.parse_args()
    assert fused_attention.DEVICES == ("cuda",)
    ok = check()
    if not args.check_only:
        timing(args.models, args.steps)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
