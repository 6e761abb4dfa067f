"""The access token and the renewal policy: the token (a small immutable value, and
``IssuedToken``, what an exchange hands back), the state it is in at a given time, when it
is renewed (``RenewalPolicy``), and the words the fleet counts with.

Times are seconds on the token store's clock (Redis TIME), the one clock every host shares.
Pure decisions on values, no I/O: docs/design.md, "Windows" and "An answer no better than
the stored token". What a 401 means is ``renewal.life``'s (``judge``).
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import dataclass, field

TRACEPARENT_MAX = 64  # a W3C traceparent is 55 characters; more is not one
API_PREFIX = "/open-api/v1/"  # every call's path starts so; a token's routes are named without it
ROUTES_KEPT = 16  # routes a token's record lists as accepting it: an API's resources, not ids


class TokenState(enum.StrEnum):
    """Where a token stands in its life, by time left (docs/design.md, "Windows")."""

    FRESH = "fresh"  # nobody renews
    ADVISORY = "advisory"  # beat renews; callers keep using it
    MANDATORY = "mandatory"  # any caller renews, single-flight
    EXPIRED = "expired"  # unusable


class RenewalReason(enum.StrEnum):
    """Why a token was renewed, recorded with it (``Token.reason``) for operators."""

    SCHEDULED = "scheduled"  # beat, inside the advisory window
    MANDATORY = "mandatory"  # a caller found it in the mandatory window, or none stored
    FORCED = "forced"  # a call got 401 with it
    MANUAL = "manual"  # an operator ran `merchant-tasks renew`


@dataclass(frozen=True)
class IssuedToken:
    """What a successful exchange returns: the token and its lifetime in seconds."""

    value: str = field(repr=False)
    expires_in: float
    status: int = 200  # the HTTP status it came with (a span's attribute)


@dataclass(frozen=True)
class Token:
    """An issued access token. ``repr`` shows a fingerprint, never the value."""

    value: str = field(repr=False)
    issued_at: float
    expires_at: float
    generation: int
    renewed_by: str = ""
    reason: RenewalReason | None = None  # None for tokens stored by older versions
    final: bool = False  # the token endpoint hands this token back until it expires:
    # renewing before expiry is futile (docs/design.md, "An answer no better")
    lag: float = 0.0  # seconds the issuing exchange took: the server's expiry is at most
    # this much later than ``expires_at`` (which counts from before the request was sent)
    traceparent: str = ""  # the span of the renewal that stored it (telemetry), or ""
    # evidence, kept in the token's own record (written by the store's scripts in the same
    # command as the fact they record, docs/design.md "Refusals"); older records lack them
    accepted: bool = False  # the API accepted it at least once
    refused_at: float = 0.0  # when the API first refused it (Redis time); 0: never
    refused_route: str = ""  # the route of that 401 ("" : a look with none), which the
    # token replacing it carries as its ``retry_route``, whichever process exchanges it
    first_use_refusals: int = 0  # tokens before it refused on their first use, in a row,
    # with no acceptance between (what the back-off after a refusal counts)
    retry_route: str = ""  # the route whose 401 made this token's exchange, until a call on
    # that route succeeds with it ("" : none)
    route_worked: bool = False  # that route had accepted the token this one replaced: its
    # refusing this one too is a revocation, not the route's permission
    accepted_routes: tuple[str, ...] = ()  # the routes the API accepted it on (the first
    # ROUTES_KEPT), written by the store's acceptance script
    routes: tuple[tuple[str, float], ...] = ()  # routes judged by their 401s: (route, until),
    # until 0 for a route that lacks a permission (kept by the tokens after it), else the
    # Redis time until which the route's calls are held back (docs/design.md, "Refusals")

    @property
    def kept_until(self) -> float:
        """Until when the store keeps it: a final token until the server surely let it go,
        so whoever renews it can wait for that rather than be handed it back again."""
        return self.expires_at + (self.lag if self.final else 0.0)

    @property
    def fingerprint(self) -> str:
        """A short, non-reversible name for the token, safe for logs."""
        return fingerprint(self.value)

    @property
    def refused(self) -> bool:
        """The API refused it: no process of the fleet sends it again."""
        return self.refused_at > 0

    @property
    def refused_on_first_use(self) -> bool:
        """Refused before the API ever accepted it."""
        return self.refused and not self.accepted

    def refusal_route(self, route: str) -> str:
        """The route a 401 on this token is judged and replaced on: ``route``, the caller's
        own 401's, else the one its record names (for a process that found it refused
        without meeting a 401 itself: its calls go elsewhere, or the one that met it died)."""
        return route or (self.refused_route if self.refused else "")

    def route_hold(self, route: str) -> float | None:
        """What this token's record says of ``route``: 0.0 if the route lacks a permission,
        the time until which its calls are held back, or None."""
        for name, until in self.routes:
            if name == route:
                return until
        return None

    @property
    def forbidden_routes(self) -> tuple[tuple[str, float], ...]:
        """The routes that lack a permission (a token replacing this one keeps them)."""
        return tuple((name, until) for name, until in self.routes if until == 0)

    def time_left(self, now: float) -> float:
        return self.expires_at - now

    @staticmethod
    def stored_time_left(raw: str | bytes, now: float) -> float:
        """A stored token's time left at ``now``, from its expiry alone (parsing the whole
        token costs ten times as much, and beat reads 10,000 accounts each tick); an
        unreadable record has none left (whoever renews it meets the same record and
        reports it)."""
        try:
            expires_at = float(json.loads(raw)["expires_at"])
        except (ValueError, KeyError, TypeError, RecursionError):
            return 0.0
        return expires_at - now if math.isfinite(expires_at) else 0.0

    def valid_at(self, now: float) -> bool:
        """Whether the token can still be sent at ``now``."""
        return self.expires_at > now

    def replaces(self, stale: Token, now: float) -> bool:
        """Whether this token stands in for ``stale``, which the API refused: a later
        generation, another value, still valid at ``now`` and not refused itself (its
        record says so: then it is replaced in turn, never sent)."""
        return (
            self.generation > stale.generation
            and self.value != stale.value
            and self.valid_at(now)
            and not self.refused
        )

    def state(self, now: float, renew_before: float, renew_mandatory: float) -> TokenState:
        """FRESH, ADVISORY, MANDATORY or EXPIRED at ``now`` for the given windows.

        A ``final`` token is FRESH until it expires: no exchange can do better before then.
        """
        left = self.expires_at - now
        if left <= 0:
            return TokenState.EXPIRED
        if self.final:
            return TokenState.FRESH
        if left < renew_mandatory:
            return TokenState.MANDATORY
        if left < renew_before:
            return TokenState.ADVISORY
        return TokenState.FRESH

    def __repr__(self) -> str:
        return (
            f"Token(fingerprint={self.fingerprint!r}, generation={self.generation}, "
            f"issued_at={self.issued_at:.3f}, expires_at={self.expires_at:.3f}, "
            f"renewed_by={self.renewed_by!r}, reason={self.reason!r}, final={self.final}, "
            f"accepted={self.accepted}, refused={self.refused}, "
            f"retry_route={self.retry_route!r}, routes={self.routes!r})"
        )

    def to_json(self) -> str:
        """The stored form (the store is the one place a token is written)."""
        return json.dumps(
            {
                "value": self.value,
                "issued_at": self.issued_at,
                "expires_at": self.expires_at,
                "generation": self.generation,
                "renewed_by": self.renewed_by,
                "reason": self.reason or "",
                "final": self.final,
                "lag": self.lag,
                "traceparent": self.traceparent,
                # the scripts rewrite these two in place (``store.scripts.set_field``)
                "first_use_refusals": self.first_use_refusals,
                "accepted": self.accepted,
                "refused_at": self.refused_at,
                # the scripts rewrite these in place too (``store.scripts.set_text``)
                "refused_route": self.refused_route,
                "retry_route": self.retry_route,
                "routes": " ".join(f"{name}={until!r}" for name, until in self.routes),
                "accepted_routes": " ".join(self.accepted_routes),
                "route_worked": self.route_worked,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> Token:
        """The token in its stored form; ValueError for anything else."""
        data = json.loads(raw)
        if not isinstance(data, dict) or not isinstance(data.get("value"), str):
            raise ValueError("not a stored token")
        try:
            token = cls(
                value=data["value"],
                issued_at=float(data["issued_at"]),
                expires_at=float(data["expires_at"]),
                generation=int(data["generation"]),
                renewed_by=str(data.get("renewed_by", "")),
                reason=RenewalReason(data["reason"]) if data.get("reason") else None,
                final=bool(data.get("final", False)),
                lag=float(data.get("lag", 0.0)),
                traceparent=str(data.get("traceparent", ""))[:TRACEPARENT_MAX],
                accepted=data.get("accepted", False) is True,
                refused_at=float(data.get("refused_at", 0.0)),
                refused_route=str(data.get("refused_route", "")),
                first_use_refusals=int(data.get("first_use_refusals", 0)),
                retry_route=str(data.get("retry_route", "")),
                routes=_routes(str(data.get("routes", ""))),
                accepted_routes=tuple(str(data.get("accepted_routes", "")).split()),
                route_worked=data.get("route_worked", False) is True,
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a stored token ({type(exc).__name__})") from None
        times = (token.issued_at, token.expires_at, token.lag, token.refused_at)
        if not all(map(math.isfinite, times)):
            raise ValueError("not a stored token (a time that is not finite)")
        return token


def _routes(text: str) -> tuple[tuple[str, float], ...]:
    """The ``routes`` of a stored record (``route=until`` separated by blanks)."""
    routes = []
    for entry in text.split():
        name, _, until = entry.rpartition("=")
        value = float(until)
        if not name or not math.isfinite(value):
            raise ValueError("not a stored token (a route that is not one)")
        routes.append((name, value))
    return tuple(routes)


def fingerprint(secret_or_token: str) -> str:
    """First 12 hex digits of a SHA-256: tells two values apart without revealing either."""
    return hashlib.sha256(secret_or_token.encode()).hexdigest()[:12]


_USABLE = (TokenState.FRESH, TokenState.ADVISORY)


class CounterName(enum.StrEnum):
    """Fleet-wide counters of the token's life (``TokenStore.records.count``)."""

    UNAUTHORIZED = "unauthorized"
    FORCED_RENEWALS = "forced_renewals"
    NEVER_ACCEPTED = "never_accepted_rejected"
    LOCK_WAITS = "lock_waits"
    REDELIVERED = "redelivered_completed_calls"  # answered from a completion record


