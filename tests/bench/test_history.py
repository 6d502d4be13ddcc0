"""The history file every benchmark run appends to (``tigon.bench.history``), without a GPU: the
harness's last writes and the scripts' append each add one parseable line with the required keys."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tigon.bench import harness, history
from tigon.bench.spec import MODES


def _bench_result():
    rows = [{"op": "rms_norm", "case": "M=1000 N=4096", "params": {"M": 1000}, "provider": p, "mode": m,
             "ms": 0.25 + i, "wall_ms": 0.5, "peak_mb": 31.0}
            for i, p in enumerate(("eager", "tigon")) for m in MODES]
    return {"device": "NVIDIA H200", "date": "2026-11-28", "versions": harness.versions(),
            "copy_bandwidth_gbps": 4100.0, "modes": list(MODES), "rows": rows}


def test_harness_run_appends_one_line_with_the_required_keys(tmp_path):
    path = tmp_path / "results" / "history.jsonl"
    result = _bench_result()
    files = harness.finish(result, tmp_path / "out", "NVIDIA-H200-2026-11-28", history=path,
                           command="tigon bench rms_norm", log=lambda _: None)
    assert {p.suffix for p in files} >= {".json", ".md"}
    harness.finish(result, tmp_path / "out", "NVIDIA-H200-2026-11-28", history=path,
                   command="tigon bench rms_norm", log=lambda _: None)
    lines = path.read_text().splitlines()
    assert len(lines) == 2  # one per run, appended
    entry = json.loads(lines[0])
    assert set(history.REQUIRED) <= entry.keys()
    assert entry["benchmark"] == "bench" and entry["command"] == "tigon bench rms_norm"
    assert entry["device"] == "NVIDIA H200" and entry["date"] == "2026-11-28"
    assert entry["versions"]["torch"] and entry["rows"] == result["rows"]
    assert entry["copy_bandwidth_gbps"] == 4100.0
    assert history.read(path) == [entry, entry]


def test_history_none_appends_nothing(tmp_path):
    harness.finish(_bench_result(), tmp_path, "stem", history=None, command="tigon bench", log=lambda _: None)
    assert not list(tmp_path.glob("*.jsonl"))


def test_default_is_the_checkout_history_file():
    assert harness.history_path(harness.AUTO) == history.default_path()
    assert history.default_path() == Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "history.jsonl"


def test_script_records_and_smoke_runs(tmp_path):
    # benchmarks/e2e_tp.py's result: versions as one string, the GPU under "gpu", a temporary path per row.
    result = {"date": "2026-11-27", "gpus": 2, "gpu": "NVIDIA H200", "models": ["llama"],
              "versions": "torch 2.11.0+cu130, transformers 5.17.0",
              "rows": [{"model": "llama", "provider": "tigon", "tokens_per_s": 27431.5, "quiet_path": "/tmp/x"}]}
    path = tmp_path / "h.jsonl"
    entry = history.append(result, benchmark="e2e-tp", command="torchrun ...", path=path)
    assert json.loads(path.read_text()) == entry
    assert entry["device"] == "NVIDIA H200" and entry["gpus"] == 2
    assert entry["versions"] == {"torch": "2.11.0+cu130", "transformers": "5.17.0"}
    assert entry["rows"] == [{"model": "llama", "provider": "tigon", "tokens_per_s": 27431.5}]

    parser = argparse.ArgumentParser()
    history.add_argument(parser)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda")
    assert history.script_path(parser.parse_args([])) == history.default_path()
    assert history.script_path(parser.parse_args(["--tiny"])) is None
    assert history.script_path(parser.parse_args(["--device", "cpu", "--history", str(path)])) == path
    assert history.script_path(parser.parse_args(["--history", "none"])) is None  # as `tigon bench --history none`


def test_a_record_without_device_is_refused(tmp_path):
    with pytest.raises(ValueError, match="device"):
        history.append({"date": "2026-11-28", "versions": {}, "rows": []}, benchmark="bench", command="x",
                       path=tmp_path / "h.jsonl")


def test_command_line_is_what_a_user_types():
    assert history.command_line(["/usr/bin/tigon", "bench", "rms_norm", "--out", "a b"]) == \
        "tigon bench rms_norm --out 'a b'"
    assert history.command_line(["/repo/benchmarks/e2e.py", "--models", "llama"]) == \
        "python benchmarks/e2e.py --models llama"
