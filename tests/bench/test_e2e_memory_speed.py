"""``benchmarks/e2e.py --memory-buys-speed``: its defaults, the 3B shape, the providers' switches and
the report (the GPU run itself is the lead's; the CPU pipeline is smoke-tested by the profile tests)."""

from __future__ import annotations

import torch
from benchmarks import e2e


def test_defaults_are_the_documented_setting():
    args = e2e.parse_args(["--memory-buys-speed"])
    assert (args.batch, args.seq, args.warmup, args.steps) == (1, e2e.MEMORY_SPEED_SEQ, 2, 3)
    assert args.providers == list(e2e.MEMORY_SPEED_PROVIDERS) and args.models == ["llama"]
    job = e2e.jobs_for(args)[0]
    assert job["shape"] == "llama-3b" and job["batch"] == 1
    plain = e2e.parse_args([])
    assert (plain.seq, plain.warmup, plain.steps) == (e2e.SEQ, e2e.WARMUP, e2e.STEPS)
    assert e2e.jobs_for(plain)[0]["shape"] is None


def test_the_3b_shape_has_llama_3_2_3b_parameters():
    import transformers

    spec = e2e.model_spec("llama", shape="llama-3b")
    assert spec.label == "Llama-3.2-3B-shaped"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(spec.config)
    params = sum(p.numel() for p in model.parameters())
    assert 3.20e9 < params < 3.22e9  # tied embeddings, as published
    assert e2e.model_spec("llama", tiny=True, shape="llama-3b").config.hidden_size < 3072  # --tiny wins


def test_report_speedups_and_premise():
    rows = [
        {"model": "llama", "provider": "stock", "batch": 1, "seq": 12288, "error": "out of memory", "oom": True},
        {"model": "llama", "provider": "stock+ckpt", "batch": 1, "seq": 12288, "tokens_per_s": 1000.0,
         "median_step_s": 8.192, "peak_bytes": 60 * 2**30, "losses": [2.0, 1.0], "label": "Llama-3.2-3B-shaped",
         "vocab": 128256},
        {"model": "llama", "provider": "tigon", "batch": 1, "seq": 12288, "tokens_per_s": 1700.0,
         "median_step_s": 4.8, "peak_bytes": 75 * 2**30, "losses": [2.0, 1.0001]},
    ]
    e2e.add_loss_agreement(rows, reference="stock+ckpt")
    result = {"kind": "memory_speed", "rows": rows, "reference": "stock+ckpt", "search": None,
              "device": "GPU", "date": "2026-11-26", "versions": {},
              "settings": {"batch": 1, "steps": 3, "warmup": 2}}
    text = e2e.markdown(result)
    assert "| tigon | 1700 | 1.70 |" in text and "1.0e-04" in text
    assert "| stock | out of memory |" in text
    assert "holds, stock without checkpointing runs out of memory" in text
