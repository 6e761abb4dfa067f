"""MerchantClient over a fake transport, with a TokenManager on fakeredis: bearer header,
renew-once on 401, what is retried for which method, and errors that never show the token."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from urllib.parse import quote

import pytest
import requests
from urllib3.connection import HTTPSConnection
from urllib3.connectionpool import HTTPSConnectionPool
from urllib3.exceptions import MaxRetryError, NewConnectionError, ProtocolError

from merchant_tasks.accounts import FleetClient
from merchant_tasks.api.client import CALL_ATTEMPTS, CALL_WAIT_MAX, EXCERPT_LENGTH, MerchantClient
from merchant_tasks.api.exchange import TOKEN_PATH
from merchant_tasks.exceptions import (
    ApiError,
    ApiOutcomeUnknown,
    ApiUnavailable,
    CredentialsRejected,
    MalformedApiResponse,
    TokenRejected,
)
from merchant_tasks.settings import Secret
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.token import RenewalReason, Token, fingerprint
from support.clock import Sleeper
from support.fake_http import FakeTransport, Reply, response, session_with
from support.renewal import FakeExchange, make_manager

BASE_URL = "https://api.example.test"
SECRET = "secret-one-0a1b2c3d4e"
ORDERS = "/open-api/v1/orders"
LIFETIME = 7200.0


@pytest.fixture
def wall_clock_exchange() -> FakeExchange:
    """The scripted token exchange of the client's manager, which runs on the real clock."""
    return FakeExchange()


@pytest.fixture
def transport() -> FakeTransport:
    return FakeTransport()


@pytest.fixture
def client(
    store: TokenStore,
    wall_clock_exchange: FakeExchange,
    sleep: Sleeper,
    transport: FakeTransport,
) -> FleetClient:
    manager = make_manager(
        store,
        wall_clock_exchange,
        secret_fingerprint=lambda: fingerprint(SECRET),
        clock=time.time,
        sleep=sleep,
    )
    return MerchantClient(
        BASE_URL,
        manager,
        session=session_with(transport),
        timeout=(1.0, 2.0),
        sleep=sleep,
        secret=Secret(SECRET),
    )


def refused() -> requests.ConnectionError:
    """What requests raises when the TCP connection is refused: nothing was sent."""
    reason = NewConnectionError(HTTPSConnection("api.example.test"), "Connection refused")
    return requests.ConnectionError(
        MaxRetryError(HTTPSConnectionPool("api.example.test"), "/", reason)
    )


def dropped() -> requests.ConnectionError:
    """What requests raises when the connection breaks after the request went out."""
    return requests.ConnectionError(ProtocolError("Connection aborted.", ConnectionResetError()))


def echo_authorization(status: int) -> Callable[[requests.PreparedRequest], requests.Response]:
    """A careless server that quotes the request's Authorization header in its error body."""

    def answer(request: requests.PreparedRequest) -> requests.Response:
        header = request.headers["Authorization"]
        return response(status, {"error": "bad", "detail": f"you sent {header}", "token": header})

    return answer


def token_values(wall_clock_exchange: FakeExchange) -> list[str]:
    return [wall_clock_exchange.issued(n) for n in range(1, len(wall_clock_exchange.calls) + 1)]


# -- the call ----------------------------------------------------------------------------


def test_a_call_sends_the_shared_token_as_a_bearer_header(
    client: FleetClient, transport: FakeTransport, store: TokenStore
) -> None:
    client.request("GET", f"{ORDERS}/42")
    [sent] = transport.sent
    assert (sent.method, sent.url) == ("GET", f"{BASE_URL}{ORDERS}/42")
    stored = store.load()
    assert stored is not None
    assert sent.headers["authorization"] == f"Bearer {stored.value}"
    assert sent.headers["accept"] == "application/json"
    assert sent.timeout == (1.0, 2.0)


