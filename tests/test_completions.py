"""Completion records in a real Redis: found once written, counted, kept past the visibility
timeout, and never in the way of a call when Redis is unreachable."""

from __future__ import annotations

import logging

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from conftest import OutOfMemory, dead_redis
from merchant_tasks.ops.metrics import FleetCollector
from merchant_tasks.ops.status import AccountState, AccountStatus, format_status
from merchant_tasks.sandbox.processes import RedisServer, free_port
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.token import CounterName
from merchant_tasks.worker.completions import CompletionRecords

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


def test_with_redis_unreachable_the_call_goes_ahead_and_the_lost_record_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = dead_redis()
    records = CompletionRecords(TokenStore(dead, "mt-test:sandbox:k"), TTL)
    with caplog.at_level(logging.WARNING, logger="merchant_tasks.worker.completions"):
        assert records.earlier_run("task-1") is None
        records.record("task-1", {"ok": True}, patience=30.0)  # unreachable: not waited for
    assert "no completion record of call task-1 could be read" in caplog.text
    assert "a redelivery would call the API again" in caplog.text
    dead.close()


def test_status_and_metrics_show_the_redelivered_calls_answered_from_their_record() -> None:
    status = AccountStatus(
        account="default",
        environment="sandbox",
        api_key="k",
        now=0.0,
        state=AccountState.MISSING,
        counters={CounterName.REDELIVERED: 3},
    )
    assert "redelivered_completed_calls=3" in format_status(status)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(lambda: {"default": status}))
    text = generate_latest(registry).decode()
    assert (
        'merchant_tasks_redelivered_completed_calls_total{account="default",'
        'environment="sandbox"} 3.0'
    ) in text


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
