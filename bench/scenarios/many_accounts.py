"""Many accounts: the scenarios of one fleet serving a thousand or ten thousand of them.

5. beat's check with nothing due: ``due.py``'s one pipeline against the old loop (each
   account's ``manager.renew()``, one GET each), same accounts, same Redis, same run;
   round trips counted as the packets the Redis connection sends;
6. a cold start through the fleet: a real beat and worker serving N accounts (from
   ``MERCHANT_ACCOUNTS_SOURCE``, ``accounts_source.accounts``) with no token stored,
   under a fleet-wide exchange rate (``MERCHANT_MAX_EXCHANGES_PER_SECOND``): the busiest
   second, the time to every first token, and how long a call for an account not yet
   served waits meanwhile; then the renewals, spread over the advisory window;
8. ten thousand accounts: beat's check, `merchant-tasks status` over them (its wall time,
   and its reading's round trips), and a real worker configured with them.

The children of scenarios 6 and 8 learn their accounts from ``accounts_source`` (a light
module of its own: `status` imports it, and this one imports Celery).
"""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import redis

from accounts_source import ACCOUNTS_SOURCE, account, shop
from harness import (
    LONG_LIFETIME,
    PING,
    Bench,
    ScenarioError,
    median,
    round_trip_counting_redis,
    timed_round_trips,
    wait_until,
    worker_argv,
)
from merchant_tasks.accounts import AccountClients, client_for
from merchant_tasks.ops.status import account_statuses
from merchant_tasks.renewal.due import due_accounts, namespace_of
from merchant_tasks.settings import FleetSettings, Secret, Settings
from merchant_tasks.store.keys import AccountKeys
from merchant_tasks.token import Token
from merchant_tasks.worker.app import package_defaults
from scenarios.scenario import Goal, Result, Scenario, Table, yes_no

CHECK_REPEATS = 7  # timed checks of each kind; the median is reported
STATUS_TIMEOUT = 300.0  # seconds for `status` of 10,000 accounts (one account at a time
# took about 25 s; pipelined, a few)
COLD_START_GOAL_SECONDS = 90.0  # 1,000 accounts at 20 a second: their first tokens within
BURST_ALLOWANCE = 1.2  # the busiest second: the rate and the bucket's 0.2 s of it
CALL_WAIT_GOAL = 10.0  # seconds a call for an account not yet served may wait meanwhile
STATUS_GOAL_SECONDS = 0.5  # `status --json` of 10,000 accounts, start-up to the last byte
STATUS_GOAL_ROUND_TRIPS = 10  # of its reading
WORKER_RSS_GOAL_MB = 80.0  # the largest process of a worker configured with 10,000 accounts
STATUS_RUNS = 3  # `status` and its floor, alternated: the medians are reported
FLOOR_PROGRAM = """\
import json, sys
import redis
names = open(sys.argv[2]).read().split()
tokens = [json.loads(raw) for raw in redis.Redis.from_url(sys.argv[1]).mget(names) if raw]
sys.stdout.write(json.dumps({"accounts": tokens}, sort_keys=True))
"""  # the floor of `status`: start Python, import redis-py, read every stored token in one
# round trip, parse each, write them as JSON; the machine's own figure to judge status by


# -- 5. beat's check ------------------------------------------------------------------------


