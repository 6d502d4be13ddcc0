"""``benchmarks/lora.py`` without a GPU: its arguments, the flop count (against the parameters a real PeftModel
holds), the fp32 reference it adds, the agreement rule and the table it writes, one tiny step run in-process for
stock PEFT, tigon and the fp32 reference, which must agree, on plain and on bitsandbytes 4-bit (QLoRA) bases, and
whole runs (their workers in-process) merged into one page."""

import copy
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
    assert lora.reference_names("tigon+ckpt+kept") == ("peft+ckpt", "peft")
    assert lora.fp32_reference("tigon+ckpt+kept") == "peft+fp32"
    assert lora._title("tigon+ckpt+kept") == "tigon.patch(PeftModel) + checkpointing + kept attention"
    assert lora.reference_names("tigon+4bit+ckpt+offload") == ("peft+4bit+ckpt", "peft+4bit")
    assert lora.reference_names("liger+4bit+ckpt") == ("peft+4bit+ckpt", "peft+4bit")
    assert lora._title("liger+4bit") == "Liger-Kernel + PEFT on 4-bit nf4 bases (QLoRA)"
    assert lora._title("tigon+ckpt+offload") == "tigon.patch(PeftModel) + checkpointing + offloaded activations"
    assert lora.fp32_reference("tigon+4bit+ckpt") == "peft+4bit+fp32" and lora.fp32_reference("liger") == "peft+fp32"
    assert args.seq == lora.TINY_SEQ and args.matmul_size == lora.TINY_MATMUL_SIZE
    for bad in (["--layers", "0"], ["--providers", "unsloth+liger"], ["--providers", "peft", "peft"],
                ["--warmup", "-1"], ["--providers", "peft+fp32"]):
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
    # the page's versions: Unsloth's as installed in its site, where a provider ran it
    assert lora.versions(["peft"], tmp_path).get("unsloth") is None
    assert lora.versions(["unsloth"], tmp_path)["unsloth"] is None  # the site holds no installed distribution
    info = tmp_path / "unsloth-2026.10.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: unsloth\nVersion: 2026.10.9\n")
    assert lora.versions(["unsloth+4bit"], tmp_path)["unsloth"] == "2026.10.9"


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


def test_jobs_add_one_untimed_fp32_reference_for_each_bases_with_stock_peft(tmp_path):
    """A run with a stock PEFT bf16 run on some bases gets that bases' fp32 reference: one step, no warm-up,
    no profile, after the timed jobs; bases without a stock PEFT run get none."""
    args = lora.parse_args(["--tiny", "--profile", "--providers", "tigon", "peft+ckpt", "tigon+4bit", "peft+4bit",
                            "peft+4bit+ckpt", "liger"])
    jobs = {job["provider"]: job for job in lora.jobs_for(args, tmp_path)}
    assert list(jobs) == args.providers + ["peft+fp32", "peft+4bit+fp32"]
    for name in ("peft+fp32", "peft+4bit+fp32"):
        assert (jobs[name]["warmup"], jobs[name]["steps"], jobs[name]["profile_steps"]) == (0, 1, 0)
    assert (jobs["tigon"]["warmup"], jobs["tigon"]["steps"]) == (lora.WARMUP, lora.STEPS)
    assert jobs["tigon"]["profile_steps"] > 0
    assert lora.references_for(["tigon", "tigon+4bit", "liger"]) == []


