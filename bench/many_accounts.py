"""A thousand accounts, and tokens sealed at rest: the scenarios ``run.py`` calls.

5. beat's check with nothing due: ``due.py``'s one pipeline against the old loop (each
   account's ``manager.renew()``, one GET each), same accounts, same Redis, same run;
   round trips counted as the packets the Redis connection sends;
6. a cold start through the fleet: a real beat and worker serving N accounts (from
   ``MERCHANT_ACCOUNTS_SOURCE``, this module's ``accounts_source``) with no token stored,
   under a fleet-wide exchange rate (``MERCHANT_MAX_EXCHANGES_PER_SECOND``): the busiest
   second, the time to every first token, and how long a call for an account not yet
   served waits meanwhile; then the renewals, spread over the advisory window;
7. the hot path with the token sealed at rest against the same calls in clear;
8. ten thousand accounts: beat's check, `merchant-tasks status` over them (its wall time,
   and its reading's round trips), and a real worker configured with them.

Also the accounts source of the worker in scenario 6: ``many_accounts:accounts_source``
reads BENCH_ACCOUNTS (how many); the accounts share the fleet's key prefix, each with an
API key of the emulator's key family (``<key>.shop-<n>``, one secret).
"""

from __future__ import annotations

import base64
import json
import math
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import redis
from harness import (
    BENCH_DIR,
    SandboxControl,
    ScenarioError,
    median,
    sandbox_process,
    wait_until,
    worker_argv,
)
from redis.connection import Connection
from scenario import Goal, Result, Scenario, Table, yes_no

from merchant_tasks.accounts import AccountClients, FleetClient, client_for
from merchant_tasks.ops.status import account_statuses
from merchant_tasks.renewal.due import due_accounts, namespace_of
from merchant_tasks.settings import FleetSettings, Secret, Settings
from merchant_tasks.store.keys import AccountKeys
from merchant_tasks.token import Token
from merchant_tasks.worker.app import package_defaults

if TYPE_CHECKING:
    from run import Bench

PING = "/open-api/v1/ping"
CHECK_REPEATS = 7  # timed checks of each kind; the median is reported
STATUS_TIMEOUT = 300.0  # seconds for `status` of 10,000 accounts (one account at a time
# took about 25 s; pipelined, a few)


@dataclass(frozen=True)
class AccountsPlan:
    check_accounts: int
    accounts: int  # of the cold start
    lifetime: float
    renew_before: float
    renew_mandatory: float
    renew_interval: float
    sealing_rounds: int
    sealing_calls: int
    cap: float = 20.0  # MERCHANT_MAX_EXCHANGES_PER_SECOND of the cold start


# quick: 15 s (lifetime - renew_before) for the first tokens; 5 s was too short under load.
# full: 1,000 first tokens at 20 a second take 50 s, well inside the 120 s before the first
# ones enter their advisory window
QUICK = AccountsPlan(1000, 100, 25.0, 10.0, 2.0, 0.5, 3, 100)
FULL = AccountsPlan(1000, 1000, 240.0, 120.0, 5.0, 1.0, 9, 1000)
COLD_START_GOAL_SECONDS = 90.0  # 1,000 accounts at 20 a second: their first tokens within
BURST_ALLOWANCE = 1.2  # the busiest second: the rate and the bucket's 0.2 s of it
CALL_WAIT_GOAL = 10.0  # seconds a call for an account not yet served may wait meanwhile


def accounts_source() -> dict[str, Settings]:
    """The worker's accounts (MERCHANT_ACCOUNTS_SOURCE=many_accounts:accounts_source)."""
    base = Settings.from_env({**os.environ, "MERCHANT_API_KEY": os.environ["BENCH_API_KEY"]})
    return {shop(n): account(base, n) for n in range(int(os.environ["BENCH_ACCOUNTS"]))}


def shop(n: int) -> str:
    return f"shop-{n}"


def account(base: Settings, n: int) -> Settings:
    """Account ``n`` of the cold start: an API key of the emulator's key family."""
    return replace(base, api_key=f"{base.api_key}.{shop(n)}")


class _CountingConnection(Connection):
    """Counts packets sent: one per command, one per pipeline (a round trip each)."""

    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        _CountingConnection.sent += 1
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


def _timed(run: Callable[[], object]) -> tuple[float, int]:
    """Milliseconds and round trips of one run."""
    before = _CountingConnection.sent
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) * 1000, _CountingConnection.sent - before


# -- 5. beat's check ------------------------------------------------------------------------


@dataclass(frozen=True)
class AccountsScenario(Scenario):
    """A scenario of many accounts, sized by an AccountsPlan."""

    plan: AccountsPlan


