"""Fine-tune a causal LM with LoRA or QLoRA through TRL's ``SFTTrainer``, the adapters inside tigon's fused nodes.

    python examples/sft_lora_trl.py --model meta-llama/Llama-3.1-8B --data corpus.txt --seq 4096 --batch 2 --out lora/
    python examples/sft_lora_trl.py --model meta-llama/Llama-3.1-8B --data corpus.txt --qlora --out qlora/
    python examples/sft_lora_trl.py --model meta-llama/Llama-3.1-8B --data corpus.txt --seq 131072 --batch 1 --long
    python examples/sft_lora_trl.py --model Qwen/Qwen3-8B --data corpus.txt --seq 65536 --batch 1 --keep-attention
    python examples/sft_lora_trl.py --tiny --steps 2 --merge --out merged/        # smoke test, no download

The base is loaded in bf16 on a GPU (fp32 on the CPU), or with ``--qlora`` as bitsandbytes 4-bit nf4 with double
quant and bf16 compute; ``SFTTrainer(peft_config=LoraConfig(...))`` wraps it in a ``PeftModel`` (r=16, α=32, the
seven projections; with ``--qlora`` after PEFT's ``prepare_model_for_kbit_training``) and turns gradient
checkpointing on. ``tigon.patch(trainer.model)`` then runs each layer's q/k/v/o and gate/up/down with their
adapters inside tigon's fused attention and MLP nodes (4-bit bases dequantized there by bitsandbytes), under
TRL's fused LM head, which ``tigon.patch_trl()`` computes with tigon (no ``[tokens, vocab]`` logits). It prints
what it replaced. ``--long`` adds ``offload_activations=True`` (each layer's checkpointed input in pinned host
memory) and ``tiled_mlp=True`` (the MLP over chunks of tokens): for sequences of 64K tokens and more.
``--keep-attention`` adds ``keep_attention=True``: the checkpoint's recompute takes each layer's attention output
back from the forward instead of running the attention kernel again (the output stays in GPU memory). ``--out``
gets the adapters (``save_model``); with ``--merge`` (not with ``--qlora``) the adapters merged into the base and
saved as a plain transformers checkpoint.
"""

from __future__ import annotations

import datasets
import peft
import torch
import trl
from common import TINY, parser, tiny_model_folder, token_rows

import tigon

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_tokenizer():
    """A word-level tokenizer over the tiny model's vocabulary (for the trainer; the rows are token ids)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, TINY["vocab_size"])}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def load_base(args, folder: str):
    """The base model: bf16 on a GPU, fp32 on the CPU; with --qlora its linear layers bitsandbytes 4-bit."""
    import transformers

    cuda = torch.cuda.is_available()
    kwargs = {"dtype": torch.bfloat16 if cuda else torch.float32}
    if args.qlora:
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=kwargs["dtype"])
        kwargs["device_map"] = {"": torch.cuda.current_device() if cuda else "cpu"}
    return transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--qlora", action="store_true", help="the base in bitsandbytes 4-bit (nf4, double quant)")
    p.add_argument("--long", action="store_true", help="offload checkpointed activations and tile the MLP")
    p.add_argument("--keep-attention", action="store_true",
                   help="reuse the forward's attention output in the checkpoint's recompute")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--merge", action="store_true", help="save the base with the adapters merged into it")
    p.set_defaults(lr=2e-4)
    args = p.parse_args(argv)
    if args.merge and args.qlora:
        p.error("--merge saves a merged bf16 model: not with --qlora's 4-bit base")
    folder = tiny_model_folder(f"{args.out or 'sft-lora-out'}-tiny-base") if args.tiny else args.model
    tokenizer = tiny_tokenizer() if args.tiny else None
    if tokenizer is None:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    rows = token_rows(args, TINY["vocab_size"])
    cuda = torch.cuda.is_available()
    config = trl.SFTConfig(
        output_dir=args.out or "sft-lora-out", max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=args.lr, bf16=cuda, logging_steps=1, save_strategy="no", report_to=[], use_cpu=not cuda,
        max_length=args.seq, gradient_checkpointing=True,
    )
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=TARGETS,
                           task_type="CAUSAL_LM")
    with tigon.patch_trl():
        trainer = trl.SFTTrainer(model=load_base(args, folder), args=config, processing_class=tokenizer,
                                 train_dataset=datasets.Dataset.from_dict({"input_ids": rows.tolist()}),
                                 peft_config=lora)
        handle = tigon.patch(trainer.model, offload_activations=args.long, tiled_mlp=args.long,
                             keep_attention=args.keep_attention)
        print("\n".join(handle.replaced))
        trainer.train()
    if args.out is None:
        return
    if args.merge:
        merged = trainer.model.merge_and_unload()  # PEFT's merge; the patch is reverted with it
        merged.save_pretrained(args.out)
    else:
        trainer.save_model(args.out)  # the adapters (PEFT's adapter_model.safetensors)


if __name__ == "__main__":
    main()
