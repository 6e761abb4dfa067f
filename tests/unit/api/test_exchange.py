"""The token exchange: the request it sends and how it sorts every answer into typed errors."""

from __future__ import annotations

import email.utils
import json
import logging
import math
import string
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from merchant_tasks.api.exchange import (
    MAX_RETRY_AFTER,
    MAX_TOKEN_LENGTH,
    TOKEN_BODY_LIMIT,
    TOKEN_PATH,
    TokenExchange,
    classify,
    parse_retry_after,
)
from merchant_tasks.exceptions import (
    ConfigurationError,
    CredentialsRejected,
    ExchangeRateLimited,
    MalformedTokenResponse,
    MerchantError,
    TokenEndpointUnavailable,
    TokenExchangeError,
    WrongBaseUrl,
)
from merchant_tasks.sandbox.processes import wait_until
from merchant_tasks.settings import Secret, Settings
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.token import IssuedToken
from support.drip_server import DRIP, DRIP_TIMEOUT, SHUTDOWN_POLL, DripServer
from support.fake_http import FakeTransport, Reply, response, session_with
from support.renewal import make_manager
from support.strategies import json_documents

BASE_URL = "https://api.example.test"
API_KEY = "app-id-1234"
SECRET = "s3cr3t-7c2e9d41b0a6f5e8"
TOKEN_VALUE = "tok-0b6f2c9e4d1a"


def exchange_with(
    transport: FakeTransport, secret: Secret | None = None, **kwargs: Any
) -> TokenExchange:
    return TokenExchange(
        BASE_URL, API_KEY, secret or Secret(SECRET), session=session_with(transport), **kwargs
    )


def ok(body: Any = None) -> FakeTransport:
    return FakeTransport(response(200, body or {"access_token": TOKEN_VALUE, "expires_in": 7200}))


# -- the request -------------------------------------------------------------------------


def test_exchange_posts_the_client_credentials_as_json_to_the_token_path() -> None:
    transport = ok()
    exchange_with(transport)()
    [sent] = transport.sent
    assert sent.method == "POST"
    assert sent.url == BASE_URL + TOKEN_PATH
    assert json.loads(sent.body) == {
        "grant_type": "client_credential",
        "appid": API_KEY,
        "secret": SECRET,
    }
    headers = sent.headers
    assert headers["content-type"] == "application/json"
    assert headers["accept"] == "application/json"
    assert "authorization" not in headers


def test_exchange_passes_its_timeouts_to_the_transport() -> None:
    transport = ok()
    exchange_with(transport, timeout=(1.5, 4.0))()
    assert transport.sent[0].timeout == (1.5, 4.0)


def test_a_trailing_slash_on_the_base_url_is_ignored() -> None:
    transport = ok()
    TokenExchange(BASE_URL + "/", API_KEY, Secret(SECRET), session=session_with(transport))()
    assert transport.sent[0].url == BASE_URL + TOKEN_PATH


def test_from_settings_uses_the_configured_url_timeouts_and_lifetime() -> None:
    settings = Settings(
        api_key=API_KEY,
        secret=Secret(SECRET),
        base_url=BASE_URL,
        token_lifetime=900,
        renew_before=60,
        renew_mandatory=10,
        connect_timeout=1.0,
        read_timeout=2.0,
    )
    transport = ok({"access_token": TOKEN_VALUE})
    exchange = TokenExchange.from_settings(settings, session=session_with(transport))
    assert exchange().expires_in == 900
    assert transport.sent[0].timeout == (1.0, 2.0)
    assert transport.sent[0].url == BASE_URL + TOKEN_PATH


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_not_followed_and_is_a_configuration_error(status: int) -> None:
    transport = FakeTransport(
        response(status, headers={"Location": "https://elsewhere.example.test/steal"})
    )
    with pytest.raises(ConfigurationError, match="MERCHANT_BASE_URL"):
        exchange_with(transport)()
    assert len(transport.sent) == 1  # the secret went nowhere else


