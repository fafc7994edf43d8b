"""Every relative link in the docs and READMEs points at a file that exists, and every `#anchor` into a
markdown file at one of its headings (as GitHub spells a heading's anchor)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchor_of(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {anchor_of(match) for match in re.findall(r"^#+ (.*)$", text, flags=re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    broken = []
    for url in LINK.findall(text):
        if re.match(r"^[a-z]+:", url):
            continue
        path, _, anchor = url.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(url)
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(url)
    assert not broken, broken
