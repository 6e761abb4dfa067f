"""Refusals: what a 401 means, and the renewal after it (docs/design.md, "Refusals"); and
the breaker, the fleet-wide pause on token exchanges.

The client's loop sends, and on a 401 asks the token source for a token that replaces the
refused one; the source (``manager.TokenManager``) hands the question to ``Refusals``, the
one place that judges a refusal:

- a token the API accepted before and now refuses was **revoked**: renewed at once
  (forced, compare-and-swap), within the fleet's forced-renewal budget;
- a token refused before it was ever used, whose predecessor was accepted, was probably
  **revoked before use** (between the exchange and the first call): renewed once more;
- otherwise it was **never accepted** (a wrong key, the other environment, access revoked,
  or revocations in a row): the account is renewed again only after a fleet-wide
  back-off (``REFUSED_BACKOFF`` doubling to ``REFUSED_BACKOFF_MAX``), so a wrong key costs
  a handful of exchanges a day, and a token revoked twice before use heals in a minute.

While a stored token is known to be refused (its back-off, or the ``revoked`` breaker once
the budget is spent), calls fail fast with ``TokenRejected`` instead of sending it again:
``known_refused`` is checked before every send, at the cost of a dictionary look-up.
Inside a process one thread asks the store; its siblings wait for its token.

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
OPERATOR_ENDS = (BreakerKind.REVOKED, BreakerKind.REFUSED)  # pauses over refused tokens: an
# operator's forced renewal says the cause is fixed (access restored, the other exchanger
# stopped); pauses over the endpoint's answers (rejected, rate limited, unavailable) hold
PROBE_INTERVAL = 2.0  # half-open: with no valid token, one caller per interval fleet-wide
# makes one exchange attempt during an `unavailable` pause, so recovery after an outage is
# not held back by the rest of a pause of up to a minute (the first back-off's length)


@dataclass(eq=False)
class Breaker:
    """Pauses exchanges fleet-wide after failures; ``check`` says whether one may go ahead."""

    store: TokenStore
    clock: Callable[[], float]
    secret_fingerprint: Callable[[], str]  # of the secret in use: a replaced one may try again
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
        """Whether a pause opened against the secret of fingerprint ``refused_with`` ('':
        none recorded) may end because another secret is in place now."""
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

    def trip_revoked(self, pause: float, detail: str) -> None:
        """Open the breaker because tokens keep being revoked (the forced budget is spent)."""
        now = self.clock()
        self._open(BreakerRecord(BreakerKind.REVOKED, now + pause, 1, "", detail), now)

    def trip_refused(self, generation: int, failures: int, pause: float, detail: str) -> None:
        """Pause renewals because token ``generation`` was refused before first use, the
        ``failures``-th time in a row (``Refusals`` decides the pause)."""
        now = self.clock()
        secret = self.secret_fingerprint()  # a new secret ends the pause (``check``)
        kind = BreakerKind.REFUSED
        record = BreakerRecord(kind, now + pause, failures, secret, detail, generation)
        self._open(record, now)

    def reset(self) -> None:
        """Close the breaker after a successful exchange. A ``refused`` record stays (its
        pause is over): it counts refusals in a row until the API accepts a token."""
        record = self.store.records.load_breaker()
        if record is not None and record.kind != BreakerKind.REFUSED:
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


FORCED_RENEWAL_BUDGET = 4  # forced renewals per account and period, fleet-wide: revocations
# by operators and rotations come far less often; more means a fight over the API key. Each
# revocation meets a 401 on every request in flight (one per calling thread), so the budget
# bounds those too: 16 threads see at most 16 x (4 + 1) = 80 401s whatever the revocations
FORCED_RENEWAL_PERIOD = 60.0  # seconds; also the pause once the budget is spent
REFUSED_BACKOFF = 60.0  # seconds before a token refused before first use is renewed again
REFUSED_BACKOFF_MAX = 1800.0  # ... doubling per refusal in a row, up to 30 minutes: a key
# that is simply wrong then costs at most 8 exchanges in 2 hours


# renews the account forced: (the refused token, when the caller began, its first look)
ForcedRenewal = Callable[[Token, float, Prelude | None, Callable[[], None]], Token]


class Refusal(enum.StrEnum):
    """What a 401 on a token means, from the evidence of what the API accepted before."""

    REVOKED = "revoked"  # accepted before: renew
    REVOKED_BEFORE_USE = "revoked_before_use"  # never accepted, but its predecessor was
    NEVER_ACCEPTED = "never_accepted"  # renewed only after a fleet-wide back-off


def judge(stale: Token, accepted_generation: int) -> Refusal:
    """What a 401 on ``stale`` means, given the highest generation the API accepted."""
    if accepted_generation >= stale.generation:
        return Refusal.REVOKED
    if accepted_generation == stale.generation - 1 and accepted_generation > 0:
        return Refusal.REVOKED_BEFORE_USE
    return Refusal.NEVER_ACCEPTED


def refused_backoff(failures: int) -> float:
    """The pause before renewing after the ``failures``-th refusal before first use in a row."""
    return float(min(REFUSED_BACKOFF * 2 ** (failures - 1), REFUSED_BACKOFF_MAX))


@dataclass(eq=False)
class Refusals:
    """Judges each 401 of one account and renews after it, once per process and fleet."""

    store: TokenStore
    copy: LocalCopy
    flight: SingleFlight
    lock: RenewalLock
    breaker: Breaker
    signal: RenewalSignal | None
    clock: Callable[[], float]

    @property
    def wait_limit(self) -> float:
        return self.flight.wait_limit

    def __post_init__(self) -> None:
        self._accepted = 0  # the highest generation this process saw accepted
        # refused generation -> (end of its back-off, fingerprint of the secret then)
        self._known: dict[int, tuple[float, str]] = {}
        self.remake_locks()

    def remake_locks(self) -> None:
        self._forcing = 0  # the generation a thread of this process is renewing after a 401
        self._forcing_changed = threading.Condition()

    def accepted(self, token: Token) -> None:
        """The API accepted ``token``: the evidence that a later 401 on it is a revocation,
        recorded once per generation and process."""
        if token.generation <= self._accepted:
            return
        self._accepted = token.generation
        try:
            self.store.mark_accepted(token.generation)
        except StoreUnavailable as exc:
            # not retried with every call (each would wait for Redis): this process still
            # knows, and the other processes using this generation record it too
            log.warning("could not record that the API accepted a token: %s", exc)

    def known_refused(self, token: Token) -> bool:
        """Whether ``token`` is known to be refused: a sibling thread is renewing it after a
        401, or its back-off is over (then renew it, or wait for the sibling's token).

        Raises TokenRejected while the back-off lasts, unless the secret was replaced since:
        the token is not sent again."""
        if self._forcing >= token.generation:
            return True
        known = self._known.get(token.generation)
        if known is None:
            return False
        until, refused_with = known
        left = until - self.clock()
        if left > 0 and not self.breaker.secret_replaced(refused_with):
            raise TokenRejected(
                f"the stored token is known to be refused (HTTP 401); the account is renewed "
                f"in {left:.0f} s. {LIKELY_CAUSES}",
                retry_after=left,
            )
        return True

    def renew_after(self, stale: Token, renew: ForcedRenewal, *, new_401: bool = True) -> Token:
        """The token that replaces ``stale``, refused by the API: another's, or a forced
        renewal if the evidence says it was revoked; else TokenRejected. ``new_401``: False
        when no request met a 401 now (``stale`` is known refused from an earlier one)."""
        token = self._renew_after(stale, renew, new_401)
        telemetry.link_renewal(token.traceparent)  # the call's span, to what replaced it
        return token

    def _renew_after(self, stale: Token, renew: ForcedRenewal, new_401: bool) -> Token:
        self.known_refused(stale)
        prelude: Prelude | None = None
        for _ in range(2):  # a second round if a sibling's renewal failed
            newer = self._newer_copy(stale) or self._sibling_renewal(stale)
            if newer is not None:
                return newer  # a sibling thread got the token that replaces it
            self.known_refused(stale)  # the sibling's renewal failed with a back-off: share it
            started = self.copy.now()
            try:
                found, renewer, prelude = self._look(stale, new_401)
            except TokenRejected as exc:  # judged refused, or a pause: no call sends it meanwhile
                self._remember(stale, exc)
                raise
            if found is not None:
                return found
            if renewer:  # this thread renews for the process
                break
        else:  # a sibling still renews: renewing too would be a second forced renewal
            raise RenewalTimeout("another thread of this process still renews the refused token")
        log.info("token %s was refused: renewing", stale.fingerprint)
        try:
            renewed = renew(stale, started, prelude, self._spend_budget)
            if not renewed.replaces(stale, self.clock()):  # the endpoint handed it back
                raise TokenRejected(_handed_back(renewed.expires_at - self.clock()))
            return self.copy.keep(renewed)
        except TokenRejected as exc:
            self._remember(stale, exc)  # before the siblings wake: they share its back-off
            raise
        finally:
            with self._forcing_changed:
                if self._forcing == stale.generation:  # this thread's mark, not a later one
                    self._forcing = 0
                self._forcing_changed.notify_all()

    def _remember(self, stale: Token, refused: TokenRejected) -> None:
        """A back-off (``refused.retry_after``): no call sends ``stale`` until it is over."""
        if refused.retry_after:
            self._known = {g: k for g, k in self._known.items() if g >= stale.generation}
            until = self.clock() + refused.retry_after
            self._known[stale.generation] = (until, self.breaker.secret_fingerprint())

    def _look(self, stale: Token, new_401: bool) -> tuple[Token | None, bool, Prelude | None]:
        """In this process's turn: a newer token (copy or store), or TokenRejected, or this
        thread registered as the process's renewer of ``stale``'s generation, with its
        look at the store and the lock (one round trip) as the renewal's first attempt."""
        self.flight.take_turn(blocking=True)
        locked = False
        try:
            newer = self._newer_copy(stale)
            if newer is not None or self._forcing >= stale.generation:
                return newer, False, None  # no token: a sibling renews; wait for it
            heard = self.signal.heard if self.signal is not None else 0
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
            if current is not None and current.replaces(stale, self.clock()):
                return self.copy.keep(current), False, None  # renewed elsewhere: CAS
            self._judge(stale)
            with self._forcing_changed:
                self._forcing = stale.generation
            prelude = Prelude(locked, heard) if locked or outcome == -1 else None
            locked = False  # handed over to the renewal
            return None, True, prelude
        finally:
            if locked:
                self.lock.release()
            self.flight.turn.release()

    def _judge(self, stale: Token) -> None:
        """Returns if ``stale`` is renewed now; raises TokenRejected if it waits."""
        accepted = self._accepted
        if accepted < stale.generation:
            accepted = max(accepted, self.store.accepted_generation())
        if judge(stale, accepted) != Refusal.NEVER_ACCEPTED:
            return
        record = self.store.records.load_breaker()
        earlier = record if record is not None and record.kind == BreakerKind.REFUSED else None
        now = self.clock()
        if earlier is not None and self.breaker.secret_replaced(earlier.secret_fingerprint):
            if earlier.generation == stale.generation:
                return  # refused under the secret since replaced: renew with the new one
            earlier = None  # refusals in a row are counted per secret
        if earlier is not None and earlier.generation == stale.generation:
            if earlier.until <= now:
                return  # its back-off is over: renew it
            left = earlier.until - now
            raise TokenRejected(_never_accepted(left), retry_after=left)
        failures = earlier.failures + 1 if earlier is not None else 1  # refusals in a row
        pause = refused_backoff(failures)
        self.store.records.count(CounterName.NEVER_ACCEPTED)
        self.breaker.trip_refused(stale.generation, failures, pause, _never_accepted(pause))
        raise TokenRejected(_never_accepted(pause), retry_after=pause)

    def _spend_budget(self) -> None:
        """Count a forced renewal (under the lock, before its exchange); past the budget,
        open the ``revoked`` breaker instead."""
        now = self.clock()
        spent = self.store.records.forced_in_period(now, FORCED_RENEWAL_PERIOD)
        if spent >= FORCED_RENEWAL_BUDGET:
            message = _revoked_over_and_over(spent)
            self.breaker.trip_revoked(FORCED_RENEWAL_PERIOD, message)
            raise TokenRejected(message, retry_after=FORCED_RENEWAL_PERIOD)
        self.store.records.log_forced(now)
        self.store.records.count(CounterName.FORCED_RENEWALS)

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


def _never_accepted(pause: float) -> str:
    return (
        "the API refused a token it never accepted (HTTP 401); the account is renewed "
        f"again in {pause:.0f} s, fleet-wide, and calls fail until then. " + LIKELY_CAUSES
    )


def _revoked_over_and_over(spent: int) -> str:
    return (
        f"tokens of this account were revoked over and over: {spent} forced renewals "
        f"in {FORCED_RENEWAL_PERIOD:.0f} s. Is another system exchanging with the same "
        "API key (each of its exchanges may revoke ours)? Or was API access revoked "
        "for this merchant?"
    )


def _handed_back(left: float) -> str:
    return (
        "the token endpoint handed back the token the API refuses (HTTP 401); "
        f"it is renewed once it expires, in {left:.0f} s"
    )


def _taken(looked: tuple[Token | None, int]) -> tuple[bool, tuple[Token | None, int]]:
    """The 401 script's answer as ``RenewalLock.acquire_with`` reads it."""
    return looked[1] == 1, looked
