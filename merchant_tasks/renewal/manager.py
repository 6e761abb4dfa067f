"""The blocking driver of the token's life: ``TokenManager`` runs ``renewal.life``'s flows
with redis-py (the account's ``TokenStore``), the token exchange it is given (a callable:
nothing here speaks HTTP), threads and ``time.sleep``.

It decides nothing: every step it carries out is a flow's (docs/design.md, "The model").
What is here is how a step is done in a blocking process: a Redis command sent, an
exchange made, a sleep, the wake-up of an announcement heard by this process's subscriber
thread (``store.wakeup``), this process's renewal led by one thread while its siblings
wait on an event (``Fly``), and a lock holding kept alive by a heartbeat thread.

- ``token()`` is the callers' path: the copy while trusted (no flow, no Redis), else the
  flow ``TokenLife.token``;
- ``refused(token, path)`` after a 401, ``accepted(token, path)`` after a 2xx;
- ``renew()`` is beat's and the operator's path (``renew(force=True)``); ``renew(stale_token=t)``
  is ``refused(t)``, as releases before this one called it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from merchant_tasks.flows import Clock, Flow, Moment, Redis, Sleep, drive
from merchant_tasks.renewal import life
from merchant_tasks.store.exchange_rate import ExchangeRate
from merchant_tasks.store.token_store import RedisClock, TokenStore
from merchant_tasks.store.topology import SOCKET_CONNECT_TIMEOUT, SOCKET_TIMEOUT
from merchant_tasks.store.wakeup import RenewalSignal
from merchant_tasks.token import IssuedToken, RenewalPolicy, RenewalReason, Token

log = logging.getLogger(__name__)

# seconds close() waits for a heartbeat to end: one command's connect and reply at most
HEARTBEAT_STOP = SOCKET_CONNECT_TIMEOUT + SOCKET_TIMEOUT

T = TypeVar("T")
Clock_ = Callable[[], float]

_owner: tuple[int, str] = (0, "")


def process_owner() -> str:
    """This process's owner id (``host:pid:nonce``): the same for all its threads, new after
    a fork; also what ``Token.renewed_by`` names."""
    global _owner
    pid = os.getpid()
    if _owner[0] != pid:
        _owner = (pid, f"{socket.gethostname()}:{pid}:{uuid.uuid4().hex[:8]}")
    return _owner[1]


class _Seat:
    """A thread's place in this process's renewal of an account: its leader's, or a
    joiner's (``life.Fly``); the flight's outcome is shared through an event."""

    def __init__(self, replacing: int, leader: bool, flight: _Seat | None = None) -> None:
        self.replacing = replacing
        self.leader = leader
        self.flight = flight or self  # the leader's seat holds the outcome
        self.landed = threading.Event()
        self.outcome: Token | Exception | None = None


class _Stopped(Exception):
    """Internal: a heartbeat's holding ended."""


