"""The API client over requests: ``MerchantClient`` drives the send loop (``api.calls``)
with a ``requests.Session``, and its token source's steps with the source's own driver.

The client needs only a ``TokenSource``; ``TokenManager`` is the fleet's, wired to its
account's settings by ``accounts.client_for``: its flows (``renewal.life``) then run inside
the call's, so a 401 is judged with its route. A source of one's own (``token``, ``renew``,
``accepted``) works too, without routes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import NewConnectionError

from merchant_tasks.api.calls import (
    CALL_ATTEMPTS,
    CALL_RETRY_BUDGET,
    CALL_WAIT_INITIAL,
    CALL_WAIT_MAX,
    EXCERPT_LENGTH,
    IDEMPOTENCY_HEADER,
    UNAUTHORIZED_RENEWALS,
    Call,
    Reveal,
    Send,
    TokenFlows,
    TokenSource,
    TransportFailure,
    call,
    with_idempotency_key,
)
from merchant_tasks.flows import Clock, Flow, Moment, Sleep, drive
from merchant_tasks.settings import DEFAULT_TIMEOUTS, Secret
from merchant_tasks.token import Token

__all__ = [
    "CALL_ATTEMPTS",
    "CALL_RETRY_BUDGET",
    "CALL_WAIT_INITIAL",
    "CALL_WAIT_MAX",
    "EXCERPT_LENGTH",
    "IDEMPOTENCY_HEADER",
    "POOL_SIZE",
    "UNAUTHORIZED_RENEWALS",
    "MerchantClient",
    "TokenSource",
    "new_session",
]

POOL_SIZE = 32  # connections kept per host, for threaded callers

SourceT = TypeVar("SourceT", bound=TokenSource)


class MerchantClient(Generic[SourceT]):
    """Calls the merchant API under ``/open-api/v1`` with the account's shared token.

    Needs only a ``TokenSource``; ``accounts.FleetClient`` is the one the fleet wires up
    (``accounts.client_for``), whose source is the ``TokenManager``.
    """

    def __init__(
        self,
        base_url: str,
        manager: SourceT,
        *,
        session: requests.Session | None = None,
        timeout: tuple[float, float] = DEFAULT_TIMEOUTS,
        sleep: Callable[[float], None] = time.sleep,
        account: str = "",
        secret: Secret | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.account = account  # its name in telemetry (``accounts.client_for`` sets it)
        # never quoted from an error body, as the token is not (``accounts.client_for`` sets it)
        self.secret = secret
        self.manager = manager
        self.session = session or new_session()
        self.timeout = timeout
        self.sleep = sleep
        self._flows: TokenFlows = getattr(manager, "life", None) or _Blocking(manager)
        self._perform: Callable[[Any], Any] = getattr(manager, "perform", _clockless)

    def __repr__(self) -> str:
        return f"MerchantClient(base_url={self.base_url!r})"

    def close(self) -> None:
        """Close the HTTP session (its pooled connections) and stop what the token source
        runs beside the calls (``TokenManager.close``)."""
        self.session.close()
        close = getattr(self.manager, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> MerchantClient[SourceT]:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> Any:
        """Call ``method path`` and return the decoded JSON body (None when empty).
        ``idempotency_key`` is sent as ``Idempotency-Key`` (a call carrying one may be sent
        again, whatever its method).

        Raises:
            ValueError: the path is outside ``/open-api/v1``, or a header would carry
                credentials (Authorization, however spelt) or is not a header name.
            PathForbidden: the API refuses the account's valid token on this path only.
            TokenRejected: the API refuses tokens renewing cannot mend (never accepted,
                refused again after renewals, or revoked over and over).
            ApiUnavailable: 429/5xx/connection failures outlasted the retries.
            ApiError: any other error status.
            TokenExchangeError, StoreUnavailable: no token could be had.
        """
        headers = with_idempotency_key(headers, idempotency_key)
        with Call(method, path, json, params, headers).recorded(self.account) as the_call:
            return self.run(call(self._flows, the_call, self.secret), the_call)

    def run(self, flow: Flow[Any], the_call: Call) -> Any:
        """Drive ``flow``: ``Send`` with requests, sleeps with this client's ``sleep``, the
        rest with the token source's driver."""

        def perform(step: Any) -> Any:
            if isinstance(step, Send):
                return self._send(step.token, the_call)
            if isinstance(step, Sleep):
                return self.sleep(step.seconds)
            if isinstance(step, Reveal):
                return self.secret.reveal() if self.secret is not None else None
            return self._perform(step)

        return drive(flow, perform)

    def _send(self, token: Token, the_call: Call) -> requests.Response:
        try:
            return self.session.request(
                **the_call.request_arguments(self.base_url, token),
                timeout=self.timeout,
                allow_redirects=False,  # a redirect would carry the token elsewhere
            )
        except requests.ConnectionError as exc:
            never_sent = isinstance(exc, requests.ConnectTimeout) or _connection_refused(exc)
            raise TransportFailure.connecting(self.base_url, exc, never_sent=never_sent) from None
        except requests.Timeout:
            raise TransportFailure.timed_out(self.base_url) from None


class _Blocking:
    """A token source of one's own (``TokenSource``), as the send loop's flows: each is one
    blocking call, no step yielded."""

    def __init__(self, source: TokenSource) -> None:
        self.source = source

    def token_for(self, path: str) -> Flow[Token]:
        return self.source.token()
        yield  # a generator: the loop yields from it

    def refused(self, token: Token, path: str = "") -> Flow[Token]:
        return self.source.renew(stale_token=token)
        yield

    def accepted(self, token: Token, path: str = "") -> Flow[None]:
        self.source.accepted(token)
        yield from ()


def _clockless(step: Any) -> Any:
    """The steps a source of one's own leaves to the client: the clock (for retry budgets)."""
    if isinstance(step, Clock):
        return Moment(time.time(), time.monotonic())
    raise TypeError(f"a token source of one's own yields no {type(step).__name__} step")


def new_session() -> requests.Session:
    """A session with a connection pool sized for threaded callers."""
    session = requests.Session()
    adapter = HTTPAdapter(pool_connections=4, pool_maxsize=POOL_SIZE)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def _connection_refused(exc: requests.ConnectionError) -> bool:
    """Whether the connection was never established (so nothing was sent)."""
    reason = getattr(exc.args[0], "reason", None) if exc.args else None
    return isinstance(reason, NewConnectionError)
