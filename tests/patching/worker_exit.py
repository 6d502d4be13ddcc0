"""How a torchrun test worker leaves once its results are written and its process group destroyed."""

from __future__ import annotations

import os
import sys


def leave() -> None:
    """Exit 0 without the interpreter's teardown, where a communication thread still being joined can abort the
    process (std::terminate) after a correct run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
