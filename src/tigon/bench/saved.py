"""What autograd keeps from the forward for the backward: bytes by module and by node, per token.

After a forward with gradients, every tensor the graph holds for its backward is reachable from the
loss: C++ nodes expose them as ``_saved_<name>`` attributes, custom ``autograd.Function`` nodes as
``saved_tensors``. :func:`saved_bytes` walks the graph once, counts each storage once (a tensor
two nodes save, or a view of another saved tensor, is held once), leaves out the parameters (they are
there anyway), and charges each storage to the node that saves it first and to the innermost module
whose forward made that node (module forward hooks tag the nodes each module's forward created).

A storage is charged whole: a saved view of a bigger buffer keeps the whole buffer alive.

``python -m tigon.bench.saved`` prints the table for a Llama shaped in proportion to Llama-3.2-1B
(hidden 256, intermediate 1024, 4/1 heads of 64, 2 layers): stock, patched, patched with
recompute_norms, bf16 autocast, per token of its second decoder layer (the difference between two
lengths), times 8: bytes per token per layer scale with the widths, so these are the 1B's. With
``--lora``: PEFT LoRA at Llama-3.1-8B's widths (and rank) divided by 8, stock PEFT and patched, on bf16 and
on 4-bit bases, by graph node (module hooks would make the fused nodes stand aside).
"""

from __future__ import annotations

import argparse
import collections
import collections.abc
import contextlib
import functools
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class SavedBytes:
    """Saved bytes, each storage counted once: ``total``, and ``by_module`` / ``by_node`` / ``by_key``
    (``(module, node)``) dicts of bytes; ``tensors``: one ``(module, node, attribute, shape, dtype,
    bytes)`` row per counted storage."""

    total: int = 0
    by_module: dict = field(default_factory=lambda: collections.defaultdict(int))
    by_node: dict = field(default_factory=lambda: collections.defaultdict(int))
    by_key: dict = field(default_factory=lambda: collections.defaultdict(int))
    tensors: list = field(default_factory=list)


def _saved_of(node):
    """``(attribute, tensor)`` pairs a graph node holds for its backward."""
    out = []
    if hasattr(node, "saved_tensors") and not hasattr(node, "_saved_self"):
        try:
            out += [(f"saved_tensors[{i}]", t) for i, t in enumerate(node.saved_tensors)]
        except RuntimeError:  # freed (after a backward) or not a custom Function
            pass
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:
            continue
        if isinstance(value, torch.Tensor):
            out.append((name, value))
        elif isinstance(value, (tuple, list)):
            out += [(f"{name}[{i}]", t) for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
    return out


def _nodes(roots):
    seen, stack, order = set(), [r for r in roots if r is not None], []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack += [n for n, _ in node.next_functions if n is not None]
    return order


def _next_sequence_nr() -> int:
    """The sequence number the next graph node made on this thread will have (at least)."""
    with torch.enable_grad():
        return (torch.empty(0, requires_grad=True) * 1).grad_fn._sequence_nr() + 1


def _made_since(roots, start: int):
    """Nodes behind ``roots`` made at or after sequence number ``start`` (older ones end the walk: a
    node's inputs are older than it)."""
    seen, stack, order = set(), [r for r in roots if r is not None], []
    while stack:
        node = stack.pop()
        if node in seen or node._sequence_nr() < start:
            continue
        seen.add(node)
        order.append(node)
        stack += [n for n, _ in node.next_functions if n is not None]
    return order


def _tensors_in(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, collections.abc.Mapping):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors_in(item)]
    return []


