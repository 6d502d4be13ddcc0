"""``benchmarks/context.py``: its options, the search over lengths, the probes' workers (Unsloth's with its own
site), one probe's job on the CPU (full fine-tuning, LoRA, QLoRA; an Unsloth job as far as it goes without Unsloth),
and the report (markdown, JSON, plot; Unsloth's rows, an error row, its published figures; the run's line in the
history). The GPU run itself is not tested here."""

from __future__ import annotations

import json
import os

import pytest
from benchmarks import context


def test_defaults_and_limits(tmp_path):
    args = context.parse_args(["--unsloth-site", str(tmp_path)])
    assert (args.step, args.start, args.max_tokens) == (8192, 8192, 262144)
    assert args.models == ["llama-1b", "llama-8b-lora", "llama-8b-qlora"] == list(context.MODELS)
    assert set(args.providers) | {"liger+ckpt"} == set(context.PROVIDERS)  # no Unsloth in the site
    assert args.gpu_memory is None and args.unsloth_dir is None
    limited = context.parse_args(["--models", "llama-8b-lora", "--providers", "stock", "tigon+long",
                                  "--max-tokens", "65536", "--gpu-memory", "79.5"])
    assert limited.models == ["llama-8b-lora"] and limited.providers == ["stock", "tigon+long"]
    assert limited.max_tokens == 65536 and limited.gpu_memory == 79.5
    for bad in (["--max-tokens", "4096"],  # below one step
                ["--providers", "compile"], ["--providers", "stock", "stock"], ["--gpu-memory", "0"]):
        with pytest.raises(SystemExit):
            context.parse_args(bad)


def test_unsloth_providers_join_the_defaults_where_the_site_holds_unsloth(tmp_path):
    (tmp_path / "unsloth").mkdir()
    (tmp_path / "unsloth" / "__init__.py").write_text("")
    args = context.parse_args(["--unsloth-site", str(tmp_path)])
    assert args.providers[-3:] == ["unsloth", "unsloth+ckpt", "unsloth+long"] == list(context.UNSLOTH_PROVIDERS)
    named = context.parse_args(["--unsloth-site", str(tmp_path / "elsewhere"), "--providers", "unsloth+long"])
    assert named.providers == ["unsloth+long"]  # asked for by name: it runs, and its error is its row


def test_an_unsloth_probe_without_unsloth_in_its_site_is_an_error_row(tmp_path):
    args = context.parse_args(["--unsloth-site", str(tmp_path), "--providers", "unsloth"])
    row = context.search(args, "llama-8b-qlora", "unsloth", log=lambda line: None)
    assert row["longest_seq"] == 0 and row["first_failure"] == 8192
    assert row["failure"] == f"Unsloth is not in --unsloth-site {tmp_path}"
    assert row["label"] == context.MODELS["llama-8b-qlora"][0]


def test_probes_run_in_workers_with_unsloths_site_first_for_its_providers(tmp_path, monkeypatch):
    (tmp_path / "unsloth").mkdir()
    (tmp_path / "unsloth" / "__init__.py").write_text("")
    started = []

    class Recorder:  # e2e.Worker's interface: what the probe starts, and the job it hands over
        def __init__(self, script, env, args):
            started.append((script, env, args))

        def run(self, job, timeout):
            return {**job, "tokens_per_s": 1.0}

    monkeypatch.setattr(context.e2e, "Worker", Recorder)
    for provider in ("tigon+long", "unsloth+ckpt"):
        job = {"model": "llama-8b-qlora", "provider": provider, "seq": 8192}
        assert context.probe(job, 60, unsloth_site=tmp_path)["tokens_per_s"] == 1.0
    (script, env, args), (unsloth_script, unsloth_env, unsloth_args) = started
    assert script == unsloth_script == context.__file__
    assert env is None and args == ()
    assert unsloth_args == ("--unsloth",)
    path = unsloth_env["PYTHONPATH"].split(":")
    assert path[:2] == [str(tmp_path), str(context.ROOT / "src")] and unsloth_env["HF_HUB_OFFLINE"] == "1"


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


