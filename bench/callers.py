"""Many callers at once: the storm's load, shared by run.py and diagnose.py."""

from __future__ import annotations

import gc
import math
import threading
import time
from collections import Counter
from collections.abc import Sequence

from harness import ScenarioError

from merchant_tasks.accounts import FleetClient

PING = "/open-api/v1/ping"
JOIN_TIMEOUT = 60.0  # seconds for every caller to finish, on a busy 2-core machine


def concurrent_calls(
    clients: Sequence[FleetClient], callers: int
) -> tuple[list[float], Counter[str]]:
    """``callers`` threads call GET PING at once, spread over ``clients``; the latency of
    each from the common start, in seconds, and the errors by type name.

    A full garbage collection comes first, untimed: one owed to what ran before (the
    imports, the set-up, the last batch) would otherwise stop every caller of whichever
    batch it fell in, for 37-77 ms here, and where it falls moves with any change in
    allocations (it moved from a calm batch to a stormy one between two commits whose
    storm paths do the same work)."""
    gc.collect()
    started: list[float] = []
    barrier = threading.Barrier(callers, action=lambda: started.append(time.perf_counter()))
    latencies = [math.nan] * callers
    errors: Counter[str] = Counter()
    lock = threading.Lock()

    def call(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            clients[i % len(clients)].request("GET", PING)
        except Exception as exc:
            with lock:
                errors[type(exc).__name__] += 1
        latencies[i] = time.perf_counter() - started[0]

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=JOIN_TIMEOUT)
    if any(thread.is_alive() for thread in threads):
        raise ScenarioError(
            f"{callers} concurrent callers did not finish within {JOIN_TIMEOUT:g} s"
        )
    return latencies, errors
