"""Test set-up: without a CUDA device every kernel runs on CPU tensors through Triton's interpreter.

TRITON_INTERPRET must be set before the first ``@triton.jit`` decorator runs, i.e. before anything
imports ``tigon.ops``; pytest imports this file before any test module, so setting it here is early
enough (``use_interpreter_without_gpu`` also applies tigon's fixes to the interpreter). On a GPU
machine nothing is set and the same tests compile the kernels for real.

Two hooks serve scripts/gpu-check.sh: under ``--dist loadgroup`` the tests that share a module- or
class-scoped fixture (a torchrun launch, a trained model) go to one worker, so that the fixture runs once
while every other test is spread on its own; and with ``TIGON_TEST_RECORD`` set each test's outcome is
appended to that file as the test ends, so that a run stopped by its time budget still counts what ran (and
with ``TIGON_TEST_COLLECTED`` the number of tests collected is written, to tell whether any was left unrun).
On a GPU the tests that take longest there (tests/gpu_durations.txt) are collected first, and a fixture keeps
the GPU's memory shared between the workers and the bigmem process (``_gpu_memory_given_back``, with the
ledger of tests/gpu_share.py).
"""

import gc
import os
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from tests.gpu_share import BIGMEM_GIB, by_test, from_environment, gib_needed
from tigon._interpreter import use_interpreter_without_gpu

use_interpreter_without_gpu()

# pytest-xdist runs one worker per core (`-n 2` on CI's two): each worker's torch then takes its share
# of the cores. torch's default, a thread per core in every worker, oversubscribes them: on the 2-core
# CI machine the suite ran 1.4-1.8x slower so.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 0:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


_SHARED_SCOPES = ("class", "module", "package")
_RECORD = os.environ.get("TIGON_TEST_RECORD")
_COLLECTED = os.environ.get("TIGON_TEST_COLLECTED")
_MEMORY_RECORD = os.environ.get("TIGON_TEST_MEMORY")
_CUDA = torch.cuda.is_available()  # asked once: the per-test fixture below runs for every test
_CACHE_KEPT = 2 << 30  # bytes a worker's allocator may keep reserved between tests
_RECORDED_PEAK = 1 << 30  # the peaks TIGON_TEST_MEMORY lists
_LEDGER = from_environment() if _CUDA else None  # GPU memory shared with the run's other processes
_GIB_NEEDED = gib_needed() if _LEDGER is not None else {}
_WAIT_RECORD = os.environ.get("TIGON_TEST_WAITS")  # "seconds GiB nodeid" of each wait for a share over 1 s


def _shares_a_fixture(item) -> bool:
    """Whether the test uses a fixture that outlives it (set up once for its class, module or package)."""
    fixtures = getattr(item, "_fixtureinfo", None)
    return fixtures is not None and any(
        definition.scope in _SHARED_SCOPES for definitions in fixtures.name2fixturedefs.values()
        for definition in definitions)


GPU_DURATIONS = Path(__file__).with_name("gpu_durations.txt")


def gpu_seconds(path: Path = GPU_DURATIONS) -> dict:
    """``{nodeid: seconds}`` from a file of "seconds nodeid" lines ('#' starts a comment line)."""
    return by_test(path)


def longest_first(items, seconds: dict) -> None:
    """Sorts ``items`` in place: the tests ``seconds`` lists first, the longest first, then the others in their
    collected order. pytest-xdist hands tests to its workers in this order, so on scripts/gpu-check.sh's 14
    workers the 1-2 minute compile tests start at once instead of extending the run's end."""
    items.sort(key=lambda item: -seconds.get(item.nodeid, 0.0))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    if config.getoption("loadgroup", False):  # set on pytest-xdist's workers under --dist loadgroup
        for item in items:
            if _shares_a_fixture(item):
                item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    if _CUDA:
        longest_first(items, gpu_seconds())
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: runs in scripts/gpu-check.sh on a GPU")
    for item in items:
        if "gpu" in item.keywords or "bigmem" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """With TIGON_TEST_COLLECTED set, the number of tests the run will run is written to that file, so that
    scripts/gpu-check.sh can tell a run stopped by its budget after its last test (in pytest's shutdown) from
    one that left tests unrun. Without pytest-xdist here; its controller collects nothing and is told by the hook
    below."""
    if _COLLECTED and "PYTEST_XDIST_WORKER" not in os.environ and session.items:
        Path(_COLLECTED).write_text(f"{len(session.items)}\n")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """pytest-xdist's controller: a worker has collected the run's tests (every worker collects them all)."""
    if _COLLECTED:
        Path(_COLLECTED).write_text(f"{len(ids)}\n")


