"""The pytest plugin, as an application's test suite uses it: examples/shop,
examples/django_shop and examples/fastapi_shop, each run by pytest."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.paths import ROOT
from support.programs import run_python

pytestmark = pytest.mark.integration

EXAMPLES = ROOT / "examples"
RUN_TIMEOUT = 600.0  # an example's suite starts real workers on a busy machine


def run_suite(root: Path, redis_url: str, expect_success: bool = True) -> str:
    """Run the tests of the project at ``root`` as its developers would, from its root and
    without PYTHONPATH; their output."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MERCHANT_", "CELERY_", "DJANGO_")) and k != "PYTHONPATH"
    }
    env["MERCHANT_TEST_REDIS_URL"] = redis_url
    done = run_python(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=root, env=env, timeout=RUN_TIMEOUT
    )
    if expect_success:
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return done.stdout


def run_example_suite(name: str, redis_url: str) -> str:
    """Run ``examples/<name>``'s tests as its developers would; their output."""
    return run_suite(EXAMPLES / name, redis_url)


DJANGO_SETTINGS = """SECRET_KEY = "test-only"\nINSTALLED_APPS = []\nUSE_TZ = True\n"""
DJANGO_CONFTEST = (
    """import os\n\nos.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")\n"""
)
WORKER_TEST = """
def test_a_call_through_the_plugins_worker(merchant_worker):
    assert merchant_worker.call("GET", "/open-api/v1/ping").get(timeout=60) == {"ok": True}
"""
BROKEN_SETTINGS = "import proj.missing_module  # {filler}\n"


def django_project(root: Path, settings: str = DJANGO_SETTINGS) -> Path:
    """A Django project's root: ``proj/settings.py``, a root conftest naming it (as
    pytest-django's ``DJANGO_SETTINGS_MODULE`` would), and a test using ``merchant_worker``."""
    (root / "proj").mkdir(parents=True)
    (root / "proj" / "__init__.py").write_text("")
    (root / "proj" / "settings.py").write_text(settings)
    (root / "conftest.py").write_text(DJANGO_CONFTEST)
    (root / "test_worker.py").write_text(WORKER_TEST)
    return root


@pytest.mark.long
def test_merchant_worker_runs_in_a_django_project_from_its_root_without_pythonpath(
    merchant_redis_url: str, tmp_path: Path
) -> None:
    """The worker inherits DJANGO_SETTINGS_MODULE, and Celery's Django fix-up imports it:
    the worker gets the test process's import path."""
    assert "1 passed" in run_suite(django_project(tmp_path / "shop"), merchant_redis_url)


@pytest.mark.long
def test_a_worker_that_dies_at_start_reports_its_whole_traceback(
    merchant_redis_url: str, tmp_path: Path
) -> None:
    filler = "x" * 50
    root = django_project(tmp_path / "shop", BROKEN_SETTINGS.format(filler=filler))
    (root / "proj" / "settings.py").write_text(BROKEN_SETTINGS.format(filler=filler))
    (root / "conftest.py").write_text(
        'import os\n\nos.environ["DJANGO_SETTINGS_MODULE"] = "proj.settings"\n'
    )
    output = run_suite(root, merchant_redis_url, expect_success=False)
    assert "the test's Celery worker exited; its log ends:" in output
    report = output.split("its log ends:", 1)[1]
    assert "Traceback (most recent call last)" in report
    assert "ModuleNotFoundError: No module named 'proj.missing_module'" in report


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


@pytest.mark.long
def test_the_fastapi_shops_tests_pass_against_a_real_uvicorn(merchant_redis_url: str) -> None:
    """examples/fastapi_shop: a FastAPI service on the asyncio client, ``delay_async`` and
    ``MerchantAuth``, served by uvicorn; every one of its tests passes, none skipped."""
    assert "20 passed in" in run_example_suite("fastapi_shop", merchant_redis_url)
    assert not (EXAMPLES / "fastapi_shop" / "conftest.py").exists()


def test_the_plugin_is_registered_through_its_entry_point() -> None:
    from importlib.metadata import entry_points

    [plugin] = [e for e in entry_points(group="pytest11") if e.name == "merchant_tasks"]
    assert plugin.value == "merchant_tasks.pytest_plugin"
