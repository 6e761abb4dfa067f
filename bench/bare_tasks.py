"""The Celery baseline: the same GET as ``merchant_tasks.call_api``, with a static token.

Registered on the same worker as merchant_tasks.tasks (the bench's celeryconfig.py lists
this module in ``imports``). The token is read once per worker process from the Redis key
named by BENCH_STATIC_TOKEN_KEY, which the bench writes before starting the worker: it is
never a task argument. No renewal, no 401 handling, no retries: the cheapest correct task.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import redis
import requests
from celery.signals import worker_process_init

from merchant_tasks.worker.app import app

TIMEOUT = (3.05, 10.0)  # the same (connect, read) timeouts as MerchantClient's defaults

_session: requests.Session | None = None
_headers: dict[str, str] = {}
_lock = threading.Lock()


@worker_process_init.connect
def _forget_parent_session(**_: Any) -> None:
    global _session
    _session = None


def _prepared() -> requests.Session:
    global _session
    if _session is None:
        with _lock:
            if _session is None:
                store = redis.Redis.from_url(os.environ["MERCHANT_REDIS_URL"])
                raw = store.get(os.environ["BENCH_STATIC_TOKEN_KEY"])
                store.close()
                if raw is None:
                    raise RuntimeError("the bench did not write the static token")
                token = raw.decode() if isinstance(raw, bytes) else str(raw)
                _headers.update({"accept": "application/json", "authorization": f"Bearer {token}"})
                _session = requests.Session()
    return _session


@app.task(name="bench.bare_call")
def bare_call(method: str, path: str) -> Any:
    """``method path`` with the static bearer token; the decoded JSON body."""
    session = _prepared()
    response = session.request(
        method,
        os.environ["MERCHANT_BASE_URL"] + path,
        headers=_headers,
        timeout=TIMEOUT,
        allow_redirects=False,
    )
    response.raise_for_status()
    return response.json() if response.content else None
