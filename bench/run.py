"""Benchmarks of merchant-tasks against the obvious alternatives, measured in one run.

    python bench/run.py            # full run, a few minutes
    python bench/run.py --quick    # smoke test, under a minute; fails only if it cannot run

Everything runs on loopback against a private ``redis-server`` (so INFO commandstats counts
only our traffic) and the sandbox emulator in its own process. This module is the runner:
it parses the arguments, picks the plan's scenarios, runs them in turn and prints what they
found. The scenarios (see README.md) live in ``scenarios/``, one module per family:

1. fleet economy (``fleet``): P processes x T threads calling for D seconds with token
   lifetime L and advisory window R; ours (plus a beat process) against authlib's
   per-process cache and a lock-free shared Redis cache, with the emulator's
   revoke-on-issue off and on;
2. 401 storm (``storm``): 64 concurrent callers over 4 clients (as 4 processes) right after
   revoke-all, against the same 64 calls without a storm, with the token endpoint taking
   ~0 ms and 100 ms; overhead over the floor (2 x calm p99 + exchange) and Redis commands
   per process that waited for another's renewal;
3. hot path (``hot_path``): MerchantClient.request against a raw requests.Session with a
   fixed bearer header, interleaved rounds; Redis commands per call from INFO commandstats;
4. Celery (``celery_tasks``): merchant_tasks.call_api against a bare task doing the same
   GET, same worker;
5, 6, 8. many accounts (``many_accounts``): beat's check of 1,000 accounts against the old
   loop, a cold start of 1,000 accounts through beat and a worker at a fleet-wide cap of 20
   exchanges a second, and beat's check of 10,000 accounts and a worker's memory
   configured with them;
7. sealing (``sealing``): the hot path with the token sealed at rest against the same in
   clear.

The output is markdown tables, then one JSON object as the last line. The exit status is 1
only when a scenario could not run; a missed goal is reported, never an error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import platform
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

import redis

from harness import (
    API_KEY,
    BENCH_DIR,
    Bench,
    SandboxControl,
    private_redis,
    progress,
    sandbox_process,
)
from scenarios.celery_tasks import CeleryTasks
from scenarios.event_loop import EventLoop
from scenarios.fleet import Fleet
from scenarios.hot_path import HotPath
from scenarios.many_accounts import AccountsCheck, ColdStart, TenThousandAccounts
from scenarios.scenario import Goal, Result, Scenario, Table, compact
from scenarios.sealing import Sealing
from scenarios.storm import STORM_CALLERS, Storm

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
log = logging.getLogger("bench")


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
    """One run's scenarios, in the order they run, each with its sizes (the fleet's in the
    docstring's letters: Fleet(P, T, D, L, R))."""

    name: str
    scenarios: tuple[Scenario, ...]

    @property
    def fleet(self) -> Fleet:
        return next(s for s in self.scenarios if isinstance(s, Fleet))

    def picked(self, only: str | None, profile_path: Path | None) -> list[Scenario]:
        """Every scenario, or the one named ``only``; the hot path also profiled into
        ``profile_path`` when given."""
        return [
            replace(s, profile_path=profile_path) if isinstance(s, HotPath) else s
            for s in self.scenarios
            if only in (None, s.name)
        ]


QUICK = Plan(
    "quick",
    (
        Fleet(processes=2, threads=4, duration=4.0, lifetime=3.0, advisory=1.0),
        Storm(rounds=3, lag_rounds=1),
        HotPath(rounds=5, calls=300),
        CeleryTasks(pairs=2, tasks=100),
        AccountsCheck(accounts=1000),
        # 15 s (lifetime - renew_before) for the first tokens; 5 s was too short under load
        ColdStart(
            accounts=100, lifetime=25.0, renew_before=10.0, renew_mandatory=2.0, renew_interval=0.5
        ),
        Sealing(rounds=3, calls=100),
        TenThousandAccounts(),
        EventLoop(rounds=3, calls=200, lag_seconds=4.0, revoke_at=1.0),
    ),
)
FULL = Plan(
    "full",
    (
        Fleet(processes=4, threads=4, duration=20.0, lifetime=4.0, advisory=1.5),
        Storm(rounds=10, lag_rounds=3, repeated_rounds=3),
        HotPath(rounds=7, calls=2000),
        CeleryTasks(pairs=5, tasks=400),
        AccountsCheck(accounts=1000),
        # 1,000 first tokens at 20 a second take 50 s, well inside the 120 s before the first
        # ones enter their advisory window
        ColdStart(
            accounts=1000,
            lifetime=240.0,
            renew_before=120.0,
            renew_mandatory=5.0,
            renew_interval=1.0,
        ),
        Sealing(rounds=9, calls=1000),
        TenThousandAccounts(),
        EventLoop(rounds=7, calls=1000),
    ),
)


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
        for scenario in plan.picked(only, profile_path):
            started = time.monotonic()
            try:
                result = scenario.measure(bench)
            except Exception as exc:
                log.exception("scenario %s could not run", scenario.name)
                findings.errors.append(compact(f"{scenario.name}: {type(exc).__name__}: {exc}"))
            else:
                findings.results.append(result)
                findings.errors += result.errors
                undeclared = scenario.undeclared_keys(result)
                if undeclared:  # scripts outside the project read these keys
                    findings.errors.append(undeclared)
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
        choices=[scenario.name for scenario in QUICK.scenarios],
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
