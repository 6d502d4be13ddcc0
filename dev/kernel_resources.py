"""Compile one tigon kernel for the H100 (sm_90) on a machine without a GPU: registers, spills, SASS.

    python3 dev/kernel_resources.py cross_entropy cross_entropy_fwd_kernel \
        BLOCK_V=16384 SINGLE_BLOCK=0 COMPUTE_GRAD=1 ROW_PREFETCH=0 PREFETCH=2 STAGES=1 \
        FIRST_READ_POLICY=0 SECOND_READ_POLICY=0 STORE_POLICY=0 HAS_WEIGHT=0 HAS_SMOOTHING=0 \
        HAS_Z_LOSS=0 HAS_SOFTCAP=1 HAS_ROW_SCALE=0 SOFTCAP_SHIFT=1 --warps 32 --ptr logits_ptr=bf16 \
        --ptr grad_ptr=bf16 --ptr target_ptr=i64

An experiment tool kept out of the package (STYLE: llm.c habit). The interpreter that CI runs never
compiles a kernel, so it cannot see what only Triton's compiler and ptxas see: a compile error (the
interpreter is plain Python: it accepted a variable named ``_`` that the compiler tracks across
branches), the registers a thread needs (whether the programs of a persistent grid all fit an SM at
once: 65536 registers an SM), spills to local memory (STACK), and the instruction mix (the MUFU count
of a transcendental-heavy loop). Triton's wheel carries ptxas and cuobjdump, so all of that runs on
the CPU in seconds, before a device call is spent on it.

The signature is built as Triton's launcher would specialize it: every UPPER_CASE argument must be
given as NAME=value (integers; 0/1 for flags); strides named ``*_col_stride``, ``*_stride`` of 1-D
tensors and ``target_stride`` are taken as 1 (Triton specializes an integer argument equal to 1), other
integers as i32 divisible by 16 when named ``*_row_stride`` or ``vocab``; pointers default to fp32 and
are 16-byte aligned; scalars named in ``--float`` (and the usual loss scalars) are fp32.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import subprocess
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's launch default (silences 3.9's notice)

import triton  # noqa: E402
import triton.backends.nvidia as nvidia_backend  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

FLOAT_SCALARS = {"label_smoothing", "z_loss", "logit_scale", "softcap", "softcap_scale", "eps", "offset"}
UNIT_STRIDES = ("_col_stride", "target_stride", "row_scale_stride")
ALIGNED_INTS = ("_row_stride", "vocab")


def _signature(kernel, constexprs: dict, pointers: dict, floats: set):
    names = kernel.arg_names
    signature, values = {}, {}
    for name in names:
        if name in constexprs:
            signature[name], values[name] = "constexpr", constexprs[name]
        elif name.endswith(UNIT_STRIDES):
            signature[name], values[name] = "constexpr", 1
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, "fp32")
        elif name in floats or name in FLOAT_SCALARS:
            signature[name] = "fp32"
        elif name.isupper():
            raise SystemExit(f"{name} is a constexpr of {kernel.fn.__name__}: give it as {name}=value")
        else:
            signature[name] = "i32"
    attrs = {
        (names.index(name),): [["tt.divisibility", 16]]
        for name in names
        if signature[name].startswith("*") or (signature[name] == "i32" and name.endswith(ALIGNED_INTS))
    }
    constants = {(names.index(name),): value for name, value in values.items()}
    return ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", name)


def resources(module: str, kernel_name: str, constexprs: dict, *, warps: int, stages: int = 1, ctas: int = 1,
              pointers: dict | None = None, floats: set | None = None) -> tuple[str, collections.Counter]:
    """(cuobjdump's resource line, SASS opcode counts) of the kernel compiled for sm_90."""
    kernel = getattr(importlib.import_module(f"tigon.ops.{module}"), kernel_name)
    source = _signature(kernel, constexprs, pointers or {}, floats or set())
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, "num_ctas": ctas})
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as cubin:
        cubin.write(compiled.asm["cubin"])
    try:
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin.name], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(cubin.name)
    line = " ".join(part.strip() for part in usage.splitlines() if "REG:" in part)
    opcodes = collections.Counter()
    for text in sass.splitlines():
        text = text.strip()
        if text.startswith("/*") and "*/" in text:
            words = text.split("*/", 1)[1].replace(";", " ").split()
            if words:
                opcode = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
                opcodes[opcode.split(".")[0]] += 1
    return line, opcodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", help="file in src/tigon/ops, e.g. cross_entropy")
    parser.add_argument("kernel", help="the @triton.jit kernel, e.g. cross_entropy_fwd_kernel")
    parser.add_argument("constexprs", nargs="*", help="NAME=int for every constexpr argument")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--ctas", type=int, default=1, help="CTAs per program (a Hopper cluster)")
    parser.add_argument("--ptr", action="append", default=[], help="NAME=dtype (bf16, fp16, fp32, i32, i64)")
    parser.add_argument("--float", action="append", default=[], help="an fp32 scalar argument")
    args = parser.parse_args()
    constexprs = {}
    for item in args.constexprs:
        name, value = item.split("=", 1)
        constexprs[name] = int(value)
    pointers = dict(item.split("=", 1) for item in args.ptr)
    line, opcodes = resources(args.module, args.kernel, constexprs, warps=args.warps, stages=args.stages,
                              ctas=args.ctas,
                              pointers=pointers, floats=set(args.float))
    registers = int(line.split("REG:")[1].split()[0]) if "REG:" in line else 0
    threads = 32 * args.warps
    fit = 65536 // max(1, registers * threads)
    print(f"{args.kernel} warps={args.warps} ctas={args.ctas}: {line}")
    print(f"programs that fit an SM by registers: {fit} (of {threads} threads at {registers} registers)")
    print(f"SASS: {sum(opcodes.values())} instructions; " + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(16)))


if __name__ == "__main__":
    main()
