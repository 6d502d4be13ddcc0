"""GPU memory shared between the processes of one GPU test run: a ledger of what the large tests hold.

scripts/gpu-check.sh runs the suite on 14 pytest-xdist workers and, beside them, one process for the bigmem tests
(each reserves up to 27 GiB). Most tests reserve well under 3 GiB, so the workers and the bigmem process fit an
80 GiB card together as long as the few large tests do not all run at once. Each test that tests/gpu_memory.txt
lists (3 GiB or more, measured) and every bigmem test therefore takes its share of a ledger before it starts and
gives it back when it ends: a share is granted while the shares held add up to at most the ledger's capacity
(scripts/gpu-check.sh sets it to the card's memory less 3 GiB for each process, what a process's CUDA context and
its allocator's kept cache may hold besides), or when nothing else is held, so that a test larger than the
capacity still runs, alone.

The ledger is a JSON file ``{pid: GiB}`` changed under an exclusive ``flock``; a process that died holding a share
(a worker ended by pytest-timeout) is dropped from it at the next change, so its share cannot stall the run.
"""

import fcntl
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

GPU_MEMORY = Path(__file__).with_name("gpu_memory.txt")
BIGMEM_GIB = 28.0  # a bigmem test that tests/gpu_memory.txt does not list: the largest listed, 27 GiB, and some


def by_test(path: Path) -> dict:
    """``{nodeid: value}`` from a file of "value nodeid" lines ('#' starts a comment line; none where the file
    is missing): tests/gpu_memory.txt's and tests/gpu_durations.txt's form."""
    if not path.is_file():
        return {}
    lines = (line.split(maxsplit=1) for line in path.read_text().splitlines() if line and not line.startswith("#"))
    return {nodeid: float(value) for value, nodeid in lines}


def gib_needed(path: Path = GPU_MEMORY) -> dict:
    """``{nodeid: GiB}``: each listed test's share of the card."""
    return by_test(path)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and, where /proc tells, is not a zombie (a worker that ended and
    that pytest-xdist has not reaped yet holds no GPU memory)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that pid: alive
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # the process ended in between; or no /proc to tell (not Linux): take it as running
        return not Path("/proc").is_dir()
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"  # the state follows "(command) "


class Ledger:
    """The shares of GPU memory (GiB) that the run's processes hold, kept in the file ``path``."""

    def __init__(self, path, capacity_gib: float, poll_s: float = 0.05):
        if not capacity_gib > 0:
            raise ValueError(f"capacity_gib must be positive, got {capacity_gib!r}")
        self.path = Path(path)
        self.capacity = float(capacity_gib)
        self.poll_s = poll_s

    def _change(self, change) -> bool:
        """Calls ``change(holds)`` on the ledger's ``{pid: GiB}`` under the lock; writes it back when the call
        returns True, and returns what it returned. Entries of processes that ended are dropped first."""
        with open(self.path, "a+") as file:
            fcntl.flock(file, fcntl.LOCK_EX)
            try:
                file.seek(0)
                text = file.read()
                holds = {int(pid): gib for pid, gib in json.loads(text).items()} if text.strip() else {}
                live = {pid: gib for pid, gib in holds.items() if _alive(pid)}
                changed = change(live)
                if changed or live != holds:
                    file.seek(0)
                    file.truncate()
                    file.write(json.dumps({str(pid): gib for pid, gib in live.items()}))
                    file.flush()
                return changed
            finally:
                fcntl.flock(file, fcntl.LOCK_UN)

    def held(self) -> dict:
        """``{pid: GiB}``: the shares held now."""
        seen = {}

        def look(holds):
            seen.update(holds)
            return False

        self._change(look)
        return seen

    def try_take(self, gib: float, pid: int | None = None) -> bool:
        """Takes a share of ``gib`` for ``pid`` (this process) if it fits now; whether it did."""
        pid = os.getpid() if pid is None else pid

        def take(holds):
            others = sum(g for p, g in holds.items() if p != pid)
            if others and others + gib > self.capacity:
                return False
            holds[pid] = gib
            return True

        return self._change(take)

    def give_back(self, pid: int | None = None) -> None:
        pid = os.getpid() if pid is None else pid
        self._change(lambda holds: holds.pop(pid, None) is not None)

    @contextmanager
    def share(self, gib: float):
        """Holds a share of ``gib`` while the block runs, waiting until it fits; yields the seconds waited."""
        start = time.monotonic()
        while not self.try_take(gib):
            time.sleep(self.poll_s)
        try:
            yield time.monotonic() - start
        finally:
            self.give_back()


def from_environment() -> Ledger | None:
    """The run's ledger, where scripts/gpu-check.sh names one (``TIGON_GPU_LEDGER`` and
    ``TIGON_GPU_SHARE_GIB``); None otherwise."""
    path = os.environ.get("TIGON_GPU_LEDGER")
    if not path:
        return None
    return Ledger(path, float(os.environ.get("TIGON_GPU_SHARE_GIB", "0")))
