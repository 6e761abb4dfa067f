"""Benchmarks of merchant-tasks against the obvious alternatives, measured in one run.

    python bench/run.py            # full run, a few minutes
    python bench/run.py --quick    # smoke test, under a minute; fails only if it cannot run

Everything runs on loopback against a private ``redis-server`` (so INFO commandstats counts
only our traffic) and the sandbox emulator in its own process. Scenarios (see README.md):

1. fleet economy: P processes x T threads calling for D seconds with token lifetime L and
   advisory window R; ours (plus a beat process) against authlib's per-process cache and a
   lock-free shared Redis cache, with the emulator's revoke-on-issue off and on;
2. 401 storm: 64 concurrent callers over 4 clients (as 4 processes) right after
   revoke-all, against the same 64 calls without a storm, with the token endpoint taking
   ~0 ms and 100 ms; overhead over the floor (2 x calm p99 + exchange) and Redis commands
   per process that waited for another's renewal;
3. hot path: MerchantClient.request against a raw requests.Session with a fixed bearer
   header, interleaved rounds; Redis commands per call from INFO commandstats;
4. Celery: merchant_tasks.call_api against a bare task doing the same GET, same worker;
5-8. many accounts and sealing (bench/many_accounts.py): beat's check of 1,000 accounts
   against the old loop, a cold start of 1,000 accounts through beat and a worker at a
   fleet-wide cap of 20 exchanges a second, the hot path with the token sealed at rest
   against the same in clear, and beat's check of 10,000 accounts and a worker's memory
   configured with them.

The output is markdown tables, then one JSON object as the last line. The exit status is 1
only when a scenario could not run; a missed goal is reported, never an error.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import json
import logging
import math
import os
import platform
import pstats
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, ClassVar

import many_accounts
import redis
import requests
from callers import concurrent_calls
from harness import (
    BENCH_DIR,
    Child,
    SandboxControl,
    ScenarioError,
    commands_processed,
    counter_delta,
    last_json_line,
    median,
    percentile,
    private_redis,
    sandbox_process,
    spawn,
    wait_until,
    worker_argv,
)
from scenario import Goal, Result, Scenario, Table, fmt

from merchant_tasks.accounts import FleetClient, client_for
from merchant_tasks.settings import (
    DEFAULT_KEY_PREFIX,
    RENEW_INTERVAL,
    FleetSettings,
    Secret,
    Settings,
    child_env,
)
from merchant_tasks.worker.app import package_defaults

API_KEY = "bench-app-id"
PING = "/open-api/v1/ping"
TIMEOUT = (3.05, 10.0)  # MerchantClient's default (connect, read) timeouts, used by every peer
LONG_LIFETIME = 7200.0  # the emulator's lifetime outside the fleet scenario
STORM_CALLERS = 64
STORM_PROCESSES = 4  # clients in the storm, each standing for a process of the fleet
STORM_SETTLE = 0.2  # seconds after the first calls, so each client hears of renewals
SLOW_EXCHANGE = 0.1  # seconds the emulator's token endpoint takes in the slow storm
STORM_OVERHEAD_GOAL = 20.0  # ms of stormed p99 over 2 x calm p99 + the exchange
STORM_WAITER_COMMANDS_GOAL = 3.0  # Redis commands per waiting process per storm
HOT_PATH_GOAL = 0.97
REDIS_OPS_GOAL = 1.0
CELERY_GOAL = 0.95
STATIC_TOKEN_KEY = "bench:static-token"  # the bare Celery task's token, written by the bench
HEADLINE_KEYS = (  # first in the JSON line, null when their scenario could not run
    "exchanges_ours",
    "exchanges_minimum",
    "exchanges_peer_per_process",
    "exchanges_peer_shared_nolock",
    "storm_exchanges",
    "storm_p99_added_ms",
    "storm_overhead_p99_ms",
    "storm_slow_exchange_overhead_p99_ms",
    "storm_redis_cmds_per_waiter",
    "hot_path_ratio",
    "redis_ops_per_call",
    "celery_ratio",
    "accounts_check_ms",
    "accounts_check_redis_roundtrips",
    "accounts_cold_start_max_exchanges_per_s",
    "cold_start_max_exchanges_per_s",
    "cold_start_seconds",
    "cold_start_call_wait_s",
    "accounts_10k_check_ms",
    "accounts_10k_check_roundtrips",
    "accounts_10k_status_s",
    "accounts_10k_status_roundtrips",
    "accounts_10k_worker_rss_mb",
    "sealing_hot_path_ratio",
)

CONTENDERS = (
    ("ours", "ours (MerchantClient + beat)"),
    ("authlib", "per-process cache (authlib OAuth2Session)"),
    ("nolock", "shared Redis cache, no lock"),
)
JSON_NAMES = {"ours": "ours", "authlib": "peer_per_process", "nolock": "peer_shared_nolock"}

log = logging.getLogger("bench")


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
        the default key prefix when None), ``extra`` on top, nothing inherited of ours."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("BENCH_")}
        account = settings or self.settings(DEFAULT_KEY_PREFIX)
        return {**child_env(account, base), "PYTHONUNBUFFERED": "1", **extra}

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


def progress(message: str) -> None:
    sys.stderr.write(f"bench: {message}\n")
    sys.stderr.flush()


def compact(error: str, limit: int = 400) -> str:
    """One line for a report: the first line of an error and, if more, its last line."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if len(lines) > 1:
        lines = [lines[0].removesuffix("Traceback (most recent call last):").strip(), lines[-1]]
    text = " ... ".join(lines)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- 1. fleet economy ---------------------------------------------------------------------


