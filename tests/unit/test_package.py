"""The package's shape (docs/design.md, "The folders"): folders by question, layers checked by
import-linter, no import circle, one owner for Redis and for the environment, and a public
surface that does not move when the inside does."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import grimp
import pytest

import merchant_tasks
from support.paths import ROOT

PACKAGE = Path(merchant_tasks.__file__).parent
FOLDERS = ("store", "renewal", "api", "worker", "ops", "sandbox")
TOP_MODULES_MAX = 12


def _imports_graph() -> dict[str, set[str]]:
    """Every import arrow between the package's modules, function-level imports included
    (TYPE_CHECKING ones aside): what grimp, import-linter's engine, reads."""
    graph = grimp.build_graph("merchant_tasks", exclude_type_checking_imports=True)
    return {module: graph.find_modules_directly_imported_by(module) for module in graph.modules}


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


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _folder_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else "(top)"


def test_a_cycle_is_found_where_there_is_one() -> None:
    graph = {"client": {"token"}, "token": {"store"}, "store": {"client"}, "cli": {"client"}}
    assert _first_cycle(graph) == "client -> token -> store -> client"


def test_the_graph_is_read_from_real_imports_function_level_ones_included() -> None:
    graph = _imports_graph()
    assert "merchant_tasks.renewal.manager" in graph["merchant_tasks.accounts"]
    # install() imports the worker's install only when called: still an arrow
    assert "merchant_tasks.worker.install" in graph["merchant_tasks"]
    assert not any(
        m.startswith("merchant_tasks.renewal") for m in graph["merchant_tasks.api.client"]
    )


def test_no_module_imports_itself_through_others() -> None:
    assert _first_cycle(_imports_graph()) is None


def test_the_folders_say_what_lives_there_and_the_top_stays_small() -> None:
    for folder in FOLDERS:
        docstring = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert docstring, f"{folder}/__init__.py says what lives there and what it may import"
    top = [path.name for path in PACKAGE.glob("*.py")]
    assert len(top) <= TOP_MODULES_MAX, top


def _imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_redis_py_is_imported_only_by_the_store() -> None:
    folders = {_folder_of(path) for path in _modules() if "redis" in _imports_of(path)}
    assert folders == {"store"}


def test_the_environment_is_read_by_settings_and_telemetry_only() -> None:
    """The package's variables through settings; telemetry asks whether OpenTelemetry's own
    variables name a provider."""
    readers = {
        path.relative_to(PACKAGE).as_posix()
        for path in _modules()
        if any(
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv", "putenv", "unsetenv")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        )
    }
    assert readers == {"settings.py", "telemetry.py"}


# -- the public surface: what users' code, fleets in flight and docs rely on --------------


def test_the_public_names_still_import_from_where_users_import_them() -> None:
    from merchant_tasks import (
        CredentialsRejected,
        TokenRejected,
        client_for,
        client_from_env,
        install,
    )
    from merchant_tasks.pytest_plugin import MerchantSandbox, MerchantWorker
    from merchant_tasks.tasks import call_api, renew_account, renew_token

    for function in (install, client_from_env, client_for):
        assert callable(function)
    for name in ("AccountClients", "FleetClient", "MerchantClient", "Settings", "__version__"):
        assert name in merchant_tasks.__all__
        assert getattr(merchant_tasks, name) is not None
    assert issubclass(CredentialsRejected, merchant_tasks.MerchantError)
    assert issubclass(TokenRejected, merchant_tasks.MerchantError)
    assert MerchantSandbox.__name__ == "MerchantSandbox"
    assert MerchantWorker.__name__ == "MerchantWorker"
    # the task names are what queued messages carry: a fleet upgraded mid-flight runs them
    assert [task.name for task in (call_api, renew_token, renew_account)] == [
        "merchant_tasks.call_api",
        "merchant_tasks.renew_token",
        "merchant_tasks.renew_account",
    ]
    app: Any = merchant_tasks.app  # celery -A merchant_tasks
    assert app.main == "merchant_tasks"


@pytest.mark.parametrize(
    ("field", "key"),
    [
        ("token", "p:sandbox:k:token"),
        ("generation", "p:sandbox:k:generation"),
        ("lock", "p:sandbox:k:lock"),
        ("breaker", "p:sandbox:k:breaker"),
        ("accepted", "p:sandbox:k:accepted"),
        ("forced", "p:sandbox:k:forced"),
        ("renewal_sent", "p:sandbox:k:renewal-sent"),
        ("renewed", "p:sandbox:k:renewed"),
    ],
)
def test_the_redis_key_names_do_not_move(field: str, key: str) -> None:
    """A fleet upgraded mid-flight keeps its tokens, locks and records."""
    from merchant_tasks.store.keys import AccountKeys

    keys = AccountKeys.of(AccountKeys.namespace_for("p", "sandbox", "k", hash_tag=False))
    assert getattr(keys, field) == key


def test_the_unit_tests_mirror_the_package() -> None:
    """docs/testing.md: ``tests/unit/<folder>/test_<module>[_<topic>].py`` tests
    ``merchant_tasks/<folder>/<module>.py`` (``tests/unit/test_<module>...`` a top-level
    one), so the tests of a rule are found from its module. ``ops/`` also holds the tests of
    the deploy files (``deploy/``), which are no module; the top, the repository's docs,
    bench, package shape and build."""
    unit = ROOT / "tests" / "unit"
    astray = []
    for test in unit.rglob("test_*.py"):
        folder = test.parent.relative_to(unit)
        modules = {path.stem for path in (ROOT / "merchant_tasks" / folder).glob("*.py")}
        if folder == Path("."):  # and the repository's own: its docs, bench, shape, build
            modules |= {"docs", "bench", "package", "distribution"}
        if folder == Path("ops"):
            modules |= {"alert", "dashboard", "deploy"}
        name = test.stem.removeprefix("test_")
        if not any(name == m or name.startswith(f"{m}_") for m in modules):
            astray.append(str(test.relative_to(ROOT)))
    assert not astray, f"unit tests with no module of their name: {astray}"
