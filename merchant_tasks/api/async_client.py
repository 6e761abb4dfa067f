"""The API for asyncio callers, over httpx (the ``asyncio`` extra): the token exchange and
``AsyncMerchantClient``.

Neither decides anything the blocking client does not: the exchange sends the same request
and reads the answer with the same rules (``api.exchange``), the client drives the same
send loop (``api.calls``) and its token source's steps with the asyncio driver
(``renewal.async_manager``). No thread per call; the secret file is read off the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from merchant_tasks.api.calls import (
    Call,
    Reveal,
    Send,
    TokenFlows,
    TransportFailure,
    call,
    with_idempotency_key,
)
from merchant_tasks.api.exchange import (
    ERROR_BODY_LIMIT,
    TOKEN_BODY_LIMIT,
    Answer,
    ExchangeRequest,
)
from merchant_tasks.extras import require
from merchant_tasks.flows import Flow, Sleep, drive_async
from merchant_tasks.settings import DEFAULT_TIMEOUTS, TOKEN_LIFETIME, Secret
from merchant_tasks.token import IssuedToken, Token

require("asyncio", "the asyncio client (merchant_tasks.api.async_client)")

import httpx  # noqa: E402

POOL_SIZE = 100  # connections kept per host: an event loop's concurrent calls share them
SECRET_READERS = 2  # threads that read secret files, the package's own: never queued behind
# the event loop's default executor (the application's work, sends waiting on a broker)
_readers: list[ThreadPoolExecutor] = []
_readers_made = threading.Lock()


@functools.cache
def tls() -> ssl.SSLContext:
    """The TLS settings every httpx client of the package shares (httpx's defaults,
    SSL_CERT_FILE included): loading the CA certificates took ~33 ms per client, on the
    event loop at an account's first use, twice per account; once per process now."""
    return httpx.create_ssl_context()


async def reveal(secret: Secret) -> str:
    """``secret``'s value, read off the event loop (it may come from a file, re-read at
    each use so that a rotation needs no restart)."""
    with _readers_made:
        if not _readers:
            _readers.append(
                ThreadPoolExecutor(SECRET_READERS, thread_name_prefix="merchant-secret")
            )
    return await asyncio.get_running_loop().run_in_executor(_readers[0], secret.reveal)


class AsyncTokenExchange(ExchangeRequest):
    """``TokenExchange`` for asyncio: the same request, the same answer's rules, the whole
    exchange ended at its deadline (``asyncio.timeout``)."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        secret: Secret,
        *,
        client: httpx.AsyncClient | None = None,
        timeout: tuple[float, float] = DEFAULT_TIMEOUTS,
        default_lifetime: float = TOKEN_LIFETIME,
    ) -> None:
        super().__init__(
            base_url, api_key, secret, timeout=timeout, default_lifetime=default_lifetime
        )
        connect, read = timeout
        self.client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(read, connect=connect),
            limits=httpx.Limits(max_keepalive_connections=0),  # exchanges are minutes apart
            follow_redirects=False,  # a redirect would resend the secret elsewhere
            verify=tls(),
        )

    async def __call__(self) -> IssuedToken:
        """``TokenExchange.__call__``, awaited."""
        with self.recorded() as issued:
            return issued(await self._exchange())

    async def credentials(self) -> str:
        """The secret, read off the event loop (it may come from a file, re-read at each
        exchange so that a rotation needs no restart)."""
        return await reveal(self.secret)

    async def _exchange(self) -> IssuedToken:
        secret = await self.credentials()
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.deadline):
                answer = await self._send(self.body(secret))
        except TimeoutError:
            raise self.unavailable(self.cut_off) from None
        except httpx.TimeoutException:
            raise self.unavailable(f"timed out (timeouts {self.timeout})") from None
        except httpx.TransportError as exc:
            reason = "unreachable" if isinstance(exc, httpx.ConnectError) else "broke off"
            raise self.unavailable(f"{reason} ({type(exc).__name__})") from None
        return self.answered(answer, secret, started)

    async def _send(self, body: Mapping[str, str]) -> Answer:
        """Post the request and read the answer, up to its size limit."""
        headers = {"accept": "application/json"}
        async with self.client.stream("POST", self.url, json=body, headers=headers) as response:
            limit = TOKEN_BODY_LIMIT if 200 <= response.status_code < 300 else ERROR_BODY_LIMIT
            read = bytearray()
            async for chunk in response.aiter_raw():
                read += chunk
                if len(read) > limit:
                    break
            return Answer(response.status_code, response.headers, bytes(read[: limit + 1]))

    async def aclose(self) -> None:
        await self.client.aclose()


class AsyncMerchantClient:
    """``MerchantClient`` for asyncio: calls the merchant API under ``/open-api/v1`` with the
    account's shared token, ``await client.request(...)``; the same errors."""

    def __init__(
        self,
        base_url: str,
        manager: Any,
        *,
        http: httpx.AsyncClient | None = None,
        timeout: tuple[float, float] = DEFAULT_TIMEOUTS,
        account: str = "",
        secret: Secret | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.account = account
        self.secret = secret
        self.manager = manager  # ``renewal.async_manager.AsyncTokenManager``
        self._flows: TokenFlows = manager.life
        connect, read = timeout
        self.http = http or httpx.AsyncClient(
            timeout=httpx.Timeout(read, connect=connect),
            limits=httpx.Limits(max_connections=POOL_SIZE, max_keepalive_connections=POOL_SIZE),
            follow_redirects=False,  # a redirect would carry the token elsewhere
            verify=tls(),
        )

    def __repr__(self) -> str:
        return f"AsyncMerchantClient(base_url={self.base_url!r})"

    async def request(
        self,
        method: str,
        path: str,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> Any:
        """Call ``method path`` and return the decoded JSON body (None when empty); raises
        as ``MerchantClient.request`` does. ``idempotency_key`` is sent as
        ``Idempotency-Key`` (a call carrying one may be sent again, whatever its method)."""
        headers = with_idempotency_key(headers, idempotency_key)
        with Call(method, path, json, params, headers).recorded(self.account) as the_call:
            return await self.run(call(self._flows, the_call, self.secret), the_call)

    async def run(self, flow: Flow[Any], the_call: Call) -> Any:
        """Drive ``flow``: ``Send`` with httpx, the rest with the token source's driver."""

        async def perform(step: Any) -> Any:
            if isinstance(step, Send):
                return await self._send(step.token, the_call)
            if isinstance(step, Sleep):
                return await asyncio.sleep(step.seconds)
            if isinstance(step, Reveal):  # off the event loop: it may read a file
                return await reveal(self.secret) if self.secret else None
            return await self.manager.perform(step)

        return await drive_async(flow, perform)

    async def _send(self, token: Token, the_call: Call) -> httpx.Response:
        try:
            return await self.http.request(**the_call.request_arguments(self.base_url, token))
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise TransportFailure.connecting(self.base_url, exc, never_sent=True) from None
        except httpx.TimeoutException:
            raise TransportFailure.timed_out(self.base_url) from None
        except httpx.TransportError as exc:
            raise TransportFailure.connecting(self.base_url, exc, never_sent=False) from None

    async def aclose(self) -> None:
        """Close the HTTP client (its pooled connections) and what the token source runs
        (heartbeats, the exchange's client)."""
        await self.http.aclose()
        close = getattr(self.manager, "aclose", None)
        if close is not None:
            await close()
