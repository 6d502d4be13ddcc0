"""``benchmarks/lora.py`` without a GPU: its arguments, the flop count (against the parameters a real PeftModel
holds), the agreement check and the table it writes, and one tiny step run in-process for stock PEFT and
tigon, which must agree, on plain and on bitsandbytes 4-bit (QLoRA) bases."""

import json
import math

import pytest
import torch

from tests.helpers import DEVICE

pytest.importorskip("peft")
from benchmarks import lora  # noqa: E402


def test_arguments():
    args = lora.parse_args([])
    assert (args.layers, args.batch, args.seq, args.rank, args.alpha) == (8, 2, 4096, 16, 32)
    assert args.providers == list(lora.PROVIDERS) and args.matmul_size == 8192 and args.weights == "bf16"
    args = lora.parse_args(["--layers", "32", "--providers", "peft+ckpt", "tigon+ckpt", "--tiny"])
    assert args.layers == 32 and args.providers == ["peft+ckpt", "tigon+ckpt"]
    assert lora.parse_args(["--providers", "peft+4bit", "tigon+4bit+ckpt"]).providers == ["peft+4bit",
                                                                                          "tigon+4bit+ckpt"]
    assert lora.reference_names("tigon+4bit+ckpt") == ("peft+4bit+ckpt", "peft+4bit")
    assert lora.reference_names("liger") == ("peft", "peft+ckpt")
    assert args.seq == lora.TINY_SEQ and args.matmul_size == lora.TINY_MATMUL_SIZE
    for bad in (["--layers", "0"], ["--providers", "unsloth+liger"], ["--providers", "peft", "peft"],
                ["--warmup", "-1"]):
        with pytest.raises(SystemExit):
            lora.parse_args(bad)


def test_unsloth_providers_where_its_site_holds_it(tmp_path):
    """Unsloth's providers join the default list only where --unsloth-site holds Unsloth; named, they run (and
    say why where they cannot); each is compared with stock PEFT on the same bases and checkpointing."""
    assert lora.parse_args(["--unsloth-site", str(tmp_path)]).providers == list(lora.PROVIDERS)
    (tmp_path / "unsloth").mkdir()
    (tmp_path / "unsloth" / "__init__.py").write_text("")
    args = lora.parse_args(["--unsloth-site", str(tmp_path)])
    assert args.providers == list(lora.PROVIDERS + lora.UNSLOTH_PROVIDERS)
    assert lora.parse_args(["--providers", "unsloth+4bit"]).providers == ["unsloth+4bit"]
    assert lora.reference_names("unsloth+4bit+ckpt") == ("peft+4bit+ckpt", "peft+4bit")
    assert lora._title("unsloth+4bit+ckpt") == "Unsloth on 4-bit nf4 bases (QLoRA) + checkpointing"
    env = lora.unsloth_models.worker_env(tmp_path, "/repo/src")
    assert env["PYTHONPATH"].split(":")[:2] == [str(tmp_path), "/repo/src"] and env["HF_HUB_OFFLINE"] == "1"


def test_unsloth_model_folder_has_weights_and_a_tokenizer_of_its_vocabulary(tmp_path):
    """What Unsloth's from_pretrained reads: the model's weights and a word-level tokenizer of its vocabulary."""
    import transformers

    config = transformers.LlamaConfig(**lora.shape({"tiny": True, "layers": 1}))
    model = transformers.AutoModelForCausalLM.from_config(config)
    lora.init_by_name(model)
    lora.unsloth_models.save_model(model, tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == config.vocab_size and tokenizer.pad_token_id == 3
    assert tokenizer("t5 t7")["input_ids"] == [5, 7]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for (name, p), (_, q) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_step_flops_llama_3_1_8b():
    """Llama-3.1-8B, 32 layers: 7.50B linear weights (its 8,030,261,248 less the embedding and the norms) and
    41.9M adapter parameters at r = 16 (PEFT's count for the seven projections)."""
    shape = lora.shape({"tiny": False, "layers": 32})
    tokens, seq = 2 * 4096, 4096
    flops = lora.step_flops(shape, batch=2, seq=seq, rank=16)
    assert flops["base"] == 4 * tokens * (8_030_261_248 - 128256 * 4096 - (2 * 32 + 1) * 4096)
    assert flops["adapters"] == 3 * 2 * tokens * 41_943_040
    assert flops["attention"] == 3 * 4 * tokens * seq * 4096 * 32
    assert flops["total"] == flops["base"] + flops["adapters"] + flops["attention"]


def tiny_job(provider, tmp_path=None, **extra):
    job = {"provider": provider, "device": DEVICE.type, "tiny": True, "layers": 2, "batch": 2, "seq": 8, "rank": 3,
           "alpha": 7.0, "weights": "fp32", "warmup": 0, "steps": 1, "matmul_size": 64}
    if tmp_path is not None:
        job["grads_path"] = str(tmp_path / f"{provider}.pt")
    return {**job, **extra}


def test_qlora_build_quantizes_the_projections():
    """+4bit: every decoder projection a bitsandbytes Linear4bit under PEFT's LoRA Linear4bit, nf4 with double
    quant and bf16 compute; norms and head fp32 (prepare_model_for_kbit_training); the adapters trainable."""
    pytest.importorskip("bitsandbytes")
    model = lora.build(tiny_job("tigon+4bit"), DEVICE)
    layer = model.get_base_model().model.layers[0]
    for projection in (layer.self_attn.q_proj, layer.mlp.down_proj):
        assert type(projection).__module__ == "peft.tuners.lora.bnb"
        base = projection.get_base_layer()
        assert type(base).__name__ == "Linear4bit" and base.compute_dtype == torch.bfloat16
        assert base.weight.quant_state.quant_type == "nf4" and base.weight.quant_state.nested
    assert layer.input_layernorm.weight.dtype == torch.float32
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)


