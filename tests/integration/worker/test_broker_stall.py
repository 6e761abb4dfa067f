"""A send to a broker that stalls (a fork for BGSAVE, an fsync, a busy server) but takes the
message: the call is queued once (worker/sending.py: a command on the broker gets the
whole bound, and is never sent a second time within it)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

import merchant_tasks
from merchant_tasks.exceptions import BrokerUnavailable
from merchant_tasks.sandbox.processes import RedisServer, wait_until
from merchant_tasks.tasks import call_api
from merchant_tasks.worker import install as install_module

pytestmark = pytest.mark.integration

STALL = 1.5  # seconds Redis answers nobody: over a third of the 3 s bound, within it


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "broker", "--enable-debug-command", "local") as server:
        yield server


@pytest.fixture
def shop_app(broker: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Celery]:
    monkeypatch.setattr(install_module, "_shop_app", None)
    monkeypatch.setenv("MERCHANT_ENQUEUE_TIMEOUT", "3")
    app = Celery("shop", broker=broker.url, backend=broker.url, set_as_current=False)
    merchant_tasks.install(app)
    yield app
    app.close()


def answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.TimeoutError:
        return False


def queued(client: redis.Redis) -> list[Any]:
    """Every message in every list of the broker (the queues)."""
    messages: list[Any] = []
    for key in client.scan_iter(count=1000):
        if client.type(key) == b"list":
            messages += client.lrange(key, 0, -1)
    return messages


def test_a_send_to_a_broker_that_stalls_within_the_bound_queues_the_call_once(
    broker: RedisServer, shop_app: Celery
) -> None:
    admin = redis.Redis.from_url(broker.url)
    assert call_api.delay("GET", "/open-api/v1/ping").id  # connections made, the queue bound
    before = queued(admin)
    stalling = redis.Redis.from_url(broker.url)
    stall = threading.Thread(target=stalling.execute_command, args=("DEBUG", "SLEEP", STALL))
    stall.start()
    probe = redis.Redis.from_url(broker.url, socket_timeout=0.05)
    wait_until(lambda: not answers(probe), "Redis stalling", 10.0)
    probe.close()
    try:
        sent = call_api.delay("POST", "/open-api/v1/payments", json={"amount": 7})
    except BrokerUnavailable:  # a machine slower than the bound: then it must say so
        sent = None
    stall.join()
    stalling.close()
    after = [message for message in queued(admin) if message not in before]
    admin.close()
    if sent is not None:
        assert len(after) == 1, f"{len(after)} messages for one send"
        assert sent.id.encode() in after[0]
    else:  # it may have been taken, once at most
        assert len(after) <= 1, f"{len(after)} messages for one send"
