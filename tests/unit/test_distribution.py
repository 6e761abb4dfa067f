"""What an index would show of the package: its licence, the Pythons it supports, its
version on the command line."""

from __future__ import annotations

from importlib.metadata import metadata

from click.testing import CliRunner

import merchant_tasks
from merchant_tasks.ops.cli import main
from support.paths import ROOT


def test_the_metadata_names_the_licence_the_pythons_and_the_frameworks() -> None:
    meta = metadata("merchant-tasks")
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Requires-Python"] == ">=3.11"
    classifiers = set(meta.get_all("Classifier") or [])
    pythons = {c.rsplit(" :: ", 1)[1] for c in classifiers if c.startswith("Programming")}
    assert {"3.11", "3.12", "3.13"} <= pythons
    assert {"Framework :: Celery", "Typing :: Typed"} <= classifiers
    assert meta["Author"]
    assert meta["Keywords"]


def test_the_licence_file_is_the_apache_licence_in_full() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_command_line_gives_the_installed_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"merchant-tasks, version {merchant_tasks.__version__}\n"
    assert merchant_tasks.__version__ == metadata("merchant-tasks")["Version"]
