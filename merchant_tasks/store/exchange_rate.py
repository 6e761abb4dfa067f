"""The fleet-wide exchange rate of one token endpoint host: every exchange takes a permit.

One token bucket per host in Redis (``store.scripts.TAKE_EXCHANGE_PERMIT``, Redis time),
shared by every account, process and machine on that Redis, beside the other guards
(docs/design.md, "The exchange rate"). It is asked only when an exchange is about to be
sent, never on the hot path; the asking and waiting are ``renewal.life``'s (``permit``), the
commands and the words of its error are here. A caller that needs a token now reserves the
next permit and waits for it (at most ``PERMIT_WAIT``); beat's renewals never take the last
``RESERVED_FOR_CALLERS`` permits. A 429 on any account of the host halves the host's rate
for ``RATE_HOLD``, then it grows back step by step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from merchant_tasks.exceptions import ExchangesThrottled
from merchant_tasks.store import scripts
from merchant_tasks.store.keys import AccountRedis, Command, Replies, milliseconds

BURST_SECONDS = 0.2  # the bucket holds this much of the rate (a small burst): no second
# carries more than 1.2 times the rate, and a quiet host still answers a caller at once
RESERVED_FOR_CALLERS = 1  # permits beat's renewals never take: a call that needs a token
# now goes before background work
PERMIT_WAIT = 5.0  # longest wait for a permit; then the caller gets ExchangesThrottled,
# a TokenEndpointUnavailable, as when the endpoint itself cannot answer
RATE_HOLD = 20.0  # after a 429 the halved rate holds this long ...
RATE_STEP = 0.1  # ... then grows by this share of the cap ...
RATE_STEP_INTERVAL = 2.0  # ... every this many seconds (additive increase)
RATE_FLOOR = 0.2  # halvings stop at one exchange per 5 s: the host is never shut out
HALVING_SPACING = 2.0  # 429s this soon after a halving answer exchanges sent before it
STATE_LIFETIME = 86400.0  # a host's bucket and counts outlive a day without exchanges
_JITTER = 0.25  # beat's renewals ask again up to this share later, so they do not ask in step


class Priority(enum.StrEnum):
    """Who wants the permit (the script's words)."""

    CALLER = "caller"  # a call needs a token now: mandatory, forced, manual renewals
    BACKGROUND = "background"  # beat's scheduled renewals and first tokens


@dataclass(frozen=True)
class RateState:
    """A host's exchange rate now, and its counts since the key was made."""

    host: str
    rate: float  # permits per second now (the cap, or less after a 429)
    cap: float  # MERCHANT_MAX_EXCHANGES_PER_SECOND
    permits: float  # in the bucket now (negative: callers have reserved ahead)
    counts: dict[str, int]  # granted_caller, granted_background, waited, waited_ms, gave_up, cuts


@dataclass(frozen=True)
class PermitAnswer:
    """The script's answer to one ask for a permit."""

    granted: int  # 1: granted (wait ``wait`` before sending), 0: ask again after ``wait``,
    # -1: none within the asker's wait
    wait: float  # seconds
    rate: float  # permits per second now
    permits: float  # in the bucket now


class ExchangeRate:
    """The permits of one token endpoint host, asked through one account's Redis: the
    commands (``ask``, ``cut``; ``renewal.life`` yields them and waits as told) and the
    host's state for `status`."""

    def __init__(self, commands: Replies, key: str, host: str, cap: float) -> None:
        self.commands = commands
        self.key = key
        self.host = host
        self.cap = cap

    def __repr__(self) -> str:
        return f"ExchangeRate(host={self.host!r}, cap={self.cap:g})"

    def ask(self, priority: Priority, budget: float, waited: float) -> Command[PermitAnswer]:
        """Ask for a permit to send one exchange now, for ``priority``; ``budget``: the
        longest wait the asker accepts, ``waited``: how long it has waited so far."""
        return self._command(priority, budget, waited)

    def cut(self) -> Command[PermitAnswer]:
        """The host answered 429: halve its rate fleet-wide."""
        return self._command("cut")

    def throttled(self, answer: PermitAnswer) -> ExchangesThrottled:
        """The error of an ask that got no permit within PERMIT_WAIT."""
        return ExchangesThrottled(
            f"no token exchange permit for {self.host} within {PERMIT_WAIT:g} s: the fleet "
            f"sends at most {answer.rate:g} exchanges a second to it "
            f"(MERCHANT_MAX_EXCHANGES_PER_SECOND={self.cap:g}"
            f"{', halved after a 429' if answer.rate < self.cap else ''})",
            retry_after=round(max(answer.wait, 1.0 / answer.rate), 3),
        )

    @staticmethod
    def jittered(wait: float, draw: float) -> float:
        """Beat's renewals ask again up to _JITTER later (``draw`` in [0, 1)), not in step."""
        return wait * (1 + _JITTER * draw)

    def state(self) -> RateState:
        """The rate now and the counts (for `status` and metrics)."""
        redis = self._blocking()
        return self.state_of(redis.send(self.peek()), redis.send(self.counts()))

    def peek(self) -> Command[PermitAnswer]:
        """The rate and the bucket now, no permit taken (``state``; `status` sends it in
        its first round trip, ``store.reading``)."""
        return self._command("peek")

    def counts(self) -> Command[dict[str, int]]:
        """The host's counts since its key was made (``RateState.counts``)."""
        return Command(("HGETALL", self.key), _counts, self.key, _counts({}))

    def state_of(self, answer: PermitAnswer, counts: dict[str, int]) -> RateState:
        """The state that ``peek`` and ``counts`` read."""
        return RateState(self.host, answer.rate, self.cap, answer.permits, counts)

    def _blocking(self) -> AccountRedis:
        assert isinstance(self.commands, AccountRedis), "the blocking store's rate"
        return self.commands

    def _command(
        self, mode: str, budget: float = 0.0, waited: float = 0.0
    ) -> Command[PermitAnswer]:
        args = [
            mode,
            repr(self.cap),
            repr(BURST_SECONDS),
            RESERVED_FOR_CALLERS,
            milliseconds(RATE_HOLD),
            repr(RATE_STEP),
            milliseconds(RATE_STEP_INTERVAL),
            repr(RATE_FLOOR),
            milliseconds(HALVING_SPACING),
            max(0, int(budget * 1000)),
            max(0, int(waited * 1000)),
            milliseconds(STATE_LIFETIME),
        ]
        return Command.script(scripts.TAKE_EXCHANGE_PERMIT, [self.key], args, _answer)


def _answer(reply: list[Any]) -> PermitAnswer:
    result, wait_ms, rate, permits = reply
    return PermitAnswer(int(result), int(wait_ms) / 1000, float(rate), float(permits))


_COUNTED = ("granted_caller", "granted_background", "waited", "waited_ms", "gave_up", "cuts")


def _counts(raw: dict[bytes, bytes]) -> dict[str, int]:
    return {name: _integer(raw.get(name.encode())) for name in _COUNTED}


def _integer(raw: bytes | None) -> int:
    try:
        return int(raw) if raw is not None else 0
    except ValueError:
        return 0
