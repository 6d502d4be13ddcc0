"""PEFT LoRA on the tiny models (tiny.py): adapters on every linear layer, one training step, stock against
patched, and the switches under which tigon's attention node runs in fp32 on the CPU.

The node runs in fp16/bf16 on the GPU only (fused_attention.DEVICES, its dtypes); :func:`node_in_fp32_here`
adds the CPU and fp32, to compare it with stock PEFT in fp32 (under the interpreter on the CPU), as
test_lora_peft.py does. :func:`count_node_calls` counts the calls of the attention node and of the MLP node
with adapters (``tigon.nn.lora_mlp.lora_gated_mlp``).
"""

from __future__ import annotations

import torch

from tests.patching import tiny
from tests.patching.tiny import SEQ, assert_grads_close, batch, grads, rel, sdpa_config_overrides
from tigon.nn import lora_mlp
from tigon.patching import fused_attention

RANK = 5
NODES = ("attention", "MLP")
# Llama-4: PEFT's all-linear takes the router, whose forward returns a tuple (stock PEFT fails on it); the
# attention and the dense layer's MLP
LLAMA4_TARGETS = r".*\.layers\.\d+\.(self_attn\.[qkvo]_proj|feed_forward\.(gate|up|down)_proj)"


def node_in_fp32_here(monkeypatch):
    monkeypatch.setattr(fused_attention, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fused_attention, "_HALF", (torch.float16, torch.bfloat16, torch.float32))


def count_node_calls(monkeypatch) -> dict:
    """A dict counting each node's calls ("attention", "MLP") from now on."""
    calls = dict.fromkeys(NODES, 0)
    apply, mlp = fused_attention.APPLY_NODE, lora_mlp.lora_gated_mlp

    def attention_node(*args):
        calls["attention"] += 1
        return apply(*args)

    def mlp_node(*args, **kwargs):
        calls["MLP"] += 1
        return mlp(*args, **kwargs)

    monkeypatch.setattr(fused_attention, "APPLY_NODE", attention_node)
    monkeypatch.setattr(lora_mlp, "lora_gated_mlp", mlp_node)
    return calls


def lora_config(model_type="llama", **kwargs):
    """Rank 5 on every linear layer (PEFT's all-linear), B drawn at random (B ≠ 0: the adapters change the loss)."""
    import peft

    if model_type == "falcon_h1":  # PEFT refuses the Mamba mixer's out_proj
        targets = {"target_modules": "all-linear", "exclude_modules": ["out_proj"]}
    elif model_type == "llama4_text":
        targets = {"target_modules": LLAMA4_TARGETS}
    else:
        targets = {"target_modules": "all-linear"}
    return peft.LoraConfig(r=RANK, lora_alpha=8, init_lora_weights=False, **targets, **kwargs)


def lora(model, model_type="llama", seed=1):
    import peft

    torch.manual_seed(seed)  # the adapters' init: the same draw for stock and patched
    return peft.get_peft_model(model, lora_config(model_type))


def base_model(model_type="llama", **overrides):
    """A tiny model on sdpa attention (the node's). Sliding windows are wider than the sequence, as a
    training sequence shorter than Mistral's 4096 window is: the mask is then causal."""
    torch.manual_seed(0)
    window = {"sliding_window": 2 * SEQ} if getattr(tiny.tiny_config(model_type), "sliding_window", None) else {}
    model = tiny.tiny_model(model_type, **{**sdpa_config_overrides(model_type), **window, **overrides})
    model.config._attn_implementation = "sdpa"
    from tests.helpers import DEVICE

    return model.to(DEVICE)  # where batch() puts the tokens


def step(model, seed=0):
    """One forward and backward: the loss and the gradients (then cleared)."""
    ids, labels = batch(seed)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    out = loss.detach(), grads(model)
    model.zero_grad(set_to_none=True)
    return out


def assert_step_matches(patched, stock, seed=0):
    """The loss within 1e-5 and every adapter gradient within 1e-4 of stock's."""
    loss_stock, want = step(stock, seed)
    loss, got = step(patched, seed)
    assert rel(loss, loss_stock) <= 1e-5, (loss.item(), loss_stock.item())
    assert want and all("lora_" in name for name in want)
    assert_grads_close(got, want, 1e-4)


def save_tiny_llama(path):
    """A tiny Llama saved as a checkpoint (fp32) in ``path``, for from_pretrained to quantize; ``path``."""
    torch.manual_seed(0)
    tiny.tiny_model("llama").save_pretrained(path)
    return path


def quantized(checkpoint, quant_type="nf4", nested=True, compute=torch.float32, kbit_prepare=True, **kwargs):
    """The checkpoint loaded in 4-bit by transformers (quantized on its way to the device), in train mode;
    through ``prepare_model_for_kbit_training`` (which turns on gradient checkpointing) where asked."""
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tests.helpers import DEVICE

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=nested,
                                bnb_4bit_compute_dtype=compute)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=config, device_map=str(DEVICE),
                                                 dtype=torch.float32, attn_implementation="sdpa", **kwargs)
    if kbit_prepare:
        model = peft.prepare_model_for_kbit_training(model)
    return model.train()
