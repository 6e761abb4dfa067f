"""pytest fixtures for applications that use merchant-tasks (loaded through ``pytest11``).

Installed with the package; the fixtures run the real parts on loopback, each test with
its own emulator account, API key and Redis key prefix, so no test sees another's token,
queue or result and there is nothing to reset between tests:

- ``merchant_sandbox``: the emulator on a free port, with a fresh API key and secret;
  ``merchant_sandbox.app`` counts calls and exchanges, revokes tokens, resets the secret.
  It is built from ``merchant_sandbox_config`` (the ``SandboxConfig``),
  ``merchant_sandbox_app`` (the ``SandboxApp``) and ``merchant_secret_file``: override any
  of them (a fixture of the same name, which may take the plugin's as an argument) to
  change how the emulator behaves, serve a subclass, or fix the key and secret.
- ``merchant_settings``: the validated ``Settings`` of that account (Redis, key prefix).
- ``merchant_env``: the same as MERCHANT_* variables in ``os.environ`` for the test only
  (any other MERCHANT_* or CELERY_* variable is hidden), for code that reads the
  environment (``client_from_env()``, ``call_api``).
- ``merchant_client``: a ``MerchantClient`` for that account.
- ``merchant_celery_eager``: ``call_api.delay(...)`` runs in the test's process at once
  (Celery's ``task_always_eager``), through the test's account: for unit tests.
- ``merchant_worker``: a real ``celery -A merchant_tasks worker`` process for the test,
  whose broker and result keys carry the test's prefix; ``merchant_worker.call(...)``
  enqueues ``call_api`` and returns its ``AsyncResult``: for integration tests.

Redis: ``MERCHANT_TEST_REDIS_URL`` if set, else 127.0.0.1:6379 if it answers, else a
private ``redis-server`` started for the session. The emulator needs the ``sandbox`` extra.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from merchant_tasks.settings import (
    PREFIX,
    FleetSettings,
    Secret,
    Settings,
    child_env,
    environment,
    read_variable,
)

if TYPE_CHECKING:
    from merchant_tasks.accounts import FleetClient
    from merchant_tasks.sandbox.emulator import SandboxApp, SandboxConfig, SandboxServer

LOCAL_REDIS = ("127.0.0.1", 6379)
WORKER_START_TIMEOUT = 60.0  # seconds for a worker to answer a ping on a busy machine


@dataclass
class MerchantSandbox:
    """A running emulator and the account it serves."""

    app: SandboxApp
    server: SandboxServer
    api_key: str
    secret_file: Path

    @property
    def url(self) -> str:
        return self.server.url

    def exchanges(self) -> dict[str, int]:
        """Token exchanges by outcome (``ok``, ``invalid_client``, ...) since the last reset."""
        counts: dict[str, int] = self.app.counters()["exchanges"]
        return counts

    def calls(self) -> dict[str, int]:
        """Business calls by outcome (``ok``, ``token_revoked``, ...) since the last reset."""
        counts: dict[str, int] = self.app.counters()["calls"]
        return counts


@dataclass
class MerchantWorker:
    """A real Celery worker of the test and an app configured to send to it."""

    app: Any  # celery.Celery
    process: subprocess.Popen[bytes]
    log: Path

    def call(self, method: str, path: str, json: Any = None, account: str | None = None) -> Any:
        """Enqueue ``call_api`` for this test's worker; the ``AsyncResult``."""
        kwargs: dict[str, Any] = {"json": json}
        if account is not None:
            kwargs["account"] = account
        return self.app.send_task("merchant_tasks.call_api", args=[method, path], kwargs=kwargs)


@pytest.fixture(scope="session")
def merchant_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The Redis the tests use (see the module docstring)."""
    from merchant_tasks.sandbox.processes import RedisServer, redis_answers

    configured = read_variable("MERCHANT_TEST_REDIS_URL")
    if configured:
        yield configured
    elif redis_answers(LOCAL_REDIS[1]):
        yield f"redis://{LOCAL_REDIS[0]}:{LOCAL_REDIS[1]}/0"
    else:
        with RedisServer(tmp_path_factory.mktemp("merchant-redis")) as server:
            yield server.url


@pytest.fixture
def merchant_key_prefix(merchant_redis_url: str) -> Iterator[str]:
    """A Redis key prefix of this test alone; its keys are deleted afterwards."""
    from merchant_tasks.store.topology import redis_from_url

    prefix = f"mt-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis_from_url(merchant_redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def merchant_sandbox_config() -> SandboxConfig:
    """How the test's emulator behaves: an API key and secret of this test, the defaults
    otherwise."""
    from merchant_tasks.extras import require

    require("sandbox", "the merchant_sandbox fixture")
    from merchant_tasks.sandbox.emulator import SandboxConfig

    return SandboxConfig(api_key=f"test-{uuid.uuid4().hex[:10]}", secret=secrets.token_urlsafe(24))


@pytest.fixture
def merchant_sandbox_app(merchant_sandbox_config: SandboxConfig) -> SandboxApp:
    """The emulator's WSGI application, not yet serving."""
    from merchant_tasks.sandbox.emulator import SandboxApp

    return SandboxApp(merchant_sandbox_config)


