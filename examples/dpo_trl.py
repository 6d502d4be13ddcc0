"""Preference-tune a causal LM with TRL's ``DPOTrainer`` on tigon: the backbone patched, TRL's head tigon's.

    python examples/dpo_trl.py --model Qwen/Qwen2.5-0.5B-Instruct --data prefs.jsonl --steps 500 --out dpo/
    python examples/dpo_trl.py --tiny --steps 2              # smoke test, no download

``--data`` is a JSON-lines file of ``{"prompt": ..., "chosen": ..., "rejected": ...}`` rows. ``tigon.patch``
patches the policy's decoder (norms, rotary, MLP, attention); ``tigon.patch_trl()`` makes the fused LM head TRL
uses for every trainer's log-probabilities (and entropies) compute with ``tigon.ops.fused_linear_logprobs``:
the same losses and metrics, the ``[tokens, vocab]`` logits never held. The reference model is a frozen copy,
patched too. GRPO, KTO, SFT and the other TRL trainers take the same two lines.
"""

from __future__ import annotations

import copy
import json

import datasets
import torch
import trl
from common import load_model, parser

import tigon


def tiny_data(steps: int, batch: int):
    """A word-level tokenizer over the tiny model's vocabulary (token i is the word t<i>) and random rows."""
    from common import TINY
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, TINY["vocab_size"])}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>")
    gen = torch.Generator().manual_seed(0)

    def words(n):
        return " ".join(f"t{int(i)}" for i in torch.randint(3, TINY["vocab_size"], (n,), generator=gen))

    rows = [{"prompt": words(6), "chosen": words(8), "rejected": words(8)} for _ in range(steps * batch)]
    return tokenizer, rows


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    if args.tiny:
        tokenizer, rows = tiny_data(args.steps, args.batch)
    else:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        with open(args.data, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    model = load_model(args)
    reference = copy.deepcopy(model)
    print("\n".join(tigon.patch(model).replaced))
    tigon.patch(reference)
    config = trl.DPOConfig(
        output_dir=args.out or "dpo-out", max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=args.lr, bf16=torch.cuda.is_available(), logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=not torch.cuda.is_available(), max_length=args.seq,
    )
    with tigon.patch_trl():
        trainer = trl.DPOTrainer(model=model, ref_model=reference, args=config,
                                 train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
        trainer.train()
    if args.out:
        trainer.save_model(args.out)


if __name__ == "__main__":
    main()
