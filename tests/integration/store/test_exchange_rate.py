"""The fleet-wide exchange rate per token endpoint host (exchange_rate.py), on a real Redis
and the emulator as the real HTTP server; the cap and the callers' priority with real
processes. Bounds come from counts (the emulator's, the limiter's in Redis), never from
how fast anything ran."""

from __future__ import annotations

import contextlib
import json
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from random import Random
from typing import Any, Protocol

import pytest
import redis
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from merchant_tasks.accounts import client_for, exchange_rate_for
from merchant_tasks.exceptions import (
    ExchangeRateLimited,
    ExchangesThrottled,
    StoreUnavailable,
    TokenEndpointUnavailable,
)
from merchant_tasks.flows import Clock, Moment, Redis, Sleep, drive
from merchant_tasks.ops.cli import main
from merchant_tasks.ops.metrics import FleetCollector
from merchant_tasks.ops.status import AccountStatus, account_status
from merchant_tasks.renewal.life import Limits, TokenLife
from merchant_tasks.sandbox.emulator import SandboxApp, SandboxConfig, SandboxServer
from merchant_tasks.sandbox.processes import RedisServer, spawn, wait_all_ready
from merchant_tasks.settings import FleetSettings, Secret, Settings, child_env
from merchant_tasks.store import exchange_rate
from merchant_tasks.store.exchange_rate import ExchangeRate, Priority
from merchant_tasks.store.keys import AccountKeys, AccountRedis
from merchant_tasks.store.token_store import TokenCommands, TokenStore
from merchant_tasks.token import RenewalPolicy
from support.clock import Sleeper
from support.paths import SUPPORT
from support.redis_conditions import dead_redis

pytestmark = pytest.mark.integration

CAP = 5.0  # exchanges per second in the process tests: far below what the loops would send
# seconds a rate worker waits for a permit at most (the package's PERMIT_WAIT is 5 s): a
# caller at CAP waits a fraction of a second, and beat's renewals give up sooner
PERMIT_WAIT = 2.0
BUCKET = 2  # permits a quiet host holds at CAP (RESERVED_FOR_CALLERS + 1)


class Permits(ExchangeRate):
    """The exchange rate of host ``h:1`` with ``take``: a permit as a renewal takes one (the
    model's ``TokenLife.permit``), its sleeps recorded, not slept, its clock injected."""

    def __init__(
        self,
        commands: AccountRedis,
        key: str,
        cap: float,
        sleeps: list[float],
        monotonic: Callable[[], float],
    ) -> None:
        super().__init__(commands, key, "h:1", cap)
        ask = TokenCommands(commands, commands.keys.namespace)
        limits = Limits.for_exchange(1.0)
        self.life = TokenLife(ask, RenewalPolicy(480, 120), limits, rate=self, rng=Random(0))
        self.sleeps, self.monotonic = sleeps, monotonic

    def take(self, priority: Priority) -> None:
        def perform(step: Any) -> Any:
            if isinstance(step, Redis):
                return self._blocking().send(step.command)
            if isinstance(step, Sleep):
                return self.sleeps.append(step.seconds)
            assert isinstance(step, Clock), step
            return Moment(0.0, self.monotonic())

        drive(self.life.permit(priority), perform)


def rate_on(
    client: redis.Redis,
    prefix: str,
    cap: float,
    sleeps: list[float],
    monotonic: Callable[[], float] = time.monotonic,
) -> Permits:
    """The exchange rate of host ``h:1`` whose sleeps are recorded, not slept."""
    commands = AccountRedis(client, AccountKeys.of(f"{prefix}:sandbox:k"))
    return Permits(commands, AccountKeys.exchange_rate(prefix, "h:1"), cap, sleeps, monotonic)


def halve(rate: ExchangeRate) -> None:
    """What an exchange's 429 does to its host's rate (``renewal.life``): halve it."""
    assert isinstance(rate.commands, AccountRedis)
    rate.commands.send(rate.cut())