@dataclass
class FleetRun:
    contender: str
    revoke_on_issue: bool
    exchanges: int
    exchange_refusals: int
    unauthorized: int
    failed: int
    ok: int
    server_ok: int
    errors: dict[str, int]
    beat_errors: dict[str, int]

    def json(self) -> dict[str, Any]:
        """This run's keys: the contender's JSON name, then the emulator's mode."""
        mode = "_revoke_on_issue" if self.revoke_on_issue else ""
        name = JSON_NAMES[self.contender] + mode
        found: dict[str, Any] = {
            f"exchanges_{name}": self.exchanges,
            f"unauthorized_{name}": self.unauthorized,
            f"failed_calls_{name}": self.failed,
            f"calls_ok_{name}": self.ok,
        }
        if self.exchange_refusals:
            found[f"exchanges_refused_{name}"] = self.exchange_refusals
        if self.errors:
            found[f"errors_{name}"] = self.errors
        if self.beat_errors:
            found[f"beat_errors{mode}"] = self.beat_errors
        return found


@dataclass(frozen=True)
class Fleet(Scenario):
    """P processes x T threads calling for D seconds with token lifetime L and advisory
    window R, each contender in turn, with the emulator's revoke-on-issue off and on."""

    processes: int  # P
    threads: int  # T
    duration: float  # D, seconds
    lifetime: float  # L, seconds
    advisory: float  # R, seconds
    name: ClassVar[str] = "fleet"

    @property
    def mandatory(self) -> float:
        return round(self.advisory / 3, 3)

    @property
    def renew_interval(self) -> float:
        return round(self.lifetime / 10, 3)

    @property
    def minimum_exchanges(self) -> int:
        return math.ceil(self.duration / (self.lifetime - self.advisory))

    def measure(self, bench: Bench) -> Result:
        minimum = self.minimum_exchanges
        found: dict[str, Any] = {"exchanges_minimum": minimum}
        runs: list[FleetRun] = []
        errors: list[str] = []
        for revoke in (False, True):
            for contender, _ in CONTENDERS:
                started = time.monotonic()
                try:
                    run = self.run(bench, contender, revoke)
                except Exception as exc:  # one contender that cannot run does not stop the rest
                    log.exception(
                        "fleet run %s (revoke_on_issue=%s) could not run", contender, revoke
                    )
                    what = f"fleet {contender} revoke_on_issue={revoke}"
                    errors.append(compact(f"{what}: {type(exc).__name__}: {exc}"))
                    continue
                runs.append(run)
                progress(
                    f"fleet {contender} revoke_on_issue={revoke}: {run.exchanges} exchanges, "
                    f"{run.unauthorized} 401s, {run.failed} failed, {run.ok} ok "
                    f"({time.monotonic() - started:.1f} s)"
                )
                found.update(run.json())
        labels = dict(CONTENDERS)
        rows = [
            [
                labels[r.contender],
                "on" if r.revoke_on_issue else "off",
                str(r.exchanges),
                f"{r.exchanges / minimum:.2f}",
                str(r.unauthorized),
                str(r.failed),
                f"{r.ok:,}",
                f"{r.ok / self.duration:,.0f}",
            ]
            for r in runs
        ]
        header = ["contender", "revoke-on-issue", "exchanges", "x minimum", "401s"]
        header += ["failed calls", "calls ok", "calls/s"]
        goals: list[Goal] = []
        for r in runs:
            if r.contender == "ours":
                mode = f"ours, revoke-on-issue {'on' if r.revoke_on_issue else 'off'}"
                goals.append(
                    Goal(
                        f"fleet exchanges, {mode}",
                        f"<= {minimum}",
                        str(r.exchanges),
                        r.exchanges <= minimum,
                    )
                )
                goals.append(Goal(f"fleet failed calls, {mode}", "0", str(r.failed), r.failed == 0))
        return Result(
            title=f"1. Fleet economy: {self.processes} processes x {self.threads} threads, "
            f"{self.duration:g} s, lifetime L={self.lifetime:g} s, advisory R={self.advisory:g} s "
            f"(mandatory {self.mandatory:g} s, beat every {self.renew_interval:g} s)",
            table=Table(header, rows),
            json=found,
            goals=goals,
            notes=[f"minimum exchanges = ceil(D / (L - R)) = {minimum}"],
            errors=errors,
        )

    def run(self, bench: Bench, contender: str, revoke_on_issue: bool) -> FleetRun:
        bench.control.configure(lifetime=self.lifetime, revoke_on_issue=revoke_on_issue)
        bench.control.revoke_all()  # nothing issued for an earlier run stays usable
        tag = uuid.uuid4().hex[:8]
        ready_key, go_key = f"bench:{tag}:ready", f"bench:{tag}:go"
        windows = bench.settings(
            f"bench-{tag}",
            token_lifetime=self.lifetime,
            renew_before=self.advisory,
            renew_mandatory=self.mandatory,
            renew_interval=self.renew_interval,
        )
        env = bench.env(
            windows,
            BENCH_REDIS_URL=bench.redis_url,
            BENCH_READY_KEY=ready_key,
            BENCH_GO_KEY=go_key,
            BENCH_ADVISORY=repr(self.advisory),
            BENCH_SHARED_KEY=f"bench:{tag}:shared-token",
        )
        roles = [contender] * self.processes + (["beat"] if contender == "ours" else [])
        worker = str(BENCH_DIR / "fleet_worker.py")
        children = [
            bench.spawn(
                f"fleet-{contender}-{'revoke' if revoke_on_issue else 'keep'}-{i}-{role}",
                [sys.executable, worker, role, str(self.threads), repr(self.duration)],
                env=env,
                stdout_pipe=True,
            )
            for i, role in enumerate(roles)
        ]
        try:

            def all_ready() -> bool:
                for child in children:
                    if child.process.poll() is not None:
                        raise ScenarioError(f"{child.name} exited early: {child.log_tail()}")
                return int(bench.store.get(ready_key) or 0) == len(children)

            wait_until(all_ready, f"{len(children)} fleet processes", timeout=60)
            before = bench.control.counters()
            bench.store.set(go_key, repr(time.time() + 0.3))
            outputs: list[dict[str, Any]] = []
            for child in children:
                try:
                    out, _ = child.process.communicate(timeout=self.duration + 60)
                except Exception as exc:
                    raise ScenarioError(f"{child.name} did not finish: {child.log_tail()}") from exc
                if child.process.returncode != 0:
                    raise ScenarioError(f"{child.name} failed: {child.log_tail()}")
                outputs.append(last_json_line(out.decode(errors="replace")))
            after = bench.control.counters()
        finally:
            for child in children:
                child.stop()
                if child.process.stdout is not None:
                    child.process.stdout.close()
        delta = counter_delta(before, after)
        callers = [o for o in outputs if o["role"] != "beat"]
        errors: Counter[str] = Counter()
        beat_errors: Counter[str] = Counter()
        for output in outputs:
            (beat_errors if output["role"] == "beat" else errors).update(output["errors"])
        return FleetRun(
            contender=contender,
            revoke_on_issue=revoke_on_issue,
            exchanges=delta["exchanges.ok"],
            exchange_refusals=sum(v for k, v in delta.items() if k.startswith("exchanges."))
            - delta["exchanges.ok"],
            unauthorized=delta["calls.unauthorized"],
            failed=sum(int(o["failed"]) for o in callers),
            ok=sum(int(o["ok"]) for o in callers),
            server_ok=delta["calls.ok"],
            errors=dict(errors),
            beat_errors=dict(beat_errors),
        )


