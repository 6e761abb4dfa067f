"""merchant-tasks: one fresh payment-API token per account, shared by a Celery fleet.

The folders: ``store/`` keeps the token in Redis, ``renewal/`` decides who renews it and
when, ``api/`` speaks HTTP (the exchange and the business client), ``worker/`` is the
Celery wiring, ``ops/`` what operators run, ``sandbox/`` the emulator and test tools. At
the top: ``token`` (the value and the renewal policy), ``exceptions``, ``settings`` and
``accounts`` (each account's settings wired to a client). docs/design.md, "The folders",
says what each holds; the design, its windows, guards and rules are there too.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:  # what ``__getattr__`` imports when first asked for, typed for mypy users
    from merchant_tasks.accounts import AccountClients, FleetClient, client_for, client_from_env
    from merchant_tasks.aio import AsyncAccountClients, MerchantAuth, async_client_from_env
    from merchant_tasks.api.async_client import AsyncMerchantClient
    from merchant_tasks.api.client import MerchantClient, TokenSource
    from merchant_tasks.ops.status import account_statuses, async_account_statuses

__version__ = package_version()

__all__ = [
    "AccountClients",
    "ApiError",
    "ApiOutcomeUnknown",
    "ApiUnavailable",
    "AsyncAccountClients",
    "AsyncMerchantClient",
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
    "async_account_statuses",
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


# the names imported when first asked for, and their modules: `status` and beat need
# neither requests nor the renewal's driver, and a worker loads them with its first client;
# the asyncio ones need the ``asyncio`` extra (httpx)
_LAZY = {
    "AccountClients": "merchant_tasks.accounts",
    "FleetClient": "merchant_tasks.accounts",
    "client_for": "merchant_tasks.accounts",
    "client_from_env": "merchant_tasks.accounts",
    "MerchantClient": "merchant_tasks.api.client",
    "TokenSource": "merchant_tasks.api.client",
    "AsyncAccountClients": "merchant_tasks.aio",
    "AsyncMerchantClient": "merchant_tasks.api.async_client",
    "MerchantAuth": "merchant_tasks.aio",
    "async_client_from_env": "merchant_tasks.aio",
    "account_statuses": "merchant_tasks.ops.status",
    "async_account_statuses": "merchant_tasks.ops.status",
}


def __getattr__(name: str) -> object:
    """The names of ``_LAZY``, imported when first asked for (``MissingExtra`` naming the
    ``asyncio`` extra for the asyncio ones when httpx is absent), and ``merchant_tasks.app``,
    the Celery app: ``celery -A merchant_tasks`` looks it up here, and library users who
    never touch Celery do not pay for importing it."""
    if name == "app":
        from merchant_tasks.worker.app import app

        return app
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'merchant_tasks' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # asked once
    return value
