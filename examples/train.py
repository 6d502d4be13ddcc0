"""Train a causal LM on one GPU with tigon: the model loaded patched, bf16 autocast, fused AdamW.

    python examples/train.py --model meta-llama/Llama-3.2-1B --data corpus.txt --steps 1000 --out trained/
    python examples/train.py --tiny --seq 64 --steps 3      # smoke test, no GPU needed

``tigon.patch(model)`` replaces the model's norms, rotary, MLP activation, attention and loss with tigon's in
place and prints what it replaced (``tigon.AutoModelForCausalLM.from_pretrained`` does the same in one call):
the same weights, state_dict keys and checkpoints; the loss computed without the logits. ``save_pretrained``
writes a stock checkpoint that plain transformers loads.
"""

from __future__ import annotations

import time

import torch
from common import batches, device, load_model, parser, token_rows

import tigon


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    args = p.parse_args(argv)
    dev = device()
    model = load_model(args).to(dev).train()
    print("\n".join(tigon.patch(model).replaced))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=dev.type == "cuda")
    rows = token_rows(args, model.config.vocab_size)
    start = time.perf_counter()
    for step, ids in enumerate(batches(rows, args.batch, args.steps * args.accumulate)):
        ids = ids.to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss / args.accumulate
        loss.backward()
        if (step + 1) % args.accumulate == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done = (step + 1) // args.accumulate
            tokens = done * args.accumulate * args.batch * args.seq
            print(f"step {done}: loss {loss.item() * args.accumulate:.4f}, "
                  f"{tokens / (time.perf_counter() - start):.0f} tokens/s", flush=True)
    if args.out:
        model.save_pretrained(args.out)


if __name__ == "__main__":
    main()
