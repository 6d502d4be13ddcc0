"""scripts/slim-wheel.py: a wheel's copy without the members a machine never loads, installable by pip."""

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("slim_wheel", ROOT / "scripts" / "slim-wheel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FILES = {
    "peer/__init__.py": b"LIB = 'cuda130'\n",
    "peer/libpeer_cuda118.so": b"\x7fELF" + b"a" * 4096,
    "peer/libpeer_cuda130.so": b"\x7fELF" + b"b" * 2048,
    "peer/libpeer_rocm72.so": b"\x7fELF" + b"c" * 1024,
}


def _wheel(folder: Path) -> Path:
    wheel = folder / "peer-1.0-py3-none-any.whl"
    info = "peer-1.0.dist-info"
    meta = {f"{info}/METADATA": b"Metadata-Version: 2.1\nName: peer\nVersion: 1.0\n",
            f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    members = {**FILES, **meta}
    record = "".join(f"{name},,{len(data)}\n" for name, data in members.items()) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", record)
    return wheel


def test_the_copy_leaves_out_what_drop_names_and_keep_does_not(tmp_path):
    slim = _script()
    wheel = _wheel(tmp_path)
    assert slim.main([str(wheel), "--drop", "peer/libpeer_*", "--keep", "*_cuda130.so",
                      "--out", str(tmp_path / "slim")]) == 0
    copy = tmp_path / "slim" / wheel.name
    with zipfile.ZipFile(copy) as zf:
        names = set(zf.namelist())
        record = zf.read("peer-1.0.dist-info/RECORD").decode()
        assert zf.read("peer/libpeer_cuda130.so") == FILES["peer/libpeer_cuda130.so"]
    assert "peer/libpeer_cuda118.so" not in names and "peer/libpeer_rocm72.so" not in names
    assert {"peer/__init__.py", "peer/libpeer_cuda130.so", "peer-1.0.dist-info/METADATA"} <= names
    assert "libpeer_cuda118" not in record and "libpeer_rocm72" not in record
    assert "peer/libpeer_cuda130.so,,2052" in record
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(target), str(copy)], check=True)
    assert sorted(p.name for p in (target / "peer").iterdir()) == ["__init__.py", "libpeer_cuda130.so"]


def test_bad_inputs_are_refused_and_the_wheel_is_left_as_it_was(tmp_path, capsys):
    slim = _script()
    wheel = _wheel(tmp_path)
    before = wheel.read_bytes()
    with pytest.raises(SystemExit):
        slim.main([str(wheel), "--drop", "peer/*", "--out", str(tmp_path)])  # the copy would overwrite it
    assert "holds the wheel itself" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        slim.main([str(tmp_path / "missing.whl"), "--drop", "x", "--out", str(tmp_path / "o")])
    assert "is not a .whl file" in capsys.readouterr().err
    assert wheel.read_bytes() == before