@pytest.mark.parametrize(
    ("status", "body", "headers"),
    [
        (404, {"error": "not_found"}, {}),
        (405, b"", {"Allow": "GET"}),
        (200, b"<!doctype html><title>Welcome</title>", {}),
        (401, b"<html><body>Sign in</body></html>", {"Content-Type": "text/html"}),
        (403, b"Forbidden", {"Content-Type": "text/html; charset=utf-8"}),
        (302, b"", {"Location": "https://elsewhere.example.test/"}),
    ],
)
def test_an_answer_no_token_endpoint_gives_says_the_base_url_is_wrong_not_the_credentials(
    status: int, body: Any, headers: dict[str, str]
) -> None:
    transport = FakeTransport(response(status, body, headers))
    with pytest.raises(WrongBaseUrl) as caught:
        exchange_with(transport)()
    message = str(caught.value)
    assert message.startswith(f"{BASE_URL}{TOKEN_PATH} answered HTTP {status}")
    assert "MERCHANT_BASE_URL does not point at the API" in message
    assert "MERCHANT_API_SECRET" not in message
    assert "\n" not in message
    assert not isinstance(caught.value, TokenExchangeError)  # no pause on exchanges
    assert caught.value.status == status
    assert not caught.value.retryable


def test_a_proxys_html_error_page_for_a_5xx_is_still_an_endpoint_outage() -> None:
    page = response(502, b"<html>Bad Gateway</html>", {"Content-Type": "text/html"})
    with pytest.raises(TokenEndpointUnavailable):
        classify(page, 7200)


def test_a_wrong_base_url_opens_no_pause_so_the_exchange_after_the_fix_is_made(
    store: TokenStore,
) -> None:
    transport = FakeTransport(response(404, b"<html>Not Found</html>"), ok().replies[0])
    manager = make_manager(store, exchange_with(transport))
    with pytest.raises(WrongBaseUrl):
        manager.renew(force=True)
    assert store.records.load_breaker() is None
    assert manager.renew(force=True).value == TOKEN_VALUE  # at once: nothing to wait out
    assert len(transport.sent) == 2


def test_the_secret_is_read_at_exchange_time(tmp_path: Path) -> None:
    path = tmp_path / "api-secret"
    path.write_text("first-secret-aaaaaaaa\n", encoding="utf-8")
    transport = ok()
    exchange = exchange_with(transport, Secret(path=path))
    exchange()
    path.write_text("rotated-secret-bbbbbbbb\n", encoding="utf-8")
    exchange()
    assert [json.loads(sent.body)["secret"] for sent in transport.sent] == [
        "first-secret-aaaaaaaa",
        "rotated-secret-bbbbbbbb",
    ]


# -- successful answers ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expires_in"),
    [
        ({"access_token": TOKEN_VALUE, "expires_in": 7200}, 7200.0),
        ({"data": {"access_token": TOKEN_VALUE, "expires_in": 3600}, "code": 0}, 3600.0),
        ({"access_token": TOKEN_VALUE}, 1234.0),
        ({"data": {"access_token": TOKEN_VALUE}}, 1234.0),
        ({"access_token": TOKEN_VALUE, "expires_in": "600"}, 600.0),
        ({"access_token": TOKEN_VALUE, "expires_in": 0.5}, 0.5),
        ({"access_token": f"  {TOKEN_VALUE} ", "expires_in": None}, 1234.0),
    ],
    ids=["top-level", "data-wrapped", "no-lifetime", "data-no-lifetime", "string", "float", "pad"],
)
def test_a_2xx_with_a_token_gives_it_with_its_lifetime(body: Any, expires_in: float) -> None:
    issued = classify(response(200, body), default_lifetime=1234.0)
    assert issued == IssuedToken(value=TOKEN_VALUE, expires_in=expires_in)


def test_a_top_level_token_wins_over_a_data_object() -> None:
    body = {"access_token": TOKEN_VALUE, "data": {"access_token": "other"}}
    assert classify(response(200, body), 7200).value == TOKEN_VALUE


def test_an_issued_token_repr_never_shows_the_value() -> None:
    assert TOKEN_VALUE not in repr(IssuedToken(TOKEN_VALUE, 7200.0))


# -- refused and failing answers ---------------------------------------------------------


@pytest.mark.parametrize("status", [400, 401, 403])
def test_a_refusal_is_credentials_rejected_with_its_status(status: int) -> None:
    with pytest.raises(CredentialsRejected, match="MERCHANT_API_SECRET") as caught:
        classify(response(status, {"error": "invalid_client"}), 7200)
    assert caught.value.status == status
    assert "invalid_client" in str(caught.value)  # a short error code is quoted back
    assert not caught.value.retryable


def test_free_text_from_an_error_body_is_never_quoted() -> None:
    body = {"error": "the secret you sent is wrong", "message": "wrong appid"}
    with pytest.raises(CredentialsRejected) as caught:
        classify(response(401, body), 7200)
    assert "wrong" not in str(caught.value)


