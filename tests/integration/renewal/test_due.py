"""Beat's fleet-wide check: which accounts are due, at what cost, and what beat sends."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import pytest
import redis
from kombu.exceptions import OperationalError

from merchant_tasks import tasks
from merchant_tasks.accounts import AccountClients
from merchant_tasks.exceptions import StoreUnavailable
from merchant_tasks.renewal.due import (
    SPREAD_TICKS,
    claim_key,
    claim_ttl,
    due_accounts,
    namespace_of,
    renewal_point,
)
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import RedisServer, free_port
from merchant_tasks.settings import (
    RENEW_BEFORE,
    RENEW_INTERVAL,
    RENEW_MANDATORY,
    TOKEN_LIFETIME,
    FleetSettings,
    Secret,
    Settings,
)
from merchant_tasks.store.keys import AccountKeys
from merchant_tasks.store.token_store import MGET_CHUNK
from merchant_tasks.worker import task_bodies
from merchant_tasks.worker.app import RENEWAL_QUEUE
from support.account import TEST_API_KEY
from support.redis_conditions import CountingConnection, OutOfMemory
from support.tokens import store_tokens

pytestmark = pytest.mark.integration

ACCOUNTS = 1000
Sent = list[tuple[tuple[Any, ...], dict[str, Any]]]  # what renew_token sent: args, options
Serve = Callable[[dict[str, Settings]], AccountClients]  # makes this worker serve accounts


@pytest.fixture
def counting_redis(merchant_redis_url: str, merchant_key_prefix: str) -> Iterator[redis.Redis]:
    pool = redis.ConnectionPool.from_url(merchant_redis_url, connection_class=CountingConnection)
    client = redis.Redis(connection_pool=pool)
    yield client
    keys = list(client.scan_iter(match=f"{merchant_key_prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


def _account(key_prefix: str, n: int, redis_url: str) -> Settings:
    return Settings(
        api_key=f"key-{n}",
        secret=Secret("unused"),
        renew_before=RENEW_BEFORE,
        renew_mandatory=RENEW_MANDATORY,
        fleet=FleetSettings(
            redis_url=redis_url, key_prefix=key_prefix, renew_interval=RENEW_INTERVAL
        ),
    )


class FleetOf(Protocol):
    def __call__(self, count: int, redis_url: str | None = None) -> dict[str, Settings]: ...


@pytest.fixture
def fleet_of(merchant_key_prefix: str, merchant_redis_url: str) -> FleetOf:
    """Accounts shop-0, shop-1, ... in this test's namespace, on its Redis unless told."""

    def fleet(count: int, redis_url: str | None = None) -> dict[str, Settings]:
        url = redis_url or merchant_redis_url
        return {f"shop-{n}": _account(merchant_key_prefix, n, url) for n in range(count)}

    return fleet


# -- the renewal point ---------------------------------------------------------------------


def test_each_account_renews_at_its_own_fixed_point_inside_the_advisory_window(
    fleet_of: FleetOf,
) -> None:
    accounts = fleet_of(400)
    points = [renewal_point(s) for s in accounts.values()]
    first = next(iter(accounts.values()))
    lowest = first.renew_mandatory + SPREAD_TICKS * first.fleet.renew_interval
    assert all(lowest <= p <= first.renew_before for p in points)
    # fixed: the same settings give the same point on every host and after every restart
    assert renewal_point(replace(first)) == points[0]
    # spread over the window, not bunched at one end
    window = first.renew_before - lowest
    assert max(points) - min(points) > 0.9 * window
    assert abs(statistics.mean(points) - (lowest + window / 2)) < 0.1 * window


def test_the_point_is_renew_before_when_the_window_leaves_no_room_to_spread(
    merchant_key_prefix: str, merchant_redis_url: str
) -> None:
    account = _account(merchant_key_prefix, 1, merchant_redis_url)
    narrow = replace(
        account,
        renew_before=100,
        renew_mandatory=90,
        fleet=replace(account.fleet, renew_interval=60),
    )
    assert renewal_point(narrow) == 100


