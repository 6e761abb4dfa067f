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
  acknowledgements and results on Redis made to wait out a Redis refusing writes
  (``worker.broker_writes``),
  bindings of older releases removed, a queue shape that would run a call twice refused in
  one line, and a warning naming each setting of the app that breaks a delivery guarantee;
- at worker and beat start: the token store checked in the background
  (``worker.store_check``);
- on every ``call_api`` sent: the sending fleet and account in its headers (``worker.fleet``).

Nothing else of the app's configuration changes. What ``install`` adds to the
configuration is added again whenever Celery (re)loads it (``on_after_configure``), so it
may come before or after ``config_from_object``. Calling it twice is harmless.
"""

from __future__ import annotations

import logging
import re
import sys
import weakref
from collections.abc import Mapping
from typing import Any

from celery.signals import (
    beat_init,
    before_task_publish,
    celeryd_after_setup,
    worker_init,
    worker_ready,
)
from kombu import Queue

from merchant_tasks.exceptions import ConfigurationError
from merchant_tasks.extras import require_worker_pool
from merchant_tasks.settings import FleetSettings
from merchant_tasks.worker.broker_writes import wait_out_refused_writes
from merchant_tasks.worker.fleet import tag_call, tag_renewal
from merchant_tasks.worker.pools import size_pools_at_worker_start
from merchant_tasks.worker.routing import (
    RENEWAL_QUEUE,
    VISIBILITY_TIMEOUT,
    own_queue,
    remove_stale_bindings,
)
from merchant_tasks.worker.store_check import start_store_check
from merchant_tasks.worker.task_bodies import CALL_API, COUNTDOWN_MAX, RENEW_ACCOUNT, TASKS

log = logging.getLogger(__name__)

EXIT_CONFIGURATION = 2  # the exit code of a configuration mistake, as the CLI's
# no call is lost when a worker dies: acknowledged after the task ran, and put back in the
# queue when the worker process is killed mid-task; set on each task, so the app's
# task_acks_late and task_reject_on_worker_lost do not matter
DELIVERY_GUARANTEES = {"acks_late": True, "reject_on_worker_lost": True}
RENEWAL_TASKS = ("merchant_tasks.renew_token", "merchant_tasks.renew_account")
BEAT_ENTRY = "renew-merchant-token"

_installed: weakref.WeakSet[Any] = weakref.WeakSet()  # the Celery apps install() ran on
_shop_app: weakref.ref[Any] | None = None  # the last of them other than the package's own


def install(app: Any) -> None:
    """Make the Celery ``app`` run merchant-tasks (see the module docstring).

    Raises ConfigurationError for a bad MERCHANT_RENEW_INTERVAL (or another fleet-wide
    MERCHANT_* variable); under a ``celery`` command it is one line on stderr instead, as
    is a worker whose pool needs a missing extra (see ``extras``).
    """
    if app in _installed:
        _note_installed(app)  # the last installed again: other threads send through it
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
    _note_installed(app)


def _note_installed(app: Any) -> None:
    global _shop_app
    _installed.add(app)
    if not _is_package_app(app):
        _shop_app = weakref.ref(app)


def sending_app(current: Any) -> Any | None:
    """The app a task of ours is sent through from this thread, whose Celery current app is
    ``current``: that app if install() ran on it; else the last app install() ran on other
    than the package's own. Celery's current app is per thread: a thread other than the
    one that made the shop's app (Django's runserver, gunicorn's threads, an executor) sees
    Celery's default app, or the package's. None: the package's own app (standalone)."""
    if current in _installed and not _is_package_app(current):
        return current
    return _shop_app() if _shop_app is not None else None


def _is_package_app(app: Any) -> bool:
    """Whether ``app`` is ``celery -A merchant_tasks``'s (``worker.app``, which may be
    being imported: its ``app`` is set before it calls install)."""
    module = sys.modules.get("merchant_tasks.worker.app")
    return module is not None and getattr(module, "app", None) is app


def beat_entry(interval: float) -> dict[str, Any]:
    """Beat's check of every account, every ``interval`` seconds."""
    return {
        "task": "merchant_tasks.renew_token",
        "schedule": interval,
        # a check nobody ran before the next tick is replaced by that tick's
        "options": {"expires": interval},
    }


def with_renewal_queue(queues: Any, app: Any) -> Any:
    """``queues`` (the app's task_queues) with the renewal queue added, or bound to its own
    exchange and routing key where the app lists it bound otherwise (by name alone, Celery
    binds it to its default exchange and routing key, beside the calls' queue: a call would
    land in both); the same object when nothing changes."""
    renewal = own_queue(RENEWAL_QUEUE)
    if not queues:  # Celery would make the default queue alone: keep it, as Celery makes it
        return (*app.amqp.Queues(None).values(), renewal)
    if isinstance(queues, Mapping):
        given = queues.get(RENEWAL_QUEUE)
        if given is not None and _is_ours(given):
            return queues
        return {**queues, RENEWAL_QUEUE: _rebound(given)}
    listed = [queue for queue in queues if queue.name == RENEWAL_QUEUE]
    if not listed:
        return (*queues, renewal)
    if all(_is_ours(queue) for queue in listed):
        return queues
    return tuple(_rebound(queue) if queue.name == RENEWAL_QUEUE else queue for queue in queues)