# -- 2. 401 storm -------------------------------------------------------------------------


class CountingConnection(redis.Connection):
    """A Redis connection that counts the commands it sends, by name (per client class)."""

    counts: ClassVar[Counter[str]] = Counter()

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        self.counts[str(args[0]).upper().split()[0]] += 1
        super().send_command(*args, **kwargs)  # type: ignore[no-untyped-call]

    def pack_commands(self, commands: Any) -> list[bytes | memoryview]:
        for command in commands:
            self.counts[str(command[0]).upper().split()[0]] += 1
        return super().pack_commands(commands)  # type: ignore[no-untyped-call, no-any-return]


@dataclass
class StormProcess:
    """One client standing for one process: its own copy, turn and Redis pool, counted."""

    client: FleetClient
    commands: Counter[str]
    exchanges: list[float]  # seconds each exchange this client made took


def storm_process(bench: Bench, prefix: str) -> StormProcess:
    counting: type[CountingConnection] = type(
        "Counting", (CountingConnection,), {"counts": Counter()}
    )
    pool = redis.ConnectionPool.from_url(bench.redis_url, connection_class=counting)
    client = bench.client(prefix, redis_client=redis.Redis(connection_pool=pool))
    timed: list[float] = []
    exchange = client.manager.renewer.exchange

    def timed_exchange() -> Any:
        started = time.perf_counter()
        try:
            return exchange()
        finally:
            timed.append(time.perf_counter() - started)

    client.manager.renewer.exchange = timed_exchange
    return StormProcess(client, counting.counts, timed)


@dataclass
class StormRound:
    calm: list[float]
    stormy: list[float]
    exchanges: int
    unauthorized: int
    errors: Counter[str]
    exchange_seconds: list[float]
    waiter_commands: list[int]  # Redis commands of each process that did not exchange


