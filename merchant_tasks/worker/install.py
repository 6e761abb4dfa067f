"""What any Celery app needs to run merchant-tasks: ``install(app)``.

A shop's own app (Django's ``proj/celery.py``, a plain ``Celery("proj")``) and the package's
standalone app (``celery -A merchant_tasks``) are built the same way. ``install`` adds:

- the tasks under their names (``merchant_tasks.call_api``, ``merchant_tasks.renew_token``,
  ``merchant_tasks.renew_account``), each acknowledged after it ran and put back when its
  worker is lost, whatever the app's ``task_acks_late`` says;
- the renewal queue (its own exchange and routing key, see ``worker.routing``) beside the app's
  queues, and the route of the two renewal tasks to it;
- beat's entry that checks every MERCHANT_RENEW_INTERVAL seconds which tokens to renew;
- at worker and beat start: the accounts' settings checked (a mistake stops the process
  with one line; beat does not read the secret files);
- at worker start: the connection pools sized for the concurrency (``worker.pools``),
  bindings of older releases removed, and a warning naming each setting of the app that
  breaks a delivery guarantee.

Nothing else of the app's configuration changes. What ``install`` adds to the
configuration is added again whenever Celery (re)loads it (``on_after_configure``), so it
may come before or after ``config_from_object``. Calling it twice is harmless.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Mapping
from typing import Any

from celery.signals import beat_init, celeryd_after_setup, worker_init

from merchant_tasks.exceptions import ConfigurationError
from merchant_tasks.extras import require_worker_pool
from merchant_tasks.settings import FleetSettings
from merchant_tasks.worker.pools import size_pools_at_worker_start
from merchant_tasks.worker.routing import (
    RENEWAL_QUEUE,
    VISIBILITY_TIMEOUT,
    own_queue,
    remove_stale_bindings,
)
from merchant_tasks.worker.tasks import COUNTDOWN_MAX, TASKS

log = logging.getLogger(__name__)

EXIT_CONFIGURATION = 2  # the exit code of a configuration mistake, as the CLI's
# no call is lost when a worker dies: acknowledged after the task ran, and put back in the
# queue when the worker process is killed mid-task; set on each task, so the app's
# task_acks_late and task_reject_on_worker_lost do not matter
DELIVERY_GUARANTEES = {"acks_late": True, "reject_on_worker_lost": True}
RENEWAL_TASKS = ("merchant_tasks.renew_token", "merchant_tasks.renew_account")
BEAT_ENTRY = "renew-merchant-token"

_installed: weakref.WeakSet[Any] = weakref.WeakSet()  # the Celery apps install() ran on


def install(app: Any) -> None:
    """Make the Celery ``app`` run merchant-tasks (see the module docstring).

    Raises ConfigurationError for a bad MERCHANT_RENEW_INTERVAL (or another fleet-wide
    MERCHANT_* variable); under a ``celery`` command it is one line on stderr instead, as
    is a worker whose pool needs a missing extra (see ``extras``).
    """
    if app in _installed:
        return
    try:
        interval = FleetSettings.from_env().renew_interval
    except ConfigurationError as exc:
        if not started_by_celery_command():
            raise
        exit_with(exc)
    for name, (run, options) in TASKS.items():
        # shared=False: only this app gets them, not every app the process creates
        app.task(name=name, shared=False, **DELIVERY_GUARANTEES, **options)(run)

    def add_configuration(sender: Any = None, **_: Any) -> None:
        conf = app.conf
        if started_by_celery_command():
            try:  # before the worker command imports its pool
                require_worker_pool(sys.argv, conf.worker_pool)
            except ConfigurationError as exc:
                exit_with(exc)
        queues = with_renewal_queue(conf.task_queues, app)
        if queues is not conf.task_queues:
            conf.task_queues = queues
        routes = with_renewal_routes(conf.task_routes)
        if routes is not conf.task_routes:
            conf.task_routes = routes
        if BEAT_ENTRY not in (conf.beat_schedule or {}):
            conf.beat_schedule = {**(conf.beat_schedule or {}), BEAT_ENTRY: beat_entry(interval)}

    app.on_after_configure.connect(add_configuration, weak=False)
    if app.configured:
        add_configuration()
    _installed.add(app)


def beat_entry(interval: float) -> dict[str, Any]:
    """Beat's check of every account, every ``interval`` seconds."""
    return {
        "task": "merchant_tasks.renew_token",
        "schedule": interval,
        # a check nobody ran before the next tick is replaced by that tick's
        "options": {"expires": interval},
    }


def with_renewal_queue(queues: Any, app: Any) -> Any:
    """``queues`` (the app's task_queues) with the renewal queue added; the same object
    when it is already there."""
    renewal = own_queue(RENEWAL_QUEUE)
    if not queues:  # Celery would make the default queue alone: keep it, as Celery makes it
        return (*app.amqp.Queues(None).values(), renewal)
    if isinstance(queues, Mapping):
        return queues if RENEWAL_QUEUE in queues else {**queues, RENEWAL_QUEUE: renewal}
    if any(queue.name == RENEWAL_QUEUE for queue in queues):
        return queues
    return (*queues, renewal)