def test_flops_count_the_models_parameters():
    """The base and adapter terms are 4·N and 6·N·r times the weights the built PeftModel holds."""
    job = tiny_job("peft")
    model = lora.build(job, DEVICE)
    names = dict(model.named_parameters())
    base = sum(p.numel() for n, p in names.items() if n.endswith("base_layer.weight") or n.endswith("lm_head.weight"))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert all("lora_" in n for n, p in names.items() if p.requires_grad)
    flops = lora.step_flops(lora.shape(job), batch=2, seq=8, rank=3)
    tokens = 16
    assert flops["base"] == 4 * tokens * base
    assert flops["adapters"] == 6 * tokens * adapters


def test_same_weights_for_every_provider():
    """Weights are drawn by name: a rebuilt model (another process's) holds the same values."""
    a, b = (dict(lora.build(tiny_job("peft"), DEVICE).named_parameters()) for _ in range(2))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    lora_b = next(p for n, p in a.items() if "lora_B" in n)
    assert lora_b.abs().sum() > 0  # random, not PEFT's zeros


@pytest.mark.parametrize("bases", ("", "+4bit"))
def test_tiny_steps_agree_in_process(tmp_path, bases):
    if bases:
        pytest.importorskip("bitsandbytes")
    rows = [lora.run_job(tiny_job(p + bases, tmp_path)) for p in ("peft", "tigon")]
    for row in rows:
        assert len(row["losses"]) == 1 and row["tokens_per_s"] > 0 and row["adapter_params"] > 0
        assert row["tflops"] == pytest.approx(row["flops"]["total"] / row["median_step_s"] / 1e12)
    lora.add_agreement(rows)
    assert rows[1]["against"] == "peft" + bases and rows[1]["agrees"], rows[1]
    assert rows[1]["grad_rel"] <= lora.BF16_TOLERANCE and rows[1]["loss_rel"] <= lora.BF16_TOLERANCE
    assert "loss_rel" not in rows[0]


def test_profiled_steps_keep_the_first_steps_gradients_and_reach_the_page(tmp_path):
    """--profile: profiled steps after the timed one (on step 0's data again, warmup 0) leave the first step's
    saved gradients as they were, and the page gets the "where the time goes" section."""
    plain = lora.run_job(tiny_job("peft", tmp_path))
    first = torch.load(tmp_path / "peft.pt")["grads"]
    row = lora.run_job(tiny_job("peft", tmp_path, profile_steps=2))
    assert torch.equal(torch.load(tmp_path / "peft.pt")["grads"], first) and plain["losses"] == row["losses"]
    assert row["profile"]["steps"] == 2 and row["profile"]["busy_ms"] > 0
    settings = {**vars(lora.parse_args(["--tiny"])), "out": "out", "unsloth_site": "site"}
    text = lora.markdown({"rows": [row], "device": "cpu", "date": "2026-12-05", "versions": {}, "settings": settings})
    assert "## Where the time goes" in text and "| ms per step | stock PEFT |" in text