def storm_round(bench: Bench, renewed_elsewhere: bool) -> StormRound:
    """STORM_PROCESSES clients (as processes), a first token, 64 calm calls over them all,
    revoke-all, then 64 calls in the storm.

    With ``renewed_elsewhere``, another client (as another process would) renews the token
    just before the revoke-all, so these processes' copies of the token lag the store's.
    """
    prefix = f"bench-storm-{uuid.uuid4().hex[:8]}"
    processes = [storm_process(bench, prefix) for _ in range(STORM_PROCESSES)]
    clients = [p.client for p in processes]
    other: FleetClient | None = None
    try:
        for client in clients:
            client.request("GET", PING)  # the first token; a new account each round
        time.sleep(STORM_SETTLE)
        calm, errors = concurrent_calls(clients, STORM_CALLERS)
        if renewed_elsewhere:
            other = bench.client(prefix)
            other.manager.renew(force=True)
        before = bench.control.counters()
        commands_before = [Counter(p.commands) for p in processes]
        exchanges_before = [len(p.exchanges) for p in processes]
        bench.control.revoke_all()
        stormy, failed = concurrent_calls(clients, STORM_CALLERS)
        after = bench.control.counters()
    finally:
        for each in [*clients, other]:
            if each is not None:
                each.session.close()
                each.manager.store.redis.close()
    errors.update(failed)
    delta = counter_delta(before, after)
    exchange_seconds: list[float] = []
    waiter_commands: list[int] = []
    for process, commands, exchanged in zip(
        processes, commands_before, exchanges_before, strict=True
    ):
        exchange_seconds += process.exchanges[exchanged:]
        if len(process.exchanges) == exchanged:
            waiter_commands.append(sum((process.commands - commands).values()))
    return StormRound(
        calm,
        stormy,
        delta["exchanges.ok"],
        delta["calls.unauthorized"],
        errors,
        exchange_seconds,
        waiter_commands,
    )


@dataclass
class StormFigures:
    calm_p50: float
    calm_p99: float
    storm_p50: float
    storm_p99: float
    exchange_ms: float
    overhead_p99: float
    per_round: list[int]
    unauthorized: int
    errors: Counter[str]
    waiter_commands: float

    def rows(self, name: str) -> list[list[str]]:
        """This latency's rows of the storm's table."""
        floor = f"2 x calm p99 + exchange {self.exchange_ms:.1f} ms"
        return [
            [
                f"{name}: same calls, no storm",
                fmt(self.calm_p50, 1),
                fmt(self.calm_p99, 1),
                *["", "", ""],
            ],
            [
                f"{name}: right after revoke-all",
                fmt(self.storm_p50, 1),
                fmt(self.storm_p99, 1),
                f"max {max(self.per_round)} ({', '.join(map(str, self.per_round))})",
                str(self.unauthorized),
                str(sum(self.errors.values())),
            ],
            [
                f"{name}: overhead over the floor ({floor})",
                "",
                fmt(self.overhead_p99, 1),
                f"{fmt(self.waiter_commands, 1)} Redis commands per waiting process",
                *["", ""],
            ],
        ]


def storm_figures(rounds: list[StormRound]) -> StormFigures:
    ms = 1000.0
    calm = [x for r in rounds for x in r.calm]
    stormy = [x for r in rounds for x in r.stormy]
    calm_p99, storm_p99 = percentile(calm, 0.99) * ms, percentile(stormy, 0.99) * ms
    exchange_ms = median([x for r in rounds for x in r.exchange_seconds] or [math.nan]) * ms
    waiters = [x for r in rounds for x in r.waiter_commands]
    return StormFigures(
        calm_p50=percentile(calm, 0.5) * ms,
        calm_p99=calm_p99,
        storm_p50=percentile(stormy, 0.5) * ms,
        storm_p99=storm_p99,
        exchange_ms=exchange_ms,
        overhead_p99=storm_p99 - 2 * calm_p99 - exchange_ms,
        per_round=[r.exchanges for r in rounds],
        unauthorized=sum(r.unauthorized for r in rounds),
        errors=sum((r.errors for r in rounds), Counter()),
        waiter_commands=sum(waiters) / len(waiters) if waiters else math.nan,
    )


