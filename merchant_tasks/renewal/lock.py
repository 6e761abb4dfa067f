"""The fleet's renewal lock of one account: taken, extended and released here only.

- **Owner.** The lock's value is ``<host>:<pid>:<nonce>:<lock>:<holding>``: the process
  (drawn once per process, again after a fork), this lock object (one per account and
  process: two managers of one account in one process, as tests and the bench make, are
  two owners) and a number per holding. A lock command that ran late, after its caller
  gave up on a stalled Redis, still names this owner: the next attempt of any of the
  process's threads takes it over at once instead of waiting out the lease. Release and
  extension name the holding, so a late release never frees a later holding's lock.
- **Lease.** Short: a holder that dies frees the lock within ``lease`` seconds. While it
  lives, a watchdog thread extends the lease every third of it, so a renewal may take
  longer than one lease (retries, waits) without another process taking the lock.
- **One holder per process.** Threads of one process share the owner id, so the process
  also keeps who holds the lock locally: a thread asks Redis only when no sibling holds it.

The store runs the commands (``TokenStore.take_lock`` and the 401 script); nothing else
names the lock's value. See docs/design.md, "Guards on exchanges".
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from typing import TypeVar

from merchant_tasks.exceptions import StoreUnavailable
from merchant_tasks.store.protocol import Store

log = logging.getLogger(__name__)

EXTENSIONS_PER_LEASE = 3  # the watchdog extends the lease every third of it: two extensions
# may fail (a slow Redis) before another process could take the lock

R = TypeVar("R")

_owner: tuple[int, str] = (0, "")


def process_owner() -> str:
    """This process's owner id (``host:pid:nonce``): the same for all its threads, new after
    a fork; also what ``Token.renewed_by`` names."""
    global _owner
    pid = os.getpid()
    if _owner[0] != pid:
        _owner = (pid, f"{socket.gethostname()}:{pid}:{uuid.uuid4().hex[:8]}")
    return _owner[1]


class RenewalLock:
    """One account's renewal lock as seen from this process."""

    def __init__(self, store: Store, lease: float) -> None:
        self.store = store
        self.lease = lease
        self._holdings = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Forget any holding (a forked child holds nothing: the watchdog did not follow)."""
        self.prefix = f"{process_owner()}:{uuid.uuid4().hex[:6]}:"  # what a holding names
        self._mutex = threading.Lock()
        self._value: str | None = None  # this process's holding, while it holds the lock
        self._stop = threading.Event()

    def __repr__(self) -> str:
        return f"RenewalLock(store={self.store!r}, lease={self.lease})"

    def acquire(self) -> bool:
        """Take the lock for this process; False if a sibling thread or another process
        holds it."""
        taken, _ = self.acquire_with(
            lambda value: (
                (self.store.take_lock(value, self.prefix, self.lease), None)
                if value is not None
                else (False, None)
            )
        )
        return taken

    def acquire_with(self, command: Callable[[str | None], tuple[bool, R]]) -> tuple[bool, R]:
        """Run a store command that tries the lock with a new holding's value (None when a
        sibling thread holds it: the command must not take it); returns whether it took the
        lock, and what else the command returned."""
        with self._mutex:
            value = None if self._value is not None else f"{self.prefix}{next(self._holdings)}"
            if value is not None:
                self._value = value  # claimed locally, before Redis is asked
        try:
            taken, result = command(value)
        except BaseException:
            if value is not None:
                self._forget(value)
            raise
        if value is None:
            return False, result
        if not taken:
            self._forget(value)
            return False, result
        self._start_watchdog(value)
        return True, result

    def release(self) -> None:
        """Release this process's holding; one that expired or cannot be reached is only
        logged (its lease frees it anyway)."""
        value = self._value
        if value is None:
            return
        self._forget(value)
        try:
            if not self.store.release_lock(value):
                log.warning("the renewal lock expired before its holder released it")
        except StoreUnavailable as exc:
            log.warning("could not release the renewal lock (its lease frees it): %s", exc)

    def _forget(self, value: str) -> None:
        with self._mutex:
            if self._value == value:
                self._value = None
                self._stop.set()
                self._stop = threading.Event()

    def _start_watchdog(self, value: str) -> None:
        stop = self._stop
        threading.Thread(
            target=self._keep_alive, args=(value, stop), name="renewal-lock-lease", daemon=True
        ).start()

    def _keep_alive(self, value: str, stop: threading.Event) -> None:
        """Extend the lease while the holding lasts; stop if the lock was lost."""
        while not stop.wait(self.lease / EXTENSIONS_PER_LEASE):
            try:
                if not self.store.extend_lock(value, self.lease):
                    log.warning("the renewal lock was lost during a renewal: its lease ran out")
                    return
            except StoreUnavailable as exc:
                log.warning("could not extend the renewal lock's lease: %s", exc)
