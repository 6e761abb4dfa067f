"""The renewal's unit tests' parts: a scripted token exchange, a ``TokenManager`` on injected
clocks, and what another process of the fleet does meanwhile (holds the lock, stores a
token while the caller waits)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from merchant_tasks.renewal.life import Await, Hold, Limits
from merchant_tasks.renewal.manager import TokenManager
from merchant_tasks.store.keys import Command
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.token import IssuedToken, Token
from support.clock import ManualClock, Sleeper
from support.tokens import LIFETIME, OTHER_HOLDER, stored


class FakeExchange:
    """A token exchange that gives the queued ``outcomes`` in turn (raising the errors), then
    fresh tokens ``tok-issued-1``, ``-2``, ... (``padding`` appended, as long as JWTs), and
    records the clock at each call in ``calls``; ``during`` runs inside each call."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.outcomes: list[IssuedToken | Exception] = []
        self.calls: list[float] = []
        self.during: Callable[[], None] | None = None
        self.padding = ""

    def issued(self, n: int) -> str:
        """The value of the ``n``-th fresh token (from 1)."""
        return f"tok-issued-{n}{self.padding}"

    def __call__(self) -> IssuedToken:
        self.calls.append(self.clock())
        if self.during is not None:
            self.during()
        if self.outcomes:
            outcome = self.outcomes.pop(0)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return IssuedToken(value=self.issued(len(self.calls)), expires_in=LIFETIME)


def make_manager(
    store: TokenStore, exchange: Callable[[], IssuedToken], **options: Any
) -> TokenManager:
    """A ``TokenManager`` for tests: the real windows (480 s / 120 s), a short exchange
    timeout, seeded jitter, no copy of the token in the process and no wake-ups (waits go
    through the injected sleep), unless ``options`` say otherwise."""
    defaults: dict[str, Any] = {
        "renew_before": 480.0,
        "renew_mandatory": 120.0,
        "exchange_timeout": 0.1,
        "rng": random.Random(0),
        "local_copy_ttl": 0.0,  # read the store on every call; the copy has its own tests
        "wake_ups": False,
    }
    fingerprint = options.pop("secret_fingerprint", lambda: "fp")
    return TokenManager(store, exchange, fingerprint, **{**defaults, **options})


@dataclass
class Renewal:
    """A test's ``TokenManager`` on fakeredis and what the test drives it by: its store, its
    clock and sleep, its scripted exchange and the current secret (conftest's ``renewal``)."""

    manager: TokenManager
    store: TokenStore
    clock: ManualClock
    exchange: FakeExchange
    sleep: Sleeper
    secret: list[str]


SHORT_LIMITS = Limits(renewal=1.0, wait=2.0)  # 100 looks at the store instead of 4330: a
# test that waits the limit out (on an injected sleep) need not spin through the real one


def shorten_limits(manager: TokenManager, limits: Limits = SHORT_LIMITS) -> Limits:
    """Give ``manager`` (and its token's life) ``limits`` instead of the real ones."""
    manager.limits = manager.life.limits = limits
    return limits


class SiblingWaits:
    """Counts the threads of ``manager``'s process that have started waiting for a sibling's
    renewal (``life.Await``), so that a test can let the renewal finish once they all wait."""

    def __init__(self, manager: TokenManager) -> None:
        self.count = 0
        self._changed = threading.Condition()
        fly = manager._fly

        def counting(step: Any) -> Any:
            if isinstance(step, Await):
                with self._changed:
                    self.count += 1
                    self._changed.notify_all()
            return fly(step)

        manager._fly = counting  # type: ignore[method-assign]

    def reach(self, threads: int, timeout: float = 10.0) -> None:
        """Wait until ``threads`` threads wait for a sibling's renewal."""
        with self._changed:
            assert self._changed.wait_for(lambda: self.count >= threads, timeout), (
                f"{self.count} of {threads} threads waited for a sibling's renewal"
            )


@contextmanager
def renewing_in_a_thread(
    exchange: FakeExchange, renew: Callable[[], Token]
) -> Iterator[list[Token]]:
    """Run ``renew`` in another thread of the process and hold it inside ``exchange``; the
    ``with`` block runs while it is held there. On leaving, the exchange ends and the thread
    is joined; the list yielded then holds the token it got."""
    exchanging, release = threading.Event(), threading.Event()

    def slow_exchange() -> None:
        exchanging.set()
        assert release.wait(10)

    exchange.during = slow_exchange
    got: list[Token] = []
    renewer = threading.Thread(target=lambda: got.append(renew()))
    renewer.start()
    try:
        assert exchanging.wait(10)
        yield got
    finally:
        release.set()
        renewer.join()


def holder_writes_at_poll(
    poll: int, sleep: Sleeper, store: TokenStore, clock: ManualClock
) -> list[Token]:
    """The holder elsewhere stores a fresh token while the caller sleeps its ``poll``-th
    wait; the list gets that token."""
    written: list[Token] = []

    def holder_finishes(polls: int) -> None:
        if polls == poll:
            written.append(stored(store, clock, left=LIFETIME))

    sleep.on_sleep = holder_finishes
    return written


def hold_lock(store: TokenStore) -> None:
    """Another process takes the renewal lock (and never lets go during the test)."""
    assert store.take_lock(f"{OTHER_HOLDER}:1", f"{OTHER_HOLDER}:", 60.0)


def when_sent(
    store: TokenStore, command: Command[Any] | str, instead: Callable[[Callable[[], Any]], Any]
) -> None:
    """Each time the manager sends ``command`` through ``store`` (one of ``store.ask``'s,
    compared by what it sends; or any run of the script ``command`` names), call
    ``instead`` with the real send: it may act around it, or not send at all."""
    send = store.send

    def matches(sent: Command[Any]) -> bool:
        if isinstance(command, str):
            return sent.args[:2] == ("EVAL", command)
        return sent.args == command.args

    def sending(sent: Command[Any]) -> Any:
        return instead(lambda: send(sent)) if matches(sent) else send(sent)

    store.send = sending  # type: ignore[method-assign,assignment]


class LockHolder:
    """One process's hold on an account's renewal lock, as the model takes it: the store's
    command with a holding of the manager's, its heartbeat beside, its release."""

    def __init__(self, store: TokenStore, lease: float, longest: float) -> None:
        limits = Limits(renewal=longest, wait=2 * longest, lease=lease, heartbeat=lease / 4)
        self.manager = make_manager(store, FakeExchange(), limits=limits)
        self.value: str | None = None

    def acquire(self) -> bool:
        """Take the lock (False if another holds it) and keep its lease alive."""
        life = self.manager.life
        value = life._holding()
        if not self.manager.store.take_lock(value, life.lock_prefix, life.limits.lease):
            return False
        self.value = value
        self.manager.perform(Hold(value))
        return True

    def release(self) -> None:
        assert self.value is not None
        self.manager.run(self.manager.life._release(self.value))
        self.value = None
