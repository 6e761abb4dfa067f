"""Renewal: the account's token for callers, renewed once for the whole fleet.

``TokenManager`` puts the parts together (docs/design.md, "Who does what"): ``Token.state``
says when to renew (the windows of ``RenewalPolicy``), ``refusals.Refusals`` what a 401
means and what follows it, ``lock.SingleFlight`` makes one caller renew while the others
wait under the fleet's ``lock.RenewalLock``, ``Renewer`` (below) exchanges and stores,
``refusals.Breaker`` pauses exchanges after failures, and ``lock.LocalCopy`` spares Redis
reads: this process's copy of the token is trusted for a second, and a token renewed
elsewhere meanwhile costs at most one 401, which compare-and-swap turns into the new token
without an exchange. The exchange is a callable passed in: nothing here speaks HTTP.

- ``token()`` is the callers' path: the stored token while it has more than the mandatory
  window left; otherwise one caller renews and the others keep the still-valid token or
  wait for the winner's.
- ``renew()`` is beat's and the operator's path; ``renew(stale_token=t)`` after a 401 is
  ``Refusals``' to answer.
- ``accepted(t)`` records, once per generation, that the API accepted ``t``.

``Renewer`` is the exchange-and-save step of a renewal, run by the holder of the fleet's
lock: exchange, retrying a failing endpoint a few times; judge the answer against the
stored token (docs/design.md, "An answer no better than the stored token"); store it, or
mark the stored token final; wake the fleet's waiters. A forced renewal first waits for
its turn, spaced fleet-wide (``refusals.Refusals``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
import weakref
from collections.abc import Callable

from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exception,
    wait_random_exponential,
)

from merchant_tasks import telemetry
from merchant_tasks.exceptions import (
    CredentialsRejected,
    ExchangeRateLimited,
    ExchangesThrottled,
    MalformedTokenResponse,
    RenewalTimeout,
    StoreUnavailable,
    TokenEndpointUnavailable,
    TokenExchangeError,
)
from merchant_tasks.renewal.lock import (
    LOCAL_COPY_TTL,
    LocalCopy,
    Prelude,
    RenewalLock,
    SingleFlight,
    process_owner,
)
from merchant_tasks.renewal.refusals import FORCED_RENEWAL_SPACING, Breaker, Refusals
from merchant_tasks.store.exchange_rate import PERMIT_WAIT, ExchangeRate, Priority
from merchant_tasks.store.token_store import RedisClock, TokenStore
from merchant_tasks.store.wakeup import RenewalSignal
from merchant_tasks.token import (
    IssuedToken,
    Outcome,
    RenewalPolicy,
    RenewalReason,
    Token,
    TokenState,
)

EXCHANGE_ATTEMPTS = 3  # tries of one renewal against a failing endpoint, while holding the lock
EXCHANGE_RETRY_WAIT_MAX = 4.0  # longest pause between those tries
ZERO_LIFETIME_RETRY = 1.0  # expires_in is in whole seconds: a token handed back with 0 left
# is gone within a second, and then the server issues a new one


@dataclasses.dataclass(eq=False)
class Renewer:
    """Exchanges for a new token and stores it, if it is better than the stored one."""

    store: TokenStore
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
        (a forced renewal's turn, spaced fleet-wide: one refused a permit takes none)."""
        current = self.store.load()
        expected = self.store.generation()  # after the load: the stored token's counts
        # refusals on first use in a row, carried in each record: any acceptance ends them
        in_a_row = 0
        if current is not None and current.refused_on_first_use:
            in_a_row = current.first_use_refusals + 1
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
            first_use_refusals=in_a_row,
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


log = logging.getLogger(__name__)

LOCK_MARGIN = 5.0  # seconds of lease beyond one exchange's deadline: a dead holder's lock
# is free within exchange_timeout + LOCK_MARGIN; a live one's is extended by its watchdog

Clock = Callable[[], float]
Acceptable = Callable[[Token | None], bool]  # whether a token (or none) serves the caller