def test_a_call_sends_its_json_body_query_and_extra_headers(
    client: FleetClient, transport: FakeTransport
) -> None:
    client.request(
        "post", ORDERS, json={"amount": 100}, params={"trace": "a1"}, headers={"X-Req": "r-1"}
    )
    [sent] = transport.sent
    assert (sent.method, sent.url) == ("POST", f"{BASE_URL}{ORDERS}?trace=a1")
    assert json.loads(sent.body) == {"amount": 100}
    assert sent.headers["content-type"] == "application/json"
    assert sent.headers["x-req"] == "r-1"


def test_the_json_answer_is_decoded(client: FleetClient, transport: FakeTransport) -> None:
    transport.reply(response(200, {"order": {"id": 42, "items": [1, 2]}}))
    assert client.request("GET", ORDERS) == {"order": {"id": 42, "items": [1, 2]}}


@pytest.mark.parametrize("status", [200, 202, 204])
def test_an_empty_answer_is_none(
    client: FleetClient, transport: FakeTransport, status: int
) -> None:
    transport.reply(response(status))
    assert client.request("DELETE", f"{ORDERS}/42") is None


def test_a_2xx_that_is_not_json_is_malformed_api_response(
    client: FleetClient, transport: FakeTransport
) -> None:
    transport.reply(response(200, "<html>ok</html>"))
    with pytest.raises(MalformedApiResponse, match="not JSON") as caught:
        client.request("GET", ORDERS)
    assert caught.value.status == 200
    assert len(transport.sent) == 1


def test_one_token_serves_many_calls(
    client: FleetClient, transport: FakeTransport, wall_clock_exchange: FakeExchange
) -> None:
    for _ in range(5):
        client.request("GET", ORDERS)
    assert len(wall_clock_exchange.calls) == 1
    assert len({sent.bearer for sent in transport.sent}) == 1


# -- what request() refuses --------------------------------------------------------------


def refused_unsent(
    client: FleetClient,
    transport: FakeTransport,
    exchange: FakeExchange,
    refusal: str,
    path: str,
    headers: dict[str, str] | None = None,
) -> None:
    """A GET of ``path`` is a ValueError matching ``refusal``, before anything is sent and
    before any exchange."""
    with pytest.raises(ValueError, match=refusal):
        client.request("GET", path, headers=headers)
    assert transport.sent == []
    assert len(exchange.calls) == 0


@pytest.mark.parametrize(
    "path",
    [
        "/open-api/v2/orders",
        "/admin",
        "open-api/v1/orders",
        "/open-api/v1",
        "https://evil.example.test/open-api/v1/orders",
        "/open-api/v1/x/../../../admin",
        "/open-api/v1/orders#fragment",
    ],
)
def test_a_path_outside_the_api_is_a_value_error(
    client: FleetClient, transport: FakeTransport, wall_clock_exchange: FakeExchange, path: str
) -> None:
    refused_unsent(client, transport, wall_clock_exchange, "/open-api/v1/", path)


@pytest.mark.parametrize(
    "path", [TOKEN_PATH, TOKEN_PATH + "/", TOKEN_PATH + "?grant=x", TOKEN_PATH + ";v=1"]
)
def test_the_token_endpoint_cannot_be_called_through_request(
    client: FleetClient, transport: FakeTransport, path: str
) -> None:
    with pytest.raises(ValueError, match="token endpoint"):
        client.request("POST", path)
    assert transport.sent == []


