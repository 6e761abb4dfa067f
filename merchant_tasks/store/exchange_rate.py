"""The fleet-wide exchange rate of one token endpoint host: every exchange takes a permit.

One token bucket per host in Redis (``store.scripts.TAKE_EXCHANGE_PERMIT``, Redis time),
shared by every account, process and machine on that Redis, beside the other guards
(docs/design.md, "The exchange rate"). It is asked only when an exchange is about to be
sent, never on the hot path. A caller that needs a token now reserves the next permit and
waits for it (at most ``PERMIT_WAIT``); beat's renewals never take the last
``RESERVED_FOR_CALLERS`` permits. A 429 on any account of the host halves the host's rate
for ``RATE_HOLD``, then it grows back step by step.
"""

from __future__ import annotations

import enum
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from tenacity import RetryCallState, Retrying, retry_if_result, stop_after_delay

from merchant_tasks.exceptions import ExchangesThrottled, StoreUnavailable
from merchant_tasks.store import scripts
from merchant_tasks.store.keys import AccountRedis, milliseconds

log = logging.getLogger(__name__)

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


class ExchangeRate:
    """The permits of one token endpoint host, asked through one account's Redis."""

    def __init__(
        self,
        commands: AccountRedis,
        key: str,
        host: str,
        cap: float,
        *,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.commands = commands
        self.key = key
        self.host = host
        self.cap = cap
        self._sleep = sleep
        self._monotonic = monotonic
        self._rng = rng or random.Random()

    def __repr__(self) -> str:
        return f"ExchangeRate(host={self.host!r}, cap={self.cap:g})"

    def take(self, priority: Priority) -> None:
        """Wait for a permit to send one exchange; ExchangesThrottled when none comes
        within PERMIT_WAIT, StoreUnavailable when Redis cannot be asked."""
        started = self._monotonic()
        asked: list[bool] = []

        def ask() -> tuple[int, float, float, float]:
            # the first ask waited for nothing: a busy process's own delay is no wait
            waited = self._monotonic() - started if asked else 0.0
            asked.append(True)
            return self._run(priority, budget=PERMIT_WAIT - waited, waited=waited)

        retrying = Retrying(
            retry=retry_if_result(lambda answer: answer[0] == 0),
            wait=lambda state: _answer(state)[1] * (1 + _JITTER * self._rng.random()),
            stop=stop_after_delay(2 * PERMIT_WAIT),  # the script's budget ends it well before
            sleep=self._sleep,
            retry_error_callback=_answer,
        )
        granted, wait, rate, _ = retrying(ask)
        if granted == 1:
            if wait > 0:
                self._sleep(wait)  # until the permit reserved for this caller
            return
        raise ExchangesThrottled(
            f"no token exchange permit for {self.host} within {PERMIT_WAIT:g} s: the fleet "
            f"sends at most {rate:g} exchanges a second to it "
            f"(MERCHANT_MAX_EXCHANGES_PER_SECOND={self.cap:g}"
            f"{', halved after a 429' if rate < self.cap else ''})",
            retry_after=round(max(wait, 1.0 / rate), 3),
        )

    def rate_limited(self) -> None:
        """The host answered 429: halve its rate fleet-wide (best effort)."""
        try:
            rate = self._run("cut")[2]
        except StoreUnavailable as exc:
            log.warning("could not lower the exchange rate of %s: %s", self.host, exc)
            return
        log.warning("token endpoint %s rate limited an exchange: %g exchanges/s", self.host, rate)

    def state(self) -> RateState:
        """The rate now and the counts (for `status` and metrics)."""
        _, _, rate, permits = self._run("peek")
        raw: dict[bytes, bytes] = self.commands.read(
            self.key, lambda: self.commands.client.hgetall(self.key), dict, {}
        )
        counted = ("granted_caller", "granted_background", "waited", "waited_ms", "gave_up")
        counts = {name: _integer(raw.get(name.encode())) for name in (*counted, "cuts")}
        return RateState(self.host, rate, self.cap, permits, counts)

    def _run(
        self, mode: str, budget: float = 0.0, waited: float = 0.0
    ) -> tuple[int, float, float, float]:
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
        result, wait_ms, rate, permits = self.commands.run(
            scripts.TAKE_EXCHANGE_PERMIT, [self.key], args
        )
        return int(result), int(wait_ms) / 1000, float(rate), float(permits)


def _answer(state: RetryCallState) -> tuple[int, float, float, float]:
    """The script's last answer, in a retry of ``take``."""
    assert state.outcome is not None  # a wait or a stop follows an attempt
    answer: tuple[int, float, float, float] = state.outcome.result()
    return answer


def _integer(raw: bytes | None) -> int:
    try:
        return int(raw) if raw is not None else 0
    except ValueError:
        return 0