@dataclass(frozen=True)
class Storm(Scenario):
    """64 concurrent callers over STORM_PROCESSES clients right after revoke-all, against
    the same calls without a storm, with the token endpoint fast and slow; then revoke-all
    just after another process renewed."""

    rounds: int
    lag_rounds: int
    name: ClassVar[str] = "storm"

    def measure(self, bench: Bench) -> Result:
        bench.control.configure(lifetime=LONG_LIFETIME, revoke_on_issue=False, token_latency=0.0)
        fast = storm_figures([storm_round(bench, False) for _ in range(self.rounds)])
        lagging = [storm_round(bench, renewed_elsewhere=True) for _ in range(self.lag_rounds)]
        bench.control.configure(token_latency=SLOW_EXCHANGE)
        try:
            slow = storm_figures([storm_round(bench, False) for _ in range(self.rounds)])
        finally:
            bench.control.configure(token_latency=0.0)
        lag_errors: Counter[str] = sum((r.errors for r in lagging), Counter())
        lag_exchanges = [r.exchanges for r in lagging]
        lag_unauthorized = sum(r.unauthorized for r in lagging)
        lag_failed = sum(lag_errors.values())
        worst = max(fast.per_round + slow.per_round)
        errors = fast.errors + slow.errors
        failed = sum(errors.values())
        found: dict[str, Any] = {
            "storm_exchanges": worst,
            "storm_exchanges_per_round": fast.per_round,
            "storm_slow_exchange_exchanges_per_round": slow.per_round,
            "storm_rounds": self.rounds,
            "storm_processes": STORM_PROCESSES,
            "storm_unauthorized": fast.unauthorized,
            "storm_failed_calls": failed,
            "storm_p50_ms": round(fast.storm_p50, 2),
            "storm_p99_ms": round(fast.storm_p99, 2),
            "storm_calm_p50_ms": round(fast.calm_p50, 2),
            "storm_calm_p99_ms": round(fast.calm_p99, 2),
            "storm_p50_added_ms": round(fast.storm_p50 - fast.calm_p50, 2),
            "storm_p99_added_ms": round(fast.storm_p99 - fast.calm_p99, 2),
            "storm_exchange_ms": round(fast.exchange_ms, 2),
            "storm_overhead_p99_ms": round(fast.overhead_p99, 2),
            "storm_slow_exchange_p99_ms": round(slow.storm_p99, 2),
            "storm_slow_exchange_calm_p99_ms": round(slow.calm_p99, 2),
            "storm_slow_exchange_ms": round(slow.exchange_ms, 2),
            "storm_slow_exchange_overhead_p99_ms": round(slow.overhead_p99, 2),
            "storm_redis_cmds_per_waiter": round(fast.waiter_commands, 2),
            "storm_slow_exchange_redis_cmds_per_waiter": round(slow.waiter_commands, 2),
            "storm_after_renewal_exchanges_per_round": lag_exchanges,
            "storm_after_renewal_unauthorized": lag_unauthorized,
            "storm_after_renewal_failed_calls": lag_failed,
        }
        if errors:
            found["storm_errors"] = dict(errors)
        if lag_errors:
            found["storm_after_renewal_errors"] = dict(lag_errors)
        progress(
            f"storm: exchanges per round {fast.per_round} / slow {slow.per_round}, overhead p99 "
            f"{fast.overhead_p99:.1f} / slow {slow.overhead_p99:.1f} ms, Redis commands per "
            f"waiter {fast.waiter_commands:.1f}; after a renewal elsewhere: exchanges "
            f"{lag_exchanges}, {lag_failed} failed calls"
        )
        calls = STORM_CALLERS * len(lagging)
        lag_failures = f"{lag_failed} of {calls}"
        if lag_errors:
            lag_failures += f" ({', '.join(f'{k} {v}' for k, v in lag_errors.items())})"
        slow_name = f"{SLOW_EXCHANGE * 1000:.0f} ms"
        rows = [
            *fast.rows("exchange ~0 ms"),
            *slow.rows(f"exchange {slow_name}"),
            [
                "revoke-all just after another process renewed",
                *["", ""],
                ", ".join(map(str, lag_exchanges)),
                str(lag_unauthorized),
                lag_failures,
            ],
        ]
        goals = [
            Goal("storm exchanges per revoke-all", "1", str(worst), worst == 1),
            Goal("storm failed calls", "0", str(failed), failed == 0),
            *(
                Goal(
                    f"storm overhead p99 over the floor, exchange {name}",
                    f"<= {STORM_OVERHEAD_GOAL:g} ms",
                    fmt(f.overhead_p99, 1),
                    f.overhead_p99 <= STORM_OVERHEAD_GOAL,
                )
                for name, f in (("~0 ms", fast), (slow_name, slow))
            ),
            Goal(
                "storm Redis commands per waiting process",
                f"<= {STORM_WAITER_COMMANDS_GOAL:g}",
                fmt(fast.waiter_commands, 1),
                fast.waiter_commands <= STORM_WAITER_COMMANDS_GOAL,
            ),
            Goal(
                "storm just after a renewal elsewhere: failed calls",
                "0",
                f"{lag_failed} of {calls}",
                lag_failed == 0,
            ),
        ]
        header = ["", "p50 ms", "p99 ms", "exchanges per round", "401s", "failed calls"]
        return Result(
            title=f"2. 401 storm: {STORM_CALLERS} concurrent callers over {STORM_PROCESSES} "
            f"clients (each standing for a process), {self.rounds} rounds per exchange latency "
            "(a new account each round)",
            table=Table(header, rows),
            json=found,
            goals=goals,
        )


# -- 3. hot path --------------------------------------------------------------------------


@dataclass
class HotPathRun:
    server: str
    ours_rate: float
    raw_rate: float
    ratios: list[float]
    redis_per_call: float
    ours_cpu_us: float  # this thread's CPU time per call: the client's own cost
    raw_cpu_us: float

    @property
    def ratio(self) -> float:
        return median(self.ratios)

    @property
    def added_us(self) -> float:
        return (1 / self.ours_rate - 1 / self.raw_rate) * 1e6

    def json(self, server: str) -> dict[str, Any]:
        """This run's keys, each ending in ``server`` (which emulator it measured)."""
        return {
            f"hot_path_ratio{server}": round(self.ratio, 3),
            f"hot_path_ratios{server}": [round(r, 3) for r in self.ratios],
            f"hot_path_ours_calls_per_s{server}": round(self.ours_rate),
            f"hot_path_raw_calls_per_s{server}": round(self.raw_rate),
            f"hot_path_added_us_per_call{server}": round(self.added_us, 1),
            f"redis_ops_per_call{server}": round(self.redis_per_call, 4),
            f"hot_path_client_cpu_us_ours{server}": round(self.ours_cpu_us, 1),
            f"hot_path_client_cpu_us_raw{server}": round(self.raw_cpu_us, 1),
        }


