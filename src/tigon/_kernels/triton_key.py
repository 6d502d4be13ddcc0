"""Triton's compiler key, hashed ahead on a background thread so that the first kernel lookup finds it done.

Triton keys every kernel it compiles or finds in its on-disk cache, hit or miss, by its source, the backend,
the options, the environment and ``triton_key()``: a hash of Triton's own installation. That function reads
and SHA-256-hashes ``triton/runtime/cache.py``, every module under ``triton.compiler``, ``triton.backends``
and ``triton.language``, and the shared library ``triton/_C/libtriton.so`` in 1 MiB chunks (415 MB in Triton
3.6's wheel, 500 MB in 3.9's). It lives in ``triton/runtime/cache.py`` (3.6, 3.9; older releases define it
in ``triton/compiler/compiler.py``) and is ``functools.lru_cache``'d, so a process computes it once, at its
first lookup. With a warm cache (``tigon warmup``) no kernel compiles, and that hash is a large part of what
the first training step's lookups cost.

:func:`prehash_triton_key` computes it on a daemon thread, once per process, when ``tigon.patch`` patches a
model on a CUDA device, so that it overlaps what a script does between patching and its first forward
(building the optimizer, the data loader). What makes this safe and exact:

- the value is the one the first lookup would compute: the same function over the same files, which do not
  change while Triton is imported; the thread only fills Triton's own cache of it;
- ``lru_cache`` stays coherent under concurrent calls (a call made while another computes the value computes
  it again; :func:`wait_for_triton_key`, which :class:`~tigon._kernels.launch.FastLaunch` calls before it
  takes Triton's path, waits for the thread instead);
- the thread mostly runs outside the GIL (hashlib releases it while it hashes a buffer over 2 KiB, file
  reads while they wait), so the main thread keeps its pace; the Python it runs walks Triton's packages,
  which ``import triton.language`` has imported already, so it imports nothing;
- it swallows its own errors: the first lookup then computes the key and raises as it would without tigon.

Nothing happens under Triton's interpreter (which keys nothing), for a model off the GPU, when the key is
computed already, or with a Triton whose ``triton_key`` is missing or not cached per process.
``tigon.patch(model, prehash=False)`` leaves it off.
"""

from __future__ import annotations

import importlib
import threading

import torch

from tigon._interpreter import interpreter_active

# Where Triton defines its key, newest first: runtime/cache.py (3.6, 3.9), compiler/compiler.py (older).
KEY_MODULES = ("triton.runtime.cache", "triton.compiler.compiler")
THREAD_NAME = "tigon-triton-key"


class _Prehash:
    """The process's one prehash thread (None until started), and the lock that keeps it one."""

    lock = threading.Lock()
    thread: threading.Thread | None = None


_PREHASH = _Prehash()


def triton_key_function():
    """Triton's ``triton_key``, or None where this Triton has none, or one not cached per process (hashing
    it ahead would then save nothing)."""
    for name in KEY_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        key = getattr(module, "triton_key", None)
        if callable(key) and hasattr(key, "cache_info"):
            return key
    return None


def prehash_triton_key(device) -> bool:
    """Start computing Triton's compiler key on a daemon thread, if kernels will be compiled for ``device``
    (a CUDA device, Triton's interpreter off) and no thread of this process has started it; True if this
    call started one."""
    if torch.device(device).type != "cuda" or interpreter_active():
        return False
    key = triton_key_function()
    if key is None or key.cache_info().currsize:
        return False
    with _PREHASH.lock:
        if _PREHASH.thread is not None:
            return False
        _PREHASH.thread = threading.Thread(target=_compute, args=(key,), name=THREAD_NAME, daemon=True)
        _PREHASH.thread.start()
    return True


def _compute(key) -> None:
    try:
        key()
    except Exception:  # the first kernel lookup computes it again and raises there
        pass


def wait_for_triton_key() -> None:
    """Wait for the prehash thread if it is still hashing: the lookup about to run needs the key, and
    waiting for the rest of the hash costs less than hashing all of it again alongside."""
    thread = _PREHASH.thread
    if thread is not None and thread.is_alive():
        thread.join()
