"""Shared fixtures. The plugin the package ships (merchant_tasks.pytest_plugin) gives each
test its Redis key prefix, emulator account, settings and client; here the suite fixes that
account's key and secret, adds a Redis client and token store under the test's prefix, the
Celery processes of a test (``fleet``), and for unit tests a store on fakeredis, a scripted
token exchange and ``make_manager``."""

from __future__ import annotations

import base64
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.connection import Connection
from redis.retry import Retry

from celery_fleet import Fleet, running_fleet
from merchant_tasks.renewal.manager import TokenManager
from merchant_tasks.sandbox.emulator import SandboxConfig
from merchant_tasks.sandbox.processes import RedisServer, free_port
from merchant_tasks.sandbox.pytest_plugin import MerchantSandbox
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.store.topology import StoreClient
from merchant_tasks.token import IssuedToken

TEST_API_KEY = "test-app-id"
TEST_SECRET = "test-secret-4f1c9a7e2b"  # searched for in every leak test
FAKE_TOKEN_LIFETIME = 7200.0  # seconds, as the real API's tokens
UNIT_NAMESPACE = TokenStore.namespace_for("mt-test", "sandbox", "app-id-1234")


class FakeExchange:
    """A token exchange that gives the queued ``outcomes`` in turn (raising the errors), then
    fresh tokens ``tok-issued-1``, ``-2``, ... (``padding`` appended, as long as JWTs), and
    records the clock at each call in ``calls``; ``during`` runs inside each call."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.outcomes: list[IssuedToken | Exception] = []
        self.calls: list[float] = []
        self.during: Callable[[], None] | None = None
        self.padding = ""

    def issued(self, n: int) -> str:
        """The value of the ``n``-th fresh token (from 1)."""
        return f"tok-issued-{n}{self.padding}"

    def __call__(self) -> IssuedToken:
        self.calls.append(self.clock())
        if self.during is not None:
            self.during()
        if self.outcomes:
            outcome = self.outcomes.pop(0)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return IssuedToken(value=self.issued(len(self.calls)), expires_in=FAKE_TOKEN_LIFETIME)


@pytest.fixture
def fake_redis() -> redis.Redis:
    """A fakeredis server of this test's own."""
    client: redis.Redis = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    return client


@pytest.fixture
def store(fake_redis: redis.Redis) -> TokenStore:
    """A token store on this test's fakeredis."""
    return TokenStore(fake_redis, UNIT_NAMESPACE)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, for tests that stop, fill or reconfigure it."""
    with RedisServer(tmp_path / "redis") as server:
        yield server


class OutOfMemory:
    """A Redis that refuses every write (``maxmemory`` 1, ``noeviction``) from now for
    ``seconds``. ``freeing`` is set just before it takes writes again (a write that waited
    finds it set), ``freed`` once it does."""

    def __init__(self, admin: redis.Redis, seconds: float = 1.0) -> None:
        self.freeing, self.freed = threading.Event(), threading.Event()
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")

        def free() -> None:
            self.freeing.set()
            admin.config_set("maxmemory", "0")
            self.freed.set()

        threading.Timer(seconds, free).start()


class CountingConnection(Connection):
    """A Redis connection that counts what it sends: one packet per command, one per
    pipeline (a round trip each)."""

    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sent += 1
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


# -- how the suite runs -------------------------------------------------------------------

# The suite waits more than it computes (token lifetimes, broker redeliveries, processes
# starting): with one xdist worker per core the cores sat idle most of the run.
WORKERS_PER_CORE = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: four workers per core (PYTEST_XDIST_AUTO_NUM_WORKERS still decides)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return WORKERS_PER_CORE * (os.cpu_count() or 1)


# The suite starts hundreds of Python processes (workers, beats, callers, the command line).
# Under PYTHONDONTWRITEBYTECODE each compiles the package again: their bytecode goes to a
# cache of the suite's own in the temporary directory instead, never beside the sources.
PYCACHE = Path(tempfile.gettempdir()) / "merchant-tasks-test-pycache"


def pytest_configure(config: pytest.Config) -> None:
    """Before xdist starts its workers, which, like every process a test starts, inherit it."""
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
        del os.environ["PYTHONDONTWRITEBYTECODE"]
        os.environ["PYTHONPYCACHEPREFIX"] = str(PYCACHE)


# Fixtures whose tests run longest (processes, failovers, token lifetimes), longest first.
LONG_RUNNING_FIXTURES = ("sentinel_group", "fleet", "callers")


def _expected_length(item: pytest.Item) -> tuple[int, int]:
    """Sorts the longest kinds of test first: those marked ``long`` and those of
    LONG_RUNNING_FIXTURES in that order, then the other integration tests, then the unit
    tests."""
    if item.get_closest_marker("long"):
        return (0, 0)
    used = getattr(item, "fixturenames", ())
    for rank, name in enumerate(LONG_RUNNING_FIXTURES):
        if name in used:
            return (0, rank)
    return (1 if item.get_closest_marker("integration") else 2, 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest tests first, the unit tests last: the long waits start at once, and the
    short tests fill the workers' gaps at the end instead of a long test ending the run."""
    items.sort(key=_expected_length)


