"""Several accounts against the emulator and real Redis: each its own token, its key only
in its environment, two accounts of one key refused by a command, and clients that close
what they opened."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from requests.adapters import HTTPAdapter

from merchant_tasks.accounts import AccountClients, load_accounts
from merchant_tasks.exceptions import ConfigurationError
from merchant_tasks.ops.cli import EXIT_CONFIGURATION, main
from merchant_tasks.sandbox.emulator import SandboxApp, SandboxConfig, SandboxServer
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import wait_until
from merchant_tasks.settings import Settings
from support.account import TEST_API_KEY
from support.accounts_files import two_accounts_of_one_key, write_file

pytestmark = pytest.mark.integration


def test_two_accounts_of_one_environment_and_key_are_refused_naming_both(
    tmp_path: Path, merchant_secret_file: Path, merchant_key_prefix: str
) -> None:
    path = two_accounts_of_one_key(tmp_path, merchant_secret_file, "http://127.0.0.2:8480")
    with pytest.raises(ConfigurationError, match="accounts 'shop-a' and 'shop-b' have the same"):
        load_accounts({"MERCHANT_ACCOUNTS_FILE": str(path)})
    env = {
        "MERCHANT_ACCOUNTS_FILE": str(path),
        "MERCHANT_KEY_PREFIX": merchant_key_prefix,
        "MERCHANT_API_KEY": None,  # no default account from the shell
        "MERCHANT_API_SECRET": None,
        "MERCHANT_API_SECRET_FILE": None,
    }
    result = CliRunner().invoke(main, ["status"], env=env)
    assert result.exit_code == EXIT_CONFIGURATION
    [line] = result.stderr.splitlines()
    assert "'shop-a' and 'shop-b'" in line


# -- two emulators, two environments ---------------------------------------------------


PRODUCTION_KEY = "prod-app-id"
PRODUCTION_SECRET = "prod-secret-5b9e0c"


class _RecordingApp:
    """Wraps an emulator to record every appid that reached its token endpoint."""

    def __init__(self, app: SandboxApp) -> None:
        self.app = app
        self.appids: list[str] = []

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if environ["PATH_INFO"].endswith("/auth/access_token"):
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = environ["wsgi.input"].read(length)
            self.appids.append(json.loads(body).get("appid", ""))
            environ["wsgi.input"] = io.BytesIO(body)
        return self.app(environ, start_response)


@pytest.fixture
def production() -> Iterator[tuple[_RecordingApp, str]]:
    app = SandboxApp(
        SandboxConfig(api_key=PRODUCTION_KEY, secret=PRODUCTION_SECRET, environment="production")
    )
    recording = _RecordingApp(app)
    with SandboxServer(recording) as server:  # type: ignore[arg-type]  # any WSGI app serves
        yield recording, server.url


def test_each_account_gets_its_own_token_and_its_key_reaches_only_its_environment(
    merchant_sandbox: MerchantSandbox,
    production: tuple[_RecordingApp, str],
    tmp_path: Path,
    merchant_secret_file: Path,
    merchant_redis_url: str,
    merchant_key_prefix: str,
    redis_client: redis.Redis,
) -> None:
    production_app, production_url = production
    production_secret = write_file(tmp_path / "prod-secret", PRODUCTION_SECRET)
    accounts_file = write_file(
        tmp_path / "accounts.toml",
        f"""
[accounts.live]
environment = "production"
base_url = "{production_url.replace("127.0.0.1", "localhost")}"
allow_insecure_http = true
api_key = "{PRODUCTION_KEY}"
api_secret_file = "{production_secret}"
""",
    )
    clients = AccountClients.from_env(
        {
            "MERCHANT_API_KEY": TEST_API_KEY,
            "MERCHANT_API_SECRET_FILE": str(merchant_secret_file),
            "MERCHANT_BASE_URL": merchant_sandbox.url,
            "MERCHANT_ACCOUNTS_FILE": str(accounts_file),
            "MERCHANT_REDIS_URL": merchant_redis_url,
            "MERCHANT_KEY_PREFIX": merchant_key_prefix,
        }
    )
    for _ in range(3):
        assert clients.get("default").request("GET", "/open-api/v1/merchant/profile") == {
            "appid": TEST_API_KEY,
            "environment": "sandbox",
        }
        assert clients.get("live").request("GET", "/open-api/v1/merchant/profile") == {
            "appid": PRODUCTION_KEY,
            "environment": "production",
        }
    clients.get("default").manager.renew(force=True)

    assert production_app.appids == [PRODUCTION_KEY]  # the sandbox key never reached it
    assert merchant_sandbox.exchanges() == {"ok": 2, "rejected": 0, "rate_limited": 0, "failed": 0}
    stores = {name: clients.get(name).manager.store for name in ("default", "live")}
    assert stores["default"].namespace != stores["live"].namespace
    assert stores["default"].generation() == 2
    assert stores["live"].generation() == 1
    assert stores["live"].records.counters() == {
        "renewals:mandatory:ok": 1,
        "exchange_attempts:mandatory:ok": 1,
    }


# -- closing the clients -----------------------------------------------------------------


def test_closing_the_clients_closes_their_redis_connections_and_http_pools(
    merchant_settings: Settings, merchant_sandbox: MerchantSandbox, redis_client: redis.Redis
) -> None:
    """What the command line does when a command ends, and a test or an application may do:
    nothing is left open for the garbage collector to find (a ResourceWarning then)."""
    with AccountClients({"default": merchant_settings}) as fleet:
        first = fleet.get()
        assert first.request("GET", "/open-api/v1/ping") == {"ok": True}
        connection = first.manager.store.redis.client_id()
        adapter = first.session.get_adapter(merchant_sandbox.url)
        assert isinstance(adapter, HTTPAdapter)
        http_pools = adapter.poolmanager.pools
        assert len(http_pools) == 1
        assert len(redis_client.client_list(client_id=[connection])) == 1
    assert len(http_pools) == 0
    wait_until(
        lambda: redis_client.client_list(client_id=[connection]) == [],
        "the store's Redis connection closed",
        10.0,
    )
    again = fleet.get()  # after close(), a client asked for opens new connections
    assert again is not first
    assert again.request("GET", "/open-api/v1/ping") == {"ok": True}
    fleet.close()
