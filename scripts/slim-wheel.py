"""A copy of a wheel without the members a GPU machine never loads, so that several peers' wheel sets fit one
device call's carry.

    python scripts/slim-wheel.py .whl-bnb/bitsandbytes-0.50.2-*.whl --drop 'bitsandbytes/libbitsandbytes_*' \
        --keep '*_cuda130.so' '*_cuda132.so' --out .whl-bnb-slim

bitsandbytes 0.50.2's wheel is 41 MiB because it ships one native library per CUDA and ROCm release (129 MB
unpacked); a machine loads only the one that matches its torch build (``libbitsandbytes_cuda130.so`` for
torch's cu130 builds). The copy keeps every member except those matching a ``--drop`` pattern and no ``--keep``
pattern (``fnmatch`` patterns over the member's path in the wheel), and drops their lines from the wheel's
``RECORD``, whose other lines (each file's hash and size) stay as they are, so ``pip install`` of the copy
installs exactly the kept files. The copy has the wheel's own file name, in ``--out``.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import zipfile
from pathlib import Path


def dropped(name: str, drop: list[str], keep: list[str]) -> bool:
    """Whether the member ``name`` leaves the copy: it matches a ``drop`` pattern and no ``keep`` pattern."""
    return (any(fnmatch.fnmatchcase(name, p) for p in drop)
            and not any(fnmatch.fnmatchcase(name, p) for p in keep))


def slim(wheel: Path, out_dir: Path, drop: list[str], keep: list[str]) -> tuple[Path, list[str]]:
    """Write the copy of ``wheel`` into ``out_dir``; returns its path and the members left out."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    if target.resolve() == wheel.resolve():
        raise ValueError(f"--out: {out_dir} holds the wheel itself; name another folder")
    left_out = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        names = [info.filename for info in src.infolist()]
        records = [n for n in names if n.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise ValueError(f"{wheel}: a wheel has one .dist-info/RECORD, this one has {len(records)}")
        for info in src.infolist():
            if dropped(info.filename, drop, keep):
                left_out.append(info.filename)
                continue
            data = src.read(info)
            if info.filename == records[0]:  # RECORD: path,hash,size per line; the dropped files' lines go
                lines = data.decode("utf-8").splitlines(keepends=True)
                data = "".join(line for line in lines if line.split(",", 1)[0] not in left_out).encode("utf-8")
            dst.writestr(info, data)
    return target, left_out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel", type=Path)
    p.add_argument("--drop", nargs="+", required=True, metavar="PATTERN", help="members to leave out")
    p.add_argument("--keep", nargs="*", default=[], metavar="PATTERN", help="members to keep though --drop matches")
    p.add_argument("--out", type=Path, required=True, help="folder for the copy")
    args = p.parse_args(argv)
    if not args.wheel.is_file() or args.wheel.suffix != ".whl":
        p.error(f"wheel: {args.wheel} is not a .whl file")
    try:
        target, left_out = slim(args.wheel, args.out, args.drop, args.keep)
    except ValueError as exc:
        p.error(str(exc))
    mib = 2**20
    print(f"{target}: {target.stat().st_size / mib:.1f} MiB (from {args.wheel.stat().st_size / mib:.1f}), "
          f"{len(left_out)} members left out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
