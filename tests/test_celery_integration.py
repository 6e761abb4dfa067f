"""Real Celery workers and beat against a private Redis and the sandbox emulator.

Every test starts its own ``redis-server`` (broker, result backend and token store), so no
queue, result or token carries over from one test to the next. Workers and beat run as
child processes (``python -m celery -A merchant_tasks worker|beat``) in their own sessions,
with DEBUG logs written to files in the test's tmp_path; every process group is stopped at
teardown and checked gone. The test process enqueues with a separate Celery app configured
like the workers; it never imports ``merchant_tasks.tasks`` and never runs a task eagerly.
"""

from __future__ import annotations

import base64
import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from conftest import TEST_API_KEY, TEST_SECRET, Sandbox, redis_value, shows
from merchant_tasks.celery_app import load_config
from merchant_tasks.exceptions import ApiError, CredentialsRejected
from merchant_tasks.local import RedisServer, stop_group, wait_until
from merchant_tasks.store import TokenStore

pytestmark = pytest.mark.integration

PING = "/open-api/v1/ping"
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
API_LATENCY = 6.0  # the emulator's delay on business calls in the worker-loss tests
KILL_VISIBILITY_TIMEOUT = 10  # seconds; above API_LATENCY, so a re-run is not re-delivered


# -- processes -----------------------------------------------------------------------------


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[str]:
    """A redis-server of this test's own: broker, result backend and token store."""
    with RedisServer(tmp_path / "redis") as server:
        yield server.url


@dataclass
class Child:
    """A worker, beat or monitor process and its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


class Fleet:
    """The Celery processes of one test, the client that feeds them, and what they touch."""

    def __init__(
        self,
        tmp_path: Path,
        sandbox: Sandbox,
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
        self._app: Any = None
        self._redis_clients: list[redis.Redis] = []
        env = {
            **os.environ,
            "MERCHANT_ENVIRONMENT": "sandbox",
            "MERCHANT_API_KEY": TEST_API_KEY,
            "MERCHANT_API_SECRET_FILE": str(secret_file),
            "MERCHANT_BASE_URL": sandbox.url,
            "MERCHANT_REDIS_URL": redis_url,
            "MERCHANT_KEY_PREFIX": key_prefix,
        }
        for name in ("MERCHANT_API_SECRET", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
            env.pop(name, None)
        self.env = env
        self.windows(LIFETIME, RENEW_BEFORE, RENEW_MANDATORY, RENEW_INTERVAL)

    def windows(self, lifetime: float, before: float, mandatory: float, interval: float) -> None:
        """Token lifetime (the emulator's too) and renewal windows, before any child starts."""
        assert not self.children, "set the windows before starting processes"
        self.env.update(
            {
                "MERCHANT_TOKEN_LIFETIME": f"{lifetime:g}",
                "MERCHANT_RENEW_BEFORE": f"{before:g}",
                "MERCHANT_RENEW_MANDATORY": f"{mandatory:g}",
                "MERCHANT_RENEW_INTERVAL": f"{interval:g}",
            }
        )
        self.sandbox.app.configure({"lifetime": lifetime})

    # -- children ------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], cwd: Path) -> Child:
        log = self.tmp_path / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                argv,
                env=self.env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        child = Child(name, process, log)
        self.children.append(child)
        return child

    def _celery(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "celery", "-A", "merchant_tasks", *args]

    def start_worker(self, label: str, concurrency: int = 2, cwd: Path | None = None) -> Child:
        return self._spawn(
            f"worker-{label}",
            self._celery(
                "worker",
                "--pool=prefork",
                f"--concurrency={concurrency}",
                "--without-gossip",
                "--without-mingle",
                "-n",
                f"{self.marker}-{label}@%h",
                "--loglevel=DEBUG",
            ),
            cwd or self.workdir,
        )

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
        """Stop every child, the last started first, and close the client app."""
        while self.children:
            stop_group(self.children.pop().process)
        if self._app is not None:
            self._app.close()
            self._app = None

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
                    # whatever celeryconfig the test process may import, use our Redis
                    "CELERY_BROKER_URL": self.redis_url,
                    "CELERY_RESULT_BACKEND": self.redis_url,
                }
            )
            config["imports"] = ()  # the client never imports the tasks module
            app.conf.update(config)
            self._app = app
        return self._app

    def call(self, method: str, path: str, json: Any = None) -> Any:
        kwargs = {} if json is None else {"json": json}
        return self.app.send_task(CALL_API, args=[method, path], kwargs=kwargs)

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
            replies = self.app.control.ping(timeout=0.5) or []
            return len(replies) >= count

        wait_until(answering, f"{count} workers answering a ping", READY_TIMEOUT)

    def store(self) -> TokenStore:
        client = redis.Redis.from_url(self.redis_url)
        self._redis_clients.append(client)
        return TokenStore(
            client, TokenStore.namespace_for(self.key_prefix, "sandbox", TEST_API_KEY)
        )

    def close(self) -> None:
        self.stop()
        for client in self._redis_clients:
            client.close()

    def send_calls_for(self, seconds: float) -> list[Any]:
        """Enqueue a ping or an echo every CALL_PERIOD for ``seconds``; return the results."""
        results = []
        deadline = time.monotonic() + seconds
        n = 0
        while time.monotonic() < deadline:
            if n % 2:
                results.append(self.call("POST", ECHO, json={"n": n}))
            else:
                results.append(self.call("GET", PING))
            n += 1
            time.sleep(CALL_PERIOD)
        return results

    def expect_all_ok(self, results: list[Any]) -> None:
        answers = [self.get(r) for r in results]
        for n, answer in enumerate(answers):
            assert answer == ({"echo": {"n": n}} if n % 2 else {"ok": True})


