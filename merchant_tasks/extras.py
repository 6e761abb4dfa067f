"""What is installed: this package's version, the optional parts and the extras that
install them.

A worker needs only the core (celery with Redis, redis, requests, tenacity, click). The
tools are extras: ``sandbox`` (the emulator: werkzeug), ``metrics`` (prometheus-client),
``flower``, ``demo`` (the emulator and an embedded Redis), ``encryption`` (tokens
sealed at rest), ``gevent`` (the gevent worker pool), ``otel`` (the OpenTelemetry API:
without it, or without an SDK, ``telemetry`` records nothing and never complains),
``asyncio`` (httpx: the asyncio client and ``MerchantAuth``), ``all``. A tool whose extra is
missing stops with ``MissingExtra`` naming the pip command, not an ImportError; so does a
Celery worker whose pool is gevent, when the pool is named where the app sees it first
(``worker_pool`` in the configuration, ``-Pgevent``). ``celery ... worker -P gevent`` and
``--pool gevent`` make Celery import gevent before it loads any app: there Celery's own
ImportError is all a user sees.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from merchant_tasks.exceptions import MissingExtra


def package_version() -> str:
    """The installed version of merchant-tasks (``0+unknown`` in a tree never installed)."""
    try:
        return version("merchant-tasks")
    except PackageNotFoundError:
        return "0+unknown"


# extra -> the top-level modules it installs
EXTRAS = {
    "sandbox": ("werkzeug",),
    "metrics": ("prometheus_client",),
    "flower": ("flower",),
    "demo": ("werkzeug", "fakeredis", "lupa"),
    "encryption": ("cryptography",),
    "gevent": ("gevent",),
    "otel": ("opentelemetry",),
    "asyncio": ("httpx",),
}
POOL_EXTRAS = {"gevent": "gevent"}  # a worker pool (-P) -> the extra that installs it


def require(extra: str, what: str) -> None:
    """Raise MissingExtra unless every module of ``extra`` can be imported."""
    missing = [name for name in EXTRAS[extra] if not _installed(name)]
    if missing:
        raise MissingExtra(
            f"{what} needs the '{extra}' extra ({', '.join(missing)} not installed): "
            f"pip install 'merchant-tasks[{extra}]'"
        )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install counts as missing
        return False


def require_worker_pool(argv: Sequence[str], configured: str | None) -> None:
    """Raise MissingExtra when ``argv`` is ``celery ... worker`` whose pool (its -P, else
    ``configured``, the app's worker_pool) needs an extra that is missing."""
    if "worker" not in argv:
        return
    pool = configured
    for i, arg in enumerate(argv):
        if arg in ("-P", "--pool") and i + 1 < len(argv):
            pool = argv[i + 1]
        elif arg.startswith("--pool="):
            pool = arg.split("=", 1)[1]
        elif arg.startswith("-P") and len(arg) > 2:
            pool = arg[2:]
    extra = POOL_EXTRAS.get(pool or "")
    if extra is not None:
        require(extra, f"celery worker -P {pool}")
