"""The pytest plugin, as an application's test suite uses it: examples/shop and
examples/django_shop, each run by pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RUN_TIMEOUT = 600.0  # an example's suite starts real workers on a busy machine


def run_example_suite(name: str, redis_url: str) -> str:
    """Run ``examples/<name>``'s tests as its developers would; their output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MERCHANT_", "CELERY_"))}
    env["MERCHANT_TEST_REDIS_URL"] = redis_url
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q"],
        cwd=EXAMPLES / name,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.long
def test_the_example_projects_tests_pass_with_the_plugins_fixtures_alone(
    merchant_redis_url: str,
) -> None:
    assert "5 passed" in run_example_suite("shop", merchant_redis_url)
    assert not (EXAMPLES / "shop" / "conftest.py").exists()  # the fixtures come from the plugin


@pytest.mark.long
def test_the_django_shops_tests_pass_against_its_own_worker_and_beat(
    merchant_redis_url: str,
) -> None:
    """examples/django_shop: proj/celery.py with install(app) and autodiscover_tasks(); a
    view charges through ``call_api.delay``; its tests see the payment created once."""
    assert "3 passed" in run_example_suite("django_shop", merchant_redis_url)


def test_the_plugin_is_registered_through_its_entry_point() -> None:
    from importlib.metadata import entry_points

    [plugin] = [e for e in entry_points(group="pytest11") if e.name == "merchant_tasks"]
    assert plugin.value == "merchant_tasks.pytest_plugin"
