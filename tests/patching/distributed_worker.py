"""Worker for tests/patching/test_distributed.py, run by ``torchrun --nproc_per_node 2``.

Every rank: a tigon-patched tiny Llama (the same weights on every rank), trained STEPS SGD steps
on its half of each batch, once under DDP, once under FSDP2 (``fully_shard`` on each decoder
layer, then the root: how FSDP2 users wrap a transformers model) and once under DeepSpeed ZeRO-3
(``deepspeed.initialize`` with stage 3, every parameter partitioned and released after each use).
Rank 0 also trains the same model alone on the whole batches. It writes the runs' per-step losses
(the distributed ones averaged over the ranks) and final weights to the file named on the command
line.

ZeRO-3 is the strictest of the three for a patched model: a parameter exists only while the module
that owns it runs, and tigon's fused forwards read their children's weights from the parent (the
gated MLP reads gate/up/down_proj's, a joined decoder layer its norms', the fused loss lm_head's
through lm_head's own call). DeepSpeed gathers a parameter read that way on first access and
registers it with the running module for the backward; this run checks that the result is exact.

CPU and gloo with the Triton interpreter, so that the same test runs on any machine: what it checks
is that patched modules and the fused loss compose with the wrappers' hooks and gradient reduction,
not kernel speed.

Under bf16 autocast (where the attention projections share their input's cast and cast their
weights again in the backward) ZeRO-3 and FSDP2 run once more, each against DDP on the same half
batches: one process on the whole batch differs from them by the bf16 rounding of half-batch
products.

With ``TIGON_DIST_DEVICE=cuda`` (two GPUs or more) each rank trains on its own GPU under NCCL with
the compiled kernels instead, and four runs are added: the same DDP, FSDP2 and ZeRO-3 runs of a
model patched with ``cuda_graphs=True``, and ZeRO-3 on a model built under ``deepspeed.zero.Init``
and patched while partitioned. Under DDP its decoder layers replay captured graphs (the
count of replays is saved); FSDP2's and ZeRO-3's sharded parameters make every layer run eagerly
(no replay).

With ``TIGON_DIST_ZERO3=0`` (the parent's choice where deepspeed is not installed) every ZeRO-3 run is
left out.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import tigon
from tests.patching import worker_exit
from tests.patching.tiny import tiny_model
from tigon._interpreter import apply_interpreter_fixes

apply_interpreter_fixes()  # the parent sets TRITON_INTERPRET=1 on a machine without CUDA

STEPS = 3
LR = 0.1
MOMENTUM = 0.9
BATCH = 4  # sequences per step, split evenly over the ranks
SEQ = 12
VOCAB = 160
ON_CUDA = os.environ.get("TIGON_DIST_DEVICE") == "cuda"
ZERO3 = os.environ.get("TIGON_DIST_ZERO3", "1") == "1"


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


def ungroup_projections(model) -> None:
    """Each attention's q/k/v projections as separate nodes (what ZeRO-3 parameters get)."""
    from tigon.nn.shared_cast_linear import CACHE_ATTR

    for module in model.modules():
        cache = getattr(module, CACHE_ATTR, None)
        if cache is not None:
            cache.group = None


def replays(model) -> int:
    """Graph replays over the model's decoder layers (0 without graphs)."""
    graphs = [getattr(layer.forward, "graphs", None) for layer in model.model.layers]
    return sum(g.replays for g in graphs if g is not None)


def forward_loss(model, ids, autocast):
    """The model's loss on ``ids``, under bf16 autocast if asked (the shared-cast projections run
    there only)."""
    with torch.autocast(device().type, dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=ids, labels=ids).loss


def train(model, shard_of, *, average_over_ranks, autocast=False) -> list[float]:
    """STEPS SGD steps on ``shard_of(full batch)``; returns each step's loss (averaged over the
    ranks for a distributed run)."""
    # SGD, not AdamW: Adam's update barely depends on the gradient's scale, so a wrapper that summed
    # the ranks' gradients instead of averaging them would pass unseen.
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for ids in batches():
        ids = shard_of(ids).to(device())
        loss = forward_loss(model, ids, autocast)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        if average_over_ranks:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses


