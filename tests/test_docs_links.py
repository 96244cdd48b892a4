"""Every relative link in README.md and docs/*.md reaches a file or folder that exists, and a link to a
section reaches a heading of that page (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted(["README.md", *(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))])
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """The text without code, where brackets and hashes are not links or headings."""
    return CODE.sub("", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", page.read_text(encoding="utf-8")), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in found:
            n += 1
            anchor = f"{slug}-{n}"
        found.add(anchor)
    return found


def broken(doc: str) -> list[str]:
    page = REPO / doc
    bad = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            bad.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            bad.append(f"{target}: no such section")
    return bad


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_reaches_a_file_and_section(doc):
    assert broken(doc) == []


def test_anchors_are_githubs():
    page = REPO / "docs" / "USAGE.md"
    assert {"many-gpus--machines", "comfyuis-own-pixart-σ-ksampler-loras", "8-bit-compute"} <= anchors(page)