def halved_ago(control: redis.Redis, key: str, seconds: float) -> None:
    """Move the host's last halving ``seconds`` into the past (Redis time)."""
    redis_now = control.time()
    now_ms = redis_now[0] * 1000 + redis_now[1] // 1000
    control.hset(key, "cut_at", now_ms - int(seconds * 1000))


class RateAt(Protocol):
    def __call__(self, cap: float, monotonic: Callable[[], float] = time.monotonic) -> Permits: ...


@pytest.fixture
def rate_at(redis_client: redis.Redis, merchant_key_prefix: str, sleep: Sleeper) -> RateAt:
    """The test's bucket of host ``h:1`` at ``cap`` exchanges a second; ``sleep`` records
    its waits."""

    def rate(cap: float, monotonic: Callable[[], float] = time.monotonic) -> Permits:
        return rate_on(redis_client, merchant_key_prefix, cap, sleep.waits, monotonic)

    return rate


# -- the bucket, in Redis time ------------------------------------------------------------


def take_the_burst(rate: Permits) -> Permits:
    """Callers take the two permits of the full bucket: for them nobody waits."""
    rate.take(Priority.CALLER)
    rate.take(Priority.CALLER)
    return rate


def test_a_quiet_host_answers_at_once_then_callers_wait_for_a_reserved_permit(
    rate_at: RateAt, sleep: Sleeper
) -> None:
    rate = take_the_burst(rate_at(1.0))
    assert sleep.waits == []  # the burst
    rate.take(Priority.CALLER)
    assert len(sleep.waits) == 1
    assert 0.5 < sleep.waits[0] <= 1.0
    counts = rate.state().counts
    assert counts["granted_caller"] == 3
    assert counts["waited"] == 1


def test_a_permit_granted_at_once_counts_no_wait_however_busy_the_process(
    rate_at: RateAt, sleep: Sleeper
) -> None:
    """The process's own delay before it asks (a loaded machine) is no wait for a permit."""
    ticks = iter(range(0, 1000, 5))  # each reading of the clock 5 s after the last
    rate = rate_at(1.0, lambda: float(next(ticks)))
    rate.take(Priority.BACKGROUND)  # a full bucket of 2: one may go
    rate.take(Priority.CALLER)
    counts = rate.state().counts
    assert counts["granted_caller"] == counts["granted_background"] == 1
    assert counts.get("waited", 0) == 0
    assert sleep.waits == []


def test_beat_never_takes_the_permits_kept_for_callers(rate_at: RateAt, sleep: Sleeper) -> None:
    rate = rate_at(0.1)  # one permit per 10 s
    rate.take(Priority.BACKGROUND)  # a full bucket of 2: one may go
    with pytest.raises(ExchangesThrottled) as raised:
        rate.take(Priority.BACKGROUND)  # the last one is the callers'
    assert raised.value.retry_after is not None
    assert raised.value.retry_after > 5
    rate.take(Priority.CALLER)  # ... and a caller gets it at once
    assert sleep.waits == []
    counts = rate.state().counts
    assert (counts["granted_background"], counts["granted_caller"], counts["gave_up"]) == (1, 1, 1)


def test_a_caller_past_its_wait_is_refused_at_once_with_the_endpoint_unavailable_error(
    rate_at: RateAt, sleep: Sleeper
) -> None:
    rate = take_the_burst(rate_at(0.1))
    with pytest.raises(TokenEndpointUnavailable) as raised:  # ExchangesThrottled is one
        rate.take(Priority.CALLER)  # the next permit is 10 s away: beyond PERMIT_WAIT
    assert isinstance(raised.value, ExchangesThrottled)
    assert "MERCHANT_MAX_EXCHANGES_PER_SECOND=0.1" in str(raised.value)
    assert raised.value.retryable
    assert raised.value.retry_after is not None
    assert sleep.waits == []  # refused without waiting for what it could not get
    assert rate.state().counts["gave_up"] == 1


