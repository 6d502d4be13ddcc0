"""Unsloth as a provider of the LoRA and context benchmarks: the same random-init model, loaded the way Unsloth's users
load one.

Unsloth (``unsloth`` and ``unsloth_zoo`` 2026.10.9) patches transformers, PEFT and TRL when it is imported and pins
their versions (transformers <= 5.17, TRL <= 1.15, datasets < 5), so it runs in its own worker processes: their
``PYTHONPATH`` starts with a folder that holds Unsloth and those pins (``--unsloth-site``; on the GPU machine a
``pip install --target`` of carried wheels), and the worker imports ``unsloth`` before transformers.

Its entry point takes a model folder, not a model object: ``FastLanguageModel.from_pretrained(folder, ...)`` loads the
weights (bf16, or 4-bit nf4 through bitsandbytes for QLoRA) and a tokenizer, then
``FastLanguageModel.get_peft_model`` adds the adapters (its own LoRA autograd for the MLP and q/k/v/o, with
``use_gradient_checkpointing="unsloth"``: checkpoints offloaded to host memory) (:func:`load_lora`); with
``full_finetuning=True`` it trains every weight instead (:func:`load_full`); ``unsloth_tiled_mlp=True`` runs each MLP
over chunks of tokens. The worker builds the benchmark's model as every provider does (benchmarks/lora.py: its weights
drawn by name; benchmarks/context.py: drawn from the seed), saves it with a word-level tokenizer of the model's
vocabulary (there is no network on the GPU machine, and the benchmarks feed token ids, never text) into a folder
(lora.py: a temporary one a job; context.py: one a run, shared by its probes), loads it through Unsloth offline, and
(lora.py) draws the adapters by name as the other providers do, so that losses and adapter gradients compare with
stock PEFT's.
"""

from __future__ import annotations

import os
from pathlib import Path

SITE = "/tmp/site-unsloth"  # where the GPU machine's command installs the carried Unsloth wheels
# The offline switches: the folder is local, and nothing may try the network (none on the GPU machine).
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}


def worker_env(site: str | Path, repo_src: str | Path) -> dict:
    """The environment of an Unsloth worker: ``site`` first on ``PYTHONPATH`` (Unsloth and its pinned versions
    win over the other providers' packages), then tigon's source, then what the parent had."""
    path = [str(site), str(repo_src), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def versions(site: str | Path) -> dict:
    """Unsloth's and unsloth_zoo's versions as installed in ``site`` (None where it holds neither): the benchmark
    pages record them with the other providers' versions, though the parent process never imports them."""
    from importlib import metadata

    found = {dist.metadata["Name"].lower(): dist.version for dist in metadata.distributions(path=[str(site)])}
    return {name: found.get(name) for name in ("unsloth", "unsloth_zoo")}


def save_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose vocabulary is the model's (ids 0..vocab_size-1; 0 unknown, 1 beginning,
    2 end, 3 padding), saved where ``from_pretrained`` looks for one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>", model_max_length=1 << 20)
    tokenizer.save_pretrained(folder)


def save_model(model, folder: Path) -> None:
    """The benchmark's model (its weights as drawn) and a tokenizer, in ``folder``."""
    model.save_pretrained(folder)
    save_tokenizer(folder, model.config.vocab_size)


def load_lora(folder: Path, *, seq: int, qlora: bool, checkpointing: bool, rank: int, alpha: float,
              targets, seed: int, tiled_mlp: bool = False):
    """Unsloth's PEFT model of ``folder``: bf16 base weights (or bitsandbytes 4-bit nf4 with ``qlora``), LoRA
    r=``rank`` α=``alpha`` (dropout 0, no bias) on ``targets``, Unsloth's offloaded checkpointing with
    ``checkpointing`` (none otherwise), its tiled MLP with ``tiled_mlp`` (``unsloth_tiled_mlp``: the MLP over
    chunks of tokens, forward and backward), in training mode."""
    import torch
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(
        model_name=str(folder), max_seq_length=seq, dtype=torch.bfloat16, load_in_4bit=qlora,
        load_in_16bit=not qlora, full_finetuning=False, local_files_only=True,
        use_gradient_checkpointing="unsloth" if checkpointing else False, unsloth_tiled_mlp=tiled_mlp,
        random_state=seed)
    model = FastLanguageModel.get_peft_model(
        model, r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=list(targets),
        use_gradient_checkpointing="unsloth" if checkpointing else False, random_state=seed)
    FastLanguageModel.for_training(model)
    return model


def load_full(folder: Path, *, seq: int, checkpointing: bool, seed: int, tiled_mlp: bool = False):
    """Unsloth's model of ``folder`` for full fine-tuning (``full_finetuning=True``, which its
    ``FastLanguageModel`` hands to ``FastModel``): loaded in bf16, every parameter trainable and upcast to fp32
    (``float32_mixed_precision=True``: fp32 weights under bf16 autocast, as the other providers train), with
    ``checkpointing`` and ``tiled_mlp`` as in :func:`load_lora`, in training mode."""
    import torch
    from unsloth import FastLanguageModel, FastModel

    model, _ = FastLanguageModel.from_pretrained(
        model_name=str(folder), max_seq_length=seq, dtype=torch.bfloat16, load_in_4bit=False,
        full_finetuning=True, float32_mixed_precision=True, local_files_only=True,
        use_gradient_checkpointing="unsloth" if checkpointing else False, unsloth_tiled_mlp=tiled_mlp,
        random_state=seed)
    FastModel.for_training(model)
    return model
