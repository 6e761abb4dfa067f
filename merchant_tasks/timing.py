"""Durations the fleet's histograms are made of, measured where they happen.

``TimedExchange`` wraps the token exchange so each attempt's latency lands in the store's
``exchange_seconds`` histogram whatever its outcome. ``lock_wait_seconds`` runs from a
caller finding another's renewal under way to a token being stored (the other's, or its
own once the lock was free), in Redis time: the store's write records it
(``TokenStore.note_wait``), so waiters send nothing for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .exchange import IssuedToken
from .store import LOCK_WAIT_SECONDS
from .store_protocol import Store

EXCHANGE_SECONDS = "exchange_seconds"  # one token exchange attempt, any outcome
HISTOGRAMS = {
    EXCHANGE_SECONDS: "Seconds one token exchange attempt took, any outcome.",
    LOCK_WAIT_SECONDS: "Seconds from a caller finding another's renewal under way to a token "
    "being stored.",
}


class TimedExchange:
    """A token exchange whose every attempt is timed into the fleet-wide histogram."""

    def __init__(
        self,
        exchange: Callable[[], IssuedToken],
        store: Store,
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
            self.store.records.observe(EXCHANGE_SECONDS, self._monotonic() - started)

    def __repr__(self) -> str:
        return f"TimedExchange({self.exchange!r})"
