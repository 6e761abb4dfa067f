"""merchant-tasks: one fresh payment-API token per account, shared by a Celery fleet.

The folders: ``store/`` keeps the token in Redis, ``renewal/`` decides who renews it and
when, ``api/`` speaks HTTP (the exchange and the business client), ``worker/`` is the
Celery wiring, ``ops/`` what operators run, ``sandbox/`` the emulator and test tools. At
the top: ``token`` (the value and the renewal policy), ``exceptions``, ``settings`` and
``accounts`` (each account's settings wired to a client). docs/design.md, "The folders",
says what each holds; the design, its windows, guards and rules are there too.
"""

from __future__ import annotations

import logging
from typing import Any

from merchant_tasks.accounts import AccountClients, FleetClient, client_for, client_from_env
from merchant_tasks.api.client import MerchantClient, TokenSource
from merchant_tasks.exceptions import (
    ApiError,
    ApiOutcomeUnknown,
    ApiUnavailable,
    BrokerUnavailable,
    ConfigurationError,
    CredentialsRejected,
    ExchangeRateLimited,
    MalformedApiResponse,
    MalformedTokenResponse,
    MerchantError,
    MissingExtra,
    PathForbidden,
    RenewalTimeout,
    StoreRefusingWrites,
    StoreUnavailable,
    TokenEndpointMisrouted,
    TokenEndpointUnavailable,
    TokenExchangeError,
    TokenRejected,
    TokenUnreadable,
    WrongBaseUrl,
)
from merchant_tasks.extras import package_version
from merchant_tasks.settings import Settings

__version__ = package_version()

__all__ = [
    "AccountClients",
    "ApiError",
    "ApiOutcomeUnknown",
    "ApiUnavailable",
    "AsyncAccountClients",
    "BrokerUnavailable",
    "ConfigurationError",
    "CredentialsRejected",
    "ExchangeRateLimited",
    "FleetClient",
    "MalformedApiResponse",
    "MalformedTokenResponse",
    "MerchantAuth",
    "MerchantClient",
    "MerchantError",
    "MissingExtra",
    "PathForbidden",
    "RenewalTimeout",
    "Settings",
    "StoreRefusingWrites",
    "StoreUnavailable",
    "TokenEndpointMisrouted",
    "TokenEndpointUnavailable",
    "TokenExchangeError",
    "TokenRejected",
    "TokenSource",
    "TokenUnreadable",
    "WrongBaseUrl",
    "__version__",
    "account_statuses",
    "async_client_from_env",
    "client_for",
    "client_from_env",
    "install",
]

# a library leaves logging to its application: without this, Python's last-resort handler
# printed warnings to stderr next to the CLI's own message (the same error twice)
logging.getLogger(__name__).addHandler(logging.NullHandler())


def install(app: Any) -> None:
    """Make your own Celery ``app`` run merchant-tasks: its tasks, renewal queue and route,
    beat's entry and worker-start checks; nothing else of ``app`` changes. Idempotent.

    Call it where the app is created (Django: ``proj/celery.py``). See docs/celery-app.md.
    """
    from merchant_tasks.worker.install import (
        install as install_into,  # Celery is imported only by its users
    )

    install_into(app)


_ASYNCIO = ("AsyncAccountClients", "MerchantAuth", "async_client_from_env")  # httpx: the
# ``asyncio`` extra, imported only by those who use them


def __getattr__(name: str) -> object:
    """``merchant_tasks.app`` is the Celery app, imported only when asked for: ``celery -A
    merchant_tasks`` looks it up here, and library users who never touch Celery do not pay
    for importing it. The asyncio client and ``MerchantAuth`` need the ``asyncio`` extra
    (httpx): they too are imported when asked for, ``MissingExtra`` naming it if absent."""
    if name == "app":
        from merchant_tasks.worker.app import app

        return app
    if name in _ASYNCIO:
        from merchant_tasks import aio

        return getattr(aio, name)
    if name == "account_statuses":
        from merchant_tasks.ops.status import account_statuses

        return account_statuses
    raise AttributeError(f"module 'merchant_tasks' has no attribute {name!r}")
