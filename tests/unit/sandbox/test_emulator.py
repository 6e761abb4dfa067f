"""The sandbox emulator (sandbox/emulator.py) behaves as the payment API's auth is specified
to, served through werkzeug's test client."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from werkzeug.test import Client, TestResponse

from merchant_tasks.sandbox.emulator import (
    DEFAULT_PORT,
    TOKEN_PATH,
    SandboxClock,
    SandboxConfig,
    SandboxServer,
)
from support.at_once import at_once
from support.emulator_app import API_KEY, GOOD_BODY, SECRET, make_app
from support.routes import PING

INVALID_CLIENT = b'{"error": "invalid_client", "message": "unknown appid or wrong secret"}'


def exchange(client: Client, body: Any = None, **headers: str) -> TestResponse:
    return client.post(TOKEN_PATH, json=GOOD_BODY if body is None else body, headers=headers)


def token_of(client: Client) -> str:
    response = exchange(client)
    assert response.status_code == 200
    token: str = body_of(response)["access_token"]
    return token


def call(
    client: Client, token: str, path: str = PING, method: str = "GET", **kw: Any
) -> TestResponse:
    return client.open(path, method=method, headers={"Authorization": f"Bearer {token}"}, **kw)


def body_of(response: TestResponse) -> Any:
    return json.loads(response.data)


def error_of(response: TestResponse) -> str:
    code: str = body_of(response)["error"]
    return code


def raw(response: TestResponse) -> bytes:
    """Status line, headers and body, as they would go over the wire."""
    head = "".join(f"{name}: {value}\n" for name, value in response.headers.items())
    body: bytes = response.get_data()
    return f"{response.status}\n{head}".encode() + body


# --- exchange: success --------------------------------------------------------------------


def test_exchange_returns_a_fresh_bearer_token_at_the_top_level() -> None:
    client = Client(make_app(lifetime=7200.0))
    first, second = exchange(client), exchange(client)
    assert first.status_code == 200
    assert first.headers["Cache-Control"] == "no-store"
    assert body_of(first)["token_type"] == "Bearer"
    assert body_of(first)["expires_in"] == 7200
    assert body_of(first)["access_token"].startswith("sbx_")
    assert body_of(first)["access_token"] != body_of(second)["access_token"]


def test_exchange_in_data_shape_wraps_the_grant_in_an_envelope() -> None:
    body = body_of(exchange(Client(make_app(token_shape="data", lifetime=60.5))))
    assert body["code"] == 0
    assert body["message"] == "ok"
    assert set(body["data"]) == {"access_token", "token_type", "expires_in"}
    assert body["data"]["expires_in"] == 60


@pytest.mark.parametrize("shape", ["top", "data"])
def test_exchange_can_leave_out_expires_in(shape: str) -> None:
    body = body_of(exchange(Client(make_app(token_shape=shape, include_expires_in=False))))
    grant = body if shape == "top" else body["data"]
    assert set(grant) == {"access_token", "token_type"}


def test_exchange_accepts_json_content_type_with_parameters() -> None:
    client = Client(make_app())
    response = client.post(
        TOKEN_PATH,
        data=b'{"grant_type": "client_credential", "appid": "%s", "secret": "%s"}'
        % (API_KEY.encode(), SECRET.encode()),
        content_type="Application/JSON; charset=utf-8",
    )
    assert response.status_code == 200


# --- exchange: every failure rule ---------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_exchange_without_json_content_type_is_415(content_type: str | None) -> None:
    client = Client(make_app())
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = client.post(TOKEN_PATH, data=b"{}", headers=headers)
    assert response.status_code == 415
    assert error_of(response) == "unsupported_media_type"


@pytest.mark.parametrize("data", [b"{not json", b"", b"\xff\xfe{}"])
def test_exchange_with_malformed_json_is_400_invalid_json(data: bytes) -> None:
    response = Client(make_app()).post(TOKEN_PATH, data=data, content_type="application/json")
    assert response.status_code == 400
    assert error_of(response) == "invalid_json"


@pytest.mark.parametrize("data", [b"[]", b'"text"', b"null", b"7"])
def test_exchange_with_a_non_object_body_is_400_invalid_body(data: bytes) -> None:
    response = Client(make_app()).post(TOKEN_PATH, data=data, content_type="application/json")
    assert response.status_code == 400
    assert error_of(response) == "invalid_body"


@pytest.mark.parametrize("grant_type", ["client_credentials", "password", None, 1, ""])
def test_exchange_with_another_grant_type_is_400(grant_type: Any) -> None:
    response = exchange(Client(make_app()), {**GOOD_BODY, "grant_type": grant_type})
    assert response.status_code == 400
    assert error_of(response) == "unsupported_grant_type"


def test_exchange_without_grant_type_is_400() -> None:
    body = {"appid": API_KEY, "secret": SECRET}
    assert error_of(exchange(Client(make_app()), body)) == "unsupported_grant_type"


@pytest.mark.parametrize(
    "changes",
    [
        {"appid": "other"},
        {"secret": "wrong"},
        {"appid": "other", "secret": "wrong"},
        {"secret": SECRET.upper()},
        {"secret": SECRET + " "},
        {"secret": None},
        {"secret": 42},
        {"appid": [API_KEY]},
        {"secret": "\ud800"},  # a lone surrogate, valid in JSON but not in UTF-8
        {"appid": ""},
    ],
)
def test_exchange_with_wrong_credentials_is_401_invalid_client(changes: dict[str, Any]) -> None:
    response = exchange(Client(make_app()), {**GOOD_BODY, **changes})
    assert response.status_code == 401
    assert response.data == INVALID_CLIENT


def test_a_key_family_stands_for_many_accounts_with_one_secret() -> None:
    family = Client(make_app(key_family=True))
    assert exchange(family, {**GOOD_BODY, "appid": f"{API_KEY}.shop-7"}).status_code == 200
    for appid in (f"{API_KEY}shop-7", f"other.{API_KEY}.x"):
        assert exchange(family, {**GOOD_BODY, "appid": appid}).data == INVALID_CLIENT
    wrong_secret = {**GOOD_BODY, "appid": f"{API_KEY}.shop-7", "secret": "nope"}
    assert exchange(family, wrong_secret).data == INVALID_CLIENT
    alone = Client(make_app())
    assert exchange(alone, {**GOOD_BODY, "appid": f"{API_KEY}.shop-7"}).data == INVALID_CLIENT


def test_exchange_without_credentials_is_401() -> None:
    response = exchange(Client(make_app()), {"grant_type": "client_credential"})
    assert error_of(response) == "invalid_client"


def test_exchange_with_get_is_405() -> None:
    response = Client(make_app()).get(TOKEN_PATH)
    assert response.status_code == 405
    assert response.headers["Allow"] == "POST"


def test_exchange_checks_rate_limit_then_injected_errors_then_the_request() -> None:
    client = Client(make_app(rate_limit=1, token_error_rate=1.0))
    bad_request = {"headers": {"Content-Type": "text/plain"}, "data": b"x"}
    assert error_of(client.post(TOKEN_PATH, **bad_request)) == "injected_failure"
    assert error_of(client.post(TOKEN_PATH, **bad_request)) == "rate_limited"


# --- tokens: expiry, revocation, secret reset ---------------------------------------------


def test_token_is_valid_until_its_lifetime_has_passed() -> None:
    app = make_app(lifetime=100.0)
    client = Client(app)
    token = token_of(client)
    app.clock.advance(99.9)
    assert call(client, token).status_code == 200
    app.clock.advance(0.1)
    response = call(client, token)
    assert response.status_code == 401
    assert error_of(response) == "token_expired"


def test_lifetime_changed_at_runtime_applies_to_new_tokens() -> None:
    app = make_app(lifetime=100.0)
    client = Client(app)
    old = token_of(client)
    app.configure({"lifetime": 10.0})
    new = token_of(client)
    app.clock.advance(50)
    assert error_of(call(client, new)) == "token_expired"
    assert call(client, old).status_code == 200


def test_issuing_keeps_earlier_tokens_valid_by_default() -> None:
    client = Client(make_app())
    first, second = token_of(client), token_of(client)
    assert call(client, first).status_code == 200
    assert call(client, second).status_code == 200


def test_revoke_on_issue_revokes_every_earlier_token() -> None:
    client = Client(make_app(revoke_on_issue=True))
    first, second, third = token_of(client), token_of(client), token_of(client)
    assert error_of(call(client, first)) == "token_revoked"
    assert error_of(call(client, second)) == "token_revoked"
    assert call(client, third).status_code == 200


def test_hand_back_live_token_returns_the_last_token_with_its_remaining_lifetime() -> None:
    app = make_app(hand_back_live_token=True, lifetime=30.0)
    client = Client(app)
    first = body_of(exchange(client))
    app.clock.advance(12.05)
    again = body_of(exchange(client))
    assert again["access_token"] == first["access_token"]
    assert again["expires_in"] == 17  # whole seconds left
    app.clock.advance(17.0)  # in its last second: 0 left, still the same token
    assert body_of(exchange(client)) == {**again, "expires_in": 0}
    app.clock.advance(1.0)  # expired: a new one
    assert body_of(exchange(client))["access_token"] != first["access_token"]


def test_hand_back_live_token_issues_a_new_one_once_the_last_is_revoked() -> None:
    app = make_app(hand_back_live_token=True)
    client = Client(app)
    first = token_of(client)
    app.revoke_all()
    second = token_of(client)
    assert second != first
    assert call(client, second).status_code == 200


def test_refuse_all_calls_refuses_even_a_fresh_token_while_the_token_endpoint_issues() -> None:
    app = make_app(refuse_all_calls=True)
    client = Client(app)
    token = token_of(client)
    response = call(client, token)
    assert (response.status_code, error_of(response)) == (401, "refused_by_api")
    assert app.counters()["exchanges"]["ok"] == 1
    app.configure({"refuse_all_calls": False})
    assert call(client, token).status_code == 200


def test_revoke_all_revokes_every_token_but_allows_new_ones() -> None:
    app = make_app()
    client = Client(app)
    first, second = token_of(client), token_of(client)
    app.revoke_all()
    assert error_of(call(client, first)) == "token_revoked"
    third = token_of(client)
    assert body_of(client.post("/_sandbox/revoke-all")) == {"ok": True}
    assert {error_of(call(client, t)) for t in (second, third)} == {"token_revoked"}
    assert app.counters()["active_tokens"] == 0


def test_reset_secret_revokes_tokens_and_only_the_new_secret_works() -> None:
    app = make_app()
    client = Client(app)
    old_token = token_of(client)
    assert app.reset_secret("brand-new-secret") == "brand-new-secret"
    assert error_of(call(client, old_token)) == "token_revoked"
    assert error_of(exchange(client)) == "invalid_client"
    assert exchange(client, {**GOOD_BODY, "secret": "brand-new-secret"}).status_code == 200


def test_reset_secret_endpoint_generates_a_random_secret_by_default() -> None:
    app = make_app()
    client = Client(app)
    old_token = token_of(client)
    new_secret = body_of(client.post("/_sandbox/reset-secret"))["secret"]
    assert len(new_secret) == 32
    assert new_secret != SECRET
    assert new_secret != body_of(client.post("/_sandbox/reset-secret"))["secret"]
    assert error_of(call(client, old_token)) == "token_revoked"


def test_reset_secret_endpoint_takes_a_chosen_secret() -> None:
    app = make_app()
    client = Client(app)
    assert body_of(client.post("/_sandbox/reset-secret", json={"secret": "chosen"})) == {
        "secret": "chosen"
    }
    assert exchange(client, {**GOOD_BODY, "secret": "chosen"}).status_code == 200
    response = client.post("/_sandbox/reset-secret", json={"secret": ""})
    assert error_of(response) == "invalid_body"
    assert app.config.secret == "chosen"


# --- business endpoints -------------------------------------------------------------------


@pytest.mark.parametrize(
    "authorization", [None, "", "Basic abc", "Bearer", "Bearer ", "Bearer a b", "Token abc"]
)
def test_call_without_a_bearer_header_is_401_missing_token(authorization: str | None) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    response = Client(make_app()).get(PING, headers=headers)
    assert response.status_code == 401
    assert error_of(response) == "missing_token"
    assert response.headers["WWW-Authenticate"] == 'Bearer error="invalid_token"'


def test_call_with_an_unknown_token_is_401_invalid_token() -> None:
    response = call(Client(make_app()), "sbx_made_up")
    assert response.status_code == 401
    assert error_of(response) == "invalid_token"
    assert response.headers["WWW-Authenticate"] == 'Bearer error="invalid_token"'


def test_bearer_scheme_is_case_insensitive() -> None:
    client = Client(make_app())
    token = token_of(client)
    assert client.get(PING, headers={"Authorization": f"bearer {token}"}).status_code == 200


def test_unknown_paths_need_a_token_and_then_answer_404() -> None:
    client = Client(make_app())
    assert error_of(client.get("/open-api/v1/nowhere")) == "missing_token"
    response = call(client, token_of(client), "/open-api/v1/nowhere")
    assert response.status_code == 404
    assert error_of(response) == "not_found"
    assert error_of(client.get("/elsewhere")) == "not_found"


def test_wrong_method_on_a_known_endpoint_is_405() -> None:
    client = Client(make_app())
    response = call(client, token_of(client), PING, method="DELETE")
    assert response.status_code == 405
    assert error_of(response) == "method_not_allowed"
    assert "GET" in response.headers["Allow"]


def test_sample_endpoints_answer_as_documented() -> None:
    client = Client(make_app(environment="staging"))
    token = token_of(client)
    assert body_of(call(client, token)) == {"ok": True}
    profile = body_of(call(client, token, "/open-api/v1/merchant/profile"))
    assert profile == {"appid": API_KEY, "environment": "staging"}
    echo = call(client, token, "/open-api/v1/echo", "POST", json={"a": [1, 2]})
    assert body_of(echo) == {"echo": {"a": [1, 2]}}


def test_echo_needs_a_json_body() -> None:
    client = Client(make_app())
    response = call(client, token_of(client), "/open-api/v1/echo", "POST", data=b"{oops")
    assert response.status_code == 400
    assert error_of(response) == "invalid_json"


def test_payments_are_created_and_read_back() -> None:
    client = Client(make_app())
    token = token_of(client)
    created = call(client, token, "/open-api/v1/payments", "POST", json={"amount": 1250})
    assert created.status_code == 201
    assert body_of(created) == {"id": "pay_1", "amount": 1250, "status": "created"}
    second = body_of(call(client, token, "/open-api/v1/payments", "POST", json={"amount": 5}))
    assert second["id"] == "pay_2"
    assert body_of(call(client, token, "/open-api/v1/payments/pay_1")) == body_of(created)
    missing = call(client, token, "/open-api/v1/payments/pay_99")
    assert missing.status_code == 404
    assert error_of(missing) == "not_found"


def test_a_payment_repeated_with_its_idempotency_key_is_the_first_one_and_creates_none() -> None:
    client = Client(make_app())
    token = token_of(client)
    auth = {"Authorization": f"Bearer {token}"}
    once = {**auth, "Idempotency-Key": "order-17"}
    first = client.post("/open-api/v1/payments", headers=once, json={"amount": 1250})
    again = client.post("/open-api/v1/payments", headers=once, json={"amount": 1250})
    other = client.post("/open-api/v1/payments", headers=auth, json={"amount": 1250})
    assert first.status_code == again.status_code == 201
    assert body_of(again) == body_of(first) == {"id": "pay_1", "amount": 1250, "status": "created"}
    assert again.headers["Idempotent-Replayed"] == "true"
    assert body_of(other)["id"] == "pay_2"  # no key: a new payment
    reused = client.post("/open-api/v1/payments", headers=once, json={"amount": 5})
    assert reused.status_code == 422
    assert error_of(reused) == "idempotency_key_reused"
    assert call(client, token, "/open-api/v1/payments/pay_3").status_code == 404


@pytest.mark.parametrize("body", [{"currency": "EUR"}, [1250]])
def test_a_payment_without_an_amount_is_400(body: Any) -> None:
    client = Client(make_app())
    response = call(client, token_of(client), "/open-api/v1/payments", "POST", json=body)
    assert response.status_code == 400
    assert error_of(response) == "invalid_body"


# --- rate limit, latency, injected errors -------------------------------------------------


def test_rate_limit_answers_429_with_retry_after_until_a_slot_frees() -> None:
    app = make_app(rate_limit=2, rate_window=60.0)
    client = Client(app)
    assert exchange(client).status_code == 200
    app.clock.advance(10.5)
    assert exchange(client).status_code == 200
    limited = exchange(client)
    assert limited.status_code == 429
    assert error_of(limited) == "rate_limited"
    assert limited.headers["Retry-After"] == "50"  # ceil(60 - 10.5)
    app.clock.advance(49.4)
    assert exchange(client).headers["Retry-After"] == "1"  # never 0, even with 0.1 s left
    app.clock.advance(0.1)
    assert exchange(client).status_code == 200  # the first slot has aged out
    assert exchange(client).status_code == 429  # the second one has not


def test_rate_limit_counts_every_request_to_the_token_endpoint() -> None:
    client = Client(make_app(rate_limit=2))
    assert error_of(exchange(client, {**GOOD_BODY, "secret": "wrong"})) == "invalid_client"
    assert error_of(client.get(TOKEN_PATH)) == "method_not_allowed"
    assert error_of(exchange(client)) == "rate_limited"


def test_rate_limit_lowered_at_runtime_waits_for_enough_slots() -> None:
    app = make_app(rate_limit=3, rate_window=30.0)
    client = Client(app)
    for _ in range(3):
        exchange(client)
        app.clock.advance(5)
    app.configure({"rate_limit": 1})
    # Exchanges at 0, 5 and 10 s, now 15 s: all three must age out, the last at 40 s.
    assert exchange(client).headers["Retry-After"] == "25"


def test_rate_limit_holds_exactly_under_concurrent_requests() -> None:
    app = make_app(rate_limit=10)
    clients = [Client(app) for _ in range(40)]
    statuses = at_once(40, lambda n: exchange(clients[n]).status_code)
    assert sorted(statuses) == [200] * 10 + [429] * 30
    assert app.counters()["exchanges"] == {"ok": 10, "rejected": 0, "rate_limited": 30, "failed": 0}


def test_latency_goes_through_the_injected_sleep() -> None:
    sleeps: list[float] = []
    client = Client(make_app(sleeps, token_latency=0.25, api_latency=0.1))
    token = token_of(client)
    call(client, token)
    call(client, "sbx_unknown")  # rejected before the latency, as a real gateway would
    assert sleeps == [0.25, 0.1]


def test_no_latency_means_no_sleep() -> None:
    sleeps: list[float] = []
    client = Client(make_app(sleeps))
    call(client, token_of(client))
    assert sleeps == []


@pytest.mark.parametrize(("status", "retry_after"), [(503, "1"), (429, "1"), (500, None)])
def test_injected_token_failure_uses_the_configured_status(
    status: int, retry_after: str | None
) -> None:
    response = exchange(Client(make_app(token_error_rate=1.0, error_status=status)))
    assert response.status_code == status
    assert error_of(response) == "injected_failure"
    assert response.headers.get("Retry-After") == retry_after


@pytest.mark.parametrize(("status", "retry_after"), [(503, "1"), (429, "1"), (502, None)])
def test_injected_api_failure_comes_after_auth(status: int, retry_after: str | None) -> None:
    app = make_app(api_error_rate=1.0, error_status=status)
    client = Client(app)
    assert error_of(call(client, "sbx_unknown")) == "invalid_token"
    response = call(client, token_of(client))
    assert response.status_code == status
    assert error_of(response) == "injected_failure"
    assert response.headers.get("Retry-After") == retry_after


def test_error_rate_is_a_probability_reproducible_with_a_seeded_rng() -> None:
    def failures(seed: int) -> list[int]:
        client = Client(make_app(seed=seed, token_error_rate=0.3))
        return [i for i in range(200) if exchange(client).status_code == 503]

    assert 30 <= len(failures(1)) <= 90
    assert failures(1) == failures(1)
    assert failures(1) != failures(2)


# --- counters -----------------------------------------------------------------------------


def test_counters_count_exchanges_calls_and_endpoint_templates() -> None:
    app = make_app()
    client = Client(app)
    token = token_of(client)
    exchange(client, {**GOOD_BODY, "secret": "wrong"})
    call(client, token)
    call(client, "sbx_unknown")
    call(client, token, "/open-api/v1/payments/pay_1")
    call(client, token, "/open-api/v1/payments/pay_2")
    call(client, token, "/open-api/v1/nowhere")
    call(client, token, PING, "POST")
    app.configure({"api_error_rate": 1.0})
    call(client, token)
    counters = app.counters()
    assert counters["exchanges"] == {"ok": 1, "rejected": 1, "rate_limited": 0, "failed": 0}
    assert counters["calls"] == {
        "ok": 1,
        "unauthorized": 1,
        "failed": 1,
        "not_found": 3,
        "rejected": 1,
    }
    assert counters["endpoints"]["GET /open-api/v1/ping"] == {
        "ok": 1,
        "unauthorized": 1,
        "failed": 1,
        "not_found": 0,
        "rejected": 0,
    }
    assert counters["endpoints"]["GET /open-api/v1/payments/{id}"]["not_found"] == 2
    assert set(counters["endpoints"]) == {
        "GET /open-api/v1/ping",
        "GET /open-api/v1/payments/{id}",
    }
    assert counters["active_tokens"] == 1
    assert body_of(Client(app).get("/_sandbox/counters")) == counters


def test_counters_reset_but_tokens_stay() -> None:
    app = make_app(rate_limit=1)
    client = Client(app)
    exchange(client)
    exchange(client)
    assert body_of(client.post("/_sandbox/reset-counters")) == {"ok": True}
    assert app.counters() == {
        "exchanges": {"ok": 0, "rejected": 0, "rate_limited": 0, "failed": 0},
        "calls": {"ok": 0, "unauthorized": 0, "failed": 0, "not_found": 0, "rejected": 0},
        "endpoints": {},
        "active_tokens": 1,
    }


def test_active_tokens_leave_out_expired_and_revoked_ones() -> None:
    app = make_app(lifetime=10.0)
    client = Client(app)
    token_of(client)
    app.clock.advance(10)
    token_of(client)
    token_of(client)
    assert app.counters()["active_tokens"] == 2
    app.revoke_all()
    assert app.counters()["active_tokens"] == 0


# --- control endpoints --------------------------------------------------------------------


def test_control_config_changes_behaviour_at_runtime() -> None:
    app = make_app()
    client = Client(app)
    response = client.post("/_sandbox/config", json={"token_shape": "data", "lifetime": 30})
    assert response.status_code == 200
    assert body_of(response)["token_shape"] == "data"
    assert "secret" not in body_of(response)
    assert "api_key" not in body_of(response)
    assert body_of(exchange(client))["data"]["expires_in"] == 30
    assert body_of(client.get("/_sandbox/config")) == body_of(response)


@pytest.mark.parametrize(
    "changes",
    [
        {"nonsense": 1},
        {"secret": "new"},
        {"api_key": "other"},
        {"lifetime": "7200"},
        {"lifetime": 0},
        {"rate_limit": 0},
        {"rate_limit": 2.5},
        {"rate_limit": True},
        {"token_error_rate": 1.5},
        {"error_status": 200},
        {"token_shape": "nested"},
        {"revoke_on_issue": 1},
        {"environment": ""},
        {"lifetime": 10, "nonsense": 1},
    ],
)
def test_control_config_rejects_bad_fields_and_changes_nothing(changes: dict[str, Any]) -> None:
    app = make_app()
    response = Client(app).post("/_sandbox/config", json=changes)
    assert response.status_code == 400
    assert error_of(response) == "invalid_config"
    assert app.config == SandboxConfig(API_KEY, SECRET)


def test_control_config_needs_a_json_object() -> None:
    client = Client(make_app())
    assert error_of(client.post("/_sandbox/config", json=[1])) == "invalid_body"


def test_control_clock_advances_the_emulator_clock() -> None:
    app = make_app(lifetime=60.0)
    client = Client(app)
    token = token_of(client)
    before = app.clock.now()
    now = body_of(client.post("/_sandbox/clock", json={"advance": 60}))["now"]
    assert now >= before + 60
    assert error_of(call(client, token)) == "token_expired"


@pytest.mark.parametrize("body", [{}, {"advance": -1}, {"advance": "5"}, {"advance": True}])
def test_control_clock_rejects_anything_but_a_forward_step(body: dict[str, Any]) -> None:
    response = Client(make_app()).post("/_sandbox/clock", json=body)
    assert response.status_code == 400
    assert error_of(response) == "invalid_body"


def test_control_tokens_lists_every_token_ever_issued() -> None:
    app = make_app(revoke_on_issue=True)
    client = Client(app)
    tokens = [token_of(client) for _ in range(3)]
    assert app.issued_tokens() == tokens
    assert body_of(client.get("/_sandbox/tokens")) == {"tokens": tokens}


def test_control_endpoints_refuse_wrong_methods_and_unknown_names() -> None:
    client = Client(make_app())
    assert client.get("/_sandbox/revoke-all").status_code == 405
    assert error_of(client.get("/_sandbox/nothing")) == "not_found"


# --- configuration and secrecy ------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"secret": ""},
        {"api_key": ""},
        {"lifetime": -1.0},
        {"rate_window": 0.0},
        {"token_latency": -1},
    ],
)
def test_sandbox_config_validates_its_fields(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be"):
        SandboxConfig(**{"api_key": API_KEY, "secret": SECRET, **overrides})


def test_sandbox_config_repr_hides_the_secret() -> None:
    assert SECRET not in repr(SandboxConfig(API_KEY, SECRET))


def test_clock_only_moves_forward() -> None:
    clock = SandboxClock()
    with pytest.raises(ValueError, match="advance"):
        clock.advance(-1)


def test_secret_never_appears_in_any_response() -> None:
    app = make_app(rate_limit=20)
    client = Client(app)
    token = token_of(client)
    exchanges = [
        exchange(client, {**GOOD_BODY, "appid": "x"}),
        exchange(client, {**GOOD_BODY, "secret": SECRET + "x"}),
        exchange(client, {**GOOD_BODY, "grant_type": SECRET}),
        exchange(client, {"secret": SECRET, "appid": API_KEY}),
        exchange(client, [SECRET, API_KEY]),
        client.post(TOKEN_PATH, data=SECRET.encode(), content_type="text/plain"),
        client.post(TOKEN_PATH, data=SECRET.encode(), content_type="application/json"),
        client.get(TOKEN_PATH, query_string={"secret": SECRET}),
    ]
    others = [
        call(client, token),
        call(client, SECRET),
        call(client, token, "/open-api/v1/merchant/profile"),
        call(client, token, f"/open-api/v1/{SECRET}"),
        call(client, token, f"/open-api/v1/payments/{SECRET}"),
        client.get("/_sandbox/counters"),
        client.get("/_sandbox/config"),
        client.post("/_sandbox/config", json={"secret": SECRET}),
        client.post("/_sandbox/config", json={"api_key": SECRET}),
        client.post("/_sandbox/config", json={"lifetime": SECRET}),
    ]
    app.configure({"token_error_rate": 1.0})
    exchanges.append(exchange(client))
    app.configure({"rate_limit": 1})
    exchanges.append(exchange(client))
    assert [r.status_code for r in exchanges[-3:]] == [405, 503, 429]
    for response in exchanges:
        assert SECRET.encode() not in raw(response)
        assert API_KEY.encode() not in raw(response)
    for response in others:
        assert SECRET.encode() not in raw(response)


@given(appid=st.text(max_size=40), secret=st.text(max_size=40))
def test_any_wrong_credentials_are_refused_without_echo(appid: str, secret: str) -> None:
    body = {**GOOD_BODY, "appid": appid, "secret": secret}
    response = exchange(Client(make_app()), body)
    if appid == API_KEY and secret == SECRET:
        assert response.status_code == 200
        return
    # The answer is the same bytes whatever was sent, so nothing sent can be in it.
    assert response.status_code == 401
    assert response.data == INVALID_CLIENT
    assert set(response.headers.keys()) == {"Content-Type", "Content-Length"}


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::", "example.com"])  # noqa: S104
def test_server_refuses_to_listen_beyond_loopback(host: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        SandboxServer(make_app(), host=host)


def test_default_port_matches_the_default_base_url() -> None:
    assert DEFAULT_PORT == 8480
