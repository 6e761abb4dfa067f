"""The token's life: every decision about one account's token, from evidence, as values.

This module reads no clock, takes no lock, starts no thread and calls neither Redis nor
HTTP. Its flows are generators, as httpx's ``Auth.auth_flow`` is: each yields the next
step as a value (send this Redis command; make one exchange attempt; sleep; wait for an
announcement; lead or join this process's renewal) and is sent what that step gave back
(or has the step's error thrown in). A driver carries the steps out: the blocking one
(``renewal.manager``: redis-py, requests, threads) and the asyncio one (``renewal.async_manager``:
redis.asyncio, httpx, tasks) drive the same flows, so no rule is written twice. Redis
commands are values too (``store.token_store.TokenCommands``).

The decisions and the evidence they read (docs/design.md, "The model", has the table):

- **Which token a caller sends** (``TokenLife.token``): this process's copy while it is
  trusted and usable; the store's; a renewal when under the mandatory window, with the
  still-valid token as the fallback; never a token refused (its record, or a 401 this
  process could not record), nor one whose replacement is held back by an error.
- **What a 401 means** (``judge``), from the refused token's own record and the route of
  the request: a route that refused a token the API accepts elsewhere lacks a permission
  (``PathForbidden``, the token stays, no pause); a token that served calls and was then
  refused was revoked, and one refused before first use was revoked before use: either is
  replaced at once; two tokens in a row refused on first use on one route, none accepted
  since, hold that route back (a wrong key or a permission: the other routes show which);
  on two routes, the credentials (a fleet-wide back-off).
- **When a replacement may be exchanged**: at once, within a fleet-wide allowance of
  forced renewals (``FORCED_BURST`` at once, then one per ``FORCED_INTERVAL``), a bound
  that stops only a stream of revocations faster than any token can serve; and after a
  pause the fleet shares (``pause_for``: rejected credentials, a 429 for as long as the
  server asked, an endpoint failing, with a half-open probe).
- **What an exchange failure means** (``misrouted``): an answer no token endpoint gives
  (404, 405, a page, a redirect) from the endpoint that issued this account's tokens is an
  outage, retried; from any other, or for ``MISROUTE_NAMED_AFTER``, a wrong base URL.
- **Who renews and how long others wait**: one renewal per process (``Fly``), one per
  fleet (the lock, whose lease a live holder's heartbeat extends and a dead one's runs out
  within ``LOCK_LEASE``), the others woken by the renewer's announcement, up to
  ``Limits.wait``, then ``RenewalTimeout`` naming the holder.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import random
import re
from copy import copy as shallow_copy
from dataclasses import dataclass, replace
from typing import Any, Protocol

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exception,
    wait_random_exponential,
)

from merchant_tasks import telemetry
from merchant_tasks.exceptions import (
    LIKELY_CAUSES,
    CredentialsRejected,
    ExchangeRateLimited,
    ExchangesThrottled,
    MalformedTokenResponse,
    MerchantError,
    PathForbidden,
    RenewalTimeout,
    StoreUnavailable,
    TokenEndpointMisrouted,
    TokenEndpointUnavailable,
    TokenExchangeError,
    TokenRejected,
    WrongBaseUrl,
)
from merchant_tasks.flows import CLOCK, Flow, Moment, Redis, Sleep, next_try
from merchant_tasks.store.exchange_rate import (
    PERMIT_WAIT,
    ExchangeRate,
    PermitAnswer,
    Priority,
)
from merchant_tasks.store.keys import Command
from merchant_tasks.store.token_store import (
    EXCHANGE_SECONDS,
    BreakerRecord,
    TokenCommands,
    opening_counter,
)
from merchant_tasks.token import (
    API_PREFIX,
    BreakerKind,
    CounterName,
    IssuedToken,
    Outcome,
    RenewalPolicy,
    RenewalReason,
    Token,
    TokenState,
)

log = logging.getLogger(__name__)


# -- policy numbers, each a bound, not a guess --------------------------------------------

LOCAL_COPY_TTL = 1.0  # seconds a process sends its copy before reading Redis again: at most
# one GET a second per process on the hot path
LOCK_LEASE = 2.0  # seconds a renewal lock outlives its last extension: a holder that died
# (SIGKILL mid-exchange) frees the account within this, and the callers it kept waiting
# resume within it and one exchange
LOCK_HEARTBEAT = LOCK_LEASE / 4  # a live holder extends the lease this often: three
# extensions may fail (a slow Redis, a busy machine) before another process may take it
EXCHANGE_ATTEMPTS = 3  # tries of one renewal against a failing endpoint, while holding the lock
EXCHANGE_RETRY_WAIT_MAX = 4.0  # longest pause between those tries
ZERO_LIFETIME_RETRY = 1.0  # expires_in is in whole seconds: a token handed back with 0 left
# is gone within a second, and then the server issues a new one
FORCED_BURST = 2  # forced renewals the fleet makes at once: two revocations in a row are
# each replaced the moment they are met
FORCED_INTERVAL = 5.0  # beyond the burst, one forced renewal per this many seconds fleet-wide:
# only tokens revoked faster than that (another system revoking them as they come) wait; 16
# callers under revocations twice a second then meet at most 16 x 4 401s in 10 s
REFUSED_BACKOFF = 60.0  # seconds before a token refused on first use, after one before it
# was too (no acceptance between), is replaced
REFUSED_BACKOFF_MAX = 1800.0  # ... doubling per refusal in a row, up to 30 minutes: a key
# that is simply wrong then costs at most 9 exchanges in 2 hours
KNOWN_ERROR_MEMO = 1.0  # seconds a process answers a refused token's error (one without its
# own retry_after) without asking Redis again: the pause's error, not the token, goes out
REJECTED_BACKOFF = 60.0  # after rejected credentials, one exchange attempt a minute fleet-wide
RATE_LIMITED_BACKOFF = 60.0  # after a 429 without a Retry-After the server's clock can read
RETRY_AFTER_MARGIN = 0.5  # Retry-After is in whole seconds and each host estimates Redis's
# clock to within milliseconds: without a margin, one may knock a moment too early
UNAVAILABLE_BACKOFF = 2.0  # first pause after the endpoint failed; doubles per failure
UNAVAILABLE_BACKOFF_MAX = 60.0  # ... up to a minute, so recovery is noticed within one
PROBE_INTERVAL = 2.0  # half-open: with no valid token, one caller per interval fleet-wide
# makes one exchange attempt during an `unavailable` pause
MISROUTE_NAMED_AFTER = 60.0  # an endpoint that issued tokens and then answers as none does
# is an outage until this many seconds of it: then the base URL is named as wrong
POLL_INITIAL = 0.02  # first wait for another process's renewal without announcements
POLL_MAX = 0.25  # longest wait between two looks at the store while another renews; also
# the fallback when announcements are heard but one may have been lost
OPERATOR_ENDS = (BreakerKind.REVOKED, BreakerKind.REFUSED, BreakerKind.REJECTED)  # pauses over
# credentials and refused tokens: an operator's forced renewal says the cause is fixed;
# pauses over the endpoint's health (rate limited, unavailable) hold

# a renewal's exchange attempts: an endpoint failing (not one throttled by the fleet's own
# rate, nor one asking for longer than we hold the lock) is tried again, with jittered
# exponential waits, at least its Retry-After
EXCHANGE_RETRY = Retrying(
    retry=retry_if_exception(
        lambda exc: (
            isinstance(exc, TokenEndpointUnavailable | MalformedTokenResponse)
            and not isinstance(exc, ExchangesThrottled)
            and (getattr(exc, "retry_after", None) or 0) <= EXCHANGE_RETRY_WAIT_MAX
        )
    ),
    wait=wait_random_exponential(multiplier=0.5, max=EXCHANGE_RETRY_WAIT_MAX)
    + wait_exception(lambda exc: getattr(exc, "retry_after", None) or 0.0),
    stop=stop_after_attempt(EXCHANGE_ATTEMPTS),
)
WAITING = wait_random_exponential(multiplier=POLL_INITIAL, max=POLL_MAX)  # between looks
# while another process renews, when no announcement wakes the waiter


@dataclass(frozen=True)
class Limits:
    """How long the longest renewal and a wait for another's last, and the lock's lease."""

    renewal: float  # every attempt of one renewal, its waits and its forced turn
    wait: float  # a caller waiting for another's renewal
    lease: float = LOCK_LEASE
    heartbeat: float = LOCK_HEARTBEAT

    @property
    def looks(self) -> int:
        """A waiter's looks at the store at most: its wait in the shortest polls (a bound
        that holds whatever the clocks say)."""
        return math.ceil(self.wait / POLL_INITIAL)

    @classmethod
    def for_exchange(cls, exchange_timeout: float) -> Limits:
        """The limits for one exchange's deadline (``exchange_timeout``, api.exchange)."""
        # every attempt at its deadline after its wait for a permit, plus the waits between
        # them (a back-off and a Retry-After, each up to EXCHANGE_RETRY_WAIT_MAX), after a
        # forced renewal's wait for its turn
        renewal = (
            FORCED_INTERVAL * FORCED_BURST
            + EXCHANGE_ATTEMPTS * (exchange_timeout + PERMIT_WAIT)
            + (EXCHANGE_ATTEMPTS - 1) * 2 * EXCHANGE_RETRY_WAIT_MAX
            + LOCK_LEASE
        )
        # a caller may arrive just after a holder took the lock and died (its lease runs
        # out), then see the next holder take it and need its whole renewal
        return cls(renewal=renewal, wait=2 * renewal)