@dataclass(frozen=True)
class AccountsCheck(Scenario):
    """Beat's check of many accounts with nothing due, against the old loop."""

    accounts: int
    name: ClassVar[str] = "accounts check"

    def measure(self, bench: Bench) -> Result:
        prefix = f"bench-check-{uuid.uuid4().hex[:8]}"
        template = Settings(
            api_key=bench.env()["MERCHANT_API_KEY"],
            secret=Secret(path=bench.secret_file),
            base_url=bench.sandbox_url,
            fleet=FleetSettings(redis_url=bench.redis_url),
        )
        accounts = {
            f"shop-{n}": replace(
                template, fleet=replace(template.fleet, key_prefix=f"{prefix}-{n}")
            )
            for n in range(self.accounts)
        }
        counting = round_trip_counting_redis(bench.redis_url)
        try:
            _store_fresh_tokens(counting, list(accounts.values()))  # nothing is due

            def new_check() -> None:
                if due_accounts(accounts, lambda url: counting):
                    raise ScenarioError("the check found accounts due; every token is fresh")

            old_fleet = AccountClients(accounts)
            # the old loop on the counting client
            old_fleet._redis_by_url[bench.redis_url] = counting

            def old_loop() -> None:  # renew_token before: each account's manager, one by one
                for name in old_fleet.accounts:
                    old_fleet.get(name).manager.renew()

            # the first run builds every client too
            old_first_ms, old_first_trips = timed_round_trips(old_loop)
            samples: dict[str, list[tuple[float, int]]] = {"new": [], "old": []}
            for i in range(CHECK_REPEATS):
                for which in ("new", "old") if i % 2 == 0 else ("old", "new"):
                    samples[which].append(
                        timed_round_trips(new_check if which == "new" else old_loop)
                    )
        finally:
            keys = list(counting.scan_iter(match=f"{prefix}-*", count=1000))
            for start in range(0, len(keys), 1000):
                counting.delete(*keys[start : start + 1000])
            counting.close()
        new_ms, old_ms = (median([ms for ms, _ in samples[w]]) for w in ("new", "old"))
        new_trips = max(trips for _, trips in samples["new"])
        old_trips = max(trips for _, trips in samples["old"])
        return Result(
            title=f"5. Beat's check, {self.accounts} accounts, nothing due "
            f"(median of {CHECK_REPEATS} interleaved runs)",
            table=Table(
                ["", "ms", "Redis round trips"],
                [
                    ["ours: one pipeline (due.py)", f"{new_ms:.2f}", str(new_trips)],
                    ["old loop: manager.renew() per account", f"{old_ms:.2f}", str(old_trips)],
                    [
                        "old loop, first run (builds every client)",
                        f"{old_first_ms:.1f}",
                        str(old_first_trips),
                    ],
                ],
            ),
            json={
                "accounts_check_accounts": self.accounts,
                "accounts_check_ms": round(new_ms, 2),
                "accounts_check_redis_roundtrips": new_trips,
                "accounts_check_old_loop_ms": round(old_ms, 2),
                "accounts_check_old_loop_redis_roundtrips": old_trips,
                "accounts_check_old_loop_first_ms": round(old_first_ms, 1),
                "accounts_check_old_loop_first_redis_roundtrips": old_first_trips,
            },
            goals=[
                Goal(
                    f"beat's check of {self.accounts} accounts, nothing due: Redis round trips",
                    "1",
                    str(new_trips),
                    new_trips == 1,
                )
            ],
        )


# -- 6. cold start through the fleet --------------------------------------------------------


