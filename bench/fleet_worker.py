"""One process of the fleet-economy scenario: T threads calling GET /open-api/v1/ping.

Run as ``python bench/fleet_worker.py ROLE THREADS DURATION`` where ROLE is

- ``ours``     client_from_env(), shared by the threads;
- ``beat``     no calls: client.manager.renew() every MERCHANT_RENEW_INTERVAL s (the
               Celery beat task's body), so ours renews in the advisory window;
- ``authlib``  peer (a): one authlib OAuth2Session per process, shared by the threads;
- ``nolock``   peer (b): the shared Redis cache without a lock.

Configuration comes from MERCHANT_* variables, plus BENCH_REDIS_URL (start line),
BENCH_READY_KEY / BENCH_GO_KEY (the start line's keys: the parent writes the start time,
seconds since the epoch, into the go key), BENCH_ADVISORY (R, for the peers) and
BENCH_SHARED_KEY (peer (b)'s Redis key). Prints one JSON line:
{"role", "ok", "failed", "errors": {kind: count}}.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import redis

PING = "/open-api/v1/ping"
START_LINE_TIMEOUT = 60.0  # seconds to wait for the parent's go
TIMEOUT = (3.05, 10.0)  # the same (connect, read) timeouts as MerchantClient's defaults


class Tally:
    """One thread's outcomes; merged after the threads end, so no lock is needed."""

    def __init__(self) -> None:
        self.ok = 0
        self.errors: Counter[str] = Counter()


def call_until(call: Callable[[], str | None], deadline: float, tally: Tally) -> None:
    """Call until ``deadline`` (epoch seconds); ``call`` returns None or why it failed."""
    while time.time() < deadline:
        try:
            failure = call()
        except Exception as exc:  # every failure is counted, none ends the run
            failure = type(exc).__name__
        if failure is None:
            tally.ok += 1
        else:
            tally.errors[failure] += 1


def status_failure(status: int) -> str | None:
    return None if status == 200 else f"HTTP {status}"


def make_call(role: str) -> Callable[[], str | None]:
    base_url = os.environ["MERCHANT_BASE_URL"]
    api_key = os.environ["MERCHANT_API_KEY"]
    if role == "ours":
        from merchant_tasks.accounts import client_from_env

        client = client_from_env()

        def ours() -> str | None:
            client.request("GET", PING)
            return None

        return ours
    secret = Path(os.environ["MERCHANT_API_SECRET_FILE"]).read_text(encoding="utf-8").strip()
    advisory = float(os.environ["BENCH_ADVISORY"])
    if role == "authlib":
        from peers import authlib_session

        session = authlib_session(base_url, api_key, secret, advisory, TIMEOUT)
        started = False
        start_lock = threading.Lock()

        def authlib() -> str | None:
            nonlocal started
            if not started:  # the first token, fetched once after the start line
                with start_lock:
                    if not started:
                        session.fetch_token()
                        started = True
            return status_failure(session.get(base_url + PING).status_code)

        return authlib
    if role == "nolock":
        from peers import SharedNoLockClient

        shared = SharedNoLockClient(
            base_url,
            api_key,
            secret,
            redis.Redis.from_url(os.environ["MERCHANT_REDIS_URL"]),
            os.environ["BENCH_SHARED_KEY"],
            advisory,
            TIMEOUT,
        )
        return lambda: status_failure(shared.get(PING).status_code)
    raise SystemExit(f"unknown role {role!r}")


def beat(deadline: float, tally: Tally) -> None:
    from merchant_tasks.accounts import client_from_env
    from merchant_tasks.exceptions import MerchantError

    client = client_from_env()
    interval = float(os.environ["MERCHANT_RENEW_INTERVAL"])
    while time.time() < deadline:
        try:
            client.manager.renew()
            tally.ok += 1
        except MerchantError as exc:
            tally.errors[type(exc).__name__] += 1
        time.sleep(max(0.0, min(interval, deadline - time.time())))


def wait_for_go(control: redis.Redis) -> float:
    control.incr(os.environ["BENCH_READY_KEY"])
    give_up = time.monotonic() + START_LINE_TIMEOUT
    while time.monotonic() < give_up:
        raw = control.get(os.environ["BENCH_GO_KEY"])
        if raw is not None:
            return float(raw)
        time.sleep(0.005)
    raise SystemExit("no go signal from the bench")


def main() -> None:
    role, threads, duration = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    call = None if role == "beat" else make_call(role)
    control = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])
    start = wait_for_go(control)
    time.sleep(max(0.0, start - time.time()))
    deadline = start + duration
    tallies = [Tally() for _ in range(threads)]
    if call is None:
        beat(deadline, tallies[0])
    else:
        workers = [
            threading.Thread(target=call_until, args=(call, deadline, tally), daemon=True)
            for tally in tallies
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=duration + 60)
    errors: Counter[str] = Counter()
    for tally in tallies:
        errors.update(tally.errors)
    result = {
        "role": role,
        "ok": sum(t.ok for t in tallies),
        "failed": sum(errors.values()),
        "errors": dict(errors),
    }
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
