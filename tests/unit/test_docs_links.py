"""The README stays a front door, and no relative link in README.md or docs/ points nowhere."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def links(text: str) -> list[str]:
    """Targets of the inline links and images outside code blocks and code spans."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    return [m.group(1) for m in LINK.finditer(text)]


def anchors(text: str) -> set[str]:
    """The ids GitHub gives the headings of a page (lower case, punctuation dropped, - for spaces)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
        plain = re.sub(r"\\(.)", r"\1", plain.replace("`", "").replace("*", ""))
        slug = re.sub(r"[^\w\- ]", "", plain.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(page: Path) -> list[str]:
    broken = []
    text = page.read_text(encoding="utf-8")
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        path, _, fragment = unquote(target).partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {shown(resolved)}")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading #{fragment} in {shown(resolved)}")
    return broken


def test_readme_is_under_200_lines() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < 200, f"README.md has {lines} lines; move reference material into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_link_checker_sees_what_it_must(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A `code` title\n\n## Same\n\n## Same\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-code-title) [ok](there.md#same-1) [ok](#top)\n"
        "# Top\n"
        "[web](https://example.com/x.md) `[in code](missing.md)`\n"
        "```\n[in a fence](missing.md)\n```\n"
        "[gone](missing.md) ![img](gone.png) [bad anchor](there.md#nope)\n",
        encoding="utf-8",
    )
    found = [b.split(":")[0] for b in broken_links(page)]
    assert found == ["missing.md", "gone.png", "there.md#nope"]
