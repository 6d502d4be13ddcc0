"""What scripts/gpu-check.sh reads from a pytest run besides its output: one outcome line per test
(``TIGON_TEST_RECORD``) and the number of tests collected (``TIGON_TEST_COLLECTED``), with and without
pytest-xdist, so that a part its budget stops after the last test can be told from one that left tests unrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELECTION = ["tests/test_gpu_order.py"]


@pytest.mark.parametrize("workers", (None, 2), ids=("one process", "two xdist workers"))
def test_the_record_and_the_collected_count_agree(tmp_path, workers):
    record, collected = tmp_path / "results.txt", tmp_path / "collected.txt"
    # (not as one of this run's pytest-xdist workers: the record is the reporting process's)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_XDIST")}
    env.update(TIGON_TEST_RECORD=str(record), TIGON_TEST_COLLECTED=str(collected))
    xdist = ["-p", "no:xdist"] if workers is None else ["-n", str(workers)]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *xdist, *SELECTION],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    outcomes = record.read_text().splitlines()
    assert outcomes and all(line.split()[0] == "passed" for line in outcomes)
    assert int(collected.read_text()) == len({line.split()[1] for line in outcomes})
