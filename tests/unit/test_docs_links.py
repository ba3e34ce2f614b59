"""The repository explains itself: every pointer into ``docs/`` names a page and heading that exist,
and nothing points at design documents outside the repository.

Code points at the docs as ``docs/<page>.md, '<Heading>'``; markdown links as
``<page>.md#<anchor>`` (GitHub's anchor rule: lower case, punctuation dropped, spaces to dashes).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SOURCES = ("node", "protocol", "security", "models", "optimizers", "pipeline", "rl", "benchmarks", "tests",
           "deploy", "scripts")
CODE_POINTER = re.compile(r"docs/([a-z_]+\.md),\s+'([^']+)'")
MD_LINK = re.compile(r"\]\((?:docs/)?([a-z_]+\.md)#([a-z0-9-]+)\)")
OUTSIDE = re.compile(r"shared[/]design|§|\b(?:ARCHITECTURE|ops|style)\.md\b|(?<![/\w])(?:noloco|pipeline|grpo|security)\.md\b")


def _anchor(heading: str) -> str:
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


def _headings(page: str) -> set[str]:
    text = (DOCS / page).read_text()
    return {m.group(1).strip() for m in re.finditer(r"^#{1,4} (.+)$", text, re.M)}


def _files():
    yield ROOT / "README.md"
    yield ROOT / "Dockerfile"
    yield ROOT / "pyproject.toml"
    yield from DOCS.glob("*.md")
    for top in SOURCES:
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and path.suffix in {".py", ".md", ".toml", ".yaml", ".yml", ".proto", ".sh"}:
                yield path


def test_every_code_pointer_names_an_existing_heading():
    pages = {p.name: _headings(p.name) for p in DOCS.glob("*.md")}
    bad = []
    for path in _files():
        for page, heading in CODE_POINTER.findall(path.read_text(errors="replace")):
            if heading not in pages.get(page, set()):
                bad.append(f"{path.relative_to(ROOT)}: docs/{page}, '{heading}'")
    assert not bad, "pointers to missing docs headings (rename the pointer or the heading):\n" + "\n".join(bad)


def test_every_markdown_anchor_exists():
    anchors = {p.name: {_anchor(h) for h in _headings(p.name)} for p in DOCS.glob("*.md")}
    bad = []
    for path in [ROOT / "README.md", ROOT / "deploy" / "README.md", *DOCS.glob("*.md")]:
        for page, anchor in MD_LINK.findall(path.read_text()):
            if anchor not in anchors.get(page, set()):
                bad.append(f"{path.relative_to(ROOT)}: {page}#{anchor}")
    assert not bad, "links to missing anchors:\n" + "\n".join(bad)


def test_readme_and_docs_point_only_inside_the_repository():
    for path in [ROOT / "README.md", ROOT / "deploy" / "README.md", *DOCS.glob("*.md")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            inside = re.sub(r"\[[^\]]*\]\([^)]*\)|docs/[a-z_]+\.md", "", line)   # links and docs/ paths
            hit = OUTSIDE.search(inside)
            assert hit is None, f"{path.relative_to(ROOT)}:{n} points outside the repository: {line.strip()[:120]}"


def test_the_anchor_rule():
    assert _anchor("Drain and preemption") == "drain-and-preemption"
    assert _anchor("Node lifecycle") == "node-lifecycle"
    assert _anchor("CheckFree+") == "checkfree"
