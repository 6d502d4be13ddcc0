"""benchmarks/warmup.py off the GPU: its page from a result, and the profile rows it reports."""

import cProfile

import pytest
from benchmarks import warmup


def _times(step: float) -> dict:
    return {"forward": step * 0.3, "backward": step * 0.6, "optimizer": step * 0.1, "step": step}


def _process(first: float, steady: float, compiled: int, **extra) -> dict:
    return {"first": _times(first), "steady": _times(steady), "compiled_entries": compiled, **extra}


def _busy(n: int) -> int:
    return sum(i * i for i in range(n))


def test_profile_rows_name_the_costliest_functions():
    profile = cProfile.Profile()
    profile.enable()
    _busy(200_000)
    profile.disable()
    rows = warmup.profile_rows(profile)
    assert set(rows) == {"own", "cumulative"}
    assert 0 < len(rows["cumulative"]) <= warmup.PROFILE_ROWS
    assert any("_busy" in where for _, _, where in rows["cumulative"])
    seconds = [sec for sec, _, _ in rows["own"]]
    assert seconds == sorted(seconds, reverse=True)


def _result() -> dict:
    return {
        "setup": {"model": warmup.MODEL, "seq": 2048, "batch": 1, "steps": 5, "gap_s": 2.0, "device": "GPU",
                  "date": "2026-12-04",
                  "versions": {"torch": "2.11.0", "triton": "3.6.0"}},
        "warmup": {"process_s": 18.9, "compiled_entries": 24},
        "cold": _process(7.24, 0.069, 24),
        "warm": _process(1.30, 0.070, 0),
        "warm_started": _process(0.21, 0.070, 0, start_libraries_s=0.9),
        "stock": _process(0.45, 0.090, 0),
        "warm_gap": _process(0.95, 0.070, 0),
        "warm_profile": {"own": [[0.5, 24, "triton/runtime/jit.py:700(run)"]],
                         "cumulative": [[1.1, 1, "torch/_tensor.py:600(backward)"]]},
    }


def test_page_has_every_process_its_phases_and_the_profile():
    page = warmup.markdown(_result())
    for _, title in warmup.ROWS:
        assert title in page
    assert "| 1.300 (0.390 / 0.780 / 0.130) | 0.070 (0.021 / 0.042 / 0.007) | 18.6x | 0 |" in page
    assert "Library start-up before the first step (row 3): 0.900 s." in page
    assert ("With 2 s between the patch and the first step (row 5), the first step takes 0.950 s against 1.300 s "
            "right after the patch (row 2;") in page
    assert "`triton/runtime/jit.py:700(run)`" in page and "`torch/_tensor.py:600(backward)`" in page


def test_history_record_has_a_row_per_measurement(tmp_path):
    from tigon.bench import history

    entry = history.append(warmup.history_result(_result()), benchmark="warmup", command="python warmup.py",
                           path=tmp_path / "history.jsonl")
    assert history.read(tmp_path / "history.jsonl") == [entry]
    assert entry["benchmark"] == "warmup" and entry["device"] == "GPU" and entry["date"] == "2026-12-04"
    rows = {row["measurement"]: row for row in entry["rows"]}
    assert set(rows) == {f"{key}_{kind}_step" for key, _ in warmup.ROWS for kind in ("first", "steady")} | {
        "warmup_process"}
    assert rows["warm_first_step"] == {"measurement": "warm_first_step", "s": 1.3, "compiled": 0,
                                       "phases_s": {"forward": 0.39, "backward": 0.78, "optimizer": 0.13}}
    assert rows["warm_gap_steady_step"] == {"measurement": "warm_gap_steady_step", "s": 0.07}
    assert rows["warmup_process"] == {"measurement": "warmup_process", "s": 18.9, "compiled": 24}
    assert entry["start_libraries_s"] == 0.9 and entry["gap_s"] == 2.0 and entry["seq"] == 2048
    assert entry["warm_profile"]["own"][0][2] == "triton/runtime/jit.py:700(run)"


def test_options():
    assert warmup.parse_args([]).history is None
    assert str(warmup.parse_args(["--history", "none"]).history) == "none"
    assert warmup.parse_args([]).gap == 2.0
    assert warmup.parse_args(["--gap", "0.5"]).gap == 0.5
    for bad in (["--gap", "-1"], ["--seq", "0"]):
        with pytest.raises(SystemExit):
            warmup.parse_args(bad)
