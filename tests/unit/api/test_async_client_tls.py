"""api/async_client.py without a server: what building the asyncio clients costs."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from merchant_tasks.aio import AsyncAccountClients
from merchant_tasks.api import async_client
from merchant_tasks.settings import FleetSettings, Secret, Settings


def test_the_clients_of_many_accounts_load_the_ca_certificates_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each account's first use builds two httpx clients on the event loop; loading the CA
    certificates for each took ~33 ms there. They share one TLS context, made once."""
    made: list[Any] = []
    create = httpx.create_ssl_context

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return create(*args, **kwargs)

    monkeypatch.setattr(httpx, "create_ssl_context", counted)
    async_client.tls.cache_clear()
    fleet = FleetSettings(redis_url="redis://127.0.0.1:6379/0", key_prefix="tls-once")
    accounts = {
        f"shop-{n}": Settings(
            api_key=f"key-{n}",
            secret=Secret(value="unused"),
            base_url="https://api.example.com",
            fleet=fleet,
        )
        for n in range(20)
    }

    async def build() -> list[Any]:
        clients = AsyncAccountClients(accounts)
        try:
            built = [clients.get(name) for name in accounts]
            return [c.http for c in built] + [c.manager.exchange.client for c in built]
        finally:
            await clients.aclose()

    https = asyncio.run(build())
    assert len(https) == 40
    assert len(made) == 1
    async_client.tls.cache_clear()
