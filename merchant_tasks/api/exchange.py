"""The token exchange: the one place that talks to the token endpoint.

It sends the client-credentials request and sorts every answer into the error tree of
``exceptions``. Neither the secret nor the request body ever reaches an error or a log:
errors carry status codes and the short error code the server gave, nothing else.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3 import HTTPConnectionPool, HTTPResponse, HTTPSConnectionPool
from urllib3.exceptions import HTTPError

from merchant_tasks import telemetry
from merchant_tasks.exceptions import (
    CredentialsRejected,
    ExchangeRateLimited,
    MalformedTokenResponse,
    MerchantError,
    TokenEndpointUnavailable,
    WrongBaseUrl,
)
from merchant_tasks.settings import DEFAULT_TIMEOUTS, TOKEN_LIFETIME, Secret, Settings
from merchant_tasks.token import IssuedToken, fingerprint

if TYPE_CHECKING:
    from urllib3._base_connection import BaseHTTPConnection

log = logging.getLogger(__name__)

TOKEN_PATH = "/open-api/v1/auth/access_token"
GRANT_TYPE = "client_credential"
MAX_RETRY_AFTER = 3600.0  # a Retry-After beyond an hour is a server bug; do not obey it blindly
# RFC 6750's b64token: what can be sent in an Authorization header as it is
_BEARER_TOKEN = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
MAX_TOKEN_LIFETIME = 30 * 86400.0  # the longest lifetime trusted: a longer one is capped to
# it (a unit mix-up, ms?, or a generous server), with a warning, and renewed on our schedule
_ERROR_CODE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")  # only short identifiers are quoted back
MAX_TOKEN_LENGTH = 8 * 1024  # a longer access_token is not a bearer token we can send
TOKEN_BODY_LIMIT = 64 * 1024  # a token response is read up to this much, no further
ERROR_BODY_LIMIT = 4 * 1024  # an error body: enough for its error code and an excerpt
_READ_CHUNK = 16 * 1024
_RECUT_INTERVAL = 0.05  # after the deadline, a connection made late is cut within this


class Answered(Protocol):
    """What ``classify`` reads of an answer: a ``requests.Response`` or an ``Answer``."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    def json(self) -> Any: ...


@dataclass(frozen=True)
class Answer:
    """The token endpoint's answer, read whole within the exchange's deadline."""

    status_code: int
    headers: Mapping[str, str]
    body: bytes = field(repr=False)

    def json(self) -> Any:
        return json.loads(self.body)


class ExchangeRequest:
    """What every token exchange sends and how it reads the answer, whatever HTTP client
    sends it (``TokenExchange``: requests; ``api.async_client.AsyncTokenExchange``: httpx)."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        secret: Secret,
        *,
        timeout: tuple[float, float] = DEFAULT_TIMEOUTS,
        default_lifetime: float = TOKEN_LIFETIME,
    ) -> None:
        self.url = base_url.rstrip("/") + TOKEN_PATH
        self.api_key = api_key
        self.secret = secret
        self.timeout = timeout
        self.default_lifetime = default_lifetime

    @classmethod
    def from_settings(cls: type[E], settings: Settings, **options: Any) -> E:
        return cls(
            settings.base_url,
            settings.api_key,
            settings.secret,
            timeout=(settings.connect_timeout, settings.read_timeout),
            default_lifetime=settings.token_lifetime,
            **options,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, api_key={self.api_key!r})"

    @property
    def deadline(self) -> float:
        """Seconds one exchange may take in all, whatever the server does byte by byte
        (HTTP clients bound each read only)."""
        return self.timeout[0] + self.timeout[1]

    @property
    def server(self) -> str:
        """The token endpoint's host, in its spans."""
        return urlsplit(self.url).hostname or ""

    @property
    def endpoint(self) -> str:
        """A fingerprint of the token endpoint: kept with each token it issues, the evidence
        that an answer no token endpoint gives from it is an outage (``renewal.life``)."""
        return fingerprint(self.url)

    def body(self, secret: str) -> dict[str, str]:
        """The request's JSON body (``secret``: the secret now)."""
        return {"grant_type": GRANT_TYPE, "appid": self.api_key, "secret": secret}

    def answered(self, answer: Answer, secret: str, started: float) -> IssuedToken:
        """The token in ``answer``, or the error it means (``classify``)."""
        log.debug(
            "token exchange for %s answered %s in %.3f s",
            self.api_key,
            answer.status_code,
            time.monotonic() - started,
        )
        return classify(answer, self.default_lifetime, secret=secret, url=self.url)

    @contextlib.contextmanager
    def recorded(self) -> Iterator[Callable[[IssuedToken], IssuedToken]]:
        """One exchange's span: the HTTP status of the token it gives (through what this
        yields) or of the error that ends it is set on it."""
        with telemetry.exchange_span(self.server) as span:

            def issued(token: IssuedToken) -> IssuedToken:
                span.set(telemetry.HTTP_STATUS, token.status)
                return token

            try:
                yield issued
            except MerchantError as exc:
                if exc.status is not None:
                    span.set(telemetry.HTTP_STATUS, exc.status)
                raise

    def unavailable(self, reason: str) -> TokenEndpointUnavailable:
        """The error of an exchange that broke off, for ``reason``."""
        return TokenEndpointUnavailable(f"token endpoint {self.url} {reason}")

    @property
    def cut_off(self) -> str:
        return f"did not finish its answer within {self.deadline:g} s"


