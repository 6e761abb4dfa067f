"""The installed package as the tools that run it see it: import-linter finds every contract
kept, the `merchant-tasks` command and the pytest plugin are where their entry points say,
mypy of an application finds the package's types, and a worker configured for a pool whose
extra is missing says so in one line."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from merchant_tasks.ops.cli import EXIT_CONFIGURATION
from support.paths import ROOT
from support.programs import run_python
from support.typecheck import mypy_strict

pytestmark = pytest.mark.integration


def test_the_import_contracts_hold() -> None:
    """The layers and forbidden imports of pyproject.toml's [tool.importlinter]."""
    lint_imports = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
    assert "0 broken" in done.stdout


def test_the_command_and_the_pytest_plugin_are_where_they_were() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"merchant_tasks": "merchant_tasks.pytest_plugin"}
    import merchant_tasks.pytest_plugin as plugin

    for fixture in (
        "merchant_redis_url",
        "merchant_key_prefix",
        "merchant_sandbox",
        "merchant_settings",
        "merchant_env",
        "merchant_client",
        "merchant_celery_eager",
        "merchant_worker",
    ):
        assert hasattr(plugin, fixture), fixture
    module, _, function = project["scripts"]["merchant-tasks"].partition(":")
    command = getattr(__import__(module, fromlist=[function]), function)
    done = run_python(
        "-c",
        f"import {module}; {module}.{function}()",
        "--version",
    )
    assert callable(command)
    assert done.returncode == 0, done.stderr[-500:]
    assert "merchant-tasks" in done.stdout


def test_mypy_of_an_application_finds_the_installed_package_and_its_types(
    tmp_path: Path,
) -> None:
    """The editable install puts a path in its .pth (no import hook mypy cannot follow)."""
    app = tmp_path / "app.py"
    app.write_text("from merchant_tasks import __version__\nx: int = __version__\n")
    done = mypy_strict(app)
    assert 'expression has type "str", variable has type "int"' in done.stdout, done.stdout
    assert "Cannot find implementation or library stub" not in done.stdout


CELERY_TIMEOUT = 300.0  # seconds: a worker's start on a busy machine
HIDE_GEVENT_AND_RUN_CELERY = """
import sys
sys.modules["gevent"] = None  # as if the gevent extra were not installed
sys.argv = ["celery", "-A", "merchant_tasks", "worker"]
from celery.__main__ import main
main()
"""


def test_a_worker_configured_for_gevent_without_it_says_so_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "celeryconfig.py").write_text('worker_pool = "gevent"\n')
    done = run_python("-c", HIDE_GEVENT_AND_RUN_CELERY, cwd=tmp_path, timeout=CELERY_TIMEOUT)
    assert done.returncode == EXIT_CONFIGURATION, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert done.stderr.strip().splitlines() == [
        "error: MissingExtra: celery worker -P gevent needs the 'gevent' extra "
        "(gevent not installed): pip install 'merchant-tasks[gevent]'"
    ]
