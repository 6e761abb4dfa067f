"""Queue bindings on real brokers: an old binding is removed, each queue gets its messages."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue

from merchant_tasks.worker.routing import remove_stale_bindings

pytestmark = pytest.mark.integration

RABBITMQ = ("127.0.0.1", 5672)
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


def _answers(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture
def rabbitmq() -> Iterator[Celery]:
    if not _answers(RABBITMQ):
        pytest.skip("no RabbitMQ on 127.0.0.1:5672")
    app = Celery("routing-test", broker=RABBITMQ_URL, set_as_current=False)
    yield app
    app.close()


def _waiting(connection: Connection, queue: Queue) -> int:
    _, count, _ = queue.bind(connection.default_channel).queue_declare(passive=True)
    return int(count)


def test_an_old_binding_is_removed_from_rabbitmq_and_messages_stop_reaching_that_queue(
    rabbitmq: Celery,
) -> None:
    tag = uuid.uuid4().hex[:10]
    exchange = Exchange(f"mt-test-x-{tag}", type="direct")  # outlives its last binding
    queue = Queue(f"mt-test-q-{tag}", exchange, routing_key=f"rk-{tag}", auto_delete=True)
    # with publisher confirms, a publish returns once the broker has routed the message
    with Connection(RABBITMQ_URL, transport_options={"confirm_publish": True}) as connection:
        queue.bind(connection.default_channel).declare()
        try:
            producer = connection.Producer()
            producer.publish({"n": 1}, exchange=exchange, routing_key=f"rk-{tag}")
            assert _waiting(connection, queue) == 1  # bound: the message arrived

            remove_stale_bindings(rabbitmq, ((queue.name, exchange.name, f"rk-{tag}"),))
            producer.publish({"n": 2}, exchange=exchange, routing_key=f"rk-{tag}")
            assert _waiting(connection, queue) == 1  # unbound: the second one did not
        finally:
            queue.bind(connection.default_channel).delete()
            exchange.bind(connection.default_channel).delete()
