"""Durations the fleet's histograms are made of, measured where they happen.

``TimedExchange`` wraps the token exchange so each attempt's latency lands in the store's
``exchange_seconds`` histogram (and this process's meter) whatever its outcome, each
attempt in its own ``merchant_tasks.exchange`` span (``telemetry``). ``lock_wait_seconds``
runs from a caller finding another's renewal under way to a token being stored (the
other's, or its own once the lock was free), in Redis time: the store's write records it
(``TokenStore.note_wait``), so waiters send nothing for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from merchant_tasks import telemetry
from merchant_tasks.exceptions import MerchantError
from merchant_tasks.store.token_store import LOCK_WAIT_SECONDS, TokenStore
from merchant_tasks.token import IssuedToken

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
        store: TokenStore,
        monotonic: Callable[[], float] = time.monotonic,
        *,
        server: str = "",
    ) -> None:
        self.exchange = exchange
        self.store = store
        self._monotonic = monotonic
        self.server = server  # the token endpoint's host, in its spans

    def __call__(self) -> IssuedToken:
        with telemetry.exchange_span(self.server) as span:
            started = self._monotonic()
            try:
                issued = self.exchange()
            except MerchantError as exc:
                if exc.status is not None:
                    span.set(telemetry.HTTP_STATUS, exc.status)
                raise
            finally:
                seconds = self._monotonic() - started
                self.store.records.observe(EXCHANGE_SECONDS, seconds)
                telemetry.observe_exchange(self.store.account, seconds)
            span.set(telemetry.HTTP_STATUS, issued.status)
            return issued

    def __repr__(self) -> str:
        return f"TimedExchange({self.exchange!r})"