class BreakerKind(enum.StrEnum):
    """Why exchanges are paused (``renewal.life.pause_for``)."""

    REJECTED = "rejected"  # the credentials were refused
    RATE_LIMITED = "rate_limited"  # 429
    UNAVAILABLE = "unavailable"  # 5xx, timeouts, unreachable
    REVOKED = "revoked"  # no longer opened (the forced-renewal budget it stood for is gone);
    # kept so that a record written by an older release still reads
    REFUSED = "refused"  # a token refused before first use: renewed after a back-off


class Outcome(enum.StrEnum):
    """How a renewal, or one HTTP attempt of its exchange, ended (``TokenStore``)."""

    OK = "ok"
    UNCHANGED = "unchanged"  # the answer was no better than the stored token
    REJECTED = "rejected"
    RATE_LIMITED = "rate_limited"
    FAILED = "failed"


@dataclass(frozen=True)
class RenewalPolicy:
    """The windows (seconds of time left) and the rules that follow from them."""

    renew_before: float
    renew_mandatory: float

    def state(self, token: Token, now: float) -> TokenState:
        return token.state(now, self.renew_before, self.renew_mandatory)

    def usable(self, token: Token | None, now: float) -> bool:
        """Whether callers use ``token`` without renewing (FRESH or ADVISORY)."""
        return token is not None and self.state(token, now) in _USABLE

    @staticmethod
    def no_better(answer_value: str, answer_expires_at: float, stored: Token, forced: bool) -> bool:
        """Whether an exchange's answer is no better than ``stored`` (still valid).

        After a 401 only the same token is no better: any other beats a refused one.
        """
        if answer_value == stored.value:
            return True
        return not forced and answer_expires_at <= stored.expires_at