def test_a_row_names_the_gpu_when_its_first_probe_failed_before_it_started():
    # a probe that runs out of memory while its model is built reports only its job's "cuda"
    args = context.parse_args(["--start", "32768", "--max-tokens", "65536"])

    def fake(job, timeout):
        if job["seq"] > 3 * 8192:
            return {**job, "error": "out of memory", "oom": True}
        return {**job, "tokens_per_s": 5000.0, "peak_bytes": 2**30, "label": "Llama-shaped", "device": "GPU-name"}

    row = context.search(args, "llama-8b-lora", "stock+ckpt", run=fake, log=lambda line: None)
    assert row["probes"][-1]["device"] == "cuda" and row["longest_seq"] == 3 * 8192
    assert row["device"] == "GPU-name"
    assert context.named_device([{"device": "cuda"}]) == "cuda"
    assert context.named_device([]) is None


def test_a_run_appends_its_rows_to_the_history(tmp_path, monkeypatch):
    from tigon.bench import history

    # main turns the interpreter on for its probes (--device cpu); monkeypatch puts the switch back after the test
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))

    def fake_search(args, model, provider):
        return {**_result()["rows"][0], "model": model, "provider": provider, "device": "GPU-name"}

    monkeypatch.setattr(context, "search", fake_search)
    monkeypatch.setattr(context, "save", lambda result, out: [])
    target = tmp_path / "history.jsonl"
    argv = ["--device", "cpu", "--tiny", "--models", "llama-1b", "--providers", "stock", "tigon",
            "--history", str(target), "--out", str(tmp_path)]
    assert context.main(argv) == 0
    (line,) = history.read(target)
    assert line["benchmark"] == "context" and line["device"] == "GPU-name"
    assert [r["provider"] for r in line["rows"]] == ["stock", "tigon"]
    assert line["command"] and line["versions"]["torch"]
    assert {"peft", "bitsandbytes", "tigon"} <= set(line["versions"])  # the LoRA and QLoRA rows' libraries
    assert context.main(argv[:-4] + ["--out", str(tmp_path)]) == 0  # a smoke run appends nowhere by default
    assert len(history.read(target)) == 1


def test_a_probe_job_trains_two_steps_on_the_cpu():
    result = context.run_job({"model": "llama-1b", "provider": "stock+ckpt", "seq": 16, "steps": 2,
                              "device": "cpu", "tiny": True})
    assert len(result["losses"]) == 2 and result["tokens_per_s"] > 0
    assert result["trained_params"] == result["params"]
    lora = context.run_job({"model": "llama-8b-lora", "provider": "stock", "seq": 16, "steps": 1,
                            "device": "cpu", "tiny": True})
    assert 0 < lora["trained_params"] < lora["params"]


def test_tigon_tiled_and_offload_are_tigon_long_without_one_switch_and_kept_adds_keep_attention():
    from tigon.nn.tiled_mlp import TiledForward
    from tigon.patching.parts.long_context import KEEP_ATTR, offloader_of

    built = {}
    for provider in ("tigon+tiled", "tigon+offload", "tigon+offload+kept", "tigon+long", "tigon+long+kept"):
        _, model, _ = context.build({"model": "llama-1b", "provider": provider, "seq": 16, "device": "cpu",
                                     "tiny": True})
        mlps = [m for m in model.modules() if isinstance(getattr(m, "forward", None), TiledForward)]
        checkpointed = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        kept = any(KEEP_ATTR in vars(m) for m in model.modules())
        built[provider] = (checkpointed, bool(mlps), offloader_of(model) is not None, kept)
    assert built == {"tigon+tiled": (True, True, False, False), "tigon+offload": (True, False, True, False),
                     "tigon+offload+kept": (True, False, True, True), "tigon+long": (True, True, True, False),
                     "tigon+long+kept": (True, True, True, True)}


def test_the_page_says_what_the_offload_costs_at_32k():
    result = _result()
    tiled = {**result["rows"][1], "provider": "tigon+tiled", "tokens_per_s_at_32k": 9000.0,
             "host_bytes_at_longest": None}
    text = context.markdown({**result, "rows": [*result["rows"][:2], tiled, *result["rows"][2:]]})
    assert ("The offload at 32K tokens: tigon + checkpointing + offload + tiled MLP runs at 0.964× the tokens/s of "
            "tigon + checkpointing + tiled MLP (within the target of ≥ 0.90×).") in text
    assert "The offload at 32K" not in context.markdown(result)  # no tigon+tiled row: nothing to compare