def test_a_429_halves_the_rate_once_then_it_grows_back_step_by_step(
    redis_client: redis.Redis, rate_at: RateAt
) -> None:
    rate = rate_at(10.0)
    halve(rate)
    halve(rate)  # an answer to an exchange sent before the halving
    assert rate.state().rate == 5.0
    assert rate.state().counts["cuts"] == 1

    halved_ago(redis_client, rate.key, exchange_rate.RATE_HOLD - 1)
    assert rate.state().rate == 5.0  # held
    halved_ago(
        redis_client, rate.key, exchange_rate.RATE_HOLD + 2.5 * exchange_rate.RATE_STEP_INTERVAL
    )
    assert rate.state().rate == pytest.approx(5.0 + 3 * 10.0 * exchange_rate.RATE_STEP)
    halved_ago(
        redis_client, rate.key, exchange_rate.RATE_HOLD + 60 * exchange_rate.RATE_STEP_INTERVAL
    )
    assert rate.state().rate == 10.0
    rate.take(Priority.CALLER)  # the first permit at the cap forgets the halving
    assert redis_client.hget(rate.key, "cut_rate") == b""


def test_halvings_stop_at_the_floor(redis_client: redis.Redis, rate_at: RateAt) -> None:
    rate = rate_at(1.0)
    for _ in range(10):
        # as if each 429 came after the spacing, during the hold
        halved_ago(redis_client, rate.key, exchange_rate.HALVING_SPACING + 1)
        halve(rate)
    assert rate.state().rate == exchange_rate.RATE_FLOOR


def test_garbage_in_the_rate_key_reads_as_a_fresh_bucket(
    redis_client: redis.Redis, rate_at: RateAt
) -> None:
    rate = rate_at(2.0)
    redis_client.set(rate.key, "not a hash")
    rate.take(Priority.CALLER)
    redis_client.hset(rate.key, mapping={"tokens": "x", "at": "y", "cut_rate": "z", "cut_at": "1"})
    rate.take(Priority.CALLER)
    assert rate.state().rate == 2.0


def test_without_redis_no_permit_is_given(merchant_key_prefix: str) -> None:
    rate = rate_on(dead_redis(), merchant_key_prefix, 10.0, [])
    with pytest.raises(StoreUnavailable):
        rate.take(Priority.CALLER)


# -- with the emulator ----------------------------------------------------------------------


def a_429_from_the_host(settings: Settings, sandbox: Any) -> None:
    """The emulator grants one exchange a minute: a forced renewal gets it, the next a 429."""
    sandbox.app.configure({"rate_limit": 1, "rate_window": 60.0})
    client = client_for(settings)
    client.manager.renew(force=True)
    with pytest.raises(ExchangeRateLimited):
        client.manager.renew(force=True)


def test_a_429_on_one_account_halves_the_rate_every_account_of_the_host_sees(
    merchant_settings: Settings, merchant_sandbox: Any, redis_client: redis.Redis
) -> None:
    a_429_from_the_host(merchant_settings, merchant_sandbox)
    other_store = TokenStore(redis_client, f"{merchant_settings.fleet.key_prefix}:sandbox:other")
    seen_elsewhere = exchange_rate_for(merchant_settings, other_store.commands).state()
    assert seen_elsewhere.rate == merchant_settings.fleet.max_exchanges_per_second / 2
    assert seen_elsewhere.counts["cuts"] == 1
    assert (
        seen_elsewhere.counts["granted_caller"]
        == 2
        == sum(merchant_sandbox.app.counters()["exchanges"].values())
    )


