"""The GPU run's order (tests/conftest.py): the tests tests/gpu_durations.txt lists first, the longest first."""

from types import SimpleNamespace

from tests.conftest import GPU_DURATIONS, gpu_seconds, longest_first


def test_the_longest_gpu_tests_go_first_and_the_rest_keep_their_order(tmp_path):
    durations = tmp_path / "durations.txt"
    durations.write_text("# a comment\n12.5 tests/b.py::test_b\n80.0 tests/d.py::test_d[x y]\n")
    seconds = gpu_seconds(durations)
    assert seconds == {"tests/b.py::test_b": 12.5, "tests/d.py::test_d[x y]": 80.0}
    items = [SimpleNamespace(nodeid=n) for n in ("tests/a.py::test_a", "tests/b.py::test_b", "tests/c.py::test_c",
                                                  "tests/d.py::test_d[x y]", "tests/e.py::test_e")]
    longest_first(items, seconds)
    assert [i.nodeid for i in items] == ["tests/d.py::test_d[x y]", "tests/b.py::test_b", "tests/a.py::test_a",
                                         "tests/c.py::test_c", "tests/e.py::test_e"]
    assert gpu_seconds(tmp_path / "missing.txt") == {}


def test_the_committed_durations_name_test_files_that_exist():
    seconds = gpu_seconds()
    assert len(seconds) > 20 and all(s >= 8 for s in seconds.values())
    root = GPU_DURATIONS.parent.parent
    assert all((root / nodeid.split("::")[0]).is_file() for nodeid in seconds)