@dataclass(frozen=True)
class ColdStart(Scenario):
    """Many accounts with no token, through one beat and one worker, until each renewed."""

    accounts: int
    lifetime: float  # seconds, the emulator's tokens
    renew_before: float  # the advisory window, seconds
    renew_mandatory: float  # seconds
    renew_interval: float  # beat's, seconds
    cap: float = 20.0  # MERCHANT_MAX_EXCHANGES_PER_SECOND
    name: ClassVar[str] = "cold start"

    def measure(self, bench: Bench) -> Result:
        bench.control.configure(lifetime=self.lifetime, revoke_on_issue=False, key_family=True)
        prefix = f"bench-cold-{uuid.uuid4().hex[:8]}"
        env = bench.env(
            BENCH_ACCOUNTS=str(self.accounts),
            BENCH_API_KEY=bench.env()["MERCHANT_API_KEY"],
            MERCHANT_KEY_PREFIX=prefix,
            MERCHANT_MAX_EXCHANGES_PER_SECOND=f"{self.cap:g}",
            MERCHANT_ACCOUNTS_SOURCE=ACCOUNTS_SOURCE,
            MERCHANT_TOKEN_LIFETIME=f"{self.lifetime:g}",
            MERCHANT_RENEW_BEFORE=f"{self.renew_before:g}",
            MERCHANT_RENEW_MANDATORY=f"{self.renew_mandatory:g}",
            MERCHANT_RENEW_INTERVAL=f"{self.renew_interval:g}",
        )
        del env["MERCHANT_API_KEY"]  # only the source's accounts, no "default" one
        base = Settings.from_env({**env, "MERCHANT_API_KEY": env["BENCH_API_KEY"]})
        accounts = [account(base, n) for n in range(self.accounts)]
        workdir = bench.workdir / "cold-start"
        workdir.mkdir()
        celery = [sys.executable, "-m", "celery", "-A", "merchant_tasks"]
        namespaces = [namespace_of(settings) for settings in accounts]
        store = bench.store

        def generations() -> list[int]:
            pipe = store.pipeline(transaction=False)
            for namespace in namespaces:
                pipe.get(AccountKeys.of(namespace).generation)
            return [int(g or 0) for g in pipe.execute()]

        def tokens() -> list[Token]:
            pipe = store.pipeline(transaction=False)
            for namespace in namespaces:
                pipe.get(AccountKeys.of(namespace).token)
            return [Token.from_json(raw) for raw in pipe.execute()]

        exchanges_before = bench.control.counters()["exchanges"]["ok"]
        seconds, micros = store.time()
        started = seconds + micros / 1e6
        worker = bench.spawn(
            "cold-start-worker",
            worker_argv(2, "-Q", "merchant-renewal", "-n", f"bench-cold-{uuid.uuid4().hex[:6]}@%h"),
            env=env,
            cwd=workdir,
        )
        beat = bench.spawn(
            "cold-start-beat",
            [*celery, "beat", "-s", str(workdir / "beat-schedule"), "--loglevel=WARNING"],
            env=env,
            cwd=workdir,
        )
        try:
            wait_until(lambda: sum(generations()) > 0, "the first exchange", timeout=60)
            call = _call_unserved(accounts, generations)
            wait_until(
                lambda: min(generations()) >= 1,
                "every account's first token",
                timeout=self.lifetime - self.renew_before,
            )
            first = tokens()
            wait_until(
                lambda: min(generations()) >= 2,
                "every account's renewal",
                timeout=self.lifetime + 30,
            )
        finally:
            beat.stop()
            worker.stop()
        exchanges = bench.control.counters()["exchanges"]["ok"] - exchanges_before
        stored = generations()
        pipe = store.pipeline(transaction=False)
        for namespace in namespaces:
            pipe.zrange(AccountKeys.of(namespace).exchange_log, 0, -1, withscores=True)
        logs: list[list[tuple[bytes, float]]] = pipe.execute()
        per_account = [sorted(score for _, score in log) for log in logs]
        # one exchange per renewal: every exchange stored a generation (accounts renewing
        # early in the window renew again while the last ones take their first renewal)
        once_each = exchanges == sum(stored) and all(
            len(times) == generation for times, generation in zip(per_account, stored, strict=True)
        )
        renewals = [times[1] for times in per_account if len(times) >= 2]
        bursts = [times[0] for times in per_account if times]
        in_time = sum(
            1
            for token, times in zip(first, per_account, strict=True)
            if len(times) >= 2 and times[1] < token.expires_at - self.renew_mandatory
        )
        scheduled = sum(1 for log in logs for member, _ in log if b":scheduled:ok" in member)
        renewal_rate, burst_rate = _max_per_second(renewals), _max_per_second(bursts)
        busiest = _max_per_second([t for times in per_account for t in times])
        first_tokens_s = max(bursts) - started
        spread = max(renewals) - min(renewals) if renewals else 0.0
        allowed = math.floor(self.cap * BURST_ALLOWANCE)
        return Result(
            title=f"6. Cold start through the fleet: {self.accounts} accounts, one beat, "
            f"one worker (prefork, 2 children), at most {self.cap:g} exchanges a second; "
            f"lifetime {self.lifetime:g} s, advisory window {self.renew_before:g} s, "
            f"mandatory {self.renew_mandatory:g} s, beat every {self.renew_interval:g} s",
            table=Table(
                ["", "value"],
                [
                    ["most exchanges in one second (first tokens and renewals)", str(busiest)],
                    ["first tokens: most exchanges in one second", str(burst_rate)],
                    ["every first token stored after (s, from the start)", f"{first_tokens_s:.1f}"],
                    [
                        "a call for an account not yet served answered in (s)",
                        f"{call.seconds:.2f} ({'no token yet' if call.unserved else 'served'})",
                    ],
                    ["renewals: most exchanges in one second (spread points)", str(renewal_rate)],
                    ["renewals spread over (s)", f"{spread:.1f}"],
                    [
                        "renewed before their mandatory window",
                        f"{in_time} of {self.accounts}",
                    ],
                    ["exchanges (emulator) / accounts", f"{exchanges} / {self.accounts}"],
                    ["one exchange per stored generation, every account", str(once_each)],
                ],
            ),
            json={
                "cold_start_max_exchanges_per_s": busiest,
                "cold_start_seconds": round(first_tokens_s, 1),
                "cold_start_call_wait_s": round(call.seconds, 3),
                "cold_start_call_account_unserved": call.unserved,
                "cold_start_cap_per_s": self.cap,
                "accounts_cold_start_accounts": self.accounts,
                "accounts_cold_start_max_exchanges_per_s": renewal_rate,
                "accounts_cold_start_first_burst_max_exchanges_per_s": burst_rate,
                "accounts_cold_start_renewals_spread_s": round(spread, 1),
                "accounts_cold_start_renewed_before_mandatory": in_time,
                "accounts_cold_start_exchanges": exchanges,
                "accounts_cold_start_one_exchange_each": once_each,
                "accounts_cold_start_scheduled_exchanges": scheduled,
            },
            goals=[
                Goal(
                    f"cold start: most exchanges in one second (cap {self.cap:g})",
                    f"<= {allowed}",
                    str(busiest),
                    busiest <= allowed,
                ),
                Goal(
                    f"cold start: every first token within (s, {self.accounts} accounts)",
                    f"<= {COLD_START_GOAL_SECONDS:g}",
                    f"{first_tokens_s:.1f}",
                    first_tokens_s <= COLD_START_GOAL_SECONDS,
                ),
                Goal(
                    "cold start: a call for an account not yet served, answered within (s)",
                    f"<= {CALL_WAIT_GOAL:g}",
                    f"{call.seconds:.2f}",
                    call.unserved and call.seconds <= CALL_WAIT_GOAL,
                ),
                Goal(
                    "cold start: accounts renewed before their mandatory window",
                    str(self.accounts),
                    str(in_time),
                    in_time == self.accounts,
                ),
                Goal("cold start: one exchange per renewal", "yes", yes_no(once_each), once_each),
            ],
        )


