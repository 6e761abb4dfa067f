"""The Celery app: ``celery -A merchant_tasks worker|beat|flower``.

Configuration is layered, each layer overriding the one before:

1. the package defaults below (safe for production: late acknowledgement, prefetch 1,
   renewal on its own queue, JSON only);
2. ``celeryconfig.py`` from the working directory, if importable (``deploy/celeryconfig.py``
   is the container image's, and an example);
3. ``CELERY_BROKER_URL`` and ``CELERY_RESULT_BACKEND`` from the environment;
4. at worker start, the broker's and result backend's connection pools are raised to fit
   the worker's concurrency (see ``worker_pools``), whatever the pool (-P).

Broker and result backend default to MERCHANT_REDIS_URL (or MERCHANT_REDIS_URL_FILE), the
token store's Redis: the defaults are built from the validated ``FleetSettings``, so a
setting is read and checked in one place. A configuration mistake stops ``celery -A
merchant_tasks ...`` with a one-line message naming the variable, and a worker with no
account configured stops at start rather than failing every task.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import beat_init, celeryd_after_setup, worker_init
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from .exceptions import ConfigurationError
from .redis_topology import is_kombu_redis_url, is_sentinel_url
from .routing import CALLS_QUEUE as CALLS_QUEUE  # re-exported: the queues' names
from .routing import RENEWAL_QUEUE as RENEWAL_QUEUE
from .routing import remove_stale_bindings, task_queues
from .settings import FleetSettings
from .worker_pools import size_pools_at_worker_start

log = logging.getLogger(__name__)

EXIT_CONFIGURATION = 2  # the exit code of a configuration mistake, as the CLI's
VISIBILITY_TIMEOUT = 3600  # seconds an unacknowledged message waits before redelivery
RESULT_EXPIRES = 3600  # results are for the caller waiting on them, not an archive
RESULT_BACKEND_RETRIES = 20  # Celery backs off between them: about a minute of Redis restart
# publishing (an enqueue, or a task's own retry) waits out a broker that is away for about
# a minute (a Redis restart, a Sentinel failover: 30 s before the sentinels even call the
# master down, by default) instead of failing after Celery's 0.6 s: a task whose retry
# cannot be published is rejected, and its call dropped
PUBLISH_RETRY_POLICY = {
    "max_retries": 30,
    "interval_start": 0,
    "interval_step": 1,
    "interval_max": 2,
}
# what only kombu's Redis transports read (visibility_timeout, sentinel_kwargs, ...): never
# sent to another broker such as RabbitMQ
REDIS_ONLY_TRANSPORT_OPTIONS = frozenset(kombu_redis.SentinelChannel.from_transport_options) - (
    frozenset(virtual.Channel.from_transport_options)
)


def package_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings merchant-tasks relies on; celeryconfig.py may change any of them."""
    fleet = FleetSettings.from_env(environ)
    redis_url = fleet.redis_url
    interval = fleet.renew_interval
    return {
        "broker_url": redis_url,
        "result_backend": redis_url,
        "broker_connection_retry_on_startup": True,
        "task_publish_retry_policy": PUBLISH_RETRY_POLICY,
        "broker_transport_options": transport_options(redis_url, {}, environ),
        "result_backend_transport_options": transport_options(redis_url, {}, environ),
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_expires": RESULT_EXPIRES,
        # a result written while Redis restarts is retried, not lost: otherwise a call the
        # API executed would look failed to its caller, who might repeat it
        "result_backend_always_retry": True,
        "result_backend_max_retries": RESULT_BACKEND_RETRIES,
        # no call is lost when a worker dies: acknowledge after the task ran, fetch one at a
        # time, and put the message back when the worker process is killed mid-task
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_queues": task_queues(),  # each bound to its own routing key
        "task_default_queue": CALLS_QUEUE,
        "task_routes": {"merchant_tasks.renew_token": {"queue": RENEWAL_QUEUE}},
        "beat_schedule": {
            "renew-merchant-token": {
                "task": "merchant_tasks.renew_token",
                "schedule": interval,
                # a renewal nobody ran before the next tick is replaced by that tick's
                "options": {"expires": interval, "queue": RENEWAL_QUEUE},
            }
        },
        "worker_send_task_events": True,  # Flower's live view
        "task_send_sent_event": True,
        "imports": ("merchant_tasks.tasks",),
    }


