"""The documentation's shape: every method has a user page (README.md, the same sections in the same
order, short) and its lab notebook (NOTES.md) apart; the top README is a front door; no Markdown link
points at a path that does not exist."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
METHODS = sorted(p.parent for p in (REPO / "methods").glob("*/__init__.py"))
SECTIONS = ["## Quick start", "## Inputs", "## What you get", "## Results", "## Deviations from the paper",
            "## Paper preset"]
README_WORDS, FRONT_DOOR_WORDS = 950, 1600
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def words(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").split())


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "methods").glob("*/*.md"))]


@pytest.mark.parametrize("folder", METHODS, ids=lambda p: p.name)
def test_every_method_has_a_short_user_page_in_the_common_shape_and_its_notebook(folder):
    readme, notes = folder / "README.md", folder / "NOTES.md"
    assert readme.is_file() and notes.is_file()
    text = readme.read_text(encoding="utf-8")
    headings = [line.strip() for line in text.splitlines() if line.startswith("## ")]
    assert headings == SECTIONS, headings
    assert text.startswith("# `icml ") and "(NOTES.md)" in text  # the title names the command; links its notebook
    assert words(readme) <= README_WORDS, words(readme)


def test_the_top_readme_is_a_front_door():
    assert words(REPO / "README.md") <= FRONT_DOOR_WORDS
    for page in ("scale-out", "adding-a-method", "results", "architecture"):
        assert (REPO / "docs" / f"{page}.md").is_file(), page


def test_no_markdown_link_points_at_a_missing_path():
    missing = []
    for md in markdown_files():
        for target in LINK.findall(md.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor of the same page
            if not (md.parent / target.split("#")[0]).exists():
                missing.append(f"{md.relative_to(REPO)} → {target}")
    assert not missing, missing
