"""One caller process of the fault suite: calls the API in a loop and reports every outcome.

Run as ``python tests/support/fault_caller.py`` with the MERCHANT_* variables set and
FAULT_KEY naming a Redis key prefix on FAULT_CONTROL_URL for the start line and the phases:
``<key>:ready`` (incremented once started), ``<key>:go`` (set by the test to start),
``<key>:stop`` (set to stop), ``<key>:phase`` (a label the test changes as it injects faults).
Every call's outcome is counted in the hash ``<key>:progress`` as ``<pid>:<phase>:<outcome>``,
so the test can watch the fleet live. Optional: FAULT_THREADS (threads calling through the
process's one client, as a threaded worker's; 1), FAULT_PAUSE (seconds between a thread's
calls), FAULT_MAX_CALLS (of the process), FAULT_CLOCK_OFFSET (seconds added to this process's
wall and monotonic clocks, as on a host whose clock is off), FAULT_PATHS (the paths the
threads call, comma-separated, thread n calling the n-th in turn; the ping otherwise).
Logs go to stderr at DEBUG, for the leak search.

Prints one JSON line: {"pid": ..., "phases": {phase: [[outcome, run length], ...]},
"samples": {error type: message}}. Any exception that is not a MerchantError ends the
process with a traceback: the test treats that as a crash.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import cast

MAX_SECONDS = 120.0  # a caller never outlives a test that forgot to stop it
# seconds between two calls: 20 a second from each of a few processes meet every phase of a
# fault; a faster loop only takes the CPU from the processes under test
DEFAULT_PAUSE = 0.05


def _skew_clocks(offset: float) -> None:
    """Move this process's clocks by ``offset`` seconds, before merchant_tasks binds them."""
    wall, mono = time.time, time.monotonic
    time.time = lambda: wall() + offset
    time.monotonic = lambda: mono() + offset


def main() -> None:
    offset = float(os.environ.get("FAULT_CLOCK_OFFSET") or 0)
    if offset:
        _skew_clocks(offset)
    logging.basicConfig(level=logging.DEBUG, format="%(name)s %(levelname)s %(message)s")

    import redis

    from merchant_tasks.accounts import client_from_env
    from merchant_tasks.exceptions import MerchantError

    key = os.environ["FAULT_KEY"]
    pause = float(os.environ.get("FAULT_PAUSE") or DEFAULT_PAUSE)
    max_calls = int(os.environ.get("FAULT_MAX_CALLS") or 1_000_000)
    threads = int(os.environ.get("FAULT_THREADS") or 1)
    paths = (os.environ.get("FAULT_PATHS") or "/open-api/v1/ping").split(",")
    client = client_from_env()
    control = redis.Redis.from_url(os.environ["FAULT_CONTROL_URL"])
    control.incr(f"{key}:ready")
    deadline = time.monotonic() + 60
    while not control.exists(f"{key}:go"):
        if time.monotonic() > deadline:
            raise SystemExit("no go signal within 60 s")
        time.sleep(0.005)

    pid = os.getpid()
    phases: dict[str, list[tuple[str, int]]] = {}  # outcomes of each phase, run-length coded
    samples: dict[str, str] = {}
    deadline = time.monotonic() + MAX_SECONDS
    calls = 0
    counting = threading.Lock()

    def call_in_a_loop(path: str) -> None:
        nonlocal calls
        # with FAULT_PATHS, each outcome is named by the path's last segment: "reports=ok"
        named = f"{path.rsplit('/', 1)[-1]}=" if "FAULT_PATHS" in os.environ else ""
        while time.monotonic() < deadline and not control.exists(f"{key}:stop"):
            with counting:
                if calls >= max_calls:
                    return
                calls += 1
            phase = cast(bytes, control.get(f"{key}:phase") or b"0").decode()
            try:
                client.request("GET", path)
                outcome = "ok"
            except MerchantError as exc:
                outcome = type(exc).__name__
                samples.setdefault(f"{named}{outcome}", str(exc))
            outcome = f"{named}{outcome}"
            with counting:
                runs = phases.setdefault(phase, [])
                if runs and runs[-1][0] == outcome:
                    runs[-1] = (outcome, runs[-1][1] + 1)
                else:
                    runs.append((outcome, 1))
            control.hincrby(f"{key}:progress", f"{pid}:{phase}:{outcome}", 1)
            time.sleep(pause)

    def crash(args: threading.ExceptHookArgs) -> None:
        """A crash (an exception that is not a MerchantError) in any thread ends the process."""
        threading.__excepthook__(args)
        sys.stderr.flush()
        os._exit(1)

    threading.excepthook = crash
    others = [
        threading.Thread(target=call_in_a_loop, args=(paths[n % len(paths)],), daemon=True)
        for n in range(1, threads)
    ]
    for thread in others:
        thread.start()
    call_in_a_loop(paths[0])
    for thread in others:
        thread.join()
    print(json.dumps({"pid": pid, "phases": phases, "samples": samples}))


if __name__ == "__main__":
    main()
