"""The package's layering, read from the source with ``ast`` (nothing is imported).

- Private names cross no package boundary: a ``_``-prefixed module or name is imported from another
  top-level package (ops, nn, losses, patching, bench, or a top-level module) only from
  ``tigon._kernels``, the one internal package other packages may import from; and no module of
  ``tigon.ops`` or ``tigon._kernels`` imports another module's ``_``-prefixed name (what two ops share
  lives in ``tigon._kernels`` under a public name). ``tigon._interpreter`` is the exception: the switch
  that must run before any kernel is defined cannot live in a package whose import defines kernels.
- Imports point down the layers: _kernels ← ops ← nn, losses ← patching ← bench ← demo, check, cli, warmup.
- No source file is over 700 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "tigon"

# Each part of the package and the layer it sits in: a part imports only from lower layers or its own.
LAYERS = {
    "_interpreter": 0, "_kernels": 0,
    "ops": 1,
    "nn": 2, "losses": 2,
    "patching": 3, "": 3,  # "": tigon's own __init__, whose lazy names are patching's
    "bench": 4,
    "demo": 5, "check": 5, "cli": 5, "warmup": 5,
}
SHARED_PRIVATE = ("tigon._kernels", "tigon._interpreter")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    """The top-level part of tigon a module belongs to ("" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path):
    """(line, imported module, names) of every tigon import in the file; a name imported as a module
    (``from tigon.ops import rms_norm``) is listed as a name."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tigon":
                    yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] == "tigon":
                yield node.lineno, source, [alias.name for alias in node.names]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


FILES = sorted(PACKAGE.rglob("*.py"))


def test_every_part_has_a_layer():
    assert {_part(_module_name(f)) for f in FILES} <= set(LAYERS)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_import_across_parts(path):
    module = _module_name(path)
    part = _part(module)
    wrong = []
    for line, source, names in _imports(path):
        shared = any(source == name or source.startswith(name + ".") for name in SHARED_PRIVATE)
        if _part(source) != part and not shared:
            private_modules = [p for p in source.split(".")[1:] if _private(p)]
            private_names = [n for n in names if _private(n)]
            if private_modules or private_names:
                wrong.append(f"line {line}: from {source} import {', '.join(names)}")
        if part in ("ops", "_kernels") and source != module and any(_private(n) for n in names):
            wrong.append(f"line {line}: {source}'s private names {[n for n in names if _private(n)]}")
    assert not wrong, f"{module}: " + "; ".join(wrong)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down_the_layers(path):
    module = _module_name(path)
    layer = LAYERS[_part(module)]
    upward = [
        f"line {line}: {source}" for line, source, names in _imports(path)
        if LAYERS[_part(source)] > layer
        and not (source == "tigon" and all(n.startswith("__") for n in names))  # tigon.__version__
    ]
    assert not upward, f"{module} (layer {layer}) imports from above: " + "; ".join(upward)


MAX_LINES = 700  # a file past this holds more than one concern: split it along them


def test_every_source_file_is_at_most_700_lines():
    long = {str(p.relative_to(SRC)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, long
