"""Wake-ups: a process waiting for another process's renewal is woken when it is stored.

The renewer publishes the new generation on the account's ``renewed`` channel
(``TokenStore.announce``). Each process keeps one subscriber thread and one connection per
Redis client, subscribed to the channel of every account the process uses: a worker
serving a thousand accounts holds one listening connection, not a thousand. Waiters block
on their account's condition, not on Redis, so a storm costs no polling. A lost message
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
from collections.abc import Callable
from typing import Any, Protocol

from redis.client import PubSub

from merchant_tasks.store.keys import REDIS_ERRORS
from merchant_tasks.store.token_store import TokenStore, open_subscription

log = logging.getLogger(__name__)

LISTEN_TICK = 0.5  # seconds the subscriber blocks on its socket before it takes up a newly
# used account's channel, or ends because no account of the process needs it any more
LISTENING_ERRORS = (*REDIS_ERRORS, OSError, ValueError, AttributeError)  # what ends a
# subscriber's listening, thread or task alike: waiters poll until it resubscribes
RESUBSCRIBE_AFTER = 1.0  # after a dropped subscription, try again at most once a second


class RenewalSignal:
    """Counts the renewals of one account this process has heard of; threads wait for the next."""

    def __init__(self, store: TokenStore) -> None:
        self._redis = store.redis
        self.channel = store.keys.renewed
        self.heard = 0  # announcements heard so far; waiters wait for it to grow
        self._reset_after_fork()
        _SIGNALS.add(self)

    def _reset_after_fork(self) -> None:
        # a forked child has no subscriber thread; the parent's connection is not ours
        self._cond = threading.Condition()
        self._listening = False

    @property
    def listening(self) -> bool:
        """Whether announcements are being received (else callers poll)."""
        return self._listening

    @property
    def subscriber_thread(self) -> threading.Thread | None:
        """The thread that listens for this signal's account, while one runs."""
        thread = subscriber_for(self._redis).thread_of(self)
        return thread if isinstance(thread, threading.Thread) else None

    def start(self) -> None:
        """Have this process's subscriber listen for the account (cheap: called on each
        store read)."""
        if not self._listening:
            subscriber_for(self._redis).add(self)

    def stop(self) -> None:
        """This process no longer listens for the account (its client closed): the
        subscriber drops its channel within LISTEN_TICK, and ends when none is left."""
        subscriber_for(self._redis).discard(self)
        self._subscribed(False)

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
            self._cond.notify_all()  # waiters re-check the store rather than trust a dead line


class Signal(Protocol):
    """What a subscriber tells a signal (``RenewalSignal``, or ``store.async_store``'s)."""

    channel: str

    def _heard(self) -> None: ...

    def _subscribed(self, listening: bool) -> None: ...


