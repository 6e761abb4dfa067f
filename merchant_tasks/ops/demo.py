"""``merchant-tasks demo``: the whole system on one machine, with a live view.

It starts the emulator (short token lifetime), finds a Redis (MERCHANT_REDIS_URL if it
answers, else a private ``redis-server``, else fakeredis's TCP server), starts a real Celery
worker and beat as child processes, enqueues calls, revokes every token midway, and shows
token generation, time left, exchanges, calls and 401 recoveries. It stops every process
it started and deletes every key it wrote, whatever happens (Ctrl-C included).

When it runs on a Redis that other programs use, nothing it writes can meet theirs: its token
keys carry a key prefix of their own, and every Celery key (queues, results, events) carries
that prefix too (kombu's ``global_keyprefix``), so its worker never takes another fleet's
calls and no other worker takes the demo's. Its children run in a private directory with a
``celeryconfig.py`` written for the run, so a ``celeryconfig.py`` in the current directory
(which may point at another broker) does not apply to them, nor to this process, which
enqueues through a Celery app of its own; CELERY_BROKER_URL and the like are ignored.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from celery import Celery

from merchant_tasks.exceptions import StoreUnavailable
from merchant_tasks.sandbox.emulator import SandboxApp, SandboxConfig, SandboxServer
from merchant_tasks.sandbox.processes import (
    RedisServer,
    free_port,
    redis_answers,
    running,
    wait_until,
)
from merchant_tasks.settings import (
    DEFAULT_REDIS_URL,
    FleetSettings,
    Secret,
    Settings,
    child_env,
    read_variable,
    use_environment,
)
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.store.topology import delete_under_prefix, probe_redis, redis_from_url
from merchant_tasks.worker.app import isolated_config, package_defaults, write_config_module

DEMO_API_KEY = "demo-app-id"
CALL_API_TASK = "merchant_tasks.call_api"
VIEW_INTERVAL = 0.5  # seconds between two refreshes of the live view
DRAIN_TIMEOUT = 30.0  # seconds to wait for calls still queued when the duration ends
REDIS_PROBE_TIMEOUT = 0.5  # a MERCHANT_REDIS_URL that takes longer is not the demo's Redis


@dataclass
class DemoSummary:
    """What one demo run did, as printed at the end."""

    redis: str = ""
    enqueued: int = 0
    ok: int = 0
    failed: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)  # the first failed calls' results
    exchanges: int = 0
    expected_exchanges: int = 0
    unauthorized: int = 0
    forced_renewals: int = 0

    @property
    def healthy(self) -> bool:
        return self.failed == 0 and self.lost == 0 and self.ok == self.enqueued


def run_demo(
    duration: float, rate: float, lifetime: float, workers: int, out: TextIO = sys.stdout
) -> DemoSummary:
    """Run the demo for ``duration`` seconds of calls and return its summary."""
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mt-demo-")))
        redis_url, redis_kind = stack.enter_context(_redis_for_demo(workdir))
        secret = secrets.token_urlsafe(24)
        sandbox = SandboxApp(SandboxConfig(api_key=DEMO_API_KEY, secret=secret, lifetime=lifetime))
        server = stack.enter_context(SandboxServer(sandbox))
        secret_file = workdir / "api-secret"
        secret_file.write_text(secret)
        secret_file.chmod(0o600)
        renew_before = round(lifetime * 0.3, 3)
        key_prefix = f"mt-demo-{uuid.uuid4().hex[:8]}"
        celery_config = isolated_config(redis_url, key_prefix)
        write_config_module(workdir / "celeryconfig.py", celery_config)
        settings = Settings(
            api_key=DEMO_API_KEY,
            secret=Secret(path=secret_file),
            base_url=server.url,
            token_lifetime=lifetime,
            renew_before=renew_before,
            renew_mandatory=round(lifetime * 0.1, 3),
            fleet=FleetSettings(
                redis_url=redis_url,
                key_prefix=key_prefix,
                renew_interval=max(1.0, round(lifetime * 0.05, 3)),
            ),
        )
        # last out, once the worker and beat below have stopped (Ctrl-C included): every
        # key the run wrote, its own and Celery's, carries its prefix
        stack.callback(_delete_keys, redis_url, key_prefix, out)
        # the children get these settings and nothing else of ours: no MERCHANT_* or CELERY_*
        # variable of this shell (Celery reads its URLs from the environment first)
        env = child_env(settings)
        # and so does this process, where the producer below would otherwise send elsewhere
        use_environment(env)
        _start_worker_and_beat(stack, workdir, env, workers)
        store = TokenStore(
            redis_from_url(redis_url),
            TokenStore.namespace_for(key_prefix, "sandbox", DEMO_API_KEY),
        )
        summary = DemoSummary(redis=redis_kind)
        summary.expected_exchanges = math.ceil(duration / (lifetime - renew_before)) + 1
        out.write(
            f"demo: emulator {server.url}, Redis {redis_kind}, {workers} worker processes, "
            f"token lifetime {lifetime:g} s, {duration:g} s of calls at {rate:g}/s\n"
        )
        # this process enqueues with the children's configuration, whatever celeryconfig.py
        # the current directory holds
        producer = Celery("merchant-tasks-demo", set_as_current=False)
        producer.conf.update({**package_defaults(env), **celery_config, "imports": ()})
        stack.callback(producer.close)
        _drive(summary, producer, sandbox, store, duration, rate, out)
        out.write(_summary_text(summary))
        return summary
    raise AssertionError("unreachable")  # pragma: no cover - ExitStack does not swallow


def _delete_keys(redis_url: str, key_prefix: str, out: TextIO) -> None:
    """Delete the run's keys; say so if Redis would not, leaving the stop to go on."""
    try:
        delete_under_prefix(redis_url, key_prefix)
    except StoreUnavailable as exc:
        out.write(f"demo: its keys {key_prefix}:* are left in Redis: {exc}\n")


