"""The Celery app: ``celery -A merchant_tasks worker|beat|flower``.

Configuration is layered, each layer overriding the one before:

1. the package defaults below (safe for production: late acknowledgement, prefetch 1,
   JSON only, results retried through a Redis restart);
2. ``celeryconfig.py`` from the working directory, if importable (the repository's top-level
   ``celeryconfig.py`` is the container image's, and the place to override these defaults);
3. ``CELERY_BROKER_URL`` and ``CELERY_RESULT_BACKEND`` from the environment;
4. ``install(app)`` (``worker.install``), as for any user's app: the tasks, the renewal queue and
   its route, beat's entry, and the worker-start hooks (pool sizing, stale bindings).

Broker and result backend default to MERCHANT_REDIS_URL (or MERCHANT_REDIS_URL_FILE), the
token store's Redis: the defaults are built from the validated ``FleetSettings``, so a
setting is read and checked in one place. On that Redis, a fleet with its own
MERCHANT_KEY_PREFIX keeps Celery's keys (queues, bindings, results, control) under
``<prefix>:celery:`` (kombu's ``global_keyprefix``), so two fleets sharing a Redis never run
each other's calls; the default prefix keeps Celery's plain key names, as older releases
wrote them. A configuration mistake stops ``celery -A
merchant_tasks ...`` with a one-line message naming the variable, and a worker with no
account configured stops at start rather than failing every task.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from celery import Celery
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from merchant_tasks.exceptions import ConfigurationError
from merchant_tasks.settings import (
    DEFAULT_KEY_PREFIX,
    FleetSettings,
    celery_url_overrides,
    environment,
)
from merchant_tasks.store.topology import celery_url, is_kombu_redis_url, is_sentinel_url
from merchant_tasks.worker.install import exit_with, install, started_by_celery_command
from merchant_tasks.worker.routing import (
    CALLS_QUEUE as CALLS_QUEUE,  # re-exported: the queues' names
)
from merchant_tasks.worker.routing import RENEWAL_QUEUE as RENEWAL_QUEUE
from merchant_tasks.worker.routing import VISIBILITY_TIMEOUT as VISIBILITY_TIMEOUT

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


def celery_key_prefix(key_prefix: str) -> str:
    """Where a fleet keeps Celery's keys on the token store's Redis: under its own
    MERCHANT_KEY_PREFIX; nowhere apart for the default prefix (older releases' key names,
    so an upgrade finds the calls they queued)."""
    return "" if key_prefix == DEFAULT_KEY_PREFIX else f"{key_prefix}:celery:"


def package_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings merchant-tasks relies on; celeryconfig.py may change any of them."""
    redis_url = celery_url(FleetSettings.from_env(environ).redis_url)
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
        # time, and put the message back when the worker process is killed mid-task (set
        # on merchant-tasks' own tasks by install() too, whatever the app's defaults)
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": CALLS_QUEUE,
        "worker_send_task_events": True,  # Flower's live view
        "task_send_sent_event": True,
    }


def load_config(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Package defaults, then celeryconfig.py (if importable), then the environment."""
    env = environment(environ)
    config = package_defaults(env)
    chosen: dict[str, Any] = {}
    try:
        module = importlib.import_module("celeryconfig")
    except ModuleNotFoundError as exc:
        if exc.name != "celeryconfig":
            raise  # celeryconfig.py exists but imports something missing: say so
    else:
        chosen = {k: v for k, v in vars(module).items() if not k.startswith("_") and k.islower()}
    config.update(chosen)
    config.update(celery_url_overrides(env))
    for url, options in (
        ("broker_url", "broker_transport_options"),
        ("result_backend", "result_backend_transport_options"),
    ):  # the defaults again for the URL finally chosen, under celeryconfig's own options
        config[options] = transport_options(config[url], chosen.get(options) or {}, env)
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
    fleet = FleetSettings.from_env(environ)
    if celery_url(url) == celery_url(fleet.redis_url) and celery_key_prefix(fleet.key_prefix):
        # Celery on the token store's Redis: its keys beside the fleet's own
        defaults["global_keyprefix"] = celery_key_prefix(fleet.key_prefix)
    if is_sentinel_url(url):
        # the token store's sentinel settings serve Celery too: one value for both
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
    prefixed = {"global_keyprefix": f"{key_prefix}:celery:"}  # whatever the prefix
    return {
        "broker_url": celery_url(redis_url),
        "result_backend": celery_url(redis_url),
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
    path.unlink(missing_ok=True)  # created anew with its mode: never readable by others
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write("\n".join(lines) + "\n")


app = Celery("merchant_tasks")
try:
    app.conf.update(load_config())
except ConfigurationError as exc:
    if not started_by_celery_command():
        raise
    exit_with(exc)
install(app)
