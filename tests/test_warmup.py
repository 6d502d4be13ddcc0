"""``tigon warmup``: resolving the model, the layers it builds, publishing into a cache, and the run itself
(on the CPU under the interpreter; on a GPU, that a training step after warmup compiles nothing)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tigon.cli import main
from tigon.warmup import (
    cache_entries,
    entry_name,
    layers_needed,
    parse_switches,
    publish,
    resolve_config,
    truncated_config,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)


def warmup_cpu(*args) -> tuple[int, str, str]:
    """``tigon warmup ARGS --device cpu``: its exit status, stdout and stderr. In this process where the
    interpreter is on (a machine without a GPU, tests/conftest.py); on a GPU machine, whose kernels this
    process defines for the GPU, in a process of its own."""
    from tigon._interpreter import interpreter_active

    argv = ["warmup", *map(str, args), "--device", "cpu"]
    if interpreter_active():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_info:
                code = exit_info.code
        return code, out.getvalue(), err.getvalue()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tigon.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=600)
    return done.returncode, done.stdout, done.stderr


@pytest.fixture
def tiny_llama(tmp_path):
    folder = tmp_path / "tiny-llama"
    transformers.LlamaConfig(**TINY, num_hidden_layers=3).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name, label, config_class", [
    ("Llama-3.2-1B-shaped", "Llama-3.2-1B-shaped", transformers.LlamaConfig),
    ("llama-3.2-1b", "Llama-3.2-1B-shaped", transformers.LlamaConfig),
    ("gemma2", "Gemma-2-2B-shaped", transformers.Gemma2Config),
    ("qwen3_moe", "qwen3_moe at Llama-3.2-1B dims", transformers.Qwen3MoeConfig),
])
def test_built_in_shapes_resolve(name, label, config_class):
    got_label, config = resolve_config(name)
    assert got_label == label and type(config) is config_class


def test_built_in_llama_shape_is_llama_3_2_1b():
    _, config = resolve_config("Llama-3.2-1B-shaped")
    assert (config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers) == (
        2048, 8192, 128256, 16)


def test_local_folder_and_config_json_resolve(tiny_llama):
    for path in (tiny_llama, tiny_llama / "config.json"):
        label, config = resolve_config(str(path))
        assert label == str(path) and isinstance(config, transformers.LlamaConfig) and config.vocab_size == 300


def test_an_unknown_model_is_a_usage_error():
    code, _, err = warmup_cpu("no such model!")
    assert code == 2
    assert "tigon warmup: error: model 'no such model!'" in err and "Llama-3.2-1B-shaped" in err


def test_a_folder_without_a_config_is_a_usage_error(tmp_path):
    code, _, err = warmup_cpu(tmp_path)
    assert code == 2
    assert "no transformers config could be read there" in err


@pytest.mark.parametrize("config, needed", [
    (transformers.LlamaConfig(**TINY, num_hidden_layers=3), 1),  # every layer alike
    (transformers.Gemma2Config(**TINY, num_hidden_layers=4, attn_logit_softcapping=None), 2),  # sliding, full
    (transformers.Gemma3TextConfig(**TINY, num_hidden_layers=8), 6),  # five sliding, then full
    (transformers.Qwen3MoeConfig(**TINY, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, mlp_only_layers=[1]), 2),  # experts, dense, experts
])
def test_one_decoder_layer_of_each_kind(config, needed):
    assert layers_needed(config) == needed
    small = truncated_config(config, needed)
    assert small.num_hidden_layers == needed and config.num_hidden_layers > needed  # the original untouched
    if getattr(config, "layer_types", None):
        assert small.layer_types == config.layer_types[:needed]
    assert layers_needed(small) == needed


def test_switches_parse_as_patch_keywords():
    assert parse_switches(["recompute_norms=true", "mlp=off", "tiled_mlp=1", "x=0.5", "y=abc"]) == dict(
        recompute_norms=True, mlp=False, tiled_mlp=1, x=0.5, y="abc")
    code, _, err = warmup_cpu("llama", "--switch", "recompute_norms")
    assert code == 2
    assert "expected NAME=VALUE" in err


def test_warmup_runs_a_patched_training_step_under_the_interpreter(tiny_llama, tmp_path):
    cache = tmp_path / "cache"
    cache_before = os.environ.get("TRITON_CACHE_DIR")
    code, out, err = warmup_cpu(tiny_llama, "--autocast", "--seq", "16", "24", "--switch", "recompute_norms=true",
                                "--cache-dir", cache)
    assert code == 0, err
    assert "1 of 3 decoder layers" in out and "fp32 weights under bf16 autocast" in out
    assert "patched: " in out and "recompute_norms" in out
    assert "nothing was compiled" in out
    assert cache.is_dir() and not list(cache.iterdir())  # its staging folder removed
    assert os.environ.get("TRITON_CACHE_DIR") == cache_before


@pytest.mark.parametrize("flags, lines", [
    (("--lora", "4"), ("LoRA r=4 on every linear layer but the head",
                       "LoRA adapters (r=4) of q_proj/k_proj/v_proj/o_proj run inside the attention node")),
    (("--qlora",), ("LoRA r=16 on every linear layer but the head; bitsandbytes 4-bit nf4 bases",
                    "LoRA adapters (r=16) of gate_proj/up_proj/down_proj run inside the MLP node; bases bitsandbytes "
                    "4-bit nf4, compute bfloat16, double quant")),
])
def test_warmup_with_lora_adapters_and_4bit_bases(tiny_llama, flags, lines):
    """--lora / --qlora: the step LoRA training runs (PEFT's adapters on every linear layer but the head, the base
    frozen; with --qlora on bitsandbytes 4-bit bases), its adapters inside tigon's nodes."""
    pytest.importorskip("peft")
    if "--qlora" in flags:
        pytest.importorskip("bitsandbytes")
    code, out, err = warmup_cpu(tiny_llama, "--seq", "16", *flags)
    assert code == 0, err
    for line in lines:
        assert line in out
    code, _, err = warmup_cpu(tiny_llama, "--qlora", "--dtype", "fp32")
    assert code == 2 and "bf16 or fp16" in err


