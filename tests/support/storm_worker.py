"""One process of the multi-process storm test: waits for the go signal, then calls.

Run as ``python tests/support/storm_worker.py CALLS`` with the MERCHANT_* variables set and
STORM_GO_KEY / STORM_READY_KEY naming Redis keys for the start line. Prints one JSON line:
{"ok": n, "errors": [...]}.
"""

from __future__ import annotations

import json
import os
import sys
import time

import redis

from merchant_tasks.accounts import client_from_env
from merchant_tasks.exceptions import MerchantError


def main() -> None:
    calls = int(sys.argv[1])
    client = client_from_env()
    control = redis.Redis.from_url(os.environ["MERCHANT_REDIS_URL"])
    control.incr(os.environ["STORM_READY_KEY"])
    deadline = time.monotonic() + 30
    while not control.exists(os.environ["STORM_GO_KEY"]):
        if time.monotonic() > deadline:
            raise SystemExit("no go signal within 30 s")
        time.sleep(0.005)
    ok, errors = 0, []
    for _ in range(calls):
        try:
            client.request("GET", "/open-api/v1/ping")
            ok += 1
        except MerchantError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    print(json.dumps({"ok": ok, "errors": errors}))


if __name__ == "__main__":
    main()
