"""What scripts/gpu-check.sh reads from a pytest run besides its output: one outcome line per test
(``TIGON_TEST_RECORD``) and the number of tests collected (``TIGON_TEST_COLLECTED``), with and without
pytest-xdist, so that a part its budget stops after the last test can be told from one that left tests unrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELECTION = ["tests/test_gpu_order.py"]
# Ids that hold spaces and differ only after the first one, as some of the suite's do (tests/ops/test_compile.py)
SPACED_IDS = textwrap.dedent('''
    import pytest

    @pytest.mark.parametrize("case", ["one chunk-mean", "one chunk-none"], ids=lambda case: case)
    def test_spaced(case):
        assert case.startswith("one chunk")
''')


@pytest.mark.parametrize("workers", (None, 2), ids=("one process", "two xdist workers"))
def test_the_record_and_the_collected_count_agree(tmp_path, workers):
    record, collected = tmp_path / "results.txt", tmp_path / "collected.txt"
    # (not as one of this run's pytest-xdist workers: the record is the reporting process's)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_XDIST")}
    env.update(TIGON_TEST_RECORD=str(record), TIGON_TEST_COLLECTED=str(collected))
    xdist = ["-p", "no:xdist"] if workers is None else ["-n", str(workers)]
    spaced = ROOT / "tests" / f"test_spaced_ids_{os.getpid()}_{workers}.py"  # under tests/: its conftest's hooks
    spaced.write_text(SPACED_IDS)
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *xdist, *SELECTION,
                               str(spaced.relative_to(ROOT))], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
    finally:
        spaced.unlink()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    outcomes = record.read_text().splitlines()
    assert outcomes and all(line.split()[0] == "passed" for line in outcomes)
    assert int(collected.read_text()) == len({line.split(maxsplit=1)[1] for line in outcomes})
    assert any(" " in line.split(maxsplit=1)[1] for line in outcomes)  # the spaced ids are in the record whole
    assert _script_finds_every_test_ran(tmp_path, record, collected)


def _script_finds_every_test_ran(out: Path, record: Path, collected: Path) -> bool:
    """scripts/gpu-check.sh's ``ran_every_test`` on this record and count, run by bash as the script runs it."""
    script = (ROOT / "scripts" / "gpu-check.sh").read_text()
    function = re.search(r"^ran_every_test\(\) \{.*?^\}", script, re.MULTILINE | re.DOTALL).group(0)
    (out / "results-part.txt").write_text(record.read_text())
    (out / "collected-part.txt").write_text(collected.read_text())
    done = subprocess.run(["bash", "-c", f'{function}\nOUT="$1"; ran_every_test part', "bash", str(out)],
                          capture_output=True, text=True, timeout=60)
    return done.returncode == 0


def test_the_script_counts_a_test_left_unrun(tmp_path):
    record, collected = tmp_path / "results.txt", tmp_path / "collected.txt"
    record.write_text("passed tests/ops/test_compile.py::test_x[one chunk-mean]\n"
                      "failed tests/ops/test_compile.py::test_x[one chunk-none]\n")
    collected.write_text("2")
    assert _script_finds_every_test_ran(tmp_path, record, collected)
    collected.write_text("3")
    assert not _script_finds_every_test_ran(tmp_path, record, collected)
