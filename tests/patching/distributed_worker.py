"""Worker for tests/patching/test_distributed.py, run by ``torchrun --nproc_per_node 2``.

Every rank: a tigon-patched tiny Llama (the same weights on every rank), trained STEPS SGD steps
on its half of each batch, once under DDP and once under FSDP2 (``fully_shard`` on each decoder
layer, then the root: how FSDP2 users wrap a transformers model). Rank 0 also trains the same model
alone on the whole batches. It writes the three runs' per-step losses (the distributed ones
averaged over the ranks) and final weights to the file named on the command line.

CPU and gloo with the Triton interpreter, so that the same test runs on any machine: what it checks
is that patched modules and the fused loss compose with the wrappers' hooks and gradient reduction,
not kernel speed.

With ``TIGON_DIST_DEVICE=cuda`` (two GPUs or more) each rank trains on its own GPU under NCCL with
the compiled kernels instead, and two runs are added: the same DDP and FSDP2 runs of a model
patched with ``cuda_graphs=True``. Under DDP its decoder layers replay captured graphs (the count
of replays is saved); FSDP2's sharded parameters make every layer run eagerly (no replay).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import tigon
from tests.patching.tiny import tiny_model

STEPS = 3
LR = 0.1
MOMENTUM = 0.9
BATCH = 4  # sequences per step, split evenly over the ranks
SEQ = 12
VOCAB = 160
ON_CUDA = os.environ.get("TIGON_DIST_DEVICE") == "cuda"


def batches():
    """The full batches: token ids with every label trained on, so each rank's half has as many
    target tokens as the other's and the mean of the ranks' mean losses is the whole batch's."""
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if ON_CUDA else torch.device("cpu")


def fresh_model(cuda_graphs=False):
    torch.manual_seed(0)
    model = tiny_model("llama").to(device())
    tigon.patch(model, cuda_graphs=cuda_graphs)
    return model


def replays(model) -> int:
    """Graph replays over the model's decoder layers (0 without graphs)."""
    graphs = [getattr(layer.forward, "graphs", None) for layer in model.model.layers]
    return sum(g.replays for g in graphs if g is not None)


def train(model, shard_of, *, average_over_ranks) -> list[float]:
    """STEPS SGD steps on ``shard_of(full batch)``; returns each step's loss (averaged over the
    ranks for a distributed run)."""
    # SGD, not AdamW: Adam's update barely depends on the gradient's scale, so a wrapper that summed
    # the ranks' gradients instead of averaging them would pass unseen.
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for ids in batches():
        ids = shard_of(ids).to(device())
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        if average_over_ranks:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses


def full_state(model) -> dict:
    """Parameters by name as plain tensors (FSDP2's DTensor shards gathered)."""
    out = {}
    for name, p in model.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("module.", "")] = p.detach().clone()
    return out


def main(out_path: str) -> None:
    if ON_CUDA:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if ON_CUDA else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = BATCH // world

    def my_half(ids):
        return ids[rank * per_rank:(rank + 1) * per_rank]

    results = {}
    if rank == 0:
        model = fresh_model()
        results["single"] = {"losses": train(model, lambda ids: ids, average_over_ranks=False),
                             "state": full_state(model)}

    for suffix, cuda_graphs in (("", False), ("_graphs", True)) if ON_CUDA else (("", False),):
        model = fresh_model(cuda_graphs)
        ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if ON_CUDA else None)
        results["ddp" + suffix] = {"losses": train(ddp, my_half, average_over_ranks=True),
                                   "state": full_state(model), "replays": replays(model)}

        model = fresh_model(cuda_graphs)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        results["fsdp2" + suffix] = {"losses": train(model, my_half, average_over_ranks=True),
                                     "state": full_state(model), "replays": replays(model)}

    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
