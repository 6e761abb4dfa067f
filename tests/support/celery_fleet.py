"""Real Celery workers and beat as child processes: the harness of the Celery tests.

``Fleet`` starts workers (any pool) and beat with ``python -m celery -A merchant_tasks`` in
their own sessions, with DEBUG logs in the test's tmp_path, against the test's own Redis
and the sandbox emulator; it enqueues through a separate Celery app configured like the
workers, so the test process never imports ``merchant_tasks.tasks``. ``running_fleet``
gives each test a redis-server of its own and kills every process group on exit (a test that
reads the logs of a warm shutdown calls ``stop()`` first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

import pytest
import redis
from celery import Celery
from celery.utils.nodenames import host_format

from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import Child, RedisServer, spawn, stop_all, wait_until
from merchant_tasks.settings import FleetSettings, Secret, Settings, child_env
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.worker.app import celery_key_prefix, load_config
from support.paths import SUPPORT
from support.routes import PING

ECHO = "/open-api/v1/echo"
CALL_API = "merchant_tasks.call_api"

# Short windows (seconds): lifetime, advisory window, mandatory window, beat interval.
LIFETIME = 6.0
RENEW_BEFORE = 3.0
RENEW_MANDATORY = 1.0
RENEW_INTERVAL = 0.5
# Long windows, for tests in which no renewal may interfere.
LONG_LIFETIME = 600.0
LONG_RENEW_BEFORE = 300.0
LONG_RENEW_MANDATORY = 100.0
LONG_RENEW_INTERVAL = 60.0

READY_TIMEOUT = 60.0  # the first task's result: worker start-up on a busy machine
RESULT_TIMEOUT = 30.0
CALL_PERIOD = 0.125  # seconds between two enqueued calls while "calls flow"


class Fleet:
    """The Celery processes of one test, the client that feeds them, and what they touch."""

    def __init__(
        self,
        tmp_path: Path,
        sandbox: MerchantSandbox,
        redis_url: str,
        key_prefix: str,
        secret_file: Path,
    ) -> None:
        self.tmp_path = tmp_path
        self.sandbox = sandbox
        self.redis_url = redis_url
        self.key_prefix = key_prefix
        self.marker = f"mt-it-{uuid.uuid4().hex[:10]}"  # in every child's command line
        self.workdir = tmp_path / "run"  # the children's cwd: no celeryconfig.py here
        self.workdir.mkdir()
        self.children: list[Child] = []
        self.nodes: list[str] = []  # the node names of the workers started by start_worker
        self._app: Any = None
        self._sent: list[Any] = []  # every AsyncResult handed out, for _stop_waiting
        self._redis_clients: list[redis.Redis] = []
        self.settings = Settings(
            api_key=sandbox.api_key,
            secret=Secret(path=secret_file),
            base_url=sandbox.url,
            fleet=FleetSettings(redis_url=redis_url, key_prefix=key_prefix),
        )
        self.env = child_env(self.settings)
        self.app_module = "merchant_tasks"  # what the children's ``celery -A`` loads
        self.windows(LIFETIME, RENEW_BEFORE, RENEW_MANDATORY, RENEW_INTERVAL)

    def long_windows(self) -> None:
        """Windows so long that no renewal interferes with the test."""
        self.windows(LONG_LIFETIME, LONG_RENEW_BEFORE, LONG_RENEW_MANDATORY, LONG_RENEW_INTERVAL)

    def windows(self, lifetime: float, before: float, mandatory: float, interval: float) -> None:
        """Token lifetime (the emulator's too) and renewal windows, before any child starts."""
        assert not self.children, "set the windows before starting processes"
        self.settings = dataclasses.replace(
            self.settings,
            token_lifetime=lifetime,
            renew_before=before,
            renew_mandatory=mandatory,
            fleet=dataclasses.replace(self.settings.fleet, renew_interval=interval),
        )
        self.env.update(self.settings.to_env())
        self.sandbox.app.configure({"lifetime": lifetime})

    def load_app(self, module: str) -> None:
        """Children load the app of ``module`` (under tests/, put on their PYTHONPATH)
        instead of merchant-tasks' own, before any child starts."""
        assert not self.children, "choose the app before starting processes"
        self.app_module = module
        given = os.environ.get("PYTHONPATH", "")
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUPPORT.parent), given) if p)

    # -- children ------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], cwd: Path) -> Child:
        child = spawn(name, argv, self.tmp_path / f"{name}.log", env=self.env, cwd=cwd)
        self.children.append(child)
        return child

    def _celery(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "celery", "-A", self.app_module, *args]

    def start_worker(
        self, label: str, concurrency: int = 2, cwd: Path | None = None, pool: str = "prefork"
    ) -> Child:
        node = f"{self.marker}-{label}@%h"
        self.nodes.append(host_format(node))
        return self._spawn(
            f"worker-{label}",
            self._celery(
                "worker",
                f"--pool={pool}",
                f"--concurrency={concurrency}",
                "--without-gossip",
                "--without-mingle",
                "-n",
                node,
                "--loglevel=DEBUG",
            ),
            cwd or self.workdir,
        )

    def short_visibility_dir(self, seconds: int) -> Path:
        """A working directory whose celeryconfig.py makes the broker redeliver a message
        left unacknowledged for ``seconds``, sweeping for such messages every second."""
        config_dir = self.tmp_path / "short-visibility"
        config_dir.mkdir()
        (config_dir / "celeryconfig.py").write_text(
            "broker_transport_options = {\n"
            f"    'visibility_timeout': {seconds},\n"
            "    'unacked_restore_interval': 1,\n"
            "    'unacked_restore_throttle': 1,\n"
            # the sweep's mutex: a worker killed inside a sweep (every second here) holds it
            # for this long, and no worker restores anything meanwhile (kombu: 300 s)
            "    'unacked_mutex_expire': 10,\n"
            "}\n"
        )
        return config_dir

    def start_beat(self, label: str) -> Child:
        schedule = self.tmp_path / f"{self.marker}-{label}-schedule"
        return self._spawn(
            f"beat-{label}",
            self._celery("beat", "-s", str(schedule), "--loglevel=DEBUG"),
            self.workdir,
        )

    def start_monitor(self) -> Child:
        """``redis-cli monitor``: every command any process sends to the private Redis."""
        binary = shutil.which("redis-cli")
        if binary is None:
            pytest.fail("redis-cli is not on PATH")
        port = self.redis_url.rsplit(":", 1)[1].split("/")[0]
        return self._spawn("redis-monitor", [binary, "-p", port, "monitor"], self.workdir)

    def stop(self) -> None:
        """Stop every child, all at once, and close the client app."""
        stop_all(self.children)
        self.children.clear()
        self._stop_waiting()
        if self._app is not None:
            self._app.close()
            self._app = None

    def _stop_waiting(self) -> None:
        """Unsubscribe every result handed out from its channel while our Redis answers.

        An AsyncResult unsubscribes when it is collected, which may be in a later test, once
        this Redis is gone: Celery then retries the unsubscribe for about 20 s, inside that
        test, and raises from ``__del__`` (an error of that test under pytest).
        """
        for result in self._sent:
            result.backend.remove_pending_result(result)
        self._sent.clear()

    def leftovers(self) -> str:
        """Processes still running with this fleet's marker in their command line."""
        found = subprocess.run(
            ["pgrep", "-af", self.marker], capture_output=True, text=True, check=False
        )
        return found.stdout.strip()

    def logs(self) -> dict[str, str]:
        return {path.name: path.read_text(errors="replace") for path in self._log_paths()}

    def _log_paths(self) -> list[Path]:
        return sorted(self.tmp_path.glob("*.log"))

    def log_tails(self, lines: int = 25) -> str:
        parts = []
        for path in self._log_paths():
            if path.name == "redis-monitor.log":
                continue  # it holds the token key's writes: not for failure messages
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name} (last {lines} lines)\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- the test's side -----------------------------------------------------------------

    @property
    def app(self) -> Any:
        """A Celery app configured like the workers (package defaults, our Redis)."""
        if self._app is None:
            app = Celery("test-client")
            config = load_config(
                {
                    **self.env,
                    # whatever celeryconfig the test process may import, use the
                    # workers' broker: our Redis unless the test gave them another
                    "CELERY_BROKER_URL": self.env.get("CELERY_BROKER_URL", self.redis_url),
                    "CELERY_RESULT_BACKEND": self.env.get("CELERY_RESULT_BACKEND", self.redis_url),
                }
            )
            config["imports"] = ()  # the client never imports the tasks module
            app.conf.update(config)
            self._app = app
        return self._app

    def call(self, method: str, path: str, json: Any = None, **options: Any) -> Any:
        """Enqueue call_api; ``options`` are more of its keyword arguments, or ``task_id``."""
        task_id = options.pop("task_id", None)
        kwargs = {} if json is None else {"json": json}
        result = self.app.send_task(
            CALL_API, args=[method, path], kwargs={**kwargs, **options}, task_id=task_id
        )
        self._sent.append(result)
        return result

    def get(self, result: Any, timeout: float = RESULT_TIMEOUT) -> Any:
        try:
            return result.get(timeout=timeout)
        except Exception as exc:
            raise AssertionError(f"task {result.id} gave {exc!r}\n{self.log_tails()}") from exc

    def wait_ready(self) -> None:
        """The first call's result: the worker is up, consuming and reaching the emulator."""
        assert self.get(self.call("GET", PING), READY_TIMEOUT) == {"ok": True}

    def wait_for_nodes(self, count: int) -> None:
        def answering() -> bool:
            # by name, as in running_on: answered as soon as they all reply
            replies = self.app.control.ping(self.nodes or None, timeout=0.5) or []
            return len(replies) >= count

        wait_until(answering, f"{count} workers answering a ping", READY_TIMEOUT)

    def broker_key(self, name: str) -> str:
        """The Redis key of Celery's ``name`` (a queue, ``unacked``) for this fleet's workers:
        under its key prefix (``worker.app.celery_key_prefix``)."""
        return celery_key_prefix(self.key_prefix) + name

    def store(self) -> TokenStore:
        client = redis.Redis.from_url(self.redis_url)
        self._redis_clients.append(client)
        return TokenStore(
            client, TokenStore.namespace_for(self.key_prefix, "sandbox", self.sandbox.api_key)
        )

    def close(self) -> None:
        self.stop()
        for client in self._redis_clients:
            client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # The test is over: nobody reads the logs any more, and a warm shutdown would only
        # make it wait (about a second per prefork worker, billiard joining its pool's
        # threads). A test that reads logs or needs the shutdown calls stop() or close().
        for child in self.children:
            child.kill()
        self.children.clear()
        self.close()

    def send_calls_for(self, seconds: float) -> list[Any]:
        """Enqueue a ping or an echo every CALL_PERIOD for ``seconds``; return the results."""
        deadline = time.monotonic() + seconds
        return self.send_calls_until(lambda: time.monotonic() >= deadline, "the span", seconds + 1)

    def send_calls_until(self, done: Callable[[], bool], what: str, timeout: float) -> list[Any]:
        """Enqueue a ping or an echo every CALL_PERIOD until ``done`` holds; the results.

        TimeoutError naming ``what`` if it does not hold within ``timeout`` s.
        """
        results: list[Any] = []
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:g} s")
            n = len(results)
            if n % 2:
                results.append(self.call("POST", ECHO, json={"n": n}))
            else:
                results.append(self.call("GET", PING))
            time.sleep(CALL_PERIOD)
        return results

    def expect_all_ok(self, results: list[Any]) -> None:
        answers = [self.get(r) for r in results]
        for n, answer in enumerate(answers):
            assert answer == ({"echo": {"n": n}} if n % 2 else {"ok": True})