@pytest.fixture
def fleet(
    tmp_path: Path,
    sandbox: Sandbox,
    private_redis: str,
    key_prefix: str,
    secret_file: Path,
) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path, sandbox, private_redis, key_prefix, secret_file)
    try:
        yield fleet
    finally:
        fleet.close()
    # killed groups vanish at once; allow a moment for the process table to catch up
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not fleet.leftovers(), "children gone", 5.0)
    assert not fleet.leftovers(), "processes left behind"


def _settled_exchanges(fleet: Fleet, sandbox: Sandbox) -> tuple[int, dict[str, int]]:
    """Tokens the emulator issued and the store's counters, read while no renewal is between
    the two (the emulator counts a renewal first, the worker's store after): beat goes on
    renewing while a test reads them."""
    store = fleet.store()
    seen: list[tuple[int, dict[str, int]]] = []

    def settled() -> bool:
        before = store.counters()
        issued = sandbox.exchanges()["ok"]
        after = store.counters()
        recorded = sum(
            v for k, v in after.items() if k.startswith("exchanges:") and k.endswith(":ok")
        )
        seen.append((issued, after))
        return before == after and recorded == issued

    wait_until(settled, "the emulator's and the store's exchange counts to agree", 10.0)
    return seen[-1]


def _echo_calls(sandbox: Sandbox) -> int:
    """Times the emulator answered POST /echo, whatever the outcome."""
    counts = sandbox.app.counters()["endpoints"].get(f"POST {ECHO}", {})
    return sum(counts.values())


# -- 1. plain calls ------------------------------------------------------------------------


def test_call_api_through_a_real_worker_returns_the_decoded_json_body(
    fleet: Fleet, sandbox: Sandbox
) -> None:
    fleet.windows(LONG_LIFETIME, LONG_RENEW_BEFORE, LONG_RENEW_MANDATORY, LONG_RENEW_INTERVAL)
    fleet.start_worker("w", concurrency=1)
    fleet.wait_ready()

    body = {"amount": 1250, "currency": "EUR", "items": [{"sku": "a-1", "qty": 2}], "x": None}
    assert fleet.get(fleet.call("GET", PING)) == {"ok": True}
    assert fleet.get(fleet.call("POST", ECHO, json=body)) == {"echo": body}
    assert sandbox.exchanges()["ok"] == 1
    assert sandbox.calls()["ok"] == 3


# -- 2. beat renews in the advisory window -------------------------------------------------