@dataclass(frozen=True)
class HotPath(Scenario):
    """MerchantClient.request against a raw requests.Session with a fixed bearer header,
    interleaved rounds in one thread; Redis commands per call from INFO commandstats."""

    rounds: int
    calls: int
    profile_path: Path | None = None  # also profile one extra round into this file
    name: ClassVar[str] = "hot path"

    def measure(self, bench: Bench) -> Result:
        if self.profile_path is not None:
            self.profile_path.write_text("")
        bench.control.configure(lifetime=LONG_LIFETIME, revoke_on_issue=False)
        runs = [self.run(bench, bench.sandbox_url, "SandboxServer (werkzeug)")]
        with sandbox_process(bench.workdir, bench.sandbox_env, "tornado") as (url, child):
            bench.children.append(child)
            runs.append(self.run(bench, url, "same app, keep-alive (tornado)"))
        main, keepalive = runs
        found = {**main.json(""), **keepalive.json("_keepalive")}
        rows: list[list[str]] = []
        for run in runs:
            progress(
                f"hot path, {run.server}: ratio {run.ratio:.3f}, "
                f"{run.redis_per_call:.3f} Redis commands per call"
            )
            rows += [
                [
                    run.server,
                    "ours: MerchantClient.request",
                    fmt(run.ours_rate),
                    fmt(1e6 / run.ours_rate, 1),
                    fmt(run.ours_cpu_us, 1),
                    f"{run.redis_per_call:.3f}",
                ],
                [
                    "",
                    "raw requests.Session, fixed bearer",
                    fmt(run.raw_rate),
                    fmt(1e6 / run.raw_rate, 1),
                    fmt(run.raw_cpu_us, 1),
                    "0",
                ],
                [
                    "",
                    "**ours / raw** (median of rounds)",
                    f"**{run.ratio:.3f}**",
                    f"{run.added_us:+.1f}",
                    f"{run.ours_cpu_us - run.raw_cpu_us:+.1f}",
                    "",
                ],
            ]
        goals = [
            Goal(
                f"hot path calls/s, ours / raw{label}",
                f">= {HOT_PATH_GOAL}",
                f"{run.ratio:.3f}",
                run.ratio >= HOT_PATH_GOAL,
            )
            for run, label in ((main, ""), (keepalive, ", keep-alive emulator"))
        ]
        goals.append(
            Goal(
                "Redis commands per call (hot path)",
                f"<= {REDIS_OPS_GOAL:g}",
                f"{main.redis_per_call:.3f}",
                main.redis_per_call <= REDIS_OPS_GOAL,
            )
        )
        header = ["emulator served by", "", "calls/s (median round)", "us per call"]
        header += ["client CPU us per call", "Redis cmds/call"]
        return Result(
            title=f"3. Hot path: one thread, {self.rounds} interleaved rounds x "
            f"{self.calls} calls of GET {PING}",
            table=Table(header, rows),
            json=found,
            goals=goals,
            notes=[
                f"per-round ratios, {run.server}: {', '.join(f'{r:.3f}' for r in run.ratios)}"
                for run in runs
            ],
        )

    def run(self, bench: Bench, base_url: str, server: str) -> HotPathRun:
        """Interleaved rounds of ours and raw in this thread, against the emulator at base_url."""
        client = bench.client(f"bench-hot-{uuid.uuid4().hex[:8]}", base_url)
        token = client.manager.token().value  # valid for 7200 s: no renewal during the rounds
        raw = requests.Session()
        raw.headers.update({"accept": "application/json", "authorization": f"Bearer {token}"})
        url = base_url + PING

        def ours(n: int) -> None:
            for _ in range(n):
                client.request("GET", PING)

        def baseline(n: int) -> None:
            for _ in range(n):
                response = raw.get(url, timeout=TIMEOUT, allow_redirects=False)
                response.raise_for_status()
                response.json()

        ours(50)  # warm both connections and caches
        baseline(50)
        ours_rates: list[float] = []
        raw_rates: list[float] = []
        ratios: list[float] = []
        cpu: dict[str, list[float]] = {"ours": [], "raw": []}
        redis_commands = 0
        for i in range(self.rounds):
            rates: dict[str, float] = {}
            for which in ("ours", "raw") if i % 2 == 0 else ("raw", "ours"):
                counted = commands_processed(bench.store) if which == "ours" else 0
                cpu0, t0 = time.thread_time(), time.perf_counter()
                (ours if which == "ours" else baseline)(self.calls)
                elapsed = time.perf_counter() - t0
                cpu[which].append((time.thread_time() - cpu0) / self.calls * 1e6)
                if which == "ours":
                    redis_commands += commands_processed(bench.store) - counted
                rates[which] = self.calls / elapsed
            ours_rates.append(rates["ours"])
            raw_rates.append(rates["raw"])
            ratios.append(rates["ours"] / rates["raw"])
        if self.profile_path is not None:
            profiler = cProfile.Profile()
            profiler.enable()
            ours(self.calls)
            profiler.disable()
            text = io.StringIO()
            text.write(f"# {self.calls} calls of MerchantClient.request, {server}\n")
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(45)
            with self.profile_path.open("a") as out:
                out.write(text.getvalue())
            progress(f"hot path profile ({server}) appended to {self.profile_path}")
        raw.close()
        return HotPathRun(
            server,
            median(ours_rates),
            median(raw_rates),
            ratios,
            redis_commands / (self.calls * self.rounds),
            median(cpu["ours"]),
            median(cpu["raw"]),
        )


# -- 4. Celery ----------------------------------------------------------------------------

CELERYCONFIG = '''"""The bench's Celery configuration: the package defaults, plus the bare task."""

imports = ("merchant_tasks.tasks", "bare_tasks")
'''