# -- the check -----------------------------------------------------------------------------


def test_a_thousand_accounts_with_nothing_due_cost_one_round_trip(
    counting_redis: redis.Redis, fleet_of: FleetOf
) -> None:
    accounts = fleet_of(ACCOUNTS)
    store_tokens(counting_redis, accounts.values(), left=TOKEN_LIFETIME - 60)
    before = CountingConnection.sent
    assert due_accounts(accounts, lambda url: counting_redis) == []
    assert CountingConnection.sent - before == 1


def test_accounts_past_one_read_cost_one_round_trip_and_keep_their_order(
    counting_redis: redis.Redis, fleet_of: FleetOf
) -> None:
    accounts = fleet_of(2 * MGET_CHUNK + 500)  # three MGETs
    names = list(accounts)
    due = {names[1], names[MGET_CHUNK], names[-1]}  # first in a chunk, and the last
    store_tokens(
        counting_redis, (accounts[n] for n in names if n not in due), left=TOKEN_LIFETIME - 60
    )
    before = CountingConnection.sent
    assert due_accounts(accounts, lambda url: counting_redis) == [n for n in names if n in due]
    assert CountingConnection.sent - before == 1


def test_missing_unreadable_and_past_their_point_tokens_are_due_and_fresh_ones_not(
    redis_client: redis.Redis, fleet_of: FleetOf
) -> None:
    accounts = fleet_of(6)
    s = list(accounts.values())
    store_tokens(redis_client, [s[0]], left=TOKEN_LIFETIME - 60)  # fresh
    store_tokens(redis_client, [s[1]], left=renewal_point(s[1]) + 5)  # just before its point
    store_tokens(redis_client, [s[2]], left=renewal_point(s[2]) - 5)  # just past it
    store_tokens(redis_client, [s[3]], left=s[3].renew_mandatory / 2)  # in the mandatory window
    redis_client.set(AccountKeys.of(namespace_of(s[4])).token, b"not json", px=60_000)
    # s[5]: nothing stored
    assert due_accounts(accounts, lambda url: redis_client) == [
        "shop-2",
        "shop-3",
        "shop-4",
        "shop-5",
    ]
    redis_client.delete(AccountKeys.of(namespace_of(s[0])).token)
    redis_client.hset(AccountKeys.of(namespace_of(s[0])).token, "a", "b")  # the wrong type: due too
    assert due_accounts(accounts, lambda url: redis_client)[0] == "shop-0"


def test_tokens_issued_together_fall_due_over_the_window_not_at_once(
    redis_client: redis.Redis, fleet_of: FleetOf
) -> None:
    """After a cold start every token has the same time left: a quarter of the way into
    the spread, about a quarter of the accounts are due; none before it, all after."""
    accounts = fleet_of(ACCOUNTS)
    first = next(iter(accounts.values()))
    top = first.renew_before
    bottom = first.renew_mandatory + SPREAD_TICKS * first.fleet.renew_interval

    def due_with_time_left(time_left: float) -> int:
        store_tokens(redis_client, accounts.values(), left=time_left)
        return len(due_accounts(accounts, lambda url: redis_client))

    assert due_with_time_left(top + 10) == 0
    assert 0.15 * ACCOUNTS < due_with_time_left(top - (top - bottom) / 4) < 0.35 * ACCOUNTS
    assert due_with_time_left(bottom - 10) == ACCOUNTS


