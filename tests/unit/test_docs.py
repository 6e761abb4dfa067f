"""The front door and the manual: README.md stays short, every link between the pages
lands, and the pages that describe the emulator and the plugin name all they serve."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from merchant_tasks.sandbox import fixtures as sandbox_fixtures
from merchant_tasks.sandbox.emulator import _CONTROL_ROUTES
from support.paths import README, ROOT

PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 160  # a front door: what it is, the two commands, installing, using it
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, made the way GitHub makes them."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_a_front_door_of_at_most_160_lines() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "Python 3.11" in text
    assert text.count("<!-- test-command -->") == 1


def _lands(page: Path, target: str) -> bool:
    """Whether a relative link of ``page`` names a file that exists, and a heading of it."""
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    if not linked.exists():
        return False
    return not anchor or linked.suffix != ".md" or anchor in _anchors(linked)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_lands_on_a_file_and_heading(page: Path) -> None:
    targets = LINK.findall(page.read_text())
    relative = [t for t in targets if not t.startswith(("http://", "https://", "mailto:"))]
    missing = [target for target in relative if not _lands(page, target)]
    assert not missing, f"{page.name} links to what is not there: {missing}"


def test_the_testing_page_lists_every_control_endpoint_of_the_emulator() -> None:
    page = (ROOT / "docs" / "testing.md").read_text()
    for rule in _CONTROL_ROUTES.iter_rules():
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            assert f"`{method} {rule.rule}`" in page, (method, rule.rule)


def test_the_testing_page_names_every_fixture_of_the_plugin() -> None:
    page = (ROOT / "docs" / "testing.md").read_text()
    fixtures = [
        name
        for name, value in inspect.getmembers(sandbox_fixtures)
        if name.startswith("merchant_") and callable(value)
    ]
    assert len(fixtures) >= 10
    for name in fixtures:
        assert f"`{name}`" in page, name