@pytest.mark.parametrize(
    ("path", "refusal"),
    [
        *(
            (path, r"/open-api/v1/|token endpoint")
            for path in [
                "/open-api/v1/auth/./access_token",  # urllib3 sends it to the token endpoint
                "/open-api/v1/..",  # urllib3 sends it to /open-api/
                "/open-api/v1/%2e%2e/%2e%2e/admin",  # RFC 3986: %2e is "."; servers decode it
                "/open-api/v1/%2E%2e/admin",
                "/open-api/v1/.%2e/admin",
                "/open-api/v1/%252e%252e/admin",  # encoded twice, for servers that decode twice
                "/open-api/v1/orders/%2e",
                "/open-api/v1/x%2f..%2f..%2fadmin",  # an encoded slash makes new segments
                "/open-api/v1/x%2F..%2F..%2Fadmin",
                "/open-api/v1/x%5c..%5cadmin",  # an encoded backslash, which some servers split at
                "/open-api/v1/auth/access%5Ftoken",  # the token endpoint, encoded
            ]
        ),
        # segments some server reads as dot segments (Tomcat, Spring, trimming, collapsing)
        *(
            (path, "/open-api/v1/")
            for path in [
                "/open-api/v1/..;/admin",  # Tomcat and Spring drop ";..." and read ".."
                "/open-api/v1/..;jsessionid=x/..;/admin",
                "/open-api/v1/.;/auth/access_token",
                "/open-api/v1/%2e%2e%3b/admin",  # the same, percent-encoded
                "/open-api/v1/.. /admin",  # trailing blanks, which some servers trim
                "/open-api/v1/.../admin",  # dots only, which some servers collapse
            ]
        ),
    ],
)
def test_a_path_with_dot_segments_cannot_leave_the_api(
    client: FleetClient, transport: FakeTransport, path: str, refusal: str
) -> None:
    with pytest.raises(ValueError, match=refusal):
        client.request("GET", path)
    assert transport.sent == []


@pytest.mark.parametrize(
    "path",
    [
        "/open-api/v1/orders/a%20b",
        "/open-api/v1/orders/%E2%82%AC",
        "/open-api/v1/x.y/z",
        "/open-api/v1/x;v=1",
    ],
)
def test_other_percent_encoded_or_dotted_names_are_allowed(
    client: FleetClient, transport: FakeTransport, path: str
) -> None:
    transport.reply(response(200, {"ok": True}))
    assert client.request("GET", path) == {"ok": True}


@pytest.mark.parametrize(
    "name",
    [
        "Authorization",
        "authorization",
        "AUTHORIZATION",
        "Authorization ",  # passed the guard once, and its 401 counted as the token's
        "authorization\t",
        " Proxy-Authorization",
        "Cookie",
    ],
)
def test_an_authorization_header_from_the_caller_is_a_value_error(
    client: FleetClient, transport: FakeTransport, wall_clock_exchange: FakeExchange, name: str
) -> None:
    refused_unsent(
        client, transport, wall_clock_exchange, "Authorization", ORDERS, {name: "Bearer mine"}
    )


@pytest.mark.parametrize("name", [b"X-Order", "X Order", "X-Order\n"])
def test_a_header_name_that_is_not_one_is_a_value_error_before_sending(
    client: FleetClient, transport: FakeTransport, name: object
) -> None:
    with pytest.raises(ValueError, match="not a header name"):
        client.request("GET", ORDERS, headers={name: "1"})  # type: ignore[dict-item]
    assert transport.sent == []


def test_no_request_is_sent_when_no_token_can_be_had(
    client: FleetClient, transport: FakeTransport, wall_clock_exchange: FakeExchange
) -> None:
    wall_clock_exchange.outcomes = [CredentialsRejected("refused (HTTP 401)", status=401)]
    with pytest.raises(CredentialsRejected):
        client.request("GET", ORDERS)
    assert transport.sent == []


# -- 401 ---------------------------------------------------------------------------------


def refused_while_another_host_renews(store: TokenStore, reason: RenewalReason) -> Reply:
    """A 401 answered while another host stores the next generation, ``tok-from-another-host``."""

    def reply(request: requests.PreparedRequest) -> requests.Response:
        current = store.load()
        assert current is not None
        newer = Token("tok-from-another-host", time.time(), time.time() + LIFETIME, 2, "b", reason)
        assert store.save(newer) == (True, current.generation + 1)
        return response(401)

    return reply


