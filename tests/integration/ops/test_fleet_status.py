"""`status`, the exporter and a health endpoint over many accounts: 1 + one round trip per
2,000 accounts per Redis server whatever the number of hosts, each account's status what
its own store reads (corrupt values included, logged once), blocking or asyncio."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import pty
import subprocess
import sys
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from merchant_tasks import account_statuses, async_account_statuses  # the public door
from merchant_tasks import accounts as accounts_module
from merchant_tasks.accounts import AccountClients, exchange_rate_for, store_for
from merchant_tasks.aio import AsyncAccountClients
from merchant_tasks.ops.cli import main
from merchant_tasks.ops.status import (
    AccountState,
    AccountStatus,
    account_status,
    healthy,
    status_documents,
)
from merchant_tasks.sandbox.processes import RedisServer
from merchant_tasks.settings import FleetSettings, Settings
from merchant_tasks.store.keys import AccountKeys
from merchant_tasks.store.token_store import BreakerRecord, TokenStore
from merchant_tasks.store.topology import StoreClient
from merchant_tasks.token import BreakerKind, Outcome, RenewalReason, Token
from support.redis_conditions import CountingConnection
from support.tokens import LIFETIME, redis_time, store_tokens

pytestmark = pytest.mark.integration

HOSTS = ("http://127.0.0.1:9001", "http://127.0.0.2:9002", "http://127.0.0.3:9003")


def _accounts(
    settings: Settings, count: int, tag: str = "", hosts: tuple[str, ...] = ()
) -> dict[str, Settings]:
    """``count`` accounts of ``settings``'s Redis and prefix, spread over ``hosts``."""
    return {
        f"shop{tag}-{n}": dataclasses.replace(
            settings,
            api_key=f"{settings.api_key}.shop{tag}-{n}",
            base_url=hosts[n % len(hosts)] if hosts else settings.base_url,
        )
        for n in range(count)
    }


def _lasting(status: AccountStatus | dict[str, Any]) -> dict[str, Any]:
    """A status (or its fields) without what moves between two reads (the time, and what
    follows from it)."""
    shown = status.as_dict() if isinstance(status, AccountStatus) else status
    lasting = {key: value for key, value in shown.items() if key not in ("now", "age", "time_left")}
    if lasting["breaker"] is not None:
        lasting["breaker"] = {k: v for k, v in lasting["breaker"].items() if k != "closes_in"}
    lasting["exchange_rate"] = {k: v for k, v in shown["exchange_rate"].items() if k != "permits"}
    return lasting