E = TypeVar("E", bound=ExchangeRequest)


class TokenExchange(ExchangeRequest):
    """Exchanges the API key and secret for a token at ``base_url``, with requests.

    Its own session (``exchange_session``) ends every exchange at its deadline; an injected
    ``session`` (a test's fake transport) is cut there once its answer's headers are in.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        secret: Secret,
        *,
        session: requests.Session | None = None,
        timeout: tuple[float, float] = DEFAULT_TIMEOUTS,
        default_lifetime: float = TOKEN_LIFETIME,
    ) -> None:
        super().__init__(
            base_url, api_key, secret, timeout=timeout, default_lifetime=default_lifetime
        )
        self.session = session or exchange_session()

    def __call__(self) -> IssuedToken:
        """Make one exchange, in its own span; raise a ``TokenExchangeError`` subclass (or
        ``WrongBaseUrl``) on any failure."""
        with self.recorded() as issued:
            return issued(self._exchange())

    def _exchange(self) -> IssuedToken:
        secret = self.secret.reveal()
        started = time.monotonic()
        with _Cutoff(self.deadline) as cutoff:
            try:
                answer = self._send(self.body(secret))
            except (requests.RequestException, HTTPError, OSError) as exc:
                raise self._failure(exc, cutoff.passed) from None
        if cutoff.passed:  # the socket was shut mid-answer: what came may be cut short
            raise self._failure(None, passed=True)
        return self.answered(answer, secret, started)

    def _send(self, body: Mapping[str, str]) -> Answer:
        """Post the request and read the answer, up to its size limit."""
        response = self.session.post(
            self.url,
            json=body,
            headers={"accept": "application/json"},
            timeout=self.timeout,
            allow_redirects=False,  # a redirect would resend the secret elsewhere
            stream=True,  # the body is read below, up to its limit
        )
        if isinstance(response.raw, HTTPResponse) and response.raw.connection is not None:
            _shown(response.raw.connection)  # an injected session's pools show nothing
        with response:  # closed, not returned to the pool, if not read to the end
            limit = TOKEN_BODY_LIMIT if 200 <= response.status_code < 300 else ERROR_BODY_LIMIT
            return Answer(response.status_code, response.headers, _read_body(response, limit))

    def _failure(self, exc: Exception | None, passed: bool) -> TokenEndpointUnavailable:
        """The error for an exchange that broke off; ``passed``: its deadline cut it."""
        if passed:
            reason = self.cut_off
        elif isinstance(exc, requests.Timeout):
            reason = f"timed out (timeouts {self.timeout})"
        elif isinstance(exc, requests.RequestException):
            reason = f"unreachable ({type(exc).__name__})"
        else:  # urllib3 or the socket, reading the body
            reason = f"broke off its answer ({type(exc).__name__})"
        return self.unavailable(reason)


def _read_body(response: requests.Response, limit: int) -> bytes:
    """The body, up to ``limit`` bytes (one more if longer)."""
    raw = response.raw
    if not isinstance(raw, HTTPResponse):  # a transport that read the body already
        return response.content[: limit + 1]
    body = bytearray()
    while len(body) <= limit:
        chunk = raw.read1(min(_READ_CHUNK, limit + 1 - len(body)))
        if not chunk:
            break
        body += chunk
    return bytes(body)


def exchange_session() -> requests.Session:
    """The exchange's own session: every exchange made through it ends at its deadline."""
    session = requests.Session()
    adapter = _DeadlineAdapter()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


_exchanging = threading.local()  # the ``_Cutoff`` of the exchange this thread is making


