"""The renewal policy: when a token is renewed, and what a refused token means.

Pure decisions on values, no I/O: docs/design.md, "Windows", "Refusals: evidence, not
timers" and "An answer no better than the stored token".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .token import Token, TokenState

FORCED_RENEWAL_BUDGET = 10  # forced renewals per account and period, fleet-wide: revocations
# by operators and rotations come far less often; more means a fight over the API key
FORCED_RENEWAL_PERIOD = 60.0  # seconds; also the pause once the budget is spent
_USABLE = (TokenState.FRESH, TokenState.ADVISORY)

LIKELY_CAUSES = (
    "Likely causes: the API key belongs to the other environment (check MERCHANT_ENVIRONMENT "
    "and MERCHANT_BASE_URL), the secret was reset in the dashboard, or API access was "
    "revoked for this merchant"
)


class Refusal(enum.StrEnum):
    """What a 401 on a token means, from the evidence of what the API accepted before."""

    REVOKED = "revoked"  # accepted before: renew
    REVOKED_BEFORE_USE = "revoked_before_use"  # never accepted, but its predecessor was
    NEVER_ACCEPTED = "never_accepted"  # wrong key or environment: no renewal, no loop


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
    def judge_refusal(stale: Token, accepted_generation: int) -> Refusal:
        """What a 401 on ``stale`` means, given the highest generation the API accepted."""
        if accepted_generation >= stale.generation:
            return Refusal.REVOKED
        if accepted_generation == stale.generation - 1 and accepted_generation > 0:
            return Refusal.REVOKED_BEFORE_USE
        return Refusal.NEVER_ACCEPTED

    @staticmethod
    def no_better(answer_value: str, answer_expires_at: float, stored: Token, forced: bool) -> bool:
        """Whether an exchange's answer is no better than ``stored`` (still valid).

        After a 401 only the same token is no better: any other beats a refused one.
        """
        if answer_value == stored.value:
            return True
        return not forced and answer_expires_at <= stored.expires_at


def never_accepted_message() -> str:
    return (
        "the API refused a token it never accepted (HTTP 401), so renewing would not help. "
        + LIKELY_CAUSES
    )


def refused_after_renewal_message(renewals: int) -> str:
    return (
        f"the API refused the token again after {renewals} renewals in one call (HTTP 401). "
        + LIKELY_CAUSES
    )


def budget_spent_message(count: int, period: float) -> str:
    return (
        f"tokens of this account were revoked over and over: {count} forced renewals in "
        f"{period:.0f} s. Is another system exchanging with the same API key (each of its "
        "exchanges may revoke ours)? Or was API access revoked for this merchant?"
    )
