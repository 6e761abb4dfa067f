"""Shared fixtures: a real Redis (the machine's, or a private one started here), a fresh key
prefix per test with a token store under it, and the sandbox emulator serving on loopback;
for unit tests, a store on fakeredis and a scripted token exchange."""

from __future__ import annotations

import base64
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from merchant_tasks.accounts import FleetClient, client_for
from merchant_tasks.exchange import IssuedToken
from merchant_tasks.local import RedisServer, free_port
from merchant_tasks.redis_topology import StoreClient
from merchant_tasks.sandbox import SandboxApp, SandboxConfig, SandboxServer
from merchant_tasks.settings import FleetSettings, Secret, Settings
from merchant_tasks.store import TokenStore

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

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


def dead_redis() -> redis.Redis:
    """A client for a port nobody listens on, failing at once (no retries, no back-off)."""
    return redis.Redis(
        host="127.0.0.1",
        port=free_port(),
        socket_connect_timeout=0.2,
        socket_timeout=0.2,
        retry=Retry(NoBackoff(), 0),
    )


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The machine's Redis on 127.0.0.1:6379, else a private redis-server started here."""
    configured = os.environ.get("MERCHANT_TEST_REDIS_URL")
    if configured:
        yield configured
        return
    if _reachable("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379/0"
        return
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture
def key_prefix() -> str:
    """A key prefix no other test (or earlier run) uses."""
    return f"mt-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def redis_client(redis_url: str, key_prefix: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    keys = list(client.scan_iter(match=f"{key_prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def redis_store(redis_client: redis.Redis, key_prefix: str) -> TokenStore:
    """A token store on the real Redis, under this test's own key prefix."""
    return TokenStore(redis_client, TokenStore.namespace_for(key_prefix, "sandbox", "app-id-1234"))


class WatchedSandbox(SandboxApp):
    """The emulator, counting requests by path as they arrive (before any latency)."""

    def __init__(self, config: SandboxConfig) -> None:
        super().__init__(config)
        self._arrivals: Counter[str] = Counter()
        self._arrivals_lock = threading.Lock()

    def arrived(self, path: str) -> int:
        with self._arrivals_lock:
            return self._arrivals[path]

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Any:
        with self._arrivals_lock:
            self._arrivals[environ.get("PATH_INFO", "")] += 1
        return super().__call__(environ, start_response)


@dataclass
class Sandbox:
    """A running emulator and what a test needs to reach it."""

    app: WatchedSandbox
    server: SandboxServer

    @property
    def url(self) -> str:
        return self.server.url

    def exchanges(self) -> dict[str, int]:
        counts: dict[str, int] = self.app.counters()["exchanges"]
        return counts

    def calls(self) -> dict[str, int]:
        counts: dict[str, int] = self.app.counters()["calls"]
        return counts


@pytest.fixture
def sandbox_config() -> SandboxConfig:
    return SandboxConfig(api_key=TEST_API_KEY, secret=TEST_SECRET)


@pytest.fixture
def sandbox(sandbox_config: SandboxConfig) -> Iterator[Sandbox]:
    app = WatchedSandbox(sandbox_config)
    with SandboxServer(app) as server:
        yield Sandbox(app, server)


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-secret"
    path.write_text(TEST_SECRET + "\n")
    return path


@pytest.fixture
def settings(sandbox: Sandbox, redis_url: str, key_prefix: str, secret_file: Path) -> Settings:
    """Settings for the emulator, the secret read from a file as in production."""
    return Settings(
        api_key=TEST_API_KEY,
        secret=Secret(path=secret_file),
        base_url=sandbox.url,
        fleet=FleetSettings(redis_url=redis_url, key_prefix=key_prefix),
    )


@pytest.fixture
def account_env(
    sandbox: Sandbox, secret_file: Path, redis_url: str, key_prefix: str
) -> dict[str, str]:
    """The MERCHANT_* variables of the emulator's account (what the command line reads)."""
    return {
        "MERCHANT_API_KEY": TEST_API_KEY,
        "MERCHANT_API_SECRET_FILE": str(secret_file),
        "MERCHANT_BASE_URL": sandbox.url,
        "MERCHANT_REDIS_URL": redis_url,
        "MERCHANT_KEY_PREFIX": key_prefix,
    }


@pytest.fixture
def client(settings: Settings, redis_client: redis.Redis) -> FleetClient:
    return client_for(settings, redis_client=redis_client)


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
