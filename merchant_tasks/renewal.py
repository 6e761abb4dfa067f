"""Renewal: when to exchange a token, and making sure only one process does it.

``TokenManager`` applies DESIGN.md's windows on the store's clock:

- ``token()`` is the callers' path: the stored token while it has more than the mandatory
  window left (one GET); otherwise one caller renews, single-flight, and the others keep
  the still-valid token or wait for the winner's.
- ``renew()`` is beat's and the operator's path: renew inside the advisory window, or
  always with ``force=True``; ``renew(stale_token=t)`` after a 401 is compare-and-swap.

Single-flight holds across threads, processes and hosts through one Redis lock per
account; inside a process, threads take their turn first, so in a 401 storm one thread
per process talks to Redis while the others wait for its token without polling (and
without a Redis connection each). The store refuses a write that does not follow the
generation it replaces.
A fleet-wide breaker in Redis pauses exchanges after rejected credentials (until the
secret changes or the back-off ends), after 429 (until Retry-After) and after repeated
endpoint failures (jittered back-off). The exchange itself is passed in as a callable:
nothing here speaks HTTP.
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable

from redis.exceptions import LockError, RedisError
from redis.lock import Lock
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_exception,
    wait_random_exponential,
)

from .exceptions import (
    CredentialsRejected,
    ExchangeRateLimited,
    MalformedTokenResponse,
    RenewalTimeout,
    StoreUnavailable,
    TokenEndpointUnavailable,
    TokenExchangeError,
    TokenRejected,
)
from .exchange import IssuedToken
from .store import BreakerRecord, RedisClock, TokenStore
from .timing import LOCK_WAIT_SECONDS
from .token import RenewalReason, Token, TokenState

log = logging.getLogger(__name__)

FRESH_TOKEN_GRACE = 60.0  # a token issued after a 401 that gets 401 again within this is not
# renewed again: that is a wrong key, a reset secret or revoked access, and a loop would
# only hammer the token endpoint; after it, one more forced renewal is allowed
REJECTED_BACKOFF = 60.0  # after rejected credentials, one exchange attempt a minute fleet-wide
RATE_LIMITED_BACKOFF = 60.0  # after a 429 without Retry-After
RETRY_AFTER_MARGIN = 0.5  # Retry-After is in whole seconds and each host estimates Redis's
# clock to within milliseconds: without a margin, one may knock a moment too early
UNAVAILABLE_BACKOFF = 2.0  # first pause after the endpoint failed; doubles per failure
UNAVAILABLE_BACKOFF_MAX = 60.0  # ... up to a minute, so recovery is noticed within one
EXCHANGE_ATTEMPTS = 3  # tries of one renewal against a failing endpoint, while holding the lock
EXCHANGE_RETRY_WAIT_MAX = 4.0  # longest pause between those tries
POLL_INITIAL = 0.02  # first wait for another process's renewal; loopback exchanges take ~ms
POLL_MAX = 0.25  # longest wait between two looks at the store while another process renews
LOCK_MARGIN = 5.0  # seconds of lock TTL beyond the longest renewal we allow ourselves
LOCAL_COPY_TTL = 1.0  # seconds a process uses its copy of the token before reading Redis
# again: at most one GET a second per process on the hot path, and a token renewed
# elsewhere costs at most one 401 (compare-and-swap then finds the new one)

Clock = Callable[[], float]


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
    ) -> None:
        self.store = store
        self.exchange = exchange
        self.secret_fingerprint = secret_fingerprint
        self.renew_before = renew_before
        self.renew_mandatory = renew_mandatory
        self.clock: Clock = clock or RedisClock(store.time)
        self.sleep = sleep
        self.rng = rng or random.Random()
        # the lock outlives the longest renewal: every attempt timing out plus the waits
        # between them (a back-off and a Retry-After, each up to EXCHANGE_RETRY_WAIT_MAX)
        self.lock_ttl = (
            EXCHANGE_ATTEMPTS * exchange_timeout
            + (EXCHANGE_ATTEMPTS - 1) * 2 * EXCHANGE_RETRY_WAIT_MAX
            + LOCK_MARGIN
        )
        # how long a caller waits for other processes' renewal: it may arrive just after a
        # holder took the lock and died (the lock expires within lock_ttl), and then see
        # the next holder take it and need its whole renewal (within lock_ttl again)
        self.wait_limit = 2 * self.lock_ttl
        self.local_copy_ttl = local_copy_ttl
        self._monotonic = monotonic
        # this process's copy of the token and the monotonic time until which it is trusted
        # without reading Redis; kept as one tuple so threads always see a matching pair
        self._copy: tuple[Token, float] | None = None
        self._make_locks()
        _MANAGERS.add(self)  # its locks are remade in a forked child

    def _make_locks(self) -> None:
        self._copy_lock = threading.Lock()  # makes _keep's compare-and-set atomic
        # threads of this process look at the store and renew in turn, one attempt at a time
        # (reentrant: an exchange keeps its token while holding it)
        self._turn = threading.RLock()

    def __repr__(self) -> str:
        return f"TokenManager(store={self.store!r})"

    # -- callers -------------------------------------------------------------------------

    def token(self) -> Token:
        """A token to call the API with; renews only when under the mandatory window.

        The process's own copy serves for ``local_copy_ttl`` seconds before Redis is read
        again: a token renewed elsewhere meanwhile costs at most one 401, which
        compare-and-swap turns into the new token without an exchange.
        """
        copy = self._copy
        if (
            copy is not None
            and self._monotonic() < copy[1]
            and self._state(copy[0], self.clock()) in _USABLE
        ):
            return copy[0]
        try:
            now = self.clock()
            current = self.store.load()
        except StoreUnavailable:
            if copy is not None and copy[0].expires_at > self.clock():
                log.warning("token store unavailable; using this process's copy of the token")
                return copy[0]
            raise
        if current is not None and self._state(current, now) in _USABLE:
            return self._keep(current)
        usable = current if current is not None and current.expires_at > now else None
        try:
            token = self._renew(
                RenewalReason.MANDATORY,
                lambda t: t is not None and self._state(t, self.clock()) in _USABLE,
                fallback=usable,
            )
        except (TokenExchangeError, RenewalTimeout) as exc:
            if usable is None or usable.expires_at <= self.clock():
                raise
            log.warning("renewal failed (%s); the current token is still valid: using it", exc)
            return usable
        return self._keep(token)

    def _keep(self, token: Token) -> Token:
        """Make ``token`` this process's copy, unless another thread just kept a newer one
        (this one was read before that was stored: it would cost each call a 401)."""
        now = self._monotonic()
        with self._copy_lock:
            copy = self._copy
            if copy is None or token.generation >= copy[0].generation or now >= copy[1]:
                # (a fresh copy with a higher generation only loses to a stale Redis after a
                # restart without persistence: then it is replaced once its second is over)
                self._copy = (token, now + self.local_copy_ttl)
        return token

    def _kept_since(self, started: float) -> Token | None:
        """The copy, if a thread of this process kept it after ``started``."""
        copy = self._copy
        if copy is None or copy[1] - self.local_copy_ttl < started:
            return None
        return copy[0]

    # -- beat, operators, 401s -----------------------------------------------------------

    def renew(self, force: bool = False, stale_token: Token | None = None) -> Token:
        """Renew if due, or always with ``force``, or compare-and-swap after a 401.

        With ``stale_token`` (the token a call was refused with): if the store already holds
        another valid token, return it without exchanging. Without it and without
        ``force``: exchange only inside the advisory window (beat's scheduled check).
        """
        if stale_token is not None:
            return self._renew_after_401(stale_token)
        if force:
            seen = self.store.generation()
            return self._renew(
                RenewalReason.MANUAL,
                lambda t: t is not None and t.generation > seen,
                fallback=None,
            )
        return self._renew(
            RenewalReason.SCHEDULED,
            lambda t: t is not None and self._state(t, self.clock()) == TokenState.FRESH,
            fallback=None,
        )

    def _renew_after_401(self, stale: Token) -> Token:
        """Compare-and-swap: another valid token than ``stale`` if one is stored (or was
        just kept by another thread of this process), else a forced renewal."""
        started = self._monotonic()
        try:
            self._take_turn(blocking=True)
        except RenewalTimeout:
            self.store.count("unauthorized")
            raise
        try:
            self.store.count("unauthorized")
            now = self.clock()
            kept = self._kept_since(started)
            if kept is not None and kept.value != stale.value and kept.expires_at > now:
                return kept  # another thread of this process took the new token meanwhile
            current = self.store.load()
            if current is not None and current.value != stale.value and current.expires_at > now:
                return self._keep(current)
            if (
                current is not None
                and stale.reason == RenewalReason.FORCED.value
                and now - stale.issued_at < FRESH_TOKEN_GRACE
            ):
                self.store.count("fresh_token_rejected")
                raise TokenRejected(
                    f"a token issued {now - stale.issued_at:.0f} s ago after a 401 was refused "
                    "again (HTTP 401). Likely causes: the API key belongs to the other "
                    "environment (check MERCHANT_ENVIRONMENT and MERCHANT_BASE_URL), the secret "
                    "was reset in the dashboard, or API access was revoked for this merchant"
                )
            self.store.count("forced_renewals")
        finally:
            self._turn.release()
        return self._keep(
            self._renew(
                RenewalReason.FORCED,
                lambda t: t is not None and t.value != stale.value and t.expires_at > self.clock(),
                fallback=None,
                started=started,
            )
        )

    # -- single flight -------------------------------------------------------------------

    def _renew(
        self,
        reason: RenewalReason,
        satisfied: Callable[[Token | None], bool],
        fallback: Token | None,
        started: float | None = None,
    ) -> Token:
        """Return a token that satisfies the caller, exchanging at most once fleet-wide.

        Whoever gets the lock re-checks the store and exchanges; the others wait for its
        token, or use ``fallback`` (a still-valid token) rather than wait. Each look at the
        store is made in this process's turn: while one thread exchanges, the others of the
        process wait for the turn instead of polling Redis, then find the token it kept.
        """
        since = self._monotonic() if started is None else started
        waited: list[bool] = []

        def attempt() -> Token | None:
            has_fallback = fallback is not None and fallback.expires_at > self.clock()
            if not self._take_turn(blocking=not has_fallback):
                return fallback  # another thread of this process is renewing; keep using it
            try:
                kept = self._kept_since(since)
                if kept is not None and satisfied(kept):
                    return kept
                return self._attempt_in_turn(reason, satisfied, fallback, waited)
            finally:
                self._turn.release()

        wait_for_holder = Retrying(
            retry=retry_if_result(lambda token: token is None),
            wait=wait_random_exponential(multiplier=POLL_INITIAL, max=POLL_MAX),
            stop=stop_after_delay(self.wait_limit)
            | stop_after_attempt(math.ceil(self.wait_limit / POLL_INITIAL)),
            sleep=self.sleep,
            retry_error_callback=self._holder_too_slow,
        )
        token = wait_for_holder(attempt)
        assert token is not None  # the retry only ends on a token or an error
        if waited:
            self.store.observe(LOCK_WAIT_SECONDS, self._monotonic() - since)
        return token

    def _take_turn(self, blocking: bool) -> bool:
        """Take this process's turn; without ``blocking``, only if no other thread has it.

        A blocking wait lasts at most one attempt of another thread: an exchange and its
        retries, bounded by the lock TTL (then the caller's own deadline decides)."""
        if not blocking:
            return self._turn.acquire(blocking=False)
        if not self._turn.acquire(timeout=self.lock_ttl):
            raise RenewalTimeout(
                f"waited {self.lock_ttl:.1f} s for another thread of this process to renew"
            )
        return True

    def _attempt_in_turn(
        self,
        reason: RenewalReason,
        satisfied: Callable[[Token | None], bool],
        fallback: Token | None,
        waited: list[bool],
    ) -> Token | None:
        """One look at the store: its token, the fallback, our own exchange under the Redis
        lock, or None to look again after a pause (another process holds the lock)."""
        found = self._stored_or_paused(satisfied, fallback)
        if found is not None:
            return found
        lock = self.store.lock(self.lock_ttl)
        if lock.acquire(token=_owner()):
            try:
                # look again: the holder we waited for may have stored a token, or failed
                # and paused exchanges (breakers only open under the lock)
                found = self._stored_or_paused(satisfied, fallback)
                if found is not None:
                    return found
                return self._exchange_and_save(reason)
            finally:
                _release(lock)
        if fallback is not None and fallback.expires_at > self.clock():
            return fallback
        if not waited:
            waited.append(True)
            self.store.count("lock_waits")
        return None

    def _stored_or_paused(
        self, satisfied: Callable[[Token | None], bool], fallback: Token | None
    ) -> Token | None:
        """The stored token if it satisfies the caller; while exchanges are paused, the
        still-valid ``fallback`` or the breaker's error; else None."""
        current = self.store.load()
        if satisfied(current):
            return current
        return self._check_breaker(fallback)

    def _holder_too_slow(self, state: RetryCallState) -> Token:
        holder = self.store.lock_holder() or "nobody (it expired)"
        raise RenewalTimeout(
            f"waited {state.seconds_since_start:.1f} s for the token renewal held by {holder}"
        )

    def _exchange_and_save(self, reason: RenewalReason) -> Token:
        """Exchange (retrying a failing endpoint a few times) and store the new token."""
        expected = self.store.generation()
        issued_at = self.clock()  # before the exchange: the token is at least this old
        retrying = Retrying(
            # a Retry-After longer than we may hold the lock is left to the breaker
            retry=retry_if_exception(
                lambda exc: (
                    isinstance(exc, TokenEndpointUnavailable | MalformedTokenResponse)
                    and (getattr(exc, "retry_after", None) or 0) <= EXCHANGE_RETRY_WAIT_MAX
                )
            ),
            wait=wait_random_exponential(multiplier=0.5, max=EXCHANGE_RETRY_WAIT_MAX)
            + wait_exception(lambda exc: getattr(exc, "retry_after", None) or 0.0),
            stop=stop_after_attempt(EXCHANGE_ATTEMPTS),
            sleep=self.sleep,
            reraise=True,
        )
        try:
            issued: IssuedToken = retrying(self.exchange)
        except TokenExchangeError as exc:
            self.store.record_exchange(reason.value, _outcome(exc), self.clock())
            self._open_breaker(exc)
            raise
        token = Token(
            value=issued.value,
            issued_at=issued_at,
            expires_at=issued_at + issued.expires_in,
            generation=expected + 1,
            renewed_by=_owner(),
            reason=reason.value,
        )
        written, stored_generation = self.store.save(token)
        self.store.record_exchange(reason.value, "ok", self.clock())
        if written:
            self._keep(token)  # the other threads of this process find it there
            if self.store.load_breaker() is not None:
                self.store.close_breaker()
            log.info(
                "renewed token for %s: generation %d, %s, valid %.0f s",
                self.store.namespace,
                token.generation,
                reason.value,
                issued.expires_in,
            )
            return token
        if stored_generation == expected:
            raise MalformedTokenResponse(
                f"token endpoint issued a token valid {issued.expires_in:g} s, "
                "which expired before it could be stored"
            )
        # our lock expired during a slow exchange and a newer token was stored meanwhile
        newer = self.store.load()
        log.warning(
            "discarded a token from a slow exchange: generation %d was stored meanwhile",
            stored_generation,
        )
        if newer is None:
            raise RenewalTimeout("a newer token was stored during a slow exchange and expired")
        return newer

    # -- breaker -------------------------------------------------------------------------

    def _check_breaker(self, fallback: Token | None) -> Token | None:
        """While exchanges are paused: the still-valid ``fallback``, else the breaker's error.

        Returns None when no pause applies (none stored, or the rejected secret was replaced).
        """
        record = self.store.load_breaker()
        if record is None or record.until <= self.clock():
            return None  # the record outlives its pause only to remember the failure count
        if record.kind == "rejected" and record.secret_fingerprint != self.secret_fingerprint():
            return None  # a new secret is in place: try it now
        if fallback is not None and fallback.expires_at > self.clock():
            return fallback
        left = max(0.0, record.until - self.clock())
        message = f"token exchanges paused for {left:.0f} s more: {record.detail}"
        if record.kind == "rejected":
            raise CredentialsRejected(message)
        if record.kind == "rate_limited":
            raise ExchangeRateLimited(message, retry_after=left)
        raise TokenEndpointUnavailable(message, retry_after=left)

    def _open_breaker(self, exc: TokenExchangeError) -> None:
        now = self.clock()
        previous = self.store.load_breaker()
        if isinstance(exc, CredentialsRejected):
            record = BreakerRecord(
                "rejected", now + REJECTED_BACKOFF, 1, self.secret_fingerprint(), str(exc)
            )
        elif isinstance(exc, ExchangeRateLimited):
            pause = exc.retry_after if exc.retry_after is not None else RATE_LIMITED_BACKOFF
            pause += RETRY_AFTER_MARGIN
            record = BreakerRecord("rate_limited", now + pause, 1, "", str(exc))
        else:
            failures = previous.failures + 1 if previous and previous.kind == "unavailable" else 1
            pause = min(UNAVAILABLE_BACKOFF * 2 ** (failures - 1), UNAVAILABLE_BACKOFF_MAX)
            pause *= 0.5 + self.rng.random() / 2  # jitter, so hosts do not retry in step
            pause = max(pause, getattr(exc, "retry_after", None) or 0.0)
            record = BreakerRecord("unavailable", now + pause, failures, "", str(exc))
        self.store.open_breaker(record, now)
        self.store.count(f"breaker_openings:{record.kind}")
        log.warning(
            "token exchanges paused for %.1f s for %s: %s",
            record.until - now,
            self.store.namespace,
            record.detail,
        )

    # -- helpers -------------------------------------------------------------------------

    def _state(self, token: Token, now: float) -> TokenState:
        return token.state(now, self.renew_before, self.renew_mandatory)


_USABLE = (TokenState.FRESH, TokenState.ADVISORY)

# A fork copies the locks as they are: one held by a parent's thread would stay held in the
# child for ever, as no thread there can release it. Every manager gets new ones instead.
_MANAGERS: weakref.WeakSet[TokenManager] = weakref.WeakSet()


def _remake_locks_after_fork() -> None:
    for manager in list(_MANAGERS):
        manager._make_locks()


os.register_at_fork(after_in_child=_remake_locks_after_fork)


def _owner() -> str:
    """Who renews: host and process, plus a nonce so each lock acquisition is distinct."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _outcome(exc: TokenExchangeError) -> str:
    if isinstance(exc, CredentialsRejected):
        return "rejected"
    if isinstance(exc, ExchangeRateLimited):
        return "rate_limited"
    return "failed"


def _release(lock: Lock) -> None:
    try:
        lock.release()
    except LockError:
        log.warning("the renewal lock expired before its holder released it")
    except RedisError as exc:  # the lock's TTL frees it for the next renewal anyway
        log.warning("could not release the renewal lock: %s", type(exc).__name__)