def test_fp32_reference_is_the_same_model_in_fp32():
    """The reference holds the bf16 model's values in fp32 (the weights drawn, rounded to bf16, then cast), its
    adapters the same, every layer checkpointed; on 4-bit bases the same nf4 weights with fp32 compute."""
    bf16, fp32 = (lora.build(tiny_job(p, weights="bf16"), DEVICE) for p in ("peft", "peft+fp32"))
    got, want = dict(fp32.named_parameters()), dict(bf16.named_parameters())
    assert got.keys() == want.keys() and all(p.dtype == torch.float32 for p in got.values())
    assert all(torch.equal(got[n], want[n].float()) for n in got)
    assert want["base_model.model.lm_head.weight"].dtype == torch.bfloat16
    assert all(layer.gradient_checkpointing for layer in fp32.base_model.model.model.layers)
    pytest.importorskip("bitsandbytes")
    bf16, fp32 = (lora.build(tiny_job(p, weights="bf16"), DEVICE) for p in ("peft+4bit", "peft+4bit+fp32"))
    for a, b in zip(bf16.get_base_model().model.layers, fp32.get_base_model().model.layers, strict=True):
        got, want = b.mlp.down_proj.get_base_layer(), a.mlp.down_proj.get_base_layer()
        assert got.compute_dtype == torch.float32 and want.compute_dtype == torch.bfloat16
        assert torch.equal(got.weight.data, want.weight.data)


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
    # --kbit-rest bf16: the same quantized projections, the rest of the model left bf16 (as Unsloth's loader)
    kept = lora.build(tiny_job("tigon+4bit", weights="bf16", kbit_rest="bf16"), DEVICE)
    base = kept.get_base_model()
    assert base.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    assert base.lm_head.weight.dtype == base.model.embed_tokens.weight.dtype == torch.bfloat16
    assert type(base.model.layers[0].mlp.down_proj.get_base_layer()).__name__ == "Linear4bit"
    assert lora.parse_args(["--kbit-rest", "bf16"]).kbit_rest == "bf16" and lora.parse_args([]).kbit_rest == "fp32"


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


def test_offload_provider_patches_with_offload_activations():
    from tigon.patching.parts.long_context import offloader_of

    assert offloader_of(lora.build(tiny_job("tigon+ckpt+offload"), DEVICE)) is not None
    assert offloader_of(lora.build(tiny_job("tigon+ckpt"), DEVICE)) is None


def test_same_weights_for_every_provider():
    """Weights are drawn by name: a rebuilt model (another process's) holds the same values."""
    a, b = (dict(lora.build(tiny_job("peft"), DEVICE).named_parameters()) for _ in range(2))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    lora_b = next(p for n, p in a.items() if "lora_B" in n)
    assert lora_b.abs().sum() > 0  # random, not PEFT's zeros


@pytest.mark.parametrize("bases", ("", "+4bit"))
def test_tiny_steps_agree_in_process(tmp_path, bases):
    """Stock PEFT and tigon in bf16 autocast against the fp32 reference, a run of one untimed step."""
    if bases:
        pytest.importorskip("bitsandbytes")
    rows = [lora.run_job(tiny_job(p + bases, tmp_path)) for p in ("peft", "tigon")]
    for row in rows:
        assert len(row["losses"]) == 1 and row["tokens_per_s"] > 0 and row["adapter_params"] > 0
        assert row["tflops"] == pytest.approx(row["flops"]["total"] / row["median_step_s"] / 1e12)
    reference = lora.run_job(tiny_job(f"peft{bases}+fp32", tmp_path))
    assert len(reference["losses"]) == 1 and reference["adapter_params"] == rows[0]["adapter_params"]
    assert not {"tokens_per_s", "median_step_s", "matmul_tflops", "peak_bytes"} & reference.keys()
    lora.add_agreement(rows, [reference])
    peft, tigon = rows
    assert tigon["against"] == f"peft{bases}+fp32" and tigon["peft"] == "peft" + bases and tigon["agrees"], tigon
    assert tigon["peft_grad_rel"] == peft["grad_rel"] > 0  # bf16 autocast against fp32: not the same
    assert tigon["grad_rel"] <= lora.BF16_TOLERANCE and tigon["loss_rel"] <= lora.BF16_TOLERANCE
    assert peft["agrees"] and peft["peft_grad_rel"] == peft["grad_rel"]


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
    """Timed rows and fp32 references whose first-step gradients are the reference's plus an error of a set
    relative size: stock PEFT 4e-2 off (more than BF16_TOLERANCE, as bf16 through a whole model is), tigon 4.5e-2
    (within 1.25x PEFT's), tigon+ckpt 1e-1; on 4-bit bases PEFT 2e-2 off, tigon 2.8e-2 (within BF16_TOLERANCE)."""
    gen = torch.Generator().manual_seed(0)
    exact = {"": torch.randn(100, generator=gen), "+4bit": torch.randn(100, generator=gen)}
    noise = torch.randn(100, generator=gen)

    def grads(bases, off):
        g = exact[bases]
        return g + noise * (off * g.norm() / noise.norm())

    def save(provider, g):
        path = tmp_path / f"{provider}.pt"
        torch.save({"names": ["a"], "grads": g}, path)
        return str(path)

    timed = {"tflops": 400.0, "matmul_tflops": 800.0, "matmul_share": 0.5, "median_step_s": 0.5,
             "peak_bytes": 3 * 2**30, "device": "NVIDIA H200", "flops": {"base": 1e12, "total": 2e12}}
    rows = []
    for provider, speed, loss, off in (("peft", 1.0, 2.0, 4e-2), ("tigon", 1.001, 2.002, 4.5e-2),
                                       ("peft+ckpt", 1.0, 2.0, 4e-2), ("tigon+ckpt", 1.1, 2.0, 1e-1)):
        rows.append({**timed, "provider": provider, "grads_path": save(provider, grads("", off)),
                     "losses": [loss, 1.0], "tokens_per_s": 1000.0 * speed})
    rows.append({"provider": "liger", "error": "ModuleNotFoundError: No module named 'liger_kernel'"})
    for provider, speed, off in (("peft+4bit", 0.9, 2e-2), ("tigon+4bit", 1.0, 2.8e-2)):
        rows.append({**timed, "provider": provider, "grads_path": save(provider, grads("+4bit", off)),
                     "losses": [2.0, 1.0], "tokens_per_s": 1000.0 * speed})
    references = [{"provider": f"peft{bases}+fp32", "grads_path": save(f"peft{bases}+fp32", exact[bases]),
                   "losses": [2.001]} for bases in ("", "+4bit")]
    return rows, references


