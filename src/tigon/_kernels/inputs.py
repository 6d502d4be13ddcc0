"""What every op checks of its inputs, and how it views them: argument checks that name the argument,
row views, and autocast's dtype on a device.
"""

from __future__ import annotations

import contextlib
import math
import numbers

import torch

from tigon._interpreter import interpreter_active

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(t, name: str, *, dtypes=FLOAT_DTYPES, device: torch.device | None = None) -> None:
    """Raise TypeError/ValueError naming ``name`` when ``t`` cannot go to a kernel.

    A kernel reads raw pointers, so a wrong device or dtype must be stopped here: past this point it
    would be a CUDA fault or a silently wrong answer rather than an error message.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {allowed}")
    t_device = t.device  # read once: each read makes a torch.device (this runs on every op call)
    if device is not None and t_device != device:
        raise ValueError(f"{name} is on {t_device}, expected {device} (all inputs on one device)")
    device_type = t_device.type
    if device_type == "cuda":
        return
    if device_type == "cpu" and interpreter_active():
        return
    if device_type == "meta":  # shape propagation (torch.compile, fake tensors)
        return
    raise ValueError(
        f"{name} is on {t_device}: tigon kernels need CUDA tensors "
        "(CPU tensors only under the Triton interpreter, TRITON_INTERPRET=1)"
    )


def check_real(value, name: str, *, minimum=None, maximum=None, positive=False, finite=True) -> float:
    """``value`` as a float: TypeError naming ``name`` for anything but a real number (a bool, a str or
    None included), ValueError for NaN, an infinity (unless ``finite=False``) or a value outside
    ``[minimum, maximum]`` (``> 0`` with ``positive``). An option that reached a comparison or a
    kernel unchecked would fail there without naming itself, or run with a meaningless value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    # (abs() == inf rather than math.isinf: under torch.compile with dynamic shapes a float option is
    # a symbolic float, which math.isinf cannot trace)
    if value != value or (finite and abs(value) == math.inf):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if positive and not value > 0.0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if minimum is not None and not value >= minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and not value <= maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_int(value, name: str) -> int:
    """``value`` as an int (a Python or NumPy integer, not a bool): TypeError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


# The devices tigon's kernels run on, both with autocast. A name list rather than
# ``torch.amp.is_autocast_available``, which dynamo does not trace (torch 2.11); meta tensors have no autocast.
AUTOCAST_DEVICES = ("cuda", "cpu")


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts matmul operands to on ``device``, or None where it is off
    (or where the device has no autocast: meta tensors)."""
    device_type = device.type
    if device_type in AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def autocast_off(device: torch.device):
    """``torch.autocast(device.type, enabled=False)``; nothing on a device without autocast (meta)."""
    if device.type in AUTOCAST_DEVICES:
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as ``(rows, last_dim)`` without copying where the strides allow it.

    Kernels take a row stride and a column stride, so a non-contiguous row layout or a stride-0
    (expanded) gradient is read in place; only layouts whose leading dims cannot be merged into one
    stride are copied by ``reshape``.
    """
    return t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
