"""The Celery tasks, where callers find them: ``from merchant_tasks.tasks import call_api``.

Each name stands for the task of the shop's app that ``install(app)`` ran on, in whichever
thread the caller runs (``worker.install.sending_app``), else of the package's own app
(``celery -A merchant_tasks``, built only when a caller first needs it), so
``call_api.delay(...)`` sends through whichever app serves the caller. The task
functions live in ``merchant_tasks.worker.tasks``.
"""

from __future__ import annotations

from typing import Any

from celery import current_app
from celery.local import Proxy

from merchant_tasks.worker.install import sending_app
from merchant_tasks.worker.tasks import CALL_API, RENEW_ACCOUNT, RENEW_TOKEN, TASKS


def installed_task(name: str) -> Any:
    """The task ``name`` of the app calls are sent through (``worker.install.sending_app``:
    the shop's app install() ran on, from any thread), else of the package's own app."""
    shop_app = sending_app(current_app._get_current_object())
    if shop_app is not None:
        return shop_app.tasks[name]
    from merchant_tasks.worker.app import app  # built only when a caller needs it

    return app.tasks[name]


def _task(name: str) -> Any:
    return Proxy(installed_task, (name,), __doc__=TASKS[name][0].__doc__)


call_api = _task(CALL_API)
renew_token = _task(RENEW_TOKEN)
renew_account = _task(RENEW_ACCOUNT)

__all__ = ["call_api", "installed_task", "renew_account", "renew_token"]
