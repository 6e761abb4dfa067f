"""The pytest plugin, where pytest and users find it (the ``pytest11`` entry point,
``from merchant_tasks.pytest_plugin import MerchantSandbox``).

The fixtures live in ``merchant_tasks.sandbox.fixtures``, which says what each does;
this door keeps the public import path.
"""

from __future__ import annotations

from merchant_tasks.sandbox.fixtures import (
    MerchantSandbox,
    MerchantWorker,
    merchant_celery_eager,
    merchant_client,
    merchant_env,
    merchant_key_prefix,
    merchant_redis_url,
    merchant_sandbox,
    merchant_sandbox_app,
    merchant_sandbox_config,
    merchant_secret_file,
    merchant_settings,
    merchant_worker,
)

__all__ = [
    "MerchantSandbox",
    "MerchantWorker",
    "merchant_celery_eager",
    "merchant_client",
    "merchant_env",
    "merchant_key_prefix",
    "merchant_redis_url",
    "merchant_sandbox",
    "merchant_sandbox_app",
    "merchant_sandbox_config",
    "merchant_secret_file",
    "merchant_settings",
    "merchant_worker",
]
