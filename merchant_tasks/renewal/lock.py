"""At most one renewal at a time for the whole fleet, the others wait for it: the fleet's
renewal lock (``RenewalLock``), single flight (``SingleFlight``) and this process's copy of
the token (``LocalCopy``, trusted for a second without reading Redis).

``SingleFlight`` holds one Redis lock per account across hosts and processes; inside a
process, threads take their turn first, so in a storm one thread per process talks to Redis
while the others wait for its token without polling. Processes that find the lock held wait
for the renewer's announcement (``store.wakeup.RenewalSignal``), with a bounded poll as the
fallback. The exchange is passed in as a callable: nothing here speaks HTTP (docs/design.md,
"Who does what").

``RenewalLock``, the renewal lock of one account, is taken, extended and released here only:

- **Owner.** The lock's value is ``<host>:<pid>:<nonce>:<lock>:<holding>``: the process
  (drawn once per process, again after a fork), this lock object (one per account and
  process: two managers of one account in one process, as tests and the bench make, are
  two owners) and a number per holding. A lock command that ran late, after its caller
  gave up on a stalled Redis, still names this owner: the next attempt of any of the
  process's threads takes it over at once instead of waiting out the lease. Release and
  extension name the holding, so a late release never frees a later holding's lock.
- **Lease.** Short: a holder that dies frees the lock within ``lease`` seconds. While it
  lives, a watchdog thread extends the lease every third of it, so a renewal may take
  longer than one lease (retries, waits) without another process taking the lock.
- **One holder per process.** Threads of one process share the owner id, so the process
  also keeps who holds the lock locally: a thread asks Redis only when no sibling holds it.

The store runs the commands (``TokenStore.take_lock`` and the 401 script); nothing else
names the lock's value. See docs/design.md, "Guards on exchanges".
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import NamedTuple, TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from merchant_tasks.exceptions import RenewalTimeout, StoreUnavailable
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.store.wakeup import RenewalSignal
from merchant_tasks.token import Token

log = logging.getLogger(__name__)

EXTENSIONS_PER_LEASE = 3  # the watchdog extends the lease every third of it: two extensions
# may fail (a slow Redis) before another process could take the lock

R = TypeVar("R")

_owner: tuple[int, str] = (0, "")


def process_owner() -> str:
    """This process's owner id (``host:pid:nonce``): the same for all its threads, new after
    a fork; also what ``Token.renewed_by`` names."""
    global _owner
    pid = os.getpid()
    if _owner[0] != pid:
        _owner = (pid, f"{socket.gethostname()}:{pid}:{uuid.uuid4().hex[:8]}")
    return _owner[1]


class RenewalLock:
    """One account's renewal lock as seen from this process."""

    def __init__(self, store: TokenStore, lease: float, longest: float) -> None:
        self.store = store
        self.lease = lease
        # the longest renewal (``manager.limits``): a holding is extended no longer, so one
        # that nothing will release (its holder died in a thread, or lost it to an error
        # raised between taking and using it) frees the account within a lease after that
        self.longest = longest
        self._holdings = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Forget any holding (a forked child holds nothing: the watchdog did not follow)."""
        self.prefix = f"{process_owner()}:{uuid.uuid4().hex[:6]}:"  # what a holding names
        self._mutex = threading.Lock()
        self._value: str | None = None  # this process's holding, while it holds the lock
        self._stop = threading.Event()

    def __repr__(self) -> str:
        return f"RenewalLock(store={self.store!r}, lease={self.lease})"

    def acquire(self) -> bool:
        """Take the lock for this process; False if a sibling thread or another process
        holds it."""
        taken, _ = self.acquire_with(
            lambda value: (
                (self.store.take_lock(value, self.prefix, self.lease), None)
                if value is not None
                else (False, None)
            )
        )
        return taken

    def acquire_with(self, command: Callable[[str | None], tuple[bool, R]]) -> tuple[bool, R]:
        """Run a store command that tries the lock with a new holding's value (None when a
        sibling thread holds it: the command must not take it); returns whether it took the
        lock, and what else the command returned."""
        with self._mutex:
            value = None if self._value is not None else f"{self.prefix}{next(self._holdings)}"
            if value is not None:
                self._value = value  # claimed locally, before Redis is asked
        try:
            taken, result = command(value)
        except BaseException:
            if value is not None:
                self._forget(value)
            raise
        if value is None:
            return False, result
        if not taken:
            self._forget(value)
            return False, result
        self._start_watchdog(value)
        return True, result

    def release(self) -> None:
        """Release this process's holding; one that expired or cannot be reached is only
        logged (its lease frees it anyway)."""
        value = self._value
        if value is None:
            return
        self._forget(value)
        try:
            if not self.store.release_lock(value):
                log.warning("the renewal lock expired before its holder released it")
        except StoreUnavailable as exc:
            log.warning("could not release the renewal lock (its lease frees it): %s", exc)

    def _forget(self, value: str) -> None:
        with self._mutex:
            if self._value == value:
                self._value = None
                self._stop.set()
                self._stop = threading.Event()

    def _start_watchdog(self, value: str) -> None:
        stop = self._stop
        threading.Thread(
            target=self._keep_alive, args=(value, stop), name="renewal-lock-lease", daemon=True
        ).start()

    def _keep_alive(self, value: str, stop: threading.Event) -> None:
        """Extend the lease while the holding lasts, up to the longest renewal; stop if the
        lock was lost."""
        ends = time.monotonic() + self.longest
        while not stop.wait(self.lease / EXTENSIONS_PER_LEASE):
            if time.monotonic() > ends:
                log.warning(
                    "the renewal lock of %s was held past the longest renewal (%.0f s): its "
                    "lease is no longer extended",
                    self.store.namespace,
                    self.longest,
                )
                return
            try:
                if not self.store.extend_lock(value, self.lease):
                    log.warning("the renewal lock was lost during a renewal: its lease ran out")
                    return
            except StoreUnavailable as exc:
                log.warning("could not extend the renewal lock's lease: %s", exc)


POLL_INITIAL = 0.02  # first wait for another process's renewal without announcements
POLL_MAX = 0.25  # longest wait between two looks at the store while another process renews;
# also the fallback when announcements are heard but one may have been lost

Look = Callable[[], Token | None]


@dataclass(frozen=True)
class Prelude:
    """A caller's own first look at the store, made in one round trip with the lock attempt
    (``TokenStore.look_after_401``): whether it took the lock (False: another holds it,
    and the wait is counted), and the announcements heard before it looked."""

    locked: bool
    heard: int


@dataclass(eq=False)
class SingleFlight:
    """Runs a renewal once fleet-wide; the others get its token, or keep a valid one."""

    store: TokenStore
    lock: RenewalLock
    signal: RenewalSignal | None  # None: no announcements, waits poll the store
    renewal_limit: float  # seconds the longest renewal takes: every attempt and wait
    wait_limit: float  # seconds a caller waits for another's renewal
    _: KW_ONLY
    clock: Callable[[], float]
    sleep: Callable[[float], None]

    def __post_init__(self) -> None:
        self.remake_locks()

    def remake_locks(self) -> None:
        # threads of this process look at the store and renew in turn, one attempt at a time
        # (reentrant: an exchange keeps its token while holding it)
        self.turn = threading.RLock()

    def take_turn(self, blocking: bool) -> bool:
        """Take this process's turn; without ``blocking``, only if no other thread has it.

        A blocking wait lasts at most one attempt of another thread: an exchange and its
        retries, bounded by ``renewal_limit`` (then the caller's own deadline decides)."""
        if not blocking:
            return self.turn.acquire(blocking=False)
        if not self.turn.acquire(timeout=self.renewal_limit):
            raise RenewalTimeout(
                f"waited {self.renewal_limit:.1f} s for another thread of this process to renew"
            )
        return True

    def run(
        self,
        look: Look,
        renew: Callable[[], Token],
        fallback: Token | None,
        *,
        prelude: Prelude | None = None,
    ) -> Token:
        """A token from ``look`` (run in this process's turn), else from ``renew`` under the
        fleet's lock, else ``fallback`` while it is valid rather than wait.

        ``prelude``: the caller's own first look (see ``Prelude``), which stands for the
        first attempt.
        """
        heard = [0]
        pending = [prelude] if prelude is not None else []
        wait_noted: list[bool] = []  # the store records it when the next token is written

        def attempt() -> Token | None:
            stale_generation = self.store.seen_generation
            has_fallback = fallback is not None and fallback.valid_at(self.clock())
            if not self.take_turn(blocking=not has_fallback):
                return fallback  # another thread of this process is renewing; keep using it
            try:
                if pending:
                    first = pending.pop()
                    heard[0] = first.heard
                    locked = first.locked
                    if not locked:
                        wait_noted.append(True)  # by the prelude
                else:
                    heard[0] = self.signal.heard if self.signal is not None else 0
                    found = look()
                    if found is not None:
                        return found
                    stale_generation = self.store.seen_generation  # what look() found
                    locked = self.lock.acquire()
                if locked:
                    try:
                        # look again: the holder we waited for may have stored a token, or
                        # failed and paused exchanges (breakers only open under the lock)
                        return look() or renew()
                    finally:
                        self.lock.release()
            finally:
                self.turn.release()
            if fallback is not None and fallback.valid_at(self.clock()):
                return fallback
            if not wait_noted and self.store.note_wait(stale_generation, self.wait_limit):
                wait_noted.append(True)
            return None

        try:
            token = self._waiting(heard)(attempt)
        finally:
            if pending and pending[0].locked:  # the caller's holding, never reached: released
                self.lock.release()
        assert token is not None  # the retry only ends on a token or an error
        return token

    def _waiting(self, heard: list[int]) -> Retrying:
        """Attempts until one gives a token: woken by an announcement after ``heard[0]``,
        or after a bounded poll; RenewalTimeout after ``wait_limit``."""

        def wait(seconds: float) -> None:
            if self.signal is not None and self.signal.listening:
                self.signal.wait(heard[0], POLL_MAX)
            else:
                self.sleep(seconds)

        return Retrying(
            retry=retry_if_result(lambda token: token is None),
            wait=wait_random_exponential(multiplier=POLL_INITIAL, max=POLL_MAX),
            stop=stop_after_delay(self.wait_limit)
            | stop_after_attempt(math.ceil(self.wait_limit / POLL_INITIAL)),
            sleep=wait,
            retry_error_callback=self._holder_too_slow,
        )

    def _holder_too_slow(self, state: RetryCallState) -> Token:
        holder = self.store.lock_holder() or "nobody (it expired)"
        raise RenewalTimeout(
            f"waited {state.seconds_since_start:.1f} s for the token renewal held by {holder}"
        )


LOCAL_COPY_TTL = 1.0  # seconds a process uses its copy before reading Redis again: at most
# one GET a second per process on the hot path


class _Trusted(NamedTuple):
    """The copy, and the monotonic time until which it is trusted: one tuple, so that
    threads always see a matching pair."""

    token: Token
    until: float


class LocalCopy:
    """The last token this process read or renewed, and until when it is trusted."""

    def __init__(
        self, ttl: float = LOCAL_COPY_TTL, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl = ttl
        self._monotonic = monotonic
        self._trusted: _Trusted | None = None
        self.remake_lock()

    def remake_lock(self) -> None:
        """A new lock (after a fork, one held by a parent's thread would never be freed)."""
        self._lock = threading.Lock()

    def trusted(self) -> Token | None:
        """The copy while it is trusted without reading Redis."""
        trusted = self._trusted
        if trusted is not None and self._monotonic() < trusted.until:
            return trusted.token
        return None

    def last(self) -> Token | None:
        """The copy, trusted or not (for when Redis cannot be read)."""
        trusted = self._trusted
        return trusted.token if trusted is not None else None

    def keep(self, token: Token) -> Token:
        """Make ``token`` the copy, unless another thread just kept a newer one (this one
        was read before that was stored: it would cost each call a 401)."""
        now = self._monotonic()
        with self._lock:
            kept = self._trusted
            if kept is None or token.generation >= kept.token.generation or now >= kept.until:
                # (a fresh copy with a higher generation only loses to a stale Redis after a
                # restart without persistence: then it is replaced once its second is over)
                self._trusted = _Trusted(token, now + self.ttl)
        return token

    def kept_since(self, started: float) -> Token | None:
        """The copy, if a thread of this process kept it after ``started`` (monotonic)."""
        trusted = self._trusted
        if trusted is None or trusted.until - self.ttl < started:
            return None
        return trusted.token

    def forget(self) -> None:
        """Drop the copy: the next call reads Redis."""
        self._trusted = None

    def now(self) -> float:
        """The monotonic clock this copy is timed by."""
        return self._monotonic()
