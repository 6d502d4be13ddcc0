"""Triton's compiler key hashed ahead: once per process, only where kernels will be compiled for a CUDA device,
nothing with a Triton that lacks the key, and errors left to Triton's own first lookup.

A stand-in key (``functools.lru_cache``'d, as Triton's is) replaces the real one, which hashes ~0.5 GB; the
real one is only looked up. ``tigon.patch``'s ``prehash`` switch is tested with the engine
(tests/patching/test_engine.py).
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
import triton

from tigon._kernels import prehash_triton_key, wait_for_triton_key
from tigon._kernels import triton_key as _triton_key
from tigon._kernels.triton_key import triton_key_function

CUDA = torch.device("cuda")


class StandInKey:
    """An lru-cached key whose computation waits for ``release`` (so a test sees the thread at work) and
    records the threads it ran on."""

    def __init__(self, *, fails=False):
        self.release = threading.Event()
        self.ran_on = []
        self.fails = fails
        self.key = functools.lru_cache()(self._compute)

    def _compute(self):
        self.ran_on.append(threading.current_thread().name)
        self.release.wait(timeout=5)
        if self.fails:
            raise OSError("libtriton.so unreadable")
        return "3.x-hashes"


@pytest.fixture
def compiled_kernels(monkeypatch):
    """A process where kernels are compiled (the interpreter off) and no prehash thread has run; the key
    is a stand-in."""
    stand_in = StandInKey()
    monkeypatch.setattr(_triton_key._PREHASH, "thread", None)
    monkeypatch.setattr(_triton_key, "interpreter_active", lambda: False)
    monkeypatch.setattr(_triton_key, "triton_key_function", lambda: stand_in.key)
    yield stand_in
    stand_in.release.set()
    wait_for_triton_key()


def test_this_tritons_key_is_found_and_cached_per_process():
    key = triton_key_function()
    assert key is not None and key is getattr(triton.runtime.cache, "triton_key", None)
    assert hasattr(key, "cache_info")


def test_the_key_is_hashed_once_on_one_daemon_thread(compiled_kernels):
    assert prehash_triton_key(CUDA)
    thread = _triton_key._PREHASH.thread
    assert thread.daemon and thread.name == _triton_key.THREAD_NAME
    assert not prehash_triton_key(torch.device("cuda", 1))  # while it hashes: still the one thread
    compiled_kernels.release.set()
    wait_for_triton_key()
    assert not thread.is_alive() and compiled_kernels.key.cache_info().currsize == 1
    assert not prehash_triton_key(CUDA)  # after it: nothing left to hash
    assert compiled_kernels.ran_on == [_triton_key.THREAD_NAME]
    assert compiled_kernels.key() == "3.x-hashes" and compiled_kernels.ran_on == [_triton_key.THREAD_NAME]


def test_a_key_computed_already_starts_no_thread(compiled_kernels):
    compiled_kernels.release.set()
    compiled_kernels.key()  # a kernel was looked up before the patch
    assert not prehash_triton_key(CUDA) and _triton_key._PREHASH.thread is None


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_nothing_for_a_model_off_the_gpu(compiled_kernels, device):
    assert not prehash_triton_key(torch.device(device)) and _triton_key._PREHASH.thread is None


def test_nothing_under_the_interpreter(compiled_kernels, monkeypatch):
    monkeypatch.setattr(_triton_key, "interpreter_active", lambda: True)
    assert not prehash_triton_key(CUDA) and _triton_key._PREHASH.thread is None


def test_a_failing_key_is_left_to_tritons_first_lookup(compiled_kernels):
    compiled_kernels.fails = True
    assert prehash_triton_key(CUDA)
    compiled_kernels.release.set()
    wait_for_triton_key()  # the thread ended quietly, and nothing was cached
    assert compiled_kernels.key.cache_info().currsize == 0
    with pytest.raises(OSError, match="unreadable"):
        compiled_kernels.key()


@pytest.mark.parametrize("key", [None, lambda: "not cached per process"], ids=["missing", "uncached"])
def test_a_triton_without_a_cached_key_is_left_alone(monkeypatch, key):
    monkeypatch.setattr(_triton_key._PREHASH, "thread", None)
    monkeypatch.setattr(_triton_key, "interpreter_active", lambda: False)
    for name in _triton_key.KEY_MODULES:
        module = pytest.importorskip(name)
        if key is None:
            monkeypatch.delattr(module, "triton_key", raising=False)
        else:
            monkeypatch.setattr(module, "triton_key", key, raising=False)
    assert triton_key_function() is None
    assert not prehash_triton_key(CUDA) and _triton_key._PREHASH.thread is None


def test_waiting_without_a_thread_returns_at_once(monkeypatch):
    monkeypatch.setattr(_triton_key._PREHASH, "thread", None)
    wait_for_triton_key()
