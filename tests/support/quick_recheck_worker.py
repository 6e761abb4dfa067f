"""merchant-tasks' own Celery app whose start-up check of the token store repeats every
second instead of every 10 s (``store_check.RECHECK_INTERVAL``), for the tests that watch it
repeat: ``celery -A support.quick_recheck_worker worker`` (or ``beat``), ``tests/`` on the
``PYTHONPATH`` (``Fleet.load_app``)."""

from __future__ import annotations

from merchant_tasks.worker import store_check
from merchant_tasks.worker.app import app

__all__ = ["app"]

store_check.RECHECK_INTERVAL = 1.0
