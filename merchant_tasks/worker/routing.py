"""Where Celery messages go: each queue bound to its own exchange and routing key.

A queue declared by name only is bound to Celery's default exchange with the default
routing key ``celery``, so a message sent with ``exchange="celery", routing_key="celery"``
reached both queues and ran twice (a payment created twice). Each queue here has an
exchange and a routing key of its own name, so every message lands in exactly one queue.

Brokers keep bindings: a Redis or RabbitMQ that served an older release still binds the
renewal queue to ``celery``/``celery``. Workers remove that binding when they start
(``remove_stale_bindings``).
"""

from __future__ import annotations

import logging
from typing import Any

from kombu import Exchange, Queue

log = logging.getLogger(__name__)

CALLS_QUEUE = "celery"  # Celery's default queue: app code needs no routing to enqueue calls
RENEWAL_QUEUE = "merchant-renewal"  # its own queue, so a backlog of calls never delays it
# (queue, exchange, routing key) bindings that older releases made and that must go
STALE_BINDINGS = ((RENEWAL_QUEUE, CALLS_QUEUE, CALLS_QUEUE),)
CONNECT_RETRIES = 2  # at worker start: a broker still down is the consumer's to wait for
VISIBILITY_TIMEOUT = 3600  # seconds an unacknowledged message waits before redelivery


def own_queue(name: str) -> Queue:
    """A queue bound to a direct exchange of its own name with its own name as routing key."""
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def remove_stale_bindings(
    app: Any, bindings: tuple[tuple[str, str, str], ...] = STALE_BINDINGS
) -> None:
    """Unbind what older releases bound, so no message is delivered to two queues."""
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=CONNECT_RETRIES)
        channel = connection.default_channel
        for queue, exchange, routing_key in bindings:
            if hasattr(channel, "keyprefix_queue"):  # kombu's Redis transport
                # its queue_unbind changes only an in-memory copy of the binding table
                member = channel.sep.join([routing_key, "", queue])
                client = channel.client
                client.srem(channel.keyprefix_queue % exchange, member)
                client.srem(channel.keyprefix_binding_permanent % exchange, member)
            else:
                channel.queue_unbind(queue, exchange=exchange, routing_key=routing_key)
            log.debug("removed any binding of %s to %s/%s", queue, exchange, routing_key)
