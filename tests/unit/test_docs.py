"""The front door and the manual: README.md stays short, every link between the pages
lands, and the pages that describe the emulator and the plugin name all they serve."""

from __future__ import annotations

import importlib
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


DESIGN = ROOT / "docs" / "design.md"
PACKAGE = ROOT / "merchant_tasks"


def _headings(page: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in page.read_text().splitlines() if line[:1] == "#"]


def test_every_section_of_design_md_the_code_cites_exists() -> None:
    """A docstring or comment that cites ``docs/design.md, "Section"`` names a heading of
    the page (a citation may shorten it: it must begin one)."""
    headings = _headings(DESIGN)
    cited = re.compile(r'design\.md(?:\'s)?,?\s+(?:#\s*)?"([^"]+)"')
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = " ".join(path.read_text().split())  # a citation may wrap across lines
        for section in cited.findall(text):
            if not any(h.startswith(section.strip(" .,")) for h in headings):
                missing.append(f"{path.relative_to(ROOT)}: {section!r}")
    assert not missing, f"sections cited but not in docs/design.md: {missing}"


def _owner_rows() -> list[str]:
    lines = DESIGN.read_text().splitlines()
    start = lines.index("### Each rule and its owner")
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("| ") and not line.startswith(("| rule", "|---")):
            rows.append(line.rsplit("|", 2)[-2])
    return rows


def _resolve(name: str, context: list[object]) -> object:
    """``name`` as the owners' column writes it: a file (``renewal/life.py``), a dotted
    name from the package (``token.Token``), or a name of what the row named last."""
    if name.endswith((".py", "/")):
        dotted = name.removesuffix("/").removesuffix(".py").replace("/", ".")
        module = importlib.import_module("merchant_tasks." + dotted)
        context[:] = [module]
        return module
    head, _, rest = name.partition(".")
    if (rest and (PACKAGE / head).exists()) or (PACKAGE / f"{head}.py").exists():
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found: object = importlib.import_module("merchant_tasks." + ".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for attribute in parts[cut:]:
                found = getattr(found, attribute)
            context[:] = [found, inspect.getmodule(found) or found]
            return found
    for owner in list(context):
        found = owner
        try:
            for attribute in name.removesuffix("()").split("."):
                found = getattr(found, attribute)
        except AttributeError:
            continue
        if inspect.isclass(found):
            context.insert(0, found)  # the names after it may be its own
        return found
    raise AttributeError(f"{name} is not in {context}")


@pytest.mark.parametrize("owners", _owner_rows(), ids=lambda row: row.strip()[:40])
def test_each_owner_design_md_names_is_in_the_code(owners: str) -> None:
    """docs/design.md's "Each rule and its owner": every module, class, function and
    constant it names in backticks imports (a rename that forgets the page fails here)."""
    context: list[object] = []
    names = re.findall(r"`([A-Za-z_][\w./]*(?:\(\))?)`", owners)
    assert names
    for name in names:
        _resolve(name, context)


def test_no_two_modules_of_the_package_share_a_name() -> None:
    """A name says which module it is, wherever it is read: in a traceback, an import, a
    search."""
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            seen.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    shared = {stem: paths for stem, paths in seen.items() if len(paths) > 1}
    assert not shared, shared


def test_every_test_the_reliability_page_names_exists() -> None:
    """docs/reliability.md proves each promise by naming tests: each name is a test file or
    a test function of the suite (a renamed test takes the page along)."""
    tests = ROOT / "tests"
    files = {path.stem for path in tests.rglob("test_*.py")}
    functions = {
        name
        for path in tests.rglob("test_*.py")
        for name in re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M)
    }
    named = set(re.findall(r"\btest_\w+", (ROOT / "docs" / "reliability.md").read_text()))
    assert named
    assert named <= files | functions, sorted(named - files - functions)