def test_a_401_on_a_token_accepted_before_renews_once_and_retries_with_the_new_token(
    client: FleetClient,
    transport: FakeTransport,
    wall_clock_exchange: FakeExchange,
    store: TokenStore,
) -> None:
    transport.reply(response(200), response(401, {"error": "invalid_token"}), response(200))
    client.request("GET", ORDERS)
    transport.reply(response(401, {"error": "invalid_token"}), response(200, {"ok": 1}))
    assert client.request("POST", ORDERS, json={"amount": 1}) == {"ok": 1}
    first, second = token_values(wall_clock_exchange)
    assert [sent.bearer for sent in transport.sent] == [first, first, second]
    assert len(wall_clock_exchange.calls) == 2
    counters = store.records.counters()
    assert (counters["unauthorized"], counters["forced_renewals"]) == (1, 1)


def test_a_401_uses_a_token_another_process_renewed_meanwhile(
    client: FleetClient,
    transport: FakeTransport,
    wall_clock_exchange: FakeExchange,
    store: TokenStore,
) -> None:
    transport.reply(
        refused_while_another_host_renews(store, RenewalReason.FORCED), response(200, {"ok": 1})
    )
    assert client.request("GET", ORDERS) == {"ok": 1}
    assert transport.sent[1].bearer == "tok-from-another-host"
    assert len(wall_clock_exchange.calls) == 1  # theirs was used: no exchange of our own


def test_a_401_on_the_tokens_of_a_wrong_key_is_token_rejected_after_one_replacement(
    client: FleetClient, transport: FakeTransport, wall_clock_exchange: FakeExchange
) -> None:
    """The wrong key or environment: the first token is refused on its first use (it may
    have been revoked before use: replaced), then its replacement too: no loop begins."""
    transport.reply(response(401))
    with pytest.raises(TokenRejected, match="2 tokens in a row") as caught:
        client.request("GET", ORDERS)
    assert "MERCHANT_ENVIRONMENT" in str(caught.value)
    assert not caught.value.retryable
    assert len(transport.sent) == 2
    assert len(wall_clock_exchange.calls) == 2  # the first token and its one replacement


def test_a_401_on_a_token_renewed_elsewhere_just_before_a_revocation_renews_once_more(
    client: FleetClient,
    transport: FakeTransport,
    wall_clock_exchange: FakeExchange,
    store: TokenStore,
) -> None:
    """Another process renewed, then every token was revoked: one exchange, no failure."""
    client.request("GET", ORDERS)  # the first token is accepted
    renewed_elsewhere = refused_while_another_host_renews(store, RenewalReason.SCHEDULED)
    transport.reply(renewed_elsewhere, response(401), response(200, {"ok": 1}))
    assert client.request("GET", ORDERS) == {"ok": 1}
    assert [sent.bearer for sent in transport.sent[2:]] == [
        "tok-from-another-host",
        "tok-issued-2",
    ]
    assert (
        len(wall_clock_exchange.calls) == 2
    )  # the first token, and one forced renewal by this call


def test_a_call_never_causes_more_than_two_exchanges_however_many_401s(
    client: FleetClient, transport: FakeTransport, wall_clock_exchange: FakeExchange
) -> None:
    """API access revoked after the first token was accepted: the call renews twice (the
    second renewal covers a revocation before first use) and then gives up."""
    client.request("GET", ORDERS)
    transport.reply(response(401))
    with pytest.raises(TokenRejected, match="again after 2 renewals"):
        client.request("GET", ORDERS)
    assert len(wall_clock_exchange.calls) == 3


def test_a_401_on_the_next_call_with_a_token_never_accepted_is_not_renewed_again(
    client: FleetClient, transport: FakeTransport, wall_clock_exchange: FakeExchange
) -> None:
    client.request("GET", ORDERS)
    transport.reply(response(401))
    with pytest.raises(TokenRejected):
        client.request("GET", ORDERS)
    with pytest.raises(TokenRejected, match="in a row"):
        client.request("GET", ORDERS)
    assert len(wall_clock_exchange.calls) == 3  # no exchange loop across calls


