"""The README and the docs pages: every relative link reaches a file (and a heading where it names one),
every flag of `python -m minisgl --help` is on the options page, and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from minisgl.service.args import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```.*?^```[^\n]*$", re.DOTALL | re.MULTILINE)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    """The text without code blocks (a `# comment` is no heading, `x[0](y)` no link)."""
    return _FENCE.sub("", text)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, each space a hyphen."""
    text = heading.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on a page, repeated headings numbered -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_prose(page.read_text())):
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    """The targets of the page's markdown links that point inside the repository."""
    prose = _INLINE_CODE.sub("", _prose(page.read_text()))
    return [t for t in _LINK.findall(prose) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Replicas behind SGLang's router", "replicas-behind-sglangs-router"),
        ("The int8 dot (`--stored-dot int8`)", "the-int8-dot---stored-dot-int8"),
        (
            "W6: the service on the H200 (2026-12-03, runs F1-F3)",
            "w6-the-service-on-the-h200-2026-12-03-runs-f1-f3",
        ),
        ("Processes (the service)", "processes-the-service"),
    ],
)
def test_a_heading_gets_githubs_anchor(heading, slug):
    assert github_slug(heading) == slug


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_reaches_a_file_and_its_heading(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, broken


def test_every_flag_of_the_help_is_on_the_options_page():
    page = (ROOT / "docs" / "options.md").read_text()
    flags = {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")}
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", page))
    assert not missing, f"flags of `python -m minisgl --help` missing from docs/options.md: {missing}"


def test_the_readme_is_short_and_its_first_command_comes_first():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 120
    first_command = next(i for i, line in enumerate(lines, 1) if line.startswith("./run serve"))
    assert first_command <= 15