def _is_ours(queue: Any) -> bool:
    """Whether a listed renewal queue is bound where merchant-tasks sends the renewals."""
    if not isinstance(queue, Queue):
        return False  # a dict of options (Celery's older form): ours replaces it
    exchange = queue.exchange
    return bool(
        exchange is not None
        and exchange.name == RENEWAL_QUEUE
        and queue.routing_key == RENEWAL_QUEUE
    )


def _rebound(given: Any) -> Queue:
    """The renewal queue on its own exchange and routing key, keeping the queue's own
    arguments (a quorum queue, a max priority) where the app gave some."""
    queue = own_queue(RENEWAL_QUEUE)
    arguments = getattr(given, "queue_arguments", None)
    if arguments:
        queue.queue_arguments = dict(arguments)
    return queue


def shared_bindings(app: Any) -> list[str]:
    """One sentence per place where merchant-tasks' messages (or a call published to
    Celery's default exchange and routing key) would reach more than one of the app's
    queues, and so run more than once."""
    conf = app.conf
    queues = app.amqp.queues
    destinations = {(conf.task_default_exchange, conf.task_default_routing_key)}
    for name in TASKS:
        queue = app.amqp.router.route({}, name).get("queue")
        if isinstance(queue, Queue) and queue.exchange is not None:
            destinations.add((queue.exchange.name, queue.routing_key))
    found = []
    for exchange, routing_key in sorted(destinations, key=str):
        bound = sorted(
            queue.name for queue in queues.values() if _receives(queue, exchange, routing_key)
        )
        if len(bound) > 1:
            found.append(
                f"task_queues bind {', '.join(bound)} to exchange {exchange!r} with routing "
                f"key {routing_key!r}: a message sent there lands in each of them and a call "
                f"runs {len(bound)} times; give each queue its own routing key, e.g. "
                f"Queue({bound[-1]!r}, Exchange({bound[-1]!r}), routing_key={bound[-1]!r})"
            )
    return found


def _receives(queue: Any, exchange: str, routing_key: str | None) -> bool:
    """Whether ``queue`` gets a message sent to ``exchange`` with ``routing_key``."""
    bound = queue.exchange
    if bound is None or bound.name != exchange:
        return False
    if bound.type in ("fanout", "headers"):
        return True
    if bound.type == "topic":
        pattern = re.escape(queue.routing_key or "").replace(r"\*", r"[^.]+")
        return re.fullmatch(pattern.replace(r"\#", ".*"), routing_key or "") is not None
    return bool(queue.routing_key == routing_key)


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


def _check_queues(sender: Any = None, **_: Any) -> None:
    """Before a worker consumes: no message of merchant-tasks can land in two queues, or
    the worker stops in one line (``shared_bindings``)."""
    app = getattr(sender, "app", None)
    if app not in _installed:
        return
    problems = shared_bindings(app)
    if problems:
        exit_with(ConfigurationError(problems[0]))


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


def _check_store_at_start(sender: Any = None, **_: Any) -> None:
    """Worker and beat: the token store checked in the background (``worker.store_check``)."""
    if getattr(sender, "app", None) in _installed:
        start_store_check()


def _prepare_worker(sender: str, instance: Any, **_: Any) -> None:
    """Once the worker logs, before it connects: pools fit its concurrency, acknowledgements
    and results on Redis wait out a Redis refusing writes (``worker.broker_writes``), the
    settings that break a guarantee are named, and no stale binding remains."""
    app = instance.app
    if app not in _installed:
        return
    size_pools_at_worker_start(instance)
    if _is_redis_broker(app.conf.broker_url) or _is_redis_broker(app.conf.result_backend):
        wait_out_refused_writes()
    for problem in broken_guarantees(app):
        log.warning("merchant-tasks: %s", problem)
    try:
        remove_stale_bindings(app)
    except Exception as exc:  # the broker may be down at start: Celery keeps retrying it
        log.warning("could not check the broker for stale queue bindings: %r", exc)


def _tag_sent_call(
    sender: str | None = None, body: Any = None, headers: dict[str, Any] | None = None, **_: Any
) -> None:
    """Every call_api this process sends names its fleet and account (``worker.fleet``)."""
    if sender == CALL_API and headers is not None:
        tag_call(body, headers)
    elif sender == RENEW_ACCOUNT and headers is not None:
        tag_renewal(headers)


before_task_publish.connect(_tag_sent_call)
worker_ready.connect(_check_store_at_start)
beat_init.connect(_check_store_at_start)
worker_init.connect(_check_accounts)
worker_init.connect(_check_queues)
beat_init.connect(_check_beat_accounts)
celeryd_after_setup.connect(_prepare_worker)
