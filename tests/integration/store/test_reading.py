"""`status` and the exporter over many accounts: a few pipelined round trips per Redis
server whatever the number of accounts, and the same statuses as one account at a time."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import redis

from merchant_tasks import accounts as accounts_module
from merchant_tasks.accounts import AccountClients, exchange_rate_for, store_for
from merchant_tasks.ops.status import AccountState, account_status, account_statuses
from merchant_tasks.sandbox.processes import RedisServer
from merchant_tasks.settings import FleetSettings, Settings
from merchant_tasks.store.token_store import BreakerRecord
from merchant_tasks.token import BreakerKind, Outcome, RenewalReason, Token
from support.redis_conditions import CountingConnection
from support.tokens import LIFETIME, redis_time, store_tokens

pytestmark = pytest.mark.integration


def _accounts(settings: Settings, count: int, tag: str = "") -> dict[str, Settings]:
    return {
        f"shop{tag}-{n}": dataclasses.replace(settings, api_key=f"{settings.api_key}.shop{tag}-{n}")
        for n in range(count)
    }


def _round_trips_of_statuses(
    settings: Settings, count: int, monkeypatch: pytest.MonkeyPatch
) -> int:
    """Round trips of one ``statuses()`` of ``count`` accounts, half with a token stored."""
    accounts = _accounts(settings, count)
    pool = redis.ConnectionPool.from_url(
        settings.fleet.redis_url, connection_class=CountingConnection
    )
    counting = redis.Redis(connection_pool=pool)
    try:
        store_tokens(counting, list(accounts.values())[: count // 2], generation=1)
        monkeypatch.setattr(accounts_module, "redis_for", lambda fleet: counting)
        fleet = AccountClients(accounts)
        before = CountingConnection.sent
        statuses = account_statuses(fleet)
        trips = CountingConnection.sent - before
    finally:
        counting.close()
    states = [statuses[name].state for name in accounts]
    assert states.count(AccountState.FRESH) == states.count(AccountState.MISSING) == count // 2
    return trips


def test_status_of_200_accounts_costs_the_round_trips_of_50(
    merchant_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    fifty = _round_trips_of_statuses(merchant_settings, 50, monkeypatch)
    two_hundred = _round_trips_of_statuses(merchant_settings, 200, monkeypatch)
    assert fifty == two_hundred
    assert two_hundred <= 4  # TIME, one pipeline, the host's rate (its script, its hash)


def test_statuses_of_the_fleet_are_what_one_account_at_a_time_reads(
    merchant_settings: Settings,
) -> None:
    """Every field a status has, set on some account: the pipelined reading gives each
    account the status ``account_status`` reads through its store alone."""
    accounts = _accounts(merchant_settings, 4)
    fleet = AccountClients(accounts)
    client = fleet.redis_for(merchant_settings.fleet.redis_url)
    stores = {name: store_for(settings, client, name=name) for name, settings in accounts.items()}
    now = redis_time(client)
    scheduled = Token("tok-a", now - 100, now + LIFETIME, 1, "beat", RenewalReason.SCHEDULED)
    stores["shop-0"].save(scheduled)
    stores["shop-0"].records.record_attempt(RenewalReason.SCHEDULED, Outcome.OK, now - 50)
    stores["shop-0"].records.record_renewal(RenewalReason.SCHEDULED, Outcome.OK)
    stores["shop-0"].records.observe("exchange_seconds", 0.2)
    stores["shop-1"].save(Token("tok-b", now - LIFETIME + 60, now + 60, 1))  # mandatory
    stores["shop-1"].take_lock("host:1:nonce:lock:1", "host:1:", 30.0)
    record = BreakerRecord(BreakerKind.REJECTED, until=now + 300, detail="check the secret")
    stores["shop-2"].records.open_breaker(record, now)
    client.set(stores["shop-3"].keys.counters, "not a hash")  # corrupt: reads as absent
    statuses = account_statuses(fleet)
    for name, settings in accounts.items():
        one = account_status(
            name, settings, stores[name], exchange_rate_for(settings, stores[name].commands)
        )
        assert _lasting(statuses[name].as_dict()) == _lasting(one.as_dict()), name
    assert statuses["shop-0"].counters["renewals:scheduled:ok"] == 1
    assert statuses["shop-0"].exchanges_last_hour == 1
    assert statuses["shop-0"].last_renewal_reason == RenewalReason.SCHEDULED
    assert statuses["shop-1"].state == AccountState.MANDATORY
    assert statuses["shop-1"].lock_holder == "host:1:nonce:lock:1"
    assert statuses["shop-2"].breaker is not None
    assert statuses["shop-2"].breaker["kind"] == BreakerKind.REJECTED
    assert statuses["shop-3"].counters == {}


def _lasting(status: dict[str, Any]) -> dict[str, Any]:
    """A status without what moves between two reads (the time, and what follows from it)."""
    moving = ("now", "age", "time_left")
    lasting = {key: value for key, value in status.items() if key not in moving}
    if lasting["breaker"] is not None:
        lasting["breaker"] = {k: v for k, v in lasting["breaker"].items() if k != "closes_in"}
    lasting["exchange_rate"] = {k: v for k, v in status["exchange_rate"].items() if k != "permits"}
    return lasting


def test_accounts_on_two_redis_servers_are_each_read_on_their_own(
    merchant_settings: Settings, private_redis: RedisServer
) -> None:
    elsewhere = dataclasses.replace(
        merchant_settings, fleet=FleetSettings(redis_url=private_redis.url, key_prefix="mt-other")
    )
    here, there = _accounts(merchant_settings, 3), _accounts(elsewhere, 3, tag="-far")
    fleet = AccountClients({**here, **there})
    store_tokens(fleet.redis_for(merchant_settings.fleet.redis_url), here.values(), generation=1)
    store_tokens(fleet.redis_for(private_redis.url), there.values(), generation=5)
    statuses = account_statuses(fleet)
    assert [statuses[name].generation for name in here] == [1, 1, 1]
    assert [statuses[name].generation for name in there] == [5, 5, 5]
    rates = {name: status.exchange_rate for name, status in statuses.items()}
    assert all(rate is not None and rate["rate"] == rate["cap"] for rate in rates.values())
