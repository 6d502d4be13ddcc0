"""Every relative link in the repository's prose resolves: README.md, CHANGELOG.md, docs/, the benchmark
results and examples/README.md. A link's file (or folder) must exist, and its ``#anchor`` must be a heading
of the linked markdown file, slugged as GitHub slugs headings. Links to the web are not fetched."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MAX_RESULT_FILES = 60


def _documents() -> list[Path]:
    docs = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "examples" / "README.md"]
    docs += sorted((ROOT / "docs").rglob("*.md")) + sorted(RESULTS.rglob("*.md"))
    return [p for p in docs if p.is_file()]


FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
# [text](target "title") and ![alt](target); the text may hold one level of brackets ([`x`][y] aside).
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def _prose(text: str) -> str:
    """The text with code blocks and code spans blanked out: links inside them are examples, not links."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return CODE_SPAN.sub("", text)


def links(text: str) -> list[str]:
    prose = _prose(text)
    return INLINE.findall(prose) + REFERENCE.findall(prose)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation but '-' and '_' removed,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set(HTML_ANCHOR.findall(text))
    for _, heading in HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")  # repeated headings get -1, -2, ...
        seen[base] = n + 1
    return out


def broken_links(doc: Path) -> list[str]:
    problems = []
    for target in links(doc.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = doc if not path_part else (doc.parent / path_part).resolve()
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    assert broken_links(doc) == []


def test_slugs_and_link_parsing():
    assert slug("How ops are timed") == "how-ops-are-timed"
    assert slug("`fused_attention=True` (the default)") == "fused_attentiontrue-the-default"
    assert slug("history.jsonl") == "historyjsonl"
    assert slug("CUDA-graph replay") == "cuda-graph-replay"
    assert slug("[Tensor parallelism](x.md) on 2 × H100") == "tensor-parallelism-on-2--h100"
    text = "[a](b.md#c) `[no](d.md)` ![img](e.png)\n```\n[no](f.md)\n```\n[ref]: g.md\n[x](https://h.org)"
    assert links(text) == ["b.md#c", "e.png", "https://h.org", "g.md"]


def test_results_stay_small():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= MAX_RESULT_FILES, f"{len(files)} files under benchmarks/results (at most {MAX_RESULT_FILES})"