def synthetic_rows(tmp_path):
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(100, generator=gen)
    rows = []
    for provider, scale, loss in (("peft", 1.0, 2.0), ("tigon", 1.001, 2.002), ("peft+ckpt", 1.0, 2.0),
                                  ("tigon+ckpt", 1.1, 2.0)):
        path = tmp_path / f"{provider}.pt"
        torch.save({"names": ["a"], "grads": grads * scale}, path)
        rows.append({"provider": provider, "grads_path": str(path), "losses": [loss, 1.0],
                     "tokens_per_s": 1000.0 * scale, "tflops": 400.0, "matmul_tflops": 800.0, "matmul_share": 0.5,
                     "median_step_s": 0.5, "peak_bytes": 3 * 2**30, "device": "NVIDIA H200",
                     "flops": {"base": 1e12, "total": 2e12}})
    rows.append({"provider": "liger", "error": "ModuleNotFoundError: No module named 'liger_kernel'"})
    for provider, scale in (("peft+4bit", 0.9), ("tigon+4bit", 1.0)):
        path = tmp_path / f"{provider}.pt"
        torch.save({"names": ["a"], "grads": grads * (1.2 if provider == "peft+4bit" else 1.2002)}, path)
        rows.append({**rows[0], "provider": provider, "grads_path": str(path), "tokens_per_s": 1000.0 * scale})
    return rows


def test_agreement_pairs_checkpointing_and_flags_disagreement(tmp_path):
    rows = synthetic_rows(tmp_path)
    lora.add_agreement(rows)
    by = {r["provider"]: r for r in rows}
    assert by["tigon"]["against"] == "peft" and by["tigon+ckpt"]["against"] == "peft+ckpt"
    assert math.isclose(by["tigon"]["loss_rel"], 1e-3) and math.isclose(by["tigon"]["grad_rel"], 1e-3, rel_tol=1e-3)
    assert by["tigon"]["agrees"] and not by["tigon+ckpt"]["agrees"]  # grads 10 % off
    assert "agrees" not in by["liger"] and "loss_rel" not in by["peft"]
    assert by["tigon+4bit"]["against"] == "peft+4bit" and by["tigon+4bit"]["agrees"]


def test_markdown_and_files(tmp_path):
    rows = synthetic_rows(tmp_path)
    lora.add_agreement(rows)
    settings = vars(lora.parse_args([]))
    result = {"kind": "lora", "rows": rows, "device": "NVIDIA H200", "date": "2026-12-04",
              "versions": {"torch": "2.13.0", "peft": "0.21.2"},
              "settings": {k: str(v) if not isinstance(v, (int, float, str, list, type(None))) else v
                           for k, v in settings.items()}}
    text = lora.markdown(result)
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(rows)  # the header, the rule, one line a row
    assert "Llama-3.1-8B-shaped, 8 of 32 layers" in text and "8192³" in text
    assert "| tigon.patch(PeftModel) + checkpointing | 1100 | 1.10x |" in text and "**disagrees**" in text
    assert "No module named 'liger_kernel'" in text
    assert "| tigon.patch(PeftModel) on 4-bit nf4 bases (QLoRA) | 1000 | 1.11x |" in text
    paths = lora.save(result, tmp_path / "out")
    assert [p.name for p in paths] == ["lora-NVIDIA-H200-2026-12-04.json", "lora-NVIDIA-H200-2026-12-04.md"]
    assert json.loads(paths[0].read_text())["rows"][1]["provider"] == "tigon"
    assert paths[1].read_text() == text


def test_runs_split_over_device_calls_merge_into_one_page(tmp_path):
    """--merge: an earlier run's rows join this run's page (earlier first; a provider measured again replaces its
    row); a run with other settings or on another device is refused, naming what differs."""
    from benchmarks import e2e

    settings = {k: str(v) if not isinstance(v, (int, float, str, list, type(None))) else v
                for k, v in vars(lora.parse_args([])).items()}
    earlier = {"kind": "lora", "device": "NVIDIA H200", "settings": settings,
               "rows": [{"provider": "peft", "tokens_per_s": 1.0}, {"provider": "tigon", "tokens_per_s": 2.0}]}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    result = {"kind": "lora", "device": "NVIDIA H200", "settings": dict(settings),
              "rows": [{"provider": "peft", "tokens_per_s": 1.1}, {"provider": "unsloth", "tokens_per_s": 2.5}]}
    e2e.merge_runs(result, [path], key=lambda row: row["provider"], same=lora.MERGE_SAME)
    assert [(r["provider"], r["tokens_per_s"]) for r in result["rows"]] == [("tigon", 2.0), ("peft", 1.1),
                                                                              ("unsloth", 2.5)]
    assert result["merged"] == [str(path)]
    for change, message in (({"settings": {**settings, "seq": 2048}}, "its seq is 4096"),
                            ({"device": "NVIDIA H100 80GB HBM3"}, "on NVIDIA H200")):
        other = {**result, "rows": [], **change}
        with pytest.raises(ValueError, match=message):
            e2e.merge_runs(other, [path], key=lambda row: row["provider"], same=lora.MERGE_SAME)
