"""``benchmarks/context.py``: its options, the search over lengths, one probe's job on the CPU, and the
report (markdown, JSON, plot). The GPU run itself is the lead's."""

from __future__ import annotations

import json

import pytest
from benchmarks import context


def test_defaults_and_limits():
    args = context.parse_args([])
    assert (args.step, args.start, args.max_tokens) == (8192, 8192, 262144)
    assert args.models == list(context.MODELS)
    assert set(args.providers) | {"liger+ckpt"} == set(context.PROVIDERS)
    limited = context.parse_args(["--models", "llama-8b-lora", "--providers", "stock", "tigon+long",
                                  "--max-tokens", "65536"])
    assert limited.models == ["llama-8b-lora"] and limited.providers == ["stock", "tigon+long"]
    assert limited.max_tokens == 65536
    with pytest.raises(SystemExit):
        context.parse_args(["--max-tokens", "4096"])  # below one step
    with pytest.raises(SystemExit):
        context.parse_args(["--providers", "compile"])


def test_the_search_finds_the_longest_length_and_reports_it():
    args = context.parse_args(["--max-tokens", "131072"])

    def fake(job, timeout):
        if job["seq"] > 5 * 8192:
            return {**job, "error": "out of memory", "oom": True}
        return {**job, "tokens_per_s": 1e6 / job["seq"] ** 0.5, "peak_bytes": job["seq"] * 2**20,
                "label": "Llama-shaped", "device": "GPU"}

    row = context.search(args, "llama-1b", "tigon", run=fake, log=lambda line: None)
    assert row["longest_seq"] == 5 * 8192 and row["first_failure"] == 6 * 8192
    assert row["failure"] == "out of memory"
    assert row["tokens_per_s_at_32k"] == pytest.approx(1e6 / 32768 ** 0.5)
    assert row["peak_bytes_at_longest"] == 5 * 8192 * 2**20
    assert [p["seq"] for p in row["probes"]] == sorted(p["seq"] for p in row["probes"])


def test_a_probe_job_trains_two_steps_on_the_cpu():
    result = context.run_job({"model": "llama-1b", "provider": "stock+ckpt", "seq": 16, "steps": 2,
                              "device": "cpu", "tiny": True})
    assert len(result["losses"]) == 2 and result["tokens_per_s"] > 0
    assert result["trained_params"] == result["params"]
    lora = context.run_job({"model": "llama-8b-lora", "provider": "stock", "seq": 16, "steps": 1,
                            "device": "cpu", "tiny": True})
    assert 0 < lora["trained_params"] < lora["params"]


def _result():
    rows = []
    for provider, longest in (("stock", 40960), ("tigon+long", 262144)):
        probes = [{"seq": s, "tokens_per_s": 9000.0 - s / 100, "peak_bytes": 60 * 2**30, "label": "Llama-1B"}
                  for s in (8192, 16384, 32768, longest)]
        rows.append({"model": "llama-1b", "provider": provider, "longest_seq": longest,
                     "first_failure": longest + 8192, "failure": "out of memory",
                     "tokens_per_s_at_32k": 8672.3, "tokens_per_s_at_longest": 7000.0,
                     "peak_bytes_at_longest": 60 * 2**30,
                     "host_bytes_at_longest": 32 * 2**30 if provider == "tigon+long" else None,
                     "label": "Llama-1B", "device": "GPU", "probes": probes})
    return {"kind": "context", "rows": rows, "device": "NVIDIA H200", "date": "2026-12-04", "versions": {},
            "settings": {"step": 8192, "max_tokens": 262144, "skipped": ["liger+ckpt (liger_kernel does not import)"]}}


def test_report_files(tmp_path):
    pytest.importorskip("matplotlib")
    paths = context.save(_result(), tmp_path, log=lambda line: None)
    assert [p.suffix for p in paths] == [".json", ".md", ".png"]
    assert json.loads(paths[0].read_text())["rows"][1]["longest_seq"] == 262144
    text = paths[1].read_text()
    long_row = ("| tigon + checkpointing + offload + tiled MLP | 262144 | 8672 | 7000 | 60.0 | 32.0 "
                "| 270336: out of memory |")
    assert long_row in text
    assert "| stock | 40960 | 8672 | 7000 | 60.0 | — |" in text
    assert "Skipped: liger+ckpt" in text
    assert paths[2].stat().st_size > 10_000
