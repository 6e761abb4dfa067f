"""worker.sending: a caller's send returns or raises BrokerUnavailable within its bound, and
changes nothing of the app's own sends."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from merchant_tasks.exceptions import BrokerUnavailable
from merchant_tasks.sandbox.processes import free_port
from merchant_tasks.worker.sending import RETRY_PAUSE, retry_policy, send
from support.clock import ManualClock

PASSWORD = "hunter2-broker"  # searched for in the error
BOUND = 1.0  # seconds: short, the promise is the same for any bound
SLACK = 1.0  # seconds over the bound for a busy machine


def probe() -> None:
    """A task of the shop's."""


@pytest.fixture
def dead_broker_app() -> Iterator[Celery]:
    """An app whose broker and result backend are a Redis nobody listens on."""
    url = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"
    app = Celery("shop", broker=url, backend=url, set_as_current=False)
    app.task(name="shop.probe")(probe)
    yield app
    app.close()


def test_the_retry_policy_starts_no_attempt_that_would_end_past_the_deadline() -> None:
    clock = ManualClock()
    policy = retry_policy(deadline=clock.now + 3.0, attempt=1.0, clock=clock)
    give_up = policy["errback"]
    refused = ConnectionRefusedError("refused")
    give_up(refused, 0)  # at once, then each pause, while an attempt still fits
    clock.now += 1.5
    give_up(refused, RETRY_PAUSE)
    clock.now += 0.5
    with pytest.raises(ConnectionRefusedError):
        give_up(refused, RETRY_PAUSE)  # 2.25 s + an attempt of 1 s: past the deadline
    assert policy["interval_start"] == 0  # a stale connection is replaced at once
    assert policy["max_retries"] == 3 / RETRY_PAUSE


def test_a_broker_nobody_listens_on_is_broker_unavailable_within_the_bound(
    dead_broker_app: Celery,
) -> None:
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable) as raised:
        send(dead_broker_app.tasks["shop.probe"], (), {}, {}, BOUND)
    waited = time.monotonic() - started
    print(f"BrokerUnavailable after {waited:.3f} s (bound {BOUND} s)")
    assert waited < BOUND + SLACK
    error = raised.value
    assert error.retryable
    assert f"127.0.0.1:{dead_broker_app.connection_for_write().port}" in str(error)
    assert PASSWORD not in f"{error} {error!r}"


def test_the_result_is_subscribed_to_at_get_and_the_apps_own_sends_are_unchanged(
    dead_broker_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = dead_broker_app.conf
    before = (conf.task_publish_retry_policy, dict(conf.broker_transport_options))
    backend = dead_broker_app.backend
    subscribed: list[Any] = []
    monkeypatch.setattr(backend.result_consumer, "consume_from", subscribed.append)
    with pytest.raises(BrokerUnavailable):
        send(dead_broker_app.tasks["shop.probe"], (), {}, {"task_id": "bounded"}, BOUND)
    assert subscribed == []  # the Redis backend's get() subscribes, and reads what is stored
    backend.on_task_call(None, "the apps own")  # Celery's send, as a worker's retry
    assert subscribed == ["the apps own"]
    assert (conf.task_publish_retry_policy, dict(conf.broker_transport_options)) == before
