"""What the example scripts share: their arguments, the model they load, and the token batches they train on.

Each script trains a causal LM with tigon in one setting (one GPU, FSDP2, tensor parallel, the transformers
Trainer, TRL). ``--model`` is a Hugging Face model id or a local folder; ``--data`` a UTF-8 text file, tokenized
with the model's tokenizer and packed into rows of ``--seq`` tokens. ``--tiny`` trains a tiny random Llama on
random tokens instead: a smoke test of the pipeline that needs no download. On a machine without a GPU, importing
this module turns on Triton's CPU interpreter (as ``tigon demo`` does), so that tigon's kernels run on the CPU:
every script imports it before anything imports ``tigon.ops``, since Triton reads ``TRITON_INTERPRET`` when a
kernel is defined.
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():  # no GPU: tigon's kernels run on the CPU, through Triton's interpreter
    os.environ["TRITON_INTERPRET"] = "1"

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="meta-llama/Llama-3.2-1B", help="model id or folder")
    p.add_argument("--data", help="a text file to train on (tokenized with the model's tokenizer)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama on random tokens (smoke test)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (per rank where ranks split data)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--out", help="folder to save the trained model in (save_pretrained)")
    return p


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_model(args, **kwargs):
    """``--model`` loaded in fp32 (``from_pretrained`` keywords passed on), or with --tiny a tiny random Llama
    (seeded: every rank draws the same)."""
    import transformers

    if not args.tiny:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, **kwargs)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))


def tiny_model_folder(folder) -> str:
    """Save the tiny random Llama in ``folder`` and return it (for loaders that read a folder; call it before
    the process group exists: with one, ``save_pretrained`` writes on the main process only)."""
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(folder)
    return str(folder)


def token_rows(args, vocab_size: int) -> torch.Tensor:
    """(rows, seq) token ids: the text file packed into rows, or random tokens with --tiny."""
    if args.tiny or args.data is None:
        if not args.tiny:
            raise SystemExit("--data FILE is needed (or --tiny for a smoke test on random tokens)")
        gen = torch.Generator().manual_seed(0)
        return torch.randint(vocab_size, (args.steps * args.batch, args.seq), generator=gen)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    with open(args.data, encoding="utf-8") as f:
        ids = torch.tensor(tokenizer(f.read())["input_ids"])
    rows = ids.numel() // args.seq
    if rows == 0:
        raise SystemExit(f"{args.data} has fewer than --seq {args.seq} tokens")
    return ids[: rows * args.seq].view(rows, args.seq)


def batches(rows: torch.Tensor, batch: int, steps: int, *, rank: int = 0, world: int = 1):
    """``steps`` batches of ``batch`` rows, cycling over the rows; with ``world`` ranks, rank r takes every
    world-th batch-sized slice (data parallel)."""
    count = rows.shape[0]
    for step in range(steps):
        start = ((step * world + rank) * batch) % count
        index = torch.arange(start, start + batch) % count
        yield rows[index]
