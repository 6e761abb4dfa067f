"""Charging a customer: the view enqueues the payment and answers at once."""

import json

from celery.result import AsyncResult
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET, require_POST

from merchant_tasks import BrokerUnavailable
from merchant_tasks.tasks import call_api

RETRY_AFTER = "5"  # seconds: a broker restart or failover is usually over by then


@require_POST
def charge(request: HttpRequest) -> HttpResponse:
    """POST {"order": ..., "amount": cents}: 202 and the id to ask about the payment."""
    order = json.loads(request.body)
    body = {"amount": int(order["amount"]), "currency": "EUR", "reference": order["order"]}
    # the order id is the idempotency key: a retried or redelivered charge pays once
    try:
        task = call_api.delay(
            "POST", "/open-api/v1/payments", json=body, idempotency_key=f"order-{order['order']}"
        )
    except BrokerUnavailable:  # within MERCHANT_ENQUEUE_TIMEOUT: the request is not held
        return JsonResponse(
            {"error": "try again"}, status=503, headers={"Retry-After": RETRY_AFTER}
        )
    return JsonResponse({"task": task.id}, status=202)


@require_GET
def payment(request: HttpRequest, task_id: str) -> HttpResponse:
    """202 while the payment is on its way, then the payment."""
    result = AsyncResult(task_id)
    if not result.ready():
        return JsonResponse({"state": result.state}, status=202)
    if result.failed():
        return JsonResponse({"state": result.state, "error": str(result.result)}, status=502)
    return JsonResponse({"payment": result.get()})