def test_calls_holding_a_valid_token_go_on_while_redis_is_down_and_exchanges_do_not(
    merchant_sandbox: Any, tmp_path: Path
) -> None:
    with RedisServer(tmp_path / "redis") as server:
        settings = Settings(
            api_key=merchant_sandbox.api_key,
            secret=Secret(path=merchant_sandbox.secret_file),
            base_url=merchant_sandbox.url,
            fleet=FleetSettings(redis_url=server.url, key_prefix="mt-rate"),
        )
        client = client_for(settings)
        assert client.request("GET", "/open-api/v1/ping") == {"ok": True}
        server.kill()
        for _ in range(3):
            assert client.request("GET", "/open-api/v1/ping") == {"ok": True}
        with pytest.raises(StoreUnavailable):
            client.manager.renew(force=True)
        with pytest.raises(StoreUnavailable):  # no permit without Redis
            client.manager.run(client.manager.life.permit(Priority.CALLER))
    assert merchant_sandbox.app.counters()["exchanges"]["ok"] == 1


# -- real processes -------------------------------------------------------------------------


def emulators(
    stack: contextlib.ExitStack, sandbox: Any, fleet: FleetSettings, count: int
) -> tuple[list[SandboxServer], Settings]:
    """``count`` more emulators (hosts) of the test's account, whose tokens live inside the
    advisory window (every scheduled renewal exchanges), and settings for the first one."""
    secret = sandbox.secret_file.read_text()
    servers = [
        stack.enter_context(
            SandboxServer(SandboxApp(SandboxConfig(sandbox.api_key, secret, lifetime=300)))
        )
        for _ in range(count)
    ]
    settings = Settings(
        api_key=sandbox.api_key,
        secret=Secret(path=sandbox.secret_file),
        base_url=servers[0].url,
        fleet=fleet,
    )
    return servers, settings


def run_workers(
    roles: list[str],
    urls: list[str],
    settings: Settings,
    control: redis.Redis,
    tmp_path: Path,
    seconds: float,
) -> tuple[list[dict[str, dict[str, int]]], float]:
    """Run one rate worker per role, all starting at once; their outputs and the seconds
    from the go signal to the last output (every exchange falls inside)."""
    run = uuid.uuid4().hex[:8]
    ready_key, go_key = (
        f"{settings.fleet.key_prefix}:ready-{run}",
        f"{settings.fleet.key_prefix}:go-{run}",
    )
    env = {
        **child_env(settings),
        "RATE_READY_KEY": ready_key,
        "RATE_GO_KEY": go_key,
        "RATE_PERMIT_WAIT": str(PERMIT_WAIT),
    }
    worker = SUPPORT / "rate_worker.py"
    children = [
        spawn(
            f"rate worker {n} ({role})",
            [sys.executable, str(worker), role, str(seconds), *urls],
            tmp_path / f"rate-{n}.log",
            env=env,
            stdout_pipe=True,
        )
        for n, role in enumerate(roles)
    ]
    try:
        wait_all_ready(
            children, lambda: int(control.get(ready_key) or 0) == len(roles), "ready", 90
        )
        started = time.monotonic()
        control.set(go_key, 1)
        outputs = [json.loads(child.output(timeout=90)) for child in children]
        return outputs, time.monotonic() - started
    finally:
        for child in children:
            child.stop()


def host_counts(settings: Settings, url: str, control: redis.Redis) -> dict[str, int]:
    store = TokenStore(control, f"{settings.fleet.key_prefix}:sandbox:reader")
    return exchange_rate_for(replace(settings, base_url=url), store.commands).state().counts


@pytest.fixture
def capped(merchant_redis_url: str, merchant_key_prefix: str) -> FleetSettings:
    return FleetSettings(
        redis_url=merchant_redis_url, key_prefix=merchant_key_prefix, max_exchanges_per_second=CAP
    )


