"""The shop's tests, written with the merchant-tasks pytest plugin's fixtures only."""

from __future__ import annotations

from typing import Any

import pytest
import shop

from merchant_tasks import ApiError, MerchantClient
from merchant_tasks.pytest_plugin import MerchantSandbox, MerchantWorker


def test_charge_creates_one_payment_eagerly(
    merchant_celery_eager: Any, merchant_sandbox: MerchantSandbox
) -> None:
    payment = shop.charge(1250)
    assert payment["amount"] == 1250
    assert payment["status"] == "created"
    assert merchant_sandbox.app.counters()["calls"]["ok"] == 1


def test_each_test_has_its_own_account_and_token(
    merchant_celery_eager: Any, merchant_sandbox: MerchantSandbox
) -> None:
    shop.charge(1)
    assert merchant_sandbox.app.counters()["exchanges"]["ok"] == 1  # nothing carried over


def test_an_api_error_reaches_the_caller_with_its_fields(merchant_celery_eager: Any) -> None:
    with pytest.raises(ApiError) as caught:
        shop.call_api.delay("GET", "/open-api/v1/payments/pay_missing").get()
    assert (caught.value.status, caught.value.code) == (404, "not_found")


def test_merchant_name_comes_from_the_api(
    merchant_client: MerchantClient, merchant_sandbox: MerchantSandbox
) -> None:
    assert shop.merchant_name(merchant_client) == merchant_sandbox.api_key


def test_a_real_worker_runs_the_call_once_and_keeps_the_errors_fields(
    merchant_worker: MerchantWorker, merchant_sandbox: MerchantSandbox
) -> None:
    created = merchant_worker.call("POST", "/open-api/v1/payments", json={"amount": 5})
    assert created.get(timeout=60)["amount"] == 5
    missing = merchant_worker.call("GET", "/open-api/v1/payments/pay_missing")
    error = missing.get(timeout=60, propagate=False)
    assert isinstance(error, ApiError)
    assert (error.status, error.code) == (404, "not_found")
    assert merchant_sandbox.app.counters()["endpoints"]["POST /open-api/v1/payments"]["ok"] == 1