def _start_worker_and_beat(
    stack: contextlib.ExitStack, workdir: Path, env: dict[str, str], workers: int
) -> None:
    """The demo's Celery worker and beat, stopped with ``stack``."""
    celery = [sys.executable, "-m", "celery", "-A", "merchant_tasks"]
    worker = [*celery, "worker", "--loglevel=WARNING", f"--concurrency={workers}"]
    worker += ["--without-gossip", "--without-mingle", "-n", f"demo-{uuid.uuid4().hex[:6]}@%h"]
    stack.enter_context(running("worker", worker, workdir / "worker.log", env=env, cwd=workdir))
    beat = [*celery, "beat", "--loglevel=WARNING", "-s", str(workdir / "beat-schedule")]
    stack.enter_context(running("beat", beat, workdir / "beat.log", env=env, cwd=workdir))


def _drive(
    summary: DemoSummary,
    producer: Celery,
    sandbox: SandboxApp,
    store: TokenStore,
    duration: float,
    rate: float,
    out: TextIO,
) -> None:
    """Enqueue calls, revoke every token midway, show the live view, collect results."""

    def call_api(method: str, path: str, **kwargs: Any) -> Any:
        return producer.send_task(CALL_API_TASK, args=[method, path], kwargs=kwargs)

    pending: list[Any] = []
    started = time.monotonic()
    revoked = False
    next_view = 0.0
    live = out.isatty()

    def collect() -> None:
        _collect(pending, summary)

    def view(now: float) -> None:
        line = _view_line(summary, sandbox, store, len(pending), now)
        out.write(("\r\x1b[K" + line) if live else line + "\n")
        out.flush()

    while (elapsed := time.monotonic() - started) < duration:
        target = int(elapsed * rate)
        while summary.enqueued < target:
            path = "/open-api/v1/echo" if summary.enqueued % 2 else "/open-api/v1/ping"
            if path.endswith("echo"):
                pending.append(call_api("POST", path, json={"n": summary.enqueued}))
            else:
                pending.append(call_api("GET", path))
            summary.enqueued += 1
        # midway, once a call succeeded: a token revoked before its first use looks like a
        # wrong key (no evidence it ever worked) and waits out a back-off (docs/design.md)
        if not revoked and elapsed >= duration / 2 and summary.ok > 0:
            sandbox.revoke_all()
            revoked = True
            out.write(
                ("\n" if live else "") + f"t={elapsed:5.1f}s  revoke-all: every token dies now\n"
            )
        collect()
        if elapsed >= next_view:
            view(elapsed)
            next_view = elapsed + (VIEW_INTERVAL if live else 2.0)
        time.sleep(0.05)
    deadline = time.monotonic() + DRAIN_TIMEOUT
    while pending and time.monotonic() < deadline:
        collect()
        time.sleep(0.1)
    summary.lost = len(pending)
    view(time.monotonic() - started)
    if live:
        out.write("\n")


