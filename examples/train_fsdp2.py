"""Train a causal LM on several GPUs with FSDP2 and tigon: data parallel, parameters sharded over the ranks.

    torchrun --nproc_per_node 8 examples/train_fsdp2.py --model meta-llama/Llama-3.1-8B --data corpus.txt \\
        --batch 2 --seq 4096 --steps 1000 --out trained/
    torchrun --nproc_per_node 2 examples/train_fsdp2.py --tiny --seq 64 --steps 2   # smoke test

The model is patched *before* it is wrapped: ``tigon.patch`` swaps modules and forwards, and ``fully_shard``
then shards the patched modules' parameters (the same ``Parameter`` objects and names as stock). Each decoder
layer is its own FSDP2 unit, then the root, as transformers models are usually wrapped. Every rank trains on its
own slice of each step's rows under bf16 autocast; the gradients are reduce-scattered by FSDP2. The trained
model is gathered to rank 0 and saved as a stock checkpoint.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from common import batches, device, load_model, parser, token_rows
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

import tigon


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    model = load_model(args).to(dev).train()
    patch = tigon.patch(model)
    if rank == 0:
        print("\n".join(patch.replaced))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=dev.type == "cuda")
    rows = token_rows(args, model.config.vocab_size)
    start = time.perf_counter()
    for step, ids in enumerate(batches(rows, args.batch, args.steps, rank=rank, world=world), start=1):
        ids = ids.to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        if rank == 0:
            tokens = step * world * args.batch * args.seq
            print(f"step {step}: loss {mean.item():.4f}, {tokens / (time.perf_counter() - start):.0f} tokens/s",
                  flush=True)
    if args.out:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            patch.revert()  # the stock modules again: a plain transformers checkpoint
            model.save_pretrained(args.out, state_dict=state)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