def test_beat_renews_in_the_advisory_window_while_calls_flow_without_a_401(
    fleet: Fleet, sandbox: Sandbox
) -> None:
    # an advisory window of 4 s: 8 beat ticks, so a stalled tick or two changes nothing
    lifetime, before, mandatory = 8.0, 5.0, 1.0
    fleet.windows(lifetime, before, mandatory, RENEW_INTERVAL)
    fleet.start_worker("w", concurrency=2)
    fleet.start_beat("b")
    fleet.wait_ready()
    # the first token may come from that call, if it ran before beat's first tick
    first_mandatory = fleet.store().counters().get("exchanges:mandatory:ok", 0)

    results = fleet.send_calls_for(2 * lifetime)
    fleet.expect_all_ok(results)

    _, counters = _settled_exchanges(fleet, sandbox)
    assert counters.get("exchanges:scheduled:ok", 0) >= 2, counters
    assert counters.get("exchanges:mandatory:ok", 0) == first_mandatory, counters
    assert counters.get("exchanges:forced:ok", 0) == 0, counters
    assert sandbox.calls()["unauthorized"] == 0


# -- 3. revoke-all storm -------------------------------------------------------------------


def test_a_revoke_all_storm_through_tasks_costs_exactly_one_exchange(
    fleet: Fleet, sandbox: Sandbox
) -> None:
    fleet.windows(LONG_LIFETIME, LONG_RENEW_BEFORE, LONG_RENEW_MANDATORY, LONG_RENEW_INTERVAL)
    fleet.start_worker("w", concurrency=4)
    fleet.wait_ready()
    before = sandbox.exchanges()["ok"]

    sandbox.app.revoke_all()
    results = [fleet.call("GET", PING) for _ in range(40)]

    assert [fleet.get(r) for r in results] == [{"ok": True}] * 40
    assert sandbox.exchanges()["ok"] == before + 1
    assert sandbox.calls()["unauthorized"] >= 1  # the storm did meet the revoked token
    assert fleet.store().counters().get("exchanges:forced:ok", 0) == 1


# -- 4. two beats --------------------------------------------------------------------------


def test_two_beats_at_once_do_not_double_the_token_exchanges(
    fleet: Fleet, sandbox: Sandbox
) -> None:
    started = time.monotonic()
    fleet.start_worker("w", concurrency=2)
    fleet.start_beat("b1")
    fleet.start_beat("b2")
    wait_until(lambda: sandbox.exchanges()["ok"] >= 1, "a first scheduled renewal", 60.0)

    time.sleep(2 * LIFETIME)  # beat renews every LIFETIME - RENEW_BEFORE = 3 s
    exchanges, counters = _settled_exchanges(fleet, sandbox)
    run = time.monotonic() - started  # every exchange counted happened inside this span

    # consecutive renewals are at least lifetime - renew_before apart, whoever asks
    assert exchanges <= math.ceil(run / (LIFETIME - RENEW_BEFORE)) + 1, (exchanges, run)
    assert exchanges >= 2
    assert counters.get("exchanges:scheduled:ok", 0) == exchanges, counters
    assert sandbox.exchanges()["rejected"] == 0


# -- 4b. several accounts: one renewal task each --------------------------------------------


def test_beat_renews_each_account_in_its_own_task_and_a_failing_account_delays_no_other(
    fleet: Fleet, sandbox: Sandbox, tmp_path: Path, secret_file: Path
) -> None:
    refused_key = "a-key-the-api-does-not-know"
    accounts_file = tmp_path / "accounts.toml"
    accounts_file.write_text(
        f'[accounts.refused]\napi_key = "{refused_key}"\n'
        f'api_secret_file = "{secret_file}"\nbase_url = "{sandbox.url}"\n'
    )
    fleet.env["MERCHANT_ACCOUNTS_FILE"] = str(accounts_file)  # beside "default"
    fleet.start_worker("w", concurrency=2)
    fleet.start_beat("b")
    default = fleet.store()
    wait_until(lambda: default.generation() >= 3, "two scheduled renewals of 'default'", 60.0)

    worker_log = fleet.logs()["worker-w.log"]
    assert "merchant_tasks.renew_account" in worker_log
    assert "scheduled token renewal of account refused failed" in worker_log
    refused = TokenStore(
        default.redis,
        TokenStore.namespace_for(fleet.key_prefix, "sandbox", refused_key),
    )
    assert refused.generation() == 0
    assert refused.counters().get("exchanges:scheduled:rejected", 0) >= 1
    counters = default.counters()
    assert counters.get("exchanges:scheduled:ok", 0) >= 2, counters
    assert counters.get("exchanges:mandatory:ok", 0) == 0, counters


# -- 5. beat down --------------------------------------------------------------------------


