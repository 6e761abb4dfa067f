"""Celery's and kombu's writes to a Redis broker and result backend wait out a Redis that
refuses writes (out of memory, read-only).

kombu's Redis transport emulates acknowledgements: a fetched message is popped from its
queue and then recorded as unacknowledged (``QoS.append``: ZADD and HSET in a MULTI), and
an acknowledgement removes that record (``QoS.ack``: ZREM and HDEL in a MULTI). A Redis out
of memory (``maxmemory`` with ``noeviction``) or read-only (a failover under way) refuses a
MULTI whole, and kombu raises the refusal in the worker's event loop: the worker stops
("Unrecoverable error"), the message it had just popped is lost, and the ones it held stay
unacknowledged for the visibility timeout (docs/reliability.md, row 43; celery/celery#5716).

``wait_out_refused_writes`` makes both wait instead, retrying every ``RECORD_RETRY_PACE``
seconds while Redis refuses writes, up to ``WAIT_IN_PLACE``: the popped message is then
recorded and delivered, and the acknowledgement lands, for the application's own tasks as
for ours. A refused MULTI applied nothing, so running it again is safe.

Celery's Redis result backend retries a result write (SETEX and PUBLISH in a MULTI) only
after a connection error, even with ``result_backend_always_retry``: a refused one was
lost, and its caller's ``get`` timed out. ``wait_out_refused_writes`` also counts a refusal
as safe to retry there, within the backend's own retry budget (``result_backend_max_retries``,
about a minute with the package's settings).

Installed at worker start for an app whose broker is Redis (``worker.install``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from celery.backends.redis import RedisBackend
from kombu.transport import redis as kombu_redis
from tenacity import RetryCallState

from merchant_tasks.exceptions import StoreRefusingWrites
from merchant_tasks.store.keys import REFUSING_WRITES, cause
from merchant_tasks.worker.completions import once_writes_are_taken
from merchant_tasks.worker.task_bodies import WAIT_IN_PLACE

log = logging.getLogger(__name__)

WHAT = {  # kombu's QoS methods that write in one MULTI, and what each writes
    "append": "a fetched message's record as unacknowledged",
    "ack": "a message's acknowledgement",
}


def wait_out_refused_writes() -> None:
    """Make kombu's Redis ``QoS.append`` and ``QoS.ack`` wait while Redis refuses writes,
    and Celery's Redis result backend retry a refused write (once per process; later calls
    do nothing)."""
    qos = kombu_redis.QoS
    for name in WHAT:
        method = getattr(qos, name)
        if not getattr(method, "_waits_out_refused_writes", False):
            setattr(qos, name, _patient(name, method))
    safe = RedisBackend.exception_safe_to_retry
    if not getattr(safe, "_waits_out_refused_writes", False):
        RedisBackend.exception_safe_to_retry = _also_refused_writes(safe)


def _also_refused_writes(safe: Callable[[Any, Exception], bool]) -> Callable[..., bool]:
    @functools.wraps(safe)
    def safe_to_retry(self: Any, exc: Exception) -> bool:
        return isinstance(exc, REFUSING_WRITES) or safe(self, exc)

    safe_to_retry._waits_out_refused_writes = True  # type: ignore[attr-defined]
    return safe_to_retry


def _patient(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def patient(self: Any, *args: Any, **kwargs: Any) -> Any:
        answer: list[Any] = []

        def attempt() -> None:
            try:
                answer.append(method(self, *args, **kwargs))
            except REFUSING_WRITES as exc:
                raise StoreRefusingWrites(f"the broker's Redis {cause(exc)}") from exc

        def waiting(state: RetryCallState) -> None:
            if state.attempt_number == 1 and state.outcome is not None:
                log.warning("%s waits: %s", WHAT[name], state.outcome.exception())

        try:
            waited = once_writes_are_taken(attempt, WAIT_IN_PLACE, before_sleep=waiting)
        except StoreRefusingWrites as exc:  # past the patience: as kombu raised it
            raise exc.__cause__ from None  # type: ignore[misc]
        if waited:
            log.warning("%s written after %.1f s", WHAT[name], waited)
        return answer[0]

    patient._waits_out_refused_writes = True  # type: ignore[attr-defined]
    return patient
