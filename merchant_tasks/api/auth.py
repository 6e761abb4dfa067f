"""``MerchantAuth``: the fleet's token and 401 handling for one's own HTTP client.

An ``httpx.Auth`` (``httpx.Client`` and ``httpx.AsyncClient``) and a requests auth
(``requests.Session().auth = ...``, or ``auth=`` on a call) in one object. Each request
goes out signed with the account's shared token; a 401 to it is judged by the fleet
(``renewal.life``: revoked, or the route's) and the request is sent once more with the
replacement; whatever answer comes last is the client's to read, as any answer is. The
same send loop as the package's own clients (``api.calls.signed``), with the same guards:
a request to another host, outside ``/open-api/v1`` or to the token endpoint, or carrying
credentials of its own, is refused before it is sent (``ValueError``), never signed.

Built from the package's clients, which hold the account's token source::

    auth = MerchantAuth(client_from_env())             # httpx.Client, requests
    auth = MerchantAuth(async_client)                  # httpx.AsyncClient
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncGenerator, Generator
from typing import Any
from urllib.parse import urlsplit

import requests

from merchant_tasks import telemetry
from merchant_tasks.api.calls import Send, check_headers, check_path, signed
from merchant_tasks.extras import require
from merchant_tasks.flows import Done, run_until, run_until_async

require("asyncio", "MerchantAuth (merchant_tasks.api.auth)")

import httpx  # noqa: E402

RESENDS = 1  # a request is sent again once, with the replacement of a token refused
_OWN_CREDENTIALS = ("authorization", "proxy-authorization")  # a caller's own would speak for
# it (a session's cookies are the session's: the API's answers may set some)


class MerchantAuth(httpx.Auth):
    """Signs requests with the account's token; on a 401, sends them once more with the
    fleet's replacement. ``clients``: a blocking client (``client_from_env()``) for
    ``httpx.Client`` and requests, an asyncio one (``async_client_from_env()``'s) for
    ``httpx.AsyncClient``, or both, of one account."""

    requires_request_body = True  # a body is read before sending, so it can be sent again

    def __init__(self, *clients: Any) -> None:
        if not clients:
            raise ValueError("MerchantAuth needs the package's client of an account")
        bases = {_origin(client.base_url) for client in clients}
        if len(bases) > 1:
            raise ValueError("MerchantAuth's clients must be of one account (one base URL)")
        self.origin = bases.pop()
        self.base_url = clients[0].base_url
        self._blocking = next((c.manager for c in clients if not _asyncio(c)), None)
        self._asyncio = next((c.manager for c in clients if _asyncio(c)), None)

    def __repr__(self) -> str:
        return f"MerchantAuth(base_url={self.base_url!r})"

    # -- httpx -----------------------------------------------------------------------------

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, Any, None]:
        manager = self._manager(self._blocking, "httpx.Client")
        flow = signed(manager.life, self._checked(request), telemetry.NO_SPAN, RESENDS)
        step = run_until(flow, None, None, manager.perform, Send)
        while not isinstance(step, Done):
            request.headers["Authorization"] = f"Bearer {step.token.value}"
            response = yield request
            step = run_until(flow, response, None, manager.perform, Send)

    async def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, Any]:
        manager = self._manager(self._asyncio, "httpx.AsyncClient")
        flow = signed(manager.life, self._checked(request), telemetry.NO_SPAN, RESENDS)
        step = await run_until_async(flow, None, None, manager.perform, Send)
        while not isinstance(step, Done):
            request.headers["Authorization"] = f"Bearer {step.token.value}"
            response = yield request
            step = await run_until_async(flow, response, None, manager.perform, Send)

    # -- requests --------------------------------------------------------------------------

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        """requests' auth: sign ``request``; a 401 to it is answered by its hook."""
        manager = self._manager(self._blocking, "requests")
        path = self._checked(request)
        flow = signed(manager.life, path, telemetry.NO_SPAN, RESENDS)
        step = run_until(flow, None, None, manager.perform, Send)
        request.headers["Authorization"] = f"Bearer {step.token.value}"

        def answered(response: requests.Response, **options: Any) -> requests.Response:
            if response.is_redirect:  # requests copies this request to follow it: unsigned,
                # the token goes to no other page (requests keeps it for the same host)
                response.request.headers.pop("Authorization", None)
            step = run_until(flow, response, None, manager.perform, Send)
            if isinstance(step, Done):
                return response
            again = response.request.copy()
            again.headers["Authorization"] = f"Bearer {step.token.value}"
            response.content  # noqa: B018  # read, so its connection goes back to the pool
            response.close()
            resent = response.connection.send(again, **options)
            resent.history.append(response)
            resent.request = again
            run_until(flow, resent, None, manager.perform, Send)  # the loop's end
            return resent

        request.register_hook("response", answered)  # type: ignore[no-untyped-call]
        return request

    # -- the guards ------------------------------------------------------------------------

    def _checked(self, request: Any) -> str:
        """The request's path, once it is known to go to the account's API with no
        credentials of its own (else ValueError, before anything is sent)."""
        url = urlsplit(str(request.url))
        if _origin(str(request.url)) != self.origin:
            raise ValueError(
                f"MerchantAuth signs requests to {self.origin} only (got {url.hostname})"
            )
        check_path(url.path + (f"?{url.query}" if url.query else ""))
        own = {name: "" for name in request.headers if name.lower() in _OWN_CREDENTIALS}
        check_headers(own)  # raises, naming the header
        return url.path

    @staticmethod
    def _manager(manager: Any, used_by: str) -> Any:
        if manager is None:
            raise ValueError(
                f"this MerchantAuth has no {'asyncio' if 'Async' in used_by else 'blocking'} "
                f"client for {used_by}: build it with that kind of client too"
            )
        return manager


def _asyncio(client: Any) -> bool:
    return inspect.iscoroutinefunction(client.manager.perform)


def _origin(url: str) -> str:
    parts = urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or default}"
