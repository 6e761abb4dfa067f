"""A caller's send of a task: within MERCHANT_ENQUEUE_TIMEOUT, or ``BrokerUnavailable``.

Celery's own send waits out a broker that is away, as a worker publishing a call's retry
must (the call is in its hands: docs/reliability.md, rows 17 and 43): about a minute of
publish retries (``worker.app.PUBLISH_RETRY_POLICY``); then, on the Redis result backend,
the subscription to the result made at send time retried its reconnection for about 19 s
and raised "The Celery application must be restarted". A web request must not wait so:
every thread of a web server waits on it at once. ``send`` bounds the one send it makes,
and changes nothing of the app's configuration (workers, ``Task.retry`` and beat publish
as before):

- the message goes through a producer of a pool of the app's broker connections of its
  own, whose connects give up after a share of the bound (``ATTEMPTS_PER_BOUND``), its
  commands after the whole bound: a broker host that takes no connection costs one
  attempt, not the system's two minutes of TCP retries, and a command that may have been
  taken is never sent again;
- kombu's publish reconnects at once, then every ``RETRY_PAUSE`` seconds, while another
  attempt can end before the deadline (the retry policy's ``errback`` stops it);
- the result is not subscribed to at send time (``_subscribe_on_get``): Celery's Redis
  backend subscribes when ``get()`` is called and reads a result stored before, so
  nothing is lost, and a send never meets the result consumer's reconnection loop.

kombu's ``OperationalError`` then becomes ``BrokerUnavailable`` naming the broker's host and
port. Nothing is left behind: the first send once the broker is back reconnects at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from celery.backends.redis import RedisBackend
from kombu import pools
from kombu.exceptions import LimitExceeded, OperationalError

from merchant_tasks.exceptions import BrokerUnavailable
from merchant_tasks.store.topology import is_kombu_redis_url

ATTEMPTS_PER_BOUND = 3  # a connect may take a third of the bound: a broker host that takes
# no connection leaves time to try again
RETRY_PAUSE = 0.25  # seconds between reconnections: a restarted Redis is found at once

_bounded: ContextVar[bool] = ContextVar("merchant_tasks_bounded_send", default=False)


def send(
    task: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    options: Mapping[str, Any],
    timeout: float,
) -> Any:
    """``task.apply_async(args, kwargs, **options)`` within ``timeout`` seconds: its
    ``AsyncResult``, or BrokerUnavailable. ``options`` given as ``producer`` or
    ``retry_policy`` replace the bounded ones."""
    deadline = time.monotonic() + timeout
    app = task.app
    attempt = timeout / ATTEMPTS_PER_BOUND
    _subscribe_on_get(app.backend)
    producers = _producer_pool(app, timeout, attempt)
    token = _bounded.set(True)
    try:
        # every connection of the pool busy with other sends for the whole bound: LimitExceeded
        with producers.acquire(block=True, timeout=timeout) as producer:
            bounded = {
                "producer": producer,
                "retry": True,
                "retry_policy": retry_policy(deadline, attempt),
            }
            return task.apply_async(args, kwargs, **{**bounded, **options})
    except (OperationalError, LimitExceeded) as exc:
        raise BrokerUnavailable(
            f"the broker at {app.connection_for_write().host} did not take {task.name} "
            f"within {timeout:g} s ({type(exc.__cause__ or exc).__name__}; it may have been "
            "taken if the broker stalled): send the call again later, with the same "
            "idempotency key (check broker_url, "
            "MERCHANT_REDIS_URL by default; MERCHANT_ENQUEUE_TIMEOUT sets the wait)"
        ) from exc
    finally:
        _bounded.reset(token)


def retry_policy(
    deadline: float, attempt: float, clock: Callable[[], float] = time.monotonic
) -> dict[str, Any]:
    """kombu's publish retry policy (``Connection.ensure``) that starts no attempt, of up
    to ``attempt`` seconds, which could end after ``deadline`` (on ``clock``)."""

    def give_up_past_the_deadline(exc: BaseException, interval: float) -> None:
        if clock() + interval + attempt > deadline:
            raise exc

    return {
        # a count as well as the deadline: with refusals at once, one attempt per pause
        "max_retries": math.ceil(max(0.0, deadline - clock()) / RETRY_PAUSE),
        "interval_start": 0,  # a stale pooled connection is replaced at once
        "interval_step": RETRY_PAUSE,
        "interval_max": RETRY_PAUSE,
        "errback": give_up_past_the_deadline,
    }


def _producer_pool(app: Any, timeout: float, attempt: float) -> Any:
    """A kombu producer pool of ``app``'s broker whose connects time out after ``attempt``
    seconds, its commands after the whole ``timeout``, and whose reconnections end after
    ``timeout`` (kombu's ``connect_timeout``); kombu keeps one per broker and options
    (``kombu.pools``, as Celery keeps its own). A connect that timed out sent nothing and
    is tried again; a command that timed out may have been taken (a Redis stalled by a
    fork or an fsync runs it when it wakes), and kombu would publish it again: one send
    queued the call twice, and two workers ran it at once."""
    options: dict[str, Any] = {}
    if is_kombu_redis_url(app.conf.broker_write_url or app.conf.broker_url or ""):
        options = {"socket_connect_timeout": attempt, "socket_timeout": timeout}
    connection = app.connection_for_write(connect_timeout=timeout, transport_options=options)
    return pools.producers[connection]


def _subscribe_on_get(backend: Any) -> None:
    """Make ``backend`` leave the subscription to a bounded send's result to ``get()``.

    Celery's Redis backend subscribes to a task's result when it is sent
    (``on_task_call``); with Redis away, its reconnection loop waited about 19 s and then
    raised RuntimeError. Its ``get()`` subscribes too and reads a result already stored,
    so nothing is lost. Every other send through ``backend`` subscribes as before.
    """
    if not isinstance(backend, RedisBackend) or hasattr(backend.on_task_call, "_bounded"):
        return
    subscribe: Callable[[Any, str], None] = backend.on_task_call

    def on_task_call(producer: Any, task_id: str) -> None:
        if not _bounded.get():
            subscribe(producer, task_id)

    on_task_call._bounded = True  # type: ignore[attr-defined]
    backend.on_task_call = on_task_call
