"""The ``tigon`` command: env, check, bench, demo, warmup, --version.

Nothing here imports ``tigon.ops`` at module level: ``check`` must decide on Triton's interpreter
(``TRITON_INTERPRET=1`` on a machine without CUDA) before the first kernel is defined.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tigon import __version__


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


ENV_PEERS = ("peft", "bitsandbytes", "accelerate", "deepspeed")


def cmd_env(_args) -> int:
    from importlib import metadata

    import torch

    from tigon._interpreter import interpreter_active
    from tigon.bench.harness import versions

    print(f"tigon {__version__}")
    for name, version in versions().items():
        print(f"{name:<13} {version or 'not installed'}")
    for name in ENV_PEERS:  # what LoRA, QLoRA and the distributed engines bring, for a bug report
        try:
            print(f"{name:<13} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            print(f"{name:<13} not installed")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"device        {props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)")
        print(f"cuda          {torch.version.cuda}")
    else:
        print("device        no CUDA device: kernels can only run under the Triton interpreter")
    interp = interpreter_active()
    print(f"interpreter   {'on (TRITON_INTERPRET=1)' if interp else 'off'}")
    print_families()
    print(FAMILY_KEY)
    return 0


# What the words in each family's line mean (the same terms as docs/glossary.md).
FAMILY_KEY = """\
what the parts mean (more in docs/glossary.md):
  rms_norm, layer_norm      the model's norm layers run as tigon kernels
  rope                      the rotary position embedding of queries and keys, one kernel for both
  mlp (split | fused)       the gated MLP's activation; split: gate and up are two projections, fused: one
                            projection whose output holds both
  experts (halves | interleaved)
                            the mixture-of-experts gate, for experts that store gate and up in one weight as
                            its two halves or as alternating columns; "eager loop": transformers' plain loop
                            over the experts
  attention as one node     the attention block (projections, rotary, attention, output) as one autograd step,
                            which saves fewer tensors for the backward (switch fused_attention)
  joins (pre_norm | post_norm | sandwich)
                            the residual addition computed in the kernel of the norm next to it, for the
                            family's arrangement of norms around each block; "cache argument": the name this
                            transformers gives the decoder layer's key-value cache argument
  fused linear cross-entropy
                            the output projection and the loss computed a slice of the vocabulary at a time,
                            never holding all the logits"""


def print_families(log=print) -> bool:
    """One line per model family: does its row check out on the installed transformers? False if
    a family this transformers has does not."""
    try:
        import transformers
    except ImportError:
        log("families      transformers is not installed: tigon.patch is unavailable")
        return True
    from tigon.patching.status import all_family_statuses, format_status

    log(f"families      tigon.patch's table against transformers {transformers.__version__}:")
    statuses = all_family_statuses()
    for status in statuses:
        log("  " + format_status(status))
    return all(status.ok is not False for status in statuses)


def check_op_names(args, *, checkable: bool) -> None:
    """Refuse op names that no benchmark spec has (argparse's usage error: exit status 2), listing
    the valid ones. ``checkable``: only the specs ``tigon check`` runs (those with a check case)."""
    if not args.ops:
        return
    from tigon.bench.specs import load_specs

    valid = [name for name, spec in load_specs().items() if not checkable or spec.check_case is not None]
    unknown = [name for name in args.ops if name not in valid]
    if unknown:
        args.parser.error(f"unknown op {', '.join(map(repr, unknown))}; valid ops: {', '.join(valid)}")


def cmd_check(args) -> int:
    from tigon._interpreter import use_interpreter_without_gpu

    use_interpreter_without_gpu()
    check_op_names(args, checkable=True)  # (loads tigon.ops: after the interpreter is decided)
    from tigon.check import run_checks

    families_ok = True if args.ops else print_families()
    ops_ok = run_checks(args.ops or None)
    return 0 if families_ok and ops_ok else 1


def cmd_bench(args) -> int:
    if not _cuda_available():
        print("tigon bench needs a CUDA GPU and this machine has none; run it on a GPU machine "
              "(`TESTS=none BENCH=all bash scripts/gpu-check.sh` runs every benchmark).", file=sys.stderr)
        return 2
    check_op_names(args, checkable=False)
    from tigon.bench.harness import markdown, run
    from tigon.bench.history import NONE

    history = None if args.history == NONE else args.history
    result = run(args.ops or None, out_dir=Path(args.out), quick=args.quick, providers=args.providers,
                 history=history, command=" ".join(["tigon", *sys.argv[1:]]), log=print)
    print()
    print(markdown(result))
    print("wrote " + ", ".join(result["files"]))
    return 0


def cmd_demo(args) -> int:
    from tigon._interpreter import use_interpreter_without_gpu

    use_interpreter_without_gpu()
    from tigon.demo import run_demo

    return run_demo(model=args.model, batch=args.batch, seq=args.seq, steps=args.steps, lr=args.lr,
                    seed=args.seed, data=args.data, out=args.out, tiny=args.tiny)


def cmd_warmup(args) -> int:
    from tigon._interpreter import apply_interpreter_fixes, interpreter_active

    if args.device == "cpu":  # a test of the pipeline: the kernels run under the interpreter, nothing compiles
        if not interpreter_active():
            if "tigon.ops" in sys.modules:  # its kernels are defined already, for the GPU
                args.parser.error("--device cpu needs Triton's interpreter on before tigon.ops is imported: "
                                  "run it in a process of its own")
            os.environ["TRITON_INTERPRET"] = "1"
        apply_interpreter_fixes()
    elif not _cuda_available():
        print("tigon warmup compiles tigon's kernels for a GPU and this machine has none (--device cpu runs the "
              "same steps under Triton's CPU interpreter, which compiles nothing).", file=sys.stderr)
        return 2
    from tigon.warmup import WarmupError, parse_switches, report, warmup

    try:
        result = warmup(args.model, seqs=args.seq, batch=args.batch, dtype=args.dtype, autocast=args.autocast,
                        switches=parse_switches(args.switch), device=args.device, cache_dir=args.cache_dir,
                        lora=args.lora, qlora=args.qlora)
    except WarmupError as err:
        args.parser.error(str(err))
    report(result)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tigon", description="Exact fused Triton kernels for LLM training.")
    parser.add_argument("--version", action="version", version=f"tigon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("env", help="print versions, device, interpreter mode and each model family's status")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("check", help="self-test: every model family's row, every op against its reference")
    p.add_argument("ops", nargs="*", help="only these ops (default: all)")
    p.set_defaults(func=cmd_check, parser=p)

    p = sub.add_parser("bench", help="benchmark ops against eager PyTorch, torch.compile and Liger (GPU)")
    p.add_argument("ops", nargs="*", help="only these ops (default: all)")
    p.add_argument("--out", default="tigon-bench", help="folder for the JSON, markdown and plot")
    p.add_argument("--history", default="auto",
                   help="JSON-lines file the run is appended to (default: benchmarks/results/history.jsonl of the "
                        "checkout; 'none': no file)")
    p.add_argument("--quick", action="store_true", help="two cases per op only")
    p.add_argument("--providers", nargs="+", metavar="NAME",
                   help="only these providers (eager, tigon, compile, liger, ...; default: all)")
    p.set_defaults(func=cmd_bench, parser=p)

    p = sub.add_parser("demo", help="train a model twice, stock vs tigon.patch: speed, memory, same loss")
    p.add_argument("--model", help="model_type of any supported family (default: llama)")
    p.add_argument("--batch", type=int, help="sequences per step (default 4; Gemma-2 on a GPU: 2)")
    p.add_argument("--seq", type=int, help="tokens per sequence (GPU default 2048, CPU 64)")
    p.add_argument("--steps", type=int, help="training steps per run (GPU default 50, CPU 24)")
    p.add_argument("--lr", type=float, help="peak AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the synthetic corpus")
    p.add_argument("--data", help="a local text file to train on (byte-level tokens; default: synthetic)")
    p.add_argument("--tiny", action="store_true", help="the tiny config even on a GPU")
    p.add_argument("--out", default="tigon-demo", help="folder for demo.png and demo.json")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("warmup", help="compile every kernel a training step of a model launches into Triton's cache",
                       description="Compile every Triton kernel a training step of MODEL launches (forward and "
                                   "backward of one decoder layer of each kind, and the loss) into Triton's cache, "
                                   "and print what was compiled and where.")
    p.add_argument("model", metavar="MODEL",
                   help="a local folder or config.json, a built-in shape (Llama-3.2-1B-shaped, Qwen2.5-0.5B-shaped, "
                        "Gemma-2-2B-shaped, or a model_type tigon.patch supports), or a Hugging Face model id")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="weights' dtype (default bf16)")
    p.add_argument("--autocast", action="store_true",
                   help="fp32 weights under torch.autocast to --dtype, as the example scripts train")
    p.add_argument("--seq", type=int, nargs="+", default=[2048], metavar="N",
                   help="sequence lengths to run (default 2048)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--switch", action="append", metavar="NAME=VALUE",
                   help="a tigon.patch switch, as training passes it (repeatable; e.g. recompute_norms=true)")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="with PEFT LoRA adapters of rank R on every linear layer but the head, as LoRA training runs")
    p.add_argument("--qlora", action="store_true",
                   help="those layers bitsandbytes 4-bit (nf4, double quant) under the adapters (rank 16 without "
                        "--lora)")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="publish the compiled kernels into DIR, one atomic rename per kernel (default: write into "
                        "Triton's cache, TRITON_CACHE_DIR or ~/.triton/cache)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: run the same steps under Triton's interpreter (a test; compiles nothing)")
    p.set_defaults(func=cmd_warmup, parser=p)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
