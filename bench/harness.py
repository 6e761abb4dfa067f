"""What every scenario stands on: child processes, a private Redis, the emulator, statistics.

Every child runs in its own session (its own process group) and is stopped with the whole
group, so prefork children and threads' helpers never outlive the bench.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import redis
import requests

from merchant_tasks.sandbox import processes as local
from merchant_tasks.sandbox.processes import Child as Child  # the scenarios' child processes
from merchant_tasks.sandbox.processes import free_port, redis_answers, redis_server_command
from merchant_tasks.sandbox.processes import spawn as spawn

BENCH_DIR = Path(__file__).resolve().parent
STOP_TIMEOUT = 10.0  # seconds a child group gets after SIGTERM before SIGKILL
START_TIMEOUT = 20.0  # seconds a server child gets to answer


class ScenarioError(RuntimeError):
    """A scenario could not run (as opposed to: it ran and missed a goal)."""


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


class SandboxControl:
    """The emulator's /_sandbox control endpoints (no auth; loopback only)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.session = requests.Session()

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        response = self.session.request(
            method, f"{self.base_url}/_sandbox/{path}", json=body, timeout=10
        )
        response.raise_for_status()
        return response.json()

    def counters(self) -> dict[str, Any]:
        return cast(dict[str, Any], self._call("GET", "counters"))

    def configure(self, **changes: Any) -> dict[str, Any]:
        return cast(dict[str, Any], self._call("POST", "config", changes))

    def revoke_all(self) -> None:
        self._call("POST", "revoke-all")

    def close(self) -> None:
        self.session.close()


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


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (no interpolation: every figure is a measured sample)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


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