# -- the steps of a token's life (beside ``flows``' Redis, Sleep and Clock) -------------------


class Exchange:
    """One exchange attempt at the token endpoint: an ``IssuedToken``, or its
    ``TokenExchangeError`` (or ``WrongBaseUrl``) thrown in."""


class Credentials:
    """The fingerprint of the credentials in use now (API key, secret, token endpoint): a
    pause tied to others ends at once."""


class Heard:
    """How many of this account's renewal announcements this process has heard (it starts
    hearing them from this step on)."""


@dataclass(frozen=True)
class Listen:
    """Wait for an announcement after ``heard``: at most ``POLL_MAX`` while announcements
    are received, else sleep ``poll``."""

    heard: int
    poll: float


@dataclass(frozen=True)
class Fly:
    """Lead this process's renewal of the account, or join the one under way (a ``Flight``);
    ``replacing``: the generation it replaces (0: none)."""

    replacing: int


@dataclass(frozen=True)
class Await:
    """Wait up to ``timeout`` for ``flight`` to land: its outcome, or ``TIMED_OUT``."""

    flight: Flight
    timeout: float


@dataclass(frozen=True)
class Land:
    """End ``flight`` with ``outcome`` (its joiners get it)."""

    flight: Flight
    outcome: Token | MerchantError | None


@dataclass(frozen=True)
class Hold:
    """Keep the lock holding ``value`` alive: run ``TokenLife.heartbeat`` beside, until
    ``Unhold``."""

    value: str


@dataclass(frozen=True)
class Unhold:
    value: str


EXCHANGE, CREDENTIALS, HEARD = Exchange(), Credentials(), Heard()


class _TimedOut:
    """What ``Await`` answers when the flight did not land in time."""


TIMED_OUT = _TimedOut()


class Flight(Protocol):
    """A process's renewal of one account, as one of its threads or tasks sits in it (made
    by the driver, ``Fly``): whether it leads, and the generation the renewal replaces (its
    leader's; 0: none)."""

    @property
    def leader(self) -> bool: ...

    @property
    def replacing(self) -> int: ...


# -- what a 401 means ------------------------------------------------------------------------


class Verdict(enum.StrEnum):
    """What a 401 on a route means, from the refused token's record (``judge``)."""

    FORBIDDEN = "forbidden"  # the route lacks a permission: its calls fail, the token stays
    HELD = "held"  # the route's calls are held back (a wrong key, or a permission)
    REVOKED = "revoked"  # it served calls, then was refused: replaced at once
    UNUSED = "unused"  # refused before its first use (revoked before use): replaced at once
    CREDENTIALS = "credentials"  # refused on two routes, none accepted: a fleet-wide back-off


ROUTE_VERDICTS = (Verdict.FORBIDDEN, Verdict.HELD)  # about the route, not the token


def judge(token: Token, route: str, now: float) -> Verdict:
    """What a 401 on ``route`` with ``token`` (its record, as the store holds it) means at
    ``now``. The table of docs/design.md, "The model", row by row. (A token whose record
    says refused is never sent again: the fleet follows its replacement.)"""
    hold = token.route_hold(route) if route else None
    if hold == 0:
        return Verdict.FORBIDDEN  # judged before, and kept by the tokens since
    if route and route in token.accepted_routes:
        return Verdict.REVOKED  # it worked on this very route
    key_works = token.accepted or token.first_use_refusals == 0  # accepted elsewhere, or
    # the token before it was: the key works
    if route and route == token.retry_route and not token.route_worked and key_works:
        return Verdict.FORBIDDEN  # the route refused the token before it, and this one
    if token.accepted:
        return Verdict.REVOKED  # it served calls, then was refused
    if hold is not None:
        return Verdict.HELD if now < hold else Verdict.UNUSED  # after its back-off: replaced
    if token.first_use_refusals == 0:
        return Verdict.UNUSED
    if route and route == token.retry_route:
        return Verdict.HELD
    return Verdict.CREDENTIALS


def refused_backoff(in_a_row: int) -> float:
    """The back-off before replacing a token refused on first use after ``in_a_row``
    tokens before it were too."""
    return float(min(REFUSED_BACKOFF * 2 ** (in_a_row - 1), REFUSED_BACKOFF_MAX))


_ID_SEGMENT = re.compile(r"[a-z][a-z_-]*")  # a resource's name; anything else is an id


@functools.lru_cache(maxsize=1024)  # pure, asked with the same few paths each call
def route_of(path: str) -> str:
    """The route ``path`` belongs to, as refusals count it: without the API's prefix and
    query, every segment that is not a plain lowercase name (an id, a date, an email)
    replaced by ``*``: ``/open-api/v1/payments/pay_81?x=1`` is ``payments/*``."""
    route = path.split("?", 1)[0].split("#", 1)[0]
    if route.startswith(API_PREFIX):
        route = route[len(API_PREFIX) :]
    segments = [s if _ID_SEGMENT.fullmatch(s) else "*" for s in route.strip("/").split("/")]
    return "/".join(segments) or "*"