def load_config(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Package defaults, then celeryconfig.py (if importable), then the environment."""
    env = os.environ if environ is None else environ
    config = package_defaults(env)
    try:
        module = importlib.import_module("celeryconfig")
    except ModuleNotFoundError as exc:
        if exc.name != "celeryconfig":
            raise  # celeryconfig.py exists but imports something missing: say so
    else:
        config.update(
            {k: v for k, v in vars(module).items() if not k.startswith("_") and k.islower()}
        )
    if env.get("CELERY_BROKER_URL"):
        config["broker_url"] = env["CELERY_BROKER_URL"]
    if env.get("CELERY_RESULT_BACKEND"):
        config["result_backend"] = env["CELERY_RESULT_BACKEND"]
    for url, options in (
        ("broker_url", "broker_transport_options"),
        ("result_backend", "result_backend_transport_options"),
    ):
        config[options] = transport_options(config[url], config.get(options) or {}, env)
    return config


def transport_options(
    url: str, chosen: Mapping[str, Any], environ: Mapping[str, str]
) -> dict[str, Any]:
    """Transport options for the broker or result backend at ``url``: ``chosen`` (from
    celeryconfig.py) over our defaults for a Redis URL; without the Redis-only ones for
    any other (RabbitMQ)."""
    if not is_kombu_redis_url(url):
        return {k: v for k, v in chosen.items() if k not in REDIS_ONLY_TRANSPORT_OPTIONS}
    defaults: dict[str, Any] = {"visibility_timeout": VISIBILITY_TIMEOUT}
    if is_sentinel_url(url):
        # the token store's sentinel settings serve Celery too: one value for both
        fleet = FleetSettings.from_env(environ)
        defaults["master_name"] = fleet.redis_sentinel_master
        if fleet.redis_sentinel_password:
            defaults["sentinel_kwargs"] = {"password": fleet.redis_sentinel_password}
    return {**defaults, **chosen}


def isolated_config(redis_url: str, key_prefix: str) -> dict[str, Any]:
    """Broker and results on ``redis_url`` with every Celery key under ``key_prefix``.

    For a fleet sharing a Redis with another (the demo, a test's worker): its queues,
    bindings and results never mix with the other's.
    """
    defaults = package_defaults({"MERCHANT_REDIS_URL": redis_url})
    prefixed = {"global_keyprefix": f"{key_prefix}:celery:"}
    return {
        "broker_url": redis_url,
        "result_backend": redis_url,
        **{
            name: {**defaults[name], **prefixed}
            for name in ("broker_transport_options", "result_backend_transport_options")
        },
    }


def write_config_module(path: Path, config: Mapping[str, Any]) -> None:
    """A celeryconfig.py holding ``config``, for children started in its directory; only
    its owner may read it (the URLs may hold a password)."""
    lines = ['"""Written by merchant-tasks for one run; deleted with it."""']
    lines += [f"{name} = {value!r}" for name, value in config.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    path.chmod(0o600)


def _started_by_celery_command() -> bool:
    """Whether this process is ``celery ...`` (its CLI module is loaded), not a library user."""
    return "celery.bin.celery" in sys.modules


def _exit_with(exc: Exception) -> None:
    """A configuration mistake under ``celery ...``: one line on stderr, no traceback.

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


def _load_accounts_or_exit(read_secrets: bool) -> None:
    from .accounts import load_accounts  # the process's own import: the app needs no account

    try:
        load_accounts(read_secrets=read_secrets)
    except Exception as exc:
        _exit_with(exc)


def _check_beat_start(sender: Any = None, **_: Any) -> None:
    """Before the first tick: every account's settings load (beat holds no secret)."""
    if getattr(sender, "app", None) is app:
        _load_accounts_or_exit(read_secrets=False)


def _check_worker_start(sender: Any = None, **_: Any) -> None:
    """Before consuming: every account's settings load, and no stale binding remains."""
    if getattr(sender, "app", None) is not app:
        return  # another Celery app's worker in a process that imported this module
    _load_accounts_or_exit(read_secrets=True)
    try:
        remove_stale_bindings(app)
    except Exception as exc:  # the broker may be down at start: Celery keeps retrying it
        log.warning("could not check the broker for stale queue bindings: %r", exc)


worker_init.connect(_check_worker_start)
beat_init.connect(_check_beat_start)

app = Celery("merchant_tasks")
try:
    app.conf.update(load_config())
except ConfigurationError as exc:
    if not _started_by_celery_command():
        raise
    _exit_with(exc)


def _size_connection_pools(sender: str, instance: Any, **_: Any) -> None:
    """Fit the pools to this worker's concurrency, before it opens a broker connection."""
    if instance.app is app:
        size_pools_at_worker_start(instance)


celeryd_after_setup.connect(_size_connection_pools)
