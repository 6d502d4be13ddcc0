"""What a benchmark spec is: the cases (shapes), the providers, and the bytes each mode must move.

A spec never times anything itself; :mod:`tigon.bench.harness` runs every (case, provider, mode).

Modes:
  fwd   the forward with autograd recording (what training runs), outputs discarded
  bwd   the backward alone, from one recorded forward (``retain_graph``), with a random gradient
  full  forward + backward
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

MODES = ("fwd", "bwd", "full")


@dataclass
class Case:
    """One benchmark point.

    ``make_inputs(device, dtype)`` returns a dict of keyword arguments for the providers; tensors that
    should receive gradients are created with ``requires_grad=True``. ``sol_bytes`` holds the fewest
    bytes each mode must move through device memory (each input read once, each output written
    once): the harness divides it by the copy bandwidth it measures to get the speed-of-light time.
    """

    label: str
    params: dict
    make_inputs: Callable[[torch.device, torch.dtype], dict]
    sol_bytes: dict[str, float]
    flops: dict[str, float] = field(default_factory=dict)


@dataclass
class Spec:
    """One op's benchmark.

    ``providers`` maps a name to ``fn(**inputs) -> Tensor | tuple[Tensor, ...]``. ``eager`` (the
    PyTorch reference) is required; the harness adds ``torch.compile`` of it as ``compile``.
    ``peers`` maps another library's provider name (``liger``, ``trl``) to a zero-argument factory
    returning such a function, or None when that library is not importable (or has no equivalent).
    The harness calls the factories when it runs the benchmark, so that loading the specs (``tigon
    check``, ``tigon bench``'s name check) imports no peer library.

    ``check_case`` is one small case (seconds under the CPU interpreter) that ``tigon check`` runs in
    float32 on whatever device is present, comparing ``tigon`` with ``eager`` output and gradients.
    """

    name: str
    cases: Callable[[], list[Case]]
    providers: dict[str, Callable]
    peers: dict[str, Callable[[], Callable | None]] = field(default_factory=dict)
    dtype: torch.dtype = torch.bfloat16
    modes: tuple[str, ...] = MODES
    # Forward outputs that are differentiated in bwd/full (indices into a tuple output); None: all.
    grad_outputs: tuple[int, ...] | None = None
    check_case: Callable[[], Case] | None = None