# -- the fleet's pauses (the breaker) ----------------------------------------------------------


def pause_for(
    exc: TokenExchangeError,
    previous: BreakerRecord | None,
    now: float,
    jitter: float,
    credentials: str,
) -> BreakerRecord:
    """The pause an exchange failing with ``exc`` opens at ``now`` (``previous``: the record
    before, for failures in a row; ``jitter`` in [0, 1): hosts do not retry in step)."""
    if isinstance(exc, CredentialsRejected):
        kind = BreakerKind.REJECTED
        return BreakerRecord(kind, now + REJECTED_BACKOFF, 1, credentials, str(exc), since=now)
    if isinstance(exc, ExchangeRateLimited):
        # as long as the server asked, read against its own clock (api.exchange)
        pause = exc.retry_after if exc.retry_after is not None else RATE_LIMITED_BACKOFF
        until = now + pause + RETRY_AFTER_MARGIN
        return BreakerRecord(BreakerKind.RATE_LIMITED, until, 1, "", str(exc), since=now)
    failures, since = 1, now
    misrouted = isinstance(exc, TokenEndpointMisrouted)
    if previous is not None and previous.kind == BreakerKind.UNAVAILABLE:
        failures = previous.failures + 1
        if misrouted and previous.misrouted and previous.since:
            since = previous.since
    pause = min(UNAVAILABLE_BACKOFF * 2 ** (failures - 1), UNAVAILABLE_BACKOFF_MAX)
    pause *= 0.5 + jitter / 2
    pause = max(pause, exc.retry_after or 0.0)
    kind = BreakerKind.UNAVAILABLE
    return BreakerRecord(kind, now + pause, failures, "", str(exc), 0, since, misrouted)


def paused_error(record: BreakerRecord, left: float) -> MerchantError:
    """What callers get while ``record``'s pause lasts, ``left`` seconds more."""
    message = f"token exchanges paused for {left:.0f} s more: {record.detail}"
    if record.kind == BreakerKind.REJECTED:  # the pause's end: other credentials end it sooner
        return CredentialsRejected(message, retry_after=left)
    if record.kind == BreakerKind.RATE_LIMITED:
        return ExchangeRateLimited(message, retry_after=left)
    if record.kind in (BreakerKind.REVOKED, BreakerKind.REFUSED):
        return TokenRejected(message, retry_after=left)
    if record.misrouted:
        return TokenEndpointMisrouted(message, retry_after=left)
    return TokenEndpointUnavailable(message, retry_after=left)


def misrouted(
    exc: WrongBaseUrl, issued_here: bool, previous: BreakerRecord | None, now: float
) -> MerchantError:
    """What an answer no token endpoint gives means (``exc``): a wrong base URL while this
    endpoint never issued the account a token (``issued_here``), else an outage, until it
    has lasted ``MISROUTE_NAMED_AFTER`` (``previous``: the pause of the failures before)."""
    if not issued_here:
        return exc
    since = now
    if previous is not None and previous.misrouted and previous.since:
        since = previous.since
    if now - since >= MISROUTE_NAMED_AFTER:
        return exc
    return TokenEndpointMisrouted(
        f"{exc} But this endpoint issued the account's tokens before: treated as an outage "
        f"(an ingress or a firewall answering?), retried; named as a wrong base URL after "
        f"{MISROUTE_NAMED_AFTER:.0f} s of it",
        status=exc.status,
        code=exc.code,
    )


def outcome_of(exc: TokenExchangeError) -> Outcome:
    """How an exchange that raised ``exc`` ended, in the counters' words."""
    if isinstance(exc, CredentialsRejected):
        return Outcome.REJECTED
    if isinstance(exc, ExchangeRateLimited):
        return Outcome.RATE_LIMITED
    return Outcome.FAILED


def poll_after(attempt: int) -> float:
    """The jittered wait before look ``attempt`` + 1 at another's renewal (``WAITING``)."""
    state = RetryCallState(None, None, (), {})  # type: ignore[arg-type]
    state.attempt_number = attempt
    return float(WAITING(state))


# -- what a renewal is for ---------------------------------------------------------------------


@dataclass(frozen=True)
class Purpose:
    """What a renewal is for, and which token serves it (``acceptable``)."""

    reason: RenewalReason
    fallback: Token | None = None  # mandatory: the still-valid token, sent rather than wait
    stale: Token | None = None  # forced: the refused token
    route: str = ""  # forced: the route of the 401 that refused it
    seen: int = 0  # manual: the generation stored before
    probe: bool = False  # may probe the endpoint during an ``unavailable`` pause

    def acceptable(self, token: Token | None, now: float, policy: RenewalPolicy) -> bool:
        if token is None:
            return False
        if self.reason == RenewalReason.FORCED:
            assert self.stale is not None
            return token.replaces(self.stale, now)
        if self.reason == RenewalReason.MANUAL:
            return token.generation > self.seen
        if self.reason == RenewalReason.SCHEDULED:
            return policy.state(token, now) == TokenState.FRESH
        return policy.usable(token, now) and not token.refused


STANDS = None  # a flight's outcome when the token it looked at was not judged refused


# -- one account's token life in one process ---------------------------------------------------