@dataclass(frozen=True)
class CallWait:
    seconds: float  # from sending the call to its answer
    unserved: bool  # the account had no token when the call was sent


def _call_unserved(accounts: list[Settings], generations: Callable[[], list[int]]) -> CallWait:
    """One call, from this process, for the last account still without a token."""
    waiting = [n for n, generation in enumerate(generations()) if generation == 0]
    client = client_for(accounts[waiting[-1] if waiting else -1])
    try:
        t0 = time.perf_counter()
        client.request("GET", PING)
        return CallWait(time.perf_counter() - t0, bool(waiting))
    finally:
        client.session.close()


def _max_per_second(times: list[float]) -> int:
    """The most events in any one-second span."""
    ordered = sorted(times)
    best, start = 0, 0
    for end, t in enumerate(ordered):
        while t - ordered[start] >= 1.0:
            start += 1
        best = max(best, end - start + 1)
    return best


# -- 8. ten thousand accounts ----------------------------------------------------------------


TEN_THOUSAND = 10_000


@dataclass(frozen=True)
class TenThousandAccounts(Scenario):
    """Beat's check and `status` of 10,000 accounts, and a real worker configured with
    them."""

    name: ClassVar[str] = "10k accounts"

    def measure(self, bench: Bench) -> Result:
        from celery import Celery

        bench.control.configure(lifetime=LONG_LIFETIME, revoke_on_issue=False, key_family=True)
        prefix = f"bench-10k-{uuid.uuid4().hex[:8]}"
        env = bench.env(
            BENCH_ACCOUNTS=str(TEN_THOUSAND),
            BENCH_API_KEY=bench.env()["MERCHANT_API_KEY"],
            MERCHANT_KEY_PREFIX=prefix,
            MERCHANT_ACCOUNTS_SOURCE=ACCOUNTS_SOURCE,
        )
        del env["MERCHANT_API_KEY"]
        base = Settings.from_env({**env, "MERCHANT_API_KEY": env["BENCH_API_KEY"]})
        accounts = {shop(n): account(base, n) for n in range(TEN_THOUSAND)}
        called = shop(TEN_THOUSAND - 1)  # no token: the worker's call exchanges for it
        counting = round_trip_counting_redis(bench.redis_url)
        workdir = bench.workdir / "10k"
        workdir.mkdir()
        try:
            _store_fresh_tokens(counting, [s for name, s in accounts.items() if name != called])

            def check() -> None:
                if due_accounts(accounts, lambda url: counting) != [called]:
                    raise ScenarioError("the check found other accounts due than the one")

            samples = [timed_round_trips(check) for _ in range(CHECK_REPEATS)]
            status = _status(accounts, env, workdir, counting, bench.redis_url)
            worker = bench.spawn(
                "10k-worker",
                worker_argv(2, "-n", f"bench-10k-{uuid.uuid4().hex[:6]}@%h"),
                env=env,
                cwd=workdir,
            )
            # configured as the fleet's workers are: their Celery keys are under its prefix
            producer = Celery("bench-10k", set_as_current=False)
            producer.conf.update({**package_defaults(env), "imports": ()})
            t0 = time.perf_counter()
            answer = producer.send_task(
                "merchant_tasks.call_api", args=["GET", PING], kwargs={"account": called}
            ).get(timeout=120)
            call_s = time.perf_counter() - t0
            rss_mb = _largest_rss_mb(worker.process.pid)
            worker.stop()
            producer.close()
        finally:
            keys = list(counting.scan_iter(match=f"{prefix}:*", count=1000))
            for start in range(0, len(keys), 1000):
                counting.delete(*keys[start : start + 1000])
            counting.close()
        check_ms = median([ms for ms, _ in samples])
        trips = max(trips for _, trips in samples)
        return Result(
            title=f"8. Ten thousand accounts: beat's check (median of {CHECK_REPEATS}), "
            f"`status` (median of {STATUS_RUNS}, beside its floor), and a worker (prefork, 2 "
            "children) configured with them serving one call",
            table=Table(
                ["", "value"],
                [
                    ["beat's check of 10,000 accounts (ms)", f"{check_ms:.1f}"],
                    ["its Redis round trips", str(trips)],
                    ["`status --json` of 10,000 accounts (s)", f"{status.seconds:.2f}"],
                    ["its CPU time, user and system (s)", f"{status.cpu_seconds:.2f}"],
                    [
                        "its floor: a bare redis-py program reading the tokens (s)",
                        f"{status.floor_seconds:.2f}",
                    ],
                    ["`status` / its floor", f"{status.seconds / status.floor_seconds:.2f}"],
                    ["its Redis round trips (reading the accounts)", str(status.round_trips)],
                    ["worker: largest process RSS after one call (MB)", f"{rss_mb:.1f}"],
                    ["the call (first token of its account, s)", f"{call_s:.2f}"],
                ],
            ),
            json={
                "accounts_10k_check_ms": round(check_ms, 1),
                "accounts_10k_check_roundtrips": trips,
                "accounts_10k_status_s": round(status.seconds, 2),
                "accounts_10k_status_roundtrips": status.round_trips,
                "accounts_10k_worker_rss_mb": round(rss_mb, 1),
                "accounts_10k_call_s": round(call_s, 2),
                "accounts_10k_call_ok": answer == {"ok": True},
                "accounts_10k_status_cpu_s": round(status.cpu_seconds, 2),
                "accounts_10k_status_floor_s": round(status.floor_seconds, 2),
            },
            goals=[
                Goal(
                    "beat's check of 10,000 accounts: round trips", "<= 10", str(trips), trips <= 10
                ),
                Goal(
                    "beat's check of 10,000 accounts: ms",
                    "< 500",
                    f"{check_ms:.0f}",
                    check_ms < 500,
                ),
                Goal(
                    "`status --json` of 10,000 accounts: s",
                    f"<= {STATUS_GOAL_SECONDS:g}",
                    f"{status.seconds:.2f}",
                    status.seconds <= STATUS_GOAL_SECONDS,
                ),
                Goal(
                    "`status` of 10,000 accounts: round trips",
                    f"<= {STATUS_GOAL_ROUND_TRIPS}",
                    str(status.round_trips),
                    status.round_trips <= STATUS_GOAL_ROUND_TRIPS,
                ),
                Goal(
                    "worker configured with 10,000 accounts: largest process RSS (MB)",
                    f"<= {WORKER_RSS_GOAL_MB:g}",
                    f"{rss_mb:.1f}",
                    rss_mb <= WORKER_RSS_GOAL_MB,
                ),
            ],
        )