def limits(exchange_timeout: float) -> tuple[float, float, float]:
    """How long the longest renewal, a wait for another's and the lock's lease last, for
    one exchange's deadline (``exchange_timeout``, api.exchange)."""
    # every attempt at its deadline after its wait for a permit, plus the waits between
    # them (a back-off and a Retry-After, each up to EXCHANGE_RETRY_WAIT_MAX), after a
    # forced renewal's wait for its turn
    renewal = (
        FORCED_RENEWAL_SPACING
        + EXCHANGE_ATTEMPTS * (exchange_timeout + PERMIT_WAIT)
        + (EXCHANGE_ATTEMPTS - 1) * 2 * EXCHANGE_RETRY_WAIT_MAX
        + LOCK_MARGIN
    )
    # a caller may arrive just after a holder took the lock and died (the lease runs out),
    # and then see the next holder take it and need its whole renewal
    wait = 2 * renewal
    return renewal, wait, exchange_timeout + LOCK_MARGIN  # the lease outlives an exchange


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
        clock: Clock | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        local_copy_ttl: float = LOCAL_COPY_TTL,
        monotonic: Clock = time.monotonic,
        wake_ups: bool = True,
        rate: ExchangeRate | None = None,
    ) -> None:
        self.store = store
        self.policy = RenewalPolicy(renew_before, renew_mandatory)
        self.clock: Clock = clock or RedisClock(store.time)  # the store's, shared by every part
        self.copy = LocalCopy(local_copy_ttl, monotonic)
        self.breaker = Breaker(store, self.clock, secret_fingerprint, rng or random.Random())
        self.signal = RenewalSignal(store) if wake_ups else None
        self.rate = rate  # the token endpoint host's fleet-wide permits (store.exchange_rate)
        self.renewal_limit, self.wait_limit, lease = limits(exchange_timeout)
        self.lock = RenewalLock(store, lease, self.renewal_limit)
        # the parts get the callables themselves, not closures over this manager: no
        # reference cycle, so a manager is freed as soon as it is dropped
        clock = self.clock
        self.renewer = Renewer(
            store,
            exchange,
            self.policy,
            self.breaker,
            self.copy,
            clock=clock,
            sleep=sleep,
            rate=rate,
        )
        self.flight = SingleFlight(
            store,
            self.lock,
            self.signal,
            self.renewal_limit,
            self.wait_limit,
            clock=clock,
            sleep=sleep,
        )
        self.refusals = Refusals(
            store, self.copy, self.flight, self.lock, self.breaker, self.signal, self.clock, sleep
        )
        self._remake_locks()
        _MANAGERS.add(self)  # its locks are remade in a forked child

    def _remake_locks(self) -> None:
        self.refusals.remake_locks()
        self.flight.remake_locks()
        self.copy.remake_lock()
        self.lock.reset()

    def __repr__(self) -> str:
        return f"TokenManager(store={self.store!r})"

    # -- callers -------------------------------------------------------------------------

    def token(self) -> Token:
        """A token to call the API with; renews only when under the mandatory window."""
        copy = self.copy.trusted()
        if copy is not None and self.policy.usable(copy, self.clock()):
            if self.refusals.known_refused(copy):  # its back-off is over: renew it
                return self.refusals.renew_after(copy, self._renew_forced, new_401=False)
            return copy
        try:
            now = self.clock()
            current = self.store.load()
        except StoreUnavailable:
            last = self.copy.last()
            if (
                last is not None
                and last.valid_at(self.clock())
                and not self.refusals.known_refused(last)  # a refused copy is never sent
            ):
                log.warning("token store unavailable; using this process's copy of the token")
                return last
            raise
        if self.signal is not None:
            self.signal.start()  # from now on, this process hears of renewals elsewhere
        if current is not None and current.valid_at(now) and self.refusals.known_refused(current):
            # whatever its window: replaced, never sent, nor kept as a fallback
            return self.refusals.renew_after(current, self._renew_forced, new_401=False)
        if self.policy.usable(current, now):
            assert current is not None
            return self.copy.keep(current)
        usable = current if current is not None and current.valid_at(now) else None
        try:
            token = self._renew(
                RenewalReason.MANDATORY,
                lambda t: self.policy.usable(t, self.clock()) and t is not None and not t.refused,
                fallback=usable,
                probe=True,
            )
        except (TokenExchangeError, RenewalTimeout) as exc:
            if usable is None or not usable.valid_at(self.clock()):
                raise
            log.warning("renewal failed (%s); the current token is still valid: using it", exc)
            return usable
        return self.copy.keep(token)

    def accepted(self, token: Token) -> None:
        """The API accepted ``token``: record it, once per generation and process."""
        self.refusals.accepted(token)

    # -- beat, operators, 401s -----------------------------------------------------------

    def renew(self, force: bool = False, stale_token: Token | None = None) -> Token:
        """Renew if due, or always with ``force``, or compare-and-swap after a 401.

        With ``stale_token`` (the token a call was refused with): another valid token if
        the store holds one; else a forced renewal if the evidence says ``stale_token``
        was revoked, or ``TokenRejected``. Without it and without ``force``: exchange only
        inside the advisory window (beat's scheduled check).
        """
        if stale_token is not None:
            return self.refusals.renew_after(stale_token, self._renew_forced)
        if force:
            self.store.load()  # the stored token's generation counts if the counter was evicted
            seen = self.store.generation()
            return self._renew(
                RenewalReason.MANUAL, lambda t: t is not None and t.generation > seen, None
            )
        return self._renew(
            RenewalReason.SCHEDULED,
            lambda t: t is not None and self.policy.state(t, self.clock()) == TokenState.FRESH,
            None,
        )

    def _renew_forced(
        self, stale: Token, started: float, prelude: Prelude | None, first: Callable[[], None]
    ) -> Token:
        """Renew after a 401 on ``stale`` (``Refusals`` decided it): a token that replaces it."""
        return self._renew(
            RenewalReason.FORCED,
            lambda t: t is not None and t.replaces(stale, self.clock()),
            None,
            started=started,
            prelude=prelude,
            first=first,
        )

    # -- single flight -------------------------------------------------------------------

    def _renew(
        self,
        reason: RenewalReason,
        acceptable: Acceptable,
        fallback: Token | None,
        *,
        started: float | None = None,
        probe: bool = False,
        prelude: Prelude | None = None,
        first: Callable[[], None] | None = None,
    ) -> Token:
        """A token ``acceptable`` to the caller, exchanging at most once fleet-wide.

        ``prelude``: the caller's own look at the store and the lock, as the first attempt;
        ``first``: run under the lock once the exchange has its permit (a forced renewal's
        turn).
        """
        since = self.copy.now() if started is None else started
        probing: list[bool] = []
        ran: list[bool] = []

        def look() -> Token | None:
            kept = self.copy.kept_since(since)
            if kept is not None and acceptable(kept):
                return kept
            current = self.store.load()
            if acceptable(current):
                return current
            try:
                return self.breaker.check(fallback, operator=reason == RenewalReason.MANUAL)
            except TokenEndpointUnavailable:  # the endpoint's pause: half-open
                if probing or (probe and self.breaker.take_probe()):
                    probing.append(True)
                    return None
                raise

        def renew() -> Token:
            ran.append(True)
            return self.renewer.renew(reason, probe=bool(probing), first=first)

        with telemetry.renewal_span(reason, self.store.account) as span:
            before = self.store.seen_generation
            span.set(telemetry.GENERATION_BEFORE, before)
            token = self.flight.run(look, renew, fallback, prelude=prelude)
            span.set(telemetry.GENERATION_AFTER, token.generation)
            if not ran:  # the renewer's outcome is counted where it ran (``TokenStore.records``)
                newer = token.generation > before  # another's renewal (or a valid fallback)
                span.set(telemetry.OUTCOME, Outcome.OK if newer else Outcome.UNCHANGED)
            span.set(telemetry.WAITED, not ran and token.generation > before)
            return token


# A fork copies the locks as they are: one held by a parent's thread would stay held in the
# child for ever, as no thread there can release it. Every manager gets new ones instead.
_MANAGERS: weakref.WeakSet[TokenManager] = weakref.WeakSet()


def _remake_locks_after_fork() -> None:
    for manager in list(_MANAGERS):
        manager._remake_locks()


os.register_at_fork(after_in_child=_remake_locks_after_fork)