class TokenLife:
    """One account's token, as one process sees it: the flows of its life and what the
    process remembers between them (its copy of the token, the refusals it holds, the
    errors that hold a replacement back). No I/O: a driver runs the flows."""

    def __init__(
        self,
        ask: TokenCommands,
        policy: RenewalPolicy,
        limits: Limits,
        *,
        rate: ExchangeRate | None = None,
        endpoint: str = "",
        rng: random.Random | None = None,
        copy_ttl: float = LOCAL_COPY_TTL,
    ) -> None:
        self.ask = ask
        self.policy = policy
        self.limits = limits
        self.rate = rate  # the token endpoint host's fleet-wide permits (store.exchange_rate)
        self.endpoint = endpoint  # fingerprint of the token endpoint (evidence it issued)
        self.rng = rng or random.Random()
        self.copy_ttl = copy_ttl
        self.owner = ""  # the process (``host:pid:nonce``), set by the driver (and after fork)
        self.lock_prefix = ""  # what this process's lock holdings start with
        self.flight: Flight | None = None  # this process's renewal under way (the driver's)
        self._copy: tuple[Token, float] | None = None  # the copy, trusted until (monotonic)
        self._held: dict[int, tuple[float, str, MerchantError]] = {}  # refused generation ->
        # until when its error stands (store time), the credentials then, the error
        self._unrecorded: frozenset[int] = frozenset()  # 401s the store could not record:
        # not sent again by this process, recorded by its next look that reaches the store
        self._accepted = 0  # the highest generation this process marked accepted
        self._routes_marked: frozenset[tuple[int, str]] = frozenset()
        self._holdings = 0

    def __repr__(self) -> str:
        return f"TokenLife({self.ask.namespace!r})"

    @property
    def account(self) -> str:
        return self.ask.account

    # -- this process's copy -------------------------------------------------------------

    def ready(self, moment: Moment) -> Token | None:
        """The token to send with no flow at all (the hot path): the copy while trusted,
        usable and known to nobody as refused; None: run ``token``."""
        kept = self._copy
        if kept is None or moment.mono >= kept[1]:
            return None
        copy = kept[0]
        if not self.policy.usable(copy, moment.now) or self._doubtful(copy):
            return None
        return copy

    def keep(self, token: Token, mono: float) -> Token:
        """Make ``token`` the copy, unless a newer one is kept and still trusted (this one
        was read before that was stored: it would cost each call a 401). Between threads
        the check and the write may interleave: the older copy then serves at most one
        ``copy_ttl``, its 401s turned into the newer token by the store."""
        kept = self._copy
        if kept is None or token.generation >= kept[0].generation or mono >= kept[1]:
            self._copy = (token, mono + self.copy_ttl)
        return token

    def last(self) -> Token | None:
        """The copy, trusted or not (for when Redis cannot be read)."""
        return self._copy[0] if self._copy is not None else None

    def forget(self) -> None:
        """Drop the copy: the next call reads Redis."""
        self._copy = None

    def after_fork(self, owner: str, lock_prefix: str) -> None:
        """A forked child: its own owner id and lock holdings, no flight (none follows)."""
        self.owner, self.lock_prefix, self.flight = owner, lock_prefix, None

    def _doubtful(self, token: Token) -> bool:
        """Whether anything this process knows stops ``token`` going out as it is."""
        flight = self.flight
        return (
            token.refused
            or token.generation in self._unrecorded
            or token.generation in self._held
            or (flight is not None and flight.replacing >= token.generation)
        )

    def _newer_copy(self, stale: Token, now: float) -> Token | None:
        copy = self.last()
        return copy if copy is not None and copy.replaces(stale, now) else None

    # -- the caller's path -----------------------------------------------------------------

    def token(self) -> Flow[Token]:
        """A token to call the API with; renews only under the mandatory window."""
        moment = yield CLOCK
        copy = self.ready(moment)
        if copy is not None:
            return copy
        kept = self._copy
        if kept is not None and moment.mono < kept[1] and self.policy.usable(kept[0], moment.now):
            # trusted but doubtful: refused, or replaced by a sibling
            return (yield from self._replacement(kept[0], "", new_401=False))
        try:
            current: Token | None = yield Redis(self.ask.load())
        except StoreUnavailable:
            last = self.last()
            moment = yield CLOCK
            if (
                last is not None
                and last.valid_at(moment.now)
                and not (yield from self._unsendable(last, moment.now))
            ):
                log.warning("token store unavailable; using this process's copy of the token")
                return last
            raise
        yield HEARD  # from now on, this process hears of renewals elsewhere
        moment = yield CLOCK
        now = moment.now
        if current is not None and current.valid_at(now):
            if (yield from self._unsendable(current, now)):
                # whatever its window: replaced, never sent, nor kept as a fallback
                return (yield from self._replacement(current, "", new_401=False))
            if self.policy.usable(current, now):
                return self.keep(current, moment.mono)
        usable = current if current is not None and current.valid_at(now) else None
        purpose = Purpose(RenewalReason.MANDATORY, fallback=usable, probe=True)
        try:
            token = yield from self.renewal(purpose)
        except (TokenExchangeError, RenewalTimeout) as exc:
            moment = yield CLOCK
            if usable is None or not usable.valid_at(moment.now):
                raise
            log.warning("renewal failed (%s); the current token is still valid: using it", exc)
            return usable
        moment = yield CLOCK
        return self.keep(token, moment.mono)

    def token_for(self, path: str) -> Flow[Token]:
        """``token``, for a call on ``path``: the route's hold stops it before it is sent
        (``PathForbidden`` once the token works elsewhere: the route's, then, not the key's)."""
        token = yield from self.token()
        hold = token.route_hold(route_of(path)) if token.routes else None
        if hold:
            moment = yield CLOCK
            if moment.now < hold:
                raise _hold_error(token, route_of(path), hold - moment.now)
        return token

    def accepted(self, token: Token, path: str = "") -> Flow[None]:
        """The API accepted ``token`` on ``path``: recorded in the token's record, once per
        generation, route and process, best effort; the record as the store then holds it
        becomes this process's copy (it knows what it just learned)."""
        route = route_of(path) if path else ""
        marked = (token.generation, route)
        if token.generation < self._accepted or marked in self._routes_marked:
            return
        if token.generation > self._accepted:
            self._accepted, self._routes_marked = token.generation, frozenset()
        self._routes_marked |= {marked}
        try:
            record = yield Redis(self.ask.mark_accepted(token.generation, route))
        except StoreUnavailable as exc:
            # not retried with every call (each would wait for Redis): the other processes
            # using this generation record it too
            log.warning("could not record that the API accepted a token: %s", exc)
            return
        kept = self._copy
        if record is not None and kept is not None and kept[0].generation == record.generation:
            self._copy = (record, kept[1])

    def refused(self, token: Token, path: str = "") -> Flow[Token]:
        """A request on ``path`` sent with ``token`` got 401: the token that replaces it
        (another's, or a forced renewal), or the error that says why not: ``PathForbidden``
        (the route lacks a permission), ``TokenRejected`` (held back)."""
        return (yield from self._replacement(token, route_of(path) if path else "", new_401=True))

    # -- refusals --------------------------------------------------------------------------

    def _unsendable(self, token: Token, now: float) -> Flow[bool]:
        """Whether ``token`` must not be sent: its record says refused, this process holds
        a 401 on it, or a sibling replaces it. Raises the error that holds its replacement
        back, while it stands and the credentials are the same: the token is not sent."""
        flight = self.flight
        if flight is not None and flight.replacing >= token.generation:
            return True
        held = self._held.get(token.generation)
        if held is not None:
            until, credentials, error = held
            if until > now and not (yield from self._credentials_replaced(credentials)):
                raise _again(error, until - now)
            return True
        return token.refused or token.generation in self._unrecorded

    def _credentials_replaced(self, then: str) -> Flow[bool]:
        """Whether credentials of fingerprint ``then`` ('' : none recorded) were replaced."""
        if not then:
            return False
        now_in_use = yield CREDENTIALS
        return bool(now_in_use != then)

    def _replacement(self, stale: Token, route: str, new_401: bool) -> Flow[Token]:
        """The token that replaces ``stale``: this process's copy, a sibling's renewal, the
        store's, or a forced renewal if the evidence says so (``_look_after_401``); the
        call's span is linked to the renewal that made it."""
        token = yield from self._replace(stale, route, new_401)
        telemetry.link_renewal(token.traceparent)
        return token

    def _replace(self, stale: Token, route: str, new_401: bool) -> Flow[Token]:
        moment = yield CLOCK
        yield from self._unsendable(stale, moment.now)  # raises an error that stands
        if new_401:
            self._route_verdict(stale, route, moment.now)  # the copy's word on the route
        new_401 = new_401 or stale.generation in self._unrecorded  # a 401 not recorded yet
        deadline = moment.mono + self.limits.wait
        while True:
            if not new_401 and not (yield from self._unsendable(stale, moment.now)):
                return stale  # what made it doubtful is over (a sibling's look let it stand)
            newer = self._newer_copy(stale, moment.now)
            if newer is not None:
                return newer  # a sibling got the token that replaces it
            flight = yield Fly(stale.generation)
            if flight.leader:
                return (yield from self._lead(flight, stale, route, new_401))
            if flight.replacing < stale.generation:
                # a sibling renews for another purpose (and may be waiting for another
                # process): the store may hold the replacement already
                current: Token | None = yield Redis(self.ask.load())
                moment = yield CLOCK
                if current is not None and current.replaces(stale, moment.now):
                    return self.keep(current, moment.mono)
            outcome = yield Await(flight, max(0.0, deadline - moment.mono))
            moment = yield CLOCK
            if isinstance(outcome, MerchantError):
                raise shallow_copy(outcome)  # threads may raise it at once
            if isinstance(outcome, Token) and outcome.replaces(stale, moment.now):
                return outcome
            if outcome is TIMED_OUT or moment.mono >= deadline:
                raise RenewalTimeout("another thread of this process still renews the token")
            yield from self._unsendable(stale, moment.now)

    def _lead(self, flight: Flight, stale: Token, route: str, new_401: bool) -> Flow[Token]:
        """This process's look at a refused token, and its replacement; the flight lands
        with the outcome (a route's verdict lands as ``STANDS``: the token stays)."""
        outcome: Token | MerchantError | None = STANDS
        try:
            found = yield from self._look_after_401(stale, route, new_401)
            if isinstance(found, Token):
                outcome = found
        except _HELD_BACK as exc:  # a back-off or pause: no call sends it meanwhile
            yield from self._remember(stale, exc)
            outcome = exc
            raise
        except MerchantError as exc:
            outcome = exc
            raise
        finally:
            yield Land(flight, outcome)
        if isinstance(found, RouteVerdict):
            raise found.error  # the route's, not the token's: no other call shares it
        return found

    def _remember(self, stale: Token, error: MerchantError) -> Flow[None]:
        """Until ``error`` stops standing, calls get it instead of sending ``stale``."""
        moment = yield CLOCK
        credentials = yield CREDENTIALS
        until = moment.now + (error.retry_after or KNOWN_ERROR_MEMO)
        held = {g: k for g, k in self._held.items() if g >= stale.generation}
        held[stale.generation] = (until, credentials, error)
        self._held = held

    def _route_verdict(self, stale: Token, route: str, now: float) -> None:
        """A 401 on a route the record of ``stale`` (as this process has it) judged already:
        its error, with no Redis command."""
        hold = stale.route_hold(route) if route and not stale.refused else None
        if hold == 0:
            raise PathForbidden.on(route, accepted_elsewhere=stale.accepted)
        if hold is not None and now < hold:
            raise _hold_error(stale, route, hold - now)

    def _look_command(
        self, stale: Token, holding: str, route: str, count: bool, mark: bool, judged: bool
    ) -> Redis[tuple[Token | None, int]]:
        """The round trip of ``_look_after_401``, holding the lock as ``holding``."""
        return Redis(
            self.ask.look_after_401(
                stale.generation,
                holding,
                self.lock_prefix,
                self.limits.lease,
                self.limits.wait,
                route=route,
                count=count,
                mark=mark,
                judged=judged,
            )
        )

    def _look_after_401(
        self, stale: Token, route: str, new_401: bool
    ) -> Flow[Token | RouteVerdict]:
        """In this process's flight: one round trip that counts the 401, reads the record
        and, when it is the refused token's, marks it refused and tries the lock; then the
        table (``judge``) on the record the store holds."""
        heard = yield HEARD
        holding = self._holding()
        try:
            current, outcome = yield self._look_command(
                stale, holding, route, new_401, new_401, judged=False
            )
        except StoreUnavailable:
            if new_401:  # the refusal is not recorded: this process holds it meanwhile
                older = {g for g in self._unrecorded if g < stale.generation}
                self._unrecorded = self._unrecorded - older | {stale.generation}
            raise
        self._unrecorded -= {stale.generation}  # recorded (and counted) in that look
        moment = yield CLOCK
        if outcome == 2 and current is not None:  # the record names the route: judge it
            verdict = judge(current, route, moment.now)
            if verdict in ROUTE_VERDICTS and not current.refused:
                return (yield from self._route_judged(current, route, verdict, moment))
            # the token's fault after all: mark it refused, try the lock (counted already)
            current, outcome = yield self._look_command(
                stale, holding, route, count=False, mark=True, judged=True
            )
            moment = yield CLOCK
        locked = outcome == 1
        handed = False
        try:
            if locked:
                yield Hold(holding)
            if current is not None and current.replaces(stale, moment.now):
                return self.keep(current, moment.mono)  # renewed elsewhere: compare-and-swap
            if current is not None and current.generation == stale.generation:
                self.keep(current, moment.mono)  # its record, refusal included
                yield from self._token_verdict(current, current.refusal_route(route), moment.now)
            log.info("token %s was refused: replacing it", stale.fingerprint)
            purpose = Purpose(RenewalReason.FORCED, stale=stale, route=route)
            handed = True
            token = yield from self._renewal(
                purpose, holding=holding if locked else None, heard=heard, noted=outcome == -1
            )
            moment = yield CLOCK
            if not token.replaces(stale, moment.now):  # the endpoint handed it back
                left = token.expires_at - moment.now  # no better answer before then
                raise TokenRejected(_handed_back(left), retry_after=left)
            return self.keep(token, moment.mono)
        finally:
            if locked and not handed:
                yield from self._release(holding)

    def _route_judged(
        self, current: Token, route: str, verdict: Verdict, moment: Moment
    ) -> Flow[RouteVerdict]:
        """Record the route's verdict in the token's record (the fleet's evidence); its
        error, for this call: the token stays for every other route."""
        if verdict == Verdict.FORBIDDEN:
            until = 0.0
            log.warning(
                "%s refuses the account's valid token (HTTP 401) on route %s: a missing "
                "permission; calls to it fail, other routes go on",
                self.ask.namespace,
                route,
            )
        else:
            until = moment.now + refused_backoff(current.first_use_refusals)
        record = yield Redis(self.ask.judge_route(current.generation, route, until))
        if record is not None:
            self.keep(record, moment.mono)
        if verdict == Verdict.FORBIDDEN:
            return RouteVerdict(PathForbidden.on(route, accepted_elsewhere=current.accepted))
        return RouteVerdict(_held(current, route, until - moment.now))

    def _token_verdict(self, refused: Token, route: str, now: float) -> Flow[None]:
        """Returns if ``refused`` (its record), met by a 401 on ``route``, is replaced now;
        raises TokenRejected while a back-off over the credentials lasts. Judged on that
        route: a route whose hold is over replaces its token (``judge``), where the same
        record judged on no route read as the credentials' (a fleet-wide pause)."""
        if judge(refused, route, now) != Verdict.CREDENTIALS:
            return
        in_a_row = refused.first_use_refusals
        record = yield Redis(self.ask.load_breaker())
        earlier = record if record is not None and record.kind == BreakerKind.REFUSED else None
        if earlier is not None and earlier.generation == refused.generation:
            if (yield from self._credentials_replaced(earlier.secret_fingerprint)):
                return  # refused under credentials since replaced: try the new ones
            if earlier.until <= now:
                return  # its back-off is over: replace it
            left = earlier.until - now
            raise TokenRejected(_refused_in_a_row(in_a_row + 1, left), retry_after=left)
        pause = refused_backoff(in_a_row)
        yield Redis(self.ask.count(CounterName.NEVER_ACCEPTED))
        detail = _refused_in_a_row(in_a_row + 1, pause)
        credentials = yield CREDENTIALS  # a new secret ends the pause
        kind = BreakerKind.REFUSED
        pause_record = BreakerRecord(
            kind, now + pause, in_a_row + 1, credentials, detail, refused.generation, now
        )
        yield from self._open(pause_record, now)
        raise TokenRejected(detail, retry_after=pause)

    # -- renewals: one per process, one per fleet --------------------------------------------

    def renewal(self, purpose: Purpose) -> Flow[Token]:
        """A token for ``purpose``, renewing at most once fleet-wide: this process's renewal
        under way, else this one (``_renewal``)."""
        deadline = None
        while True:
            flight = yield Fly(0)
            if flight.leader:
                outcome: Token | MerchantError | None = STANDS
                try:
                    token = yield from self._renewal(purpose)
                    outcome = token
                    return token
                except MerchantError as exc:
                    outcome = exc
                    raise
                finally:
                    yield Land(flight, outcome)
            moment = yield CLOCK
            fallback = purpose.fallback
            if fallback is not None and fallback.valid_at(moment.now):
                return fallback  # a sibling renews: keep using the valid token
            if deadline is None:
                deadline = moment.mono + self.limits.wait
            outcome = yield Await(flight, max(0.0, deadline - moment.mono))
            moment = yield CLOCK
            if isinstance(outcome, Token) and purpose.acceptable(outcome, moment.now, self.policy):
                return outcome
            if isinstance(outcome, MerchantError) and not isinstance(outcome, PathForbidden):
                raise shallow_copy(outcome)
            if outcome is TIMED_OUT or moment.mono >= deadline:
                raise RenewalTimeout("another thread of this process still renews the token")

    def _renewal(
        self,
        purpose: Purpose,
        *,
        holding: str | None = None,
        heard: int | None = None,
        noted: bool = False,
    ) -> Flow[Token]:
        """A token ``acceptable`` to ``purpose``, exchanging at most once fleet-wide: the
        store's, or this process's exchange under the lock, or the holder's once it is
        stored (woken by its announcement, or a bounded poll), up to ``Limits.wait``.

        ``holding``: the lock, already taken by the caller's own look (``heard``: the
        announcements heard before it; ``noted``: its wait was noted).
        """
        with telemetry.renewal_span(purpose.reason, self.account) as span:
            before = self.ask.seen_generation
            span.set(telemetry.GENERATION_BEFORE, before)
            found, ran = yield from self._fleet_renewal(purpose, holding, heard, noted)
            span.set(telemetry.GENERATION_AFTER, found.generation)
            if not ran:  # the renewer's outcome is counted where it ran (the store's records)
                newer = found.generation > before  # another's renewal (or a valid fallback)
                span.set(telemetry.OUTCOME, Outcome.OK if newer else Outcome.UNCHANGED)
            span.set(telemetry.WAITED, not ran and found.generation > before)
            return found

    def _fleet_renewal(
        self, purpose: Purpose, holding: str | None, heard: int | None, noted: bool
    ) -> Flow[tuple[Token, bool]]:
        """``_renewal``'s token, and whether this process exchanged for it. Nothing is
        yielded before a ``holding`` passed in is under the ``finally`` that releases it: a
        cancellation at such a step left the lock to its lease, renewing nobody's token."""
        started: float | None = None  # when this process began to wait for another's renewal
        taken = False  # the lock taken here (a holding passed in is held already)
        probing = [False]
        attempt = 0
        looked = heard is not None  # the caller's own look stands for the first attempt
        while True:
            attempt += 1
            stale_generation = self.ask.seen_generation
            if holding is None and not looked:
                heard = yield HEARD
                found = yield from self._look(purpose, probing)
                if found is not None:
                    return found, False
                stale_generation = self.ask.seen_generation  # what the look found
                value = self._holding()
                if (yield Redis(self.ask.take_lock(value, self.lock_prefix, self.limits.lease))):
                    holding = value
                    taken = True
            looked = False
            if holding is not None:
                try:
                    if taken:
                        yield Hold(holding)
                    # look again: the holder we waited for may have stored a token, or
                    # failed and paused exchanges (pauses only open under the lock)
                    found = yield from self._look(purpose, probing)
                    if found is not None:
                        return found, False
                    return (yield from self._renew(purpose, probing[0])), True
                finally:
                    yield from self._release(holding)
            moment = yield CLOCK
            fallback = purpose.fallback
            if fallback is not None and fallback.valid_at(moment.now):
                return fallback, False
            if not noted:
                noted = yield Redis(self.ask.note_wait(stale_generation, self.limits.wait))
            if started is None:
                started = moment.mono
            if moment.mono >= started + self.limits.wait or attempt >= self.limits.looks:
                holder = yield Redis(self.ask.lock_holder())
                raise RenewalTimeout(
                    f"waited {moment.mono - started:.1f} s for the token renewal held "
                    f"by {holder or 'nobody (it expired)'}"
                )
            assert heard is not None
            yield Listen(heard, poll_after(attempt))

    def _look(self, purpose: Purpose, probing: list[bool]) -> Flow[Token | None]:
        """The store's token if it serves ``purpose``; else what a pause says (the valid
        fallback, or its error), or None: exchange now (a probe, during an outage)."""
        current: Token | None = yield Redis(self.ask.load())
        moment = yield CLOCK
        if purpose.acceptable(current, moment.now, self.policy):
            return current
        record = yield Redis(self.ask.load_breaker())
        if record is None or record.until <= moment.now:
            return None  # the record outlives its pause only to count failures in a row
        if (yield from self._credentials_replaced(record.secret_fingerprint)):
            return None  # a new secret is in place: try it now
        if purpose.reason == RenewalReason.MANUAL and record.kind in OPERATOR_ENDS:
            log.info("an operator's forced renewal ends the %s pause", record.kind)
            return None
        fallback = purpose.fallback
        if fallback is not None and fallback.valid_at(moment.now):
            return fallback
        error = paused_error(record, max(0.0, record.until - moment.now))
        if record.kind != BreakerKind.UNAVAILABLE or not purpose.probe:
            raise error
        # half-open: one caller per PROBE_INTERVAL fleet-wide tries the endpoint once
        if not probing[0]:
            if not (yield Redis(self.ask.take_probe(PROBE_INTERVAL))):
                raise error
            log.info("no valid token during an endpoint pause: probing the endpoint once")
            probing[0] = True
        return None

    def _release(self, holding: str) -> Flow[None]:
        """Let go of the lock holding ``holding``; one that expired or cannot be reached is
        only logged (its lease frees it anyway)."""
        yield Unhold(holding)
        try:
            released = yield Redis(self.ask.release_lock(holding))
        except StoreUnavailable as exc:
            log.warning("could not release the renewal lock (its lease frees it): %s", exc)
            return
        if not released:
            log.warning("the renewal lock expired before its holder released it")

    def _holding(self) -> str:
        """A new holding's lock value: the process, this account's lock, a number."""
        self._holdings += 1
        return f"{self.lock_prefix}{self._holdings}"

    def heartbeat(self, holding: str) -> Flow[None]:
        """Beside a holding (``Hold``): extend its lease every ``Limits.heartbeat`` while it
        lasts, up to the longest renewal (a holding nothing releases then frees within a
        lease); stop if the lock was lost. The driver ends it at ``Unhold``."""
        started = yield CLOCK
        while True:
            yield Sleep(self.limits.heartbeat)
            moment = yield CLOCK
            if moment.mono - started.mono > self.limits.renewal:
                log.warning(
                    "the renewal lock of %s was held past the longest renewal (%.0f s): its "
                    "lease is no longer extended",
                    self.ask.namespace,
                    self.limits.renewal,
                )
                return
            try:
                kept = yield Redis(self.ask.extend_lock(holding, self.limits.lease))
            except StoreUnavailable as exc:
                log.warning("could not extend the renewal lock's lease: %s", exc)
                continue
            if not kept:
                log.warning("the renewal lock was lost during a renewal: its lease ran out")
                return

    # -- the exchange and the save (under the lock) -------------------------------------------

    def _renew(self, purpose: Purpose, probing: bool) -> Flow[Token]:
        """Exchange (retrying a failing endpoint a few times, once for a probe) and store
        the answer if it is better than the stored token; else mark the stored one final
        (docs/design.md, "An answer no better than the stored token")."""
        reason = purpose.reason
        current: Token | None = yield Redis(self.ask.load())
        expected = yield Redis(self.ask.generation())  # after the load: its token counts
        # refusals on first use in a row, carried in each record: any acceptance ends them
        in_a_row = current.first_use_refusals + 1 if current and current.refused_on_first_use else 0
        moment = yield CLOCK
        if (
            current is not None
            and not current.valid_at(moment.now)
            and (moment.now < current.kept_until)
        ):
            # a final token just expired on our clock may live on the server's for as long
            # as its exchange took: asking before then would be handed it back again
            yield Sleep(max(0.0, current.kept_until - moment.now))
        issued_at = (yield CLOCK).now  # before the exchange: the token is at least this old
        kept_routes = current.forbidden_routes if current is not None else ()
        worked_on = current.accepted_routes if current is not None else ()
        # the route of the 401 that made this exchange (without it, the replacement's own
        # 401 on that route would read as the credentials')
        route = current.refusal_route(purpose.route) if current is not None else purpose.route
        if current is not None and not current.valid_at(issued_at):
            current = None
        try:
            issued = yield from self._exchange(purpose, current, 1 if probing else None)
        except ExchangesThrottled:
            raise  # the host's fleet-wide rate, not this account's endpoint: no pause
        except TokenExchangeError as exc:
            yield Redis(self.ask.record_renewal(reason, outcome_of(exc)))
            yield from self._trip(exc)
            raise
        forced = reason == RenewalReason.FORCED
        expires_at = issued_at + issued.expires_in
        if current is not None and self.policy.no_better(issued.value, expires_at, current, forced):
            yield Redis(self.ask.record_renewal(reason, Outcome.UNCHANGED))
            return (yield from self._keep_final(current, expected, forced))
        yield Redis(self.ask.record_renewal(reason, Outcome.OK))
        token = Token(
            value=issued.value,
            issued_at=issued_at,
            expires_at=expires_at,
            generation=expected + 1,
            renewed_by=self.owner,
            reason=reason,
            lag=max(0.0, (yield CLOCK).now - issued_at),
            traceparent=telemetry.renewal_traceparent(),
            first_use_refusals=in_a_row,
            retry_route=route if forced else "",
            route_worked=forced and bool(route) and route in worked_on,
            routes=kept_routes,
        )
        return (yield from self._store_new(token, expected, issued.expires_in))

    def _exchange(
        self, purpose: Purpose, current: Token | None, attempts: int | None
    ) -> Flow[IssuedToken]:
        """The exchange, tried again while the endpoint fails (``EXCHANGE_RETRY``; only once
        with ``attempts`` 1); each HTTP attempt counted."""
        started = (yield CLOCK).mono
        attempt = 0
        while True:
            attempt += 1
            try:
                return (yield from self._attempt(purpose, current, first=attempt == 1))
            except TokenExchangeError as exc:
                if attempts is not None and attempt >= attempts:
                    raise
                moment = yield CLOCK
                wait = next_try(EXCHANGE_RETRY, attempt, started, moment.mono, exc)
                if wait is None:
                    raise
                yield Sleep(wait)

    def _attempt(self, purpose: Purpose, current: Token | None, first: bool) -> Flow[IssuedToken]:
        """One HTTP attempt: its permit, a forced renewal's turn (once), the exchange, its
        time and outcome recorded."""
        reason = purpose.reason
        if self.rate is not None:
            urgent = reason != RenewalReason.SCHEDULED
            yield from self.permit(Priority.CALLER if urgent else Priority.BACKGROUND)
        if first and reason == RenewalReason.FORCED:
            yield from self._forced_turn()
        began = yield CLOCK
        try:
            issued: IssuedToken = yield EXCHANGE
        except (TokenExchangeError, WrongBaseUrl) as exc:
            ended = yield CLOCK
            yield from self._timed(ended.mono - began.mono)
            failure: MerchantError = exc
            if isinstance(exc, WrongBaseUrl):
                failure = yield from self._misrouted(exc, ended.now)
            outcome = (
                outcome_of(failure) if isinstance(failure, TokenExchangeError) else (Outcome.FAILED)
            )
            yield Redis(self.ask.record_attempt(reason, outcome, ended.now))
            if isinstance(exc, ExchangeRateLimited) and self.rate is not None:
                yield from self._best_effort(self.rate.cut(), "lower the exchange rate")
            if failure is exc:
                raise
            raise failure from None
        ended = yield CLOCK
        yield from self._timed(ended.mono - began.mono)
        yield Redis(self.ask.record_attempt(reason, Outcome.OK, ended.now))
        if issued.expires_in <= 0 and current is None:
            # its last token, in its last second: a new one comes once that is over
            raise TokenEndpointUnavailable(
                "token endpoint handed back a token that expires now (expires_in 0)",
                retry_after=ZERO_LIFETIME_RETRY,
            )
        return issued

    def _misrouted(self, exc: WrongBaseUrl, now: float) -> Flow[MerchantError]:
        """``misrouted``, on the evidence in the store: who issued the last token, and the
        pause of the failures before."""
        issuer = yield Redis(self.ask.issuer())
        previous = yield Redis(self.ask.load_breaker())
        return misrouted(exc, bool(self.endpoint) and issuer == self.endpoint, previous, now)

    def _timed(self, seconds: float) -> Flow[None]:
        """One exchange attempt's duration, into the fleet's histogram (best effort)."""
        telemetry.observe_exchange(self.account, seconds)
        yield from self._best_effort(self.ask.observe(EXCHANGE_SECONDS, seconds), "time it")

    def _best_effort(self, command: Command[Any], what: str) -> Flow[None]:
        try:
            yield Redis(command)
        except StoreUnavailable as exc:
            log.warning("could not %s in Redis: %s", what, exc)

    def permit(self, priority: Priority) -> Flow[None]:
        """Wait for a permit of the host's fleet-wide exchange rate; ExchangesThrottled when
        none comes within PERMIT_WAIT."""
        assert self.rate is not None
        started = (yield CLOCK).mono
        waited = 0.0
        while True:
            answer: PermitAnswer = yield Redis(
                self.rate.ask(priority, budget=PERMIT_WAIT - waited, waited=waited)
            )
            if answer.granted == 1:
                if answer.wait > 0:
                    yield Sleep(answer.wait)  # until the permit reserved for this caller
                return
            moment = yield CLOCK
            if answer.granted == -1 or moment.mono - started >= 2 * PERMIT_WAIT:
                raise self.rate.throttled(answer)
            yield Sleep(self.rate.jittered(answer.wait, self.rng.random()))
            waited = (yield CLOCK).mono - started

    def _forced_turn(self) -> Flow[None]:
        """Before a forced renewal's exchange: its turn in the fleet's allowance."""
        wait = yield Redis(
            self.ask.reserve_forced(FORCED_INTERVAL, FORCED_INTERVAL * (FORCED_BURST - 1))
        )
        yield Redis(self.ask.count(CounterName.FORCED_RENEWALS))
        if wait > 0:
            log.warning(
                "tokens of %s are refused faster than one per %.0f s: the next forced renewal "
                "waits %.1f s. Is another system exchanging with the same API key?",
                self.ask.namespace,
                FORCED_INTERVAL,
                wait,
            )
            yield Sleep(wait)

    def _trip(self, exc: TokenExchangeError) -> Flow[None]:
        """Pause exchanges fleet-wide for the failure ``exc`` (``pause_for``)."""
        moment = yield CLOCK
        previous = yield Redis(self.ask.load_breaker())
        credentials = ""
        if isinstance(exc, CredentialsRejected):  # a new secret ends the pause
            credentials = yield CREDENTIALS
        record = pause_for(exc, previous, moment.now, self.rng.random(), credentials)
        if record.kind == BreakerKind.UNAVAILABLE:  # the first probe comes an interval later
            yield Redis(self.ask.take_probe(PROBE_INTERVAL))
        yield from self._open(record, moment.now)

    def _open(self, record: BreakerRecord, now: float) -> Flow[None]:
        yield Redis(self.ask.open_breaker(record, now))
        yield Redis(self.ask.count(opening_counter(record.kind)))
        telemetry.count_breaker_opening(self.account, record.kind)
        log.warning(
            "token exchanges paused for %.1f s for %s: %s",
            record.until - now,
            self.ask.namespace,
            record.detail,
        )

    def _store_new(self, token: Token, expected: int, lifetime: float) -> Flow[Token]:
        written, stored_generation = yield Redis(self.ask.save(token, self.endpoint))
        if written:
            yield from self._stored(token)
            log.info(
                "renewed token for %s: generation %d, %s, valid %.0f s",
                self.ask.namespace,
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
        return (yield from self._newer_than_ours(stored_generation))

    def _keep_final(self, current: Token, expected: int, forced: bool) -> Flow[Token]:
        """The exchange handed back ``current`` (or worse): no exchange before it expires.
        After a 401 (``forced``) ``current`` is the refused token: the caller says so."""
        if forced or current.final:
            return current
        final = replace(current, generation=expected + 1, final=True)
        written, stored_generation = yield Redis(self.ask.save(final, self.endpoint))
        if not written:
            return (yield from self._newer_than_ours(stored_generation))
        yield from self._stored(final)
        moment = yield CLOCK
        log.info(
            "the token endpoint handed back the stored token for %s: no renewal before it "
            "expires in %.0f s",
            self.ask.namespace,
            final.expires_at - moment.now,
        )
        return final

    def _stored(self, token: Token) -> Flow[None]:
        """``token`` was written: keep it, close the pause, wake the fleet's waiters."""
        moment = yield CLOCK
        self.keep(token, moment.mono)  # the other threads of this process find it there
        if (yield Redis(self.ask.load_breaker())) is not None:
            yield Redis(self.ask.close_breaker())
        # best effort: waiters also poll
        yield from self._best_effort(self.ask.announce(token.generation), "announce a new token")

    def _newer_than_ours(self, stored_generation: int) -> Flow[Token]:
        # our lock expired during a slow exchange and a newer token was stored meanwhile
        newer: Token | None = yield Redis(self.ask.load())
        log.warning(
            "discarded a token from a slow exchange: generation %d was stored meanwhile",
            stored_generation,
        )
        if newer is None:
            raise RenewalTimeout("a newer token was stored during a slow exchange and expired")
        return newer


_HELD_BACK = (TokenRejected, TokenExchangeError)  # what holds a replacement back: remembered


def _again(error: MerchantError, left: float) -> MerchantError:
    """A copy of ``error`` to raise again (threads may raise it at once), ``left`` seconds
    before it stops standing."""
    again = shallow_copy(error)
    if again.retry_after is not None:
        again.retry_after = left
    return again


def _refused_in_a_row(count: int, pause: float) -> str:
    return (
        f"the API refused {count} tokens in a row on their first use (HTTP 401); the account "
        f"is renewed again in {pause:.0f} s, fleet-wide, and calls fail until then. "
        + LIKELY_CAUSES
    )


@dataclass(frozen=True)
class RouteVerdict:
    """A 401 judged the route's, not the token's: the call's error (the token stays)."""

    error: MerchantError


def _hold_error(token: Token, route: str, left: float) -> PathForbidden:
    """The error of a call to ``route``, which ``token``'s record holds back for ``left``
    seconds more, before it is sent or after a 401: the route's (a permission) once the
    token works elsewhere, else the key's or the route's."""
    if token.accepted:
        error = PathForbidden.on(route)
        error.retry_after = max(0.0, left)
        return error
    return _held(token, route, left)


def _held(token: Token, route: str, left: float) -> PathForbidden:
    """The error of a call to a route held back for ``left`` seconds more by ``token``'s
    record: it and the tokens before it refused on their first use, in a row."""
    left = max(0.0, left)
    in_a_row = token.first_use_refusals + 1
    return PathForbidden(
        f"the API refused {in_a_row} tokens in a row on {API_PREFIX}{route} (HTTP 401), and no "
        "call of the account has succeeded with them yet: the merchant may lack a permission for "
        f"this path, or the key is wrong. Calls to it fail for {left:.0f} s, then a new token "
        "is tried; calls to other paths go on. " + LIKELY_CAUSES,
        status=401,
        retry_after=left,
    )


def _handed_back(left: float) -> str:
    return (
        "the token endpoint handed back the token the API refuses (HTTP 401); "
        f"it is renewed once it expires, in {left:.0f} s"
    )