class StaticTokens:
    """The smallest TokenSource: two tokens in turn, and what the client told it."""

    def __init__(self) -> None:
        now = time.time()
        self.tokens = [Token(f"tok-static-{n}", now, now + LIFETIME, n) for n in (1, 2)]
        self.renewed: list[Token] = []
        self.accepted_tokens: list[Token] = []

    def token(self) -> Token:
        return self.tokens[len(self.renewed)]

    def renew(self, force: bool = False, stale_token: Token | None = None) -> Token:
        assert stale_token is not None
        self.renewed.append(stale_token)
        return self.token()

    def accepted(self, token: Token) -> None:
        self.accepted_tokens.append(token)


def test_the_client_needs_only_a_token_source(transport: FakeTransport) -> None:
    tokens = StaticTokens()
    client = MerchantClient(BASE_URL, tokens, session=session_with(transport))
    transport.reply(response(401), response(200, {"ok": 1}))
    assert client.request("GET", ORDERS) == {"ok": 1}
    assert [t.value for t in tokens.renewed] == ["tok-static-1"]
    assert [t.value for t in tokens.accepted_tokens] == ["tok-static-2"]
    assert [sent.bearer for sent in transport.sent] == ["tok-static-1", "tok-static-2"]


# -- transient failures ------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 503])
def test_429_and_503_are_retried_for_post_honouring_retry_after(
    client: FleetClient, transport: FakeTransport, sleep: Sleeper, status: int
) -> None:
    transport.reply(response(status, headers={"Retry-After": "3"}), response(201, {"id": 7}))
    assert client.request("POST", ORDERS, json={"amount": 1}) == {"id": 7}
    assert len(transport.sent) == 2
    assert [round(wait) for wait in sleep.waits if wait] == [3] or max(sleep.waits) >= 3
    assert 3 <= max(sleep.waits) <= 3 + CALL_WAIT_MAX


def test_transient_failures_are_retried_for_get(
    client: FleetClient, transport: FakeTransport, sleep: Sleeper
) -> None:
    transport.reply(
        response(502), response(504), requests.ReadTimeout("read timed out"), response(200, [1])
    )
    assert client.request("GET", ORDERS) == [1]
    assert len(transport.sent) == 4
    assert len(sleep.waits) == 3
    assert all(0 <= wait <= CALL_WAIT_MAX for wait in sleep.waits)


@pytest.mark.parametrize("method", ["PUT", "DELETE", "HEAD", "OPTIONS"])
def test_other_idempotent_methods_are_retried_like_get(
    client: FleetClient, transport: FakeTransport, method: str
) -> None:
    transport.reply(response(502), dropped(), response(204))
    assert client.request(method, f"{ORDERS}/42") is None
    assert len(transport.sent) == 3


@pytest.mark.parametrize(
    ("failure", "status"),
    [(response(502), 502), (response(504), 504), (requests.ReadTimeout("read"), None)],
    ids=["502", "504", "read-timeout"],
)
def test_502_504_and_read_timeouts_are_not_retried_for_post(
    client: FleetClient,
    transport: FakeTransport,
    failure: Reply,
    status: int | None,
) -> None:
    transport.reply(failure, response(201))
    with pytest.raises(ApiUnavailable, match="not retried") as caught:
        client.request("POST", ORDERS, json={"amount": 1})
    assert caught.value.status == status
    assert len(transport.sent) == 1
    # nor may Celery send it again: call_api retries only what is retryable
    assert isinstance(caught.value, ApiOutcomeUnknown)
    assert not caught.value.retryable


@pytest.mark.parametrize("header", ["Idempotency-Key", "idempotency-key"])
def test_a_post_with_an_idempotency_key_is_retried_like_get(
    client: FleetClient, transport: FakeTransport, header: str
) -> None:
    transport.reply(response(502), requests.ReadTimeout("read"), dropped(), response(201, [1]))
    assert client.request("POST", ORDERS, json={"amount": 1}, headers={header: "order-42"}) == [1]
    assert len(transport.sent) == 4


