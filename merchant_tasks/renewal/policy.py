"""The renewal policy: when a token is renewed, and the words the fleet counts with.

Pure decisions on values, no I/O: docs/design.md, "Windows" and "An answer no better than
the stored token". What a 401 means is ``refusals``'.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from merchant_tasks.token import Token, TokenState

_USABLE = (TokenState.FRESH, TokenState.ADVISORY)


class CounterName(enum.StrEnum):
    """Fleet-wide counters of the token's life (``TokenStore.count``)."""

    UNAUTHORIZED = "unauthorized"
    FORCED_RENEWALS = "forced_renewals"
    NEVER_ACCEPTED = "never_accepted_rejected"
    LOCK_WAITS = "lock_waits"
    REDELIVERED = "redelivered_completed_calls"  # answered from a completion record


class BreakerKind(enum.StrEnum):
    """Why exchanges are paused (``breaker.Breaker``)."""

    REJECTED = "rejected"  # the credentials were refused
    RATE_LIMITED = "rate_limited"  # 429
    UNAVAILABLE = "unavailable"  # 5xx, timeouts, unreachable
    REVOKED = "revoked"  # the forced-renewal budget is spent
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
