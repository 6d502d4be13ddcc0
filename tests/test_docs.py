"""The signatures written in docs/api/ are the code's: every one is parsed and compared with
``inspect.signature`` of the function or class it names (parameter names, order, keyword-only or not,
defaults), so the reference cannot drift from the code."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import tigon.losses
import tigon.nn
import tigon.ops

DOCS = Path(__file__).resolve().parents[1] / "docs"

# What the losses' tables write as "...": the keywords every loss takes (docs/api/post-training.md says so).
LOSS_KEYWORDS = "linear_bias=None, ignore_index=-100, temperature=1.0, softcap=None, logit_scale=1.0"

# Parameters a page leaves out of its signatures and names in its prose instead.
IN_PROSE = {
    "ops.md": {"config"},  # each op's launch config: docs/tuning.md
    "post-training.md": {"config"},  # "FusedLinearLogprobsConfig (the config= keyword)"
    "nn.md": {"device", "dtype"},  # "The norm and MLP constructors also take device=None, dtype=None"
}

PAGES = {"ops.md": (tigon.ops,), "post-training.md": (tigon.ops, tigon.losses), "nn.md": (tigon.nn,)}


def written_signatures(page: str) -> dict[str, str]:
    """``name -> parameter text`` for every signature on the page: the first line(s) of each python code
    block that call a name (``name(...) -> ...``), and the first cell of each table row (`` `Name(...)` ``)."""
    text = (DOCS / "api" / page).read_text()
    found = {}
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    rows = re.findall(r"^\| `([A-Za-z_][\w]*\(.*?\))` \|", text, flags=re.M)
    for source in [*blocks, *rows]:
        match = re.match(r"([A-Za-z_]\w*)\(", source)
        if match is None:
            continue
        depth, start = 0, match.end()
        for i in range(match.end() - 1, len(source)):
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            if depth == 0:
                found[match.group(1)] = source[start:i]
                break
    return found


def parsed(params: str) -> list[tuple[str, str, object]]:
    """``[(name, kind, default)]`` of a written parameter list; kind "positional" or "keyword"."""
    params = re.sub(r"\.\.\.(?=\s*$)", LOSS_KEYWORDS, params.strip())
    args = ast.parse(f"def f({params}): pass").body[0].args
    out = []
    positional = args.posonlyargs + args.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults]
    out += [(a.arg, "positional", d) for a, d in zip(positional, defaults, strict=True)]
    out += [(a.arg, "keyword", inspect.Parameter.empty if d is None else ast.literal_eval(d))
            for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    return out


def actual(obj) -> list[tuple[str, str, object]]:
    kinds = {inspect.Parameter.POSITIONAL_ONLY: "positional", inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
             inspect.Parameter.KEYWORD_ONLY: "keyword"}
    return [(p.name, kinds.get(p.kind, str(p.kind)), p.default) for p in inspect.signature(obj).parameters.values()]


def _cases():
    for page, modules in PAGES.items():
        for name, params in written_signatures(page).items():
            yield pytest.param(page, modules, name, params, id=f"{page}:{name}")


def test_the_pages_have_their_signatures():
    names = {page: set(written_signatures(page)) for page in PAGES}
    assert {"rms_norm", "rope", "cross_entropy", "fused_linear_cross_entropy", "fused_linear_jsd"} <= names["ops.md"]
    assert {"fused_linear_logprobs", "tvd", "dpo_loss", "kto_loss", "grpo_loss"} <= names["post-training.md"]
    assert {"RMSNorm", "SwiGLUMLP", "CrossEntropyLoss", "FusedLinearCrossEntropyLoss"} <= names["nn.md"]


@pytest.mark.parametrize("page, modules, name, params", list(_cases()))
def test_written_signature_is_the_code_signature(page, modules, name, params):
    obj = next((getattr(m, name) for m in modules if hasattr(m, name)), None)
    assert obj is not None, f"docs/api/{page} documents {name}, which {[m.__name__ for m in modules]} lack"
    written = parsed(params)
    code = [p for p in actual(obj) if p[0] not in IN_PROSE[page] or p[0] in {w[0] for w in written}]
    assert written == code, f"docs/api/{page}: {name}({params})\n  code: {inspect.signature(obj)}"


def test_the_command_page_documents_every_subcommand_and_option():
    import argparse

    from tigon.bench.specs import load_specs
    from tigon.cli import build_parser

    text = (DOCS / "api" / "cli.md").read_text()
    parser = build_parser()
    assert "--version" in text
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        assert f"## `tigon {name}" in text, name
        for action in sub._actions:
            for option in action.option_strings:
                assert option in ("-h", "--help") or f"`{option}" in text, f"tigon {name} {option}"
    for op in load_specs():
        assert f"`{op}`" in text, op  # the op names `tigon bench` and `tigon check` take
