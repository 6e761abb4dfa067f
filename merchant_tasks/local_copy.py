"""This process's copy of the account's token, trusted for a second without reading Redis.

A token renewed elsewhere meanwhile costs at most one 401, which compare-and-swap turns
into the new token without an exchange (docs/design.md, "Who does what").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .token import Token

LOCAL_COPY_TTL = 1.0  # seconds a process uses its copy before reading Redis again: at most
# one GET a second per process on the hot path


class LocalCopy:
    """The last token this process read or renewed, and until when it is trusted."""

    def __init__(
        self, ttl: float = LOCAL_COPY_TTL, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl = ttl
        self._monotonic = monotonic
        # the token and the monotonic time until which it is trusted, as one tuple so that
        # threads always see a matching pair
        self._copy: tuple[Token, float] | None = None
        self.remake_lock()

    def remake_lock(self) -> None:
        """A new lock (after a fork, one held by a parent's thread would never be freed)."""
        self._lock = threading.Lock()

    def trusted(self) -> Token | None:
        """The copy while it is trusted without reading Redis."""
        copy = self._copy
        if copy is not None and self._monotonic() < copy[1]:
            return copy[0]
        return None

    def last(self) -> Token | None:
        """The copy, trusted or not (for when Redis cannot be read)."""
        copy = self._copy
        return copy[0] if copy is not None else None

    def keep(self, token: Token) -> Token:
        """Make ``token`` the copy, unless another thread just kept a newer one (this one
        was read before that was stored: it would cost each call a 401)."""
        now = self._monotonic()
        with self._lock:
            copy = self._copy
            if copy is None or token.generation >= copy[0].generation or now >= copy[1]:
                # (a fresh copy with a higher generation only loses to a stale Redis after a
                # restart without persistence: then it is replaced once its second is over)
                self._copy = (token, now + self.ttl)
        return token

    def kept_since(self, started: float) -> Token | None:
        """The copy, if a thread of this process kept it after ``started`` (monotonic)."""
        copy = self._copy
        if copy is None or copy[1] - self.ttl < started:
            return None
        return copy[0]

    def forget(self) -> None:
        """Drop the copy: the next call reads Redis."""
        self._copy = None

    def now(self) -> float:
        """The monotonic clock this copy is timed by."""
        return self._monotonic()
