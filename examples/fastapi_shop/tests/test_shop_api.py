"""The shop's service, served by a real uvicorn against the plugin's emulator and Redis (and
its Celery worker for the queued path): what a client of the shop sees."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import shop_api

from merchant_tasks import exceptions
from merchant_tasks.pytest_plugin import MerchantSandbox, MerchantWorker
from merchant_tasks.sandbox.processes import Child, RedisServer, free_port, spawn, wait_until
from merchant_tasks.settings import Settings, child_env

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 60.0  # seconds for uvicorn to start the shop on a busy machine
WAIT = 60.0  # seconds for a queued payment, or for Redis to be read again, on a busy machine
REQUEST_TIMEOUT = 60.0  # seconds a request to the shop may take on a busy machine
SLACK = 2.0  # seconds beyond MERCHANT_ENQUEUE_TIMEOUT for the enqueue's 503 to arrive
ENQUEUES = 30  # enqueues at once while Redis is down: more than the loop's default executor


@dataclass
class Shop:
    """The running service and a client of it."""

    server: Child
    http: httpx.Client

    def pay(self, order: str, amount: int = 1200) -> httpx.Response:
        return self.http.post(f"/orders/{order}/payment", json={"amount": amount})

    def enqueue(self, order: str, amount: int = 1200) -> httpx.Response:
        return self.http.post(f"/orders/{order}/payment/queued", json={"amount": amount})


def _timed(send: Callable[[str], httpx.Response], arg: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    return send(arg), time.monotonic() - started


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[Settings], Shop]]:
    """Start ``uvicorn shop_api:app`` with an account's variables, as its operators do; at
    the end, stop it and check it shut down cleanly."""
    started: list[Shop] = []

    def start(settings: Settings) -> Shop:
        port = free_port()
        argv = [sys.executable, "-m", "uvicorn", "shop_api:app", "--host", "127.0.0.1"]
        server = spawn(
            "uvicorn",
            [*argv, "--port", str(port)],
            tmp_path / f"uvicorn-{port}.log",
            env=child_env(settings),
            cwd=ROOT,
        )
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=REQUEST_TIMEOUT)
        shop = Shop(server, http)
        started.append(shop)
        server.wait_ready(
            # bound and listening: "Application startup complete." comes before the bind
            lambda: "Uvicorn running on" in server.log_text(),
            timeout=START_TIMEOUT,
        )
        return shop

    yield start
    for shop in started:
        shop.http.close()
        shop.server.stop()
        log = shop.server.log_text()
        assert "Application shutdown complete." in log, log
        assert "Traceback" not in log, log


@pytest.fixture
def shop(
    serve: Callable[[Settings], Shop],
    merchant_settings: Settings,
    merchant_sandbox: MerchantSandbox,
) -> Shop:
    return serve(merchant_settings)


def test_a_payment_is_made_and_a_double_click_pays_once(
    shop: Shop, merchant_sandbox: MerchantSandbox
) -> None:
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: shop.pay("1017"), range(2))
    assert (first.status_code, second.status_code) == (201, 201), first.text + second.text
    assert first.json() == second.json()
    assert [p["id"] for p in merchant_sandbox.app.payments()] == [first.json()["id"]]
    found = shop.http.get(f"/payments/{first.json()['id']}")
    assert found.status_code == 200
    assert found.json()["amount"] == 1200


def test_the_apis_404_passes_through(shop: Shop) -> None:
    missing = shop.http.get("/payments/pay_missing")
    assert missing.status_code == 404
    assert missing.json()["code"] == "not_found"


def test_a_route_the_merchant_may_not_call_is_403_and_other_routes_go_on(
    shop: Shop, merchant_sandbox: MerchantSandbox
) -> None:
    assert shop.pay("1").status_code == 201  # the account's token is accepted
    merchant_sandbox.app.configure({"forbidden_paths": ["/open-api/v1/payments/"]})
    forbidden = shop.http.get("/payments/pay_1")
    assert forbidden.status_code == 403, forbidden.text
    assert forbidden.json()["error"] == "PathForbidden"
    assert shop.pay("2").status_code == 201
    health = shop.http.get("/health")  # told, but no reason to take the shop out
    assert health.status_code == 200
    [account] = health.json()["accounts"].values()
    assert account["refused"], account


def test_a_queued_payment_runs_on_a_worker_and_comes_back_through_tasks(
    serve: Callable[[Settings], Shop],
    merchant_settings: Settings,
    merchant_worker: MerchantWorker,
    merchant_sandbox: MerchantSandbox,
) -> None:
    shop = serve(merchant_settings)
    done = _queued_outcome(shop, "2001", 700)
    assert done.status_code == 200, done.text
    assert done.json()["amount"] == 700
    assert [p["id"] for p in merchant_sandbox.app.payments()] == [done.json()["id"]]
    changed = _queued_outcome(shop, "2001", 800)  # the worker's ApiError, as HTTP
    assert changed.status_code == 422, changed.text
    assert changed.json()["code"] == "idempotency_key_reused"


def _queued_outcome(shop: Shop, order: str, amount: int) -> httpx.Response:
    """Queue a payment through the shop and poll /tasks until it is done; the answer."""
    queued = shop.http.post(f"/orders/{order}/payment/queued", json={"amount": amount})
    assert queued.status_code == 202, queued.text
    task = f"/tasks/{queued.json()['task']}"
    wait_until(lambda: shop.http.get(task).status_code != 202, "the queued payment", WAIT)
    return shop.http.get(task)


def test_the_own_client_after_a_revoke_all_makes_one_exchange_for_8_concurrent_requests(
    shop: Shop, merchant_sandbox: MerchantSandbox
) -> None:
    assert shop.http.get("/merchant").json()["appid"] == merchant_sandbox.api_key
    before = merchant_sandbox.exchanges()["ok"]
    merchant_sandbox.app.revoke_all()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: shop.http.get("/merchant"), range(8)))
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
    assert merchant_sandbox.exchanges()["ok"] == before + 1


def test_refused_credentials_are_503_without_retry_after_and_health_shows_the_pause(
    shop: Shop, merchant_sandbox: MerchantSandbox
) -> None:
    assert shop.pay("1").status_code == 201
    assert shop.http.get("/health").status_code == 200
    merchant_sandbox.app.reset_secret()  # in the dashboard: every token revoked too
    refused = shop.pay("2")
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"] == "CredentialsRejected"
    assert "retry-after" not in refused.headers
    health = shop.http.get("/health")
    assert health.status_code == 503
    [account] = health.json()["accounts"].values()
    assert account["paused"]["kind"] == "rejected"


def test_with_redis_down_health_and_enqueues_are_503_direct_calls_go_on_and_all_comes_back(
    serve: Callable[[Settings], Shop],
    merchant_settings: Settings,
    merchant_sandbox: MerchantSandbox,
    tmp_path: Path,
) -> None:
    with RedisServer(tmp_path / "redis") as redis:
        fleet = replace(merchant_settings.fleet, redis_url=redis.url)
        shop = serve(replace(merchant_settings, fleet=fleet))
        assert shop.pay("1").status_code == 201
        assert shop.http.get("/health").status_code == 200
        redis.kill()
        assert shop.http.get("/health").status_code == 503
        with ThreadPoolExecutor(ENQUEUES) as pool:  # many clients at once, and one more
            sent = [pool.submit(_timed, shop.enqueue, str(n)) for n in range(ENQUEUES)]
            missing = _timed(shop.http.get, "/payments/pay_missing")  # while they wait
            answers = [future.result() for future in sent]
        for queued, waited in answers:
            assert queued.status_code == 503, queued.text
            assert queued.json()["error"] == "BrokerUnavailable"
            assert int(queued.headers["retry-after"]) > 0
            assert waited < fleet.enqueue_timeout + SLACK  # the promise itself: a bound
        # a direct call waits for no enqueue (its error answer reads the secret in a thread)
        assert missing[0].status_code == 404
        assert missing[1] < fleet.enqueue_timeout
        assert shop.pay("3").status_code == 201  # the process's token, without Redis
        redis.start()
        wait_until(lambda: shop.http.get("/health").status_code == 200, "health again", WAIT)
        assert shop.pay("4").status_code == 201


def _error(kind: type[exceptions.MerchantError], **fields: Any) -> exceptions.MerchantError:
    return kind("what happened", **fields)


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (_error(exceptions.PathForbidden, status=401), 403, None),
        (_error(exceptions.CredentialsRejected, status=401), 503, None),
        (_error(exceptions.TokenRejected), 503, None),
        (_error(exceptions.ApiOutcomeUnknown, status=504), 502, None),
        (_error(exceptions.ApiUnavailable, status=503), 503, "5"),
        (_error(exceptions.ExchangeRateLimited, status=429, retry_after=2.5), 503, "3"),
        (_error(exceptions.BrokerUnavailable), 503, "5"),
        (_error(exceptions.StoreUnavailable), 503, "5"),
        (_error(exceptions.ApiError, status=404, code="not_found"), 404, None),
        (_error(exceptions.ApiError, status=422, code="idempotency_key_reused"), 422, None),
        (_error(exceptions.ApiError, status=500), 502, None),
        (_error(exceptions.MalformedApiResponse, status=200), 502, None),
        (_error(exceptions.ConfigurationError), 500, None),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, exceptions.MerchantError) else None,
)
def test_each_error_maps_to_one_answer(
    error: exceptions.MerchantError, status: int, retry_after: str | None
) -> None:
    response = shop_api.error_response(error)
    assert response.status_code == status
    assert response.headers.get("retry-after") == retry_after
