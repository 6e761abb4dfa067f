"""Optional parts and the pip extras that install them.

A worker needs only the core (celery with Redis, redis, requests, tenacity, click). The
tools are extras: ``sandbox`` (the emulator: werkzeug), ``metrics`` (prometheus-client),
``flower``, ``demo`` (the emulator and an embedded Redis), ``encryption`` (tokens
sealed at rest), ``gevent`` (the gevent worker pool), ``all``. A tool whose extra is
missing stops with ``MissingExtra`` naming the pip command, not an ImportError.
"""

from __future__ import annotations

import importlib.util

from .exceptions import MissingExtra

# extra -> the top-level modules it installs
EXTRAS = {
    "sandbox": ("werkzeug",),
    "metrics": ("prometheus_client",),
    "flower": ("flower",),
    "demo": ("werkzeug", "fakeredis", "lupa"),
    "encryption": ("cryptography",),
    "gevent": ("gevent",),
}


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