def test_accounts_on_two_redis_servers_cost_one_round_trip_per_server(
    counting_redis: redis.Redis,
    merchant_key_prefix: str,
    merchant_redis_url: str,
    fleet_of: FleetOf,
) -> None:
    other_url = merchant_redis_url.rsplit("/", 1)[0] + "/1"
    pool = redis.ConnectionPool.from_url(other_url, connection_class=CountingConnection)
    other = redis.Redis(connection_pool=pool)
    accounts = {
        **fleet_of(3),
        **{f"other-{n}": _account(merchant_key_prefix, 100 + n, other_url) for n in range(3)},
    }
    counting_redis.ping()  # connect first: the connection's own handshake is not counted
    other.ping()
    before = CountingConnection.sent
    due = due_accounts(accounts, lambda url: other if url == other_url else counting_redis)
    assert sorted(due) == sorted(accounts)
    assert CountingConnection.sent - before == 2
    other.close()


def test_an_unreachable_redis_is_store_unavailable_naming_the_variable(fleet_of: FleetOf) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    with pytest.raises(StoreUnavailable, match="MERCHANT_REDIS_URL"):
        due_accounts(fleet_of(2, url), lambda _: client)
    client.close()


# -- beat's task ---------------------------------------------------------------------------


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Sent:
    """What renew_token sends, recorded instead of published."""
    calls: Sent = []

    def record(args: tuple[Any, ...], **options: Any) -> None:
        calls.append((args, options))

    monkeypatch.setattr(tasks.renew_account, "apply_async", record)
    return calls


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Serve:
    """Makes this worker serve the given accounts (the clients its tasks use)."""

    def install(accounts: dict[str, Settings]) -> AccountClients:
        clients = AccountClients(accounts)
        monkeypatch.setattr(task_bodies, "_clients", clients)
        return clients

    return install


def test_beat_sends_one_renewal_task_per_due_account_on_the_renewal_queue_and_builds_no_client(
    serve: Serve, sent: Sent, redis_client: redis.Redis, fleet_of: FleetOf
) -> None:
    accounts = fleet_of(ACCOUNTS)
    store_tokens(redis_client, list(accounts.values())[2:], left=TOKEN_LIFETIME - 60)
    fleet = serve(accounts)
    tasks.renew_token()
    assert [args for args, _ in sent] == [("shop-0",), ("shop-1",)]
    assert {options["queue"] for _, options in sent} == {RENEWAL_QUEUE}
    assert fleet._clients == {}  # clients are made by the renewal tasks, per account


def test_beat_sends_an_accounts_renewal_again_only_once_the_pending_one_has_run(
    serve: Serve, sent: Sent, redis_client: redis.Redis, fleet_of: FleetOf
) -> None:
    accounts = fleet_of(3)
    fleet = serve(accounts)
    tasks.renew_token()
    assert len(sent) == 3
    tasks.renew_token()  # a second beat, or the next tick while the tasks wait in the queue
    assert len(sent) == 3
    ttl = redis_client.pttl(claim_key(accounts["shop-0"]))
    assert 0 < ttl <= claim_ttl(accounts["shop-0"]) * 1000
    assert sent[0][1]["expires"] == claim_ttl(accounts["shop-0"])
    fleet.renewal_done("shop-0")  # as renew_account does when it has run, even failing
    tasks.renew_token()
    assert [args for args, _ in sent[3:]] == [("shop-0",)]


def test_beat_with_redis_down_logs_a_warning_and_sends_nothing(
    serve: Serve, sent: Sent, caplog: pytest.LogCaptureFixture, fleet_of: FleetOf
) -> None:
    serve(fleet_of(3, f"redis://127.0.0.1:{free_port()}/0"))
    with caplog.at_level(logging.WARNING, logger="merchant_tasks.worker.task_bodies"):
        tasks.renew_token()
    assert sent == []
    assert "scheduled token check failed" in caplog.text


