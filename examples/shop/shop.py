"""A shop's payment code: what an application that uses merchant-tasks looks like."""

from __future__ import annotations

from typing import Any

from merchant_tasks import MerchantClient
from merchant_tasks.tasks import call_api

PAYMENT_TIMEOUT = 30.0  # seconds the shop waits for the payment API through Celery


def charge(amount_cents: int, currency: str = "EUR") -> dict[str, Any]:
    """Create a payment through the Celery fleet and wait for it."""
    body = {"amount": amount_cents, "currency": currency}
    result = call_api.delay("POST", "/open-api/v1/payments", json=body)
    payment: dict[str, Any] = result.get(timeout=PAYMENT_TIMEOUT)
    return payment


def merchant_name(client: MerchantClient) -> str:
    """The API key the payment API knows us by (in-process, without Celery)."""
    profile = client.request("GET", "/open-api/v1/merchant/profile")
    return str(profile["appid"])
