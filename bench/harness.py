"""What every scenario stands on: the servers and children they share, and the tools they
measure with.

- ``Bench``: the private Redis, the emulator, the secret file and every child started, as
  handed to each scenario's ``measure``;
- child processes: each runs in its own session (its own process group) and is stopped
  with the whole group, so prefork children and threads' helpers never outlive the bench;
- a private ``redis-server``, the emulator in its own process and its control endpoints;
- timers, percentiles, Redis counting (server-side INFO commandstats, client-side commands
  by name, round trips), and many callers at once.

It imports only the library and its dependencies, never a scenario or the runner.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, ParamSpec, TypeVar, cast

import redis

from merchant_tasks.accounts import FleetClient, client_for
from merchant_tasks.sandbox import processes as local
from merchant_tasks.sandbox.emulator import SandboxControl as SandboxControl  # the scenarios'
from merchant_tasks.sandbox.processes import Child as Child  # the scenarios' child processes
from merchant_tasks.sandbox.processes import free_port, redis_answers, redis_server_command
from merchant_tasks.sandbox.processes import spawn as spawn
from merchant_tasks.settings import (
    DEFAULT_KEY_PREFIX,
    RENEW_INTERVAL,
    FleetSettings,
    Secret,
    Settings,
    child_env,
)

BENCH_DIR = Path(__file__).resolve().parent
API_KEY = "bench-app-id"  # the emulator's account, for the bench and its children
PING = "/open-api/v1/ping"  # the call every scenario makes
LONG_LIFETIME = 7200.0  # the emulator's token lifetime outside the fleet and cold start
STOP_TIMEOUT = 10.0  # seconds a child group gets after SIGTERM before SIGKILL
START_TIMEOUT = 20.0  # seconds a server child gets to answer
JOIN_TIMEOUT = 60.0  # seconds for every concurrent caller to finish, on a busy 2-core machine

P = ParamSpec("P")
R = TypeVar("R")


class ScenarioError(RuntimeError):
    """A scenario could not run (as opposed to: it ran and missed a goal)."""


def progress(message: str) -> None:
    """One line on stderr, so that a long run shows where it is."""
    sys.stderr.write(f"bench: {message}\n")
    sys.stderr.flush()


# -- what the scenarios share ---------------------------------------------------------------


@dataclass
class Bench:
    """What the scenarios share: the servers and the processes started for them."""

    workdir: Path
    redis_url: str
    sandbox_url: str
    secret_file: Path
    control: SandboxControl
    store: redis.Redis
    sandbox_env: dict[str, str]
    children: list[Child] = field(default_factory=list)

    def settings(
        self,
        prefix: str,
        base_url: str | None = None,
        renew_interval: float = RENEW_INTERVAL,
        **fields: Any,
    ) -> Settings:
        """The emulator's account with its own key prefix (default windows unless given)."""
        return Settings(
            api_key=API_KEY,
            secret=Secret(path=self.secret_file),
            base_url=base_url or self.sandbox_url,
            **fields,
            fleet=FleetSettings(
                redis_url=self.redis_url, key_prefix=prefix, renew_interval=renew_interval
            ),
        )

    def env(self, settings: Settings | None = None, **extra: str) -> dict[str, str]:
        """The children's environment: ``settings.to_env()`` (the emulator's account with
        the default key prefix when None), ``extra`` on top, nothing inherited of ours;
        ``bench/`` first on PYTHONPATH, so that a worker imports the bench's own modules
        (``bare_tasks``, ``accounts_source``)."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("BENCH_")}
        account = settings or self.settings(DEFAULT_KEY_PREFIX)
        path = os.pathsep.join(p for p in (str(BENCH_DIR), base.get("PYTHONPATH")) if p)
        return {
            **child_env(account, base),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": path,
            **extra,
        }

    def client(
        self, prefix: str, base_url: str | None = None, redis_client: redis.Redis | None = None
    ) -> FleetClient:
        """A MerchantClient in this process, default windows, its own key prefix."""
        settings = self.settings(prefix, base_url)
        return client_for(settings, redis_client=redis_client)

    def spawn(self, name: str, argv: list[str], **kwargs: Any) -> Child:
        child = spawn(name, argv, self.workdir / f"{name}.log", **kwargs)
        self.children.append(child)
        return child


# -- child processes and servers ------------------------------------------------------------


def worker_argv(concurrency: int, *options: str) -> list[str]:
    """``celery -A merchant_tasks worker`` as the benchmarks run it: prefork, quiet, and
    without the gossip, mingle and heartbeat traffic that would add to what is measured."""
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "merchant_tasks",
        "worker",
        "--pool=prefork",
        f"--concurrency={concurrency}",
        "--loglevel=WARNING",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        *options,
    ]


def wait_until(ready: Callable[[], bool], what: str, timeout: float = START_TIMEOUT) -> None:
    """``merchant_tasks.sandbox.processes.wait_until``, its time-out a ScenarioError."""
    try:
        local.wait_until(ready, what, timeout)
    except TimeoutError as exc:
        raise ScenarioError(str(exc)) from None


@contextlib.contextmanager
def private_redis(workdir: Path) -> Iterator[tuple[str, Child]]:
    """A redis-server of our own on a free loopback port: no persistence, nobody else's traffic."""
    port = free_port()
    try:
        argv = redis_server_command(port, workdir, "--loglevel", "warning")
    except FileNotFoundError as exc:
        raise ScenarioError(str(exc)) from None
    child = spawn("redis-server", argv, workdir / "redis.log")
    try:
        try:
            child.wait_ready(lambda: redis_answers(port), "the private redis-server", START_TIMEOUT)
        except (RuntimeError, TimeoutError) as exc:
            raise ScenarioError(str(exc)) from None
        yield f"redis://127.0.0.1:{port}/0", child
    finally:
        child.stop()