@dataclass(frozen=True)
class Tasks(Scenario):
    """Celery: merchant_tasks.call_api against a bare task doing the same GET, one worker."""

    pairs: int
    tasks: int
    concurrency: int = 2
    name: ClassVar[str] = "celery"

    def measure(self, bench: Bench) -> Result:
        from celery import Celery
        from celery.result import ResultSet

        bench.control.configure(lifetime=LONG_LIFETIME, revoke_on_issue=False)
        prefix = f"bench-celery-{uuid.uuid4().hex[:8]}"
        # the bare task's static token: a valid one, put in Redis before the worker starts
        bench.store.set(STATIC_TOKEN_KEY, bench.client(prefix).manager.token().value)
        celery_dir = bench.workdir / "celery"
        celery_dir.mkdir()
        (celery_dir / "celeryconfig.py").write_text(CELERYCONFIG)
        pythonpath = os.pathsep.join(p for p in (str(BENCH_DIR), os.environ.get("PYTHONPATH")) if p)
        worker_env = bench.env(
            bench.settings(prefix), PYTHONPATH=pythonpath, BENCH_STATIC_TOKEN_KEY=STATIC_TOKEN_KEY
        )
        worker = bench.spawn(
            "celery-worker",
            worker_argv(self.concurrency, "-n", f"bench-{uuid.uuid4().hex[:6]}@%h"),
            env=worker_env,
            cwd=celery_dir,
        )
        # configured as the fleet's workers are: their Celery keys are under the fleet's prefix
        producer = Celery("bench-producer", set_as_current=False)
        producer.conf.update({**package_defaults(worker_env), "imports": ()})
        names = {"ours": "merchant_tasks.call_api", "bare": "bench.bare_call"}

        def batch(which: str, n: int, timeout: float) -> tuple[float, int]:
            t0 = time.perf_counter()
            results = [producer.send_task(names[which], args=["GET", PING]) for _ in range(n)]
            try:
                values = ResultSet(results).get(timeout=timeout, propagate=False)
            except Exception as exc:
                raise ScenarioError(
                    f"{which} tasks did not finish in {timeout:g} s ({type(exc).__name__}); "
                    f"worker log: {worker.log_tail()}"
                ) from exc
            elapsed = time.perf_counter() - t0
            failures = sum(1 for v in values if not (isinstance(v, dict) and v.get("ok") is True))
            return n / elapsed, failures

        try:
            for which in names:  # readiness, and every child warm: connections, token, imports
                _, failures = batch(which, 8 * self.concurrency, timeout=90)
                if failures:
                    raise ScenarioError(f"{which} warm-up tasks failed: {worker.log_tail()}")
            rates: dict[str, list[float]] = {"ours": [], "bare": []}
            ratios: list[float] = []
            failed = {"ours": 0, "bare": 0}
            for i in range(self.pairs):
                pair: dict[str, float] = {}
                for which in ("ours", "bare") if i % 2 == 0 else ("bare", "ours"):
                    pair[which], failures = batch(which, self.tasks, timeout=300)
                    failed[which] += failures
                    rates[which].append(pair[which])
                ratios.append(pair["ours"] / pair["bare"])
        finally:
            producer.close()
            worker.stop()
        ratio = median(ratios)
        ours_rate, bare_rate = median(rates["ours"]), median(rates["bare"])
        found = {
            "celery_ratio": round(ratio, 3),
            "celery_ratios": [round(r, 3) for r in ratios],
            "celery_ours_tasks_per_s": round(ours_rate, 1),
            "celery_bare_tasks_per_s": round(bare_rate, 1),
            "celery_failed_tasks": failed,
        }
        progress(f"celery: ratio {ratio:.3f} ({ours_rate:.0f} vs {bare_rate:.0f} tasks/s)")
        return Result(
            title=f"4. Celery: one worker, --pool=prefork --concurrency={self.concurrency}, "
            f"{self.pairs} interleaved pairs of {self.tasks} tasks",
            table=Table(
                ["", "tasks/s (median batch)", "failed tasks"],
                [
                    ["ours: merchant_tasks.call_api", fmt(ours_rate, 1), str(failed["ours"])],
                    ["bare task, static token", fmt(bare_rate, 1), str(failed["bare"])],
                    ["ours / bare (median of pairs)", f"{ratio:.3f}", ""],
                ],
            ),
            json=found,
            goals=[
                Goal(
                    "Celery tasks/s, call_api / bare",
                    f">= {CELERY_GOAL}",
                    f"{ratio:.3f}",
                    ratio >= CELERY_GOAL,
                )
            ],
            notes=[f"per-pair ratios: {', '.join(f'{r:.3f}' for r in ratios)}"],
        )


# -- the run ------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": library_version(),
    }


def library_version() -> str:
    """The commit measured, marked "+changes" if merchant_tasks/ differs from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args],
            cwd=BENCH_DIR.parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changes = git("status", "--porcelain", "--", "merchant_tasks")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+changes" if changes else "")


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP end the run the way Ctrl-C does: through every finally block."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: each scenario's own (the fleet's in the docstring's letters:
    Fleet(P, T, D, L, R))."""

    name: str
    fleet: Fleet
    storm: Storm
    hot_path: HotPath
    tasks: Tasks

    def scenarios(self, profile_path: Path | None) -> list[Scenario]:
        accounts = many_accounts.QUICK if self.name == "quick" else many_accounts.FULL
        return [
            self.fleet,
            self.storm,
            replace(self.hot_path, profile_path=profile_path),
            self.tasks,
            *many_accounts.scenarios(accounts),
        ]


