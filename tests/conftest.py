"""Shared fixtures and the hooks that order the run. The plugin the package ships
(merchant_tasks.pytest_plugin) gives each test its Redis key prefix, emulator account,
settings and client; here the suite fixes that account's key and secret, adds a Redis client
and token store under the test's prefix, the Celery processes of a test (``fleet``), the
fault suites' caller processes (``callers``), and for unit tests a store on fakeredis and a
``TokenManager`` on a manual clock, sleep and scripted exchange. What tests import (fakes,
token makers, harnesses) is in ``support``."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
import redis

from merchant_tasks.renewal.manager import TokenManager
from merchant_tasks.sandbox.emulator import SandboxConfig
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import RedisServer
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.token import fingerprint
from support.account import TEST_API_KEY, TEST_SECRET, UNIT_NAMESPACE
from support.celery_config import write_celeryconfig
from support.celery_fleet import Fleet, running_fleet
from support.clock import ManualClock, Sleeper
from support.drip_server import DRIP, SHUTDOWN_POLL, DripServer
from support.fault_harness import Callers, Evidence
from support.renewal import FakeExchange, Renewal, make_manager
from support.token_keys import token_key_file


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
def key_file(tmp_path: Path) -> Path:
    """A token key file (tokens sealed at rest) of this test's own."""
    return token_key_file(tmp_path / "token-key")


@pytest.fixture
def empty_celeryconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An empty celeryconfig.py first on the path (not the repo's), unless a test writes one."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    write_celeryconfig(tmp_path, "")
    yield
    sys.modules.pop("celeryconfig", None)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, for tests that stop, fill or reconfigure it."""
    with RedisServer(tmp_path / "redis") as server:
        yield server


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
        _seed_pycache(PYCACHE)


def _seed_pycache(prefix: Path) -> None:
    """The bytecode written beside the standard library and the virtualenv's packages when
    they were installed, put where a ``PYTHONPYCACHEPREFIX`` makes Python look (it then reads
    no ``__pycache__``). Without it the first run on a fresh clone compiles the standard
    library, Celery, redis-py and the rest again in every process until each module is
    cached: 8 concurrent collections took 83 s of CPU here (27 s once cached). Python checks
    each file against its source, as it does in ``__pycache__``; a file already in the
    prefix is left as it is."""
    tag = sys.implementation.cache_tag
    packages = {Path(sysconfig.get_path(name)) for name in ("purelib", "platlib")}
    skipped = {"site-packages", "test", "idlelib", "tkinter", "lib2to3"}  # not imported here
    for root in {Path(sysconfig.get_path("stdlib")), *packages}:
        if not root.is_dir():
            continue
        stamp = prefix / f"seeded-{hashlib.sha256(str(root).encode()).hexdigest()[:16]}"
        installed = str(root.stat().st_mtime_ns)  # changes as packages come and go
        if stamp.is_file() and stamp.read_text() == installed:
            continue
        for folder, subfolders, _ in os.walk(root):
            if root not in packages:  # the standard library: without the interpreter's own
                subfolders[:] = [name for name in subfolders if name not in skipped]
            if Path(folder).name != "__pycache__":
                continue
            target = prefix / Path(folder).parent.relative_to("/")
            for pyc in Path(folder).glob(f"*.{tag}.pyc"):
                seeded = target / pyc.name
                if not seeded.exists():  # copied whole, then renamed: never read half-written
                    seeded.parent.mkdir(parents=True, exist_ok=True)
                    partial = seeded.with_name(f"{seeded.name}.{os.getpid()}")
                    shutil.copyfile(pyc, partial)
                    os.replace(partial, seeded)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(installed)


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


# -- the fault suites' caller processes, what they saw searched for the secret -------------


@pytest.fixture
def evidence() -> Iterator[Evidence]:
    """What the test saw (its caller processes' reports, whatever a test adds), searched for
    the test secret once every fixture that adds to it has been torn down: the test fails
    if the secret shows (faults/test_faults.py adds needles and texts of its own)."""
    record = Evidence()
    record.needle("the test secret", TEST_SECRET)
    yield record
    record.assert_no_leak()


@pytest.fixture
def callers(
    redis_client: redis.Redis,
    merchant_redis_url: str,
    merchant_key_prefix: str,
    tmp_path: Path,
    evidence: Evidence,
    request: pytest.FixtureRequest,
) -> Iterator[Callers]:
    """Caller processes for the test's account, killed when it ends."""
    fleet = Callers(
        redis_client,
        merchant_redis_url,
        f"{merchant_key_prefix}:callers",
        tmp_path,
        evidence,
        request.node.name,
    )
    try:
        yield fleet
    finally:
        fleet.kill()


# -- the renewal's unit tests: a manager on fakeredis, its clock, sleep and exchange -----


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def sleep(clock: ManualClock) -> Sleeper:
    return Sleeper(clock)


@pytest.fixture
def exchange(clock: ManualClock) -> FakeExchange:
    """The scripted token exchange the manager calls, recording each call on ``clock``."""
    return FakeExchange(clock)


@pytest.fixture
def secret() -> list[str]:
    """The current API secret; a test rotates it by replacing the item."""
    return ["secret-one-0a1b2c3d4e"]


@pytest.fixture
def manager(
    store: TokenStore,
    exchange: FakeExchange,
    clock: ManualClock,
    sleep: Sleeper,
    secret: list[str],
) -> TokenManager:
    return make_manager(
        store, exchange, secret_fingerprint=lambda: fingerprint(secret[0]), clock=clock, sleep=sleep
    )


@pytest.fixture
def renewal(
    manager: TokenManager,
    store: TokenStore,
    clock: ManualClock,
    exchange: FakeExchange,
    sleep: Sleeper,
    secret: list[str],
) -> Renewal:
    """``manager`` with its store, clock, sleep, exchange and secret, as one fixture."""
    return Renewal(manager, store, clock, exchange, sleep, secret)


@pytest.fixture
def copying_manager(
    store: TokenStore, exchange: FakeExchange, clock: ManualClock, sleep: Sleeper
) -> TokenManager:
    """A manager that trusts its copy for 1 s of the injected clock."""
    return make_manager(
        store,
        exchange,
        clock=clock,
        sleep=sleep,
        local_copy_ttl=1.0,
        monotonic=clock,
        wake_ups=True,
    )


# -- a token endpoint that drips its answer (the exchange's deadline) -----------------------


@pytest.fixture(params=["headers", "body"])
def dripping(request: pytest.FixtureRequest) -> Iterator[DripServer]:
    """A token endpoint on loopback dripping its headers, or its body, one byte at a time."""
    server = DripServer(drip=DRIP, dripped=request.param)
    thread = threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
