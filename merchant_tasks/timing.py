"""Durations the fleet's histograms are made of, measured where they happen.

``TimedExchange`` wraps the token exchange so each attempt's latency lands in the store's
``exchange_seconds`` histogram whatever its outcome; the renewal records
``lock_wait_seconds``: from finding the lock held by another process to having a token
(the other's, or its own exchange's once the lock was free).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .exchange import IssuedToken
from .store import TokenStore

EXCHANGE_SECONDS = "exchange_seconds"  # one token exchange attempt, any outcome
LOCK_WAIT_SECONDS = "lock_wait_seconds"  # from finding the lock held to having a token
HISTOGRAMS = {
    EXCHANGE_SECONDS: "Seconds one token exchange attempt took, any outcome.",
    LOCK_WAIT_SECONDS: "Seconds from a renewal finding the lock held to its having a token.",
}


class TimedExchange:
    """A token exchange whose every attempt is timed into the fleet-wide histogram."""

    def __init__(
        self,
        exchange: Callable[[], IssuedToken],
        store: TokenStore,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.exchange = exchange
        self.store = store
        self._monotonic = monotonic

    def __call__(self) -> IssuedToken:
        started = self._monotonic()
        try:
            return self.exchange()
        finally:
            self.store.observe(EXCHANGE_SECONDS, self._monotonic() - started)

    def __repr__(self) -> str:
        return f"TimedExchange({self.exchange!r})"