def test_a_model_that_refuses_sdpa_warms_with_eager_attention(tmp_path):
    folder = tmp_path / "gemma2"  # Gemma-2 as published: attention-logit softcap on, which sdpa cannot apply
    transformers.Gemma2Config(**TINY, num_hidden_layers=4).save_pretrained(folder)
    code, out, err = warmup_cpu(folder, "--seq", "16")
    assert code == 0, err
    assert "2 of 4 decoder layers" in out


def test_an_unknown_switch_is_a_usage_error(tiny_llama):
    code, _, err = warmup_cpu(tiny_llama, "--seq", "16", "--switch", "no_such_switch=true")
    assert code == 2
    assert "no_such_switch" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU warmup runs (the GPU test below)")
def test_warmup_without_a_gpu_says_so(capsys):
    assert main(["warmup", "llama"]) == 2
    assert "this machine has none" in capsys.readouterr().err


def _fake_entry(cache: Path, key: str, kernel: str) -> None:
    """A cache entry as Triton writes one: its files, and a group file naming them by absolute path."""
    entry = cache / key
    entry.mkdir(parents=True)
    (entry / f"{kernel}.json").write_text(json.dumps({"name": kernel, "num_warps": 4}))
    (entry / f"{kernel}.cubin").write_bytes(b"\x7fELF")
    children = {f"{kernel}.{ext}": str(entry / f"{kernel}.{ext}") for ext in ("json", "cubin")}
    (entry / f"__grp__{kernel}.json").write_text(json.dumps({"child_paths": children}))


def test_publish_moves_each_entry_whole_and_points_its_group_at_the_target(tmp_path, monkeypatch):
    from triton.runtime.cache import FileCacheManager

    staging, target = tmp_path / "staging", tmp_path / "cache"
    _fake_entry(staging, "KEYA", "rms_norm_fwd_kernel")
    _fake_entry(staging, "KEYB", "rope_kernel")
    assert entry_name(staging / "KEYA") == "rms_norm_fwd_kernel"
    assert publish(staging, target) == ["KEYA", "KEYB"]
    assert cache_entries(staging) == set() and cache_entries(target) == {"KEYA", "KEYB"}
    # Triton's own cache manager, pointed at the target, finds the entry: a hit, not a recompile
    monkeypatch.setenv("TRITON_CACHE_DIR", str(target))
    group = FileCacheManager("KEYA").get_group("rms_norm_fwd_kernel.json")
    assert group == {name: str(target / "KEYA" / name) for name in ("rms_norm_fwd_kernel.json",
                                                                      "rms_norm_fwd_kernel.cubin")}
    # a second warmup publishing the same entry leaves the first one in place
    other = tmp_path / "other"
    _fake_entry(other, "KEYA", "rms_norm_fwd_kernel")
    _fake_entry(other, "KEYC", "swiglu_kernel")
    assert publish(other, target) == ["KEYC"]
    assert cache_entries(target) == {"KEYA", "KEYB", "KEYC"}


