"""Flower as docker-compose.yml's flower service runs it (the image's flowerconfig, a secret
file), on loopback against real Redis: every page and the API ask for basic auth."""

from __future__ import annotations

import base64
import os
import sys
import urllib.error
import urllib.request
from http import HTTPStatus
from pathlib import Path

import pytest

from merchant_tasks.sandbox.processes import free_port, running
from merchant_tasks.worker.app import isolated_config, write_config_module
from support.compose import COMPOSE
from support.paths import ROOT

pytestmark = pytest.mark.integration


def _status(url: str, auth: str | None = None) -> int:
    request = urllib.request.Request(url)  # noqa: S310 - a loopback URL of the test
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code
    except urllib.error.URLError:
        return 0  # not listening yet


def test_flower_with_the_images_flowerconfig_asks_every_page_and_the_api_for_basic_auth(
    tmp_path: Path, merchant_redis_url: str, merchant_key_prefix: str
) -> None:
    """Flower as the flower service runs it (its --conf, a secret file), on loopback."""
    auth = tmp_path / "flower-auth"
    auth.write_text("ops:flower-test-pw\n", encoding="utf-8")
    write_config_module(
        tmp_path / "celeryconfig.py", isolated_config(merchant_redis_url, merchant_key_prefix)
    )
    port = free_port()
    command = COMPOSE["services"]["flower"]["command"]
    argv = [sys.executable, "-m", *command]
    argv = [a for a in argv if not a.startswith(("--address=", "--port=", "--conf="))]
    argv += [f"--conf={ROOT / 'deploy' / 'flowerconfig.py'}", "--address=127.0.0.1"]
    argv += [f"--port={port}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MERCHANT_", "CELERY_"))}
    env["FLOWER_BASIC_AUTH_FILE"] = str(auth)
    base = f"http://127.0.0.1:{port}"
    with running(
        "flower",
        argv,
        tmp_path / "flower.log",
        lambda: _status(f"{base}/healthcheck") == HTTPStatus.OK,  # open: for the healthcheck
        env=env,
        cwd=tmp_path,
    ) as flower:
        for path in ("/", "/tasks", "/api/workers?refresh=false", "/api/tasks"):
            assert _status(base + path) == HTTPStatus.UNAUTHORIZED, path
            assert _status(base + path, "ops:wrong") == HTTPStatus.UNAUTHORIZED, path
            assert _status(base + path, "ops:flower-test-pw") == HTTPStatus.OK, path
    assert "flower-test-pw" not in flower.log_text()
