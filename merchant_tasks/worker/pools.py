"""Broker and result-backend connection pools sized for the worker's pool and concurrency.

With ``-P gevent`` or ``-P threads`` each task acknowledges its own message as it ends, and
each acknowledgement takes a connection from the broker channel's Redis pool, which kombu
caps at 10. A 401 storm ends many tasks at once: past the cap redis-py raises
``MaxConnectionsError``, kombu logs ``Couldn't ack``, and the message is delivered again
(at once if the consumer reconnects, else at warm shutdown or after the visibility
timeout), so a call the API already executed runs a second time. The result backend's pool
has the same kind of cap (redis-py's default). At worker start, once Celery knows the pool
and the concurrency (``-c``, ``--autoscale`` or ``auto``), every cap below it is raised to
the concurrency plus the consumer's own connections; a smaller value set in celeryconfig is
raised too, with a warning naming the setting.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from merchant_tasks.store.topology import is_kombu_redis_url

log = logging.getLogger(__name__)

CONSUMER_CONNECTIONS = 10  # beyond one per task: the consumer's fetch, restores of unacked
# messages, remote control, events and retries' publishing (kombu's own default cap)
KOMBU_CHANNEL_CAP = 10  # kombu's Redis channel pool when max_connections is not set
REDIS_PY_POOL_CAP = 100  # redis-py's ConnectionPool when max_connections is not set
BROKER_POOL_LIMIT_DEFAULT = 10  # Celery's broker_pool_limit
_BROKER_CAP = "broker_transport_options['max_connections']"


@dataclass(frozen=True)
class PoolSizes:
    """What the worker's connection pools were set to, and the settings that were raised."""

    concurrency: int
    connections: int
    raised: tuple[str, ...]


def connections_needed(concurrency: int) -> int:
    """Connections a worker running ``concurrency`` tasks at once may hold on one pool."""
    return concurrency + CONSUMER_CONNECTIONS


def size_pools(conf: Any, concurrency: int) -> PoolSizes:
    """Raise the broker's and result backend's pool caps in ``conf`` to fit ``concurrency``.

    ``conf`` is a Celery app's configuration; caps already large enough (or unlimited) are
    left alone. Returns what was set.
    """
    needed = connections_needed(concurrency)
    raised: list[str] = []
    options = dict(conf.broker_transport_options or {})
    if is_kombu_redis_url(conf.broker_url or "") and (
        (options.get("max_connections") or KOMBU_CHANNEL_CAP) < needed
    ):  # a Redis transport's cap: another broker (RabbitMQ) has no such option
        _warn_if_set(options.get("max_connections"), _BROKER_CAP, needed)
        options["max_connections"] = needed
        conf.broker_transport_options = options
        raised.append(_BROKER_CAP)
    if (conf.redis_max_connections or REDIS_PY_POOL_CAP) < needed:
        _warn_if_set(conf.redis_max_connections, "redis_max_connections", needed)
        conf.redis_max_connections = needed
        raised.append("redis_max_connections")
    limit = conf.broker_pool_limit
    if limit and limit < needed:  # None or 0: no limit
        if limit != BROKER_POOL_LIMIT_DEFAULT:
            _warn_if_set(limit, "broker_pool_limit", needed)
        conf.broker_pool_limit = needed
        raised.append("broker_pool_limit")
    return PoolSizes(concurrency, needed, tuple(raised))


def worker_concurrency(worker: Any) -> int:
    """The most tasks the worker runs at once: ``-c`` (resolved), or ``--autoscale``'s max."""
    return int(max(worker.concurrency or 1, getattr(worker, "max_concurrency", None) or 0))


def size_pools_at_worker_start(worker: Any) -> PoolSizes:
    """Called by ``worker.install`` at worker start, before any broker connection is made."""
    sizes = size_pools(worker.app.conf, worker_concurrency(worker))
    log.info(
        "connection pools sized for %d tasks at once (%s pool): up to %d connections each%s",
        sizes.concurrency,
        getattr(worker.pool_cls, "__module__", worker.pool_cls),
        sizes.connections,
        f"; raised {', '.join(sizes.raised)}" if sizes.raised else "",
    )
    return sizes


def _warn_if_set(value: object, setting: str, needed: int) -> None:
    if value:
        log.warning(
            "%s allows %s connections, fewer than this worker's concurrency needs (%d): "
            "raised to %d, so no acknowledgement fails for want of a connection",
            setting,
            value,
            needed,
            needed,
        )
