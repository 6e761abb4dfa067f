"""Wake-ups: a process waiting for another process's renewal is woken when it is stored.

One subscriber thread per account and process listens on the account's ``renewed``
channel; the renewer publishes the new generation there (``TokenStore.announce``).
Waiters block on a condition, not on Redis, so a storm costs no polling. A lost message
(the subscription dropped, or not yet confirmed) costs a bounded poll, which the caller
keeps as its fallback (docs/design.md, "Storms").
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from typing import Any

import redis
from redis.client import PubSub

from .store import TokenStore

log = logging.getLogger(__name__)

LISTEN_TICK = 1.0  # seconds the subscriber blocks on its socket before checking that
# someone still needs it (it ends with its manager)
RESUBSCRIBE_AFTER = 1.0  # after a dropped subscription, try again at most once a second


class RenewalSignal:
    """Counts the renewals this process has heard of, and lets threads wait for the next."""

    def __init__(self, store: TokenStore) -> None:
        self._redis = store.redis
        self._channel = store.renewed_channel
        self.heard = 0  # announcements heard so far; waiters wait for it to grow
        self._next_try = 0.0
        self._reset_after_fork()
        _SIGNALS.add(self)

    def _reset_after_fork(self) -> None:
        # a forked child has no subscriber thread; the parent's connection is not ours
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._listening = False

    @property
    def listening(self) -> bool:
        """Whether announcements are being received (else callers poll)."""
        return self._listening

    def start(self) -> None:
        """Start the subscriber thread unless it runs (cheap: called on each store read)."""
        if self._thread is not None or time.monotonic() < self._next_try:
            return
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=_listen,
                args=(weakref.ref(self), self._redis, self._channel),
                name=f"renewal-signal {self._channel}",
                daemon=True,
            )
            self._thread.start()

    def wait(self, heard: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s for an announcement after ``heard``; True if one came."""
        with self._cond:
            return self._cond.wait_for(lambda: self.heard > heard, timeout)

    def _heard(self) -> None:
        with self._cond:
            self.heard += 1
            self._cond.notify_all()

    def _subscribed(self, listening: bool) -> None:
        with self._cond:
            self._listening = listening
            if not listening:
                self._thread = None
                self._next_try = time.monotonic() + RESUBSCRIBE_AFTER
            self._cond.notify_all()  # waiters re-check the store rather than trust a dead line


def _listen(signal_ref: weakref.ref[RenewalSignal], client: redis.Redis, channel: str) -> None:
    """The subscriber thread: holds only a weak reference, so it ends with its signal."""
    try:
        # Redis and RedisCluster both make their own kind of PubSub here
        pubsub: PubSub = client.pubsub()  # type: ignore[no-untyped-call]
    except (redis.RedisError, OSError, AttributeError) as exc:
        log.info("renewal announcements unavailable (%s); waiters poll", type(exc).__name__)
        owner = signal_ref()
        if owner is not None:
            owner._subscribed(False)
        return
    try:
        pubsub.subscribe(channel)
        while True:
            message: dict[str, Any] | None = pubsub.get_message(timeout=LISTEN_TICK)
            signal = signal_ref()
            if signal is None:
                return
            if message is not None and message["type"] == "subscribe":
                signal._subscribed(True)
            elif message is not None and message["type"] == "message":
                signal._heard()
            del signal
    except (redis.RedisError, OSError, ValueError) as exc:
        log.info(
            "renewal announcements lost (%s); waiters poll until resubscribed",
            type(exc).__name__,
        )
    finally:
        owner = signal_ref()
        if owner is not None:
            owner._subscribed(False)
        with contextlib.suppress(redis.RedisError, OSError):
            pubsub.close()


_SIGNALS: weakref.WeakSet[RenewalSignal] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for signal in list(_SIGNALS):
        signal._reset_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
