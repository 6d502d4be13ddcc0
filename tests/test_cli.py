"""The tigon command: env, check, bench (demo has its own tests)."""

import pytest
import torch

from tigon.cli import main


def test_env_reports_versions_and_interpreter(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "triton" in out and "interpreter" in out


def test_env_reports_the_families_whose_attention_runs_as_one_node(capsys):
    assert main(["env"]) == 0
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["ok"]}
    for family in ("llama", "qwen2", "gemma2", "starcoder2", "smollm3"):
        assert "attention as one node" in lines[family], lines[family]
    assert "attention as one node" not in lines["qwen3"]  # q/k norms: not Llama's attention forward


def test_check_passes_for_rms_norm(capsys):
    assert main(["check", "rms_norm", "add_rms_norm"]) == 0
    out = capsys.readouterr().out
    assert "ok   rms_norm" in out and "all ops match" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU `tigon bench` runs for real (gpu-check.sh)")
def test_bench_without_a_gpu_says_so(capsys):
    assert main(["bench", "rms_norm"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
