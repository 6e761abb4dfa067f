"""A call to the merchant API as a flow: the send loop, and what each answer means.

Written once for every HTTP client (``flows``): ``MerchantClient`` drives it with requests,
``api.async_client.AsyncMerchantClient`` with httpx, and ``api.auth.MerchantAuth`` inside the user's
own httpx or requests client. A driver carries out ``Send`` (the request, signed with the
token it names; the answer, or a ``TransportFailure``) and the token source's steps.

- 401s have one owner, a plain loop as in google-auth's ``AuthorizedSession.request``:
  send; on a 401 to a request signed with the fleet's token, the source's replacement
  (``refused``: it judges what the 401 means, see docs/design.md "The model"), and send
  again, at most ``UNAUTHORIZED_RENEWALS`` times;
- connection failures, 429, 502, 503 and 504 back off exponentially with jitter (tenacity's
  pieces, ``CALL_RETRY``), honouring Retry-After, bounded in attempts and in total time. A
  method that is not idempotent is retried only when the server surely did not process the
  request: the connection was never made, or the answer was 429 or 503.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Protocol
from urllib.parse import quote, unquote, urlsplit

from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    wait_exception,
    wait_random_exponential,
)

from merchant_tasks import telemetry
from merchant_tasks.api.exchange import TOKEN_PATH, error_code, retry_after_of
from merchant_tasks.exceptions import (
    ApiError,
    ApiOutcomeUnknown,
    ApiUnavailable,
    MalformedApiResponse,
    PathForbidden,
    TokenRejected,
)
from merchant_tasks.flows import CLOCK, Flow, Sleep, next_try
from merchant_tasks.settings import Secret
from merchant_tasks.token import API_PREFIX, Token

log = logging.getLogger(__name__)

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})  # RFC 9110 9.2.2
IDEMPOTENCY_HEADER = "Idempotency-Key"  # the header most payment APIs read (IETF draft name):
# a request carrying one may be sent again whatever its method, the server answers it once


def with_idempotency_key(
    headers: Mapping[str, str] | None, idempotency_key: str | None
) -> Mapping[str, str] | None:
    """``headers``, with ``idempotency_key`` as IDEMPOTENCY_HEADER when one is given."""
    if idempotency_key is None:
        return headers
    return {**(headers or {}), IDEMPOTENCY_HEADER: idempotency_key}


SAFE_TO_RESEND_STATUSES = frozenset({429, 503})  # the server refused before processing
TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})
CALL_ATTEMPTS = 4  # one call plus three retries, then the caller (or Celery) decides
UNAUTHORIZED_RENEWALS = 2  # replacements after a 401 within one call: the first may give a
# token another process renewed just before a revocation
CALL_RETRY_BUDGET = 20.0  # seconds of back-off at most inside one call
CALL_WAIT_INITIAL = 0.25  # first back-off; doubles per attempt, with jitter
CALL_WAIT_MAX = 5.0
EXCERPT_LENGTH = 200  # characters of an error body kept in ApiError
EXCERPT_SCAN = 64 * 1024  # characters searched for the token before the excerpt is cut
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})  # the
# client signs each call with the fleet's token; a caller's own credentials would speak for
# it (and a 401 on them would be taken for the token's refusal)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 5.1: a token, no blanks


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


# a call's own retries: transient failures a resend is safe for, jittered exponential waits
# of at least the server's Retry-After, bounded in attempts and in time
CALL_RETRY = Retrying(
    retry=retry_if_exception(lambda exc: isinstance(exc, _Transient) and exc.resendable),
    wait=wait_random_exponential(multiplier=CALL_WAIT_INITIAL, max=CALL_WAIT_MAX)
    + wait_exception(lambda exc: getattr(exc, "retry_after", None) or 0.0),
    stop=stop_after_attempt(CALL_ATTEMPTS) | stop_before_delay(CALL_RETRY_BUDGET),
)


class TransportFailure(Exception):
    """What a driver throws into the flow when its HTTP client failed to get an answer:
    ``reason`` names it (never the URL's credentials), ``never_sent``: the connection was
    never made (nothing reached the server)."""

    def __init__(self, reason: str, *, never_sent: bool) -> None:
        super().__init__(reason)
        self.reason, self.never_sent = reason, never_sent

    @classmethod
    def connecting(cls, url: str, exc: Exception, *, never_sent: bool) -> TransportFailure:
        """The connection to ``url``'s host failed with ``exc``."""
        return cls(
            f"connection to {host_of(url)} failed: {type(exc).__name__}", never_sent=never_sent
        )

    @classmethod
    def timed_out(cls, url: str) -> TransportFailure:
        """No answer from ``url``'s host in time (the request may have been processed)."""
        return cls(f"timed out waiting for {host_of(url)}", never_sent=False)


class Answer(Protocol):
    """What the flow reads of an HTTP answer: a ``requests.Response`` or an
    ``httpx.Response`` both are one."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def text(self) -> str: ...

    @property
    def content(self) -> bytes: ...

    def json(self) -> Any: ...


@dataclass(frozen=True)
class Send:
    """Send the call with ``token`` (the ``Authorization`` header its bearer value): the
    answer (an ``Answer``, its ``request`` as sent), or a ``TransportFailure`` thrown in."""

    token: Token


class Reveal:
    """The secret now (to blank it from an error's excerpt): the driver reads it, off the
    event loop for asyncio (it may come from a file)."""


REVEAL = Reveal()


class TokenSource(Protocol):
    """Where a client gets its token, and tells what the API made of it (the blocking
    interface a source of one's own implements; the fleet's is ``TokenFlows`` too)."""

    def token(self) -> Token: ...

    def renew(self, force: bool = False, stale_token: Token | None = None) -> Token: ...

    def accepted(self, token: Token) -> None: ...


class TokenFlows(Protocol):
    """The token's flows the send loop yields from (``renewal.life.TokenLife``)."""

    def token_for(self, path: str) -> Flow[Token]: ...

    def refused(self, token: Token, path: str = "") -> Flow[Token]: ...

    def accepted(self, token: Token, path: str = "") -> Flow[None]: ...


@dataclass(frozen=True)
class Call:
    """What the caller asked for, sent again as it was after a 401 or a transient failure."""

    method: str
    path: str
    json: Any = None
    params: Mapping[str, Any] | None = None
    headers: Mapping[str, str] | None = None
    span: telemetry.Recorder = telemetry.NO_SPAN  # its ``merchant_tasks.request`` span

    @contextmanager
    def recorded(self, account: str) -> Iterator[Call]:
        """The call, once its path and headers are checked (ValueError naming what is
        wrong: a path outside the API, a header carrying credentials), in its
        ``merchant_tasks.request`` span; its outcome counted for ``account``."""
        check_path(self.path)
        check_headers(self.headers)
        method = self.method.upper()
        with telemetry.request_span(method, self.path, account) as span:
            try:
                yield replace(self, method=method, span=span)
            except Exception as exc:
                telemetry.count_call(account, type(exc).__name__)
                raise
            telemetry.count_call(account, "ok")

    @property
    def resendable(self) -> bool:
        """Whether sending it twice does no more than sending it once (RFC 9110 9.2.2, or
        an idempotency key the server answers once)."""
        return self.method in IDEMPOTENT_METHODS or any(
            name.lower() == IDEMPOTENCY_HEADER.lower() for name in self.headers or {}
        )

    def request_arguments(self, base_url: str, token: Token) -> dict[str, Any]:
        """The call as requests' and httpx's ``request`` both take it (method, URL, JSON
        body, query parameters, headers), with the fleet's token as its only credentials."""
        headers = {"accept": "application/json", **(self.headers or {})}
        headers["authorization"] = f"Bearer {token.value}"
        return {
            "method": self.method,
            "url": base_url + self.path,
            "json": self.json,
            "params": self.params,
            "headers": headers,
        }


@dataclass(frozen=True)
class Signed:
    """The last answer of ``signed``, the token it was sent with, the 401 replacements made
    for it, and, for a 401 judged its route's, that judgment."""

    answer: Any
    token: Token
    renewals: int
    forbidden: PathForbidden | None = None


def signed(
    source: TokenFlows, path: str, span: telemetry.Recorder, replacements: int
) -> Flow[Signed]:
    """Send with the fleet's token; on a 401 to a request signed with it, send again with
    its replacement, at most ``replacements`` times (a route that lacks a permission ends
    the loop: its 401 is the answer). The answer is not judged otherwise."""
    token = yield from source.token_for(path)
    renewals = 0
    while True:
        span.count(telemetry.ATTEMPTS)
        answer = yield Send(token)
        status = answer.status_code
        span.set(telemetry.HTTP_STATUS, status)
        if 200 <= status < 300:
            yield from source.accepted(token, path)
        if status != 401 or not signed_with(answer, token) or renewals == replacements:
            return Signed(answer, token, renewals)
        span.count(telemetry.UNAUTHORIZED)
        log.info("call got 401 with token %s; renewing", token.fingerprint)
        renewals += 1
        try:
            token = yield from source.refused(token, path)
        except PathForbidden as exc:
            return Signed(answer, token, renewals, exc)


def call(source: TokenFlows, the_call: Call, secret: Secret | None) -> Flow[Any]:
    """The whole call: the send loop, the answer judged (the decoded JSON body, or the
    error that says why not), transient failures retried (``CALL_RETRY``); ``secret`` is
    never quoted from an error body."""
    started = (yield CLOCK).mono
    attempt = 0
    while True:
        attempt += 1
        try:
            return (yield from _once(source, the_call, secret))
        except _Transient as exc:
            if not exc.resendable:  # report it as it came, never resent
                raise ApiOutcomeUnknown(
                    f"{the_call.method} {the_call.path} failed ({exc}); "
                    "not retried: the server may have processed it",
                    status=exc.status,
                    excerpt=exc.excerpt,
                    retry_after=exc.retry_after,
                ) from None
            moment = yield CLOCK
            wait = next_try(CALL_RETRY, attempt, started, moment.mono, exc)
            if wait is None:
                raise ApiUnavailable(
                    f"gave up after {attempt} attempts in {moment.mono - started:.1f} s ({exc})",
                    status=exc.status,
                    excerpt=exc.excerpt,
                    retry_after=exc.retry_after,
                ) from None
            yield Sleep(wait)


def _once(source: TokenFlows, the_call: Call, secret: Secret | None) -> Flow[Any]:
    """One try of the call (its 401 replacements included)."""
    try:
        done = yield from signed(source, the_call.path, the_call.span, UNAUTHORIZED_RENEWALS)
    except TransportFailure as exc:
        raise _Transient(exc.reason, resendable=exc.never_sent or the_call.resendable) from None
    revealed: str | None = None
    if secret is not None and not 200 <= done.answer.status_code < 300:
        revealed = yield REVEAL
    return judge_answer(done, the_call, revealed)


def judge_answer(done: Signed, the_call: Call, secret: str | None) -> Any:
    """What the call's last answer means: its decoded JSON body, or the error (``secret``:
    never quoted from its body)."""
    answer, token = done.answer, done.token
    method, path, status = the_call.method, the_call.path, answer.status_code
    log.debug("%s %s answered %d", method, path, status)
    if 200 <= status < 300:
        return decode(answer, method, path)
    if status == 401 and signed_with(answer, token):
        if done.forbidden is not None:
            raise done.forbidden  # the route's (``renewal.life``)
        raise TokenRejected.after_renewals(done.renewals)
    hidden = {token.value: "<token>"}
    if secret:
        hidden[secret] = "<secret>"
    excerpt = _excerpt(answer, hidden)
    if status in TRANSIENT_STATUSES:
        raise _Transient(
            f"HTTP {status}",
            status=status,
            excerpt=excerpt,
            retry_after=retry_after_of(answer),
            resendable=status in SAFE_TO_RESEND_STATUSES or the_call.resendable,
        )
    found = error_code(answer, *hidden)
    raise ApiError(
        f"{method} {path} failed with HTTP {status}{f' ({found[1]})' if found else ''}",
        status=status,
        code=found[1] if found else None,
        excerpt=excerpt,
    )


@functools.lru_cache(maxsize=1024)  # a pure check, asked with the same few paths each call
def check_path(path: str) -> None:
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


def check_headers(headers: Mapping[str, str] | None) -> None:
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


def signed_with(answer: Any, token: Token) -> bool:
    """Whether the request that got ``answer`` carried ``token`` and no other credentials
    (a session's own auth or hooks could replace them), to the path it was signed for (a
    user's client that follows redirects answers with the last page's: a login page's 401
    says nothing of the token): only then is a 401 the token's."""
    if any(300 <= getattr(earlier, "status_code", 0) < 400 for earlier in answer_history(answer)):
        return False
    request = getattr(answer, "request", None)
    if request is None:  # a transport that keeps no request: as it was given
        return True
    return bool(request.headers.get("Authorization") == f"Bearer {token.value}")


def answer_history(answer: Any) -> list[Any]:
    """The answers before ``answer`` (redirects, a resent 401) its client kept, if any."""
    return list(getattr(answer, "history", None) or ())


def host_of(url: str) -> str:
    """host[:port] of a URL, never the user or password it may carry."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)


def decode(answer: Answer, method: str, path: str) -> Any:
    """A 2xx answer's JSON body (None when empty)."""
    if not answer.content:
        return None
    try:
        return answer.json()
    except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
        raise MalformedApiResponse(
            f"{method} {path} answered HTTP {answer.status_code} with a body that is not JSON",
            status=answer.status_code,
        ) from None


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


def _excerpt(answer: Answer, hidden: Mapping[str, str]) -> str:
    """The start of an error body, each ``hidden`` value (the token, the secret) replaced by
    its placeholder before anything is cut: as sent, and as a server may echo it, escaped
    for JSON (``\\/``) or percent-encoded."""
    text = answer.text[:EXCERPT_SCAN]
    for value, placeholder in hidden.items():
        for form in {value, value.replace("/", "\\/"), quote(value, safe="")}:
            text = text.replace(form, placeholder)
    return " ".join(text.split())[:EXCERPT_LENGTH]