def test_with_one_of_two_redis_servers_down_beat_still_renews_the_accounts_of_the_other(
    serve: Serve,
    sent: Sent,
    merchant_key_prefix: str,
    caplog: pytest.LogCaptureFixture,
    fleet_of: FleetOf,
) -> None:
    """Accounts spread over servers (MERCHANT_ACCOUNTS_SOURCE): a server down skips its own
    accounts, logged naming it, not every account's renewal."""
    down = f"redis://127.0.0.1:{free_port()}/0"
    accounts = {
        **fleet_of(2),
        "elsewhere": _account(merchant_key_prefix, 100, down),
    }
    serve(accounts)
    with caplog.at_level(logging.WARNING, logger="merchant_tasks.renewal.due"):
        tasks.renew_token()
    assert sorted(args for args, _ in sent) == [("shop-0",), ("shop-1",)]
    assert "skipped the accounts on Redis" in caplog.text
    assert down.split("//")[1].split("/")[0] in caplog.text  # host:port of the one down


def test_a_failing_account_renewal_is_logged_and_another_account_still_renews(
    serve: Serve,
    merchant_sandbox: MerchantSandbox,
    merchant_secret_file: Path,
    redis_client: redis.Redis,
    merchant_key_prefix: str,
    merchant_redis_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    good = Settings(
        api_key=TEST_API_KEY,
        secret=Secret(path=merchant_secret_file),
        base_url=merchant_sandbox.url,
        fleet=FleetSettings(redis_url=merchant_redis_url, key_prefix=merchant_key_prefix),
    )
    bad = replace(good, api_key="unknown-key")
    serve({"bad": bad, "good": good})
    with caplog.at_level(logging.WARNING, logger="merchant_tasks.worker.task_bodies"):
        tasks.renew_account("bad")
        tasks.renew_account("good")
    assert "scheduled token renewal of account bad failed" in caplog.text
    assert redis_client.exists(AccountKeys.of(namespace_of(good)).token)
    assert not redis_client.exists(claim_key(bad), claim_key(good))  # beat may send again
    assert merchant_sandbox.exchanges()["ok"] == 1


def test_a_renewal_the_broker_refuses_is_released_and_sent_at_the_next_tick(
    serve: Serve,
    monkeypatch: pytest.MonkeyPatch,
    sent: Sent,
    caplog: pytest.LogCaptureFixture,
    fleet_of: FleetOf,
) -> None:
    """The broker refuses the first renewal beat sends (out of memory): the task ends
    without an error, and neither that account's claim nor the unsent ones' stay behind."""
    serve(fleet_of(3))

    def refuse(args: tuple[Any, ...], **options: Any) -> None:
        raise OperationalError("OOM command not allowed")

    with monkeypatch.context() as patched:
        patched.setattr(tasks.renew_account, "apply_async", refuse)
        with caplog.at_level(logging.WARNING, logger="merchant_tasks.worker.task_bodies"):
            tasks.renew_token()
    assert "renewal of account shop-0 not sent (OperationalError)" in caplog.text
    tasks.renew_token()
    assert sorted(args for args, _ in sent) == [("shop-0",), ("shop-1",), ("shop-2",)]


def test_beat_whose_claims_redis_refuses_for_memory_ends_only_once_it_takes_writes(
    serve: Serve,
    sent: Sent,
    private_redis: RedisServer,
    caplog: pytest.LogCaptureFixture,
    fleet_of: FleetOf,
) -> None:
    """Its acknowledgement, on the same Redis by default, would be refused too, which stops
    the worker (docs/reliability.md, row 43): like a renewal, beat's check waits."""
    serve(fleet_of(2, private_redis.url))
    admin = redis.Redis(port=private_redis.port)
    window = OutOfMemory(admin)
    try:
        with caplog.at_level(logging.WARNING, logger="merchant_tasks.worker.task_bodies"):
            tasks.renew_token()
        assert window.freeing.is_set()  # it returned only once Redis took writes again
        assert "scheduled token check failed" in caplog.text
        assert "out of memory" in caplog.text
        assert sent == []
        tasks.renew_token()  # the next tick sends them
        assert sorted(args for args, _ in sent) == [("shop-0",), ("shop-1",)]
    finally:
        window.freed.wait(10.0)
        admin.close()