@pytest.mark.parametrize(
    ("header", "expected"),
    [("30", 30.0), ("0", 0.0), ("2.5", 2.5), ("-10", 0.0), ("999999", MAX_RETRY_AFTER)],
)
def test_a_429_is_rate_limited_with_retry_after_seconds(header: str, expected: float) -> None:
    with pytest.raises(ExchangeRateLimited) as caught:
        classify(response(429, headers={"Retry-After": header}), 7200)
    assert caught.value.retry_after == expected
    assert caught.value.retryable


@pytest.mark.parametrize("host_off_by", [-600.0, 0.0, 90.0])
def test_a_429_with_an_http_date_is_read_against_the_servers_own_date(host_off_by: float) -> None:
    """The server asks for 120 s by date; whatever this host's clock says (600 s behind,
    right, 90 s ahead), the wait is what the server asked: its Date header is the now."""
    server_now = time.time() + host_off_by
    headers = {
        "Retry-After": email.utils.formatdate(server_now + 120, usegmt=True),
        "Date": email.utils.formatdate(server_now, usegmt=True),
    }
    with pytest.raises(ExchangeRateLimited) as caught:
        classify(response(429, headers=headers), 7200)
    assert caught.value.retry_after == 120.0


def test_a_429_with_a_past_http_date_may_retry_at_once() -> None:
    now = time.time()
    headers = {
        "Retry-After": email.utils.formatdate(now - 120, usegmt=True),
        "Date": email.utils.formatdate(now, usegmt=True),
    }
    with pytest.raises(ExchangeRateLimited) as caught:
        classify(response(429, headers=headers), 7200)
    assert caught.value.retry_after == 0.0


def test_a_retry_after_date_without_the_servers_date_is_not_read_against_this_hosts_clock() -> None:
    """A date with no Date header to read it against has no trustworthy now here: the wait
    is unknown (the fleet's own back-off applies), never a guess on this host's clock."""
    header = email.utils.formatdate(time.time() + 120, usegmt=True)
    with pytest.raises(ExchangeRateLimited) as caught:
        classify(response(429, headers={"Retry-After": header}), 7200)
    assert caught.value.retry_after is None


@pytest.mark.parametrize("headers", [{}, {"Retry-After": "soon"}, {"Retry-After": ""}])
def test_a_429_without_a_usable_retry_after_has_none(headers: dict[str, str]) -> None:
    with pytest.raises(ExchangeRateLimited) as caught:
        classify(response(429, {"error": "too_many_requests"}, headers), 7200)
    assert caught.value.retry_after is None


@pytest.mark.parametrize("header", ["nan", "inf", "Infinity", "Mon, 99 Foo 2024"])
def test_parse_retry_after_ignores_values_that_are_not_a_time(header: str) -> None:
    assert parse_retry_after(header) is None


@pytest.mark.parametrize("status", [500, 502, 503, 504, 599, 408])
def test_a_5xx_or_408_is_endpoint_unavailable_with_its_status(status: int) -> None:
    with pytest.raises(TokenEndpointUnavailable) as caught:
        classify(response(status, headers={"Retry-After": "7"}), 7200)
    assert caught.value.status == status
    assert caught.value.retry_after == 7.0
    assert caught.value.retryable


@pytest.mark.parametrize(
    "failure",
    [
        requests.ConnectTimeout("connect timed out"),
        requests.ReadTimeout("read timed out"),
        requests.ConnectionError("connection refused"),
        requests.exceptions.SSLError("certificate verify failed"),
    ],
    ids=["connect-timeout", "read-timeout", "refused", "tls"],
)
def test_network_failures_are_endpoint_unavailable(failure: Exception) -> None:
    transport = FakeTransport(failure)
    with pytest.raises(TokenEndpointUnavailable, match="token endpoint") as caught:
        exchange_with(transport)()
    assert caught.value.status is None
    assert caught.value.__cause__ is None  # the request (and its body) is not chained along
    assert caught.value.__suppress_context__


@pytest.mark.parametrize(
    "body",
    [
        b"",  # an HTML page is a wrong base URL, below
        b'["access_token"]',
        b'"access_token"',
        b"null",
        b'{"token": "x"}',
        b'{"access_token": ""}',
        b'{"access_token": "   "}',
        b'{"access_token": null}',
        b'{"access_token": 12345}',
        b'{"access_token": ["x"]}',
        b'{"access_token": "tok\\nen"}',
        b'{"data": {"token": "x"}}',
        b'{"data": "tok-in-a-string"}',
    ],
)
def test_a_2xx_without_a_usable_token_is_malformed(body: bytes) -> None:
    with pytest.raises(MalformedTokenResponse) as caught:
        classify(response(200, body), 7200)
    assert caught.value.retryable


