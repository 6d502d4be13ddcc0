"""``benchmarks/e2e_tp.py``: the tensor-parallel pipeline end to end on the CPU (two gloo ranks, the
interpreter, a tiny Llama), and the report. The timed run is on two GPUs (benchmarks/results)."""

from __future__ import annotations

import json

from benchmarks import e2e_tp


def test_cpu_pipeline_trains_both_providers(tmp_path):
    code = e2e_tp.main(["--device", "cpu", "--tiny", "--models", "llama", "--warmup", "1", "--steps", "1",
                        "--seq", "8", "--batch", "1", "--out", str(tmp_path)])
    assert code == 0
    (saved,) = tmp_path.glob("e2e-tp-cpu-*.json")
    result = json.loads(saved.read_text())
    rows = {row["provider"]: row for row in result["rows"]}
    assert rows.keys() == {"stock", "tigon"} and result["gpus"] == 2
    # The same weights and batches: tigon's loss is stock's within bf16 autocast's rounding.
    for got, want in zip(rows["tigon"]["losses"], rows["stock"]["losses"], strict=True):
        assert abs(got - want) <= 1e-2 * abs(want)
    text = (tmp_path / saved.name.replace(".json", ".md")).read_text()
    assert "| tiny llama, 1 × 8 | tigon |" in text


def test_report_names_a_failed_run():
    result = {"gpus": 2, "gpu": "GPU", "versions": "v", "date": "2026-11-27", "models": ["llama"], "rows": [
        {"model": "llama", "label": "L", "provider": "stock", "batch": 4, "seq": 2048, "tokens_per_s": 1000.0,
         "median_step_s": 8.192, "peak_bytes": 2**30, "losses": [2.0, 1.0]},
        {"model": "llama", "label": "L", "provider": "tigon", "error": "Traceback\nRuntimeError: boom"},
    ]}
    text = e2e_tp.markdown(result)
    assert "| L, 4 × 2048 | stock | 1.0k | 1.00× | 8192.0 | 1.0 | 0.0e+00 |" in text
    assert "error: RuntimeError: boom" in text
