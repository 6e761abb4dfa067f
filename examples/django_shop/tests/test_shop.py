"""The shop charges through its own Celery app, which merchant-tasks was installed into."""

from typing import Any

from merchant_tasks.pytest_plugin import MerchantSandbox
from merchant_tasks.sandbox.processes import Child, wait_until

WAIT = 60.0  # seconds for a payment or a renewal on a busy machine


def charge(web: Any, order: str, amount: int) -> Any:
    response = web.post(
        "/charge/", {"order": order, "amount": amount}, content_type="application/json"
    )
    assert response.status_code == 202, response.content
    return response.json()["task"]


def payment(web: Any, task: str) -> dict[str, Any]:
    wait_until(lambda: web.get(f"/payments/{task}/").status_code != 202, "the payment", WAIT)
    response = web.get(f"/payments/{task}/")
    assert response.status_code == 200, response.content
    created: dict[str, Any] = response.json()["payment"]
    return created


def test_an_order_charged_twice_is_paid_once_with_the_token_beat_renewed(
    shop_fleet: list[Child], merchant_sandbox: MerchantSandbox, web: Any
) -> None:
    counters = merchant_sandbox.app.counters
    wait_until(lambda: counters()["exchanges"]["ok"] >= 1, "beat's renewal", WAIT)
    exchanged = counters()["exchanges"]["ok"]

    first = payment(web, charge(web, "1017", 1250))
    again = payment(web, charge(web, "1017", 1250))  # a double click: the same order

    assert first == again
    assert (first["amount"], first["status"]) == (1250, "created")
    assert len(merchant_sandbox.app.payments()) == 1
    assert counters()["endpoints"]["POST /open-api/v1/payments"]["ok"] == 2  # one replayed
    assert counters()["exchanges"]["ok"] == exchanged  # the calls used beat's token


def test_the_shops_own_task_runs_on_the_same_workers(shop_fleet: list[Child]) -> None:
    from shop.tasks import receipt

    line = receipt.delay({"id": "pay_9", "amount": 1250}).get(timeout=WAIT)
    assert line == "payment pay_9: 12.50 EUR"


def test_a_unit_test_runs_call_api_eagerly_through_the_shops_app(
    celery_app: Any, merchant_celery_eager: Any, merchant_sandbox: MerchantSandbox
) -> None:
    """No worker: the plugin's eager fixture runs tasks of the shop's app in the test."""
    from merchant_tasks.tasks import call_api

    assert merchant_celery_eager is celery_app
    created = call_api.delay("POST", "/open-api/v1/payments", json={"amount": 3}).get()
    assert created["amount"] == 3
    assert len(merchant_sandbox.app.payments()) == 1