class AccountsCheck(AccountsScenario):
    """Beat's check of many accounts with nothing due, against the old loop."""

    name: ClassVar[str] = "accounts check"

    def measure(self, bench: Bench) -> Result:
        plan = self.plan
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
            for n in range(plan.check_accounts)
        }
        pool = redis.ConnectionPool.from_url(bench.redis_url, connection_class=_CountingConnection)
        counting = redis.Redis(connection_pool=pool)
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

            old_first_ms, old_first_trips = _timed(old_loop)  # builds 1,000 clients first
            samples: dict[str, list[tuple[float, int]]] = {"new": [], "old": []}
            for i in range(CHECK_REPEATS):
                for which in ("new", "old") if i % 2 == 0 else ("old", "new"):
                    samples[which].append(_timed(new_check if which == "new" else old_loop))
        finally:
            keys = list(counting.scan_iter(match=f"{prefix}-*", count=1000))
            for start in range(0, len(keys), 1000):
                counting.delete(*keys[start : start + 1000])
            counting.close()
        new_ms, old_ms = (median([ms for ms, _ in samples[w]]) for w in ("new", "old"))
        new_trips = max(trips for _, trips in samples["new"])
        old_trips = max(trips for _, trips in samples["old"])
        return Result(
            title=f"5. Beat's check, {plan.check_accounts} accounts, nothing due "
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
                "accounts_check_accounts": plan.check_accounts,
                "accounts_check_ms": round(new_ms, 2),
                "accounts_check_redis_roundtrips": new_trips,
                "accounts_check_old_loop_ms": round(old_ms, 2),
                "accounts_check_old_loop_redis_roundtrips": old_trips,
                "accounts_check_old_loop_first_ms": round(old_first_ms, 1),
                "accounts_check_old_loop_first_redis_roundtrips": old_first_trips,
            },
            goals=[
                Goal(
                    f"beat's check of {plan.check_accounts} accounts, nothing due: "
                    "Redis round trips",
                    "1",
                    str(new_trips),
                    new_trips == 1,
                )
            ],
        )


# -- 6. cold start through the fleet --------------------------------------------------------


