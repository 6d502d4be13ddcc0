"""The tigon command: --version, env, check, bench (demo and warmup have their own tests)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tigon
from tigon.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tigon {tigon.__version__}"


def test_version_from_the_command_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tigon.cli", "--version"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "tigon 0.1.0"


def test_env_reports_versions_and_interpreter(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "triton" in out and "interpreter" in out
    assert all(f"\n{name} " in out for name in ("peft", "bitsandbytes", "accelerate", "deepspeed"))


def test_env_reports_the_families_whose_attention_runs_as_one_node(capsys):
    assert main(["env"]) == 0
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["ok"]}
    for family in ("llama", "qwen2", "gemma2", "starcoder2", "smollm3"):
        assert "attention as one node" in lines[family], lines[family]
    assert "attention as one node" not in lines["qwen3"]  # q/k norms: not Llama's attention forward


def test_env_explains_the_words_of_the_family_lines(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "what the parts mean" in out and "docs/glossary.md" in out
    key = out.split("what the parts mean")[1]
    for word in ("joins", "halves", "interleaved", "attention as one node", "fused linear cross-entropy"):
        assert word in key, word


@pytest.mark.parametrize("command", ["check", "bench"])
def test_an_unknown_op_name_is_a_usage_error_listing_the_valid_ones(capsys, command):
    if command == "bench" and not torch.cuda.is_available():
        pytest.skip("without a GPU `tigon bench` stops before it reads op names (test below)")
    with pytest.raises(SystemExit) as exit_info:
        main([command, "rms_norm", "rms_nrom"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "all ops match" not in captured.out and "ok   rms_norm" not in captured.out  # nothing ran
    assert f"tigon {command}: error: unknown op 'rms_nrom'" in captured.err
    assert "valid ops: rms_norm, add_rms_norm" in captured.err and "fused_linear_cross_entropy" in captured.err


def test_check_with_an_unknown_op_exits_2_from_the_command_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tigon.cli", "check", "rms_nrom"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2
    assert "unknown op 'rms_nrom'" in done.stderr and "valid ops:" in done.stderr
    assert "all ops match" not in done.stdout


def test_check_passes_for_rms_norm(capsys):
    assert main(["check", "rms_norm", "add_rms_norm"]) == 0
    out = capsys.readouterr().out
    assert "ok   rms_norm" in out and "all ops match" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU `tigon bench` runs for real (gpu-check.sh)")
def test_bench_without_a_gpu_says_so(capsys):
    assert main(["bench", "rms_norm"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
