"""The breaker: a fleet-wide pause on token exchanges, with check, trip and reset.

Kinds and pauses are in docs/design.md, "Guards on exchanges". The record lives in Redis
(``store.BreakerRecord``), so every process of the fleet obeys one pause; it is only
opened by the holder of the renewal lock.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

from merchant_tasks import telemetry
from merchant_tasks.exceptions import (
    CredentialsRejected,
    ExchangeRateLimited,
    MerchantError,
    TokenEndpointUnavailable,
    TokenExchangeError,
    TokenRejected,
)
from merchant_tasks.renewal.policy import BreakerKind
from merchant_tasks.store.protocol import Store
from merchant_tasks.store.records import BreakerRecord, opening_counter
from merchant_tasks.token import Token

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

    store: Store
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
        ``failures``-th time in a row (``refusals`` decides the pause)."""
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
