"""The GPU run's memory ledger (tests/gpu_share.py): shares granted within the capacity, a share larger than the
capacity granted alone, the shares of processes that ended dropped, and several processes kept within it."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.gpu_share import GPU_MEMORY, Ledger, gib_needed

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def sleepers():
    """Two live processes whose pids stand for two workers."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


def test_shares_are_granted_within_the_capacity_and_one_too_large_alone(tmp_path, sleepers):
    a, b = sleepers
    ledger = Ledger(tmp_path / "ledger.json", capacity_gib=10)
    assert ledger.try_take(6.5, pid=a)
    assert not ledger.try_take(6.5, pid=b)  # 13 > 10
    assert ledger.held() == {a: 6.5}
    assert ledger.try_take(3.5, pid=b)  # exactly the capacity
    assert ledger.held() == {a: 6.5, b: 3.5}
    ledger.give_back(pid=a)
    ledger.give_back(pid=b)
    assert ledger.held() == {}
    assert ledger.try_take(27.0, pid=a)  # larger than the capacity: granted while nothing else is held
    assert not ledger.try_take(0.5, pid=b)
    ledger.give_back(pid=a)
    ledger.give_back(pid=a)  # giving back twice changes nothing
    assert ledger.held() == {}


def test_the_share_of_a_process_that_ended_is_dropped(tmp_path, sleepers):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    ledger = Ledger(tmp_path / "ledger.json", capacity_gib=10)
    assert ledger.try_take(9.0, pid=ended.pid)
    assert ledger.try_take(9.0, pid=sleepers[0])  # the ended process's 9 GiB no longer count
    assert ledger.held() == {sleepers[0]: 9.0}


def test_the_share_of_a_zombie_process_is_dropped(tmp_path, sleepers):
    """A worker that ended but is not reaped yet (a zombie) holds no GPU memory: its share does not count."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    for _ in range(200):  # until it has exited (not reaped: no wait() yet)
        if Path(f"/proc/{ended.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.01)
    ledger = Ledger(tmp_path / "ledger.json", capacity_gib=10)
    try:
        assert ledger.try_take(9.0, pid=ended.pid)
        assert ledger.try_take(9.0, pid=sleepers[0])
        assert ledger.held() == {sleepers[0]: 9.0}
    finally:
        ended.wait()


def test_a_bad_capacity_is_refused(tmp_path):
    with pytest.raises(ValueError, match="capacity_gib"):
        Ledger(tmp_path / "ledger.json", capacity_gib=0)


def test_processes_sharing_the_ledger_stay_within_its_capacity(tmp_path):
    """Four processes take shares of 4 GiB and 6 GiB from a 10 GiB ledger, fifteen times each, holding each for
    20 ms and logging when it starts and ends: at no moment do the shares held add up to more than 10 GiB."""
    worker = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from tests.gpu_share import Ledger
        ledger = Ledger({str(tmp_path / 'ledger.json')!r}, capacity_gib=10, poll_s=0.002)
        gib = float(sys.argv[1])
        with open({str(tmp_path / 'log.txt')!r}, "a", buffering=1) as log:
            for _ in range(15):
                with ledger.share(gib):
                    log.write(f"{{time.monotonic()}} +{{gib}}\\n")
                    time.sleep(0.02)
                    log.write(f"{{time.monotonic()}} -{{gib}}\\n")
    """)
    procs = [subprocess.Popen([sys.executable, "-c", worker, str(gib)]) for gib in (4, 6, 4, 6)]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    events = sorted((float(t), float(change)) for t, change in
                    (line.split() for line in (tmp_path / "log.txt").read_text().splitlines()))
    held = most = 0.0
    for _, change in events:
        held += change
        most = max(most, held)
    assert len(events) == 4 * 15 * 2 and held == 0
    assert 6 < most <= 10  # shares did overlap, and never past the capacity


def test_the_committed_memory_list_names_test_files_that_exist():
    needed = gib_needed()
    assert len(needed) > 20 and all(gib >= 3 for gib in needed.values())
    assert all((ROOT / nodeid.split("::")[0]).is_file() for nodeid in needed)
    assert gib_needed(GPU_MEMORY.with_name("missing.txt")) == {}


def test_the_conftest_fixture_holds_a_listed_tests_share_while_it_runs(tmp_path, monkeypatch, sleepers):
    """tests/conftest.py's per-test fixture under a ledger: a listed test (and a bigmem one) holds its share while
    it runs and gives it back after; one that waited over 1 s for it is recorded; an unlisted test takes none."""
    import threading
    from types import SimpleNamespace

    import tests.conftest as conftest

    ledger = Ledger(tmp_path / "ledger.json", capacity_gib=10, poll_s=0.01)
    waits = tmp_path / "waits.txt"
    monkeypatch.setattr(conftest, "_LEDGER", ledger)
    monkeypatch.setattr(conftest, "_GIB_NEEDED", {"tests/a.py::test_large": 8.0})
    monkeypatch.setattr(conftest, "_WAIT_RECORD", str(waits))
    fixture = conftest._gpu_memory_given_back.__wrapped__

    def run(nodeid, keywords=()):
        request = SimpleNamespace(node=SimpleNamespace(nodeid=nodeid, keywords=set(keywords)))
        steps = fixture(request)
        next(steps)
        held = ledger.held()
        with pytest.raises(StopIteration):
            next(steps)
        return held

    me = os.getpid()
    assert run("tests/a.py::test_large") == {me: 8.0} and ledger.held() == {}
    assert run("tests/b.py::test_big", ["bigmem"]) == {me: conftest.BIGMEM_GIB}
    assert run("tests/c.py::test_small") == {} and not waits.exists()
    assert ledger.try_take(5.0, pid=sleepers[0])  # another worker's test: 5 + 8 > 10, so the next one waits
    threading.Timer(1.3, ledger.give_back, kwargs={"pid": sleepers[0]}).start()
    assert run("tests/a.py::test_large") == {me: 8.0}
    seconds, gib, nodeid = waits.read_text().split()
    assert float(seconds) >= 1.2 and (gib, nodeid) == ("8", "tests/a.py::test_large")