@pytest.mark.parametrize(
    "expires_in",
    [
        "-1",
        "-7200",
        "NaN",
        "Infinity",
        "-Infinity",
        "true",
        "false",
        '"abc"',
        '""',
        "[]",
        "{}",
    ],
)
def test_a_2xx_with_a_bad_expires_in_is_malformed(expires_in: str) -> None:
    body = f'{{"access_token": "{TOKEN_VALUE}", "expires_in": {expires_in}}}'.encode()
    with pytest.raises(MalformedTokenResponse, match="expires_in"):
        classify(response(200, body), 7200)


def test_a_2xx_with_a_lifetime_of_zero_is_a_token_that_expires_now_not_malformed() -> None:
    """A server handing back its last token at the end of its life says 0: the renewal
    decides what such an answer is worth (docs/design.md, "An answer no better")."""
    body = f'{{"access_token": "{TOKEN_VALUE}", "expires_in": 0}}'.encode()
    assert classify(response(200, body), 7200).expires_in == 0.0


def test_a_2xx_with_an_expires_in_too_large_for_a_float_is_malformed() -> None:
    body = f'{{"access_token": "{TOKEN_VALUE}", "expires_in": {"9" * 400}}}'.encode()
    with pytest.raises(MalformedTokenResponse):
        classify(response(200, body), 7200)


@pytest.mark.parametrize(
    ("status", "error"), [(200, MalformedTokenResponse), (401, CredentialsRejected)]
)
def test_a_deeply_nested_body_is_still_classified(
    status: int, error: type[TokenExchangeError]
) -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(error):
        classify(response(status, body), 7200)


def test_a_malformed_answer_names_the_fields_it_had_but_not_their_values() -> None:
    body = {"token": SECRET, "error": "no_token", "hint": "use-this-value-xyz"}
    with pytest.raises(MalformedTokenResponse) as caught:
        classify(response(200, body), 7200, secret=SECRET)
    text = str(caught.value)
    assert "token" in text
    assert "hint" in text
    assert "error=no_token" in text
    assert "use-this-value-xyz" not in text
    assert SECRET not in text


# -- nothing ever leaks the secret -------------------------------------------------------

json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from([TOKEN_VALUE, "", "  ", "7200", "abc", "invalid_client"])
)
json_keys = st.sampled_from(
    ["access_token", "expires_in", "data", "error", "code", "errcode", "error_code", "message"]
) | st.text(max_size=12)


json_values = json_documents(json_leaves, json_keys, list_size=4, object_size=5, max_leaves=12)


# a real secret is random: one that spells words of our own messages (hypothesis finds
# "MERCHANT_API_SEC") would be "found" in the advice text without having leaked
def _not_only_letters(secret: str) -> bool:
    return not secret.replace("_", "").isalpha()


secrets = st.text(
    alphabet=string.ascii_letters + string.digits + "-_", min_size=16, max_size=48
).filter(_not_only_letters)  # a named function, for the reason above


def outcome_of(exchange: Callable[[], IssuedToken]) -> IssuedToken | MerchantError:
    """What one classification gives: the token, or an error of the tree (anything else fails)."""
    try:
        return exchange()
    except (TokenExchangeError, ConfigurationError) as exc:
        return exc


def _echoing(body: Any, secret: str, where: str) -> Any:
    """``body`` with the secret planted the way a careless server might echo it."""
    if not isinstance(body, dict):
        body = {"data": body}
    plants: dict[str, dict[str, Any]] = {
        "error": {"error": secret},
        "code": {"code": secret},
        "message": {"message": f"secret {secret} is wrong"},
        "key": {secret: "x"},
        "data-key": {"data": {secret: 1, "appid": API_KEY}},
        "error-prefix": {"error": "E." + secret},
        "nothing": {},
    }
    return {**body, **plants[where]}


