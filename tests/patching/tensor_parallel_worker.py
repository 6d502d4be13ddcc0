"""Worker for tests/patching/test_tensor_parallel.py, run by ``torchrun --nproc_per_node 2``.

    worker.py RESULTS MODELS_DIR

Tensor parallelism as transformers does it: ``from_pretrained(path, tp_plan="auto")`` splits the
attention and MLP projections by columns and rows over the ranks (DTensor weights, a forward set on
each projection that redistributes its input and output) and the LM head by classes
(``colwise_gather_output``). Every rank sees the same batches.

For each tiny model saved under MODELS_DIR (by the test), every rank loads it twice, leaves one stock
and patches the other with ``tigon.patch`` (defaults; for Llama also once more with its classes
patched before loading), and trains both STEPS SGD steps on the same batches. Rank 0 saves the
per-step losses, the trained weights (gathered whole), the eval-mode logits after training (the
head's own gathering forward) and, after ``Patch.revert()``, the reverted model's logits; and the
results of :func:`op_checks`, the vocabulary-parallel loss against the fp64 reference.

CPU and gloo with the Triton interpreter; with ``TIGON_DIST_DEVICE=cuda`` (two GPUs) NCCL and one GPU
a rank, the compiled kernels, and a bf16 autocast run of each model as well.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.patching import worker_exit
from tigon._interpreter import apply_interpreter_fixes

apply_interpreter_fixes()  # the parent sets TRITON_INTERPRET=1 on a machine without CUDA

import tigon  # noqa: E402

STEPS = 3
LR = 0.1
BATCH = 2
SEQ = 12
VOCAB = 160
ON_CUDA = os.environ.get("TIGON_DIST_DEVICE") == "cuda"


def batches():
    gen = torch.Generator().manual_seed(4321)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
        labels = ids.clone()
        labels[0, :3] = -100  # a prompt that is not trained on
        out.append((ids, labels))
    return out


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if ON_CUDA else torch.device("cpu")


def load(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).train()


def whole(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu()


def train(model, autocast):
    """STEPS SGD steps; per-step losses and the eval logits of the first batch afterwards."""
    # foreach=False: one step over split (DTensor) and plain parameters together (a foreach launch takes one kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    losses = []
    for ids, labels in batches():
        with torch.autocast(device().type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids.to(device()), labels=labels.to(device())).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, eval_logits(model, autocast)


def eval_logits(model, autocast):
    model.eval()
    with torch.no_grad(), torch.autocast(device().type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=batches()[0][0].to(device())).logits
    model.train()
    return whole(logits)


def model_runs(path, autocast, *, by_class=False):
    """Stock and patched (the instance, or with ``by_class`` the family's classes before loading)."""
    stock = load(path)
    stock_losses, stock_logits = train(stock, autocast)
    if by_class:
        handle = tigon.patch(stock.config.model_type)
        patched = load(path)
    else:
        patched = load(path)
        handle = tigon.patch(patched)
    losses, logits = train(patched, autocast)
    handle.revert()
    reverted_logits = eval_logits(patched, autocast)
    stock_reference = eval_logits(stock, autocast)
    return {
        "replaced": handle.replaced,
        "stock_losses": stock_losses, "losses": losses,
        "stock_state": {n: whole(p) for n, p in stock.named_parameters()},
        "state": {n: whole(p) for n, p in patched.named_parameters()},
        "stock_logits": stock_logits, "logits": logits,
        "reverted_logits": reverted_logits, "stock_logits_again": stock_reference,
        "head_forward_restored": "_tigon_logits_forward" not in vars(patched.lm_head),
    }


def op_checks():
    """The vocabulary-parallel loss on a DTensor head (uneven shards: 101 classes over 2 ranks, every
    option and dtype) and on plain shards with a process group, against the fp64 reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tigon.ops import fused_linear_cross_entropy, vocab_parallel_cross_entropy
    from tigon.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_reference

    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    num_tokens, hidden, vocab = 37, 24, 101
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.3
    b = torch.randn(vocab, generator=gen, dtype=torch.float64) * 0.1
    class_weight = torch.rand(vocab, generator=gen, dtype=torch.float64) + 0.5
    target = torch.randint(0, vocab, (num_tokens,), generator=gen)
    target[::5] = -100
    cases = {
        "plain": {}, "softcap": {"softcap": 5.0, "logit_scale": 0.7}, "sum": {"reduction": "sum"},
        "smoothing_z_loss": {"label_smoothing": 0.1, "z_loss": 1e-3},
        "class_weight": {"weight": class_weight.float()},
    }
    results = {}
    dev = device()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for case, options in cases.items():
            xd = x.to(dtype).to(dev).requires_grad_()
            wd = distribute_tensor(w.to(dtype).to(dev), mesh, [Shard(0)]).requires_grad_()
            bd = distribute_tensor(b.to(dtype).to(dev), mesh, [Shard(0)]).requires_grad_()
            opts = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in options.items()}
            grad_out = torch.tensor(1.7, device=dev)  # a grad_output other than 1
            loss = vocab_parallel_cross_entropy(xd, wd, target.to(dev), bias_shard=bd, **opts)
            (loss * grad_out).backward()
            ref_opts = {k: (v.double() if torch.is_tensor(v) else v) for k, v in options.items()}
            xr, wr, br = (t.to(dtype).double().requires_grad_() for t in (x, w, b))
            ref = fused_linear_cross_entropy_reference(xr, wr, target, linear_bias=br, io_dtype=dtype, **ref_opts)
            (ref * 1.7).backward()
            results[(str(dtype), case)] = {
                "loss": (whole(loss), ref.detach()), "dx": (whole(xd.grad), xr.grad),
                "dw": (whole(wd.grad), wr.grad), "db": (whole(bd.grad), br.grad),
            }
    # Plain shards and a process group (no DTensor): rank r's rows of W, the whole input gradient.
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.tensor_split(torch.arange(vocab), world)[rank]
    xd = x.float().to(dev).requires_grad_()
    shard = w.float()[rows].to(dev).requires_grad_()
    loss = vocab_parallel_cross_entropy(xd, shard, target.to(dev), vocab_start=int(rows[0]), vocab_size=vocab)
    loss.backward()
    xr, wr = x.float().double().requires_grad_(), w.float().double().requires_grad_()
    ref = fused_linear_cross_entropy_reference(xr, wr, target)
    ref.backward()
    gathered = [torch.empty(len(r), hidden, device=dev) for r in torch.tensor_split(torch.arange(vocab), world)]
    _gather_rows(gathered, shard.grad)
    results[("group", "plain")] = {"loss": (whole(loss), ref.detach()), "dx": (whole(xd.grad), xr.grad),
                                   "dw": (torch.cat([g.cpu() for g in gathered]), wr.grad)}
    # Bad input: a head replicated on every rank is not one split by classes; the plain fused loss takes no
    # DTensor (an FSDP2 shard looks like a head split by classes).
    try:
        vocab_parallel_cross_entropy(xd, distribute_tensor(w.float().to(dev), mesh, [Replicate()]), target.to(dev))
        results["replicated_error"] = None
    except ValueError as err:
        results["replicated_error"] = str(err)
    try:
        fused_linear_cross_entropy(xd, distribute_tensor(w.float().to(dev), mesh, [Shard(0)]), target.to(dev))
        results["dtensor_error"] = None
    except ValueError as err:
        results["dtensor_error"] = str(err)
    try:
        vocab_parallel_cross_entropy(xd, shard, target.to(dev), vocab_start=vocab, vocab_size=vocab)
        results["offset_error"] = None
    except ValueError as err:
        results["offset_error"] = str(err)
    return results


def _gather_rows(out, local):
    """all_gather of each rank's rows into ``out`` (counts may differ: padded to the largest)."""
    width = max(t.shape[0] for t in out)
    padded = torch.zeros(width, local.shape[1], device=local.device)
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in out]
    dist.all_gather(parts, padded)
    for o, p in zip(out, parts, strict=True):
        o.copy_(p[: o.shape[0]])


def main(out_path: str, models_dir: str) -> None:
    if ON_CUDA:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if ON_CUDA else "gloo")
    results = {"ops": op_checks()}
    for path in sorted(Path(models_dir).iterdir()):
        results[(path.name, "fp32")] = model_runs(path, autocast=False)
        if path.name == "llama":
            results[(path.name, "class")] = model_runs(path, autocast=False, by_class=True)
        if ON_CUDA:
            results[(path.name, "autocast")] = model_runs(path, autocast=True)
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    worker_exit.leave()  # results written, group destroyed