def test_the_qlora_row_trains_adapters_on_4bit_bases():
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    job = {"model": "llama-8b-qlora", "provider": "stock", "seq": 16, "steps": 1, "device": "cpu", "tiny": True}
    label, model, _ = context.build(job)
    assert label == "tiny llama-8b-qlora"
    bases = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(bases) == 7 * model.config.num_hidden_layers
    ranks = {p.shape[0] for n, p in model.named_parameters() if "lora_A" in n}
    assert ranks == {context.ADAPTERS["qlora"][0]} == {32}
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)


def test_an_unsloth_job_saves_the_rows_weights_once_for_its_loader(tmp_path):
    """Where Unsloth cannot import (here: not installed), the job fails at the import, after the first probe
    has left the model and a tokenizer in the run's folder, under the name every later probe reads."""
    job = {"model": "llama-8b-lora", "provider": "unsloth+long", "seq": 16, "steps": 1, "device": "cpu",
           "tiny": True, "unsloth_dir": str(tmp_path)}
    with pytest.raises(ImportError, match="unsloth"):
        context.run_job(job)
    folder = tmp_path / "tiny-llama-3.1-8b-bf16"
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    written = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    with pytest.raises(ImportError, match="unsloth"):
        context.run_job({**job, "provider": "unsloth", "seq": 32})  # a later probe: reads what is there
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == written


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
    qlora = context.MODELS["llama-8b-qlora"][0]
    probes = [{"seq": s, "tokens_per_s": 3000.0 - s / 1000, "peak_bytes": 70 * 2**30, "label": qlora}
              for s in (8192, 16384, 32768, 65536, 131072, 262144)]
    rows.append({"model": "llama-8b-qlora", "provider": "unsloth+ckpt", "longest_seq": 262144, "first_failure": None,
                 "failure": None, "tokens_per_s_at_32k": 2967.2, "tokens_per_s_at_longest": 2737.9,
                 "peak_bytes_at_longest": 70 * 2**30, "host_bytes_at_longest": None, "label": qlora, "device": "GPU",
                 "probes": probes, "versions": {"unsloth": "2026.10.9", "transformers": "5.17.0"}})
    error = "worker exited with status 1: Traceback | ValueError: Unsloth: no tiled MLP for this model"
    rows.append({"model": "llama-8b-qlora", "provider": "unsloth+long", "longest_seq": 0, "first_failure": 8192,
                 "failure": error, "tokens_per_s_at_32k": None, "tokens_per_s_at_longest": None,
                 "peak_bytes_at_longest": None, "host_bytes_at_longest": None, "label": qlora, "device": None,
                 "probes": [{"seq": 8192, "error": error}]})
    return {"kind": "context", "rows": rows, "device": "NVIDIA H200", "date": "2026-12-04", "versions": {},
            "unsloth_versions": {"unsloth": "2026.10.9", "transformers": "5.17.0", "bitsandbytes": None},
            "settings": {"step": 8192, "max_tokens": 262144, "gpu_memory": 79.0,
                         "skipped": ["liger+ckpt (liger_kernel does not import)"]}}


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
    assert "tokens/s from the second step; GPU memory capped at 79 GiB." in text
    assert "Unsloth's probes (their own site): unsloth 2026.10.9, transformers 5.17.0\n" in text
    assert paths[2].stat().st_size > 10_000