def pytest_runtest_logreport(report):
    """With TIGON_TEST_RECORD set, one line per outcome: passed, failed, skipped, error (of a set-up or
    tear-down), xfailed or xpassed, then the test's id. Written by the process that reports to the user
    (pytest-xdist's controller receives every worker's reports), so each outcome is written once."""
    if not _RECORD or "PYTEST_XDIST_WORKER" in os.environ:
        return
    if report.when == "call":
        outcome = report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
    elif report.failed:
        outcome = "error"
    elif report.skipped:
        outcome = "skipped"
    else:
        return
    with open(_RECORD, "a") as record:
        record.write(f"{outcome} {report.nodeid}\n")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_saved_tensor_hooks_left_on():
    """A test leaves no saved-tensor hooks switched on. In torch 2.11, a function that raises inside
    non-reentrant ``checkpoint`` leaves the checkpoint's hooks on for as long as the exception's traceback is
    kept (pytest keeps it), and every later backward in that process re-runs the failed function: one failure
    would fail unrelated tests after it on the same worker. The hooks are switched off here and the test that
    left them fails, so a failure is reported where it happened."""
    yield
    left = 0
    while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        left += 1
    if left:
        pytest.fail(f"the test left {left} saved-tensor hook pair(s) switched on (an exception inside "
                    "torch.utils.checkpoint?); switched off here", pytrace=False)


@pytest.fixture(autouse=True)
def _triton_interpreter_switch_kept():
    """A test leaves ``TRITON_INTERPRET`` as it found it. The benchmarks' ``main`` with ``--device cpu`` sets it
    for the worker processes they start; called in a test's own process on a GPU it would stay set there, and
    every later torch.compile in that process would build Inductor's kernels for the interpreter (Inductor reads
    the variable when it makes a kernel) and fail. It is put back here and the test that changed it fails."""
    before = os.environ.get("TRITON_INTERPRET")
    yield
    after = os.environ.get("TRITON_INTERPRET")
    if after != before:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
        pytest.fail(f"the test changed TRITON_INTERPRET from {before!r} to {after!r}; put back here",
                    pytrace=False)


@pytest.fixture(autouse=True)
def _gpu_memory_given_back(request):
    """On a GPU, the memory a test leaves in its worker's cache goes back to the driver when it exceeds 2 GiB.
    PyTorch's caching allocator keeps what a process once reserved: on scripts/gpu-check.sh's 12-14 workers each
    would hold the high-water mark of the largest test it ran (20-25 GiB for some), and on an 80 GiB card the
    tests running beside them then fail to allocate a few hundred MiB. With ``TIGON_TEST_MEMORY`` set, each test's
    peak reserved memory above 1 GiB is appended to that file ("GiB nodeid"): where the suite's memory goes.
    Under scripts/gpu-check.sh's ledger (tests/gpu_share.py) a test that tests/gpu_memory.txt lists, and every
    bigmem test, holds its share of the card from before it starts until its memory is given back; with
    ``TIGON_TEST_WAITS`` set, a wait of more than 1 s for a share is appended to that file ("seconds GiB nodeid").
    The cache and the record are left alone in a process where CUDA is not initialised (every CPU run, and the
    tests that fork or launch workers before touching the GPU)."""
    gib = _GIB_NEEDED.get(request.node.nodeid, BIGMEM_GIB if "bigmem" in request.node.keywords else 0.0)
    with _LEDGER.share(gib) if _LEDGER is not None and gib > 0 else nullcontext(0.0) as waited:
        if _WAIT_RECORD and waited > 1:
            with open(_WAIT_RECORD, "a") as record:
                record.write(f"{waited:.1f} {gib:g} {request.node.nodeid}\n")
        if _CUDA and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        yield
        if not (_CUDA and torch.cuda.is_initialized()):
            return
        peak = torch.cuda.max_memory_reserved()
        if _MEMORY_RECORD and peak > _RECORDED_PEAK:
            with open(_MEMORY_RECORD, "a") as record:
                record.write(f"{peak / 2**30:.1f} {request.node.nodeid}\n")
        if torch.cuda.memory_reserved() > _CACHE_KEPT:
            gc.collect()
            torch.cuda.empty_cache()
