"""Train a causal LM split over the GPUs of one host with transformers' tensor parallelism and tigon.

    torchrun --nproc_per_node 4 examples/train_tensor_parallel.py --model meta-llama/Llama-3.1-8B \\
        --data corpus.txt --seq 4096 --steps 1000 --out trained/
    torchrun --nproc_per_node 2 examples/train_tensor_parallel.py --tiny --seq 64 --steps 2

``from_pretrained(..., tp_plan="auto")`` splits the attention and MLP projections by columns and rows over the
ranks and the LM head by classes. ``tigon.patch`` then leaves the split projections' own forwards in place and
computes the loss over each rank's classes of the head (``tigon.ops.vocab_parallel_cross_entropy``): the
logits are never gathered. Every rank trains on the same batch (tensor parallelism splits the model, not the
data). The split projections hold DTensors and the norms plain tensors, and one fused AdamW launch takes one
kind, so they are two parameter groups.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist
import transformers
from common import batches, device, parser, tiny_model_folder, token_rows
from torch.distributed.tensor import DTensor

import tigon


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        # transformers splits a model as it loads it: the tiny one goes through a folder
        source = tiny_model_folder(tmp) if args.tiny else args.model
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        model = transformers.AutoModelForCausalLM.from_pretrained(source, tp_plan="auto", dtype=torch.float32)
    model.train()
    rank, dev = dist.get_rank(), device()
    patch = tigon.patch(model)
    if rank == 0:
        print("\n".join(patch.replaced))
    params = list(model.parameters())
    groups = [{"params": [p for p in params if isinstance(p, DTensor)]},
              {"params": [p for p in params if not isinstance(p, DTensor)]}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, fused=dev.type == "cuda")
    rows = token_rows(args, model.config.vocab_size)
    start = time.perf_counter()
    for step, ids in enumerate(batches(rows, args.batch, args.steps), start=1):
        ids = ids.to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            tokens = step * args.batch * args.seq
            print(f"step {step}: loss {loss.item():.4f}, {tokens / (time.perf_counter() - start):.0f} tokens/s",
                  flush=True)
    if args.out:
        patch.revert()  # the stock modules again; transformers gathers the split weights as it saves
        model.save_pretrained(args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