def zero3_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH // dist.get_world_size(),
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,  # torch's SGD, as the other runs use
        "gradient_clipping": 0.0,  # DeepSpeed clips to norm 1 unless told otherwise
        # Every parameter partitioned, none kept or prefetched: each is gathered only for its use.
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
                              "stage3_prefetch_bucket_size": 0},
    }


def zero_init_model():
    """The tiny Llama built by transformers under a ZeRO-3 config (``deepspeed.zero.Init``), given
    the other runs' initial weights, then patched while its parameters are partitioned (empty,
    their shapes in ``ds_shape``). GPU only: DeepSpeed 0.19's zero.Init fails on torch 2.13, the CPU
    build CI installs; tests/patching/test_engine.py covers the patch of partitioned parameters on
    the CPU."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    torch.manual_seed(0)
    initial = {name: p.detach().clone() for name, p in tiny_model("llama").named_parameters()}
    # While this object lives, transformers builds models under zero.Init (and initialises their
    # weights gathered), as it does under a Trainer's ZeRO-3 config.
    zero3 = HfDeepSpeedConfig(zero3_config())
    model = tiny_model("llama")
    del zero3
    params = dict(model.named_parameters())
    assert all(p.numel() == 0 for p in params.values())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0), torch.no_grad():
        if dist.get_rank() == 0:
            for name, p in params.items():
                p.copy_(initial[name])
    tigon.patch(model)
    return model


def train_zero3(model, shard_of, *, autocast=False) -> tuple[list[float], dict]:
    """STEPS SGD steps under DeepSpeed ZeRO-3; each step's loss averaged over the ranks, and the
    final weights gathered."""
    import deepspeed

    config = zero3_config()
    if autocast:
        # The engine's forward turns a CUDA autocast off unless its config asks for one (the CPU's
        # it leaves alone); no module's gradients reduced in bf16, as DDP reduces them in fp32.
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses = []
    for ids in batches():
        ids = shard_of(ids).to(device())
        loss = forward_loss(engine, ids, autocast)
        engine.backward(loss)
        engine.step()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
    params = list(model.parameters())
    assert all(p.numel() == 0 for p in params), "ZeRO-3 left a parameter gathered after the step"
    with deepspeed.zero.GatheredParameters(params):
        state = {name: p.detach().clone() for name, p in model.named_parameters()}
    return losses, state


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

        if ZERO3:
            model = fresh_model(cuda_graphs)
            losses, state = train_zero3(model, my_half)
            results["zero3" + suffix] = {"losses": losses, "state": state, "replays": replays(model)}

    if ON_CUDA and ZERO3:
        model = zero_init_model()
        losses, state = train_zero3(model, my_half)
        results["zero3_init"] = {"losses": losses, "state": state, "replays": replays(model)}

    # Under autocast, each rank's bf16 products of half a batch differ from one product of the whole
    # batch by bf16 rounding; DDP on the same halves is the exact reference for ZeRO-3 there, with
    # the q/k/v projections ungrouped as ZeRO-3 has them (tigon.nn.shared_cast_linear): a grouped node sums the
    # three input gradients into one bf16 buffer, ungrouped autograd adds three bf16 tensors.
    model = fresh_model()
    ungroup_projections(model)
    ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if ON_CUDA else None)
    results["ddp_autocast"] = {"losses": train(ddp, my_half, average_over_ranks=True, autocast=True),
                               "state": full_state(model)}
    if ZERO3:
        model = fresh_model()
        losses, state = train_zero3(model, my_half, autocast=True)
        results["zero3_autocast"] = {"losses": losses, "state": state}
    # FSDP2 gathers a whole decoder layer at once: its projections stay one q/k/v node, as under DDP.
    model = fresh_model()
    ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if ON_CUDA else None)
    results["ddp_autocast_grouped"] = {"losses": train(ddp, my_half, average_over_ranks=True, autocast=True),
                                       "state": full_state(model)}
    model = fresh_model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    results["fsdp2_autocast"] = {"losses": train(model, my_half, average_over_ranks=True, autocast=True),
                                 "state": full_state(model)}

    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    worker_exit.leave()  # results written, group destroyed