class _Cutoff:
    """Shuts the exchange's connection down at its deadline, so that whatever read it is
    waiting in ends then, status line and headers included: ``requests`` and urllib3 bound
    each socket read only, so a server sending one byte per read timeout is never cut."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.connection: BaseHTTPConnection | None = None  # shown by the pool, see _shown
        self.passed = False  # the deadline came before the exchange ended
        self._ended = threading.Event()

    def __enter__(self) -> _Cutoff:
        _exchanging.cutoff = self
        threading.Thread(target=self._watch, name="exchange-deadline", daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        _exchanging.cutoff = None
        self._ended.set()

    def _watch(self) -> None:
        if self._ended.wait(self.seconds):
            return
        self.passed = True  # before the cut: the exchange reads it once its read ends
        while True:  # until the exchange ends: a connection still being opened is cut too
            sock = getattr(self.connection, "sock", None)
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):  # closed meanwhile: nothing left to cut
                    # the plain socket's shutdown, also under TLS: no close_notify to send
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
            if self._ended.wait(_RECUT_INTERVAL):
                return


def _shown(connection: BaseHTTPConnection) -> BaseHTTPConnection:
    """Show the connection a pool lends to this thread to the exchange it is making."""
    cutoff: _Cutoff | None = getattr(_exchanging, "cutoff", None)
    if cutoff is not None:
        cutoff.connection = connection
    return connection


class _CutoffHTTPPool(HTTPConnectionPool):
    """Shows each exchange its connection, and keeps none open between exchanges (they
    are minutes apart, and nobody closes the exchange's session)."""

    def _get_conn(self, timeout: float | None = None) -> BaseHTTPConnection:
        return _shown(super()._get_conn(timeout))

    def _put_conn(self, conn: BaseHTTPConnection | None) -> None:
        if conn is not None:
            conn.close()  # the pool opens it again for the next exchange
        super()._put_conn(conn)


class _CutoffHTTPSPool(_CutoffHTTPPool, HTTPSConnectionPool):
    pass


class _DeadlineAdapter(HTTPAdapter):
    """The exchange's transport: its pools show each exchange the connection it uses."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {
            "http": _CutoffHTTPPool,
            "https": _CutoffHTTPSPool,
        }


def classify(
    response: Answered, default_lifetime: float, secret: str = "", url: str = ""
) -> IssuedToken:
    """Turn a token endpoint's answer into an ``IssuedToken`` or the matching error.

    ``secret`` is only used to make sure nothing quoted from the body contains it; ``url``
    (the token endpoint's) is named when the answer says the base URL is wrong.
    """
    status = response.status_code
    found = error_code(response, secret) if status >= 400 else None
    code = found[1] if found else None
    if status == 429:
        retry_after = retry_after_of(response)
        raise ExchangeRateLimited(
            f"token endpoint rate limited the exchange (HTTP 429{_error_code(response, secret)}); "
            f"retry after {retry_after if retry_after is not None else 'an unknown time'} s",
            status=status,
            code=code,
            retry_after=retry_after,
        )
    if status >= 500 or status == 408:
        raise TokenEndpointUnavailable(
            f"token endpoint failed (HTTP {status}{_error_code(response, secret)})",
            status=status,
            code=code,
            retry_after=retry_after_of(response),
        )
    # what no token endpoint answers: the request went to some other server or path, so
    # the base URL is wrong, whatever the key and secret (a redirect is not followed: it
    # would resend the secret elsewhere)
    redirect, html = 300 <= status < 400, _is_html(response)
    if redirect or html or status in (404, 405):
        detail = (
            " (a redirect, not followed)"
            if redirect
            else " with an HTML page"
            if html
            else " (no token endpoint there)"
        )
        raise WrongBaseUrl(
            f"{url or 'the token endpoint'} answered HTTP {status}{detail}: MERCHANT_BASE_URL "
            "does not point at the API (set it to the API's scheme://host[:port]); this says "
            "nothing of the key or secret",
            status=status,
            code=code,
        )
    if status >= 400:
        raise CredentialsRejected(
            "token endpoint refused the credentials "
            f"(HTTP {status}{_error_code(response, secret)}): "
            "check MERCHANT_API_KEY and MERCHANT_API_SECRET; the secret may have been reset "
            "in the dashboard, or the key may belong to the other environment",
            status=status,
            code=code,
        )
    return parse_token(response, default_lifetime, secret)


def _is_html(response: Answered) -> bool:
    """Whether an answer is a web page (a site or a proxy's error page), not the API's JSON."""
    if "html" in response.headers.get("Content-Type", "").lower():
        return True
    body = response.body if isinstance(response, Answer) else getattr(response, "content", b"")
    return isinstance(body, bytes) and body.lstrip()[:1] == b"<"


def parse_token(response: Answered, default_lifetime: float, secret: str = "") -> IssuedToken:
    """Find ``access_token`` (top level or under ``data``) and ``expires_in`` in a 2xx body."""
    if isinstance(response, Answer) and len(response.body) > TOKEN_BODY_LIMIT:
        raise MalformedTokenResponse(
            f"token endpoint's answer is longer than {TOKEN_BODY_LIMIT // 1024} KiB"
        )
    try:
        payload: Any = response.json()
    except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
        raise MalformedTokenResponse(
            f"token endpoint answered HTTP {response.status_code} with a body that is not JSON"
        ) from None
    if not isinstance(payload, dict):
        raise MalformedTokenResponse(
            f"token endpoint answered a JSON {type(payload).__name__}, not an object"
        )
    container = payload
    if "access_token" not in payload and isinstance(payload.get("data"), dict):
        container = payload["data"]
    value = container.get("access_token")
    if isinstance(value, str):
        value = value.strip()
    if isinstance(value, str) and len(value) > MAX_TOKEN_LENGTH:
        raise MalformedTokenResponse(
            f"token endpoint's access_token is longer than {MAX_TOKEN_LENGTH // 1024} KiB"
        )
    if not isinstance(value, str) or not _BEARER_TOKEN.fullmatch(value):
        names = sorted(str(k)[:32] for k in container if _quotable(str(k), secret))
        raise MalformedTokenResponse(
            "token endpoint answered without a usable access_token "
            f"(fields: {', '.join(names[:10]) or 'none'}){_error_code(response, secret)}"
        )
    expires_in = container.get("expires_in")
    if expires_in is None:
        lifetime = default_lifetime
    else:
        try:
            lifetime = float(expires_in)
        except (TypeError, ValueError, OverflowError):
            raise MalformedTokenResponse("token endpoint's expires_in is not a number") from None
        # 0 is a token that expires now (a server handing back its last token at the end of
        # its life), not a malformed answer: the renewal decides what it is worth
        if isinstance(expires_in, bool) or not math.isfinite(lifetime) or lifetime < 0:
            raise MalformedTokenResponse("token endpoint's expires_in is not a number >= 0")
    if lifetime > MAX_TOKEN_LIFETIME:
        # a promise we do not hold the server to: the token is renewed on our schedule
        log.warning(
            "token endpoint's expires_in (%.0f s) is beyond %.0f s: treating the token as "
            "valid for %.0f s",
            lifetime,
            MAX_TOKEN_LIFETIME,
            MAX_TOKEN_LIFETIME,
        )
        lifetime = MAX_TOKEN_LIFETIME
    return IssuedToken(value=value, expires_in=lifetime, status=response.status_code)


def parse_retry_after(header: str | None, date: str | None = None) -> float | None:
    """Seconds from a Retry-After header, capped; None if absent or unusable.

    Delta-seconds are taken as they are. An HTTP date is read against the answer's own
    ``Date`` header (``date``), the server's clock: never against this host's, which may be
    minutes off (a host behind would pause the fleet for those minutes, one ahead knock
    early). A date without the server's ``Date`` (RFC 9110 has every server with a clock
    send one with a 4xx) is unusable: the caller's own back-off applies.
    """
    if not header:
        return None
    header = header.strip()
    try:
        seconds = float(header)
    except ValueError:
        when, now = _http_date(header), _http_date(date)
        if when is None or now is None:
            return None
        seconds = when - now
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


def retry_after_of(response: Answered) -> float | None:
    """An answer's Retry-After, in seconds (``parse_retry_after``, against its ``Date``)."""
    headers = response.headers
    return parse_retry_after(headers.get("Retry-After"), headers.get("Date"))


def _http_date(text: str | None) -> float | None:
    """An HTTP date as a timestamp, or None."""
    if not text:
        return None
    try:
        return email.utils.parsedate_to_datetime(text.strip()).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def _quotable(text: str, *hidden: str) -> bool:
    """Whether a piece of a response may appear in an error: a short identifier holding
    none of ``hidden`` (the secret, the token)."""
    return bool(_ERROR_CODE.match(text)) and not any(value and value in text for value in hidden)


def _error_code(response: Answered, secret: str) -> str:
    """``, key=code`` for a message when the body has a quotable error code, else ``""``."""
    found = error_code(response, secret)
    return f", {found[0]}={found[1]}" if found else ""


def error_code(response: Answered, *hidden: str) -> tuple[str, str] | None:
    """The server's short error code (field name and value), if its body has a plain one.

    Free text from the body is never quoted: it could echo what we sent.
    """
    try:
        payload = response.json()
    except (ValueError, RecursionError):
        return None
    if not isinstance(payload, dict):
        return None
    for key in ("error", "code", "errcode", "error_code"):
        value = payload.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            text = str(value)
            if _quotable(text, *hidden):
                return key, text
    return None
