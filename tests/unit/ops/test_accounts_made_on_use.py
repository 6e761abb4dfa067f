"""A process configured with 10,000 accounts builds what it uses: one account's call builds
that account's store and client only, the start-up check holds one store at a time and
keeps none, and `status` loads neither the HTTP stack nor Celery (a worker's memory and
`status`'s time, bench scenario 8)."""

from __future__ import annotations

import subprocess
import sys
import weakref
from typing import Any

import fakeredis
import pytest

from merchant_tasks import accounts as accounts_module
from merchant_tasks.accounts import AccountClients
from merchant_tasks.api.client import MerchantClient
from merchant_tasks.settings import FleetSettings, Secret, Settings
from merchant_tasks.store.health import check_store
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.worker import store_check
from support.account import TEST_SECRET

ACCOUNTS = 10_000
HEAVY = ("requests", "urllib3", "tenacity", "celery", "kombu")  # what `status` never needs


def _accounts(count: int) -> dict[str, Settings]:
    base = Settings(
        api_key="AK-made-on-use",
        secret=Secret(TEST_SECRET),
        fleet=FleetSettings(redis_url="redis://127.0.0.1:6379/0", key_prefix="mt-unit"),
    )
    return {
        f"shop-{n}": Settings(
            api_key=f"{base.api_key}.shop-{n}", secret=base.secret, fleet=base.fleet
        )
        for n in range(count)
    }


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> dict[str, weakref.WeakSet[Any]]:
    """Every TokenStore and MerchantClient made from now on (while alive), on fakeredis."""
    server = fakeredis.FakeServer()
    monkeypatch.setattr(
        accounts_module, "redis_for", lambda fleet: fakeredis.FakeRedis(server=server)
    )
    seen: dict[str, weakref.WeakSet[Any]] = {
        "stores": weakref.WeakSet(),
        "clients": weakref.WeakSet(),
    }
    for kind, cls in (("stores", TokenStore), ("clients", MerchantClient)):
        init = cls.__init__

        def counted(
            self: Any, *args: Any, _init: Any = init, _kind: str = kind, **kwargs: Any
        ) -> None:
            seen[_kind].add(self)
            _init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counted)
    return seen


def test_using_one_account_of_10000_builds_only_its_store_and_client(
    made: dict[str, weakref.WeakSet[Any]],
) -> None:
    with AccountClients(_accounts(ACCOUNTS)) as fleet:
        client = fleet.get("shop-4321")
        assert fleet.get("shop-4321") is client
        assert [store.account for store in made["stores"]] == ["shop-4321"]
        assert list(made["clients"]) == [client]


def test_the_start_up_check_holds_one_store_at_a_time_and_keeps_none(
    made: dict[str, weakref.WeakSet[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    accounts = _accounts(200)
    monkeypatch.setattr(AccountClients, "from_env", classmethod(lambda cls, **_: cls(accounts)))
    held: list[int] = []  # stores alive at each account's check
    checked: list[str] = []

    def check(store: TokenStore) -> None:
        held.append(len(made["stores"]))
        checked.append(store.account)
        check_store(store)

    monkeypatch.setattr("merchant_tasks.worker.store_check.check_store", check)
    store_check.check_stores()
    assert checked == list(accounts)
    assert max(held) == 1
    assert len(made["stores"]) == 0


def test_importing_the_command_line_loads_no_http_stack_and_no_celery() -> None:
    code = (
        "import sys, merchant_tasks.ops.cli\n"
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == []


def test_status_loads_no_http_stack_and_no_celery_up_to_reading_redis() -> None:
    """The whole command, its accounts loaded and its records made: Redis is down here, so
    it stops at the reading (exit 3), having imported all it would use."""
    code = (
        "import sys\n"
        "from merchant_tasks.ops.cli import main\n"
        "try:\n"
        "    main(['status', '--json'])\n"
        "except SystemExit as exc:\n"
        f"    print(exc.code, ' '.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    env = {
        "MERCHANT_API_KEY": "AK-status",
        "MERCHANT_API_SECRET": TEST_SECRET,
        "MERCHANT_REDIS_URL": "redis://127.0.0.1:1/0",
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    exit_code, *loaded = done.stdout.splitlines()[-1].split()
    assert (exit_code, loaded) == ("3", [])