def test_with_beat_down_workers_renew_in_the_mandatory_window(
    fleet: Fleet, sandbox: Sandbox
) -> None:
    started = time.monotonic()
    fleet.start_worker("w", concurrency=2)
    fleet.wait_ready()

    results = fleet.send_calls_for(2 * LIFETIME)
    fleet.expect_all_ok(results)
    exchanges = sandbox.exchanges()["ok"]
    run = time.monotonic() - started

    counters = fleet.store().counters()
    assert counters.get("exchanges:mandatory:ok", 0) >= 2, counters
    assert counters.get("exchanges:mandatory:ok", 0) == exchanges, counters
    assert exchanges <= math.ceil(run / (LIFETIME - RENEW_MANDATORY)) + 1, (exchanges, run)
    assert sandbox.calls()["unauthorized"] == 0


# -- 6. worker loss ------------------------------------------------------------------------


def _running_on(fleet: Fleet, result: Any, timeout: float = RESULT_TIMEOUT) -> tuple[str, int]:
    """The node name and pool process id executing the task, asked over the broker."""
    task_id = result.id
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not result.ready():
        active = fleet.app.control.inspect(timeout=0.5).active() or {}
        for node, tasks in active.items():
            for task in tasks:
                if task["id"] == task_id:
                    return str(node), int(task["worker_pid"])
        time.sleep(0.05)
    raise AssertionError(f"task {task_id} was not seen running\n{fleet.log_tails()}")


def test_a_worker_killed_mid_task_has_its_call_rerun_by_another_worker(
    fleet: Fleet, sandbox: Sandbox
) -> None:
    fleet.windows(LONG_LIFETIME, LONG_RENEW_BEFORE, LONG_RENEW_MANDATORY, LONG_RENEW_INTERVAL)
    config_dir = fleet.tmp_path / "short-visibility"
    config_dir.mkdir()
    (config_dir / "celeryconfig.py").write_text(
        "broker_transport_options = {\n"
        f"    'visibility_timeout': {KILL_VISIBILITY_TIMEOUT},\n"
        "    'unacked_restore_interval': 1,  # sweep for abandoned messages every second\n"
        "    'unacked_restore_throttle': 1,\n"
        "}\n"
    )
    workers = {
        label: fleet.start_worker(label, concurrency=1, cwd=config_dir) for label in ("a", "b")
    }
    fleet.wait_ready()
    fleet.wait_for_nodes(2)  # both workers consume (and answer remote control)
    sandbox.app.configure({"api_latency": API_LATENCY})

    result = fleet.call("POST", ECHO, json={"order": "kill-me"})
    node, _ = _running_on(fleet, result)
    wait_until(lambda: sandbox.app.arrived(ECHO) == 1, "the call reaching the API", 20.0)
    label = node.split("@")[0].rsplit("-", 1)[1]
    victim = workers[label]
    os.killpg(victim.process.pid, signal.SIGKILL)  # the worker and its pool child, at once
    victim.process.wait()

    assert fleet.get(result, 60.0) == {"echo": {"order": "kill-me"}}
    survivor = workers["b" if label == "a" else "a"]
    assert result.id in survivor.log_text()
    assert _echo_calls(sandbox) == 2  # received by the killed worker's child, then again


def test_a_pool_child_killed_mid_task_has_its_call_requeued_at_once(
    fleet: Fleet, sandbox: Sandbox
) -> None:
    # package defaults: the visibility timeout is an hour, so only the requeue can save it
    fleet.windows(LONG_LIFETIME, LONG_RENEW_BEFORE, LONG_RENEW_MANDATORY, LONG_RENEW_INTERVAL)
    worker = fleet.start_worker("w", concurrency=1)
    fleet.wait_ready()
    sandbox.app.configure({"api_latency": API_LATENCY})

    result = fleet.call("POST", ECHO, json={"order": "kill-my-child"})
    _, child_pid = _running_on(fleet, result)
    assert child_pid != worker.process.pid
    wait_until(lambda: sandbox.app.arrived(ECHO) == 1, "the call reaching the API", 20.0)
    os.kill(child_pid, signal.SIGKILL)

    assert fleet.get(result, 60.0) == {"echo": {"order": "kill-my-child"}}
    assert worker.process.poll() is None  # the worker itself lived on
    assert _echo_calls(sandbox) == 2


# -- 7. no secret, no token outside the token key -------------------------------------------