def test_the_page_shows_unsloths_rows_its_errors_and_its_published_figures():
    text = context.markdown(_result())
    section = text[text.index("## Llama-3.1-8B-shaped, QLoRA"):]
    # --max-tokens trained: the provider may reach further
    assert "| Unsloth + offloaded checkpointing | ≥ 262144 | 2967 | 2738 | 70.0 | — | — |" in section
    assert ("| Unsloth + offloaded checkpointing + tiled MLP | none | — | — | — | — | 8192: worker exited with "
            "status 1: Traceback / ValueError: Unsloth: no tiled MLP for this model |") in section
    published = ("Published, not measured here: Unsloth's benchmarks "
                 "(https://unsloth.ai/docs/basics/unsloth-benchmarks), "
                 '"Llama 3.1 (8B) max. context length", 4-bit QLoRA r=32 on all linear layers, batch 1, A100/H100 — '
                 "80 GB: 342,733 tokens with Unsloth vs 28,454 with Hugging Face + FA2; 48 GB: 191,728 tokens with "
                 "Unsloth; 40 GB: 153,977 tokens with Unsloth.")
    assert section.count(published) == 1 and text.count("Published, not measured here") == 1
    assert section.index("tiled MLP | none") < section.index(published)
    tiny = context.markdown({**_result(), "settings": {**_result()["settings"], "tiny": True}})
    assert "Published" not in tiny  # a tiny model's figures are not Llama 3.1 (8B)'s


def test_a_search_split_over_device_calls_merges_into_one_page(tmp_path):
    """--merge: the earlier run's rows first, one row per model and provider, the settings naming them all."""
    settings = {name: 1 for name in context.MERGE_SAME}
    earlier = {"kind": "context", "device": "NVIDIA H200", "settings": {**settings, "models": ["llama-1b"],
                                                                      "providers": ["stock", "tigon"]},
               "rows": [{"model": "llama-1b", "provider": "stock"}, {"model": "llama-1b", "provider": "tigon"}]}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    result = {"kind": "context", "device": "NVIDIA H200",
              "settings": {**settings, "models": ["llama-8b-lora"], "providers": ["stock"]},
              "rows": [{"model": "llama-8b-lora", "provider": "stock"}]}
    context.merge(result, [path])
    assert [(r["model"], r["provider"]) for r in result["rows"]] == [
        ("llama-1b", "stock"), ("llama-1b", "tigon"), ("llama-8b-lora", "stock")]
    assert result["settings"]["models"] == ["llama-1b", "llama-8b-lora"]
    assert result["settings"]["providers"] == ["stock", "tigon"]


def _fails_inside_a_library(job):
    raise RuntimeError("A view was created in no_grad mode and its base or another view of its base has been "
                       "modified inplace with grad mode enabled.\nsecond line")


def test_a_failed_probe_says_where_it_failed(monkeypatch, capsys):
    import io

    job = {"model": "llama-8b-lora", "provider": "unsloth+long", "seq": 131072}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(job) + "\n"))
    assert context.e2e.worker_main(run=_fails_inside_a_library) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    result = json.loads(line.removeprefix(context.e2e.RESULT_MARK))
    assert result["error"].startswith("RuntimeError: A view was created in no_grad mode") and not result["oom"]
    assert "second line" not in result["error"]
    assert result["trace"][-1] == "bench/test_context.py:" + str(
        _fails_inside_a_library.__code__.co_firstlineno + 1) + " _fails_inside_a_library"
    assert len(result["trace"]) <= context.e2e.TRACE_FRAMES
    shown = context.probe_line("unsloth+long", result)
    assert shown.endswith("at " + result["trace"][-1]) and "RuntimeError" in shown.splitlines()[0]
    probes = [{k: result[k] for k in context.PROBE_KEYS if k in result}]
    assert probes[0]["trace"] == result["trace"]  # the row's probes keep it for the JSON


def _run(provider, probes, *, date="2026-12-06", device="GPU-name", model="llama-8b-lora", **settings):
    """A context run's result as a history line holds it: one row of ``provider`` with ``probes``."""
    row = context.row_of(model, provider, probes, 0, None)
    return {"kind": "context", "benchmark": "context", "date": date, "device": device, "rows": [row],
            "versions": {"torch": "2.11.0"}, "unsloth_versions": None, "wall_s": 10.0,
            "settings": {**{name: 1 for name in context.COMBINE_SAME}, **settings}}


def _probe(seq, speed=None, *, error=None, peak=2**30):
    if error:
        return {"seq": seq, "error": error, "oom": error == "out of memory", "device": "GPU-name"}
    return {"seq": seq, "tokens_per_s": speed, "peak_bytes": peak, "device": "GPU-name", "label": "Llama-8B-shaped"}


