"""A FastAPI shop that pays through merchant-tasks: the asyncio client, the Celery fleet, and
an ``httpx.AsyncClient`` of its own signed by ``MerchantAuth``.

Run it with the MERCHANT_* variables of an account (docs/configuration.md) set::

    uvicorn shop_api:app

docs/asyncio.md explains each part.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from celery.result import AsyncResult
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from merchant_tasks import (
    ApiError,
    ApiOutcomeUnknown,
    CredentialsRejected,
    MerchantError,
    PathForbidden,
    StoreUnavailable,
    TokenRejected,
)
from merchant_tasks.aio import AsyncAccountClients, MerchantAuth
from merchant_tasks.api.async_client import AsyncMerchantClient
from merchant_tasks.ops.status import async_account_statuses
from merchant_tasks.tasks import call_api

RETRY_AFTER = 5  # seconds a client is told to wait when the error names no time of its own
OWN_CLIENT_TIMEOUT = 30.0  # seconds for the shop's own client: a 401 may wait for a renewal


@dataclass
class Services:
    """What the handlers share, opened by ``lifespan`` and closed when the server stops."""

    fleet: AsyncAccountClients  # every account's asyncio client, and their status
    merchant: AsyncMerchantClient  # the only (or default) account's client
    own: httpx.AsyncClient  # the shop's own client, signed by MerchantAuth


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the clients once per process; close them in reverse order at shutdown."""
    async with AsyncAccountClients.from_env() as fleet:
        merchant = fleet.get()
        async with httpx.AsyncClient(
            base_url=merchant.base_url, auth=MerchantAuth(merchant), timeout=OWN_CLIENT_TIMEOUT
        ) as own:
            app.state.services = Services(fleet, merchant, own)
            yield


app = FastAPI(title="fastapi_shop", lifespan=lifespan)


def services(request: Request) -> Services:
    found: Services = request.app.state.services
    return found


def error_response(exc: MerchantError) -> JSONResponse:
    """The shop's one answer to a merchant-tasks error (docs/operations.md, "What each error
    means"): the API's own 4xx pass through, what only waiting mends is a 503."""
    body = {"error": type(exc).__name__, "code": exc.code, "message": str(exc)}
    if isinstance(exc, PathForbidden):  # before TokenRejected, its parent
        return JSONResponse(body, status_code=403)
    if isinstance(exc, CredentialsRejected | TokenRejected):
        # an operator must act (a secret reset, access revoked): no time to come back at
        return JSONResponse(body, status_code=503)
    if isinstance(exc, ApiOutcomeUnknown):  # may have been processed: never "retry later"
        return JSONResponse(body, status_code=502)
    if exc.retryable:
        wait = math.ceil(exc.retry_after) if exc.retry_after else RETRY_AFTER
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(wait)})
    if isinstance(exc, ApiError) and exc.status is not None and 400 <= exc.status < 500:
        return JSONResponse(body, status_code=exc.status)
    if isinstance(exc, ApiError):
        return JSONResponse(body, status_code=502)
    return JSONResponse(body, status_code=500)  # configuration: the shop's own fault


@app.exception_handler(MerchantError)
async def merchant_error(request: Request, exc: MerchantError) -> JSONResponse:
    return error_response(exc)


class Payment(BaseModel):
    amount: int  # in cents


@app.post("/orders/{order_id}/payment", status_code=201)
async def pay(order_id: str, payment: Payment, request: Request) -> Any:
    """Pay an order now, on the event loop; the order id makes a double click pay once."""
    return await services(request).merchant.request(
        "POST",
        "/open-api/v1/payments",
        json={"amount": payment.amount},
        idempotency_key=f"order-{order_id}",
    )


@app.get("/payments/{payment_id}")
async def payment(payment_id: str, request: Request) -> Any:
    return await services(request).merchant.request("GET", f"/open-api/v1/payments/{payment_id}")


@app.post("/orders/{order_id}/payment/queued", status_code=202)
async def pay_queued(order_id: str, payment: Payment, request: Request) -> dict[str, str]:
    """Hand the payment to the Celery fleet; BrokerUnavailable (within
    MERCHANT_ENQUEUE_TIMEOUT) becomes a 503 with Retry-After through ``error_response``."""
    task = await call_api.delay_async(
        "POST",
        "/open-api/v1/payments",
        json={"amount": payment.amount},
        idempotency_key=f"order-{order_id}",
    )
    return {"task": task.id}


def _outcome(task_id: str) -> tuple[bool, Any]:
    """Whether the task is done, and its result or error (blocking: Celery's result backend)."""
    result: AsyncResult = call_api.AsyncResult(task_id)
    if not result.ready():
        return False, None
    return True, result.result


@app.get("/tasks/{task_id}")
async def task(task_id: str) -> Any:
    """202 until the queued call is done; then its result, or its error as HTTP."""
    done, outcome = await asyncio.to_thread(_outcome, task_id)
    if not done:
        return JSONResponse({"task": task_id, "state": "pending"}, status_code=202)
    if isinstance(outcome, MerchantError):
        return error_response(outcome)
    if isinstance(outcome, BaseException):
        return JSONResponse({"error": type(outcome).__name__}, status_code=500)
    return outcome


@app.get("/merchant")
async def merchant(request: Request) -> Any:
    """The merchant's profile through the shop's own client (MerchantAuth signs it): its
    answers are plain httpx responses, passed on as they came."""
    response = await services(request).own.get("/open-api/v1/merchant/profile")
    return JSONResponse(response.json(), status_code=response.status_code)


@app.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while every account has a usable token or can get one; 503 when Redis cannot
    be read or renewals are paused (rejected credentials, refused tokens)."""
    try:
        statuses = await async_account_statuses(services(request).fleet)
    except StoreUnavailable as exc:
        return JSONResponse({"redis": "unreachable", "message": str(exc)}, status_code=503)
    accounts = {  # a path refused (a permission the merchant lacks) is told, not a 503
        name: {"state": status.state, "paused": status.breaker, "refused": status.refused_paths}
        for name, status in statuses.items()
    }
    paused = any(status.breaker is not None for status in statuses.values())
    return JSONResponse({"accounts": accounts}, status_code=503 if paused else 200)
