"""The Celery tasks, where callers find them: ``from merchant_tasks.tasks import call_api``.

Each name stands for the task of the shop's app that ``install(app)`` ran on, in whichever
thread the caller runs (``worker.install.sending_app``), else of the package's own app
(``celery -A merchant_tasks``, built only when a caller first needs it), so
``call_api.delay(...)`` sends through whichever app serves the caller. The task
functions live in ``merchant_tasks.worker.task_bodies``.

``call_api`` is typed (``CallApi``): its ``delay`` and ``apply_async`` return or raise
``BrokerUnavailable`` within MERCHANT_ENQUEUE_TIMEOUT (``worker.sending``), and
``await call_api.delay_async(...)`` does the same from async code without blocking the
event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from celery import current_app
from celery.local import Proxy
from celery.result import AsyncResult

from merchant_tasks.api.calls import check_headers, check_path
from merchant_tasks.exceptions import BrokerUnavailable
from merchant_tasks.settings import FleetSettings
from merchant_tasks.worker.install import sending_app
from merchant_tasks.worker.sending import send
from merchant_tasks.worker.task_bodies import CALL_API, RENEW_ACCOUNT, RENEW_TOKEN, TASKS

P = ParamSpec("P")
R = TypeVar("R")

ENQUEUE_THREADS = 32  # sends from async code waiting on the broker at once, in a process
_left: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "merchant_tasks_enqueue_left", default=None
)  # what an async caller's bound left for the send, once a thread took it
_threads: list[ThreadPoolExecutor] = []
_threads_made = threading.Lock()


def _enqueue_threads() -> ThreadPoolExecutor:
    """The threads ``delay_async`` sends on: the package's own, so that sends waiting on a
    broker that is away take none of the event loop's default executor, which the
    application's own work shares (and the loop's threads none of these)."""
    with _threads_made:
        if not _threads:
            _threads.append(
                ThreadPoolExecutor(ENQUEUE_THREADS, thread_name_prefix="merchant-enqueue")
            )
        return _threads[0]


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


def _in_a_thread(blocking: Callable[P, R]) -> Callable[P, Coroutine[Any, Any, R]]:
    """``blocking`` (a send) as a coroutine function that runs it on the enqueue threads,
    so that an event loop goes on serving while it waits; the wait for a free thread counts
    against MERCHANT_ENQUEUE_TIMEOUT, and the send gets what is left."""

    @functools.wraps(blocking)
    async def in_a_thread(*args: P.args, **kwargs: P.kwargs) -> R:
        called = time.monotonic()

        def send_what_is_left() -> R:
            # read here, on the thread: the variables may name files (MERCHANT_*_FILE)
            timeout = FleetSettings.from_env().enqueue_timeout
            left = called + timeout - time.monotonic()
            if left <= 0:
                raise BrokerUnavailable(
                    f"no enqueue thread came free within {timeout:g} s: {ENQUEUE_THREADS} "
                    "sends were already waiting on the broker. Send the call again later, "
                    "with the same idempotency key (check broker_url, MERCHANT_REDIS_URL by "
                    "default)"
                )
            _left.set(left)
            return blocking(*args, **kwargs)

        context = contextvars.copy_context()  # the caller's, with _left set in it alone
        send_it = functools.partial(context.run, send_what_is_left)
        return await asyncio.get_running_loop().run_in_executor(_enqueue_threads(), send_it)

    return in_a_thread


class CallApi:
    """Call the merchant API from a Celery worker: ``call_api.delay(method, path, ...)``.

    Sends the task ``merchant_tasks.call_api`` (``worker.task_bodies.call_api`` says what it does)
    and returns its ``AsyncResult``, or raises ``BrokerUnavailable`` (retryable, naming the
    broker) when the broker has not taken it within MERCHANT_ENQUEUE_TIMEOUT seconds (3 by
    default). Every other attribute (``s``, ``si``, ``name``, ``app``, ``AsyncResult``, ...)
    is the registered Celery task's.
    """

    name = CALL_API

    def delay(
        self,
        method: str,
        path: str,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        account: str | None = None,
        idempotency_key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncResult:
        """Enqueue a call of ``method`` ``path`` as ``account`` (the default one when None).

        ``idempotency_key`` is sent as the ``Idempotency-Key`` header: the same for every
        attempt of one operation (an order id); ``headers`` are more request headers (never
        credentials: arguments show in Flower).
        """
        given = {
            "json": json,
            "params": params,
            "account": account,
            "idempotency_key": idempotency_key,
            "headers": headers,
        }
        return self.apply_async((method, path), {k: v for k, v in given.items() if v is not None})

    delay_async = _in_a_thread(delay)  # ``await call_api.delay_async(...)``, same arguments

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> AsyncResult:
        """Celery's ``apply_async`` of the task (``countdown``, ``task_id``, ...), bounded
        as ``delay``; a path off the API or a credential header raises ValueError here, as
        the worker would, before anything reaches the broker."""
        given = {**dict(zip(("method", "path"), args or (), strict=False)), **(kwargs or {})}
        if "path" in given:  # the worker's own checks, before the broker, Flower and the
            check_path(given["path"])  # results hold a path off the API or a credential
        check_headers(given.get("headers"))
        timeout = _left.get() or FleetSettings.from_env().enqueue_timeout
        return send(installed_task(CALL_API), args or (), kwargs or {}, options, timeout)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task's body here, in this process, as Celery's tasks do when called."""
        return installed_task(CALL_API)(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and inspect probing: no app is built for them
            raise AttributeError(name)
        return getattr(installed_task(CALL_API), name)


call_api = CallApi()
renew_token = _task(RENEW_TOKEN)
renew_account = _task(RENEW_ACCOUNT)

__all__ = ["CallApi", "call_api", "installed_task", "renew_account", "renew_token"]
