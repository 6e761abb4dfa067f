"""This process's copy of the account's token, trusted for a second without reading Redis.

A token renewed elsewhere meanwhile costs at most one 401, which compare-and-swap turns
into the new token without an exchange (docs/design.md, "Who does what").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from merchant_tasks.token import Token

LOCAL_COPY_TTL = 1.0  # seconds a process uses its copy before reading Redis again: at most
# one GET a second per process on the hot path


class _Trusted(NamedTuple):
    """The copy, and the monotonic time until which it is trusted: one tuple, so that
    threads always see a matching pair."""

    token: Token
    until: float


class LocalCopy:
    """The last token this process read or renewed, and until when it is trusted."""

    def __init__(
        self, ttl: float = LOCAL_COPY_TTL, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl = ttl
        self._monotonic = monotonic
        self._trusted: _Trusted | None = None
        self.remake_lock()

    def remake_lock(self) -> None:
        """A new lock (after a fork, one held by a parent's thread would never be freed)."""
        self._lock = threading.Lock()

    def trusted(self) -> Token | None:
        """The copy while it is trusted without reading Redis."""
        trusted = self._trusted
        if trusted is not None and self._monotonic() < trusted.until:
            return trusted.token
        return None

    def last(self) -> Token | None:
        """The copy, trusted or not (for when Redis cannot be read)."""
        trusted = self._trusted
        return trusted.token if trusted is not None else None

    def keep(self, token: Token) -> Token:
        """Make ``token`` the copy, unless another thread just kept a newer one (this one
        was read before that was stored: it would cost each call a 401)."""
        now = self._monotonic()
        with self._lock:
            kept = self._trusted
            if kept is None or token.generation >= kept.token.generation or now >= kept.until:
                # (a fresh copy with a higher generation only loses to a stale Redis after a
                # restart without persistence: then it is replaced once its second is over)
                self._trusted = _Trusted(token, now + self.ttl)
        return token

    def kept_since(self, started: float) -> Token | None:
        """The copy, if a thread of this process kept it after ``started`` (monotonic)."""
        trusted = self._trusted
        if trusted is None or trusted.until - self.ttl < started:
            return None
        return trusted.token

    def forget(self) -> None:
        """Drop the copy: the next call reads Redis."""
        self._trusted = None

    def now(self) -> float:
        """The monotonic clock this copy is timed by."""
        return self._monotonic()