class ColdStart(AccountsScenario):
    """Many accounts with no token, through one beat and one worker, until each renewed."""

    name: ClassVar[str] = "cold start"

    def measure(self, bench: Bench) -> Result:
        plan = self.plan
        bench.control.configure(lifetime=plan.lifetime, revoke_on_issue=False, key_family=True)
        prefix = f"bench-cold-{uuid.uuid4().hex[:8]}"
        env = bench.env(
            BENCH_ACCOUNTS=str(plan.accounts),
            BENCH_API_KEY=bench.env()["MERCHANT_API_KEY"],
            MERCHANT_KEY_PREFIX=prefix,
            MERCHANT_MAX_EXCHANGES_PER_SECOND=f"{plan.cap:g}",
            MERCHANT_ACCOUNTS_SOURCE="many_accounts:accounts_source",
            MERCHANT_TOKEN_LIFETIME=f"{plan.lifetime:g}",
            MERCHANT_RENEW_BEFORE=f"{plan.renew_before:g}",
            MERCHANT_RENEW_MANDATORY=f"{plan.renew_mandatory:g}",
            MERCHANT_RENEW_INTERVAL=f"{plan.renew_interval:g}",
            PYTHONPATH=os.pathsep.join(
                p for p in (str(BENCH_DIR), os.environ.get("PYTHONPATH")) if p
            ),
        )
        del env["MERCHANT_API_KEY"]  # only the source's accounts, no "default" one
        base = Settings.from_env({**env, "MERCHANT_API_KEY": env["BENCH_API_KEY"]})
        accounts = [account(base, n) for n in range(plan.accounts)]
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
                timeout=plan.lifetime - plan.renew_before,
            )
            first = tokens()
            wait_until(
                lambda: min(generations()) >= 2,
                "every account's renewal",
                timeout=plan.lifetime + 30,
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
            if len(times) >= 2 and times[1] < token.expires_at - plan.renew_mandatory
        )
        scheduled = sum(1 for log in logs for member, _ in log if b":scheduled:ok" in member)
        renewal_rate, burst_rate = _max_per_second(renewals), _max_per_second(bursts)
        busiest = _max_per_second([t for times in per_account for t in times])
        first_tokens_s = max(bursts) - started
        spread = max(renewals) - min(renewals) if renewals else 0.0
        allowed = math.floor(plan.cap * BURST_ALLOWANCE)
        return Result(
            title=f"6. Cold start through the fleet: {plan.accounts} accounts, one beat, "
            f"one worker (prefork, 2 children), at most {plan.cap:g} exchanges a second; "
            f"lifetime {plan.lifetime:g} s, advisory window {plan.renew_before:g} s, "
            f"mandatory {plan.renew_mandatory:g} s, beat every {plan.renew_interval:g} s",
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
                        f"{in_time} of {plan.accounts}",
                    ],
                    ["exchanges (emulator) / accounts", f"{exchanges} / {plan.accounts}"],
                    ["one exchange per stored generation, every account", str(once_each)],
                ],
            ),
            json={
                "cold_start_max_exchanges_per_s": busiest,
                "cold_start_seconds": round(first_tokens_s, 1),
                "cold_start_call_wait_s": round(call.seconds, 3),
                "cold_start_call_account_unserved": call.unserved,
                "cold_start_cap_per_s": plan.cap,
                "accounts_cold_start_accounts": plan.accounts,
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
                    f"cold start: most exchanges in one second (cap {plan.cap:g})",
                    f"<= {allowed}",
                    str(busiest),
                    busiest <= allowed,
                ),
                Goal(
                    f"cold start: every first token within (s, {plan.accounts} accounts)",
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
                    str(plan.accounts),
                    str(in_time),
                    in_time == plan.accounts,
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


# -- 7. hot path with the token sealed -----------------------------------------------------


class Sealing(AccountsScenario):
    """The hot path with the token sealed at rest, against the same in clear."""

    name: ClassVar[str] = "sealing"

    def measure(self, bench: Bench) -> Result:
        plan = self.plan
        key_file = bench.workdir / "token-key"
        key_file.write_text(base64.urlsafe_b64encode(os.urandom(32)).decode())
        key_file.chmod(0o600)
        # the emulator behind a keep-alive server: a new connection per call would hide the
        # client's own cost (as in scenario 3's keep-alive variant)
        with sandbox_process(bench.workdir, bench.sandbox_env, "tornado") as (url, child):
            bench.children.append(child)
            SandboxControl(url).configure(lifetime=7200.0, revoke_on_issue=False)
            clients = {"clear": _client(bench, url, None), "sealed": _client(bench, url, key_file)}
            wall: dict[str, list[float]] = {"clear": [], "sealed": []}
            cpu: dict[str, list[float]] = {"clear": [], "sealed": []}
            for client in clients.values():
                client.request("GET", PING)  # token and connection first
            for i in range(plan.sealing_rounds):
                for which in ("clear", "sealed") if i % 2 == 0 else ("sealed", "clear"):
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(plan.sealing_calls):
                        clients[which].request("GET", PING)
                    wall[which].append((time.perf_counter() - t0) / plan.sealing_calls * 1e6)
                    cpu[which].append((time.process_time() - c0) / plan.sealing_calls * 1e6)
        # the cost a call pays when it meets a token it has not opened yet (once per process
        # and renewal: the parsed token is reused until the stored value changes)
        store = clients["sealed"].manager.store
        opens = []
        for _ in range(200):
            stored = store.codec.seal("a-token-value-of-typical-length-0123456789", store.namespace)
            t0 = time.perf_counter()
            store.codec.open(stored, store.namespace)
            opens.append((time.perf_counter() - t0) * 1e6)
        clear_us, sealed_us = median(wall["clear"]), median(wall["sealed"])
        clear_cpu, sealed_cpu = median(cpu["clear"]), median(cpu["sealed"])
        ratios = [c / s for c, s in zip(wall["clear"], wall["sealed"], strict=True)]
        ratio = median(ratios)
        return Result(
            title=f"7. Hot path with the token sealed at rest: MerchantClient.request against the "
            f"keep-alive emulator, {plan.sealing_rounds} interleaved rounds of "
            f"{plan.sealing_calls} calls",
            table=Table(
                ["", "µs per call (median round)", "client CPU µs per call"],
                [
                    ["token in clear", f"{clear_us:.1f}", f"{clear_cpu:.1f}"],
                    [
                        "token sealed (MERCHANT_TOKEN_KEY_FILE)",
                        f"{sealed_us:.1f}",
                        f"{sealed_cpu:.1f}",
                    ],
                    ["clear / sealed, median of rounds (1.0 = no cost)", f"{ratio:.3f}", ""],
                    ["opening one sealed value (median of 200)", f"{median(opens):.1f}", ""],
                ],
            ),
            json={
                "sealing_hot_path_ratio": round(ratio, 3),
                "sealing_hot_path_ratios": [round(r, 3) for r in ratios],
                "sealing_hot_path_clear_us": round(clear_us, 1),
                "sealing_hot_path_sealed_us": round(sealed_us, 1),
                "sealing_hot_path_clear_cpu_us": round(clear_cpu, 1),
                "sealing_hot_path_sealed_cpu_us": round(sealed_cpu, 1),
                "sealing_open_us": round(median(opens), 1),
            },
        )


def _client(bench: Bench, url: str, key_file: Path | None) -> FleetClient:
    settings = Settings(
        api_key=bench.env()["MERCHANT_API_KEY"],
        secret=Secret(path=bench.secret_file),
        base_url=url,
        fleet=FleetSettings(
            redis_url=bench.redis_url,
            key_prefix=f"bench-sealing-{uuid.uuid4().hex[:8]}",
            token_key_file=str(key_file) if key_file is not None else None,
        ),
    )
    return client_for(settings)


# -- 8. ten thousand accounts ----------------------------------------------------------------


TEN_THOUSAND = 10_000


class TenThousandAccounts(AccountsScenario):
    """Beat's check and `status` of 10,000 accounts, and a real worker configured with
    them."""

    name: ClassVar[str] = "10k accounts"

    def measure(self, bench: Bench) -> Result:
        from celery import Celery

        bench.control.configure(lifetime=7200.0, revoke_on_issue=False, key_family=True)
        prefix = f"bench-10k-{uuid.uuid4().hex[:8]}"
        env = bench.env(
            BENCH_ACCOUNTS=str(TEN_THOUSAND),
            BENCH_API_KEY=bench.env()["MERCHANT_API_KEY"],
            MERCHANT_KEY_PREFIX=prefix,
            MERCHANT_ACCOUNTS_SOURCE="many_accounts:accounts_source",
            PYTHONPATH=os.pathsep.join(
                p for p in (str(BENCH_DIR), os.environ.get("PYTHONPATH")) if p
            ),
        )
        del env["MERCHANT_API_KEY"]
        base = Settings.from_env({**env, "MERCHANT_API_KEY": env["BENCH_API_KEY"]})
        accounts = {shop(n): account(base, n) for n in range(TEN_THOUSAND)}
        called = shop(TEN_THOUSAND - 1)  # no token: the worker's call exchanges for it
        pool = redis.ConnectionPool.from_url(bench.redis_url, connection_class=_CountingConnection)
        counting = redis.Redis(connection_pool=pool)
        workdir = bench.workdir / "10k"
        workdir.mkdir()
        try:
            _store_fresh_tokens(counting, [s for name, s in accounts.items() if name != called])

            def check() -> None:
                if due_accounts(accounts, lambda url: counting) != [called]:
                    raise ScenarioError("the check found other accounts due than the one")

            samples = [_timed(check) for _ in range(CHECK_REPEATS)]
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
            "`status` (once), and a worker (prefork, 2 children) configured with them serving "
            "one call",
            table=Table(
                ["", "value"],
                [
                    ["beat's check of 10,000 accounts (ms)", f"{check_ms:.1f}"],
                    ["its Redis round trips", str(trips)],
                    ["`status --json` of 10,000 accounts (s)", f"{status.seconds:.2f}"],
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
            ],
        )


@dataclass(frozen=True)
class StatusRun:
    seconds: float  # the command's wall time: start-up, loading the accounts, reading, JSON
    round_trips: int  # of its reading (``AccountClients.statuses``)


def _status(
    accounts: dict[str, Settings],
    env: dict[str, str],
    workdir: Path,
    counting: redis.Redis,
    redis_url: str,
) -> StatusRun:
    """`merchant-tasks status --json` over the accounts, as an operator runs it, then the
    same reading in this process on the counting connection (its packets: round trips)."""
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "merchant_tasks.ops.cli", "status", "--json"],
        env=env,
        cwd=workdir,
        capture_output=True,
        timeout=STATUS_TIMEOUT,
        check=False,
    )
    seconds = time.perf_counter() - t0
    shown = json.loads(done.stdout).get("accounts", []) if done.stdout else []
    if len(shown) != len(accounts):
        raise ScenarioError(f"status showed {len(shown)} accounts: {done.stderr[-300:]!r}")
    fleet = AccountClients(accounts)
    fleet._redis_by_url[redis_url] = counting  # its reading on the counting connection
    _, round_trips = _timed(lambda: account_statuses(fleet))
    return StatusRun(seconds, round_trips)


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


def scenarios(plan: AccountsPlan) -> list[Scenario]:
    return [AccountsCheck(plan), ColdStart(plan), Sealing(plan), TenThousandAccounts(plan)]
