"""At worker and beat start: the token store is checked once, and a WARNING names
MERCHANT_REDIS_URL (host only) while it is unreachable, refused by its ACL or read-only.

Celery connects to its broker by itself and says so; the token store is only met by the first
task that needs a token, where an unreachable store showed as a retry at INFO. The check
runs in a daemon thread, so a slow Redis never delays the start, and repeats every
``RECHECK_INTERVAL`` seconds until the store answers (then says so once).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tenacity import Retrying, retry_if_exception_type, stop_never, wait_fixed

from merchant_tasks.accounts import AccountClients
from merchant_tasks.exceptions import MerchantError, StoreUnavailable
from merchant_tasks.store.health import check_store
from merchant_tasks.store.token_store import TokenStore

log = logging.getLogger(__name__)

RECHECK_INTERVAL = 10.0  # seconds between warnings while the store stays unusable


def _warn(state: Any) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.warning(
        "merchant-tasks: %s; checking again in %g s (calls needing a token wait meanwhile)",
        exc,
        RECHECK_INTERVAL,
    )


# the start-up check's policy: a store refusing us is named every RECHECK_INTERVAL, forever
RECHECK_UNTIL_USABLE = Retrying(
    retry=retry_if_exception_type(StoreUnavailable),
    wait=wait_fixed(RECHECK_INTERVAL),
    stop=stop_never,
    before_sleep=_warn,
    reraise=True,
)


def check_stores(recheck: Retrying = RECHECK_UNTIL_USABLE) -> None:
    """Check every account's token store (one per Redis) until each answers."""
    try:
        fleet = AccountClients.from_env(read_secrets=False)
    except MerchantError as exc:  # the accounts' own check stops the process and says why
        log.debug("no token store to check: %s", exc)
        return
    with fleet:  # its connections closed once checked, not kept for the worker's life
        for name, store in fleet.each_store():  # one store at a time, none kept
            _check_until_usable(name, store, recheck)


def _check_until_usable(name: str, store: TokenStore, recheck: Retrying) -> None:
    """``store`` checked under ``recheck``; once it answers after a warning, say so."""
    warned = False

    def attempt() -> None:
        nonlocal warned
        try:
            check_store(store)
        except StoreUnavailable:
            warned = True
            raise

    recheck(attempt)
    if warned:
        log.warning("merchant-tasks: the token store of account %s answers again", name)


def start_store_check(**_: Any) -> threading.Thread:
    """``check_stores`` in a daemon thread (a Celery signal handler)."""
    thread = threading.Thread(target=check_stores, name="merchant-store-check", daemon=True)
    thread.start()
    return thread
