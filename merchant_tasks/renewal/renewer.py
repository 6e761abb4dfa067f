"""The exchange-and-save step of a renewal, run by the holder of the fleet's lock.

Exchange (the callable passed in: nothing here speaks HTTP), retrying a failing endpoint
a few times; judge the answer against the stored token (docs/design.md, "An answer no
better than the stored token"); store it, or mark the stored token final; wake the
fleet's waiters. Forced renewals spend their budget first (``refusals``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exception,
    wait_random_exponential,
)

from merchant_tasks import telemetry
from merchant_tasks.api.exchange import IssuedToken
from merchant_tasks.exceptions import (
    CredentialsRejected,
    ExchangeRateLimited,
    ExchangesThrottled,
    MalformedTokenResponse,
    RenewalTimeout,
    TokenEndpointUnavailable,
    TokenExchangeError,
)
from merchant_tasks.renewal.breaker import Breaker
from merchant_tasks.renewal.local_copy import LocalCopy
from merchant_tasks.renewal.lock import process_owner
from merchant_tasks.renewal.policy import (
    Outcome,
    RenewalPolicy,
)
from merchant_tasks.store.exchange_rate import ExchangeRate, Priority
from merchant_tasks.store.protocol import Store
from merchant_tasks.token import RenewalReason, Token

log = logging.getLogger(__name__)

EXCHANGE_ATTEMPTS = 3  # tries of one renewal against a failing endpoint, while holding the lock
EXCHANGE_RETRY_WAIT_MAX = 4.0  # longest pause between those tries
ZERO_LIFETIME_RETRY = 1.0  # expires_in is in whole seconds: a token handed back with 0 left
# is gone within a second, and then the server issues a new one


@dataclasses.dataclass(eq=False)
class Renewer:
    """Exchanges for a new token and stores it, if it is better than the stored one."""

    store: Store
    exchange: Callable[[], IssuedToken]
    policy: RenewalPolicy
    breaker: Breaker
    copy: LocalCopy
    _: dataclasses.KW_ONLY
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    rate: ExchangeRate | None = None  # the host's fleet-wide permits; None: unlimited

    def renew(
        self,
        reason: RenewalReason,
        *,
        probe: bool = False,
        first: Callable[[], None] | None = None,
    ) -> Token:
        """Exchange (retrying a failing endpoint a few times, once for a half-open probe)
        and store the answer if it is better than the stored token; else mark the stored
        one final. ``first`` runs once the first permit is granted, before the exchange
        (the forced-renewal budget: a renewal refused a permit spends none of it)."""
        expected = self.store.generation()
        current = self.store.load()
        now = self.clock()
        if current is not None and not current.valid_at(now) and now < current.kept_until:
            # a final token just expired on our clock may live on the server's for as long
            # as its exchange took: asking before then would be handed it back again
            self.sleep(max(0.0, current.kept_until - now))
        issued_at = self.clock()  # before the exchange: the token is at least this old
        if current is not None and not current.valid_at(issued_at):
            current = None
        try:
            attempts = 1 if probe else EXCHANGE_ATTEMPTS
            issued = self._exchange(reason, current, attempts, [first] if first else [])
        except ExchangesThrottled:
            raise  # the host's fleet-wide rate, not this account's endpoint: no pause
        except TokenExchangeError as exc:
            self.store.records.record_renewal(reason, outcome_of(exc))
            self.breaker.trip(exc)
            raise
        forced = reason == RenewalReason.FORCED
        expires_at = issued_at + issued.expires_in
        if current is not None and self.policy.no_better(issued.value, expires_at, current, forced):
            self.store.records.record_renewal(reason, Outcome.UNCHANGED)
            return self._keep_final(current, expected, forced)
        self.store.records.record_renewal(reason, Outcome.OK)
        token = Token(
            value=issued.value,
            issued_at=issued_at,
            expires_at=expires_at,
            generation=expected + 1,
            renewed_by=process_owner(),
            reason=reason,
            lag=max(0.0, self.clock() - issued_at),
            traceparent=telemetry.renewal_traceparent(),
        )
        return self._store_new(token, expected, issued.expires_in)

    def _exchange(
        self,
        reason: RenewalReason,
        current: Token | None,
        attempts: int,
        first: list[Callable[[], None]],
    ) -> IssuedToken:
        """The exchange, retried while the endpoint fails; each HTTP attempt counted."""

        def attempt() -> IssuedToken:
            if self.rate is not None:
                urgent = reason != RenewalReason.SCHEDULED
                self.rate.take(Priority.CALLER if urgent else Priority.BACKGROUND)
            if first:
                first.pop()()
            try:
                issued = self.exchange()
            except TokenExchangeError as exc:
                self.store.records.record_attempt(reason, outcome_of(exc), self.clock())
                if isinstance(exc, ExchangeRateLimited) and self.rate is not None:
                    self.rate.rate_limited()
                raise
            self.store.records.record_attempt(reason, Outcome.OK, self.clock())
            if issued.expires_in <= 0 and current is None:
                # its last token, in its last second: a new one comes once that is over
                raise TokenEndpointUnavailable(
                    "token endpoint handed back a token that expires now (expires_in 0)",
                    retry_after=ZERO_LIFETIME_RETRY,
                )
            return issued

        retrying = Retrying(
            # a Retry-After longer than we may hold the lock is left to the breaker
            retry=retry_if_exception(
                lambda exc: (
                    isinstance(exc, TokenEndpointUnavailable | MalformedTokenResponse)
                    and not isinstance(exc, ExchangesThrottled)
                    and (getattr(exc, "retry_after", None) or 0) <= EXCHANGE_RETRY_WAIT_MAX
                )
            ),
            wait=wait_random_exponential(multiplier=0.5, max=EXCHANGE_RETRY_WAIT_MAX)
            + wait_exception(lambda exc: getattr(exc, "retry_after", None) or 0.0),
            stop=stop_after_attempt(attempts),
            sleep=self.sleep,
            reraise=True,
        )
        issued: IssuedToken = retrying(attempt)
        return issued

    def _store_new(self, token: Token, expected: int, lifetime: float) -> Token:
        written, stored_generation = self.store.save(token)
        if written:
            self._stored(token)
            log.info(
                "renewed token for %s: generation %d, %s, valid %.0f s",
                self.store.namespace,
                token.generation,
                token.reason,
                lifetime,
            )
            return token
        if stored_generation == expected:
            raise MalformedTokenResponse(
                f"token endpoint issued a token valid {lifetime:g} s, "
                "which expired before it could be stored"
            )
        return self._newer_than_ours(stored_generation)

    def _keep_final(self, current: Token, expected: int, forced: bool) -> Token:
        """The exchange handed back ``current`` (or worse): no exchange before it expires.
        After a 401 (``forced``) ``current`` is the refused token: ``refusals`` says so."""
        if forced:
            return current
        if current.final:
            return current
        final = dataclasses.replace(current, generation=expected + 1, final=True)
        written, stored_generation = self.store.save(final)
        if not written:
            return self._newer_than_ours(stored_generation)
        self._stored(final)
        log.info(
            "the token endpoint handed back the stored token for %s: no renewal before it "
            "expires in %.0f s",
            self.store.namespace,
            final.expires_at - self.clock(),
        )
        return final

    def _stored(self, token: Token) -> None:
        """``token`` was written: keep it, close the breaker, wake the fleet's waiters."""
        self.copy.keep(token)  # the other threads of this process find it there
        self.breaker.reset()
        self.store.announce(token.generation)  # best effort: waiters also poll

    def _newer_than_ours(self, stored_generation: int) -> Token:
        # our lock expired during a slow exchange and a newer token was stored meanwhile
        newer = self.store.load()
        log.warning(
            "discarded a token from a slow exchange: generation %d was stored meanwhile",
            stored_generation,
        )
        if newer is None:
            raise RenewalTimeout("a newer token was stored during a slow exchange and expired")
        return newer


def outcome_of(exc: TokenExchangeError) -> Outcome:
    """How an exchange that raised ``exc`` ended, in the counters' words."""
    if isinstance(exc, CredentialsRejected):
        return Outcome.REJECTED
    if isinstance(exc, ExchangeRateLimited):
        return Outcome.RATE_LIMITED
    return Outcome.FAILED