@dataclass(frozen=True)
class StatusRun:
    seconds: float  # the command's wall time: start-up, loading the accounts, reading, JSON
    cpu_seconds: float  # its CPU time (user and system): on a loaded machine, the wall time
    # is mostly waiting for a core
    round_trips: int  # of its reading (``AccountClients.statuses``)
    floor_seconds: float  # FLOOR_PROGRAM's wall time over the same tokens


def _status(
    accounts: dict[str, Settings],
    env: dict[str, str],
    workdir: Path,
    counting: redis.Redis,
    redis_url: str,
) -> StatusRun:
    """`merchant-tasks status --json` over the accounts, as an operator runs it, alternated
    with its floor (FLOOR_PROGRAM over the same tokens, same interpreter and packages),
    STATUS_RUNS times each; then the same reading in this process on the counting
    connection (its packets: round trips)."""
    names = workdir / "token-keys.txt"
    names.write_text("\n".join(AccountKeys.of(namespace_of(s)).token for s in accounts.values()))
    status = [sys.executable, "-m", "merchant_tasks.ops.cli", "status", "--json"]
    floor = [sys.executable, "-c", FLOOR_PROGRAM, redis_url, str(names)]
    runs: list[tuple[float, float]] = []
    floors: list[float] = []
    for _ in range(STATUS_RUNS):
        seconds, cpu_seconds, shown = _timed_child(status, env, workdir)
        if len(shown) != len(accounts):
            raise ScenarioError(f"status showed {len(shown)} accounts")
        runs.append((seconds, cpu_seconds))
        seconds, _, read = _timed_child(floor, env, workdir)
        if len(read) != len(accounts) - 1:  # the account left without a token
            raise ScenarioError(f"the floor read {len(read)} tokens")
        floors.append(seconds)
    fleet = AccountClients(accounts)
    fleet._redis_by_url[redis_url] = counting  # its reading on the counting connection
    _, round_trips = timed_round_trips(lambda: account_statuses(fleet))
    return StatusRun(
        seconds=median([seconds for seconds, _ in runs]),
        cpu_seconds=median([cpu for _, cpu in runs]),
        round_trips=round_trips,
        floor_seconds=median(floors),
    )