def test_the_secret_and_tokens_appear_nowhere_in_broker_results_or_logs(
    fleet: Fleet, sandbox: Sandbox, key_prefix: str
) -> None:
    fleet.env["MERCHANT_REJECTED_RETRY_WINDOW"] = "0"  # fail at once, no slow retries
    monitor = fleet.start_monitor()  # first, so it sees every command of the run
    fleet.start_worker("w", concurrency=2)
    fleet.start_beat("b")
    fleet.wait_ready()
    store = fleet.store()
    results = []

    canary = f"canary-{uuid.uuid4().hex}"  # must be found: the search sees what tasks carry
    ok = [fleet.call("GET", PING) for _ in range(4)]
    ok += [fleet.call("POST", ECHO, json={"n": n, "note": canary}) for n in range(4)]
    assert [fleet.get(r) for r in ok] == [{"ok": True}] * 4 + [
        {"echo": {"n": n, "note": canary}} for n in range(4)
    ]
    results += ok

    # every worker process meets a 401 and recovers; a scheduled renewal landing between the
    # revoke-all and the first call would spare them the 401, so try again if one did
    for _ in range(3):
        sandbox.app.revoke_all()
        recovered = [fleet.call("GET", PING) for _ in range(8)]
        assert [fleet.get(r) for r in recovered] == [{"ok": True}] * 8
        results += recovered
        if sandbox.calls()["unauthorized"] >= 1:
            break
    assert sandbox.calls()["unauthorized"] >= 1
    assert store.counters().get("exchanges:forced:ok", 0) >= 1

    missing = fleet.call("GET", "/open-api/v1/payments/pay_does_not_exist")
    assert isinstance(missing.get(timeout=RESULT_TIMEOUT, propagate=False), ApiError)
    assert "404" in str(missing.result)
    results.append(missing)

    # a token renewed after a 401 that gets 401 again means TokenRejected; wait until beat
    # has replaced the forced token so the reset secret shows as rejected credentials
    def renewed_by_beat() -> bool:
        token = store.load()
        return token is not None and token.reason == "scheduled"

    wait_until(renewed_by_beat, "a scheduled renewal after the storm", 3 * LIFETIME)
    new_secret = sandbox.app.reset_secret()
    refused = fleet.call("GET", PING)
    outcome = refused.get(timeout=RESULT_TIMEOUT, propagate=False)
    assert isinstance(outcome, CredentialsRejected), repr(outcome)
    results.append(refused)

    texts: dict[str, bytes] = {}
    for result in results:
        texts[f"result {result.id}"] = "\n".join(
            [result.state, repr(result.result), str(result.result), str(result.traceback)]
        ).encode()
    fleet.stop()  # logs complete and flushed, monitor stopped; Redis still up
    logs = fleet.logs()
    for name in ("worker-w.log", "beat-b.log"):
        assert "DEBUG" in logs[name], f"{name} has no DEBUG lines"
    assert "renew" in logs["worker-w.log"]
    for name, text in logs.items():
        if name == monitor.log.name:
            continue
        texts[name] = text.encode()
    token_key = store.token_key
    lines = monitor.log_text().splitlines()
    assert len(lines) > 100, "the monitor saw almost nothing"
    # the one place a token may be: commands writing or reading the token key
    texts["redis MONITOR"] = "\n".join(line for line in lines if token_key not in line).encode()
    for key in store.redis.scan_iter(count=1000):
        if key != token_key.encode():
            texts[f"redis key {key!r}"] = redis_value(store.redis, key)
    assert any(key.startswith("redis key b'celery-task-meta-") for key in texts)
    assert any(key.startswith(f"redis key b'{key_prefix}:") for key in texts)

    # positive controls: a value sent as a task argument shows in the message bodies
    # (base64 on the broker) and in the stored results
    assert shows(canary, texts["redis MONITOR"])
    assert shows(canary, base64.b64encode(f'{{"note": "{canary}"}}'.encode()))
    assert any(shows(canary, text) for key, text in texts.items() if "celery-task-meta" in key)

    tokens = sandbox.app.issued_tokens()
    assert len(tokens) >= 3  # first, after revoke-all, and beat's
    needles = {"the secret": TEST_SECRET, "the new secret": new_secret}
    needles.update({f"token #{n}": token for n, token in enumerate(tokens)})
    leaks = [
        f"{what} in {where}"
        for what, needle in needles.items()
        for where, text in texts.items()
        if shows(needle, text)
    ]
    assert not leaks, leaks
