"""Several accounts: configuration, isolation, and keys that never cross environments."""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from merchant_tasks.accounts import (
    DEFAULT_ACCOUNT,
    AccountClients,
    client_for,
    client_from_env,
    load_accounts,
)
from merchant_tasks.exceptions import ConfigurationError
from merchant_tasks.settings import ACCOUNT_KEYS
from support.account import TEST_SECRET
from support.accounts_files import two_accounts_of_one_key, write_file


def entry(name: str, secret_file: Path, **keys: str) -> str:
    """The ``[accounts.<name>]`` table of an accounts file: ``keys`` as strings, and the
    secret as a file."""
    lines = [f"[accounts.{name}]", *(f'{key} = "{value}"' for key, value in keys.items())]
    return "\n".join([*lines, f'api_secret_file = "{secret_file}"']) + "\n"


@pytest.fixture
def accounts_toml(tmp_path: Path) -> Callable[[str], dict[str, str]]:
    """The environment of an accounts file (TOML) of the given text."""
    return lambda text: {
        "MERCHANT_ACCOUNTS_FILE": str(write_file(tmp_path / "accounts.toml", text))
    }


def test_the_single_account_variables_define_the_default_account(
    merchant_secret_file: Path,
) -> None:
    accounts = load_accounts(
        {"MERCHANT_API_KEY": "k1", "MERCHANT_API_SECRET_FILE": str(merchant_secret_file)}
    )
    assert list(accounts) == [DEFAULT_ACCOUNT]
    assert accounts[DEFAULT_ACCOUNT].api_key == "k1"


def test_an_accounts_file_adds_accounts_sharing_the_fleet_settings(
    tmp_path: Path, merchant_secret_file: Path
) -> None:
    accounts_file = write_file(
        tmp_path / "accounts.toml",
        f"""
[accounts.eu-shop]
environment = "production"
base_url = "https://api.example.test"
api_key = "eu-key"
api_secret_file = "{merchant_secret_file}"
renew_before = 600

[accounts.test-shop]
api_key = "test-key"
api_secret_file = "{merchant_secret_file}"
""",
    )
    accounts = load_accounts(
        {
            "MERCHANT_ACCOUNTS_FILE": str(accounts_file),
            "MERCHANT_REDIS_URL": "redis://127.0.0.1:6390/3",
            "MERCHANT_RENEW_BEFORE": "300",
            "MERCHANT_API_SECRET": "must-not-be-inherited",
        }
    )
    assert set(accounts) == {"eu-shop", "test-shop"}
    assert accounts["eu-shop"].environment == "production"
    assert accounts["eu-shop"].renew_before == 600
    assert accounts["test-shop"].renew_before == 300
    assert accounts["test-shop"].environment == "sandbox"
    assert {a.fleet.redis_url for a in accounts.values()} == {"redis://127.0.0.1:6390/3"}
    assert accounts["test-shop"].secret.reveal() == TEST_SECRET


def test_a_json_accounts_file_works_too(tmp_path: Path, merchant_secret_file: Path) -> None:
    document = {"accounts": {"one": {"api_key": "k", "api_secret_file": str(merchant_secret_file)}}}
    path = write_file(tmp_path / "accounts.json", json.dumps(document))
    assert list(load_accounts({"MERCHANT_ACCOUNTS_FILE": str(path)})) == ["one"]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('api_key = "k"\napi_secret = "inline"', "unknown keys \\['api_secret'\\]"),
        ('api_key = "k"', "MERCHANT_API_SECRET or MERCHANT_API_SECRET_FILE is required"),
        (
            'api_key = "k"\napi_secret_file = "SECRET"\nenvironment = "production"\n'
            'base_url = "http://api.example.test"',
            "must be https://",
        ),
    ],
)
def test_a_bad_account_is_an_error_naming_the_file_and_the_account(
    tmp_path: Path, merchant_secret_file: Path, entry: str, message: str
) -> None:
    path = write_file(
        tmp_path / "accounts.toml",
        "[accounts.shop]\n" + entry.replace("SECRET", str(merchant_secret_file)),
    )
    with pytest.raises(ConfigurationError, match=message) as caught:
        load_accounts({"MERCHANT_ACCOUNTS_FILE": str(path)})
    assert "account 'shop'" in str(caught.value)
    assert "inline" not in str(caught.value)