@contextlib.contextmanager
def sandbox_process(
    workdir: Path, env: Mapping[str, str], server: str = "werkzeug"
) -> Iterator[tuple[str, Child]]:
    """The emulator in its own process (bench/sandbox_server.py); yields its base URL."""
    child = spawn(
        f"sandbox-{server}",
        [sys.executable, str(BENCH_DIR / "sandbox_server.py"), server],
        workdir / f"sandbox-{server}.log",
        env=env,
        stdout_pipe=True,
    )
    try:
        assert child.process.stdout is not None
        line = child.process.stdout.readline().decode().strip()  # the server prints its URL
        if not line.startswith("http://"):
            child.process.wait(timeout=STOP_TIMEOUT)
            raise ScenarioError(f"the emulator did not start: {child.log_tail()}")
        yield line, child
    finally:
        child.stop()
        if child.process.stdout is not None:
            child.process.stdout.close()


def last_json_line(text: str) -> dict[str, Any]:
    """The last line of a child's stdout that parses as a JSON object."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                value = json.loads(line)
                if isinstance(value, dict):
                    return value
    raise ScenarioError(f"no JSON result line in: {text[-300:]!r}")


# -- measuring ------------------------------------------------------------------------------


def counter_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, int]:
    """Exchange and call outcome counts between two counter snapshots, flat."""
    delta: dict[str, int] = {}
    for group in ("exchanges", "calls"):
        for outcome, value in after[group].items():
            delta[f"{group}.{outcome}"] = int(value) - int(before[group].get(outcome, 0))
    return delta


def commands_processed(client: redis.Redis) -> int:
    """Commands Redis has run, from INFO commandstats, leaving out INFO itself."""
    stats = cast(dict[str, dict[str, Any]], client.info("commandstats"))
    return sum(int(entry["calls"]) for name, entry in stats.items() if name != "cmdstat_info")


class CommandCountingConnection(redis.Connection):
    """A Redis connection that counts the commands it sends, by name (per client class)."""

    counts: ClassVar[Counter[str]] = Counter()

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        self.counts[str(args[0]).upper().split()[0]] += 1
        super().send_command(*args, **kwargs)  # type: ignore[no-untyped-call]

    def pack_commands(self, commands: Any) -> list[bytes | memoryview]:
        for command in commands:
            self.counts[str(command[0]).upper().split()[0]] += 1
        return super().pack_commands(commands)  # type: ignore[no-untyped-call, no-any-return]


def command_counting_redis(url: str) -> tuple[redis.Redis, Counter[str]]:
    """A Redis client whose connections count the commands they send, and its own count."""
    counting: type[CommandCountingConnection] = type(
        "Counting", (CommandCountingConnection,), {"counts": Counter()}
    )
    pool = redis.ConnectionPool.from_url(url, connection_class=counting)
    return redis.Redis(connection_pool=pool), counting.counts


class RoundTripCountingConnection(redis.Connection):
    """Counts packets sent: one per command, one per pipeline (a round trip each)."""

    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        RoundTripCountingConnection.sent += 1
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


def round_trip_counting_redis(url: str) -> redis.Redis:
    """A Redis client whose round trips ``timed_round_trips`` counts."""
    pool = redis.ConnectionPool.from_url(url, connection_class=RoundTripCountingConnection)
    return redis.Redis(connection_pool=pool)


def timed_round_trips(run: Callable[[], object]) -> tuple[float, int]:
    """Milliseconds and round trips (of round-trip-counting clients) of one run."""
    before = RoundTripCountingConnection.sent
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) * 1000, RoundTripCountingConnection.sent - before


def timed(target: Callable[P, R], into: list[float]) -> Callable[P, R]:
    """``target``, appending the seconds each call of it takes to ``into``."""

    def timed_call(*args: P.args, **kwargs: P.kwargs) -> R:
        t0 = time.perf_counter()
        try:
            return target(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    return timed_call


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (no interpolation: every figure is a measured sample)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def concurrent_calls(
    clients: Sequence[FleetClient], callers: int
) -> tuple[list[float], Counter[str]]:
    """``callers`` threads call GET PING at once, spread over ``clients``; the latency of
    each from the common start, in seconds, and the errors by type name.

    A full garbage collection comes first, untimed: one owed to what ran before (the
    imports, the set-up, the last batch) would otherwise stop every caller of whichever
    batch it fell in, for 37-77 ms here, and where it falls moves with any change in
    allocations (it moved from a calm batch to a stormy one between two commits whose
    storm paths do the same work)."""
    gc.collect()
    started: list[float] = []
    barrier = threading.Barrier(callers, action=lambda: started.append(time.perf_counter()))
    latencies = [math.nan] * callers
    errors: Counter[str] = Counter()
    lock = threading.Lock()

    def call(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            clients[i % len(clients)].request("GET", PING)
        except Exception as exc:
            with lock:
                errors[type(exc).__name__] += 1
        latencies[i] = time.perf_counter() - started[0]

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=JOIN_TIMEOUT)
    if any(thread.is_alive() for thread in threads):
        raise ScenarioError(
            f"{callers} concurrent callers did not finish within {JOIN_TIMEOUT:g} s"
        )
    return latencies, errors
