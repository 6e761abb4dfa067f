"""The accounts of the bench's children (``MERCHANT_ACCOUNTS_SOURCE=accounts_source:accounts``,
``bench/`` on PYTHONPATH): the cold start's worker and beat, and the ten thousand accounts'
`status` and worker (``scenarios.many_accounts``).

A module of its own, importing the library's settings only: `status` loads it to learn the
accounts, and a scenario module would bring the bench's harness and Celery into what is
timed.

BENCH_ACCOUNTS says how many; the accounts share the fleet's key prefix, each with an API
key of the emulator's key family (``<BENCH_API_KEY>.shop-<n>``, one secret).
"""

from __future__ import annotations

import os
from dataclasses import replace

from merchant_tasks.settings import Settings

ACCOUNTS_SOURCE = "accounts_source:accounts"  # MERCHANT_ACCOUNTS_SOURCE of the children


def accounts() -> dict[str, Settings]:
    """The children's accounts, from BENCH_ACCOUNTS and BENCH_API_KEY."""
    base = Settings.from_env({**os.environ, "MERCHANT_API_KEY": os.environ["BENCH_API_KEY"]})
    return {shop(n): account(base, n) for n in range(int(os.environ["BENCH_ACCOUNTS"]))}


def shop(n: int) -> str:
    return f"shop-{n}"


def account(base: Settings, n: int) -> Settings:
    """Account ``n``: an API key of the emulator's key family."""
    return replace(base, api_key=f"{base.api_key}.{shop(n)}")