def test_an_idempotency_key_argument_is_sent_as_its_header_and_retried_like_get(
    client: FleetClient, transport: FakeTransport
) -> None:
    transport.reply(response(502), response(201, [1]))
    assert client.request("POST", ORDERS, json={"amount": 1}, idempotency_key="order-43") == [1]
    assert [request.headers["Idempotency-Key"] for request in transport.sent] == ["order-43"] * 2


def test_a_connection_dropped_after_sending_is_not_retried_for_post(
    client: FleetClient, transport: FakeTransport
) -> None:
    transport.reply(dropped(), response(201))
    with pytest.raises(ApiUnavailable, match="not retried"):
        client.request("PATCH", ORDERS, json={"amount": 1})
    assert len(transport.sent) == 1


@pytest.mark.parametrize(
    "failure",
    [refused(), requests.ConnectTimeout("connect timed out")],
    ids=["refused", "connect-timeout"],
)
def test_a_connection_never_made_is_retried_for_post(
    client: FleetClient, transport: FakeTransport, failure: Exception
) -> None:
    transport.reply(failure, response(201, {"id": 7}))
    assert client.request("POST", ORDERS, json={"amount": 1}) == {"id": 7}
    assert len(transport.sent) == 2


def test_gives_up_after_call_attempts_with_api_unavailable_and_the_status(
    client: FleetClient, transport: FakeTransport, sleep: Sleeper
) -> None:
    transport.reply(response(503, {"error": "maintenance"}))
    with pytest.raises(ApiUnavailable, match=f"gave up after {CALL_ATTEMPTS} attempts") as caught:
        client.request("POST", ORDERS, json={"amount": 1})
    assert caught.value.status == 503
    assert "maintenance" in caught.value.excerpt
    assert caught.value.retryable
    assert isinstance(caught.value, ApiError)
    assert len(transport.sent) == CALL_ATTEMPTS
    assert len(sleep.waits) == CALL_ATTEMPTS - 1


def test_a_retry_after_beyond_the_call_budget_gives_up_at_once(
    client: FleetClient, transport: FakeTransport, sleep: Sleeper
) -> None:
    transport.reply(response(429, headers={"Retry-After": "60"}), response(200))
    with pytest.raises(ApiUnavailable) as caught:
        client.request("POST", ORDERS, json={"amount": 1})
    assert (caught.value.status, caught.value.retry_after) == (429, 60.0)
    assert len(transport.sent) == 1
    assert sleep.waits == []


# -- other errors ------------------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 403, 404, 409, 422, 500, 501, 302])
def test_other_error_statuses_are_api_error_with_status_and_excerpt(
    client: FleetClient, transport: FakeTransport, status: int
) -> None:
    transport.reply(
        response(status, {"error": "order_state", "message": "already  paid"}, {"Location": "/x"})
    )
    with pytest.raises(ApiError, match=f"HTTP {status}") as caught:
        client.request("POST", ORDERS, json={"amount": 1})
    assert type(caught.value) is ApiError
    assert caught.value.status == status
    assert "order_state" in caught.value.excerpt
    assert "already paid" in caught.value.excerpt  # whitespace collapsed
    assert not caught.value.retryable
    assert len(transport.sent) == 1  # neither retried nor redirected


def test_the_excerpt_is_bounded(client: FleetClient, transport: FakeTransport) -> None:
    transport.reply(response(400, "x" * 5000))
    with pytest.raises(ApiError) as caught:
        client.request("GET", ORDERS)
    assert len(caught.value.excerpt) == EXCERPT_LENGTH


@pytest.mark.parametrize("status", [400, 500, 503, 401])
def test_errors_never_contain_the_token_even_when_the_server_echoes_it(
    client: FleetClient, transport: FakeTransport, wall_clock_exchange: FakeExchange, status: int
) -> None:
    transport.reply(echo_authorization(status))
    with pytest.raises((ApiError, TokenRejected)) as caught:
        client.request("GET", ORDERS)
    error = caught.value
    excerpt = error.excerpt if isinstance(error, ApiError) else ""
    for token in token_values(wall_clock_exchange):
        assert token not in str(error)
        assert token not in repr(error)
        assert token not in excerpt
    if isinstance(error, ApiError):
        assert "<token>" in excerpt


