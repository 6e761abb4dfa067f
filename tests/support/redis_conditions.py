"""Redis as tests need it: unreachable (``dead_redis``), refusing every write for a while
(``OutOfMemory``), or counting the round trips a client makes (``CountingConnection``)."""

from __future__ import annotations

import threading
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.connection import Connection
from redis.retry import Retry

from merchant_tasks.sandbox.processes import free_port


def dead_redis() -> redis.Redis:
    """A client for a port nobody listens on, failing at once (no retries, no back-off)."""
    return redis.Redis(
        host="127.0.0.1",
        port=free_port(),
        socket_connect_timeout=0.2,
        socket_timeout=0.2,
        retry=Retry(NoBackoff(), 0),
    )


class OutOfMemory:
    """A Redis that refuses every write (``maxmemory`` 1, ``noeviction``) from now for
    ``seconds``. ``freeing`` is set just before it takes writes again (a write that waited
    finds it set), ``freed`` once it does."""

    def __init__(self, admin: redis.Redis, seconds: float = 1.0) -> None:
        self.freeing, self.freed = threading.Event(), threading.Event()
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")

        def free() -> None:
            self.freeing.set()
            admin.config_set("maxmemory", "0")
            self.freed.set()

        threading.Timer(seconds, free).start()


class CountingConnection(Connection):
    """A Redis connection that counts what it sends: one packet per command, one per
    pipeline (a round trip each)."""

    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sent += 1
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]
