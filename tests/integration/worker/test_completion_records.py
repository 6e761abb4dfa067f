"""Completion records in a real Redis: found once written, counted, kept past the visibility
timeout, and written once a Redis out of memory takes writes again (or given up past the
call's patience)."""

from __future__ import annotations

import pytest
import redis

from merchant_tasks.sandbox.processes import RedisServer, free_port
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.token import CounterName
from merchant_tasks.worker.completions import CompletionRecords
from support.redis_conditions import OutOfMemory

pytestmark = pytest.mark.integration


VISIBILITY_TIMEOUT = 3600.0
TTL = 2 * VISIBILITY_TIMEOUT


@pytest.fixture
def records(redis_store: TokenStore) -> CompletionRecords:
    return CompletionRecords(redis_store, TTL)


def test_a_recorded_call_is_found_with_its_result_and_the_redelivery_is_counted(
    records: CompletionRecords,
) -> None:
    result = {"id": "pay_1", "amount": 1200, "items": [1, None], "note": "é"}
    records.record("task-1", result)

    earlier = records.earlier_run("task-1")

    assert earlier is not None
    assert earlier.result == result
    assert records.store.records.counters() == {CounterName.REDELIVERED: 1}


def test_an_empty_body_is_a_completed_call_too(records: CompletionRecords) -> None:
    records.record("task-1", None)
    earlier = records.earlier_run("task-1")
    assert earlier is not None
    assert earlier.result is None


def test_a_call_never_recorded_is_not_found_and_not_counted(records: CompletionRecords) -> None:
    records.record("task-1", {"ok": True})
    assert records.earlier_run("task-2") is None
    assert records.store.records.counters() == {}


def test_a_record_lives_twice_the_visibility_timeout_under_the_accounts_namespace(
    records: CompletionRecords, redis_store: TokenStore
) -> None:
    records.record("task-1", {"ok": True})
    key = records.store.keys.completed("task-1")
    assert key == f"{records.store.namespace}:completed:task-1"
    ttl = redis_store.redis.pttl(key)
    assert VISIBILITY_TIMEOUT * 1000 < ttl <= TTL * 1000


def test_a_record_refused_for_lack_of_memory_is_written_once_redis_takes_writes_again(
    private_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The call waits (its message still unacknowledged) rather than return without its
    record: the result and the acknowledgement, on the same Redis, would be refused too."""
    admin = redis.Redis(port=private_redis.port)
    records = CompletionRecords(TokenStore(admin, "mt-test:sandbox:app-id"), TTL)
    window = OutOfMemory(admin, 1.2)
    records.record("task-1", {"ok": True}, patience=30.0)
    assert records.earlier_run("task-1") is not None
    assert "not written yet" in caplog.text
    assert "written after" in caplog.text
    window.freed.wait(10.0)
    admin.close()


def test_a_record_refused_past_the_calls_patience_is_given_up_with_a_warning(
    private_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis.Redis(port=private_redis.port)
    records = CompletionRecords(TokenStore(admin, "mt-test:sandbox:app-id"), TTL)
    admin.replicaof("127.0.0.1", str(free_port()))  # read-only
    try:
        records.record("task-1", {"ok": True}, patience=1.0)
    finally:
        admin.replicaof("NO", "ONE")
    assert "not written (" in caplog.text
    assert "read-only replica" in caplog.text
    assert records.earlier_run("task-1") is None
    admin.close()
