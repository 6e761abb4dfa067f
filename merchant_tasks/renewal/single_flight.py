"""Single flight: at most one renewal at a time for the whole fleet, the others wait for it.

One Redis lock per account across hosts and processes; inside a process, threads take
their turn first, so in a storm one thread per process talks to Redis while the others
wait for its token without polling. Processes that find the lock held wait for the
renewer's announcement (``wakeup.RenewalSignal``), with a bounded poll as the fallback.
The exchange is passed in as a callable: nothing here speaks HTTP (docs/design.md,
"Who does what").
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from merchant_tasks.exceptions import RenewalTimeout
from merchant_tasks.renewal.lock import RenewalLock
from merchant_tasks.store.protocol import Store
from merchant_tasks.store.wakeup import RenewalSignal
from merchant_tasks.token import Token

log = logging.getLogger(__name__)

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

    store: Store
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

        token = self._waiting(heard)(attempt)
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
