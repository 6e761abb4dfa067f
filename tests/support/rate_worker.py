"""One process of the exchange-rate tests: renews over and over, one thread per base URL.

Run as ``python tests/support/rate_worker.py ROLE SECONDS URL [URL ...]`` with the MERCHANT_*
variables of the account set (its base URL is replaced by each URL) and RATE_READY_KEY /
RATE_GO_KEY naming Redis keys for the start line; RATE_PERMIT_WAIT, if set, is the longest
wait for a permit in seconds (``exchange_rate.PERMIT_WAIT``, 5 s otherwise). ROLE
``caller`` renews as an operator does (a caller's permit), ``background`` as beat does (its
token is never fresh: the emulator's lifetime is inside the advisory window). Each process
renews an account of its own per URL (its namespace ends in the role, pid and URL's place),
so processes never wait for each other's renewal lock, only for permits. Prints one JSON
line: {url: {error or "ok": n}}.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from collections import Counter

import redis

from merchant_tasks.accounts import exchange_rate_for, redis_for
from merchant_tasks.api.exchange import TokenExchange
from merchant_tasks.exceptions import MerchantError
from merchant_tasks.renewal import life
from merchant_tasks.renewal.manager import TokenManager
from merchant_tasks.settings import Settings
from merchant_tasks.store import exchange_rate
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.token import fingerprint


def manager_for(settings: Settings, account: str) -> TokenManager:
    fleet = settings.fleet
    namespace = TokenStore.namespace_for(
        fleet.key_prefix, settings.environment, f"{settings.api_key}-{account}"
    )
    store = TokenStore(redis_for(fleet), namespace)
    return TokenManager(
        store,
        TokenExchange.from_settings(settings),
        lambda: fingerprint(settings.secret.reveal()),
        renew_before=settings.renew_before,
        renew_mandatory=settings.renew_mandatory,
        exchange_timeout=settings.connect_timeout + settings.read_timeout,
        rate=exchange_rate_for(settings, store.commands),
    )


def renew_until(manager: TokenManager, role: str, deadline: float, outcomes: Counter[str]) -> None:
    while time.monotonic() < deadline:
        try:
            manager.renew(force=role == "caller")
            outcomes["ok"] += 1
        except MerchantError as exc:
            outcomes[type(exc).__name__] += 1


def main() -> None:
    role, seconds, urls = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    if "RATE_PERMIT_WAIT" in os.environ:  # the store's budget, and the model's wait
        exchange_rate.PERMIT_WAIT = float(os.environ["RATE_PERMIT_WAIT"])
        life.PERMIT_WAIT = exchange_rate.PERMIT_WAIT  # type: ignore[attr-defined]
    settings = Settings.from_env()
    managers = {
        url: manager_for(dataclasses.replace(settings, base_url=url), f"{role}-{os.getpid()}-{n}")
        for n, url in enumerate(urls)
    }
    control = redis.Redis.from_url(os.environ["MERCHANT_REDIS_URL"])
    control.incr(os.environ["RATE_READY_KEY"])
    started = time.monotonic()
    while not control.exists(os.environ["RATE_GO_KEY"]):
        if time.monotonic() > started + 60:
            raise SystemExit("no go signal within 60 s")
        time.sleep(0.005)
    deadline = time.monotonic() + seconds
    outcomes = {url: Counter[str]() for url in urls}
    threads = [
        threading.Thread(target=renew_until, args=(managers[url], role, deadline, outcomes[url]))
        for url in urls
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({url: dict(counted) for url, counted in outcomes.items()}))


if __name__ == "__main__":
    main()
