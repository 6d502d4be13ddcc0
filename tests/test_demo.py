"""``tigon demo`` (its CPU path end to end) and ``benchmarks/e2e.py`` (arguments, configs, output).

The demo test is the CI run the issue asks for: a tiny config, a few steps under the interpreter,
the stock and patched losses within the fp32 tolerance at every step, and the plot written. The e2e
benchmark only runs on a GPU; here its argument parsing, model configs (built on the meta device,
so parameter counts are checked without allocating), length search and report writers are tested,
plus one tiny job through the real worker-process protocol.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time

import pytest
import torch
from benchmarks import e2e

import tigon
from tigon import demo
from tigon.cli import build_parser
from tigon.patching.families import FAMILIES

CPU_TOLERANCE = 1e-4  # fp32, per step, relative (the demo's own threshold on CPU)

# Published parameter counts of the shapes the demo and the benchmark build (tied embeddings).
PUBLISHED = {
    "llama": (128256, 1_235_814_400),
    "qwen2": (151936, 494_032_768),
    "gemma2": (256000, 2_614_341_888),
}


# --------------------------------------------------------------------------------------- the demo


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path; the GPU path is the real demo")
def test_cpu_demo_agrees_learns_and_writes_the_plot(tmp_path, capsys):
    status = demo.run_demo(batch=2, seq=32, steps=3, out=tmp_path)
    printed = capsys.readouterr()
    assert status == 0
    assert "No CUDA device" in printed.out and "interpreter" in printed.out
    assert "loss agreement" in printed.out and "OK" in printed.out
    assert "stock  [" in printed.err and "tigon  [" in printed.err  # the progress bars
    png = tmp_path / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((tmp_path / "demo.json").read_text())
    stock, patched = record["runs"]["stock"]["losses"], record["runs"]["tigon"]["losses"]
    assert len(stock) == len(patched) == 3
    for step, (s, t) in enumerate(zip(stock, patched, strict=True)):
        assert abs(t - s) / abs(s) <= CPU_TOLERANCE, f"step {step}: tigon {t} vs stock {s}"
    assert stock[-1] < stock[0], "the synthetic corpus should be learnable from the first steps"
    assert record["runs"]["tigon"]["replaced"], "tigon.patch replaced nothing"
    assert record["max_relative_loss_difference"] <= CPU_TOLERANCE


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_cpu_demo_trains_on_a_local_text_file(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    status = demo.run_demo(model="qwen2", batch=1, seq=16, steps=2, data=str(text), out=tmp_path / "out")
    assert status == 0
    record = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert "byte-level" in record["data"] and record["model_type"] == "qwen2"
    assert (tmp_path / "out" / "demo.png").exists()


@pytest.mark.gpu
def test_gpu_demo_tiny_bf16_agrees(tmp_path, capsys):
    assert demo.run_demo(tiny=True, batch=4, seq=256, steps=12, out=tmp_path) == 0
    record = json.loads((tmp_path / "demo.json").read_text())
    assert record["precision"] == "bf16 autocast"
    assert record["max_relative_loss_difference"] <= demo.TOLERANCE[torch.bfloat16]
    assert all(run["peak_bytes"] > 0 for run in record["runs"].values())


@pytest.mark.gpu
@pytest.mark.bigmem
def test_gpu_demo_llama_1b_shaped_agrees_in_less_memory(tmp_path, capsys):
    # 4096 tokens: enough that the peak falls in the backward (logits and activations alive), not at
    # the end of it where weights, grads and AdamW moments alone set it for both runs alike.
    assert demo.run_demo(batch=2, seq=2048, steps=6, out=tmp_path) == 0
    record = json.loads((tmp_path / "demo.json").read_text())
    assert record["model"] == "Llama-3.2-1B-shaped"
    stock, patched = record["runs"]["stock"], record["runs"]["tigon"]
    assert stock["params"] == patched["params"] == PUBLISHED["llama"][1]
    assert patched["peak_bytes"] < stock["peak_bytes"], "tigon.patch should lower the training peak"
    assert (tmp_path / "demo.png").exists()


def _fake_train(losses_by_label, peak=None):
    def train(setup, label, batches, *, patch):
        run = demo.Run(label, losses=list(losses_by_label[label]), step_seconds=[0.5] * len(batches),
                       peak_bytes=peak, params=10, fingerprint=1.0)
        if patch:
            run.replaced = ["something -> tigon"]
        return run

    return train


# Relative differences as fractions of the run's tolerance (1e-4 in fp32 on a CPU, 2e-2 under
# bf16 autocast on a GPU): half of it passes, five times it fails.
@pytest.mark.parametrize("patched, status", [
    ([4.0, 3.0, 2.0], 0),
    ([4.0, 3.0, "half"], 0),  # within the tolerance
    ([4.0, 3.0, "five"], 1),  # beyond it at one step
    ([4.0, math.nan, 2.0], 1),  # a NaN loss is a disagreement
])
def test_exit_status_follows_the_per_step_agreement(tmp_path, monkeypatch, capsys, patched, status):
    autocast = torch.bfloat16 if torch.cuda.is_available() else None
    factor = {"half": 0.5, "five": 5.0}
    tol = demo.TOLERANCE[autocast]
    patched = [2.0 * (1 + factor[v] * tol) if isinstance(v, str) else v for v in patched]
    monkeypatch.setattr(demo, "train", _fake_train({"stock": [4.0, 3.0, 2.0], "tigon": patched}))
    assert demo.run_demo(batch=1, seq=8, steps=3, out=tmp_path) == status
    out = capsys.readouterr().out
    assert ("DISAGREE" in out) == (status == 1)
    assert (tmp_path / "demo.png").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="gpt2"), "is not supported"),
    (dict(steps=0), "--steps must be at least 1"),
    (dict(data="/nonexistent/corpus.txt"), "No such file"),
])
def test_bad_usage_exits_2_with_a_message(tmp_path, capsys, kwargs, message):
    assert demo.run_demo(out=tmp_path, **kwargs) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "demo.png").exists()


def test_too_short_data_file_exits_2(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    assert demo.run_demo(data=str(short), seq=16, out=tmp_path) == 2
    assert "shorter than one sequence" in capsys.readouterr().err


def test_missing_matplotlib_is_reported_before_training(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(demo, "train", lambda *a, **k: pytest.fail("trained without matplotlib"))
    assert demo.run_demo(out=tmp_path) == 2
    assert "pip install 'tigon[demo]'" in capsys.readouterr().err


def test_cli_demo_flags():
    args = build_parser().parse_args(["demo", "--model", "qwen2", "--batch", "2", "--seq", "128",
                                      "--steps", "7", "--data", "x.txt", "--out", "runs/a", "--tiny"])
    assert args.func.__name__ == "cmd_demo"
    assert (args.model, args.batch, args.seq, args.steps, args.data, args.out, args.tiny) == (
        "qwen2", 2, 128, 7, "x.txt", "runs/a", True)
    defaults = build_parser().parse_args(["demo"])
    assert defaults.model is None and defaults.out == "tigon-demo" and defaults.seed == 0


# ------------------------------------------------------------------------------------------- data


def test_grammar_is_deterministic_spread_over_the_vocab_and_consistent():
    vocab = 128256
    first = demo.synthetic_batches(vocab, 2, 512, 3, seed=1)
    again = demo.synthetic_batches(vocab, 2, 512, 3, seed=1)
    other = demo.synthetic_batches(vocab, 2, 512, 3, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])
    ids = torch.stack(first)
    assert ids.shape == (3, 2, 512) and ids.dtype == torch.int64
    assert ids.min() >= 0 and ids.max() < vocab
    grammar = demo.Grammar(vocab)
    assert grammar.token_of[0] == 0 and grammar.token_of[-1] > 0.99 * vocab  # the whole range
    assert len(set(ids.flatten().tolist())) > 200  # many symbols used, not a handful


def test_grammar_sentences_obey_their_rules():
    grammar = demo.Grammar(512, seed=3)
    first = grammar.first

    def cls(symbol):
        return max((start, name) for name, start in first.items() if start <= symbol)[1]

    additions = statements = 0
    for _ in range(300):
        sentence = grammar.sentence()
        assert cls(sentence[-1]) == "stop"
        if cls(sentence[1]) == "plus":
            a, b = sentence[0] - first["digit"], sentence[2] - first["digit"]
            digits = [s - first["digit"] for s in sentence[4:-1]]
            assert int("".join(map(str, digits))) == a + b
            additions += 1
        else:
            head_noun = next(s for s in sentence if cls(s).startswith("noun"))
            verb = next(s for s in sentence if cls(s).startswith("verb"))
            assert cls(head_noun)[-2:] == cls(verb)[-2:] == cls(sentence[0])[-2:]  # sg/pl agreement
            statements += 1
    assert additions > 20 and statements > 150


def test_byte_tokens_spread_bytes_over_the_vocab():
    tokens = demo.byte_tokens(b"\x00A\xff", 1024)
    assert tokens.tolist() == [0, 65 * 4, 255 * 4]
    with pytest.raises(ValueError, match="do not fit"):
        demo.spread(300, 256)


# ---------------------------------------------------------------------------------- model configs


@pytest.mark.parametrize(
    "model_type", [t for t in tigon.supported_models() if not FAMILIES[t].is_vision_language]
)
def test_every_family_has_a_tiny_and_a_full_config(model_type):
    for tiny in (True, False):
        spec = demo.model_config(model_type, tiny=tiny)
        model = demo.build_model(spec.config, device="meta")
        assert model.training and model.config._attn_implementation == "sdpa"
        assert model.config.model_type == model_type
        assert model.get_input_embeddings().padding_idx is None
        params = demo.parameter_count(model)
        assert params < 2e5 if tiny else 4e8 < params < 3e9, (spec.label, params)


@pytest.mark.parametrize("model_type", sorted(PUBLISHED))
def test_published_shapes(model_type):
    vocab, params = PUBLISHED[model_type]
    spec = e2e.model_spec(model_type)
    assert spec.config.vocab_size == vocab and spec.config.tie_word_embeddings
    assert demo.parameter_count(demo.build_model(spec.config, device="meta")) == params
    if model_type == "gemma2":
        assert spec.config.final_logit_softcapping == 30.0


# ------------------------------------------------------------------------------------ e2e benchmark


def test_e2e_default_arguments():
    args = e2e.parse_args([])
    assert args.models == ["llama", "qwen2", "gemma2"]
    assert args.providers[:4] == ["stock", "tigon", "compile", "tigon+compile"]
    assert ("liger" in args.providers) == e2e.liger_available()
    assert ("liger" in args.skipped) != e2e.liger_available()
    jobs = e2e.jobs_for(args)
    assert len(jobs) == 3 * len(args.providers)
    assert {j["model"]: j["batch"] for j in jobs} == {"llama": 4, "qwen2": 4, "gemma2": 2}
    assert all((j["seq"], j["warmup"], j["steps"]) == (2048, 3, 5) for j in jobs)


def test_e2e_argument_choices():
    args = e2e.parse_args(["--models", "llama", "--providers", "stock", "tigon+compile", "--batch", "1",
                           "--seq", "512", "--steps", "2", "--warmup", "0"])
    assert [(j["provider"], j["batch"], j["seq"]) for j in e2e.jobs_for(args)] == [
        ("stock", 1, 512), ("tigon+compile", 1, 512)]
    context = e2e.parse_args(["--longest-context"])
    assert context.models == ["llama"] and context.providers == ["stock", "tigon"]
    for bad in (["--models", "gpt2"], ["--providers", "apex"], ["--steps", "0"], ["--batch", "0"]):
        with pytest.raises(SystemExit):
            e2e.parse_args(bad)


@pytest.mark.parametrize("limit, expected", [
    (20480, (20480, 22528)),  # doubling 8K, 16K, fail at 32K, then bisection
    (6144, (6144, 8192)),  # the first probe fails: bisect below it
    (1000, (0, 2048)),  # nothing trains
    (10**9, (131072, None)),  # everything up to the maximum trains
])
def test_longest_context_search(limit, expected):
    probed = []

    def probe(seq):
        probed.append(seq)
        return seq <= limit

    assert e2e.search_longest(probe, step=2048, start=8192, maximum=131072) == expected
    assert all(seq % 2048 == 0 for seq in probed) and len(probed) == len(set(probed)) <= 12


def _fake_rows():
    base = {"batch": 4, "seq": 2048, "vocab": 128256, "label": "Llama-3.2-1B-shaped", "params": 10**9,
            "wall_s": 9.0, "warmup": 3, "steps": 5}
    rows = [
        {**base, "model": "llama", "provider": "stock", "tokens_per_s": 40000.0, "median_step_s": 0.2,
         "peak_bytes": 46 * 2**30, "activation_bytes": 30 * 2**30, "losses": [11.9, 11.8]},
        {**base, "model": "llama", "provider": "tigon", "tokens_per_s": 52000.0, "median_step_s": 0.15,
         "peak_bytes": 24 * 2**30, "activation_bytes": 8 * 2**30, "losses": [11.9, 11.81]},
        {**base, "model": "llama", "provider": "tigon+compile", "tokens_per_s": 60000.0,
         "median_step_s": 0.13, "peak_bytes": 22 * 2**30, "activation_bytes": 6 * 2**30,
         "losses": [11.9, 11.8], "graph_breaks": 0},
        {**base, "model": "llama", "provider": "liger", "error": "out of memory", "oom": True},
    ]
    e2e.add_loss_agreement(rows)
    return rows


def test_e2e_reports_throughput(tmp_path):
    rows = _fake_rows()
    assert rows[1]["max_loss_rel_diff"] == pytest.approx(0.01 / 11.8)
    result = {"kind": "throughput", "rows": rows, "device": "NVIDIA H100 80GB HBM3", "date": "2025-01-01",
              "versions": {"torch": "2.11"}, "settings": {"steps": 5, "warmup": 3, "skipped": {}}}
    table = e2e.markdown(result)
    assert ("| Llama-3.2-1B-shaped (V=128256), batch 4 x 2048 | 40.0k (1.00x), 30.0 GiB | "
            "52.0k (1.30x), 8.0 GiB") in table
    assert "| OOM |" in table
    paths = e2e.save(result, tmp_path)
    stem = "e2e-NVIDIA-H100-80GB-HBM3-2025-01-01"
    assert [p.name for p in paths] == [f"{stem}.{ext}" for ext in ("json", "md", "png")]
    assert json.loads(paths[0].read_text())["rows"][1]["tokens_per_s"] == 52000.0
    assert "ERROR out of memory" in e2e.row_line(rows[3])


def test_e2e_reports_longest_context(tmp_path):
    rows = [{"model": "llama", "provider": p, "label": "Llama-3.2-1B-shaped", "longest_seq": n,
             "first_failure": n + 2048, "failure": "out of memory", "peak_bytes_at_longest": 70 * 2**30,
             "device": "H100", "probes": []} for p, n in (("stock", 14336), ("tigon", 51200))]
    result = {"kind": "longest_context", "rows": rows, "device": "H100", "date": "2025-01-01",
              "versions": {"torch": "2.11"}, "settings": {"context_step": 2048, "context_max": 131072}}
    table = e2e.markdown(result)
    assert "| Llama-3.2-1B-shaped | tigon | 51200 | 53248 (out of memory) | 70.0 |" in table
    assert [p.name for p in e2e.save(result, tmp_path)][-1] == "e2e-context-H100-2025-01-01.png"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke test of the GPU benchmark")
def test_e2e_pipeline_smoke_test_on_cpu(tmp_path, capsys):
    """The whole pipeline (worker processes, loss agreement, files, table) with tiny models."""
    argv = ["--device", "cpu", "--tiny", "--models", "llama", "--providers", "stock", "tigon", "--batch", "1",
            "--seq", "16", "--warmup", "1", "--steps", "1", "--out", str(tmp_path)]
    assert e2e.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1].startswith("| llama | tigon |")  # the table is printed last
    result = json.loads(next(tmp_path.glob("e2e-cpu-*.json")).read_text())
    stock, patched = result["rows"]
    assert "error" not in stock and "error" not in patched, (stock.get("error"), patched.get("error"))
    assert len(patched["losses"]) == 2 and patched["label"] == "tiny llama"
    assert patched["max_loss_rel_diff"] <= 3e-2  # bf16 autocast on the CPU
    assert len(list(tmp_path.glob("e2e-cpu-*.*"))) == 3


def test_e2e_times_only_after_the_spare_worker_has_imported(tmp_path):
    """The spare worker's imports must not overlap a job's timed steps (a host-bound step slows)."""
    import threading

    path = tmp_path / "imported"
    threading.Timer(0.3, path.touch).start()
    start = time.perf_counter()
    e2e.wait_until_quiet(str(path))
    assert path.exists() and time.perf_counter() - start >= 0.25
    start = time.perf_counter()
    e2e.wait_until_quiet(None)  # no spare (a job run by hand): no wait
    assert time.perf_counter() - start < 0.05