def test_agreement_rule():
    """A row agrees when its loss is within BF16_TOLERANCE of fp32's and its gradients within
    max(BF16_TOLERANCE, 1.25 x stock PEFT's bf16 distance from fp32) of fp32's."""
    assert lora.grad_bound(4e-2) == pytest.approx(5e-2) and lora.grad_bound(1e-3) == lora.BF16_TOLERANCE
    assert lora.grad_bound(None) == lora.BF16_TOLERANCE
    assert lora.agrees(1e-3, 4.7e-2, 4.5e-2)  # an exact kernel rounding differently: as far as PEFT, no further
    assert lora.agrees(1e-3, 5.6e-2, 4.5e-2) and not lora.agrees(1e-3, 5.7e-2, 4.5e-2)  # bound 5.625e-2
    assert lora.agrees(1e-3, 3e-2, 1e-3) and not lora.agrees(1e-3, 3.1e-2, 1e-3)  # the floor
    assert lora.agrees(0.0, 3e-2) and not lora.agrees(0.0, 3.1e-2)  # no stock PEFT run to compare with
    assert not lora.agrees(3.1e-2, 0.0, 1e-1)  # the loss has no slack
    assert not lora.agrees(1e-3, math.inf, 1e-1) and not lora.agrees(1e-3, math.nan, 1e-1)


def test_agreement_against_fp32_pairs_checkpointing_and_flags_disagreement(tmp_path):
    rows, references = synthetic_rows(tmp_path)
    fresh = copy.deepcopy(rows)
    lora.add_agreement(rows, references)
    by = {r["provider"]: r for r in rows}
    assert by["tigon"]["against"] == "peft+fp32" and by["tigon+ckpt"]["against"] == "peft+fp32"
    assert by["tigon"]["peft"] == "peft" and by["tigon+ckpt"]["peft"] == "peft+ckpt"
    assert math.isclose(by["tigon"]["loss_rel"], 1e-3 / 2.001)
    assert math.isclose(by["tigon"]["grad_rel"], 4.5e-2, rel_tol=1e-6)
    assert math.isclose(by["tigon"]["peft_grad_rel"], 4e-2, rel_tol=1e-6)
    assert by["peft"]["agrees"] and by["tigon"]["agrees"]  # both past BF16_TOLERANCE, tigon within 1.25x PEFT's
    assert not by["tigon+ckpt"]["agrees"]  # grads 10 % off
    assert "agrees" not in by["liger"]
    assert by["tigon+4bit"]["against"] == "peft+4bit+fp32" and by["tigon+4bit"]["peft"] == "peft+4bit"
    assert by["tigon+4bit"]["agrees"]  # 2.8e-2: within the floor, above 1.25 x PEFT's 2e-2
    lora.add_agreement(fresh, references[:1])  # no 4-bit reference: no agreement on 4-bit bases
    by = {r["provider"]: r for r in fresh}
    assert "loss_rel" not in by["tigon+4bit"] and "agrees" not in by["tigon+4bit"] and by["tigon"]["agrees"]