@given(
    status=st.integers(min_value=100, max_value=599),
    body=json_values,
    secret=secrets,
    where=st.sampled_from(
        ["error", "code", "message", "key", "data-key", "error-prefix", "nothing"]
    ),
    retry_after=st.none() | st.text(max_size=30),
)
@hypothesis_settings(database=None, max_examples=300, deadline=None)
def test_classify_gives_a_token_or_a_typed_error_that_never_contains_the_secret(
    status: int, body: Any, secret: str, where: str, retry_after: str | None
) -> None:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    payload = json.dumps(_echoing(body, secret, where)).encode()
    outcome = outcome_of(lambda: classify(response(status, payload, headers), 7200.0, secret))
    if isinstance(outcome, IssuedToken):
        assert outcome.value
        assert outcome.value.strip() == outcome.value
        assert math.isfinite(outcome.expires_in)
        assert outcome.expires_in > 0
    else:
        assert secret not in str(outcome)
        assert secret not in repr(outcome)
        assert all(secret not in str(arg) for arg in outcome.args)


@given(status=st.integers(min_value=100, max_value=599), raw=st.binary(max_size=64))
@hypothesis_settings(database=None, deadline=None)
def test_classify_never_fails_outside_the_error_tree_on_arbitrary_bytes(
    status: int, raw: bytes
) -> None:
    outcome = outcome_of(lambda: classify(response(status, raw), 7200.0, secret=SECRET))
    assert SECRET not in str(outcome)


def test_the_secret_never_reaches_logs_errors_or_repr(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.DEBUG)
    echo = {"error": SECRET, "message": f"bad secret {SECRET}", SECRET: SECRET}
    replies: list[Reply] = [
        response(200, {"access_token": TOKEN_VALUE}),
        response(401, echo),
        response(429, echo, {"Retry-After": "5"}),
        response(503, echo),
        response(200, echo),
        requests.ConnectionError(f"failed sending {SECRET}"),
        requests.ReadTimeout(f"timed out sending {SECRET}"),
    ]
    exchange = exchange_with(FakeTransport(*replies))
    outcomes = [outcome_of(exchange) for _ in replies]
    errors = [outcome for outcome in outcomes if isinstance(outcome, MerchantError)]
    assert len(errors) == len(replies) - 1
    texts = [repr(exchange), str(exchange)] + [f"{error} {error!r}" for error in errors]
    assert all(SECRET not in text for text in texts)
    assert caplog.records, "the exchange logs its answers at DEBUG"
    for record in caplog.records:
        assert SECRET not in record.getMessage()
        assert SECRET not in repr(record.args)


# -- sizes and the total deadline ----------------------------------------------------------


def test_a_token_longer_than_8_kib_is_a_malformed_response() -> None:
    long_token = "a" * (MAX_TOKEN_LENGTH + 1)
    with pytest.raises(MalformedTokenResponse, match="longer than 8 KiB"):
        exchange_with(ok({"access_token": long_token, "expires_in": 7200}))()


def test_a_token_response_longer_than_64_kib_is_a_malformed_response() -> None:
    body = {"access_token": TOKEN_VALUE, "expires_in": 7200, "padding": "x" * TOKEN_BODY_LIMIT}
    with pytest.raises(MalformedTokenResponse, match="longer than 64 KiB"):
        exchange_with(ok(body))()


def test_an_endpoint_dripping_its_answer_is_cut_off_at_the_exchanges_deadline(
    dripping: DripServer,
) -> None:
    """Each byte comes well within the read timeout, of the headers or of the body; the
    answer as a whole never does. The exchange gives up at its deadline and hangs up,
    leaving nothing in flight."""
    exchange = TokenExchange(dripping.url, API_KEY, Secret(SECRET), timeout=DRIP_TIMEOUT)
    with pytest.raises(TokenEndpointUnavailable, match=r"did not finish its answer within 0.75 s"):
        exchange()
    wait_until(lambda: dripping.hung_up == 1, "the server notices the hang-up", timeout=10.0)
    assert dripping.finished == 0


def test_an_injected_session_is_cut_off_at_the_deadline_once_its_headers_are_in() -> None:
    """A session of the caller's own (not the exchange's) has pools that show nothing: the
    exchange finds the connection on the answer and still cuts its body at the deadline."""
    server = DripServer(drip=DRIP, dripped="body")
    threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL,), daemon=True).start()
    session = requests.Session()
    try:
        exchange = TokenExchange(
            server.url, API_KEY, Secret(SECRET), session=session, timeout=DRIP_TIMEOUT
        )
        with pytest.raises(TokenEndpointUnavailable, match=r"did not finish its answer"):
            exchange()
        wait_until(lambda: server.hung_up == 1, "the server notices the hang-up", timeout=10.0)
        assert server.finished == 0
    finally:
        session.close()
        server.shutdown()
        server.server_close()
