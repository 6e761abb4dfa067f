"""The API client: business calls with the fleet's token, retried the way HTTP allows.

- 401s have one owner, a plain loop as in google-auth's ``AuthorizedSession.request``:
  send; on 401, ``renew(stale_token=...)`` and send again, at most
  ``UNAUTHORIZED_RENEWALS`` times. The token source decides whether a refused token is
  renewed (revoked) or ``TokenRejected`` (never accepted), see docs/design.md,
  "Refusals: evidence, not timers";
- connection failures, 429, 502, 503 and 504 back off exponentially with jitter
  (tenacity), honouring Retry-After, bounded in attempts and in total time. A method
  that is not idempotent is retried only when the server surely did not process the
  request: the connection was never made, or the answer was 429 or 503 (refused before
  processing).

The client needs only a ``TokenSource``; ``TokenManager`` is the fleet's, wired to its
account's settings by ``accounts.client_for``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import quote, unquote, urlsplit

import requests
from requests.adapters import HTTPAdapter
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    wait_exception,
    wait_random_exponential,
)
from urllib3.exceptions import NewConnectionError

from merchant_tasks import telemetry
from merchant_tasks.api.exchange import TOKEN_PATH, error_code, parse_retry_after
from merchant_tasks.exceptions import (
    ApiError,
    ApiOutcomeUnknown,
    ApiUnavailable,
    MalformedApiResponse,
    TokenRejected,
)
from merchant_tasks.settings import DEFAULT_TIMEOUTS, Secret
from merchant_tasks.token import Token

log = logging.getLogger(__name__)

API_PREFIX = "/open-api/v1/"
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})  # RFC 9110 9.2.2
IDEMPOTENCY_HEADER = "Idempotency-Key"  # the header most payment APIs read (IETF draft name):
# a request carrying one may be sent again whatever its method, the server answers it once
SAFE_TO_RESEND_STATUSES = frozenset({429, 503})  # the server refused before processing
TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})
CALL_ATTEMPTS = 4  # one call plus three retries, then the caller (or Celery) decides
UNAUTHORIZED_RENEWALS = 2  # renewals after a 401 within one call: the first may give a token
# another process renewed just before a revocation; fleet-wide, the token source spaces
# forced renewals
CALL_RETRY_BUDGET = 20.0  # seconds of back-off at most inside one call
CALL_WAIT_INITIAL = 0.25  # first back-off; doubles per attempt, with jitter
CALL_WAIT_MAX = 5.0
EXCERPT_LENGTH = 200  # characters of an error body kept in ApiError
EXCERPT_SCAN = 64 * 1024  # characters searched for the token before the excerpt is cut
POOL_SIZE = 32  # connections kept per host, for threaded callers
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})  # the
# client signs each call with the fleet's token; a caller's own credentials would speak for
# it (and a 401 on them would be taken for the token's refusal)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 5.1: a token, no blanks


class _Unauthorized(Exception):
    """Internal: a call got 401 with ``token``."""

    def __init__(self, token: Token) -> None:
        super().__init__("HTTP 401")
        self.token = token


@dataclass(eq=False)  # compared and hashed by identity, as exceptions are
class _Transient(Exception):
    """Internal: a failure worth retrying (within what the method allows)."""

    reason: str
    resendable: bool  # idempotent method, or surely not processed
    status: int | None = None
    excerpt: str = ""
    retry_after: float | None = None

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class _Call:
    """What the caller asked for, sent again as it was after a 401 or a transient failure."""

    method: str
    path: str
    json: Any
    params: Mapping[str, Any] | None
    headers: Mapping[str, str] | None
    span: telemetry.Recorder = telemetry.NO_SPAN  # its ``merchant_tasks.request`` span

    @property
    def resendable(self) -> bool:
        """Whether sending it twice does no more than sending it once (RFC 9110 9.2.2, or
        an idempotency key the server answers once)."""
        return self.method in IDEMPOTENT_METHODS or any(
            name.lower() == IDEMPOTENCY_HEADER.lower() for name in self.headers or {}
        )


class TokenSource(Protocol):
    """Where the client gets its token, and tells what the API made of it."""

    def token(self) -> Token: ...

    def renew(self, force: bool = False, stale_token: Token | None = None) -> Token: ...

    def accepted(self, token: Token) -> None: ...


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
        self._retry_transient = Retrying(
            retry=retry_if_exception(lambda exc: isinstance(exc, _Transient) and exc.resendable),
            wait=wait_random_exponential(multiplier=CALL_WAIT_INITIAL, max=CALL_WAIT_MAX)
            + wait_exception(_retry_after),
            stop=stop_after_attempt(CALL_ATTEMPTS) | stop_before_delay(CALL_RETRY_BUDGET),
            retry_error_callback=_gave_up,
            sleep=sleep,
        )

    def __repr__(self) -> str:
        return f"MerchantClient(base_url={self.base_url!r})"

    def request(
        self,
        method: str,
        path: str,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """Call ``method path`` and return the decoded JSON body (None when empty).

        Raises:
            ValueError: the path is outside ``/open-api/v1``, or a header would carry
                credentials (Authorization, however spelt) or is not a header name.
            TokenRejected: the API refuses tokens renewing cannot mend (never accepted,
                refused again after renewals, or revoked over and over).
            ApiUnavailable: 429/5xx/connection failures outlasted the retries.
            ApiError: any other error status.
            TokenExchangeError, StoreUnavailable: no token could be had.
        """
        method = method.upper()
        _check_path(path)
        _check_headers(headers)
        with telemetry.request_span(method, path, self.account) as span:
            try:
                answer = self._request(_Call(method, path, json, params, headers, span))
            except Exception as exc:
                telemetry.count_call(self.account, type(exc).__name__)
                raise
            telemetry.count_call(self.account, "ok")
            return answer

    def _request(self, call: _Call) -> Any:
        try:
            # the usual case, kept free of the retry machinery's cost
            return self._send(self.manager.token(), call)
        except (_Unauthorized, _Transient) as exc:
            first_failure: list[_Unauthorized | _Transient] = [exc]

        def attempt() -> Any:
            refused = None
            if first_failure:  # the call already made is the transient policy's attempt 1
                failure = first_failure.pop()
                if isinstance(failure, _Transient):
                    raise failure
                refused = failure
            return self._send_renewing(refused, call)

        try:
            return self._retry_transient(attempt)
        except _Transient as exc:  # not resendable: report it as it came, never resent
            raise ApiOutcomeUnknown(
                f"{call.method} {call.path} failed ({exc}); "
                "not retried: the server may have processed it",
                status=exc.status,
                excerpt=exc.excerpt,
                retry_after=exc.retry_after,
            ) from None

    def _send_renewing(self, refused: _Unauthorized | None, call: _Call) -> Any:
        """Send; on 401, renew the refused token and send again, a bounded number of times."""
        token = self.manager.token() if refused is None else refused.token
        renewals = 0
        while True:
            if refused is not None:
                if renewals == UNAUTHORIZED_RENEWALS:
                    raise TokenRejected.after_renewals(renewals)
                renewals += 1
                log.info("call got 401 with token %s; renewing", refused.token.fingerprint)
                token = self.manager.renew(stale_token=refused.token)
            try:
                return self._send(token, call)
            except _Unauthorized as exc:
                refused = exc

    def _send(self, token: Token, call: _Call) -> Any:
        method, path = call.method, call.path
        all_headers = {"accept": "application/json", **(call.headers or {})}
        all_headers["authorization"] = f"Bearer {token.value}"
        call.span.count(telemetry.ATTEMPTS)
        try:
            response = self.session.request(
                method,
                self.base_url + path,
                json=call.json,
                params=call.params,
                headers=all_headers,
                timeout=self.timeout,
                allow_redirects=False,  # a redirect would carry the token elsewhere
            )
        except requests.ConnectionError as exc:
            never_sent = isinstance(exc, requests.ConnectTimeout) or _connection_refused(exc)
            raise _Transient(
                f"connection to {_host(self.base_url)} failed: {type(exc).__name__}",
                resendable=never_sent or call.resendable,
            ) from None
        except requests.Timeout:
            raise _Transient(
                f"timed out waiting for {_host(self.base_url)}",
                resendable=call.resendable,
            ) from None
        status = response.status_code
        log.debug("%s %s answered %d", method, path, status)
        call.span.set(telemetry.HTTP_STATUS, status)
        if 200 <= status < 300:
            self.manager.accepted(token)
            return _decode(response, method, path)
        if status == 401 and _signed_with(response, token):
            call.span.count(telemetry.UNAUTHORIZED)
            raise _Unauthorized(token)
        hidden = {token.value: "<token>"}
        if self.secret is not None:
            hidden[self.secret.reveal()] = "<secret>"
        excerpt = _excerpt(response, hidden)
        if status in TRANSIENT_STATUSES:
            raise _Transient(
                f"HTTP {status}",
                status=status,
                excerpt=excerpt,
                retry_after=parse_retry_after(response.headers.get("Retry-After")),
                resendable=status in SAFE_TO_RESEND_STATUSES or call.resendable,
            )
        found = error_code(response, *hidden)
        raise ApiError(
            f"{method} {path} failed with HTTP {status}{f' ({found[1]})' if found else ''}",
            status=status,
            code=found[1] if found else None,
            excerpt=excerpt,
        )


def new_session() -> requests.Session:
    """A session with a connection pool sized for threaded callers."""
    session = requests.Session()
    adapter = HTTPAdapter(pool_connections=4, pool_maxsize=POOL_SIZE)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def _check_path(path: str) -> None:
    """Refuse anything that could send the token outside /open-api/v1 or to the token path.

    Dot segments and empty segments are refused rather than resolved: HTTP libraries
    normalise them, so ``/open-api/v1/..`` would leave the API's root. Their percent-encoded
    forms (``%2e%2e``, also encoded more than once) and encoded slashes or backslashes are
    refused too: RFC 3986 makes ``%2e`` equal to ``.``, and servers and proxies decode them.
    So are segments some servers read as dot segments (``..;``, see ``_dot_like``).
    """
    route = path.split("?", 1)[0]
    segments = [_fully_decoded(s) for s in route[len(API_PREFIX) :].split("/")]
    if (
        not route.startswith(API_PREFIX)
        or "#" in path
        or "\\" in route
        or any(_dot_like(segment) or "/" in segment or "\\" in segment for segment in segments)
        or "" in segments[:-1]
    ):
        raise ValueError(f"path must be under {API_PREFIX} (got {path[:80]!r})")
    names = [segment.split(";", 1)[0] for segment in segments]  # as servers that drop ;params
    if (API_PREFIX + "/".join(names)).rstrip("/").lower() == TOKEN_PATH:
        raise ValueError("the token endpoint is called by the exchange, not by request()")


def _check_headers(headers: Mapping[str, str] | None) -> None:
    """Refuse, before anything is sent, a header name that is not one (blanks around it
    included: ``"Authorization "``) and any that would carry credentials, compared after
    stripping and case-folding."""
    for name in headers or {}:
        if not isinstance(name, str):
            raise ValueError(f"not a header name: a {type(name).__name__}")
        if name.strip().casefold() in CREDENTIAL_HEADERS:
            raise ValueError(
                f"header {name.strip()!r}: credentials (Authorization, Proxy-Authorization, "
                "Cookie) are set by the client from the account's shared token"
            )
        if not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"not a header name: {name[:40]!r}")


def _signed_with(response: requests.Response, token: Token) -> bool:
    """Whether the request that got ``response`` carried ``token`` and no other credentials
    (a session's own auth or hooks could replace them): only then is a 401 the token's."""
    if response.request is None:  # a transport that keeps no request: as it was given
        return True
    return response.request.headers.get("Authorization") == f"Bearer {token.value}"


def _dot_like(segment: str) -> bool:
    """``.`` or ``..``, or what some server reads as one: with path parameters (``..;x``,
    Tomcat and Spring drop them), with trailing blanks, or any run of dots only."""
    name = segment.split(";", 1)[0].strip()
    return bool(name) and set(name) == {"."}


def _fully_decoded(segment: str) -> str:
    """A path segment percent-decoded until nothing changes (double encoding included)."""
    decoded = unquote(segment)
    while decoded != segment:
        segment, decoded = decoded, unquote(decoded)
    return decoded


def _host(url: str) -> str:
    """host[:port] of a URL, never the user or password it may carry."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)


def _decode(response: requests.Response, method: str, path: str) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
        raise MalformedApiResponse(
            f"{method} {path} answered HTTP {response.status_code} with a body that is not JSON",
            status=response.status_code,
        ) from None


def _excerpt(response: requests.Response, hidden: Mapping[str, str]) -> str:
    """The start of an error body, each ``hidden`` value (the token, the secret) replaced by
    its placeholder before anything is cut: as sent, and as a server may echo it, escaped
    for JSON (``\\/``) or percent-encoded."""
    text = response.text[:EXCERPT_SCAN]
    for value, placeholder in hidden.items():
        for form in {value, value.replace("/", "\\/"), quote(value, safe="")}:
            text = text.replace(form, placeholder)
    return " ".join(text.split())[:EXCERPT_LENGTH]


def _retry_after(exc: BaseException) -> float:
    return getattr(exc, "retry_after", None) or 0.0


def _connection_refused(exc: requests.ConnectionError) -> bool:
    """Whether the connection was never established (so nothing was sent)."""
    reason = getattr(exc.args[0], "reason", None) if exc.args else None
    return isinstance(reason, NewConnectionError)


def _gave_up(state: RetryCallState) -> Any:
    assert state.outcome is not None
    last = state.outcome.exception()
    assert isinstance(last, _Transient)
    raise ApiUnavailable(
        f"gave up after {state.attempt_number} attempts in {state.seconds_since_start:.1f} s "
        f"({last})",
        status=last.status,
        excerpt=last.excerpt,
        retry_after=last.retry_after,
    )