def test_markdown_and_files(tmp_path):
    rows, references = synthetic_rows(tmp_path)
    lora.add_agreement(rows, references)
    settings = vars(lora.parse_args([]))
    result = {"kind": "lora", "rows": rows, "references": references, "device": "NVIDIA H200", "date": "2026-12-04",
              "versions": {"torch": "2.13.0", "peft": "0.21.2"},
              "settings": {k: str(v) if not isinstance(v, (int, float, str, list, type(None))) else v
                           for k, v in settings.items()}}
    text = lora.markdown(result)
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(rows)  # the header, the rule, one line a row: the references are none of them
    assert "| loss Δ vs fp32 | grad Δ vs fp32 | PEFT's grad Δ vs fp32 | note |" in table[0]
    assert ("A row agrees when its loss Δ is at most 0.03 and its grad Δ at most max(0.03, 1.25 × PEFT's grad Δ)"
            in text)
    assert "Llama-3.1-8B-shaped, 8 of 32 layers" in text and "8192³" in text
    assert "| tigon.patch(PeftModel) | 1001 | 1.00x |" in text
    assert "| 4.5e-02 | 4.0e-02 |  |" in text  # tigon: past 3e-2, agreeing
    assert "| tigon.patch(PeftModel) + checkpointing | 1100 | 1.10x |" in text and "| **disagrees** |" in text
    assert "No module named 'liger_kernel'" in text
    assert "| tigon.patch(PeftModel) on 4-bit nf4 bases (QLoRA) | 1000 | 1.11x |" in text
    assert ("fp32 references: stock PEFT in fp32: first loss 2.001; stock PEFT on 4-bit nf4 bases (QLoRA) in fp32: "
            "first loss 2.001.") in text
    # a row merged from a file whose rows were compared with stock PEFT's bf16 run: no fp32 columns, no verdict
    old = {**rows[3], "against": "peft+ckpt", "loss_rel": 0.0, "grad_rel": 0.1, "agrees": False}
    text_old = lora.markdown({**result, "rows": [old]})
    assert "| — | — | — |  |" in text_old and "| **disagrees** |" not in text_old
    paths = lora.save(result, tmp_path / "out")
    assert [p.name for p in paths] == ["lora-NVIDIA-H200-2026-12-04.json", "lora-NVIDIA-H200-2026-12-04.md"]
    assert json.loads(paths[0].read_text())["rows"][1]["provider"] == "tigon"
    assert paths[1].read_text() == text


def test_a_run_without_stock_peft_takes_its_distance_from_another_record(tmp_path):
    """Stock PEFT out of memory: the rows compared with fp32 take stock PEFT's bf16 distance from the newest history
    record with the same model, data and fp32 reference, the same checkpointing first (in any record); a record with
    other settings or another reference loss gives none. The page marks the borrowed value and names the record."""
    rows, references = synthetic_rows(tmp_path)
    settings = {k: str(v) if not isinstance(v, (int, float, str, list, type(None))) else v
                for k, v in vars(lora.parse_args([])).items()}
    peft_fp32 = next(r for r in references if r["provider"] == "peft+fp32")
    assert peft_fp32["losses"][0] == 2.001

    def record(peft_name, grad_rel, loss=2.001, **changed):
        return {"benchmark": "lora", "date": "2026-12-05", "device": "NVIDIA H100 80GB HBM3",
                "settings": {**settings, **changed}, "references": [{"provider": "peft+fp32", "losses": [loss]}],
                "rows": [{"provider": peft_name, "against": "peft+fp32", "grad_rel": grad_rel}]}

    history = [record("peft", 0.038),                    # line 1: no checkpointing, as this run's tigon row
               record("peft+ckpt", 0.039),               # line 2: the other checkpointing, newer
               record("peft", 0.5, layers=32),           # line 3: another model
               record("peft", 0.5, loss=2.5),            # line 4: another reference loss
               {"benchmark": "context", "rows": []}]     # line 5: another benchmark
    live = [r for r in rows if r["provider"] in ("tigon", "tigon+ckpt")]
    lora.add_agreement(live, [peft_fp32])  # no stock PEFT row: the fallback bound of BF16_TOLERANCE
    assert not any(r["agrees"] for r in live) and all("peft_grad_rel" not in r for r in live)
    result = {"kind": "lora", "rows": live, "references": [peft_fp32], "settings": settings,
              "device": "NVIDIA H100 80GB HBM3", "date": "2026-12-06", "versions": {}}
    lora.peft_distances_from(history, result)
    tigon, ckpt = live
    assert (tigon["peft"], tigon["peft_grad_rel"], tigon["peft_from"]["line"]) == ("peft", 0.038, 1)
    assert tigon["agrees"]  # 4.5e-2 within 1.25 x 3.8e-2
    assert (ckpt["peft"], ckpt["peft_grad_rel"], ckpt["peft_from"]["line"]) == ("peft+ckpt", 0.039, 2)
    assert not ckpt["agrees"]  # 1e-1 past 1.25 x 3.9e-2
    text = lora.markdown(result)
    assert "| 3.8e-02 † |" in text and "| 3.9e-02 † |" in text
    assert ("history.jsonl line 1 (2026-12-05, NVIDIA H100 80GB HBM3, stock PEFT); history.jsonl line 2 "
            "(2026-12-05, NVIDIA H100 80GB HBM3, stock PEFT + checkpointing).") in text
    untouched = copy.deepcopy(live)
    for row in untouched:
        row.pop("peft_grad_rel"), row.pop("peft"), row.pop("peft_from")
    lora.peft_distances_from(history[2:], {**result, "rows": untouched})
    assert all("peft_from" not in r for r in untouched)


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