def test_an_accounts_file_entry_takes_every_per_account_key_of_the_table(
    tmp_path: Path, merchant_secret_file: Path
) -> None:
    values = {
        "environment": '"production"',
        "base_url": '"http://api.example.test:8080"',
        "api_key": '"k"',
        "api_secret_file": f'"{merchant_secret_file}"',
        "allow_insecure_http": "true",
        "token_lifetime": "3600",
        "renew_before": "400",
        "renew_mandatory": "60",
        "connect_timeout": "1.5",
        "read_timeout": "4",
    }
    assert set(values) == set(ACCOUNT_KEYS)
    entry = "\n".join(f"{key} = {value}" for key, value in values.items())
    path = write_file(tmp_path / "accounts.toml", "[accounts.shop]\n" + entry)
    shop = load_accounts({"MERCHANT_ACCOUNTS_FILE": str(path)})["shop"]
    assert (shop.connect_timeout, shop.read_timeout, shop.allow_insecure_http) == (1.5, 4.0, True)
    assert (shop.token_lifetime, shop.renew_before, shop.renew_mandatory) == (3600, 400, 60)


def test_an_empty_api_key_variable_defines_no_default_account(
    tmp_path: Path, merchant_secret_file: Path
) -> None:
    document = {"accounts": {"one": {"api_key": "k", "api_secret_file": str(merchant_secret_file)}}}
    path = write_file(tmp_path / "accounts.json", json.dumps(document))
    env = {"MERCHANT_API_KEY": "", "MERCHANT_ACCOUNTS_FILE": str(path)}
    assert list(load_accounts(env)) == ["one"]
    with pytest.raises(ConfigurationError, match="no account configured"):
        load_accounts({"MERCHANT_API_KEY": " ", "MERCHANT_API_SECRET": "s"})


def test_a_base_url_with_a_password_in_an_accounts_file_is_refused_without_echoing_it(
    tmp_path: Path, merchant_secret_file: Path
) -> None:
    document = {
        "accounts": {
            "gw": {
                "api_key": "k",
                "api_secret_file": str(merchant_secret_file),
                "base_url": "https://apiuser:BasicPw99@gateway.example.test",
            }
        }
    }
    path = write_file(tmp_path / "accounts.json", json.dumps(document))
    with pytest.raises(ConfigurationError, match="must not hold a user or password") as caught:
        load_accounts({"MERCHANT_ACCOUNTS_FILE": str(path)})
    assert "BasicPw99" not in str(caught.value)
    assert "account 'gw'" in str(caught.value)


@pytest.mark.parametrize(
    "production_url",
    [
        "https://API.example.test",
        "https://api.example.test:443",
        "https://api.example.test.",
        "https://api.example.test.:443/open-api/v1",
    ],
)
def test_the_environment_guard_compares_canonical_origins(
    tmp_path: Path, merchant_secret_file: Path, production_url: str
) -> None:
    document = {
        "accounts": {
            "test": {
                "api_key": "same",
                "api_secret_file": str(merchant_secret_file),
                "base_url": "https://api.example.test",
            },
            "live": {
                "api_key": "same",
                "api_secret_file": str(merchant_secret_file),
                "base_url": production_url,
                "environment": "production",
            },
        }
    }
    path = write_file(tmp_path / "accounts.json", json.dumps(document))
    with pytest.raises(
        ConfigurationError, match=re.escape("https://api.example.test:443: a key of one")
    ):
        load_accounts({"MERCHANT_ACCOUNTS_FILE": str(path)})


