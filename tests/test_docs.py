"""The README stays a front door and the docs stay connected: every relative link resolves, CI runs
exactly the README's test command, and the dashboard picture stays small enough to load with the page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# [text](target) with a relative target; external links and pure anchors are not files
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _relative_links(page: Path) -> list[str]:
    targets = [t.split("#", 1)[0] for t in LINK.findall(page.read_text(encoding="utf-8"))]
    return [t for t in targets if t and not re.match(r"^[a-z]+:", t)]


def test_every_relative_link_of_the_readme_and_docs_resolves() -> None:
    pages = [README, *sorted(DOCS.glob("*.md"))]
    missing = [f"{page.relative_to(ROOT)} -> {target}" for page in pages for target in _relative_links(page)
               if not (page.parent / target).exists()]
    assert not missing, missing


def test_readme_is_a_front_door_that_links_every_docs_page() -> None:
    text = README.read_text(encoding="utf-8")
    # a front door, not a manual: topics live in docs/ (about 150 lines at most)
    assert len(text.splitlines()) <= 160
    linked = {Path(t).name for t in _relative_links(README) if t.startswith("docs/")}
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_ci_runs_exactly_the_readmes_test_command() -> None:
    readme_commands = re.findall(r"^(\./dev test)\b", README.read_text(encoding="utf-8"), flags=re.M)
    assert readme_commands == ["./dev test"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1] == "./dev test"


def test_dashboard_picture_is_small() -> None:
    picture = DOCS / "images" / "dashboard.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert picture.stat().st_size < 300 * 1024