@contextlib.contextmanager
def tag_nodes(model):
    """While active, each graph node made in a module's forward gets ``node.metadata["tigon_module"]``:
    the qualified name of the innermost module whose forward made it (found, when the forward
    returns, among the nodes behind its outputs made since it began)."""
    handles, starts = [], []

    def before(_module, _args):
        starts.append(_next_sequence_nr())

    def after(name):
        def tag(_module, _args, output):
            start = starts.pop()
            roots = [t.grad_fn for t in _tensors_in(output)]
            for node in _made_since(roots, start):
                node.metadata.setdefault("tigon_module", name)  # an inner module tagged it first
        return tag

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after(name or "<model>")))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class _Made(TorchDispatchMode):
    """While active, records the storages of every tensor an op makes anew (views of its inputs are
    not new), and the tensors such ops read: what unpacking a saved tensor made (a recompute) and what
    it made it from (which the graph holds, through the recompute's recipe)."""

    def __init__(self):
        super().__init__()
        self.storages, self.reads, self.keep = set(), [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        ptrs = {t.untyped_storage().data_ptr() for t in inputs}
        made = [t for t in torch.utils._pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ptrs]
        if made:
            self.storages.update(t.untyped_storage().data_ptr() for t in made)
            self.reads += inputs
        self.keep += made  # alive until the walk ends: no address is reused meanwhile
        return out


def saved_bytes(root: torch.Tensor, parameters=()) -> SavedBytes:
    """What the graph behind ``root`` saves, each storage once, ``parameters`` left out. A saved tensor
    that unpacking makes anew (a saved_tensors_hooks recompute) is left out, and what its recompute
    reads is counted instead (attribute ``recompute input``)."""
    skip = {p.untyped_storage().data_ptr() for p in parameters}
    seen, keep, made_all = set(), [], set()
    result = SavedBytes()
    walked = []
    for node in _nodes([root.grad_fn]):
        with _Made() as made:
            tensors = _saved_of(node)
        made_all |= made.storages
        keep.append(made)
        walked.append((node, tensors + [("recompute input", t) for t in made.reads]))
    for node, tensors in walked:
        module = node.metadata.get("tigon_module", "<outside>")
        for attr, t in tensors:
            if t is None or t.untyped_storage().data_ptr() in made_all:
                continue
            keep.append(t)
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in skip or ptr in seen or storage.nbytes() == 0:
                continue
            seen.add(ptr)
            nbytes = storage.nbytes()
            result.total += nbytes
            result.by_module[module] += nbytes
            result.by_node[node.name()] += nbytes
            result.by_key[(module, node.name())] += nbytes
            result.tensors.append((module, node.name(), attr, tuple(t.shape), t.dtype, nbytes))
    return result


# ------------------------------------------------------------------------------------------ the table

# Llama-3.2-1B divided by 8 in its widths (hidden, intermediate, heads); head_dim as the 1B's.
PROPORTIONAL_LLAMA = dict(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                          max_position_embeddings=4096, tie_word_embeddings=True)
SCALE_TO_1B = 8  # widths of Llama-3.2-1B / PROPORTIONAL_LLAMA's


def measure_model(model, *, batch: int, seq: int, dtype=torch.bfloat16) -> tuple[SavedBytes, torch.Tensor]:
    """One training forward (loss inside the model) under autocast; the saved bytes and the loss."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (batch, seq), device=device, generator=gen)
    with tag_nodes(model), torch.autocast(device.type, dtype=dtype):
        loss = model(input_ids=ids, labels=ids).loss
    return saved_bytes(loss, list(model.parameters())), loss


PROVIDERS = {"stock": None, "tigon": {}, "tigon recompute_norms": {"recompute_norms": True}}


def per_token_layer_rows(model, layer: str, seq: int, *, scale: float):
    """``{(module, node): bytes}`` per token of decoder layer ``layer``, as the difference between
    sequences of ``2·seq`` and ``seq`` tokens (what does not grow with the tokens, such as a bf16 weight
    copy, cancels), times ``scale``."""
    rows = {}
    for sign, length in ((-1, seq), (1, 2 * seq)):
        result, _ = measure_model(model, batch=1, seq=length)
        for (module, node), nbytes in result.by_key.items():
            if module == layer or module.startswith(layer + "."):
                key = (module[len(layer):].lstrip(".") or "(layer)", node)
                rows[key] = rows.get(key, 0.0) + sign * nbytes * scale / seq
        model.zero_grad(set_to_none=True)
    return {k: v for k, v in rows.items() if abs(v) >= 1}


# Llama-3.1-8B divided by 8 in its widths (hidden, intermediate, heads), head_dim as the 8B's, untied head;
# LoRA's rank divided by 8 too (r = 2 here is r = 16 there), so every saved width scales by 8.
PROPORTIONAL_LLAMA_8B = dict(vocab_size=1024, hidden_size=512, intermediate_size=1792, num_attention_heads=4,
                             num_key_value_heads=1, head_dim=128, max_position_embeddings=4096,
                             tie_word_embeddings=False)
LORA_RANK_8B = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_PROVIDERS = {"PEFT": (False, False), "tigon": (True, False),
                  "PEFT, 4-bit bases (QLoRA)": (False, True), "tigon, 4-bit bases (QLoRA)": (True, True)}


@contextlib.contextmanager
def attention_node_on_the_cpu():
    """The fused attention node runs on the CPU while active, as it does on a GPU (it keeps the separate
    products there otherwise, tigon.patching.fused_attention): what it saves is what it saves on the GPU."""
    from tigon.patching import fused_attention

    devices = fused_attention.DEVICES
    fused_attention.DEVICES = (*devices, "cpu")
    try:
        yield
    finally:
        fused_attention.DEVICES = devices


def lora_model(layers: int, *, patched: bool, qlora: bool):
    """PROPORTIONAL_LLAMA_8B with ``layers`` layers, bf16 weights (4-bit nf4 bases with ``qlora``, prepared as
    TRL prepares them), PEFT LoRA of rank LORA_RANK_8B / SCALE_TO_1B on the seven projections, patched or not."""
    import peft
    import transformers

    import tigon
    from tigon.bench.models import quantize_4bit

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**PROPORTIONAL_LLAMA_8B, num_hidden_layers=layers)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()
    model.config._attn_implementation = "sdpa"
    if qlora:
        quantize_4bit(model, torch.device("cpu"), torch.bfloat16)
    rank = LORA_RANK_8B // SCALE_TO_1B
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                       target_modules=list(LORA_TARGETS))).train()
    if patched:
        tigon.patch(model)
    return model


def per_token_layer_by_node(build, seq: int, *, scale: float) -> dict:
    """``{node: bytes}`` per token of one decoder layer, without module hooks (hooks make the fused nodes stand
    aside): the saved bytes of 2 layers less 1, at ``2·seq`` tokens less ``seq``, over ``seq``, times ``scale``;
    ``build(layers)`` makes the model."""
    rows = collections.Counter()
    for layers, layer_sign in ((2, 1), (1, -1)):
        model = build(layers)
        for length, sign in ((2 * seq, 1), (seq, -1)):
            gen = torch.Generator().manual_seed(0)
            ids = torch.randint(model.config.vocab_size, (1, length), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            for node, nbytes in saved_bytes(loss, list(model.parameters())).by_node.items():
                rows[node] += layer_sign * sign * nbytes * scale / seq
    return {node: b for node, b in rows.items() if abs(b) >= 1}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="saved-for-backward bytes per token per decoder layer")
    parser.add_argument("--seq", type=int, default=128, help="tokens (and twice as many) to measure at")
    parser.add_argument("--lora", action="store_true",
                        help="LoRA r=16 on the seven projections at Llama-3.1-8B's widths instead: PEFT and tigon, "
                             "on bf16 and on bitsandbytes 4-bit bases")
    args = parser.parse_args(argv)
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    import transformers

    import tigon
    from tigon._interpreter import apply_interpreter_fixes

    apply_interpreter_fixes()
    if args.lora:
        print(f"Bytes saved for the backward per token per decoder layer, LoRA r={LORA_RANK_8B} on the seven "
              f"projections, bf16 autocast over bf16 bases, at Llama-3.1-8B's widths (a Llama of 1/{SCALE_TO_1B} "
              f"its widths and rank measured, times {SCALE_TO_1B}); by the graph node that holds each storage.")
        with attention_node_on_the_cpu():
            for provider, (patched, qlora) in LORA_PROVIDERS.items():
                build = functools.partial(lora_model, patched=patched, qlora=qlora)
                rows = per_token_layer_by_node(build, args.seq, scale=SCALE_TO_1B)
                print(f"\n{provider}\n\n| node | bytes/token |\n| --- | --- |")
                for node, b in sorted(rows.items(), key=lambda kv: -kv[1]):
                    print(f"| {node} | {b:.0f} |")
                print(f"| **total** | **{sum(rows.values()):.0f}** |")
        return 0
    config = transformers.LlamaConfig(**PROPORTIONAL_LLAMA)
    print(f"Bytes saved for the backward per token per decoder layer, bf16 autocast, at Llama-3.2-1B's widths "
          f"(a Llama of 1/{SCALE_TO_1B} its widths measured, times {SCALE_TO_1B}); (module, node) that holds "
          "each storage first.")
    for provider, switches in PROVIDERS.items():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).train()
        model.config._attn_implementation = "sdpa"
        if switches is not None:
            tigon.patch(model, **switches)
        rows = per_token_layer_rows(model, "model.layers.1", args.seq, scale=SCALE_TO_1B)
        print(f"\n{provider}\n\n| module | node | bytes/token |\n| --- | --- | --- |")
        for (module, node), b in sorted(rows.items(), key=lambda kv: -kv[1]):
            print(f"| {module} | {node} | {b:.0f} |")
        print(f"| **total** | | **{sum(rows.values()):.0f}** |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
