"""The pytest plugin, as an application's test suite uses it: examples/shop, run by pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "shop"
RUN_TIMEOUT = 600.0  # the example's suite starts a real worker on a busy machine


def test_the_example_projects_tests_pass_with_the_plugins_fixtures_alone(
    merchant_redis_url: str,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MERCHANT_", "CELERY_"))}
    env["MERCHANT_TEST_REDIS_URL"] = merchant_redis_url
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q"],
        cwd=EXAMPLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "5 passed" in done.stdout
    assert not (EXAMPLE / "conftest.py").exists()  # the fixtures come from the plugin


def test_the_plugin_is_registered_through_its_entry_point() -> None:
    from importlib.metadata import entry_points

    [plugin] = [e for e in entry_points(group="pytest11") if e.name == "merchant_tasks"]
    assert plugin.value == "merchant_tasks.pytest_plugin"