def test_runs_that_probed_different_lengths_combine_into_one_page(tmp_path):
    """--combine: a row's probes from every run, its longest the longest that trained, its first failure the
    shortest that failed above it; a length trained three times gives the median and range."""
    pytest.importorskip("matplotlib")
    runs = [_run("liger+ckpt", [_probe(32768, 5600.0), _probe(65536, 4100.0)], step=16384),
            _run("liger+ckpt", [_probe(98304, 3156.0, peak=3 * 2**30)], step=98304),
            _run("unsloth+ckpt", [_probe(131072, 2761.0)], step=131072),
            _run("liger+ckpt", [_probe(98304, 3201.0, peak=4 * 2**30)], step=98304),
            _run("unsloth+ckpt", [_probe(262144, error="out of memory")], step=262144),
            _run("liger+ckpt", [_probe(98304, 3160.0, peak=3 * 2**30)], step=98304),
            _run("unsloth+ckpt", [_probe(196608, 1954.0)], step=196608),
            _run("unsloth+long", [_probe(131072, error="ImportError: no bitsandbytes")], step=131072),
            _run("unsloth+long", [_probe(131072, error="RuntimeError: a view")], step=131072)]
    files = []
    for number, run in enumerate(runs):
        files.append(tmp_path / f"run{number}.json")
        files[-1].write_text(json.dumps(run))
    result = context.combine(files)
    rows = {r["provider"]: r for r in result["rows"]}
    assert list(rows) == ["liger+ckpt", "unsloth+ckpt", "unsloth+long"]
    liger, unsloth, tiled = rows.values()
    assert (liger["longest_seq"], liger["first_failure"]) == (98304, None)
    assert liger["tokens_per_s_at_longest"] == 3160.0 and liger["tokens_per_s_range_at_longest"] == [3156.0, 3201.0]
    assert liger["peak_bytes_at_longest"] == 4 * 2**30 and liger["tokens_per_s_at_32k"] == 5600.0
    assert (unsloth["longest_seq"], unsloth["first_failure"], unsloth["failure"]) == (196608, 262144, "out of memory")
    assert unsloth["tokens_per_s_at_longest"] == 1954.0 and unsloth["tokens_per_s_range_at_longest"] is None
    assert [p["seq"] for p in unsloth["probes"]] == [131072, 196608, 262144]
    assert (tiled["longest_seq"], tiled["failure"]) == (0, "RuntimeError: a view")  # the latest run's error
    assert result["settings"]["runs"] == 9 and result["settings"]["combined"][0] == "run0.json"
    assert result["settings"]["providers"] == ["liger+ckpt", "unsloth+ckpt", "unsloth+long"]
    text = context.markdown(result)
    assert "| Liger-Kernel + checkpointing | ≥ 98304 | 5600 | 3160 (3156–3201) | 4.0 | — | — |" in text
    assert "| Unsloth + offloaded checkpointing | 196608 | — | 1954 | 1.0 | — | 262144: out of memory |" in text
    assert "the lengths each row probed are listed under its table" in text
    assert ("Lengths probed: Liger-Kernel + checkpointing: 32768, 65536, 98304 ×3; Unsloth + offloaded "
            "checkpointing: 131072, 196608, 262144 (failed); Unsloth + offloaded checkpointing + tiled MLP: "
            "131072 ×2 (failed).") in text
    assert "Probes of 9 runs, combined" in text and "Lengths: multiples" not in text
    out = tmp_path / "page"
    assert context.main(["--combine", *map(str, files), "--out", str(out)]) == 0
    assert sorted(p.suffix for p in out.iterdir()) == [".json", ".md", ".png"]


