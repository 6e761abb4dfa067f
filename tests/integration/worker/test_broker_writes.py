"""Acknowledgements and results on Redis wait out a Redis refusing writes
(worker/broker_writes.py): real kombu and Celery's result backend, a private redis-server
made to run out of memory, no worker."""

from __future__ import annotations

import logging

import pytest
import redis
from celery import Celery
from celery.backends.redis import RedisBackend
from kombu import Connection
from kombu.transport import redis as kombu_redis

from merchant_tasks.sandbox.processes import RedisServer
from merchant_tasks.worker.broker_writes import wait_out_refused_writes
from support.redis_conditions import OutOfMemory

pytestmark = pytest.mark.integration

REFUSED_FOR = 1.0  # seconds Redis refuses writes in each test
# Celery 5.7's Redis result backend writes with redis-py's deprecated setex (its own doing)
CELERY_SETEX = pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")


def _kombus_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """kombu's and Celery's own methods for this test (another test's worker start, in this
    process, may have installed the workaround), and whatever was there back after it."""
    for owner, name in (
        (kombu_redis.QoS, "append"),
        (kombu_redis.QoS, "ack"),
        (RedisBackend, "exception_safe_to_retry"),
    ):
        method = getattr(owner, name)
        monkeypatch.setattr(owner, name, getattr(method, "__wrapped__", method))


@pytest.fixture
def patient_qos(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workaround installed for this test only."""
    _kombus_own(monkeypatch)
    wait_out_refused_writes()


def test_a_message_fetched_while_redis_refuses_writes_is_recorded_and_delivered(
    private_redis: RedisServer, patient_qos: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Popped from its queue, then recorded as unacknowledged in a MULTI Redis refuses: kombu
    raised that (in a worker's event loop it stops the worker) and the message was lost."""
    admin = redis.Redis(port=private_redis.port)
    with Connection(private_redis.url) as connection:
        queue = connection.SimpleQueue("mt-acks")
        queue.put({"order": 1})
        window = OutOfMemory(admin, REFUSED_FOR)
        with caplog.at_level(logging.WARNING, logger="merchant_tasks.worker.broker_writes"):
            message = queue.get(timeout=10)
        assert window.freeing.is_set()  # it waited for Redis to take writes
        window.freed.wait(10.0)
        assert message.payload == {"order": 1}
        assert admin.hlen("unacked") == 1  # recorded: a lost worker's message comes back
        assert "record as unacknowledged waits" in caplog.text
        assert "out of memory" in caplog.text
        message.ack()
        queue.close()
    assert admin.hlen("unacked") == 0
    admin.close()


def test_an_acknowledgement_while_redis_refuses_writes_lands_once_it_takes_them(
    private_redis: RedisServer, patient_qos: None
) -> None:
    """kombu raised the refused acknowledgement; a Celery worker stopped on it."""
    admin = redis.Redis(port=private_redis.port)
    with Connection(private_redis.url) as connection:
        queue = connection.SimpleQueue("mt-acks")
        queue.put({"order": 2})
        message = queue.get(timeout=10)
        window = OutOfMemory(admin, REFUSED_FOR)
        message.ack()
        assert window.freeing.is_set()
        window.freed.wait(10.0)
        assert admin.hlen("unacked") == 0
        queue.close()
    admin.close()


def test_without_the_workaround_kombu_loses_the_message_fetched_in_the_window(
    private_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upstream behaviour the workaround exists for (celery/celery#5716), as kombu 5.7
    has it: if this starts failing, kombu has changed and the workaround may go."""
    _kombus_own(monkeypatch)
    admin = redis.Redis(port=private_redis.port)
    with Connection(private_redis.url) as connection:
        queue = connection.SimpleQueue("mt-acks")
        queue.put({"order": 3})
        window = OutOfMemory(admin, REFUSED_FOR)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            queue.get(timeout=10)
        window.freed.wait(10.0)
        assert admin.llen("mt-acks") == 0  # popped: gone from the queue...
        assert admin.hlen("unacked") == 0  # ... and never recorded
        queue.close()
    admin.close()


def _results_app(url: str) -> Celery:
    """Celery's Redis result backend as the package configures it (retrying)."""
    app = Celery("results", set_as_current=False)
    app.conf.update(result_backend=url, result_backend_always_retry=True)
    return app


@CELERY_SETEX
def test_a_result_written_while_redis_refuses_writes_is_stored_once_it_takes_them(
    private_redis: RedisServer, patient_qos: None
) -> None:
    """Celery retried a result write only after a connection error: a refused one was lost
    (the call had run; its caller's get timed out)."""
    admin = redis.Redis(port=private_redis.port)
    app = _results_app(private_redis.url)
    try:
        window = OutOfMemory(admin, REFUSED_FOR)
        app.backend.store_result("call-1", {"ok": True}, "SUCCESS")
        assert window.freeing.is_set()
        window.freed.wait(10.0)
        assert app.AsyncResult("call-1").get(timeout=10) == {"ok": True}
    finally:
        app.close()
        admin.close()


@CELERY_SETEX
def test_without_the_workaround_celery_does_not_retry_a_refused_result_write(
    private_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _kombus_own(monkeypatch)
    admin = redis.Redis(port=private_redis.port)
    app = _results_app(private_redis.url)
    try:
        window = OutOfMemory(admin, REFUSED_FOR)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            app.backend.store_result("call-2", {"ok": True}, "SUCCESS")
        window.freed.wait(10.0)
    finally:
        app.close()
        admin.close()