@pytest.fixture
def merchant_secret_file(merchant_sandbox_config: SandboxConfig, tmp_path: Path) -> Path:
    """The account's secret in a file only its owner reads, as in production."""
    path = tmp_path / "merchant-api-secret"
    path.write_text(merchant_sandbox_config.secret, encoding="utf-8")
    path.chmod(0o600)
    return path


@pytest.fixture
def merchant_sandbox(
    merchant_sandbox_app: SandboxApp, merchant_secret_file: Path
) -> Iterator[MerchantSandbox]:
    """The emulator on a free loopback port, serving the test's account."""
    from merchant_tasks.sandbox.emulator import SandboxServer

    with SandboxServer(merchant_sandbox_app) as server:
        api_key = merchant_sandbox_app.config.api_key
        yield MerchantSandbox(merchant_sandbox_app, server, api_key, merchant_secret_file)


@pytest.fixture
def merchant_settings(
    merchant_sandbox: MerchantSandbox, merchant_redis_url: str, merchant_key_prefix: str
) -> Settings:
    """Settings of the test's emulator account, its Redis and key prefix."""
    return Settings(
        api_key=merchant_sandbox.api_key,
        secret=Secret(path=merchant_sandbox.secret_file),
        base_url=merchant_sandbox.url,
        fleet=FleetSettings(redis_url=merchant_redis_url, key_prefix=merchant_key_prefix),
    )


@pytest.fixture
def merchant_env(merchant_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The test's settings as MERCHANT_* variables, for this test only."""
    for name in list(environment()):
        if name.startswith((PREFIX, "CELERY_")):
            monkeypatch.delenv(name)
    env = merchant_settings.to_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def merchant_client(merchant_settings: Settings) -> Iterator[FleetClient]:
    """A client of the test's account."""
    from merchant_tasks.accounts import client_for, close_client

    client = client_for(merchant_settings)
    yield client
    close_client(client)


@pytest.fixture
def merchant_celery_eager(
    merchant_settings: Settings, merchant_env: dict[str, str]
) -> Iterator[Any]:
    """The Celery app ``call_api`` sends through (yours if install() ran on it, else the
    package's), running tasks in the test's process at once, as the
    test's account."""
    from merchant_tasks.accounts import DEFAULT_ACCOUNT, AccountClients
    from merchant_tasks.tasks import installed_task
    from merchant_tasks.worker import task_bodies

    app = installed_task(task_bodies.CALL_API).app

    saved = {name: app.conf[name] for name in ("task_always_eager", "task_eager_propagates")}
    app.conf.update(task_always_eager=True, task_eager_propagates=True)
    task_bodies.use_clients(AccountClients({DEFAULT_ACCOUNT: merchant_settings}))
    try:
        yield app
    finally:
        task_bodies.use_clients(None)
        app.conf.update(saved)


def worker_env(settings: Settings) -> dict[str, str]:
    """The test worker's environment: the account's variables, and this process's import
    path (a Django project's ``DJANGO_SETTINGS_MODULE`` names a package that pytest found
    from the project's root, not from the worker's directory)."""
    env = child_env(settings)
    path = [entry or os.getcwd() for entry in sys.path]
    given = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([*path, given] if given else path)
    return env


@pytest.fixture
def merchant_worker(
    merchant_settings: Settings, merchant_key_prefix: str, tmp_path: Path
) -> Iterator[MerchantWorker]:
    """A real worker process of this test (prefork, two processes) and an app to reach it."""
    from celery import Celery
    from celery.utils.nodenames import host_format

    from merchant_tasks.sandbox.processes import spawn
    from merchant_tasks.worker.app import isolated_config, load_config, write_config_module

    workdir = tmp_path / "merchant-worker"
    workdir.mkdir()
    config = isolated_config(merchant_settings.fleet.redis_url, merchant_key_prefix)
    write_config_module(workdir / "celeryconfig.py", config)
    node = f"{merchant_key_prefix}@%h"
    log = tmp_path / "merchant-worker.log"
    argv = [sys.executable, "-m", "celery", "-A", "merchant_tasks", "worker", "-n", node]
    argv += ["--pool=prefork", "--concurrency=2", "--without-gossip", "--without-mingle"]
    worker = spawn(
        "the test's Celery worker",
        [*argv, "--loglevel=INFO"],
        log,
        env=worker_env(merchant_settings),
        cwd=workdir,
    )
    app = Celery("merchant-tasks-test-client", set_as_current=False)
    app.conf.update({**load_config(merchant_settings.to_env()), **config, "imports": ()})
    try:
        # a ping of this node alone returns as soon as it answers, not after its timeout
        node_only = [host_format(node)]
        worker.wait_ready(
            lambda: bool(app.control.ping(node_only, timeout=0.5)), timeout=WORKER_START_TIMEOUT
        )
        yield MerchantWorker(app, worker.process, log)
    finally:
        worker.stop()
        app.close()
