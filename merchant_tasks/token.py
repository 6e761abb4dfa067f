"""The access token: a small immutable value and the state it is in at a given time.

Times are seconds on the token store's clock (Redis TIME), the one clock every host shares.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import dataclass, field


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

    @property
    def kept_until(self) -> float:
        """Until when the store keeps it: a final token until the server surely let it go,
        so whoever renews it can wait for that rather than be handed it back again."""
        return self.expires_at + (self.lag if self.final else 0.0)

    @property
    def fingerprint(self) -> str:
        """A short, non-reversible name for the token, safe for logs."""
        return fingerprint(self.value)

    def time_left(self, now: float) -> float:
        return self.expires_at - now

    def valid_at(self, now: float) -> bool:
        """Whether the token can still be sent at ``now``."""
        return self.expires_at > now

    def replaces(self, stale: Token, now: float) -> bool:
        """Whether this token stands in for ``stale``, which the API refused: a later
        generation, another value, and still valid at ``now``."""
        return (
            self.generation > stale.generation and self.value != stale.value and self.valid_at(now)
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
            f"renewed_by={self.renewed_by!r}, reason={self.reason!r}, final={self.final})"
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
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a stored token ({type(exc).__name__})") from None
        if not all(map(math.isfinite, (token.issued_at, token.expires_at, token.lag))):
            raise ValueError("not a stored token (a time that is not finite)")
        return token


def fingerprint(secret_or_token: str) -> str:
    """First 12 hex digits of a SHA-256: tells two values apart without revealing either."""
    return hashlib.sha256(secret_or_token.encode()).hexdigest()[:12]