def running_on(fleet: Fleet, result: Any, timeout: float = RESULT_TIMEOUT) -> tuple[str, int]:
    """The node name and pool process id executing the task, asked over the broker."""
    task_id = result.id
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not result.ready():
        # asked of the fleet's nodes by name, the answer comes as soon as they have all
        # replied, not when the timeout ends
        active = fleet.app.control.inspect(fleet.nodes or None, timeout=0.5).active() or {}
        for node, tasks in active.items():
            for task in tasks:
                if task["id"] == task_id:
                    return str(node), int(task["worker_pid"])
        time.sleep(0.05)
    raise AssertionError(f"task {task_id} was not seen running\n{fleet.log_tails()}")


def echo_calls(sandbox: MerchantSandbox) -> int:
    """Times the emulator answered POST /echo, whatever the outcome."""
    counts = sandbox.app.counters()["endpoints"].get(f"POST {ECHO}", {})
    return sum(counts.values())


def kill_the_worker_running(fleet: Fleet, workers: dict[str, Child], result: Any) -> str:
    """SIGKILL the worker (and its pool child, at once) whose call ``result`` reached the
    API; returns the label of the survivor among ``workers`` (two of them)."""
    node, _ = running_on(fleet, result)
    wait_until(lambda: fleet.sandbox.app.arrived(ECHO) == 1, "the call reaching the API", 20.0)
    label = node.split("@")[0].rsplit("-", 1)[1]
    workers[label].kill()
    return next(other for other in workers if other != label)


@contextlib.contextmanager
def running_fleet(
    tmp_path: Path, sandbox: MerchantSandbox, key_prefix: str, secret_file: Path
) -> Iterator[Fleet]:
    """A Fleet on a redis-server of its own (broker, result backend and token store), every
    process group stopped and checked gone on exit."""
    with RedisServer(tmp_path / "redis") as server:
        with Fleet(tmp_path, sandbox, server.url, key_prefix, secret_file) as fleet:
            yield fleet
        # killed groups vanish at once; allow a moment for the process table to catch up
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not fleet.leftovers(), "children gone", 5.0)
        assert not fleet.leftovers(), "processes left behind"
