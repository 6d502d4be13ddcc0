"""What a training forward really leaves allocated on the device, per provider, and where the step peaks.

    PYTHONPATH=src:. python dev/saved_on_device.py --seq 16384 --layers 16
    PYTHONPATH=src:. python dev/saved_on_device.py --device cpu --tiny --seq 64   # pipeline check

``python -m tigon.bench.saved`` walks the autograd graph and counts what it holds; this measures the
allocator instead: the bytes allocated after the forward minus before it (what the backward will find
saved, plus the loss), the peak of the forward, the peak of the backward, and for ``recompute_norms``
how many saved tensors the layer scopes swapped for recipes, how many scopes were opened, and how many
times another saved-tensor hook was found active at a layer's start.
Each provider runs in a fresh process (``--provider`` runs one in this one), Llama-3.2-1B-shaped with
``--layers`` decoder layers, batch 1, bf16 autocast, fp32 weights, sdpa, one forward and backward
after one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

PROVIDERS = ("stock", "tigon", "tigon+recompute")


def measure(provider: str, seq: int, layers: int, device_name: str, tiny: bool, with_optimizer: bool) -> dict:
    import os

    if device_name == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import tigon
    from tigon.bench.models import build_model, model_config
    from tigon.patching import norm_recompute as recompute

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    spec = model_config("llama", tiny=tiny)
    config = spec.config
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = build_model(config, device=device)
    if provider != "stock":
        tigon.patch(model, recompute_norms="recompute" in provider)

    counts = {"scopes": 0, "packed": 0, "kept": 0, "hooks_active": 0}
    pack, init, hooks_active = recompute._LayerScope._pack, recompute._LayerScope.__init__, recompute._hooks_active

    def counting_pack(self, t):
        out = pack(self, t)
        counts["packed" if isinstance(out, recompute._Packed) else "kept"] += 1
        return out

    def counting_init(self, layer_input):
        counts["scopes"] += 1
        init(self, layer_input)

    def counting_hooks_active():
        active = hooks_active()
        counts["hooks_active"] += int(active)
        return active

    # the layer hooks are bound when patched, but look these up when they run
    recompute._LayerScope._pack, recompute._LayerScope.__init__ = counting_pack, counting_init
    recompute._hooks_active = counting_hooks_active
    ids = torch.randint(config.vocab_size, (2, 1, seq), device=device)

    def allocated():
        return torch.cuda.memory_allocated() if cuda else 0

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda) if with_optimizer else None

    def peak():
        if not cuda:
            return 0
        torch.cuda.synchronize()
        value = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return value

    out = {"provider": provider, "seq": seq, "layers": layers}
    for step in range(2):
        for k in counts:
            counts[k] = 0
        model.zero_grad(set_to_none=True)
        peak()
        before = allocated()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids[step], labels=ids[step]).loss
        forward_peak, after = peak(), allocated()
        loss.backward()
        backward_peak = peak()
        if optimizer is not None:
            optimizer.step()
        optimizer_peak = peak()
        if cuda:
            out.update(before_gib=before / 2**30, saved_gib=(after - before) / 2**30,
                       forward_peak_gib=forward_peak / 2**30, backward_peak_gib=backward_peak / 2**30,
                       optimizer_peak_gib=optimizer_peak / 2**30)
        out.update(loss=loss.item(), **counts)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--provider", choices=PROVIDERS, help="run this one provider in this process")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--optimizer", action="store_true", help="a fused AdamW step after each backward "
                        "(step 2's peaks then hold its moments, as a training step's do)")
    args = parser.parse_args(argv)
    if args.provider:
        print(json.dumps(measure(args.provider, args.seq, args.layers, args.device, args.tiny, args.optimizer)))
        return 0
    for provider in args.providers:
        command = [sys.executable, __file__, "--provider", provider, "--seq", str(args.seq),
                   "--layers", str(args.layers), "--device", args.device] + (["--tiny"] if args.tiny else []) \
            + (["--optimizer"] if args.optimizer else [])
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = result.stdout.strip().splitlines()
        print(lines[-1] if result.returncode == 0 and lines else f"{provider}: failed\n{result.stderr[-2000:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
