"""asyncio callers (FastAPI, Starlette, aiohttp): each account's asyncio client, wired as
``accounts`` wires the blocking ones (the ``asyncio`` extra: httpx).

``async with async_client_from_env() as client: await client.request(...)`` calls the API
with the fleet's token: the same token, records, refusals, exchange rate and wake-ups as
the Celery workers and blocking clients of the account, driven on the event loop
(``renewal.async_manager``). ``AsyncAccountClients`` keeps one client per account and one Redis pool
per server, as ``AccountClients`` does. docs/asyncio.md shows them in a FastAPI service.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from merchant_tasks.accounts import (
    DEFAULT_ACCOUNT,
    Codecs,
    codec_of,
    credentials_fingerprint,
    default_name,
    load_accounts,
    renewal_terms,
    settings_of,
    stored_accounts,
)
from merchant_tasks.api.async_client import AsyncMerchantClient, AsyncTokenExchange
from merchant_tasks.api.auth import MerchantAuth
from merchant_tasks.renewal.async_manager import AsyncTokenManager
from merchant_tasks.renewal.due import namespace_of
from merchant_tasks.settings import Settings
from merchant_tasks.store.async_store import AsyncTokenStore
from merchant_tasks.store.reading import StoredAccount
from merchant_tasks.store.sealing import TokenCodec
from merchant_tasks.store.topology import AsyncStoreClient, async_redis_from_url

__all__ = ["AsyncAccountClients", "MerchantAuth", "async_client_for", "async_client_from_env"]


def async_client_for(
    settings: Settings,
    redis_client: AsyncStoreClient,
    *,
    name: str = DEFAULT_ACCOUNT,
    codec: TokenCodec | None = None,
) -> AsyncMerchantClient:
    """The asyncio client of account ``name``, its store on ``redis_client``."""
    codec = codec_of(settings.fleet) if codec is None else codec
    store = AsyncTokenStore(redis_client, namespace_of(settings), codec, account=name)
    exchange = AsyncTokenExchange.from_settings(settings)

    async def credentials() -> str:
        return credentials_fingerprint(settings, await exchange.credentials())

    terms = renewal_terms(settings, store.commands, exchange)
    manager = AsyncTokenManager(store, exchange, credentials, **terms)
    return AsyncMerchantClient(
        settings.base_url,
        manager,
        timeout=(settings.connect_timeout, settings.read_timeout),
        account=name,
        secret=settings.secret,
    )


class AsyncAccountClients:
    """This process's asyncio clients, one per account, each made on its first use (one
    httpx client each; one Redis pool per Redis server). Close them with ``aclose`` (or
    ``async with``): their HTTP connections, Redis pools and announcement tasks end."""

    def __init__(self, accounts: Mapping[str, Settings]) -> None:
        self.accounts = dict(accounts)
        self._clients: dict[str, AsyncMerchantClient] = {}
        self._redis_by_url: dict[str, AsyncStoreClient] = {}
        self._codec = Codecs()
        self._stored: dict[str, StoredAccount[AsyncStoreClient]] | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AsyncAccountClients:
        return cls(load_accounts(environ))

    def get(self, account: str | None = None) -> AsyncMerchantClient:
        """The client of ``account`` (the only or ``default`` account when None)."""
        name = account or default_name(self.accounts)
        client = self._clients.get(name)
        if client is not None:
            return client
        settings = settings_of(self.accounts, name)
        fleet = settings.fleet
        redis_client = self.redis_for(fleet.redis_url)
        client = async_client_for(settings, redis_client, name=name, codec=self._codec(fleet))
        self._clients[name] = client
        return client

    def stored_accounts(self) -> dict[str, StoredAccount[AsyncStoreClient]]:
        """Every account as ``ops.status.async_account_statuses`` reads it, on this
        process's pools (see ``AccountClients.stored_accounts``); made once."""
        if self._stored is None:
            self._stored = stored_accounts(self.accounts, self.redis_for, self._codec)
        return self._stored

    def redis_for(self, url: str) -> AsyncStoreClient:
        """This process's Redis client (one pool) for ``url``, shared by its accounts."""
        redis_client = self._redis_by_url.get(url)
        if redis_client is None:
            # the accounts of one URL share the topology variables (MERCHANT_REDIS_*)
            fleet = next(s.fleet for s in self.accounts.values() if s.fleet.redis_url == url)
            redis_client = self._redis_by_url[url] = async_redis_from_url(
                url,
                sentinel_master=fleet.redis_sentinel_master,
                sentinel_password=fleet.redis_sentinel_password,
                cluster=fleet.redis_cluster,
            )
        return redis_client

    def auth(self, account: str | None = None) -> MerchantAuth:
        """``MerchantAuth`` for one's own ``httpx.AsyncClient``, as ``account``."""
        return MerchantAuth(self.get(account))

    async def aclose(self) -> None:
        """Close every client made so far and the Redis pools (their announcement tasks
        end with their connection); a client asked for afterwards opens new ones."""
        clients, pools = list(self._clients.values()), list(self._redis_by_url.values())
        self._clients.clear()
        self._redis_by_url.clear()
        self._stored = None
        for client in clients:
            await client.aclose()
        for pool in pools:
            await pool.aclose()

    async def __aenter__(self) -> AsyncAccountClients:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()


class async_client_from_env:  # used as a function: async with ...() as client
    """The asyncio client of the only (or ``default``) account the MERCHANT_* variables and
    MERCHANT_ACCOUNTS_FILE / _SOURCE configure, as an async context manager::

        async with async_client_from_env() as client:
            payment = await client.request("POST", "/open-api/v1/payments", json={...})
    """

    def __init__(self, environ: Mapping[str, str] | None = None, account: str | None = None):
        self.clients = AsyncAccountClients.from_env(environ)
        self.account = account

    async def __aenter__(self) -> AsyncMerchantClient:
        return self.clients.get(self.account)

    async def __aexit__(self, *_: Any) -> None:
        await self.clients.aclose()
