"""Many threads doing one thing at the same moment: a storm of callers, a race."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def at_once(count: int, action: Callable[[int], T]) -> list[T]:
    """``action(n)`` in ``count`` threads (n = 0, 1, ...), each started only once all are
    ready (a barrier); their results in order. An exception in one is raised here."""
    start = threading.Barrier(count)

    def one(n: int) -> T:
        start.wait()
        return action(n)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))