QUICK = Plan("quick", Fleet(2, 4, 4.0, 3.0, 1.0), Storm(3, 1), HotPath(5, 300), Tasks(2, 100))
FULL = Plan("full", Fleet(4, 4, 20.0, 4.0, 1.5), Storm(10, 3), HotPath(7, 2000), Tasks(5, 400))


@dataclass
class Findings:
    """What a run found: each scenario's result, what could not run, what was left behind."""

    results: list[Result] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)

    def json(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for result in self.results:
            found.update(result.json)
        return found

    def goals(self) -> list[Goal]:
        return [goal for result in self.results for goal in result.goals]


def run(plan: Plan, profile_path: Path | None, only: str | None = None) -> Findings:
    findings = Findings()
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mt-bench-")))
        secret_file = workdir / "api-secret"
        secret_file.write_text(secrets.token_urlsafe(24))
        secret_file.chmod(0o600)
        redis_url, redis_child = stack.enter_context(private_redis(workdir))
        base_env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("MERCHANT_")},
            "MERCHANT_API_KEY": API_KEY,
            "MERCHANT_API_SECRET_FILE": str(secret_file),
        }
        sandbox_url, sandbox_child = stack.enter_context(sandbox_process(workdir, base_env))
        control = SandboxControl(sandbox_url)
        stack.callback(control.close)
        store = redis.Redis.from_url(redis_url)
        stack.callback(store.close)
        bench = Bench(workdir, redis_url, sandbox_url, secret_file, control, store, base_env)
        bench.children += [redis_child, sandbox_child]
        for scenario in plan.scenarios(profile_path):
            if only is not None and scenario.name != only:
                continue
            started = time.monotonic()
            try:
                result = scenario.measure(bench)
            except Exception as exc:
                log.exception("scenario %s could not run", scenario.name)
                findings.errors.append(compact(f"{scenario.name}: {type(exc).__name__}: {exc}"))
            else:
                findings.results.append(result)
                findings.errors += result.errors
            progress(f"{scenario.name} done in {time.monotonic() - started:.1f} s")
    findings.leftovers = [child.name for child in bench.children if child.group_alive()]
    for child in bench.children:  # reported above, and not left running on the machine
        if child.group_alive():
            child.stop()
    return findings


def report(plan: Plan, findings: Findings, run_facts: dict[str, Any], elapsed: float) -> int:
    """The markdown report, then the JSON line; ``run_facts`` are the run's own keys."""
    fleet = plan.fleet
    host = machine()
    load = run_facts.get("load_average_1min", ["?", "?"])
    goals = findings.goals()
    out = [
        f"## merchant-tasks bench ({plan.name} run, {elapsed:.0f} s)",
        "",
        f"{host['date']}; commit {host['commit']}; {host['nproc']} CPUs ({host['cpu']}); "
        f"Python {host['python']}; 1-minute load average {load[0]} before, {load[1]} after",
        "",
    ]
    for result in findings.results:
        out += [result.section(), ""]
    goals_table = Table(
        ["goal", "target", "measured", "met"],
        [[goal.name, goal.target, goal.measured, goal.verdict] for goal in goals],
    )
    out += ["### Goals", "", goals_table.markdown(), ""]
    for error in findings.errors:
        out.append(f"**could not run**: {error}")
    if findings.leftovers:
        out.append(f"**processes left behind**: {', '.join(findings.leftovers)}")
    found = {**findings.json(), **run_facts}
    summary: dict[str, Any] = {key: found.get(key) for key in HEADLINE_KEYS}
    summary.update(found)
    summary.update(
        mode=plan.name,
        parameters={
            "P": fleet.processes,
            "T": fleet.threads,
            "D": fleet.duration,
            "L": fleet.lifetime,
            "R": fleet.advisory,
            "mandatory": fleet.mandatory,
            "beat_interval": fleet.renew_interval,
            "storm_callers": STORM_CALLERS,
        },
        goals_missed=[goal.name for goal in goals if goal.met is False],
        errors=findings.errors,
        leftover_processes=findings.leftovers,
        elapsed_s=round(elapsed, 1),
        machine=host,
    )
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()
    return 1 if findings.errors or findings.leftovers else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smoke test, under a minute")
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="FILE",
        help="also profile one extra round of the hot path with cProfile into FILE",
    )
    parser.add_argument(
        "--only",
        choices=[scenario.name for scenario in QUICK.scenarios(None)],
        help="run one scenario only (to compare two versions of one figure quickly)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # 64 storm callers share a pool of 32 connections by design; the overflow is not news
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    plan = QUICK if args.quick else FULL
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    commit_at_start = library_version()
    try:
        with stopped_by_signals():
            findings = run(plan, args.profile, args.only)
    except KeyboardInterrupt as exc:
        progress(f"interrupted ({exc or 'Ctrl-C'}); every process it started is stopped")
        return 130
    run_facts = {
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "commit_at_start": commit_at_start,
    }
    return report(plan, findings, run_facts, time.monotonic() - started)


if __name__ == "__main__":
    sys.exit(main())