def _timed_child(
    argv: list[str], env: dict[str, str], workdir: Path
) -> tuple[float, float, list[object]]:
    """Run ``argv`` to its end: its wall and CPU seconds, and the "accounts" of the JSON it
    printed (`status` exits 1 here: one account has no token yet)."""
    cpu_before = _children_cpu()
    t0 = time.perf_counter()
    done = subprocess.run(
        argv, env=env, cwd=workdir, capture_output=True, timeout=STATUS_TIMEOUT, check=False
    )
    seconds = time.perf_counter() - t0
    if not done.stdout:
        raise ScenarioError(f"{argv[1:3]} exited {done.returncode}: {done.stderr[-300:]!r}")
    shown: list[object] = json.loads(done.stdout).get("accounts", [])
    return seconds, _children_cpu() - cpu_before, shown


def _children_cpu() -> float:
    """CPU seconds (user and system) of this process's children that have ended."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _store_fresh_tokens(client: redis.Redis, accounts: list[Settings]) -> None:
    """A fresh token for each of ``accounts``, so that beat's check finds them not due."""
    seconds, micros = client.time()
    now = seconds + micros / 1e6
    pipe = client.pipeline(transaction=False)
    for settings in accounts:
        token = Token("bench-token", now, now + settings.token_lifetime, 1)
        pipe.set(AccountKeys.of(namespace_of(settings)).token, token.to_json(), ex=3600)
    pipe.execute()


def _largest_rss_mb(session: int) -> float:
    """The largest resident set (MB) among the processes of a child's session (Linux)."""
    largest = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[3]) == session:  # the session id, after state, ppid, pgrp
            status = (stat.parent / "status").read_text()
            line = next(x for x in status.splitlines() if x.startswith("VmRSS:"))
            largest = max(largest, int(line.split()[1]))
    return largest / 1024