LORA_TRAIN = """
import sys, torch, transformers, peft, tigon
from tigon.bench.models import quantize_4bit
config = transformers.AutoConfig.from_pretrained(sys.argv[1])
model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().train()
if sys.argv[2] == "qlora":
    quantize_4bit(model, torch.device("cuda"), torch.bfloat16)
lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
model = peft.get_peft_model(model, lora).train()
tigon.patch(model)
ids = torch.randint(300, (1, 64), device="cuda")
model(input_ids=ids, labels=ids).loss.backward()
torch.cuda.synchronize()
"""


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_a_lora_training_step_after_warmup_compiles_nothing(tiny_llama, tmp_path, kind):
    """As below, for LoRA (bf16 base, fp32 adapters) and QLoRA (4-bit bases) training and ``--lora`` / ``--qlora``."""
    pytest.importorskip("peft")
    if kind == "qlora":
        pytest.importorskip("bitsandbytes")
    cache = tmp_path / "triton-cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_CACHE_DIR", None)
    flags = ["--lora", "8"] + (["--qlora"] if kind == "qlora" else [])
    done = subprocess.run([sys.executable, "-m", "tigon.cli", "warmup", str(tiny_llama), "--seq", "64", *flags,
                           "--cache-dir", str(cache)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    warmed = cache_entries(cache)
    assert warmed
    done = subprocess.run([sys.executable, "-c", LORA_TRAIN, str(tiny_llama), kind],
                          env={**env, "TRITON_CACHE_DIR": str(cache)}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert cache_entries(cache) == warmed


@pytest.mark.gpu
def test_a_training_step_after_warmup_compiles_nothing(tiny_llama, tmp_path):
    cache = tmp_path / "triton-cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-m", "tigon.cli", "warmup", str(tiny_llama), "--autocast", "--seq", "64",
                           "--cache-dir", str(cache)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "compiled" in done.stdout and str(cache) in done.stdout
    warmed = cache_entries(cache)
    assert warmed and not list(cache.glob(".tigon-warmup-*"))  # the staging folder is gone
    train = (
        "import sys, torch, transformers, tigon\n"
        "model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(sys.argv[1]))\n"
        "model = model.cuda().train(); tigon.patch(model)\n"
        "ids = torch.randint(300, (1, 64), device='cuda')\n"
        "with torch.autocast('cuda', dtype=torch.bfloat16):\n"
        "    model(input_ids=ids, labels=ids).loss.backward()\n"
        "torch.cuda.synchronize()\n"
    )
    done = subprocess.run([sys.executable, "-c", train, str(tiny_llama)], env={**env, "TRITON_CACHE_DIR": str(cache)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert cache_entries(cache) == warmed


def test_benchmark_arguments_and_table():
    from benchmarks.warmup import markdown, parse_args

    args = parse_args(["--seq", "1024", "--steps", "3", "--out", "x"])
    assert (args.seq, args.batch, args.steps, args.out, args.worker) == (1024, 1, 3, "x", False)
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])
    times = lambda step: {"forward": step / 4, "backward": step / 2, "optimizer": step / 4, "step": step}  # noqa: E731
    result = {
        "setup": {"model": "Llama-3.2-1B-shaped", "seq": 2048, "batch": 1, "steps": 5, "device": "NVIDIA H200",
                  "date": "2026-12-04", "versions": {"torch": "2.13.0", "triton": "3.9.0", "liger-kernel": None}},
        "cold": {"first": times(61.0), "steady": times(0.2), "compiled_entries": 40},
        "warmup": {"process_s": 70.0, "compiled_entries": 41},
        "warm": {"first": times(1.0), "steady": times(0.25), "compiled_entries": 0},
    }
    table = markdown(result)
    assert "| tigon, cold cache (the first step compiles) | 61.000 (15.250 / 30.500 / 15.250) |" in table
    assert "| tigon, after `tigon warmup` | 1.000 (0.250 / 0.500 / 0.250) | 0.250" in table
    assert "4.0x a steady step (cold: 305.0x); warmup saved 60.0 s" in table
    assert "torch 2.13.0, triton 3.9.0" in table and "liger" not in table
