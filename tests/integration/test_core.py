"""The core against the real Redis and the sandbox emulator on loopback."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from merchant_tasks.accounts import FleetClient, client_for
from merchant_tasks.api.exchange import TokenExchange
from merchant_tasks.exceptions import (
    ConfigurationError,
    CredentialsRejected,
    MerchantError,
    TokenExchangeError,
)
from merchant_tasks.sandbox.emulator import SandboxApp, SandboxConfig, SandboxServer
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import spawn, wait_all_ready, wait_until
from merchant_tasks.settings import FleetSettings, Secret, Settings
from merchant_tasks.token import IssuedToken
from support.account import TEST_API_KEY, TEST_SECRET
from support.at_once import at_once
from support.paths import SUPPORT
from support.routes import PING
from support.strategies import json_documents

pytestmark = pytest.mark.integration

STORM_THREADS = 64
STORM_PROCESSES = 8


def test_exchanges_once_and_calls_through_the_emulator(
    merchant_client: FleetClient, merchant_sandbox: MerchantSandbox
) -> None:
    assert merchant_client.request("GET", PING) == {"ok": True}
    assert merchant_client.request("POST", "/open-api/v1/echo", json={"amount": 12}) == {
        "echo": {"amount": 12}
    }
    assert merchant_sandbox.exchanges()["ok"] == 1
    assert merchant_sandbox.calls()["ok"] == 2


def test_threads_hitting_a_revoke_all_at_once_make_exactly_one_exchange(
    merchant_client: FleetClient, merchant_sandbox: MerchantSandbox
) -> None:
    merchant_client.request("GET", PING)
    merchant_sandbox.app.revoke_all()
    results = at_once(STORM_THREADS, lambda _: merchant_client.request("GET", PING))
    assert results == [{"ok": True}] * STORM_THREADS
    assert merchant_sandbox.exchanges()["ok"] == 2  # the first token, then one for the whole storm
    print(
        f"\nstorm of {STORM_THREADS} threads: {merchant_sandbox.exchanges()['ok'] - 1} exchange(s)"
    )


def test_processes_hitting_a_revoke_all_at_once_make_exactly_one_exchange(
    merchant_client: FleetClient,
    merchant_sandbox: MerchantSandbox,
    merchant_settings: Settings,
    redis_client: redis.Redis,
    merchant_key_prefix: str,
    merchant_secret_file: Path,
    tmp_path: Path,
) -> None:
    merchant_client.request("GET", PING)
    merchant_sandbox.app.revoke_all()
    ready_key, go_key = f"{merchant_key_prefix}:test:ready", f"{merchant_key_prefix}:test:go"
    env = {
        **os.environ,
        "MERCHANT_API_KEY": TEST_API_KEY,
        "MERCHANT_API_SECRET_FILE": str(merchant_secret_file),
        "MERCHANT_BASE_URL": merchant_sandbox.url,
        "MERCHANT_REDIS_URL": merchant_settings.fleet.redis_url,
        "MERCHANT_KEY_PREFIX": merchant_key_prefix,
        "STORM_READY_KEY": ready_key,
        "STORM_GO_KEY": go_key,
    }
    env.pop("MERCHANT_API_SECRET", None)
    worker = SUPPORT / "storm_worker.py"
    processes = [
        spawn(
            f"storm worker {n}",
            [sys.executable, str(worker), "5"],
            tmp_path / f"storm-{n}.log",
            env=env,
            stdout_pipe=True,
        )
        for n in range(STORM_PROCESSES)
    ]
    try:
        wait_all_ready(
            processes,
            lambda: int(redis_client.get(ready_key) or 0) == STORM_PROCESSES,
            "storm workers ready",
            60,
        )
        redis_client.set(go_key, 1)
        outputs = [json.loads(p.output(timeout=60)) for p in processes]
    finally:
        for p in processes:
            p.stop()
    assert [o["errors"] for o in outputs] == [[]] * STORM_PROCESSES
    assert sum(o["ok"] for o in outputs) == 5 * STORM_PROCESSES
    assert merchant_sandbox.exchanges()["ok"] == 2
    renewals = merchant_sandbox.exchanges()["ok"] - 1
    print(f"\nstorm of {STORM_PROCESSES} processes: {renewals} exchange(s)")


def test_revoke_on_issue_causes_no_401_loop(
    merchant_client: FleetClient, merchant_sandbox: MerchantSandbox
) -> None:
    merchant_sandbox.app.config.revoke_on_issue = True
    merchant_client.request("GET", PING)
    stop = threading.Event()
    failures: list[str] = []
    successes = [0] * 8  # per thread

    def keep_calling(n: int) -> None:
        while not stop.is_set():
            try:
                merchant_client.request("GET", PING)
                successes[n] += 1
            except MerchantError as exc:
                failures.append(repr(exc))

    threads = [threading.Thread(target=keep_calling, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    renewals = 5
    for _ in range(renewals):
        # every thread gets through a call between two renewals; a call that met two of them
        # would rightly give up (its third 401 in a row)
        seen = list(successes)

        def every_thread_got_through(seen: list[int] = seen) -> bool:
            return all(now > then for now, then in zip(successes, seen, strict=True))

        wait_until(every_thread_got_through, "a successful call in every thread", 10.0)
        merchant_client.manager.renew(force=True)  # each revokes every token in flight
    stop.set()
    for t in threads:
        t.join()

    assert failures == []
    assert merchant_sandbox.exchanges()["ok"] == 1 + renewals
    # a call in flight with the revoked token gets one 401, then uses the new token
    assert merchant_sandbox.calls()["unauthorized"] <= 8 * renewals


def test_a_slow_exchange_racing_a_newer_one_never_overwrites_it(
    merchant_sandbox_config: SandboxConfig, merchant_settings: Settings, redis_client: redis.Redis
) -> None:
    app = SandboxApp(merchant_sandbox_config)
    hold_exchanges = threading.Event()  # while set, token requests wait for ``release``
    slow_request_arrived = threading.Event()
    release = threading.Event()

    def watching(environ: dict[str, Any], start_response: Any) -> Any:
        if environ["PATH_INFO"].endswith("/access_token") and hold_exchanges.is_set():
            hold_exchanges.clear()
            slow_request_arrived.set()
            assert release.wait(30)
        return app(environ, start_response)

    with SandboxServer(watching) as server:  # type: ignore[arg-type]  # any WSGI app serves
        account = dataclasses.replace(merchant_settings, base_url=server.url)
        client = client_for(account, redis_client=redis_client)
        # the newer renewal comes from another process (threads of one process take turns)
        other_process = client_for(account, redis_client=redis_client)
        store = client.manager.store
        client.request("GET", PING)
        hold_exchanges.set()
        slow_result: list[Any] = []
        slow = threading.Thread(target=lambda: slow_result.append(client.manager.renew(force=True)))
        slow.start()
        assert slow_request_arrived.wait(10)
        redis_client.delete(store.keys.lock)  # as if the slow holder's lock had expired
        newer = other_process.manager.renew(force=True)
        assert slow.is_alive()  # its exchange is still held
        release.set()
        slow.join()

    stored = store.load()
    assert stored is not None
    assert stored.value == newer.value
    assert stored.generation == newer.generation == 2
    assert slow_result == [newer]  # the slow renewal hands back the newer token
    assert app.counters()["exchanges"]["ok"] == 3  # first token, the slow one, the newer one


def test_breaker_stops_hammering_a_reset_secret_and_recovers_after_rotation(
    merchant_client: FleetClient, merchant_sandbox: MerchantSandbox, merchant_secret_file: Path
) -> None:
    merchant_client.request("GET", PING)
    new_secret = merchant_sandbox.app.reset_secret("rotated-secret-8d2e61")

    for _ in range(20):
        with pytest.raises(CredentialsRejected) as caught:
            merchant_client.request("GET", PING)
        assert "MERCHANT_API_SECRET" in str(caught.value)
    assert merchant_sandbox.exchanges()["rejected"] == 1  # the breaker held every later attempt

    merchant_secret_file.write_text(new_secret)
    assert merchant_client.request("GET", PING) == {"ok": True}
    assert merchant_sandbox.exchanges()["ok"] == 2
    assert merchant_client.manager.store.records.load_breaker() is None


# -- malformed token responses, from a real server on loopback ---------------------------


json_values = json_documents(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    st.text(max_size=12),
    list_size=3,
    object_size=4,
    max_leaves=8,
)
token_like_fields = st.fixed_dictionaries(
    {},
    optional={
        "access_token": json_values,
        "expires_in": json_values,
        "data": json_values,
        "error": st.just(TEST_SECRET) | json_values,
    },
)


@pytest.fixture(scope="module")
def scripted_server() -> Iterator[tuple[str, dict[str, Any]]]:
    """A loopback server that answers whatever the test scripted."""
    script: dict[str, Any] = {"status": 200, "body": b"{}"}

    @Request.application
    def app(request: Request) -> Response:
        return Response(script["body"], status=script["status"], content_type="application/json")

    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", script
    server.shutdown()


@hypothesis_settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    status=st.sampled_from([200, 201, 400, 401, 403, 404, 408, 429, 500, 502, 503]),
    body=st.one_of(
        token_like_fields.map(lambda d: json.dumps(d).encode()),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=40),
    ),
)
def test_any_token_response_gives_a_token_or_a_typed_error_without_the_secret(
    scripted_server: tuple[str, dict[str, Any]], status: int, body: bytes
) -> None:
    url, script = scripted_server
    script.update(status=status, body=body)
    exchange = TokenExchange(url, TEST_API_KEY, Secret(TEST_SECRET), timeout=(2, 2))
    outcome: IssuedToken | MerchantError
    try:
        outcome = exchange()
    except MerchantError as exc:  # any other exception type fails the test
        outcome = exc
    if isinstance(outcome, IssuedToken):
        assert outcome.value
        assert outcome.expires_in > 0
    else:
        assert isinstance(outcome, TokenExchangeError | ConfigurationError)
        assert TEST_SECRET not in str(outcome)
        assert TEST_SECRET not in "".join(traceback.format_exception(outcome))


def test_the_secret_and_tokens_never_reach_logs_errors_reprs_or_redis(
    merchant_client: FleetClient,
    merchant_sandbox: MerchantSandbox,
    merchant_settings: Settings,
    redis_client: redis.Redis,
    merchant_key_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    merchant_client.request("GET", PING)
    merchant_sandbox.app.revoke_all()
    merchant_client.request("POST", "/open-api/v1/echo", json={"x": 1})  # 401 and forced renewal
    merchant_sandbox.app.reset_secret("another-secret-77aa01")
    failed = 0
    for _ in range(3):
        try:
            merchant_client.request("GET", PING)
        except MerchantError as exc:
            failed += 1
            texts.append(str(exc))
            texts.append("".join(traceback.format_exception(exc)))
    assert failed == 3  # the reset secret failed every call: their errors are searched too
    merchant_sandbox.app.config.token_error_rate = 1.0
    texts += [
        repr(merchant_client),
        repr(merchant_client.manager),
        repr(merchant_settings),
        repr(merchant_settings.secret),
        str(merchant_settings),
    ]
    texts += [record.getMessage() for record in caplog.records]
    texts += [repr(merchant_client.manager.store.load())]
    redis_dump = [
        f"{key!r}={redis_client.dump(key)!r}"
        for key in redis_client.scan_iter(f"{merchant_key_prefix}:*")
    ]

    haystack = "\n".join(texts)
    assert TEST_SECRET not in haystack
    assert "another-secret-77aa01" not in haystack
    for token in merchant_sandbox.app.issued_tokens():
        assert token not in haystack
    assert TEST_SECRET not in "\n".join(redis_dump)
    assert len(caplog.records) > 0  # DEBUG logging was really on


def test_a_sandbox_key_is_refused_by_an_emulator_playing_production(
    merchant_sandbox: MerchantSandbox,
    merchant_redis_url: str,
    merchant_key_prefix: str,
    redis_client: redis.Redis,
) -> None:
    production_settings = Settings(
        api_key="sandbox-only-key",
        secret=Secret("sandbox-only-secret"),
        base_url=merchant_sandbox.url,
        fleet=FleetSettings(redis_url=merchant_redis_url, key_prefix=merchant_key_prefix),
    )
    wrong = client_for(production_settings, redis_client=redis_client)
    for _ in range(5):
        with pytest.raises(CredentialsRejected):
            wrong.request("GET", PING)
    assert merchant_sandbox.exchanges()["rejected"] == 1
    assert requests.get(merchant_sandbox.url + "/_sandbox/counters", timeout=5).ok