def dead_redis() -> redis.Redis:
    """A client for a port nobody listens on, failing at once (no retries, no back-off)."""
    return redis.Redis(
        host="127.0.0.1",
        port=free_port(),
        socket_connect_timeout=0.2,
        socket_timeout=0.2,
        retry=Retry(NoBackoff(), 0),
    )


# -- the plugin's fixtures, as this suite needs them -------------------------------------
# merchant_tasks.pytest_plugin gives every test its emulator account, settings, client and
# Redis key prefix (merchant_sandbox, merchant_settings, merchant_client, merchant_env,
# merchant_key_prefix, merchant_redis_url); the suite fixes the account's key and secret.


@pytest.fixture
def merchant_sandbox_config() -> SandboxConfig:
    """The suite's emulator account: a fixed API key, and the secret every leak search
    looks for."""
    return SandboxConfig(api_key=TEST_API_KEY, secret=TEST_SECRET)


@pytest.fixture
def redis_client(merchant_redis_url: str) -> Iterator[redis.Redis]:
    """A client of the tests' Redis (the plugin deletes the test's keys afterwards)."""
    client = redis.Redis.from_url(merchant_redis_url)
    yield client
    client.close()


@pytest.fixture
def redis_store(redis_client: redis.Redis, merchant_key_prefix: str) -> TokenStore:
    """A token store on the real Redis, under this test's own key prefix."""
    namespace = TokenStore.namespace_for(merchant_key_prefix, "sandbox", "app-id-1234")
    return TokenStore(redis_client, namespace)


@pytest.fixture
def fleet(
    tmp_path: Path,
    merchant_sandbox: MerchantSandbox,
    merchant_key_prefix: str,
    merchant_secret_file: Path,
) -> Iterator[Fleet]:
    """The Celery processes of this test (none started yet), on a redis-server of its own."""
    with running_fleet(tmp_path, merchant_sandbox, merchant_key_prefix, merchant_secret_file) as f:
        yield f


def make_manager(
    store: TokenStore, exchange: Callable[[], IssuedToken], **options: Any
) -> TokenManager:
    """A ``TokenManager`` for tests: the real windows (480 s / 120 s), a short exchange
    timeout, seeded jitter, no copy of the token in the process and no wake-ups (waits go
    through the injected sleep), unless ``options`` say otherwise."""
    defaults: dict[str, Any] = {
        "renew_before": 480.0,
        "renew_mandatory": 120.0,
        "exchange_timeout": 0.1,
        "rng": random.Random(0),
        "local_copy_ttl": 0.0,  # read the store on every call; the copy has its own tests
        "wake_ups": False,
    }
    fingerprint = options.pop("secret_fingerprint", lambda: "fp")
    return TokenManager(store, exchange, fingerprint, **{**defaults, **options})


# -- the leak searches' readers (test_faults.py, test_celery_integration.py) ----------------


def redis_value(client: StoreClient, key: bytes) -> bytes:
    """A key and everything in it, read by type (members only, for sorted sets)."""
    kind = client.type(key)
    values: list[Any] = [key]
    if kind == b"string":
        values.append(client.get(key))
    elif kind == b"list":
        values += cast(list[bytes], client.lrange(key, 0, -1))
    elif kind == b"hash":
        for pair in cast(dict[bytes, bytes], client.hgetall(key)).items():
            values += pair
    elif kind == b"set":
        values += cast(set[bytes], client.smembers(key))
    elif kind == b"zset":
        values += cast(list[bytes], client.zrange(key, 0, -1))
    elif kind == b"stream":
        for entry_id, fields in cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(key)):
            values.append(entry_id)
            for pair in fields.items():
                values += pair
    elif kind != b"none":  # "none": expired since the scan
        raise AssertionError(f"no reader for Redis type {kind!r} (key {key!r})")
    return b"\n".join(v for v in values if isinstance(v, bytes))


def encoded_forms(needle: str) -> list[bytes]:
    """The needle, and the part of its base64 that shows at any offset (message bodies)."""
    raw = needle.encode()
    forms = [raw]
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + raw)
        core = encoded[4 if shift else 0 : (len(raw) + shift) // 3 * 4]
        forms += [core, core.replace(b"+", b"-").replace(b"/", b"_")]
    return forms


def shows(needle: str, text: bytes) -> bool:
    """Whether ``text`` holds the needle, plainly or in base64."""
    return any(form in text for form in encoded_forms(needle))