def test_servers_apart_by_port_or_scheme_may_serve_both_environments(
    tmp_path: Path, merchant_secret_file: Path
) -> None:
    document = {
        "accounts": {
            "test": {
                "api_key": "k",
                "api_secret_file": str(merchant_secret_file),
                "base_url": "https://api.example.test:8443",
            },
            "live": {
                "api_key": "k",
                "api_secret_file": str(merchant_secret_file),
                "base_url": "https://api.example.test",
                "environment": "production",
            },
        }
    }
    path = write_file(tmp_path / "accounts.json", json.dumps(document))
    assert set(load_accounts({"MERCHANT_ACCOUNTS_FILE": str(path)})) == {"test", "live"}


def test_one_account_under_two_names_is_accepted(
    tmp_path: Path, merchant_secret_file: Path
) -> None:
    path = two_accounts_of_one_key(tmp_path, merchant_secret_file, "http://127.0.0.1:8480/")
    assert sorted(load_accounts({"MERCHANT_ACCOUNTS_FILE": str(path)})) == ["shop-a", "shop-b"]


def test_no_account_at_all_is_an_error() -> None:
    with pytest.raises(ConfigurationError, match="no account configured"):
        load_accounts({})


def test_a_sandbox_and_a_production_account_may_not_share_a_server(
    accounts_toml: Callable[[str], dict[str, str]], merchant_secret_file: Path
) -> None:
    env = accounts_toml(
        entry(
            "live",
            merchant_secret_file,
            environment="production",
            base_url="https://api.example.test",
            api_key="live",
        )
        + entry("test", merchant_secret_file, base_url="https://api.example.test/", api_key="test")
    )
    with pytest.raises(ConfigurationError, match="must never reach the other"):
        load_accounts(env)


def test_an_unknown_account_is_an_error_listing_the_configured_ones(
    merchant_secret_file: Path,
) -> None:
    clients = AccountClients.from_env(
        {"MERCHANT_API_KEY": "k1", "MERCHANT_API_SECRET_FILE": str(merchant_secret_file)}
    )
    with pytest.raises(ConfigurationError, match=r"unknown account 'eu'.*default"):
        clients.get("eu")


def test_client_from_env_wires_the_only_account_to_its_store_and_server(
    merchant_secret_file: Path,
) -> None:
    client = client_from_env(
        {
            "MERCHANT_API_KEY": "k1",
            "MERCHANT_API_SECRET_FILE": str(merchant_secret_file),
            "MERCHANT_BASE_URL": "http://127.0.0.1:9",
            "MERCHANT_KEY_PREFIX": "wiring-test",
        }
    )
    assert client.base_url == "http://127.0.0.1:9"
    assert client.manager.store.namespace.startswith("wiring-test:")
    assert "k1" in client.manager.store.namespace
    client.session.close()


def test_client_from_env_with_several_accounts_and_no_default_asks_to_name_one(
    accounts_toml: Callable[[str], dict[str, str]], merchant_secret_file: Path
) -> None:
    env = accounts_toml(
        entry("eu", merchant_secret_file, api_key="eu")
        + entry("us", merchant_secret_file, api_key="us", base_url="http://127.0.0.1:10")
    )
    with pytest.raises(ConfigurationError, match=r"several accounts .*eu, us.*name one"):
        client_from_env(env)


def test_clients_of_one_account_share_what_they_are_given(merchant_secret_file: Path) -> None:
    settings = load_accounts(
        {"MERCHANT_API_KEY": "k1", "MERCHANT_API_SECRET_FILE": str(merchant_secret_file)}
    )[DEFAULT_ACCOUNT]
    pool = redis.Redis()
    first, second = (client_for(settings, redis_client=pool) for _ in range(2))
    assert first.manager.store.redis is second.manager.store.redis is pool
    assert first.session is not second.session  # cookies never cross clients
    assert first.manager.store.namespace == second.manager.store.namespace
    pool.close()


