"""The package's shape: modules import one another without a cycle, and each class and
function stays small enough to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

import merchant_tasks

PACKAGE = Path(merchant_tasks.__file__).parent
CLASS_LINES_MAX = 200  # a class a newcomer reads whole before changing it
FUNCTION_LINES_MAX = 60


def _imported_at_load(path: Path) -> set[str]:
    """The package modules ``path`` imports when it is loaded (not inside a function, not
    under ``if TYPE_CHECKING``)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found - {"__init__"}


def _graph() -> dict[str, set[str]]:
    return {path.stem: _imported_at_load(path) for path in PACKAGE.glob("*.py")}


def test_the_graph_is_read_from_real_imports() -> None:
    graph = _graph()
    assert "renewal" in graph["accounts"]  # the wiring lives with the accounts
    assert "renewal" not in graph["client"]  # the client needs only a TokenSource


def _first_cycle(graph: dict[str, set[str]]) -> str | None:
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> str | None:
        if module in path:
            return " -> ".join((*path[path.index(module) :], module))
        if module in done:
            return None
        for imported in sorted(graph.get(module, ())):
            cycle = visit(imported, (*path, module))
            if cycle:
                return cycle
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module, ())
        if cycle:
            return cycle
    return None


def test_a_cycle_is_found_where_there_is_one() -> None:
    graph = {"client": {"token"}, "token": {"store"}, "store": {"client"}, "cli": {"client"}}
    assert _first_cycle(graph) == "client -> token -> store -> client"


def test_no_module_imports_itself_through_others() -> None:
    assert _first_cycle(_graph()) is None


def test_no_class_is_over_200_lines_and_no_function_over_60() -> None:
    too_long = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            limit = CLASS_LINES_MAX if isinstance(node, ast.ClassDef) else FUNCTION_LINES_MAX
            if lines > limit:
                too_long.append(f"{path.name}: {node.name} has {lines} lines (at most {limit})")
    assert too_long == []