class _Subscriber:
    """One process's subscription connection to one Redis, shared by every account on it:
    which channels are wanted and confirmed, and who hears what. The listening itself is a
    thread's (``_listen``) or, for asyncio, a task's (``store.async_store``), started by
    ``start``."""

    def __init__(self, client: Any, start: Callable[[_Subscriber], Any] | None = None) -> None:
        self._client = client
        self._start = start or _listening_thread
        self._lock = threading.Lock()
        self._signals: dict[str, weakref.WeakSet[Signal]] = {}
        self._confirmed: set[str] = set()  # channels the server confirmed subscribing
        self.thread: Any = None  # the listening thread (or task), while one runs
        self._next_try = 0.0

    @property
    def client(self) -> Any:
        return self._client

    def add(self, signal: Signal) -> None:
        with self._lock:
            self._signals.setdefault(signal.channel, weakref.WeakSet()).add(signal)
            confirmed = signal.channel in self._confirmed
            if _ended(self.thread) and time.monotonic() >= self._next_try:
                self.thread = self._start(self)
        if confirmed:  # another signal of this account subscribed already
            signal._subscribed(True)

    def discard(self, signal: Signal) -> None:
        with self._lock:
            members = self._signals.get(signal.channel)
            if members is not None:
                members.discard(signal)

    def thread_of(self, signal: Signal) -> Any:
        with self._lock:
            members = self._signals.get(signal.channel)
            return self.thread if members is not None and signal in members else None

    def wanted(self) -> set[str]:
        """The channels some live signal still needs; forgets the others."""
        with self._lock:
            for channel in [c for c, members in self._signals.items() if not members]:
                del self._signals[channel]
            if not self._signals:
                self.thread = None  # decided under the lock: a new add() starts another
            self._confirmed &= set(self._signals)
            return set(self._signals)

    def deliver(self, message: dict[str, Any]) -> None:
        """A subscription confirmed or an announcement heard: tell the channel's signals."""
        if message["type"] not in ("subscribe", "message"):
            return
        channel = message["channel"]
        channel = channel.decode() if isinstance(channel, bytes) else str(channel)
        with self._lock:
            if message["type"] == "subscribe":
                self._confirmed.add(channel)
            members = list(self._signals.get(channel, ()))
        for signal in members:
            if message["type"] == "subscribe":
                signal._subscribed(True)
            else:
                signal._heard()

    def _listen(self) -> None:
        """The subscriber thread: takes up new channels each tick, ends when none is left."""
        pubsub: PubSub | None = None
        try:
            pubsub = open_subscription(self._client)
            subscribed: set[str] = set()
            while True:
                wanted = self.wanted()
                if not wanted:
                    return
                if wanted - subscribed:
                    pubsub.subscribe(*(wanted - subscribed))
                if subscribed - wanted:
                    pubsub.unsubscribe(*(subscribed - wanted))  # type: ignore[no-untyped-call]
                subscribed = wanted
                message: dict[str, Any] | None = pubsub.get_message(timeout=LISTEN_TICK)
                if message is not None:
                    self.deliver(message)  # holds no signal across ticks: they may end
        except LISTENING_ERRORS as exc:
            self.stopped(exc)
        finally:
            if pubsub is not None:
                with contextlib.suppress(*REDIS_ERRORS, OSError):
                    pubsub.close()

    def stopped(self, exc: BaseException | None = None) -> None:
        """The listening ended (the subscription dropped: waiters poll meanwhile); on
        ``exc``, said."""
        if exc is not None:
            log.info(
                "renewal announcements lost (%s); waiters poll until resubscribed",
                type(exc).__name__,
            )
        with self._lock:
            self.thread = None
            self._confirmed.clear()
            self._next_try = time.monotonic() + RESUBSCRIBE_AFTER
            signals = [s for members in self._signals.values() for s in members]
        for signal in signals:
            signal._subscribed(False)


def _ended(listener: Any) -> bool:
    """Whether no listener runs: none started, or its thread or task is over (a task dies
    with its event loop, without saying so)."""
    if listener is None:
        return True
    if isinstance(listener, threading.Thread):
        return not listener.is_alive()
    return bool(listener.done())


def _listening_thread(subscriber: _Subscriber) -> threading.Thread:
    thread = threading.Thread(target=subscriber._listen, name="renewal-announcements", daemon=True)
    thread.start()
    return thread


_SUBSCRIBERS: weakref.WeakKeyDictionary[Any, _Subscriber] = weakref.WeakKeyDictionary()
_SUBSCRIBERS_LOCK = threading.Lock()
_SIGNALS: weakref.WeakSet[RenewalSignal] = weakref.WeakSet()


def subscriber_for(client: Any, start: Callable[[_Subscriber], Any] | None = None) -> _Subscriber:
    """This process's subscriber for ``client`` (one per Redis client), made on first use;
    ``start``: how its listening starts (a thread unless given)."""
    with _SUBSCRIBERS_LOCK:
        subscriber = _SUBSCRIBERS.get(client)
        if subscriber is None:
            subscriber = _SUBSCRIBERS[client] = _Subscriber(client, start)
        return subscriber


def _after_fork_in_child() -> None:
    global _SUBSCRIBERS_LOCK
    _SUBSCRIBERS_LOCK = threading.Lock()
    _SUBSCRIBERS.clear()  # the parent's threads and connections are not the child's
    for signal in list(_SIGNALS):
        signal._reset_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
