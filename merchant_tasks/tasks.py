"""The Celery tasks, where users import them: ``from merchant_tasks.tasks import call_api``.

They live in ``merchant_tasks.worker.tasks``; this door keeps the public import path.
"""

from __future__ import annotations

from merchant_tasks.worker.tasks import call_api, renew_account, renew_token

__all__ = ["call_api", "renew_account", "renew_token"]
