"""The benchmark harness and the specs, without a GPU: spec shapes and byte counts, report writers."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from tests.helpers import DEVICE
from tigon.bench import harness
from tigon.bench.spec import MODES
from tigon.bench.specs import SPEC_MODULES, load_specs


def test_every_spec_module_loads_and_has_the_reference_providers():
    specs = load_specs()
    assert len(specs) >= len(SPEC_MODULES)
    for spec in specs.values():
        assert "eager" in spec.providers and "tigon" in spec.providers, spec.name
        assert set(spec.modes) <= set(MODES)


def test_cases_declare_bytes_for_their_modes():
    for spec in load_specs().values():
        for case in spec.cases():
            for mode in spec.modes:
                if case.sol_bytes:
                    assert case.sol_bytes.get(mode, 0) > 0, (spec.name, case.label, mode)


def test_check_cases_run_on_this_device():
    spec = load_specs(["rms_norm"])["rms_norm"]
    inputs = spec.check_case().make_inputs(DEVICE, torch.float32)
    out = spec.providers["tigon"](**inputs)
    ref = spec.providers["eager"](**inputs)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)


def _fake_result():
    rows = []
    for provider, ms in (("eager", 3.0), ("tigon", 0.3)):
        for mode in MODES:
            rows.append({"op": "rms_norm", "case": "Llama-3-8B M=16384 N=4096", "params": {}, "provider": provider,
                         "mode": mode, "ms": ms, "wall_ms": 2 * ms, "peak_mb": 100.0, "sol_pct": 50.0})
    rows.append({"op": "rms_norm", "case": "Llama-3-8B M=16384 N=4096", "params": {}, "provider": "liger",
                 "mode": "full", "error": "out of memory"})
    return {"device": "test", "date": "2026-11-22", "versions": harness.versions(),
            "copy_bandwidth_gbps": 3000.0, "modes": list(MODES), "rows": rows}


def test_markdown_and_plot(tmp_path):
    result = _fake_result()
    table = harness.markdown(result)
    assert "| Llama-3-8B M=16384 N=4096 | 3.000 (50%) [100] | 0.300 (50%) [100] | OOM |" in table
    assert "## rms_norm (full), wall clock" in table
    assert "| Llama-3-8B M=16384 N=4096 | 6.000 | 0.600 | OOM |" in table
    harness.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_providers_filter_skips_what_is_not_asked_for():
    spec = load_specs(["rms_norm"])["rms_norm"]
    assert set(harness.providers_of(spec, ["tigon", "eager"])) == {"tigon", "eager"}
    assert "compile" in harness.providers_of(spec)


def test_peers_are_made_when_the_benchmark_runs():
    """A peer's provider is made by the harness, where the peer imports; without it the spec still loads."""
    spec = load_specs(["fused_linear_logprobs"])["fused_linear_logprobs"]
    assert set(spec.peers) == {"trl"} and "trl" not in spec.providers
    providers = harness.providers_of(spec, ["tigon", "trl"])
    assert ("trl" in providers) == (importlib.util.find_spec("trl") is not None)
    assert set(load_specs(["rms_norm"])["rms_norm"].peers) == {"liger"}


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL installed, to show it stays unimported")
def test_loading_the_specs_imports_no_peer_library():
    """``tigon check`` and ``tigon bench`` load every spec to check the names they are given: TRL (and with it
    transformers, PEFT and bitsandbytes, which may reach for the network) is imported only by a benchmark that
    runs TRL's head. In a fresh process: this one has imported them."""
    peers = ("trl", "transformers", "peft", "bitsandbytes", "liger_kernel")
    script = ("import sys; from tigon._interpreter import use_interpreter_without_gpu; use_interpreter_without_gpu(); "
              "from tigon.bench.specs import load_specs; load_specs(); "
              f"print(sorted(m for m in {peers!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
