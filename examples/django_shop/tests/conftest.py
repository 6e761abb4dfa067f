"""The shop's test set-up: Django configured against the test Redis, and per test a real
``celery -A proj worker`` and ``celery -A proj beat`` serving the test's emulator account.

The emulator, its account, the Redis and the token store's key prefix come from the
merchant-tasks pytest plugin (``merchant_sandbox``, ``merchant_settings``, ...).
"""

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from merchant_tasks.sandbox.processes import Child, spawn, stop_all
from merchant_tasks.settings import Settings, child_env

ROOT = Path(__file__).resolve().parents[1]
CELERY_PREFIX = f"shop-test-{uuid.uuid4().hex[:10]}:"  # this run's queues and results
START_TIMEOUT = 90.0  # seconds for the worker to answer on a busy machine
RENEW_INTERVAL = "1"  # seconds between beat's checks: the renewal shows within the test


@pytest.fixture(scope="session")
def celery_app(merchant_redis_url: str) -> Iterator[Any]:
    """Django set up on the test Redis; the shop's Celery app (proj/celery.py)."""
    os.environ["SHOP_REDIS_URL"] = merchant_redis_url
    os.environ["SHOP_CELERY_KEY_PREFIX"] = CELERY_PREFIX
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
    import django

    django.setup()
    from proj.celery import app

    yield app
    app.close()
    client = redis.Redis.from_url(merchant_redis_url)
    keys = list(client.scan_iter(match=f"{CELERY_PREFIX}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def shop_fleet(
    celery_app: Any, merchant_settings: Settings, merchant_redis_url: str, tmp_path: Path
) -> Iterator[list[Child]]:
    """The shop's worker and beat, as its operators start them, for the test's account."""
    env = child_env(merchant_settings)
    env.update(
        SHOP_REDIS_URL=merchant_redis_url,
        SHOP_CELERY_KEY_PREFIX=CELERY_PREFIX,
        DJANGO_SETTINGS_MODULE="proj.settings",
        MERCHANT_RENEW_INTERVAL=RENEW_INTERVAL,
    )
    celery = [sys.executable, "-m", "celery", "-A", "proj"]
    node = f"{uuid.uuid4().hex[:8]}@%h"
    # alone on its queues: no gossip, and no second's wait for neighbours to sync with
    options = ["--concurrency=2", "--without-gossip", "--without-mingle", "--loglevel=INFO"]
    worker = spawn(
        "the shop's worker",
        [*celery, "worker", "-n", node, *options],
        tmp_path / "worker.log",
        env=env,
        cwd=ROOT,
    )
    beat = spawn(
        "the shop's beat",
        [*celery, "beat", "-s", str(tmp_path / "beat-schedule"), "--loglevel=INFO"],
        tmp_path / "beat.log",
        env=env,
        cwd=ROOT,
    )
    try:
        worker.wait_ready(
            lambda: bool(celery_app.control.ping([node.replace("%h", _host())], timeout=0.5)),
            timeout=START_TIMEOUT,
        )
        yield [worker, beat]
    finally:
        stop_all([beat, worker])


def _host() -> str:
    import socket

    return socket.gethostname()


@pytest.fixture
def web() -> Any:
    """Django's test client: requests through the shop's URLs and views."""
    from django.test import Client

    return Client()
