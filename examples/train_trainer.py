"""Fine-tune a causal LM with the transformers ``Trainer`` and tigon.

    python examples/train_trainer.py --model meta-llama/Llama-3.2-1B --data corpus.txt --steps 1000 --out trained/
    torchrun --nproc_per_node 8 examples/train_trainer.py ...      # the Trainer's own DDP
    python examples/train_trainer.py --tiny --seq 64 --steps 2   # smoke test

The model comes patched from ``tigon.AutoModelForCausalLM`` (transformers' loader, then ``tigon.patch``) and the
``Trainer`` runs it as any model: bf16 mixed precision on a GPU, gradient accumulation (the loss divided by the
accumulated batch's tokens, as transformers does), checkpoints in the stock format. Add ``--deepspeed ds.json``
or ``--fsdp`` options to ``TrainingArguments`` as usual; patch before the Trainer wraps the model (it does here).
"""

from __future__ import annotations

import torch
import transformers
from common import load_model, parser, token_rows

import tigon


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--accumulate", type=int, default=1)
    args = p.parse_args(argv)
    if args.tiny:
        model = load_model(args)
        print("\n".join(tigon.patch(model).replaced))
    else:
        model = tigon.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    training = transformers.TrainingArguments(
        output_dir=args.out or "trainer-out", max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulate, learning_rate=args.lr, bf16=torch.cuda.is_available(),
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
    )
    rows = Rows(token_rows(args, model.config.vocab_size))
    trainer = transformers.Trainer(model=model, args=training, train_dataset=rows)
    trainer.train()
    if args.out:
        trainer.save_model(args.out)


if __name__ == "__main__":
    main()
