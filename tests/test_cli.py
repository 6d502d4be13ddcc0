"""The tigon command: env, check, bench (demo has its own tests)."""

import pytest
import torch

from tigon.cli import main


def test_env_reports_versions_and_interpreter(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "triton" in out and "interpreter" in out


def test_check_passes_for_rms_norm(capsys):
    assert main(["check", "rms_norm", "add_rms_norm"]) == 0
    out = capsys.readouterr().out
    assert "ok   rms_norm" in out and "all ops match" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU `tigon bench` runs for real (gpu-check.sh)")
def test_bench_without_a_gpu_says_so(capsys):
    assert main(["bench", "rms_norm"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
