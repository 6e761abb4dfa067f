"""Refusals: what a 401 means, and the renewal after it (docs/design.md, "Refusals"); and
the breaker, the fleet-wide pause on token exchanges.

The client's loop sends, and on a 401 asks the token source for a token that replaces the
refused one; the source (``manager.TokenManager``) hands the question to ``Refusals``, the
one place that judges a refusal, from the evidence in the refused token's own record
(docs/design.md, "Refusals", has the table):

- the first 401 on a token marks its record refused (the store's 401 script, same write):
  from then on no process of the fleet sends it (``known_refused``, before every send);
  a 401 the store cannot record (it refuses writes, or is unreachable) is held by the
  process that met it, which does not send the token again and records it once it can;
- a token the API had **accepted** was revoked, and one refused on its **first use** with
  no such refusal just before it was revoked before use (or replaced by beat before
  anyone called with it): either is replaced at once;
- a token refused on its first use right after another was (no acceptance between: a
  wrong key, the other environment, access revoked) is replaced only after a fleet-wide
  back-off (``REFUSED_BACKOFF`` doubling to ``REFUSED_BACKOFF_MAX``); any acceptance ends
  the run, as each token's record counts the refusals in a row before it;
- forced renewals are spaced, one per ``FORCED_RENEWAL_SPACING`` per account fleet-wide;
  callers wait for the next replacement instead of failing.

While a replacement is held back (a back-off, a pause over the credentials), calls fail
fast with its error instead of sending the refused token. Inside a process one thread asks
the store; its siblings wait for its token.

``Breaker`` pauses token exchanges fleet-wide, with check, trip and reset. Kinds and pauses
are in docs/design.md, "Guards on exchanges". The record lives in Redis
(``store.token_store.BreakerRecord``), so every process of the fleet obeys one pause; it is
only opened by the holder of the renewal lock.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
from collections.abc import Callable
from copy import copy as shallow_copy
from dataclasses import dataclass

from merchant_tasks import telemetry
from merchant_tasks.exceptions import (
    LIKELY_CAUSES,
    CredentialsRejected,
    ExchangeRateLimited,
    MerchantError,
    RenewalTimeout,
    StoreUnavailable,
    TokenEndpointUnavailable,
    TokenExchangeError,
    TokenRejected,
)
from merchant_tasks.renewal.lock import LocalCopy, Prelude, RenewalLock, SingleFlight
from merchant_tasks.store.token_store import BreakerRecord, TokenStore, opening_counter
from merchant_tasks.store.wakeup import RenewalSignal
from merchant_tasks.token import BreakerKind, CounterName, Token

log = logging.getLogger(__name__)

REJECTED_BACKOFF = 60.0  # after rejected credentials, one exchange attempt a minute fleet-wide
RATE_LIMITED_BACKOFF = 60.0  # after a 429 without Retry-After
RETRY_AFTER_MARGIN = 0.5  # Retry-After is in whole seconds and each host estimates Redis's
# clock to within milliseconds: without a margin, one may knock a moment too early
UNAVAILABLE_BACKOFF = 2.0  # first pause after the endpoint failed; doubles per failure
UNAVAILABLE_BACKOFF_MAX = 60.0  # ... up to a minute, so recovery is noticed within one
OPERATOR_ENDS = (BreakerKind.REVOKED, BreakerKind.REFUSED, BreakerKind.REJECTED)  # pauses over
# credentials and refused tokens: an operator's forced renewal says the cause is fixed
# (access restored, the key re-enabled); pauses over the endpoint's health (rate limited,
# unavailable) hold
PROBE_INTERVAL = 2.0  # half-open: with no valid token, one caller per interval fleet-wide
# makes one exchange attempt during an `unavailable` pause, so recovery after an outage is
# not held back by the rest of a pause of up to a minute (the first back-off's length)


@dataclass(eq=False)
class Breaker:
    """Pauses exchanges fleet-wide after failures; ``check`` says whether one may go ahead."""

    store: TokenStore
    clock: Callable[[], float]
    # of the credentials in use (API key, secret, token endpoint): a pause opened against
    # other ones ends at once, in every process whose configuration no longer matches it
    secret_fingerprint: Callable[[], str]
    rng: random.Random

    def check(self, fallback: Token | None, *, operator: bool = False) -> Token | None:
        """While exchanges are paused: the still-valid ``fallback``, else the pause's error.

        Returns None when an exchange may go ahead: no pause, a pause opened against a
        secret since replaced, or (``operator``: ``renew --force``) a pause in
        ``OPERATOR_ENDS``.
        """
        record = self.store.records.load_breaker()
        now = self.clock()
        if record is None or record.until <= now:
            return None  # the record outlives its pause only to remember the failure count
        if self.secret_replaced(record.secret_fingerprint):
            return None  # a new secret is in place: try it now
        if operator and record.kind in OPERATOR_ENDS:
            log.info("an operator's forced renewal ends the %s pause", record.kind)
            return None
        if fallback is not None and fallback.valid_at(now):
            return fallback
        raise self._error(record, max(0.0, record.until - now))

    def secret_replaced(self, refused_with: str) -> bool:
        """Whether a pause opened against the credentials of fingerprint ``refused_with``
        ('': none recorded) may end because others are in place now."""
        return bool(refused_with) and refused_with != self.secret_fingerprint()

    def take_probe(self) -> bool:
        """Half-open: whether this caller may probe the endpoint during an ``unavailable``
        pause (one caller per PROBE_INTERVAL fleet-wide; only when it has no valid token)."""
        if not self.store.records.take_probe(PROBE_INTERVAL):
            return False
        log.info("no valid token during an endpoint pause: probing the endpoint once")
        return True

    def trip(self, exc: TokenExchangeError) -> None:
        """Open the breaker for the failure ``exc`` of an exchange."""
        now = self.clock()
        if isinstance(exc, CredentialsRejected):
            record = BreakerRecord(
                BreakerKind.REJECTED, now + REJECTED_BACKOFF, 1, self.secret_fingerprint(), str(exc)
            )
        elif isinstance(exc, ExchangeRateLimited):
            pause = exc.retry_after if exc.retry_after is not None else RATE_LIMITED_BACKOFF
            record = BreakerRecord(
                BreakerKind.RATE_LIMITED, now + pause + RETRY_AFTER_MARGIN, 1, "", str(exc)
            )
        else:
            previous = self.store.records.load_breaker()
            failures = 1
            if previous is not None and previous.kind == BreakerKind.UNAVAILABLE:
                failures = previous.failures + 1
            pause = min(UNAVAILABLE_BACKOFF * 2 ** (failures - 1), UNAVAILABLE_BACKOFF_MAX)
            pause *= 0.5 + self.rng.random() / 2  # jitter, so hosts do not retry in step
            pause = max(pause, getattr(exc, "retry_after", None) or 0.0)
            record = BreakerRecord(BreakerKind.UNAVAILABLE, now + pause, failures, "", str(exc))
            self.store.records.take_probe(PROBE_INTERVAL)  # the first probe comes an interval later
        self._open(record, now)

    def trip_refused(self, generation: int, failures: int, pause: float, detail: str) -> None:
        """Pause renewals because token ``generation`` was refused on its first use, the
        ``failures``-th in a row (``Refusals`` decides the pause)."""
        now = self.clock()
        secret = self.secret_fingerprint()  # a new secret ends the pause (``check``)
        kind = BreakerKind.REFUSED
        record = BreakerRecord(kind, now + pause, failures, secret, detail, generation)
        self._open(record, now)

    def reset(self) -> None:
        """Close the breaker after a successful exchange (refusals in a row are counted in
        the tokens' records, not here)."""
        if self.store.records.load_breaker() is not None:
            self.store.records.close_breaker()

    def _open(self, record: BreakerRecord, now: float) -> None:
        self.store.records.open_breaker(record, now)
        self.store.records.count(opening_counter(record.kind))
        telemetry.count_breaker_opening(self.store.account, record.kind)
        log.warning(
            "token exchanges paused for %.1f s for %s: %s",
            record.until - now,
            self.store.namespace,
            record.detail,
        )

    @staticmethod
    def _error(record: BreakerRecord, left: float) -> MerchantError:
        message = f"token exchanges paused for {left:.0f} s more: {record.detail}"
        if record.kind == BreakerKind.REJECTED:
            return CredentialsRejected(message)
        if record.kind == BreakerKind.RATE_LIMITED:
            return ExchangeRateLimited(message, retry_after=left)
        if record.kind in (BreakerKind.REVOKED, BreakerKind.REFUSED):
            return TokenRejected(message, retry_after=left)
        return TokenEndpointUnavailable(message, retry_after=left)


FORCED_RENEWAL_SPACING = 4.0  # seconds between two forced renewals of an account, fleet-wide:
# a rate no token endpoint minds. A refused token meets at most one 401 per request in flight,
# and revocations twice a second for 10 s refuse the first token and one replacement per 4 s:
# under 16 threads, 16 x (1 + ceil(10 s / 4 s)) = 64 401s
REFUSED_BACKOFF = 60.0  # seconds before a token refused on its first use, after one before
# it was too (no acceptance between), is replaced
REFUSED_BACKOFF_MAX = 1800.0  # ... doubling per refusal in a row, up to 30 minutes: a key
# that is simply wrong then costs at most 9 exchanges in 2 hours
KNOWN_ERROR_MEMO = 1.0  # seconds a process answers a refused token's error (one without its
# own retry_after) without asking Redis again: the pause's error, not the token, goes out


# renews the account forced: (the refused token, when the caller began, its first look, the
# spacing step run under the lock before the exchange)
ForcedRenewal = Callable[[Token, float, Prelude | None, Callable[[], None]], Token]


class Refusal(enum.StrEnum):
    """What a 401 on a token means, from the evidence in its record (docs/design.md,
    "Refusals": the table)."""

    REVOKED = "revoked"  # accepted before: replace it
    UNUSED = "unused"  # refused on its first use, the first in a row: replace it
    IN_A_ROW = "in_a_row"  # refused on its first use after another was: replace after a back-off


def judge(refused: Token) -> Refusal:
    """What a 401 on ``refused`` (its record as the store holds it) means."""
    if refused.accepted:
        return Refusal.REVOKED
    if refused.first_use_refusals == 0:
        return Refusal.UNUSED
    return Refusal.IN_A_ROW


def refused_backoff(in_a_row: int) -> float:
    """The pause before replacing a token refused on its first use after ``in_a_row`` tokens
    before it were too."""
    return float(min(REFUSED_BACKOFF * 2 ** (in_a_row - 1), REFUSED_BACKOFF_MAX))


@dataclass(eq=False)
class Refusals:
    """Judges each 401 of one account and replaces the refused token, once per process and
    fleet; no process sends a token its record says was refused."""

    store: TokenStore
    copy: LocalCopy
    flight: SingleFlight
    lock: RenewalLock
    breaker: Breaker
    signal: RenewalSignal | None
    clock: Callable[[], float]
    sleep: Callable[[float], None]

    @property
    def wait_limit(self) -> float:
        return self.flight.wait_limit

    def __post_init__(self) -> None:
        self._accepted = 0  # the highest generation this process saw accepted
        # refused generation -> (until when its error stands, fingerprint of the
        # credentials then, the error): calls get it without asking Redis
        self._known: dict[int, tuple[float, str, MerchantError]] = {}
        # generations this process met a 401 on that the store could not record (it refused
        # writes or could not be reached): not sent again by this process meanwhile, and
        # recorded (the 401 counted) by the next look that reaches the store; changed only
        # in this process's turn (``_look``)
        self._unrecorded: set[int] = set()
        self.remake_locks()

    def remake_locks(self) -> None:
        self._forcing = 0  # the generation a thread of this process is renewing after a 401
        self._forcing_changed = threading.Condition()

    def accepted(self, token: Token) -> None:
        """The API accepted ``token``: the evidence that a later 401 on it is a revocation,
        written into its record once per generation and process."""
        if token.generation <= self._accepted:
            return
        self._accepted = token.generation
        try:
            self.store.mark_accepted(token.generation)
        except StoreUnavailable as exc:
            # not retried with every call (each would wait for Redis): the other processes
            # using this generation record it too
            log.warning("could not record that the API accepted a token: %s", exc)

    def known_refused(self, token: Token) -> bool:
        """Whether ``token`` must not be sent: its record says the API refused it, or a
        sibling thread is replacing it (then wait for it, or replace it).

        Raises the error of what holds the replacement back (a back-off, a pause), for as
        long as it stands and the credentials are the same: the token is not sent again."""
        if self._forcing >= token.generation:
            return True
        known = self._known.get(token.generation)
        if known is not None:
            until, credentials, error = known
            left = until - self.clock()
            if left > 0 and not self.breaker.secret_replaced(credentials):
                raise _again(error, left)
            return True
        return token.refused or token.generation in self._unrecorded

    def renew_after(self, stale: Token, renew: ForcedRenewal, *, new_401: bool = True) -> Token:
        """The token that replaces ``stale``, refused by the API: another's, or a forced
        renewal (spaced fleet-wide) unless the evidence calls for a back-off (TokenRejected).
        ``new_401``: False when no request met a 401 now (``stale`` is known refused)."""
        token = self._renew_after(stale, renew, new_401)
        telemetry.link_renewal(token.traceparent)  # the call's span, to what replaced it
        return token

    def _renew_after(self, stale: Token, renew: ForcedRenewal, new_401: bool) -> Token:
        self.known_refused(stale)
        new_401 = new_401 or stale.generation in self._unrecorded  # a 401 not recorded yet
        prelude: Prelude | None = None
        for _ in range(2):  # a second round if a sibling's renewal failed
            newer = self._newer_copy(stale) or self._sibling_renewal(stale)
            if newer is not None:
                return newer  # a sibling thread got the token that replaces it
            self.known_refused(stale)  # the sibling's renewal failed with a pause: share it
            started = self.copy.now()
            try:
                found, renewer, prelude = self._look(stale, new_401)
            except _HELD_BACK as exc:  # a back-off or pause: no call sends it meanwhile
                self._remember(stale, exc)
                raise
            if found is not None:
                return found
            if renewer:  # this thread renews for the process
                break
        else:  # a sibling still renews: renewing too would be a second forced renewal
            raise RenewalTimeout("another thread of this process still renews the refused token")
        log.info("token %s was refused: replacing it", stale.fingerprint)
        try:
            renewed = renew(stale, started, prelude, self._space_forced)
            if not renewed.replaces(stale, self.clock()):  # the endpoint handed it back
                left = renewed.expires_at - self.clock()  # no better answer before then
                raise TokenRejected(_handed_back(left), retry_after=left)
            return self.copy.keep(renewed)
        except _HELD_BACK as exc:
            self._remember(stale, exc)  # before the siblings wake: they share its error
            raise
        finally:
            with self._forcing_changed:
                if self._forcing == stale.generation:  # this thread's mark, not a later one
                    self._forcing = 0
                self._forcing_changed.notify_all()

    def _remember(self, stale: Token, error: MerchantError) -> None:
        """Until ``error`` stops standing, calls get it instead of sending ``stale``."""
        self._known = {g: k for g, k in self._known.items() if g >= stale.generation}
        until = self.clock() + (error.retry_after or KNOWN_ERROR_MEMO)
        self._known[stale.generation] = (until, self.breaker.secret_fingerprint(), error)

    def _look(self, stale: Token, new_401: bool) -> tuple[Token | None, bool, Prelude | None]:
        """In this process's turn: a newer token (copy or store), or TokenRejected, or this
        thread registered as the process's renewer of ``stale``'s generation, with its
        look at the store and the lock (one round trip, which also records the refusal in
        the token's record) as the renewal's first attempt."""
        self.flight.take_turn(blocking=True)
        locked = False
        try:
            newer = self._newer_copy(stale)
            if newer is not None or self._forcing >= stale.generation:
                return newer, False, None  # no token: a sibling renews; wait for it
            heard = self.signal.heard if self.signal is not None else 0
            try:
                locked, (current, outcome) = self.lock.acquire_with(
                    lambda value: _taken(
                        self.store.look_after_401(
                            stale.generation,
                            value,
                            self.lock.prefix,
                            self.lock.lease,
                            self.wait_limit,
                            count=new_401,
                        )
                    )
                )
            except StoreUnavailable:
                if new_401:  # the refusal is not recorded: this process holds it meanwhile
                    for older in [g for g in self._unrecorded if g < stale.generation]:
                        self._unrecorded.discard(older)
                    self._unrecorded.add(stale.generation)
                raise
            self._unrecorded.discard(stale.generation)  # recorded (and counted) in that look
            if current is not None and current.replaces(stale, self.clock()):
                return self.copy.keep(current), False, None  # renewed elsewhere: CAS
            if current is not None and current.generation == stale.generation:
                self.copy.keep(current)  # its record, refusal included: siblings see it
                self._judge(current)  # None: evicted with its evidence, simply replaced
            with self._forcing_changed:
                self._forcing = stale.generation
            prelude = Prelude(locked, heard) if locked or outcome == -1 else None
            locked = False  # handed over to the renewal
            return None, True, prelude
        finally:
            if locked:
                self.lock.release()
            self.flight.turn.release()

    def _judge(self, refused: Token) -> None:
        """Returns if ``refused`` (its record) is replaced now; raises TokenRejected while
        its back-off lasts."""
        in_a_row = refused.first_use_refusals
        if judge(refused) != Refusal.IN_A_ROW:
            return
        record = self.store.records.load_breaker()
        earlier = record if record is not None and record.kind == BreakerKind.REFUSED else None
        if earlier is not None and earlier.generation == refused.generation:
            if self.breaker.secret_replaced(earlier.secret_fingerprint):
                return  # refused under credentials since replaced: try the new ones
            now = self.clock()
            if earlier.until <= now:
                return  # its back-off is over: replace it
            left = earlier.until - now
            raise TokenRejected(_refused_in_a_row(in_a_row + 1, left), retry_after=left)
        pause = refused_backoff(in_a_row)
        self.store.records.count(CounterName.NEVER_ACCEPTED)
        detail = _refused_in_a_row(in_a_row + 1, pause)
        self.breaker.trip_refused(refused.generation, in_a_row + 1, pause, detail)
        raise TokenRejected(detail, retry_after=pause)

    def _space_forced(self) -> None:
        """Under the lock, before the exchange: wait for this forced renewal's turn, one
        FORCED_RENEWAL_SPACING after the fleet's last (callers wait for its token)."""
        wait = self.store.records.reserve_forced(FORCED_RENEWAL_SPACING)
        self.store.records.count(CounterName.FORCED_RENEWALS)
        if wait > 0:
            log.warning(
                "tokens of %s are refused again %.1f s after the last forced renewal: the "
                "next one waits %.1f s. Is another system exchanging with the same API key?",
                self.store.namespace,
                FORCED_RENEWAL_SPACING - wait,
                wait,
            )
            self.sleep(wait)

    def _sibling_renewal(self, stale: Token) -> Token | None:
        """While another thread of this process renews (or waits for the fleet's renewal
        of) ``stale``'s generation, wait for its token rather than ask Redis too."""
        with self._forcing_changed:
            if self._forcing < stale.generation:
                return None
            self._forcing_changed.wait_for(
                lambda: self._forcing < stale.generation, timeout=self.wait_limit
            )
        return self._newer_copy(stale)  # None if it failed: then this thread tries itself

    def _newer_copy(self, stale: Token) -> Token | None:
        """This process's copy if it replaces ``stale`` (no Redis read)."""
        copy = self.copy.last()
        return copy if copy is not None and copy.replaces(stale, self.clock()) else None


def _refused_in_a_row(count: int, pause: float) -> str:
    return (
        f"the API refused {count} tokens in a row on their first use (HTTP 401); the account "
        f"is renewed again in {pause:.0f} s, fleet-wide, and calls fail until then. "
        + LIKELY_CAUSES
    )


def _again(error: MerchantError, left: float) -> MerchantError:
    """A copy of ``error`` to raise again (threads may raise it at once), ``left`` seconds
    before it stops standing."""
    again = shallow_copy(error)
    if again.retry_after is not None:
        again.retry_after = left
    return again


def _handed_back(left: float) -> str:
    return (
        "the token endpoint handed back the token the API refuses (HTTP 401); "
        f"it is renewed once it expires, in {left:.0f} s"
    )


_HELD_BACK = (TokenRejected, TokenExchangeError)  # what holds a replacement back: remembered


def _taken(looked: tuple[Token | None, int]) -> tuple[bool, tuple[Token | None, int]]:
    """The 401 script's answer as ``RenewalLock.acquire_with`` reads it."""
    return looked[1] == 1, looked
