"""A shop's own Celery app hosts merchant-tasks through install(app), for real.

``proj.py`` below is what a shop writes: its own ``Celery("proj")`` with its own task and
settings, and one line, ``merchant_tasks.install(app)``. ``celery -A proj worker`` and
``celery -A proj beat`` run from a directory of their own against the real Redis and the
emulator; a separate process enqueues the way the shop's code does (``proj.add.delay``,
``call_api.delay``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import Child, spawn, wait_until
from merchant_tasks.settings import Settings, child_env
from support.programs import run_python

pytestmark = pytest.mark.integration

START_TIMEOUT = 90.0  # seconds for a worker or beat to come up on a busy machine
RESULT_TIMEOUT = 60.0  # seconds for a task's result

PROJ = '''\
"""The shop's one Celery app: its own tasks, and merchant-tasks' through install()."""
import os

from celery import Celery

import merchant_tasks

app = Celery("proj", broker=os.environ["PROJ_REDIS_URL"], backend=os.environ["PROJ_REDIS_URL"])
prefix = {"global_keyprefix": os.environ["PROJ_KEY_PREFIX"]}  # its keys apart from others'
app.conf.update(
    broker_transport_options=prefix,
    result_backend_transport_options=prefix,
    task_default_queue="shop",  # the shop's own choices, kept by install()
    worker_prefetch_multiplier=4,
)
merchant_tasks.install(app)


@app.task
def add(x, y):
    return x + y
'''

SHOP_CODE = """
import json, threading, proj
from merchant_tasks.tasks import call_api

total = proj.add.delay(2, 3)
payment = call_api.delay("POST", "/open-api/v1/payments", json={"amount": 700})
# as a web server's request thread would: Celery's current app there is not proj's
sent = []
request = threading.Thread(
    target=lambda: sent.append(call_api.delay("POST", "/open-api/v1/payments", json={"amount": 7})),
)
request.start()
request.join()
print(json.dumps([total.get(timeout=60), payment.get(timeout=60), sent[0].get(timeout=60)]))
"""


@pytest.fixture
def proj_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "proj"
    directory.mkdir()
    (directory / "proj.py").write_text(PROJ, encoding="utf-8")
    return directory


@pytest.fixture
def proj_env(merchant_settings: Settings, merchant_key_prefix: str) -> dict[str, str]:
    env = child_env(merchant_settings)
    env.update(
        PROJ_REDIS_URL=merchant_settings.fleet.redis_url,
        PROJ_KEY_PREFIX=f"{merchant_key_prefix}:proj:",
        MERCHANT_RENEW_INTERVAL="1",  # beat's check every second
    )
    return env


def celery(proj_dir: Path, env: dict[str, str], name: str, *args: str) -> Child:
    argv = [sys.executable, "-m", "celery", "-A", "proj", *args, "--loglevel=INFO"]
    return spawn(name, argv, proj_dir / f"{name}.log", env=env, cwd=proj_dir)


@pytest.fixture
def proj_worker(proj_dir: Path, proj_env: dict[str, str]) -> Iterator[Child]:
    options = ["--pool=prefork", "--concurrency=2", "--without-gossip", "--without-mingle"]
    worker = celery(proj_dir, proj_env, "worker", "worker", *options)
    probe = Celery("probe", broker=proj_env["PROJ_REDIS_URL"], set_as_current=False)
    prefix = {"global_keyprefix": proj_env["PROJ_KEY_PREFIX"]}
    probe.conf.broker_transport_options = prefix
    try:
        worker.wait_ready(lambda: bool(probe.control.ping(timeout=0.5)), timeout=START_TIMEOUT)
        yield worker
    finally:
        worker.stop()
        probe.close()


def test_the_shops_worker_and_beat_serve_its_task_call_api_and_the_renewal(
    proj_dir: Path,
    proj_env: dict[str, str],
    proj_worker: Child,
    merchant_sandbox: MerchantSandbox,
) -> None:
    beat = celery(proj_dir, proj_env, "beat", "beat", "-s", str(proj_dir / "beat-schedule"))
    try:
        # beat's check finds the account without a token and the renewal task exchanges
        wait_until(
            lambda: merchant_sandbox.app.counters()["exchanges"]["ok"] >= 1,
            "a renewal sent by the shop's beat",
            timeout=START_TIMEOUT,
        )
    finally:
        beat.stop()
    log = proj_worker.log_text()
    assert "Task merchant_tasks.renew_token[" in log
    assert "Task merchant_tasks.renew_account[" in log
    exchanges = merchant_sandbox.app.counters()["exchanges"]["ok"]

    done = run_python("-c", SHOP_CODE, cwd=proj_dir, env=proj_env, timeout=RESULT_TIMEOUT * 2)
    assert done.returncode == 0, done.stderr
    total, payment, from_a_thread = json.loads(done.stdout)
    assert total == 5
    assert (payment["amount"], payment["status"]) == (700, "created")
    assert (from_a_thread["amount"], from_a_thread["status"]) == (7, "created")
    counters = merchant_sandbox.app.counters()
    assert counters["endpoints"]["POST /open-api/v1/payments"]["ok"] == 2
    assert counters["exchanges"]["ok"] == exchanges  # the call used beat's token
    # the shop's settings are its own: the one that weakens a guarantee is named at start
    assert "merchant-tasks: result_backend_always_retry is off" in proj_worker.log_text()
