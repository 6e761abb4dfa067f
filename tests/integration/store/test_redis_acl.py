"""The token store works under the least-privilege Redis ACL user docs/topologies.md documents."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from merchant_tasks.accounts import AccountClients, client_for
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import wait_until
from merchant_tasks.settings import FleetSettings, Secret, Settings
from merchant_tasks.store.keys import AccountRedis
from merchant_tasks.store.token_store import LOCK_WAIT_SECONDS
from merchant_tasks.store.topology import redis_from_url
from merchant_tasks.worker.completions import CompletionRecords
from support.account import TEST_API_KEY
from support.paths import ROOT

pytestmark = pytest.mark.integration

# the documented ACL, with the key pattern of this test's prefix
TOKEN_STORE_COMMANDS = (
    "+get +set +del +hincrby +hgetall +zadd +zcount +zremrangebyscore +rpush +lrange +ltrim "
    "+pexpire +eval +evalsha +script|load +time +ping +publish +subscribe +unsubscribe "
    "+type +hset +pttl +zcard"  # the scripts check a key's type and TTL before writing over it
    " +select"  # a Redis URL naming a database other than 0 (redis-py selects it on connect)
)
OTHER_DATABASE = 3  # where the ACL user works when the test's Redis URL names database 0


def _on_another_database(url: str, user: str = "") -> str:
    """``url`` (as ``user``, "name:password", if given) on a database other than 0: the
    test's own when it names one, else ``OTHER_DATABASE`` (a user without SELECT rights
    works on database 0 alone)."""
    address, _, database = url.split("://", 1)[1].partition("/")
    if database in ("", "0"):
        database = str(OTHER_DATABASE)
    return f"redis://{user + '@' if user else ''}{address}/{database}"


def test_the_topologies_page_and_the_reliability_notes_show_this_acl() -> None:
    for document in ("docs/topologies.md", "docs/reliability.md"):
        text = (ROOT / document).read_text()
        block = text[text.index("ACL SETUSER merchant-tokens") :].split("```")[0]
        shown = [word for word in block.split() if word.startswith("+")]
        assert shown == TOKEN_STORE_COMMANDS.split(), document


@pytest.fixture
def acl_user(redis_client: redis.Redis, merchant_key_prefix: str) -> Iterator[tuple[str, str]]:
    name, password = f"mt-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    redis_client.execute_command(  # type: ignore[no-untyped-call]
        "ACL",
        "SETUSER",
        name,
        "on",
        f">{password}",
        "resetkeys",
        f"~{merchant_key_prefix}:*",
        "resetchannels",
        f"&{merchant_key_prefix}:*",
        "-@all",
        *TOKEN_STORE_COMMANDS.split(),
    )
    yield name, password
    redis_client.execute_command("ACL", "DELUSER", name)  # type: ignore[no-untyped-call]


def test_the_documented_acl_user_is_enough_for_the_token_store(
    acl_user: tuple[str, str],
    merchant_redis_url: str,
    merchant_key_prefix: str,
    merchant_sandbox: MerchantSandbox,
    merchant_secret_file: Path,
) -> None:
    name, password = acl_user
    store_url = _on_another_database(merchant_redis_url, f"{name}:{password}")
    settings = Settings(
        api_key=TEST_API_KEY,
        secret=Secret(path=merchant_secret_file),
        base_url=merchant_sandbox.url,
        fleet=FleetSettings(redis_url=store_url, key_prefix=merchant_key_prefix),
    )
    client = client_for(settings)
    assert client.request("GET", "/open-api/v1/ping") == {"ok": True}
    signal = client.manager.signal
    assert signal is not None
    wait_until(lambda: signal.listening, "the subscription to renewal announcements", 10.0)
    heard = signal.heard
    merchant_sandbox.app.revoke_all()
    assert client.request("GET", "/open-api/v1/ping") == {"ok": True}  # lock, CAS, counters
    # a wait for another's renewal, noted now and recorded by the next write
    store = client.manager.store
    assert store.note_wait(store.seen_generation, 30.0)
    client.manager.renew(force=True)
    assert merchant_sandbox.exchanges()["ok"] == 3
    rate = client.manager.rate  # the host's exchange rate: every exchange took a permit
    assert rate is not None
    assert isinstance(rate.commands, AccountRedis)
    rate.commands.send(rate.cut())  # a 429's halving
    assert rate.state().counts == {**rate.state().counts, "granted_caller": 3, "cuts": 1}
    assert f"{LOCK_WAIT_SECONDS}:sum_us" in store.records.histograms()
    wait_until(lambda: signal.heard >= heard + 2, "both renewals announced", 10.0)
    # completion records of calls that succeeded (completions.py)
    records = CompletionRecords(store, ttl=60.0)
    records.record("task-1", {"ok": True})
    assert records.earlier_run("task-1") is not None
    # beat's check and its claims (due.py): one pipeline of TIME and GETs, SET NX, DEL
    fleet = AccountClients({"default": settings, "other": replace(settings, api_key="other")})
    assert fleet.due() == ["other"]
    fleet.renewal_done("other")
    # the other database is not the fixtures' to empty; the client is closed, not left to GC
    with redis_from_url(_on_another_database(merchant_redis_url)) as cleanup:
        keys = list(cleanup.scan_iter(match=f"{merchant_key_prefix}:*"))
        if keys:
            cleanup.delete(*keys)


def test_the_acl_user_cannot_touch_keys_outside_its_prefix(
    acl_user: tuple[str, str], merchant_redis_url: str
) -> None:
    name, password = acl_user
    host = merchant_redis_url.split("://", 1)[1]
    with (
        redis_from_url(f"redis://{name}:{password}@{host}") as limited,
        pytest.raises(redis.exceptions.NoPermissionError),
    ):
        limited.get("celery")