def test_two_processes_on_two_hosts_keep_each_host_under_the_cap(
    merchant_sandbox: Any, capped: FleetSettings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with contextlib.ExitStack() as stack:
        servers, settings = emulators(stack, merchant_sandbox, capped, 2)
        urls = [server.url for server in servers]
        outputs, elapsed = run_workers(
            ["caller", "caller"], urls, settings, redis_client, tmp_path, 2.0
        )
        for server, url in zip(servers, urls, strict=True):
            sent = sum(server.app.counters()["exchanges"].values())
            counts = host_counts(settings, url, redis_client)
            assert counts["granted_caller"] == sent  # every exchange took a permit
            assert 3 <= sent <= BUCKET + CAP * elapsed, outputs  # the cap, however slow
            assert counts["waited"] > 0  # the loops asked faster than the cap
            assert all(output[url].get("ok", 0) > 0 for output in outputs)  # both were served


def test_callers_go_before_beat(
    merchant_sandbox: Any, capped: FleetSettings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with contextlib.ExitStack() as stack:
        (server,), settings = emulators(stack, merchant_sandbox, capped, 1)
        roles = ["caller", "background"]
        # longer than PERMIT_WAIT, so that beat's renewal gives up waiting while calls go on
        outputs, _ = run_workers(roles, [server.url], settings, redis_client, tmp_path, 3.0)
        counts = host_counts(settings, server.url, redis_client)
        sent = sum(server.app.counters()["exchanges"].values())
        assert counts["granted_caller"] + counts["granted_background"] == sent
        assert counts["granted_caller"] >= 5
        # beat's renewals get what the bucket held before the caller began asking (one)
        # and after it stopped (one), nothing while it asked
        assert counts["granted_background"] <= BUCKET
        caller, beat = (output[server.url] for output in outputs)
        assert beat.get("ExchangesThrottled", 0) > 0
        assert caller.get("ExchangesThrottled", 0) == 0


# -- what operators see ---------------------------------------------------------------------


def test_status_and_metrics_show_the_hosts_rate_and_permits_waited_for(
    merchant_settings: Settings, merchant_sandbox: Any, merchant_env: dict[str, str]
) -> None:
    a_429_from_the_host(merchant_settings, merchant_sandbox)
    result = CliRunner().invoke(main, ["status", "--json"])
    (account,) = json.loads(result.stdout)["accounts"]
    host = merchant_settings.origin.split("://")[1]
    assert account["exchange_rate"]["host"] == host
    assert account["exchange_rate"]["rate"] == 5.0  # the default 10, halved
    assert account["exchange_rate"]["counts"]["cuts"] == 1
    text = CliRunner().invoke(main, ["status"]).stdout
    assert f"5/s to {host} (cap 10, lowered after a 429)" in text

    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(lambda: {"default": account_status_of(merchant_settings)}))
    samples = {
        (s.name, tuple(s.labels.items())): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert samples[("merchant_tasks_exchange_rate", (("host", host),))] == 5.0
    assert samples[("merchant_tasks_exchange_rate_cap", (("host", host),))] == 10.0
    assert samples[("merchant_tasks_exchange_rate_halvings_total", (("host", host),))] == 1


def account_status_of(settings: Settings) -> AccountStatus:
    manager = client_for(settings).manager
    return account_status("default", settings, manager.store, manager.rate)


def test_a_forced_renewal_refused_a_permit_spends_none_of_the_forced_budget(
    merchant_settings: Settings, merchant_sandbox: Any
) -> None:
    fleet = replace(merchant_settings.fleet, max_exchanges_per_second=0.1)  # a bucket of 2
    client = client_for(replace(merchant_settings, fleet=fleet))
    client.request("GET", "/open-api/v1/ping")  # the first token: permit 1
    merchant_sandbox.app.revoke_all()
    client.request("GET", "/open-api/v1/ping")  # a forced renewal: permit 2
    merchant_sandbox.app.revoke_all()
    with pytest.raises(ExchangesThrottled):
        client.request("GET", "/open-api/v1/ping")  # the next permit is 10 s away
    records = client.manager.store.records
    assert records.forced_in_period(client.manager.store.time(), 60.0) == 1
    assert records.counters()["forced_renewals"] == 1
    assert merchant_sandbox.app.counters()["exchanges"]["ok"] == 2