def _collect(pending: list[Any], summary: DemoSummary) -> None:
    """Count the results that are in, and forget them."""
    for result in [r for r in pending if r.ready()]:
        pending.remove(result)
        if result.successful():
            summary.ok += 1
        else:
            summary.failed += 1
            summary.errors.append(repr(result.result)[:200])


def _view_line(
    summary: DemoSummary, sandbox: SandboxApp, store: TokenStore, queued: int, now: float
) -> str:
    """One line of the live view (and the summary's figures brought up to date)."""
    counters = sandbox.counters()
    token = store.load()
    clock = store.time()
    summary.exchanges = counters["exchanges"]["ok"]
    summary.unauthorized = counters["calls"]["unauthorized"]
    summary.forced_renewals = store.records.counters().get("renewals:forced:ok", 0)
    token_text = (
        f"gen {token.generation:>3} left {token.time_left(clock):5.1f}s"
        if token is not None
        else "no token yet    "
    )
    return (
        f"t={now:5.1f}s  token {token_text}  exchanges {summary.exchanges:>3}  "
        f"calls ok {summary.ok:>5} failed {summary.failed:>3} queued {queued:>4}  "
        f"401s {summary.unauthorized:>3} (forced renewals {summary.forced_renewals})"
    )


def _summary_text(summary: DemoSummary) -> str:
    lines = [
        "",
        "summary",
        f"  calls enqueued        {summary.enqueued}",
        f"  calls ok              {summary.ok}",
        f"  calls failed          {summary.failed}",
        f"  calls not finished    {summary.lost}",
        f"  token exchanges       {summary.exchanges} (expected at most "
        f"{summary.expected_exchanges}: one per renewal period, plus the revoke-all)",
        f"  401s answered         {summary.unauthorized}",
        f"  forced renewals       {summary.forced_renewals}",
        f"  Redis                 {summary.redis}",
        f"  result                {'OK' if summary.healthy else 'PROBLEMS'}",
    ]
    lines += [f"  error: {e}" for e in summary.errors[:5]]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _redis_for_demo(workdir: Path) -> Iterator[tuple[str, str]]:
    """MERCHANT_REDIS_URL if it answers, else a private redis-server, else fakeredis."""
    url = read_variable("MERCHANT_REDIS_URL") or DEFAULT_REDIS_URL
    if probe_redis(url, connect_timeout=REDIS_PROBE_TIMEOUT):
        yield url, f"{url.split('@')[-1]} (MERCHANT_REDIS_URL)"
        return
    if shutil.which("redis-server") is not None:
        with RedisServer(workdir) as server:
            yield server.url, f"private redis-server on port {server.port}"
        return
    port = free_port()
    from fakeredis import TcpFakeServer

    fake = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    try:
        wait_until(lambda: redis_answers(port), "fakeredis's TCP server")
        yield f"redis://127.0.0.1:{port}/0", f"embedded fakeredis on port {port} (slower)"
    finally:
        fake.shutdown()
        fake.server_close()