class InProcessPool:
    """e2e.WorkerPool's part that lora.run uses, each job run in this process (an error a result, as a worker's)."""

    def __init__(self, *args, **kwargs):
        pass

    def run(self, job):
        try:
            return lora.run_job(job)
        except Exception as exc:
            return {**job, "error": f"{type(exc).__name__}: {exc}"}

    def close(self):
        pass


def test_whole_runs_add_the_fp32_reference_and_merge(tmp_path, monkeypatch, capsys):
    """A run (its jobs in this process) adds the fp32 reference, which is no row of the page nor of the tokens/s
    comparison and gives the rows their agreement; a later part merged with it (--merge) adds its rows, the earlier
    rows keep the agreement they were given and the earlier reference stays on the page."""
    monkeypatch.setattr(lora.e2e, "WorkerPool", InProcessPool)  # without a GPU, conftest set TRITON_INTERPRET=1 as
    common = ["--device", DEVICE.type, "--tiny", "--layers", "2", "--seq", "8", "--rank", "3",  # main does
              "--warmup", "0", "--steps", "1", "--matmul-size", "64"]
    assert lora.main([*common, "--providers", "peft", "tigon", "--out", str(tmp_path / "first")]) == 0
    [first] = (tmp_path / "first").glob("*.json")
    result = json.loads(first.read_text())
    peft, tigon = result["rows"]
    [reference] = result["references"]
    assert (peft["provider"], tigon["provider"], reference["provider"]) == ("peft", "tigon", "peft+fp32")
    assert "tokens_per_s" not in reference and not {"grads_path", "quiet_path"} & reference.keys()
    assert tigon["against"] == "peft+fp32" and tigon["peft"] == "peft" and tigon["agrees"]
    assert tigon["peft_grad_rel"] == peft["grad_rel"] > 0
    text = first.with_suffix(".md").read_text()
    assert len([line for line in text.splitlines() if line.startswith("| ")]) == 2 + 2
    assert "fp32 references: stock PEFT in fp32: first loss " in text

    assert lora.main([*common, "--providers", "tigon+ckpt", "--merge", str(first),
                      "--out", str(tmp_path / "merged")]) == 0
    [merged] = (tmp_path / "merged").glob("*.json")
    result = json.loads(merged.read_text())
    assert [r["provider"] for r in result["rows"]] == ["peft", "tigon", "tigon+ckpt"]
    assert result["rows"][:2] == [peft, tigon] and result["references"] == [reference]
    assert "agrees" not in result["rows"][2]  # no stock PEFT run in its part: nothing to compare it with
    text = merged.with_suffix(".md").read_text()
    assert "fp32 references: stock PEFT in fp32: first loss " in text
    assert f"| {tigon['loss_rel']:.1e} | {tigon['grad_rel']:.1e} | {tigon['peft_grad_rel']:.1e} |  |" in text
    capsys.readouterr()