def test_a_history_files_runs_of_one_day_combine_and_mismatched_runs_are_refused(tmp_path):
    history_file = tmp_path / "history.jsonl"
    lines = [_run("tigon+long", [_probe(32768, 5674.0)], date="2026-12-05"),
             _run("tigon+long", [_probe(131072, 2543.0)]),
             {"benchmark": "lora", "date": "2026-12-06"},
             _run("tigon+long", [_probe(262144, 1457.0)])]
    history_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = context.combine([history_file], "2026-12-06")
    (row,) = result["rows"]
    assert [p["seq"] for p in row["probes"]] == [131072, 262144] and row["longest_seq"] == 262144
    assert result["settings"]["combined"] == ["history.jsonl, line 2", "history.jsonl, line 4"]
    with pytest.raises(ValueError, match="needs --date"):
        context.combine([history_file])
    with pytest.raises(SystemExit):
        context.parse_args(["--date", "2026-12-06"])  # --date only with --combine
    with pytest.raises(ValueError, match="no context runs of 2026-12-07"):
        context.combine([history_file], "2026-12-07")
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_run("stock", [_probe(8192, 1.0)], device="another GPU")))
    with pytest.raises(ValueError, match="on another GPU"):
        context.combine([history_file, other], "2026-12-06")
    other.write_text(json.dumps(_run("stock", [_probe(8192, 1.0)], seed=2)))
    with pytest.raises(ValueError, match="its seed is 2"):
        context.combine([history_file, other], "2026-12-06")


def test_combining_a_day_keeps_the_models_asked_for(tmp_path):
    """A day's 1B full fine-tunes and 8B LoRA runs differ in their adapters, so combining them all is refused;
    --models keeps one model's runs for its own page."""
    history_file = tmp_path / "history.jsonl"
    lines = [_run("stock", [_probe(8192, 29475.0)], model="llama-1b", adapters=None),
             _run("tigon+offload", [_probe(131072, 2722.0)], adapters="lora"),
             _run("liger+ckpt", [_probe(16384, 31957.0)], model="llama-1b", adapters=None)]
    history_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match="adapters"):
        context.combine([history_file], "2026-12-06")
    result = context.combine([history_file], "2026-12-06", ["llama-1b"])
    assert [r["provider"] for r in result["rows"]] == ["stock", "liger+ckpt"]
    assert result["settings"]["models"] == ["llama-1b"]
    assert result["settings"]["combined"] == ["history.jsonl, line 1", "history.jsonl, line 3"]
    (row,) = context.combine([history_file], "2026-12-06", ["llama-8b-lora"])["rows"]
    assert row["provider"] == "tigon+offload" and row["longest_seq"] == 131072
    with pytest.raises(ValueError, match="no runs of llama-3b"):
        context.combine([history_file], "2026-12-06", ["llama-3b"])


def test_a_superseded_row_joins_no_row_and_the_page_names_it(tmp_path):
    """A run's row marked ``superseded`` (the code it measured is not the code tigon runs) is left out of its provider's
    row, which the other runs' probes make; the page names it, with its note, under the model's table."""
    history_file = tmp_path / "history.jsonl"
    old = _run("tigon+offload+kept", [_probe(131072, 3227.0, peak=68 * 2**30)])
    old["rows"][0]["superseded"] = "the kept outputs stayed on the GPU"
    lines = [old, _run("unsloth+ckpt", [_probe(131072, 2713.0)]),
             _run("tigon+offload+kept", [_probe(131072, 3219.0, peak=38 * 2**30)])]
    history_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = context.combine([history_file], "2026-12-06")
    rows = {r["provider"]: r for r in result["rows"]}
    assert list(rows) == ["unsloth+ckpt", "tigon+offload+kept"]
    kept = rows["tigon+offload+kept"]
    assert kept["tokens_per_s_at_longest"] == 3219.0 and kept["peak_bytes_at_longest"] == 38 * 2**30
    assert [p["tokens_per_s"] for p in kept["probes"]] == [3219.0]
    assert result["settings"]["superseded"] == [{"model": "llama-8b-lora", "provider": "tigon+offload+kept",
                                                 "run": "history.jsonl, line 1",
                                                 "note": "the kept outputs stayed on the GPU"}]
    text = context.markdown(result)
    assert ("Left out, measured on code that tigon no longer runs: tigon + checkpointing + offload + kept attention in "
            "history.jsonl, line 1 (the kept outputs stayed on the GPU).") in text
    without = tmp_path / "without.jsonl"
    without.write_text(json.dumps(lines[1]) + "\n")
    assert "Left out" not in context.markdown(context.combine([without], "2026-12-06"))