class TokenManager:
    """Gives out the account's token and renews it, once for the whole fleet."""

    def __init__(
        self,
        store: TokenStore,
        exchange: Callable[[], IssuedToken],
        secret_fingerprint: Callable[[], str],
        *,
        renew_before: float,
        renew_mandatory: float,
        exchange_timeout: float,
        clock: Clock_ | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        local_copy_ttl: float = life.LOCAL_COPY_TTL,
        monotonic: Clock_ = time.monotonic,
        wake_ups: bool = True,
        rate: ExchangeRate | None = None,
        endpoint: str = "",
        limits: life.Limits | None = None,
        owns_redis: bool = False,
    ) -> None:
        self.store = store
        self.owns_redis = owns_redis  # its store's Redis client is its own: close() closes it
        self.exchange = exchange
        self.secret_fingerprint = secret_fingerprint  # of the credentials in use (a pause
        # opened against other ones ends at once)
        self.clock: Clock_ = clock or RedisClock(store.time, monotonic)  # the store's
        self.monotonic = monotonic
        self.sleep = sleep
        self.signal = RenewalSignal(store) if wake_ups else None
        self.rate = rate
        self.limits = limits or life.Limits.for_exchange(exchange_timeout)
        self.life = life.TokenLife(
            store.ask,
            RenewalPolicy(renew_before, renew_mandatory),
            self.limits,
            rate=rate,
            endpoint=endpoint,
            rng=rng,
            copy_ttl=local_copy_ttl,
        )
        self._heartbeats: dict[str, threading.Event] = {}  # the holdings kept alive
        # their threads, until they end: a holding let go (``Unhold``) only tells its
        # heartbeat to stop, and it may be in the middle of a command
        self._beating: list[threading.Thread] = []
        self._remake_locks()
        _MANAGERS.add(self)  # its locks are remade in a forked child

    def _remake_locks(self) -> None:
        self._fly_lock = threading.Lock()
        self.life.after_fork(process_owner(), f"{process_owner()}:{uuid.uuid4().hex[:6]}:")

    def __repr__(self) -> str:
        return f"TokenManager(store={self.store!r})"

    def close(self) -> None:
        """Stop what this manager runs beside its callers (it hears no more announcements,
        its heartbeats end) and close its store's Redis client if it is its own.

        A heartbeat in the middle of a command is waited for (at most HEARTBEAT_STOP): the
        caller closes the Redis pool next, and a pool closed under a command raised from
        redis-py's socket reader in the heartbeat's thread (a traceback, not a
        StoreUnavailable)."""
        if self.signal is not None:
            self.signal.stop()
        for stop in list(self._heartbeats.values()):
            stop.set()
        for thread in list(self._beating):
            if thread.ident is not None:  # started (one not yet ends at its first rest)
                thread.join(HEARTBEAT_STOP)
        if self.owns_redis:
            self.store.redis.close()

    # -- callers -------------------------------------------------------------------------

    def token(self, path: str = "") -> Token:
        """A token to call the API with (on ``path``: a route held back stops it); renews
        only when under the mandatory window."""
        token = self.life.ready(self._moment())
        if token is not None and not token.routes:
            return token
        return self.run(self.life.token_for(path) if path else self.life.token())

    def refused(self, token: Token, path: str = "") -> Token:
        """A request on ``path`` with ``token`` got 401: the token that replaces it, or the
        error that says why not (``TokenLife.refused``)."""
        return self.run(self.life.refused(token, path))

    def accepted(self, token: Token, path: str = "") -> None:
        """The API accepted ``token`` on ``path``: recorded once per generation (and per
        route its record names), best effort."""
        self.run(self.life.accepted(token, path))

    # -- beat, operators -----------------------------------------------------------------

    def renew(self, force: bool = False, stale_token: Token | None = None) -> Token:
        """Renew if due (beat's scheduled check: only inside the advisory window), or always
        with ``force`` (an operator); ``stale_token``: ``refused(stale_token)``."""
        if stale_token is not None:
            return self.refused(stale_token)
        if force:
            self.store.load()  # the stored token's generation counts if the counter was evicted
            purpose = life.Purpose(RenewalReason.MANUAL, seen=self.store.generation())
        else:
            purpose = life.Purpose(RenewalReason.SCHEDULED)
        return self.run(self.life.renewal(purpose))

    # -- the driver ----------------------------------------------------------------------

    def run(self, flow: Flow[T], sleep: Callable[[float], None] | None = None) -> T:
        """Carry out ``flow``'s steps until it returns (or raises); ``sleep``: its sleeps."""
        rest = sleep or self.sleep
        return drive(flow, lambda step: self.perform(step, rest))

    def _moment(self) -> Moment:
        return Moment(self.clock(), self.monotonic())

    def perform(self, step: Any, sleep: Callable[[float], None] | None = None) -> Any:
        """Carry out one step of a flow of the token's life (or the send loop's Redis,
        sleep and clock steps)."""
        kind = type(step)
        if kind is Redis:
            return self.store.send(step.command)
        if kind is Clock:
            return self._moment()
        if kind is Sleep:
            return (sleep or self.sleep)(step.seconds)
        if kind is life.Exchange:
            return self.exchange()
        if kind is life.Credentials:
            return self.secret_fingerprint()
        return self._coordinate(step)

    def _coordinate(self, step: Any) -> Any:
        """The steps between this process's threads, and with other processes' renewals."""
        if isinstance(step, life.Heard):
            if self.signal is None:
                return 0
            self.signal.start()  # from now on, this process hears of renewals elsewhere
            return self.signal.heard
        if isinstance(step, life.Listen):
            if self.signal is not None and self.signal.listening:
                return self.signal.wait(step.heard, life.POLL_MAX)
            return self.sleep(step.poll)
        if isinstance(step, life.Fly | life.Await | life.Land):
            return self._fly(step)
        if isinstance(step, life.Hold):
            return self._hold(step.value)
        if isinstance(step, life.Unhold):
            stop = self._heartbeats.pop(step.value, None)
            if stop is not None:
                stop.set()
            return None
        raise TypeError(f"not a step: {step!r}")

    def _fly(self, step: life.Fly | life.Await | life.Land) -> Any:
        """This process's renewal of the account: one thread leads, the others wait for
        its outcome."""
        if isinstance(step, life.Fly):
            with self._fly_lock:
                flight = self.life.flight
                if isinstance(flight, _Seat):
                    return _Seat(flight.replacing, leader=False, flight=flight)
                seat = _Seat(step.replacing, leader=True)
                self.life.flight = seat
                return seat
        assert isinstance(step.flight, _Seat)
        flight = step.flight.flight
        if isinstance(step, life.Await):
            return flight.outcome if flight.landed.wait(step.timeout) else life.TIMED_OUT
        with self._fly_lock:
            if self.life.flight is flight:
                self.life.flight = None
        flight.outcome = step.outcome
        flight.landed.set()
        return None

    def _hold(self, holding: str) -> None:
        """Keep ``holding`` alive beside the renewal: a thread runs the heartbeat flow until
        ``life.Unhold``."""
        stop = threading.Event()

        def rest(seconds: float) -> None:
            if stop.wait(seconds):
                raise _Stopped

        def beat() -> None:
            with contextlib.suppress(_Stopped):
                self.run(self.life.heartbeat(holding), sleep=rest)

        thread = threading.Thread(target=beat, name="renewal-lock-lease", daemon=True)
        self._heartbeats[holding] = stop
        self._beating = [*(t for t in self._beating if t.is_alive()), thread]
        thread.start()


# A fork copies the locks as they are: one held by a parent's thread would stay held in the
# child for ever, as no thread there can release it. Every manager gets new ones instead.
_MANAGERS: weakref.WeakSet[TokenManager] = weakref.WeakSet()


def _remake_locks_after_fork() -> None:
    for manager in list(_MANAGERS):
        manager._remake_locks()


os.register_at_fork(after_in_child=_remake_locks_after_fork)
