"""Shared launcher helpers."""

from tigon.ops._common import cache_by_size


class _SymbolicSize(int):
    """Stands in for a SymInt: an int that cannot be hashed."""

    __hash__ = None


def test_cache_by_size_caches_ints_and_passes_symbolic_sizes_through():
    calls = []

    @cache_by_size
    def geometry(n, *, backward=False):
        calls.append(n)
        return n * 2 + backward

    assert geometry(3) == geometry(3) == 6 and calls == [3]
    assert geometry(3, backward=True) == 7 and calls == [3, 3]
    assert geometry(_SymbolicSize(5)) == geometry(_SymbolicSize(5)) == 10 and calls == [3, 3, 5, 5]
