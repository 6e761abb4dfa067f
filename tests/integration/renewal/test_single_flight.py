"""Single flight against a token endpoint that drips its answer, on real Redis: the holder's
exchange ends at its deadline while its heartbeat keeps the lock, so no second one starts
meanwhile."""

from __future__ import annotations

import threading

import pytest

from merchant_tasks.api.exchange import TokenExchange
from merchant_tasks.exceptions import MerchantError
from merchant_tasks.renewal.life import LOCAL_COPY_TTL
from merchant_tasks.settings import Secret
from merchant_tasks.store.token_store import TokenStore
from support.account import TEST_API_KEY, TEST_SECRET
from support.drip_server import DRIP_TIMEOUT, DripServer
from support.renewal import make_manager

pytestmark = pytest.mark.integration


def test_a_dripping_endpoint_never_has_two_exchanges_in_flight(
    dripping: DripServer, redis_store: TokenStore
) -> None:
    """Four threads need a token at once; the holder's exchange ends at its deadline, its
    heartbeat keeping the lock meanwhile, so no other process or thread starts a second one."""
    exchange = TokenExchange(dripping.url, TEST_API_KEY, Secret(TEST_SECRET), timeout=DRIP_TIMEOUT)
    manager = make_manager(
        redis_store, exchange, exchange_timeout=exchange.deadline, local_copy_ttl=LOCAL_COPY_TTL
    )
    errors: list[str] = []

    def call() -> None:
        try:
            manager.token()
        except MerchantError as exc:
            errors.append(type(exc).__name__)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120.0)
    assert dripping.most_in_flight == 1
    assert dripping.finished == 0
    assert set(errors) <= {"TokenEndpointUnavailable", "RenewalTimeout"}, errors