@pytest.mark.parametrize("status", [302, 400, 500])
def test_an_error_body_echoing_the_api_secret_never_shows_it(
    client: FleetClient, transport: FakeTransport, status: int
) -> None:
    """Found by fuzzing: ``{"error": <the secret>}`` was quoted as the API's error code, in
    the message and in ``code``, and the excerpt held it (it travels in Celery results)."""
    transport.reply(response(status, {"error": SECRET, "message": f"bad {SECRET}"}))
    with pytest.raises((ApiError, ApiUnavailable)) as caught:
        client.request("GET", ORDERS)
    error = caught.value
    assert isinstance(error, ApiError)
    for text in (str(error), repr(error), error.excerpt, str(error.code)):
        assert SECRET not in text
    assert "<secret>" in error.excerpt


@pytest.mark.parametrize(
    "echo",
    [
        lambda value: json.dumps({"got": value}).replace("/", "\\/"),  # PHP's json_encode
        lambda value: "token=" + quote(value, safe=""),
    ],
    ids=["json-escaped", "percent-encoded"],
)
def test_a_token_echoed_escaped_or_percent_encoded_never_shows_in_an_excerpt(
    client: FleetClient,
    transport: FakeTransport,
    wall_clock_exchange: FakeExchange,
    echo: Callable[[str], str],
) -> None:
    wall_clock_exchange.padding = "/a+b=c/d"  # a b64token may hold '/', '+' and '='

    def echoed(request: requests.PreparedRequest) -> requests.Response:
        return response(400, echo(request.headers["Authorization"].removeprefix("Bearer ")))

    transport.reply(echoed)
    with pytest.raises(ApiError) as caught:
        client.request("GET", ORDERS)
    [token] = token_values(wall_clock_exchange)
    assert "<token>" in caught.value.excerpt
    assert echo(token) not in caught.value.excerpt
    assert "tok-issued" not in caught.value.excerpt


def test_no_part_of_the_token_survives_in_an_excerpt_cut_mid_token(
    client: FleetClient, transport: FakeTransport, wall_clock_exchange: FakeExchange
) -> None:
    wall_clock_exchange.padding = "x" * 64

    def indented_echo(request: requests.PreparedRequest) -> requests.Response:
        return response(400, " " * 370 + request.headers["Authorization"])

    transport.reply(indented_echo)
    with pytest.raises(ApiError) as caught:
        client.request("GET", ORDERS)
    [token] = token_values(wall_clock_exchange)
    assert token[:12] not in caught.value.excerpt


def test_the_token_never_appears_in_debug_logs(
    client: FleetClient,
    transport: FakeTransport,
    wall_clock_exchange: FakeExchange,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    transport.reply(
        response(200),
        echo_authorization(401),
        echo_authorization(503),
        response(200, {"ok": 1}),
        echo_authorization(500),
    )
    client.request("GET", ORDERS)
    client.request("GET", ORDERS)
    with pytest.raises(ApiError):
        client.request("GET", ORDERS)
    assert len(wall_clock_exchange.calls) == 2
    assert caplog.records
    for record in caplog.records:
        text = f"{record.getMessage()} {record.args!r} {record.exc_text or ''}"
        for token in token_values(wall_clock_exchange):
            assert token not in text


def test_repr_shows_the_base_url_only(client: FleetClient) -> None:
    client.request("GET", ORDERS)
    assert repr(client) == f"MerchantClient(base_url={BASE_URL!r})"


def test_an_unreachable_api_is_named_by_its_host_in_the_error(
    client: FleetClient, transport: FakeTransport
) -> None:
    transport.reply(refused())
    with pytest.raises(ApiUnavailable, match=r"connection to api\.example\.test failed"):
        client.request("GET", ORDERS)