# -- accounts from the platform's own source ---------------------------------------------

_SOURCE = """
from merchant_tasks.settings import Secret, Settings

def accounts():
    return {
        "db-shop": {"api_key": "db-key", "api_secret_file": SECRET_FILE, "renew_before": 600},
        "built": Settings(api_key="built-key", secret=Secret("from-the-database")),
    }

def failing():
    raise RuntimeError("could not connect to postgresql://admin:hunter2@db/accounts")

def nothing():
    return {}

not_callable = 3
"""


@pytest.fixture
def source_module(
    tmp_path: Path, merchant_secret_file: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """An importable module of account sources, named uniquely for this test."""
    name = f"platform_accounts_{uuid.uuid4().hex[:8]}"
    write_file(
        tmp_path / f"{name}.py", _SOURCE.replace("SECRET_FILE", repr(str(merchant_secret_file)))
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_source_function_adds_accounts_checked_like_the_file_and_the_variables(
    source_module: str,
    merchant_secret_file: Path,
    accounts_toml: Callable[[str], dict[str, str]],
) -> None:
    accounts = load_accounts(
        {
            "MERCHANT_API_KEY": "k1",
            "MERCHANT_API_SECRET_FILE": str(merchant_secret_file),
            **accounts_toml(entry("file-shop", merchant_secret_file, api_key="file-key")),
            "MERCHANT_ACCOUNTS_SOURCE": f"{source_module}:accounts",
            "MERCHANT_RENEW_BEFORE": "300",
        }
    )
    assert set(accounts) == {DEFAULT_ACCOUNT, "file-shop", "db-shop", "built"}
    assert accounts["db-shop"].api_key == "db-key"
    assert accounts["db-shop"].renew_before == 600
    assert accounts["db-shop"].secret.reveal() == TEST_SECRET
    assert accounts["built"].secret.reveal() == "from-the-database"


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("", "must be 'package.module:function'"),
        (":accounts", "must be 'package.module:function'"),
        ("no_such_module_here:accounts", "cannot import 'no_such_module_here'"),
        ("MODULE:missing", "has no function 'missing'"),
        ("MODULE:not_callable", "has no function 'not_callable'"),
        ("MODULE:failing", "the function raised RuntimeError"),
        ("MODULE:nothing", "must return a mapping with at least one account"),
    ],
)
def test_a_bad_source_is_an_error_naming_the_variable_and_never_the_platforms_message(
    source_module: str, function: str, message: str
) -> None:
    value = function.replace("MODULE", source_module) or source_module
    with pytest.raises(ConfigurationError, match=message) as caught:
        load_accounts({"MERCHANT_ACCOUNTS_SOURCE": value})
    assert str(caught.value).startswith("MERCHANT_ACCOUNTS_SOURCE")
    assert "hunter2" not in str(caught.value)


def test_an_account_defined_by_two_sources_is_an_error(
    source_module: str, merchant_secret_file: Path, accounts_toml: Callable[[str], dict[str, str]]
) -> None:
    env = accounts_toml(entry("db-shop", merchant_secret_file, api_key="other"))
    env["MERCHANT_ACCOUNTS_SOURCE"] = f"{source_module}:accounts"
    with pytest.raises(ConfigurationError, match="account 'db-shop' is also defined"):
        load_accounts(env)


def test_loading_a_thousand_accounts_builds_no_client(
    accounts_toml: Callable[[str], dict[str, str]], merchant_secret_file: Path
) -> None:
    entries = "".join(
        entry(f"shop-{n}", merchant_secret_file, api_key=f"key-{n}") for n in range(1000)
    )
    fleet = AccountClients.from_env(accounts_toml(entries))
    assert len(fleet.accounts) == 1000
    assert fleet._clients == {}
    assert fleet._redis_by_url == {}