def with_renewal_routes(routes: Any) -> Any:
    """``routes`` (the app's task_routes) routing the renewal tasks to their queue; a route
    the user gave one of them by its exact name is kept. The same object when unchanged."""
    routers = [] if routes is None else [routes] if _is_single_router(routes) else list(routes)
    named = {name for router in routers if isinstance(router, Mapping) for name in router}
    ours = {name: {"queue": RENEWAL_QUEUE} for name in RENEWAL_TASKS if name not in named}
    if not ours:
        return routes
    if routes is None:
        return ours
    if isinstance(routes, Mapping):
        return {**routes, **ours}  # exact names are looked up before the user's patterns
    return (ours, *routers)


def _is_single_router(routes: Any) -> bool:
    return isinstance(routes, Mapping | str) or callable(routes)


def broken_guarantees(app: Any) -> list[str]:
    """One sentence per setting of ``app`` that breaks a delivery guarantee, naming it."""
    found = []
    for name in TASKS:
        task = app.tasks.get(name)
        for option in DELIVERY_GUARANTEES:
            if task is not None and not getattr(task, option):
                found.append(
                    f"task_annotations turn off {option} for {name}: a task whose worker "
                    "dies mid-call is lost; remove that annotation"
                )
    conf = app.conf
    options = conf.broker_transport_options or {}
    timeout = options.get("visibility_timeout", VISIBILITY_TIMEOUT)
    if _is_redis_broker(conf.broker_url) and timeout <= COUNTDOWN_MAX:
        found.append(
            f"broker_transport_options['visibility_timeout'] is {timeout} s, not above "
            f"call_api's longest retry countdown ({COUNTDOWN_MAX} s): a waiting retry is "
            f"delivered again before it is due and a call runs twice; set it to at least "
            f"{VISIBILITY_TIMEOUT}"
        )
    if conf.result_backend and not conf.result_backend_always_retry:
        found.append(
            "result_backend_always_retry is off: a result written while the backend "
            "restarts is lost, and a call the API executed looks failed to its caller, who "
            "may repeat it; set result_backend_always_retry = True"
        )
    return found


def _is_redis_broker(url: str | None) -> bool:
    from merchant_tasks.store.topology import is_kombu_redis_url

    return bool(url) and is_kombu_redis_url(url or "")


def started_by_celery_command() -> bool:
    """Whether this process is ``celery ...`` (its CLI module is loaded), not a library user."""
    return "celery.bin.celery" in sys.modules


def exit_with(exc: Exception) -> None:
    """A configuration mistake under ``celery ...``: one line on stderr, no traceback (the
    process's own stderr: beat has redirected sys.stderr to its log by then).

    Another exception met while loading the configuration is shown by its type only (its
    text could quote a file's content), and stops the process all the same: Celery would
    otherwise log what a start-up signal raised and run on.
    """
    if isinstance(exc, ConfigurationError):
        print(f"error: {type(exc).__name__}: {exc}", file=sys.__stderr__)
    else:
        log.debug("loading the configuration failed", exc_info=exc)
        print(f"error: loading the configuration raised {type(exc).__name__}", file=sys.__stderr__)
    raise SystemExit(EXIT_CONFIGURATION)


def _check_accounts(sender: Any = None, **_: Any) -> None:
    """Before a worker is set up: every account's settings load, or it stops in one line."""
    _load_accounts_or_exit(getattr(sender, "app", None), read_secrets=True)


def _check_beat_accounts(sender: Any = None, **_: Any) -> None:
    """Before beat's first tick: the same check, but beat holds no secret."""
    _load_accounts_or_exit(getattr(sender, "app", None), read_secrets=False)


def _load_accounts_or_exit(app: Any, read_secrets: bool) -> None:
    if app not in _installed:
        return  # a Celery app that does not run merchant-tasks
    from merchant_tasks.accounts import (
        load_accounts,  # the process's own import: the app needs no account
    )

    try:
        load_accounts(read_secrets=read_secrets)
    except Exception as exc:
        exit_with(exc)


def _prepare_worker(sender: str, instance: Any, **_: Any) -> None:
    """Once the worker logs, before it connects: pools fit its concurrency, the settings
    that break a guarantee are named, and no stale binding remains."""
    app = instance.app
    if app not in _installed:
        return
    size_pools_at_worker_start(instance)
    for problem in broken_guarantees(app):
        log.warning("merchant-tasks: %s", problem)
    try:
        remove_stale_bindings(app)
    except Exception as exc:  # the broker may be down at start: Celery keeps retrying it
        log.warning("could not check the broker for stale queue bindings: %r", exc)


worker_init.connect(_check_accounts)
beat_init.connect(_check_beat_accounts)
celeryd_after_setup.connect(_prepare_worker)
