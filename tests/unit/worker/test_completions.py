"""Completion records (worker/completions.py) never in the way of a call when Redis is
unreachable, and the redelivered calls they answer shown by status and metrics."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from merchant_tasks.ops.metrics import FleetCollector
from merchant_tasks.ops.status import AccountState, AccountStatus, format_status
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.token import CounterName
from merchant_tasks.worker.completions import CompletionRecords
from support.redis_conditions import dead_redis

VISIBILITY_TIMEOUT = 3600.0
TTL = 2 * VISIBILITY_TIMEOUT


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
