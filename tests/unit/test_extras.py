"""Tools are extras: a missing one is named with its pip command, never an ImportError."""

from __future__ import annotations

import tomllib

import pytest
from click.testing import CliRunner

from merchant_tasks import __version__, extras
from merchant_tasks.exceptions import ConfigurationError, MissingExtra
from merchant_tasks.ops.cli import EXIT_CONFIGURATION, main
from support.paths import ROOT


@pytest.fixture
def without(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Modules to treat as not installed."""
    missing: set[str] = set()
    installed = extras._installed
    monkeypatch.setattr(extras, "_installed", lambda name: name not in missing and installed(name))
    return missing


@pytest.mark.parametrize(
    ("command", "module", "extra"),
    [
        (["sandbox"], "werkzeug", "sandbox"),
        (["metrics"], "prometheus_client", "metrics"),
        (["demo"], "fakeredis", "demo"),
    ],
)
def test_a_command_whose_extra_is_missing_names_the_pip_command(
    without: set[str], command: list[str], module: str, extra: str
) -> None:
    without.add(module)
    result = CliRunner().invoke(
        main, command, env={"MERCHANT_API_KEY": "k", "MERCHANT_API_SECRET": "s"}
    )
    assert result.exit_code == EXIT_CONFIGURATION
    assert f"pip install 'merchant-tasks[{extra}]'" in result.stderr
    assert module in result.stderr
    assert "Traceback" not in result.output


def test_missing_extra_is_a_configuration_error() -> None:
    assert issubclass(MissingExtra, ConfigurationError)


def test_every_extra_is_declared_in_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = project["project"]["optional-dependencies"]
    assert set(extras.EXTRAS) <= set(declared)
    assert declared["all"] == [f"merchant-tasks[{','.join(sorted(extras.EXTRAS))}]"]
    assert "merchant-tasks[all]" in declared["dev"]
    assert sorted(project["project"]["dependencies"]) == sorted(
        [
            "celery[redis]>=5.4",
            "redis>=5.0",
            "requests>=2.31",
            "tenacity>=9.1",
            "click>=8.1",
        ]
    )


def test_the_package_exports_its_version() -> None:
    from importlib.metadata import version

    assert __version__ == version("merchant-tasks")


@pytest.mark.parametrize(
    ("argv", "configured"),
    [
        (["celery", "-A", "proj", "worker"], "gevent"),  # worker_pool in the configuration
        (["celery", "-A", "proj", "worker", "-Pgevent"], "prefork"),
    ],
)
def test_a_worker_pool_whose_extra_is_missing_is_named(
    without: set[str], argv: list[str], configured: str
) -> None:
    without.add("gevent")
    with pytest.raises(MissingExtra, match=r"pip install 'merchant-tasks\[gevent\]'"):
        extras.require_worker_pool(argv, configured)
    extras.require_worker_pool([*argv[:3], "inspect", "ping"], configured)  # not a worker
    for pool in (["-P", "threads"], ["--pool=solo"], ["--pool", "prefork"]):
        extras.require_worker_pool([*argv[:4], *pool], configured)  # the command line wins