def _own_reading(name: str, settings: Settings, client: StoreClient) -> AccountStatus:
    """``name``'s status read a command at a time through a store of its own."""
    store = store_for(settings, client, name=name)
    return account_status(name, settings, store, exchange_rate_for(settings, store.commands))


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "round_trips"),
    [(1, 2), (2000, 2), (2001, 3), (10_000, 6)],  # TIME and the hosts' rates, then 2,000 a trip
)
@pytest.mark.parametrize("hosts", [HOSTS[:1], HOSTS], ids=["one host", "three hosts"])
def test_status_costs_one_round_trip_and_one_per_2000_accounts_whatever_the_hosts(
    merchant_settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
    count: int,
    round_trips: int,
    hosts: tuple[str, ...],
) -> None:
    accounts = _accounts(merchant_settings, count, hosts=hosts)
    pool = redis.ConnectionPool.from_url(
        merchant_settings.fleet.redis_url, connection_class=CountingConnection
    )
    counting = redis.Redis(connection_pool=pool)
    try:
        store_tokens(counting, list(accounts.values())[: (count + 1) // 2], generation=1)
        monkeypatch.setattr(accounts_module, "redis_for", lambda fleet: counting)
        fleet = AccountClients(accounts)
        before = CountingConnection.sent
        statuses = account_statuses(fleet)
        assert CountingConnection.sent - before == round_trips
    finally:
        counting.close()
    states = [statuses[name].state for name in accounts]
    assert states.count(AccountState.FRESH) == (count + 1) // 2
    assert states.count(AccountState.MISSING) == count // 2
    assert {s.exchange_rate["host"] for s in statuses.values() if s.exchange_rate} == {
        host.removeprefix("http://") for host in hosts[:count]
    }


# -- what is read --------------------------------------------------------------------------


def test_every_field_of_every_account_is_what_its_own_store_reads(
    merchant_settings: Settings,
) -> None:
    """Every field a status has, set on some account: the fleet's reading gives each account
    the status ``account_status`` reads through its store alone, and `status --json`'s
    documents (``status_documents``) are those statuses' fields, healthy as they are."""
    accounts = _accounts(merchant_settings, 5)
    fleet = AccountClients(accounts)
    client = fleet.redis_for(merchant_settings.fleet.redis_url)
    stores = {name: store_for(settings, client, name=name) for name, settings in accounts.items()}
    now = redis_time(client)
    scheduled = Token("tök-ä", now - 100, now + LIFETIME, 1, "beat:1:ab", RenewalReason.SCHEDULED)
    stores["shop-0"].save(scheduled)
    stores["shop-0"].records.record_attempt(RenewalReason.SCHEDULED, Outcome.OK, now - 50)
    stores["shop-0"].records.record_attempt(RenewalReason.SCHEDULED, Outcome.OK, now - 7200)
    stores["shop-0"].records.record_renewal(RenewalReason.SCHEDULED, Outcome.OK)
    stores["shop-0"].send(stores["shop-0"].ask.observe("exchange_seconds", 0.2))
    stores["shop-1"].save(Token("tok-b", now - LIFETIME + 60, now + 60, 1))  # mandatory
    stores["shop-1"].take_lock("hôst:1:nonce:lock:1", "hôst:1:", 30.0)
    record = BreakerRecord(BreakerKind.REJECTED, until=now + 300, detail="check the secret")
    stores["shop-2"].records.open_breaker(record, now)
    windows = (merchant_settings.renew_before, merchant_settings.renew_mandatory)
    advisory = sum(windows) / 2  # seconds left: inside the advisory window
    stores["shop-3"].save(Token("tok-d", now - LIFETIME + advisory, now + advisory, 1))
    statuses = account_statuses(fleet)
    for name, settings in accounts.items():
        own = _own_reading(name, settings, client)
        assert _lasting(statuses[name]) == _lasting(own), name
        assert statuses[name].as_dict() == dataclasses.asdict(statuses[name])
    shop0, shop1, shop2 = statuses["shop-0"], statuses["shop-1"], statuses["shop-2"]
    assert shop0.counters["renewals:scheduled:ok"] == 1
    assert (shop0.exchanges_last_hour, shop0.exchanges_last_day) == (1, 2)
    assert shop0.histograms["exchange_seconds:le:0.25"] == 1
    assert (shop0.last_renewal_reason, shop0.renewed_by) == (RenewalReason.SCHEDULED, "beat:1:ab")
    assert shop1.state == AccountState.MANDATORY
    assert shop1.lock_holder == "hôst:1:nonce:lock:1"
    assert shop2.breaker is not None
    assert shop2.breaker["kind"] == BreakerKind.REJECTED
    assert shop2.breaker["detail"] == "check the secret"
    assert statuses["shop-3"].state == AccountState.ADVISORY
    assert statuses["shop-4"].state == AccountState.MISSING
    documents = status_documents(fleet)  # what `status --json` prints
    assert [document["account"] for document in documents] == list(statuses)
    for document in documents:
        status = statuses[document["account"]]
        assert _lasting(document) == _lasting(status), document["account"]
        assert healthy(document) == status.healthy
    assert [healthy(document) for document in documents] == [True, False, False, True, False]


def _corrupt(client: StoreClient, keys: AccountKeys, case: str) -> str:
    """Write ``case``'s garbage; the key it is in."""
    if case == "token not JSON":
        client.set(keys.token, "not a token")
    elif case == "token not UTF-8":
        client.set(keys.token, b'{"value": "\xff\xfe", "issued_at": 1}')
    elif case == "token a hash":
        client.hset(keys.token, "value", "x")
    elif case == "breaker not a record":
        client.set(keys.breaker, "{}")
    elif case == "lock a list":
        client.rpush(keys.lock, "x")
    elif case == "lock not UTF-8":
        client.set(keys.lock, b"host\xff:1", ex=60)
    elif case == "counters a string":
        client.set(keys.counters, "not a hash")
    elif case == "counter not a number":
        client.hset(keys.counters, mapping={"unauthorized": "3", "renewals:x": "many"})
    elif case == "counter field not UTF-8":
        client.hset(keys.counters, mapping={b"\xff\xfe": b"1", b"lock_waits": b"2"})
    elif case == "histograms a set":
        client.sadd(keys.histograms, "x")
    elif case == "exchange log a string":
        client.set(keys.exchange_log, "x")
    else:
        raise AssertionError(case)
    return {
        "token": keys.token,
        "breaker": keys.breaker,
        "lock": keys.lock,
        "counter": keys.counters,
        "counters": keys.counters,
        "histograms": keys.histograms,
        "exchange": keys.exchange_log,
    }[case.split()[0]]


CORRUPTIONS = [
    "token not JSON",
    "token not UTF-8",
    "token a hash",
    "breaker not a record",
    "lock a list",
    "lock not UTF-8",
    "counters a string",
    "counter not a number",
    "counter field not UTF-8",
    "histograms a set",
    "exchange log a string",
]


def test_a_corrupt_value_reads_as_its_own_store_reads_it_logged_once(
    merchant_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    accounts = _accounts(merchant_settings, len(CORRUPTIONS))
    fleet = AccountClients(accounts)
    client = fleet.redis_for(merchant_settings.fleet.redis_url)
    now = redis_time(client)
    corrupt: dict[str, str] = {}
    for (name, settings), case in zip(accounts.items(), CORRUPTIONS, strict=True):
        keys = AccountKeys.of(
            TokenStore.namespace_for(
                merchant_settings.fleet.key_prefix, "sandbox", settings.api_key
            )
        )
        if not case.startswith("token"):  # a token beside the garbage: it still reads
            store_for(settings, client, name=name).save(Token("tok", now - 60, now + 600, 1))
        corrupt[name] = _corrupt(client, keys, case)
    with caplog.at_level(logging.WARNING, logger="merchant_tasks.store.keys"):
        statuses = account_statuses(fleet)
        account_statuses(fleet)  # the exporter's next scrape: nothing logged again
    fleet_logged = [record.getMessage().split()[0] for record in caplog.records]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="merchant_tasks.store.keys"):
        own = {name: _own_reading(name, s, client) for name, s in accounts.items()}
    own_logged = [record.getMessage().split()[0] for record in caplog.records]
    assert sorted(fleet_logged) == sorted(own_logged) == sorted(corrupt.values())
    for name, case in zip(accounts, CORRUPTIONS, strict=True):
        assert _lasting(statuses[name]) == _lasting(own[name]), case
    by_case = dict(zip(CORRUPTIONS, accounts, strict=True))
    assert statuses[by_case["token a hash"]].state == AccountState.MISSING
    assert statuses[by_case["lock not UTF-8"]].lock_holder is None
    assert statuses[by_case["counter field not UTF-8"]].counters == {"lock_waits": 2}
    assert statuses[by_case["counter not a number"]].counters == {"unauthorized": 3}
    assert statuses[by_case["exchange log a string"]].state == AccountState.FRESH


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
    assert list(statuses) == [*here, *there]
    assert [statuses[name].generation for name in here] == [1, 1, 1]
    assert [statuses[name].generation for name in there] == [5, 5, 5]
    rates = {name: status.exchange_rate for name, status in statuses.items()}
    assert all(rate is not None and rate["rate"] == rate["cap"] for rate in rates.values())


# -- asyncio: a health endpoint ------------------------------------------------------------


def test_the_asyncio_statuses_are_the_blocking_ones(merchant_settings: Settings) -> None:
    """``async_account_statuses`` (docs/operations.md, "A health endpoint") reads what
    ``account_statuses`` reads, on the asyncio fleet's own pools."""
    accounts = _accounts(merchant_settings, 2001, hosts=HOSTS)
    blocking = AccountClients(accounts)
    client = blocking.redis_for(merchant_settings.fleet.redis_url)
    store_tokens(client, list(accounts.values())[:1000], generation=3)
    stores = {name: store_for(s, client, name=name) for name, s in list(accounts.items())[:3]}
    now = redis_time(client)
    stores["shop-1"].records.open_breaker(BreakerRecord(BreakerKind.UNAVAILABLE, now + 60), now)
    stores["shop-2"].records.record_renewal(RenewalReason.MANDATORY, Outcome.OK)

    async def health() -> dict[str, AccountStatus]:
        async with AsyncAccountClients(accounts) as fleet:
            return await async_account_statuses(fleet)

    asynchronous = asyncio.run(health())
    expected = account_statuses(blocking)
    assert list(asynchronous) == list(expected)
    for name in accounts:
        assert _lasting(asynchronous[name]) == _lasting(expected[name]), name
    assert asynchronous["shop-0"].healthy
    assert not asynchronous["shop-1"].healthy  # its breaker is open
    assert asynchronous["shop-2"].counters == {"renewals:mandatory:ok": 1}
    assert asynchronous["shop-1999"].state == AccountState.MISSING


# -- the command ---------------------------------------------------------------------------


def test_status_json_piped_is_one_line_with_every_field_of_a_status(
    merchant_env: dict[str, str],
) -> None:
    result = CliRunner().invoke(main, ["status", "--json"], env=merchant_env)
    assert result.exit_code == 1  # no token yet
    assert result.stdout.count("\n") == 1  # a pipe: one line
    [shown] = json.loads(result.stdout)["accounts"]
    fields = [field.name for field in dataclasses.fields(AccountStatus)]
    assert sorted(shown) == sorted(fields)
    assert shown["state"] == "missing"
    assert shown["exchange_rate"]["counts"]["waited"] == 0


def test_status_json_on_a_terminal_is_indented_with_the_same_document(
    merchant_env: dict[str, str],
) -> None:
    def shown(terminal: bool) -> str:
        reader, writer = pty.openpty() if terminal else os.pipe()
        with subprocess.Popen(
            [sys.executable, "-m", "merchant_tasks.ops.cli", "status", "--json"],
            env={**os.environ, **merchant_env},
            stdout=writer,
        ) as child:
            os.close(writer)
            chunks = []
            while chunk := _read(reader):
                chunks.append(chunk)
            child.wait(timeout=60)
        os.close(reader)
        return b"".join(chunks).decode().replace("\r\n", "\n")

    indented, piped = shown(terminal=True), shown(terminal=False)
    assert indented.startswith('{\n  "accounts": [\n')
    assert piped.count("\n") == 1
    moving = ("now",)
    documents = [json.loads(text)["accounts"] for text in (indented, piped)]
    for accounts in documents:
        for account in accounts:
            for key in moving:
                del account[key]
            account["exchange_rate"].pop("permits")
    assert documents[0] == documents[1]


def _read(descriptor: int) -> bytes:
    try:
        return os.read(descriptor, 65536)
    except OSError:  # a terminal whose other end closed
        return b""
