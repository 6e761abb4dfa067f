"""Configuration from the environment: defaults, *_FILE variants, validation, the Secret."""

from __future__ import annotations

import base64
import copy
import dataclasses
import logging
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from merchant_tasks import settings as settings_module
from merchant_tasks.exceptions import ConfigurationError
from merchant_tasks.renewal.due import namespace_of
from merchant_tasks.settings import (
    ACCOUNT_KEYS,
    CONNECT_TIMEOUT,
    DEFAULT_KEY_PREFIX,
    DEFAULT_REDIS_URL,
    DOCS_PAGE,
    READ_TIMEOUT,
    RENEW_BEFORE,
    RENEW_INTERVAL,
    RENEW_MANDATORY,
    SANDBOX_DEFAULT_BASE_URL,
    TOKEN_LIFETIME,
    FleetSettings,
    Scope,
    Secret,
    Settings,
    child_env,
    configuration_page,
    origin,
    refuse_unknown_names,
)
from merchant_tasks.settings import VARIABLES as TABLE
from merchant_tasks.store.topology import parse_sentinel_url

SECRET = "s3cr3t-7c2e9d41b0a6f5e8"
API_KEY = "app-id-1234"
URLS_WITH_PASSWORDS = (  # base URLs holding a user or password: refused, never echoed
    "http://apiuser:BasicPw99@api.example.test",
    "https://apiuser:BasicPw99@api.example.test:8443/",
    "https://BasicPw99@api.example.test",
)


@pytest.fixture
def env() -> dict[str, str]:
    """The least a valid configuration needs: the API key and the secret."""
    return {"MERCHANT_API_KEY": API_KEY, "MERCHANT_API_SECRET": SECRET}


@pytest.fixture
def secret_path(tmp_path: Path) -> Path:
    path = tmp_path / "api-secret"
    path.write_text(SECRET + "\n", encoding="utf-8")
    return path


def test_defaults_apply_when_only_key_and_secret_are_given(env: dict[str, str]) -> None:
    settings = Settings.from_env(env)
    assert settings.api_key == API_KEY
    assert settings.secret.reveal() == SECRET
    assert settings.environment == "sandbox"
    assert settings.base_url == SANDBOX_DEFAULT_BASE_URL
    assert settings.fleet.redis_url == DEFAULT_REDIS_URL
    assert settings.fleet.key_prefix == DEFAULT_KEY_PREFIX
    assert settings.token_lifetime == TOKEN_LIFETIME == 7200
    assert settings.renew_before == RENEW_BEFORE == 480
    assert settings.renew_mandatory == RENEW_MANDATORY == 120
    assert settings.fleet.renew_interval == RENEW_INTERVAL == 60
    assert settings.connect_timeout == CONNECT_TIMEOUT
    assert settings.read_timeout == READ_TIMEOUT
    assert settings.allow_insecure_http is False
    assert namespace_of(settings) == f"{DEFAULT_KEY_PREFIX}:sandbox:{API_KEY}"


def _field(settings: Settings, attribute: str) -> object:
    """An account's field, or its fleet's."""
    return getattr(settings if hasattr(settings, attribute) else settings.fleet, attribute)


VARIABLES = [
    ("MERCHANT_ENVIRONMENT", "sandbox", "environment", "sandbox"),
    ("MERCHANT_BASE_URL", "https://api.example.test/", "base_url", "https://api.example.test"),
    ("MERCHANT_API_KEY", "other-key", "api_key", "other-key"),
    ("MERCHANT_REDIS_URL", "rediss://cache.example.test:6380/2", "redis_url", None),
    ("MERCHANT_KEY_PREFIX", "acme", "key_prefix", "acme"),
    ("MERCHANT_TOKEN_LIFETIME", "3600", "token_lifetime", 3600.0),
    ("MERCHANT_RENEW_BEFORE", "300.5", "renew_before", 300.5),
    ("MERCHANT_RENEW_MANDATORY", "30", "renew_mandatory", 30.0),
    ("MERCHANT_RENEW_INTERVAL", "15", "renew_interval", 15.0),
    ("MERCHANT_ENQUEUE_TIMEOUT", "0.5", "enqueue_timeout", 0.5),
    ("MERCHANT_CONNECT_TIMEOUT", "1.5", "connect_timeout", 1.5),
    ("MERCHANT_READ_TIMEOUT", "20", "read_timeout", 20.0),
    ("MERCHANT_ALLOW_INSECURE_HTTP", "yes", "allow_insecure_http", True),
]


@pytest.mark.parametrize(("name", "raw", "attribute", "expected"), VARIABLES)
def test_every_variable_is_read(
    env: dict[str, str], name: str, raw: str, attribute: str, expected: object
) -> None:
    env[name] = raw
    settings = Settings.from_env(env)
    assert _field(settings, attribute) == (raw if expected is None else expected)


@pytest.mark.parametrize(("name", "raw", "attribute", "expected"), VARIABLES)
def test_every_variable_may_come_from_its_file_variant(
    env: dict[str, str], tmp_path: Path, name: str, raw: str, attribute: str, expected: object
) -> None:
    path = tmp_path / name.lower()
    path.write_text(f"  {raw}\n", encoding="utf-8")  # as a secret mount may deliver it
    env.pop(name, None)
    env[f"{name}_FILE"] = str(path)
    settings = Settings.from_env(env)
    assert _field(settings, attribute) == (raw if expected is None else expected)


def test_the_secret_may_come_from_a_file(env: dict[str, str], secret_path: Path) -> None:
    del env["MERCHANT_API_SECRET"]
    env["MERCHANT_API_SECRET_FILE"] = str(secret_path)
    assert Settings.from_env(env).secret.reveal() == SECRET


def test_the_secret_value_is_stripped(env: dict[str, str]) -> None:
    env["MERCHANT_API_SECRET"] = f"  {SECRET}\n"
    assert Settings.from_env(env).secret.reveal() == SECRET


@pytest.mark.parametrize("name", [name for name, *_ in VARIABLES] + ["MERCHANT_API_SECRET"])
def test_a_variable_and_its_file_variant_together_are_an_error_naming_it(
    env: dict[str, str], secret_path: Path, name: str
) -> None:
    env[name] = env.get(name, "1")
    env[f"{name}_FILE"] = str(secret_path)
    with pytest.raises(ConfigurationError, match=f"{name} or {name}_FILE"):
        Settings.from_env(env)


@pytest.mark.parametrize("name", ["MERCHANT_API_KEY", "MERCHANT_API_SECRET"])
@pytest.mark.parametrize("value", [None, ""])
def test_key_and_secret_are_required(env: dict[str, str], name: str, value: str | None) -> None:
    if value is None:
        del env[name]
    else:
        env[name] = value
    with pytest.raises(ConfigurationError, match=name):
        Settings.from_env(env)


def test_a_blank_secret_is_an_error_naming_the_variable(env: dict[str, str]) -> None:
    env["MERCHANT_API_SECRET"] = "   "
    with pytest.raises(ConfigurationError, match="MERCHANT_API_SECRET"):
        Settings.from_env(env)


NUMBERS = [
    "MERCHANT_TOKEN_LIFETIME",
    "MERCHANT_RENEW_BEFORE",
    "MERCHANT_RENEW_MANDATORY",
    "MERCHANT_RENEW_INTERVAL",
    "MERCHANT_ENQUEUE_TIMEOUT",
    "MERCHANT_CONNECT_TIMEOUT",
    "MERCHANT_READ_TIMEOUT",
]


@pytest.mark.parametrize("name", NUMBERS)
@pytest.mark.parametrize("raw", ["abc", "10s", "0", "-5", "nan"])
def test_an_invalid_number_of_seconds_is_an_error_naming_the_variable(
    env: dict[str, str], name: str, raw: str
) -> None:
    env[name] = raw
    with pytest.raises(ConfigurationError, match=name):
        Settings.from_env(env)


@pytest.mark.parametrize(
    ("name", "attribute", "default"),
    [
        ("MERCHANT_TOKEN_LIFETIME", "token_lifetime", TOKEN_LIFETIME),
        ("MERCHANT_RENEW_BEFORE", "renew_before", RENEW_BEFORE),
        ("MERCHANT_RENEW_MANDATORY", "renew_mandatory", RENEW_MANDATORY),
        ("MERCHANT_RENEW_INTERVAL", "renew_interval", RENEW_INTERVAL),
        ("MERCHANT_CONNECT_TIMEOUT", "connect_timeout", CONNECT_TIMEOUT),
        ("MERCHANT_READ_TIMEOUT", "read_timeout", READ_TIMEOUT),
    ],
)
def test_an_empty_number_means_the_default(
    env: dict[str, str], name: str, attribute: str, default: float
) -> None:
    env[name] = ""
    assert _field(Settings.from_env(env), attribute) == default


@pytest.mark.parametrize("name", ["MERCHANT_TOKEN_LIFETIME", "MERCHANT_READ_TIMEOUT"])
def test_an_infinite_number_of_seconds_is_an_error_naming_the_variable(
    env: dict[str, str], name: str
) -> None:
    env[name] = "inf"
    with pytest.raises(ConfigurationError, match=name):
        Settings.from_env(env)


@pytest.mark.parametrize(
    ("mandatory", "before", "lifetime"),
    [("480", "480", "7200"), ("500", "480", "7200"), ("120", "7200", "7200"), ("60", "90", "80")],
)
def test_windows_must_be_ordered_mandatory_before_lifetime(
    env: dict[str, str], mandatory: str, before: str, lifetime: str
) -> None:
    env |= {
        "MERCHANT_RENEW_MANDATORY": mandatory,
        "MERCHANT_RENEW_BEFORE": before,
        "MERCHANT_TOKEN_LIFETIME": lifetime,
    }
    with pytest.raises(
        ConfigurationError, match="MERCHANT_RENEW_MANDATORY < MERCHANT_RENEW_BEFORE"
    ):
        Settings.from_env(env)


def test_small_lifetimes_are_allowed_when_the_windows_fit(env: dict[str, str]) -> None:
    env |= {
        "MERCHANT_TOKEN_LIFETIME": "6",
        "MERCHANT_RENEW_BEFORE": "3",
        "MERCHANT_RENEW_MANDATORY": "1",
    }
    settings = Settings.from_env(env)
    assert (settings.renew_mandatory, settings.renew_before, settings.token_lifetime) == (1, 3, 6)


def _refused(says: str, **given: str) -> Any:
    """A row of ``REFUSED``: the variables ``given``, and how their error begins."""
    return pytest.param(
        given, says, id=" ".join(f"{name}={value}" for name, value in given.items())
    )


REFUSED = [  # values the settings refuse, and how the error begins: with the variable's name
    *(
        _refused(
            "MERCHANT_ENVIRONMENT must be one of",
            MERCHANT_ENVIRONMENT=environment,
            MERCHANT_BASE_URL="https://api.example.test",
        )
        for environment in ("staging", "Production", "prod")
    ),
    _refused("MERCHANT_BASE_URL is required in production", MERCHANT_ENVIRONMENT="production"),
    _refused(
        "MERCHANT_BASE_URL must be https://",
        MERCHANT_ENVIRONMENT="production",
        MERCHANT_BASE_URL="http://api.example.test",
    ),
    *(
        _refused("MERCHANT_BASE_URL", MERCHANT_BASE_URL=url)
        for url in ("ftp://api.example.test", "api.example.test", "https://", "https://api:x8/")
    ),
    *(
        _refused("MERCHANT_BASE_URL must be the API", MERCHANT_BASE_URL=url)
        for url in (
            "http://127.0.0.1:8480/v2",
            "http://127.0.0.1:8480/open-api",
            "http://127.0.0.1:8480/api/open-api/v1",
            "http://127.0.0.1:8480/open-api/v1/auth/access_token",
            "http://127.0.0.1:8480/?tenant=1",
            "http://127.0.0.1:8480/open-api/v1#top",
        )
    ),
    *(
        _refused("MERCHANT_BASE_URL must not hold a user or password", MERCHANT_BASE_URL=url)
        for url in URLS_WITH_PASSWORDS
    ),
    *(
        _refused("MERCHANT_ALLOW_INSECURE_HTTP", MERCHANT_ALLOW_INSECURE_HTTP=flag)
        for flag in ("maybe", "2", "enabled")
    ),
    *(
        _refused("MERCHANT_REDIS_URL", MERCHANT_REDIS_URL=url)
        for url in (
            "http://:hunter2-redis-pw@cache.example.test:6379/0",
            "localhost:6379",
            "redis:///0",
            "memcached://user:hunter2-redis-pw@cache.example.test",
        )
    ),
]


@pytest.mark.parametrize(("given", "says"), REFUSED)
def test_a_refused_value_is_one_line_naming_its_variable_that_never_echoes_a_url(
    env: dict[str, str], given: dict[str, str], says: str
) -> None:
    """A URL may hold a password (a Redis URL's, a base URL's user:password@)."""
    with pytest.raises(ConfigurationError, match=f"^{re.escape(says)}") as caught:
        Settings.from_env(env | given)
    message = str(caught.value)
    assert "\n" not in message
    urls = [value for value in given.values() if value.partition("://")[2]]  # past a scheme
    assert not [url for url in urls if url in message]
    assert "hunter2" not in message
    assert "BasicPw99" not in message


def test_settings_made_directly_refuse_a_base_url_holding_a_password_without_echoing_it() -> None:
    for url in URLS_WITH_PASSWORDS:
        with pytest.raises(ConfigurationError, match="must not hold a user or password") as caught:
            Settings(api_key=API_KEY, secret=Secret(SECRET), base_url=url)
        assert "BasicPw99" not in str(caught.value)


def test_production_accepts_plain_http_when_insecure_http_is_allowed(env: dict[str, str]) -> None:
    env |= {
        "MERCHANT_ENVIRONMENT": "production",
        "MERCHANT_BASE_URL": "http://127.0.0.1:9000",
        "MERCHANT_ALLOW_INSECURE_HTTP": "1",
    }
    settings = Settings.from_env(env)
    assert (settings.environment, settings.base_url) == ("production", "http://127.0.0.1:9000")
    assert namespace_of(settings) == f"{DEFAULT_KEY_PREFIX}:production:{API_KEY}"


def test_production_accepts_an_https_base_url(env: dict[str, str]) -> None:
    env |= {"MERCHANT_ENVIRONMENT": "production", "MERCHANT_BASE_URL": "https://api.example.test"}
    assert Settings.from_env(env).base_url == "https://api.example.test"


def test_sandbox_accepts_a_plain_http_base_url(env: dict[str, str]) -> None:
    env["MERCHANT_BASE_URL"] = "http://localhost:8480"
    assert Settings.from_env(env).base_url == "http://localhost:8480"


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8480/open-api/v1",
        "http://127.0.0.1:8480/open-api/v1/",
        "http://127.0.0.1:8480/",
        "http://127.0.0.1:8480",
    ],
)
def test_a_base_url_ending_in_the_apis_path_is_understood_as_its_host(
    env: dict[str, str], url: str
) -> None:
    env["MERCHANT_BASE_URL"] = url
    assert Settings.from_env(env).base_url == "http://127.0.0.1:8480"
    assert Settings(api_key=API_KEY, secret=Secret(SECRET), base_url=url).base_url == (
        "http://127.0.0.1:8480"
    )


@pytest.mark.parametrize(
    "url",
    [
        "redis://localhost:6379/0",
        "redis://:pw@cache.example.test:6379/1",
        "rediss://cache.example.test:6380/0",
        "unix:///var/run/redis/redis.sock",
    ],
)
def test_redis_urls_with_redis_rediss_or_unix_scheme_are_accepted(
    env: dict[str, str], url: str
) -> None:
    env["MERCHANT_REDIS_URL"] = url
    assert Settings.from_env(env).fleet.redis_url == url


def test_secret_repr_and_str_never_show_the_value(secret_path: Path) -> None:
    for secret in (Secret(SECRET), Secret(path=secret_path)):
        shown = f"{secret!r} {secret} {secret!s} {[secret]}"
        assert SECRET not in shown
        assert "hidden" in shown


def test_settings_repr_never_shows_the_secret(env: dict[str, str]) -> None:
    settings = Settings.from_env(env)
    assert SECRET not in repr(settings)
    assert SECRET not in str(settings)
    assert API_KEY in repr(settings)  # the key is an identifier, not a credential


def test_a_secret_cannot_be_pickled_or_copied(env: dict[str, str]) -> None:
    settings = Settings.from_env(env)
    with pytest.raises(TypeError, match="not serialisable"):
        pickle.dumps(settings.secret)
    with pytest.raises(TypeError, match="not serialisable"):
        pickle.dumps(settings)
    with pytest.raises(TypeError, match="not serialisable"):
        copy.deepcopy(settings.secret)


def test_a_secret_from_a_file_is_re_read_after_the_file_changes(secret_path: Path) -> None:
    secret = Secret(path=secret_path)
    assert secret.reveal() == SECRET
    secret_path.write_text("rotated-secret-9f8e7d\n", encoding="utf-8")
    assert secret.reveal() == "rotated-secret-9f8e7d"


def test_settings_built_from_a_secret_file_follow_its_rotation(
    env: dict[str, str], secret_path: Path
) -> None:
    del env["MERCHANT_API_SECRET"]
    env["MERCHANT_API_SECRET_FILE"] = str(secret_path)
    settings = Settings.from_env(env)
    secret_path.write_text("rotated-secret-9f8e7d", encoding="utf-8")
    assert settings.secret.reveal() == "rotated-secret-9f8e7d"


def test_an_unreadable_secret_file_is_an_error_at_start_up(
    env: dict[str, str], tmp_path: Path
) -> None:
    del env["MERCHANT_API_SECRET"]
    env["MERCHANT_API_SECRET_FILE"] = str(tmp_path / "missing")
    with pytest.raises(ConfigurationError, match="MERCHANT_API_SECRET_FILE: cannot read"):
        Settings.from_env(env)


def test_an_empty_secret_file_is_an_error_at_start_up(env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.write_text(" \n", encoding="utf-8")
    del env["MERCHANT_API_SECRET"]
    env["MERCHANT_API_SECRET_FILE"] = str(path)
    with pytest.raises(ConfigurationError, match=r"MERCHANT_API_SECRET_FILE: .* is empty"):
        Settings.from_env(env)


def test_a_secret_file_that_disappears_later_is_an_error_when_revealed(secret_path: Path) -> None:
    secret = Secret(path=secret_path)
    secret_path.unlink()
    with pytest.raises(ConfigurationError, match="MERCHANT_API_SECRET_FILE: cannot read") as caught:
        secret.reveal()
    assert SECRET not in str(caught.value)


def test_an_unreadable_file_variant_is_an_error_naming_it(
    env: dict[str, str], tmp_path: Path
) -> None:
    env["MERCHANT_REDIS_URL_FILE"] = str(tmp_path / "missing")
    with pytest.raises(ConfigurationError, match="MERCHANT_REDIS_URL_FILE: cannot read"):
        Settings.from_env(env)


@pytest.mark.parametrize("kwargs", [{}, {"value": "v", "path": Path("p")}])
def test_a_secret_needs_exactly_one_source(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Secret(**kwargs)  # type: ignore[arg-type]


def test_settings_built_directly_are_validated_too() -> None:
    with pytest.raises(ConfigurationError, match="MERCHANT_API_KEY"):
        Settings(api_key="", secret=Secret(SECRET))
    with pytest.raises(ConfigurationError, match="MERCHANT_ENVIRONMENT"):
        Settings(api_key=API_KEY, secret=Secret(SECRET), environment="staging")


# -- Redis topologies: Sentinel, Cluster ----------------------------------------------------


def test_a_sentinel_url_in_celerys_form_is_accepted_with_master_and_sentinel_password(
    env: dict[str, str],
) -> None:
    url = "sentinel://:master-pw@s1.example.test:26379/2;sentinel://:master-pw@s2.example.test/2"
    env.update(
        {
            "MERCHANT_REDIS_URL": url,
            "MERCHANT_REDIS_SENTINEL_MASTER": "payments",
            "MERCHANT_REDIS_SENTINEL_PASSWORD": "hunter2-sentinel-pw",
        }
    )
    settings = Settings.from_env(env)
    assert settings.fleet.redis_url == url
    assert settings.fleet.redis_sentinel_master == "payments"
    assert settings.fleet.redis_sentinel_password == "hunter2-sentinel-pw"
    assert "hunter2" not in repr(settings)
    assert "master-pw" not in repr(settings)
    parsed = parse_sentinel_url(url)
    assert parsed.sentinels == (("s1.example.test", 26379), ("s2.example.test", 26379))
    assert (parsed.db, parsed.password) == (2, "master-pw")
    assert "master-pw" not in repr(parsed)


def test_the_sentinel_master_defaults_to_mymaster(env: dict[str, str]) -> None:
    env["MERCHANT_REDIS_URL"] = "sentinel://s1.example.test:26379"
    assert Settings.from_env(env).fleet.redis_sentinel_master == "mymaster"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("sentinel://:hunter2-pw@s1:26379;redis://:hunter2-pw@s2:26379", "must start with"),
        ("sentinel://:hunter2-pw@:26379", "no host"),
        ("sentinel://:hunter2-pw@s1:port", "not a number"),
        ("sentinel://:hunter2-pw@s1:26379/zero", "database number"),
        ("sentinel://:hunter2-pw@s1:26379/0;sentinel://:hunter2-pw@s2:26379/1", "same database"),
        ("sentinel://:hunter2-pw@s1:26379/0?ssl=true", "not supported"),
        ("sentinel://;", "no host"),
    ],
)
def test_an_invalid_sentinel_url_names_the_variable_and_never_echoes_the_password(
    env: dict[str, str], url: str, says: str
) -> None:
    env["MERCHANT_REDIS_URL"] = url
    with pytest.raises(ConfigurationError, match="MERCHANT_REDIS_URL") as caught:
        Settings.from_env(env)
    assert says in str(caught.value)
    assert "hunter2" not in str(caught.value)


def test_cluster_mode_needs_a_redis_url_of_a_node(env: dict[str, str]) -> None:
    env.update({"MERCHANT_REDIS_CLUSTER": "1", "MERCHANT_REDIS_URL": "redis://node-1:7000/0"})
    assert Settings.from_env(env).fleet.redis_cluster is True
    for url in ("sentinel://:hunter2-pw@s1:26379", "unix:///run/redis.sock"):
        env["MERCHANT_REDIS_URL"] = url
        with pytest.raises(ConfigurationError, match="MERCHANT_REDIS_URL") as caught:
            Settings.from_env(env)
        assert "hunter2" not in str(caught.value)


# -- to_env: the one way child processes are configured ------------------------------------


def _fields_except_secret(settings: Settings | FleetSettings) -> dict[str, object]:
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)} | {
        "secret": None
    }


def test_to_env_gives_back_every_field_when_read_again(secret_path: Path) -> None:
    # every field away from its default, so a field to_env forgets shows as a difference
    keys = []
    for name in ("token-key", "previous-token-key"):
        keys.append(secret_path.with_name(name))
        keys[-1].write_text(base64.urlsafe_b64encode(os.urandom(32)).decode())
        keys[-1].chmod(0o600)
    settings = Settings(
        api_key="other-key",
        secret=Secret(path=secret_path),
        environment="production",
        base_url="http://api.example.test:8080",
        token_lifetime=3600.25,
        renew_before=300.5,
        renew_mandatory=30.125,
        connect_timeout=1.5,
        read_timeout=20.0,
        allow_insecure_http=True,
        fleet=FleetSettings(
            redis_url="rediss://user:pw@cache.example.test:6380/2",
            key_prefix="acme",
            renew_interval=15.0,
            rejected_retry_window=0.5,
            enqueue_timeout=1.25,
            max_exchanges_per_second=2.5,
            token_key_file=str(keys[0]),
            token_key_previous_file=str(keys[1]),
            redis_sentinel_master="payments",
            redis_sentinel_password="sentinel-pw",
            redis_cluster=True,
            accounts_file="/etc/merchant/accounts.toml",
            accounts_source="platform.merchants:accounts",
        ),
    )
    for part in (settings, settings.fleet):
        defaults = {f.name: f.default for f in dataclasses.fields(part)}
        values = {f: getattr(part, f) for f in defaults if f != "secret"}
        assert {f for f, v in values.items() if v != defaults[f]} == set(values)
    again = Settings.from_env(settings.to_env())
    assert _fields_except_secret(again) == _fields_except_secret(settings)
    assert again.secret.path == secret_path


def test_to_env_passes_a_secret_from_a_file_as_its_path_only(secret_path: Path) -> None:
    env = Settings(api_key=API_KEY, secret=Secret(path=secret_path)).to_env()
    assert env["MERCHANT_API_SECRET_FILE"] == str(secret_path)
    assert "MERCHANT_API_SECRET" not in env
    assert not any(SECRET in value for value in env.values())


def test_to_env_passes_a_secret_given_as_a_value_as_the_value() -> None:
    settings = Settings(api_key=API_KEY, secret=Secret(SECRET))
    again = Settings.from_env(settings.to_env())
    assert again.secret.reveal() == SECRET


def test_a_child_environment_keeps_nothing_of_the_parents_merchant_or_celery_variables(
    secret_path: Path,
) -> None:
    parent = {
        "PATH": "/usr/bin",
        "MERCHANT_ACCOUNTS_FILE": "/etc/accounts.toml",
        "MERCHANT_API_SECRET": "parent-secret",
        "CELERY_BROKER_URL": "redis://elsewhere:6379/0",
    }
    settings = Settings(api_key=API_KEY, secret=Secret(path=secret_path))
    env = child_env(settings, parent)
    assert env == {"PATH": "/usr/bin", **settings.to_env()}


# -- FleetSettings: what Celery reads, without any account ---------------------------------


def test_fleet_settings_need_no_account() -> None:
    fleet = FleetSettings.from_env({})
    assert fleet.redis_url == DEFAULT_REDIS_URL
    assert fleet.key_prefix == DEFAULT_KEY_PREFIX
    assert fleet.renew_interval == RENEW_INTERVAL


def test_fleet_settings_read_the_redis_url_from_its_file_variant(tmp_path: Path) -> None:
    path = tmp_path / "redis-url"
    path.write_text("redis://:pw@cache.example.test:6380/3\n", encoding="utf-8")
    fleet = FleetSettings.from_env({"MERCHANT_REDIS_URL_FILE": str(path)})
    assert fleet.redis_url == "redis://:pw@cache.example.test:6380/3"


@pytest.mark.parametrize("raw", ["abc", "-5", "0", "inf"])
def test_an_invalid_renew_interval_is_refused_by_fleet_settings_naming_the_variable(
    raw: str,
) -> None:
    with pytest.raises(ConfigurationError, match="MERCHANT_RENEW_INTERVAL"):
        FleetSettings.from_env({"MERCHANT_RENEW_INTERVAL": raw})


@pytest.mark.parametrize("raw", ["abc", "-1", "inf"])
def test_an_invalid_rejected_retry_window_is_refused_naming_the_variable(raw: str) -> None:
    with pytest.raises(ConfigurationError, match="MERCHANT_REJECTED_RETRY_WINDOW"):
        FleetSettings.from_env({"MERCHANT_REJECTED_RETRY_WINDOW": raw})


@pytest.mark.parametrize("raw", ["ten", "0", "-3", "nan", "inf"])
def test_an_invalid_exchange_rate_is_refused_naming_the_variable(raw: str) -> None:
    with pytest.raises(ConfigurationError, match="MERCHANT_MAX_EXCHANGES_PER_SECOND"):
        FleetSettings.from_env({"MERCHANT_MAX_EXCHANGES_PER_SECOND": raw})


def test_the_exchange_rate_is_ten_a_second_per_host_unless_set() -> None:
    assert FleetSettings.from_env({}).max_exchanges_per_second == 10
    rate = FleetSettings.from_env({"MERCHANT_MAX_EXCHANGES_PER_SECOND": "0.5"})
    assert rate.max_exchanges_per_second == 0.5


def test_a_rejected_retry_window_of_zero_means_fail_at_once() -> None:
    assert (
        FleetSettings.from_env({"MERCHANT_REJECTED_RETRY_WINDOW": "0"}).rejected_retry_window == 0
    )
    assert FleetSettings.from_env({}).rejected_retry_window == 900


def test_account_settings_take_their_fleet_part_from_fleet_settings(
    env: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "redis-url"
    path.write_text("redis://cache.example.test:6380/3", encoding="utf-8")
    env |= {"MERCHANT_REDIS_URL_FILE": str(path), "MERCHANT_RENEW_INTERVAL": "7"}
    settings, fleet = Settings.from_env(env), FleetSettings.from_env(env)
    assert (settings.fleet.redis_url, settings.fleet.key_prefix, settings.fleet.renew_interval) == (
        fleet.redis_url,
        fleet.key_prefix,
        fleet.renew_interval,
    )


# -- the table: reading, to_env, accounts-file keys and the docs page come from it ---------


def test_every_settings_field_has_one_row_of_the_table_and_every_row_a_field() -> None:
    def fields_of(*scopes: Scope) -> list[str]:
        return sorted(v.field for v in TABLE if v.scope in scopes)

    account = sorted(f.name for f in dataclasses.fields(Settings) if f.name != "fleet")
    fleet = sorted(f.name for f in dataclasses.fields(FleetSettings))
    assert fields_of(Scope.ACCOUNT, Scope.OVERRIDABLE) == account
    assert fields_of(Scope.FLEET) == fleet


def test_the_accounts_file_keys_are_the_per_account_rows_and_a_secret_only_as_a_file() -> None:
    assert sorted(ACCOUNT_KEYS) == [
        "allow_insecure_http",
        "api_key",
        "api_secret_file",
        "base_url",
        "connect_timeout",
        "environment",
        "read_timeout",
        "renew_before",
        "renew_mandatory",
        "token_lifetime",
    ]


def test_the_configuration_page_shows_the_table_as_generated_from_it() -> None:
    page = DOCS_PAGE.read_text(encoding="utf-8")
    assert configuration_page(page) == page, "run write_configuration_page() and commit"
    for variable in TABLE:
        assert f"| `{variable.name}`" in page


def test_no_module_but_settings_reads_a_merchant_variable() -> None:
    reads = re.compile(r"""(environ|getenv)\b[^\n]*["']MERCHANT_|envvar=""")
    package = Path(settings_module.__file__).parent
    modules = sorted(package.rglob("*.py"))
    assert len(modules) > 30  # every folder is searched
    for path in modules:
        if path.name != "settings.py":
            assert not reads.search(path.read_text(encoding="utf-8")), path.name


# -- what the door refuses -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "closest"),
    [
        ("MERCHANT_RENEW_INTERVALL", "MERCHANT_RENEW_INTERVAL"),
        ("MERCHANT_API_SECRET_FIEL", "MERCHANT_API_SECRET_FILE"),
        ("MERCHANT_REDIS_URI", "MERCHANT_REDIS_URL"),
    ],
)
def test_an_unknown_variable_is_an_error_naming_the_closest_known_one(
    env: dict[str, str], name: str, closest: str
) -> None:
    env[name] = "30"
    for read in (Settings.from_env, FleetSettings.from_env, refuse_unknown_names):
        with pytest.raises(ConfigurationError, match=f"{name} \\(did you mean {closest}\\?\\)"):
            read(env)


@pytest.mark.parametrize("name", ["MERCHANT_ID", "MERCHANT_DB_URL", "MERCHANT_WEBHOOK_SECRET"])
def test_an_applications_own_merchant_variable_is_logged_as_ignored_not_refused(
    env: dict[str, str], name: str, caplog: pytest.LogCaptureFixture
) -> None:
    env[name] = "shop-value"
    with caplog.at_level(logging.WARNING, logger="merchant_tasks.settings"):
        Settings.from_env(env)
        Settings.from_env(env)
    ignored = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert ignored == [
        f"{name} is not a merchant-tasks variable: ignored (see docs/configuration.md)"
    ]
    assert "shop-value" not in caplog.text


def test_a_file_variant_of_a_variable_that_has_none_is_unknown(env: dict[str, str]) -> None:
    env["MERCHANT_TOKEN_KEY_FILE_FILE"] = "/run/secrets/key"
    with pytest.raises(ConfigurationError, match="unknown variable MERCHANT_TOKEN_KEY_FILE_FILE"):
        Settings.from_env(env)


def test_an_empty_variable_is_unset_beside_its_file_variant(tmp_path: Path) -> None:
    path = tmp_path / "redis-url"
    path.write_text("redis://cache.example.test:6380/3", encoding="utf-8")
    fleet = FleetSettings.from_env({"MERCHANT_REDIS_URL": "", "MERCHANT_REDIS_URL_FILE": str(path)})
    assert fleet.redis_url == "redis://cache.example.test:6380/3"
    with pytest.raises(ConfigurationError, match="MERCHANT_REDIS_URL_FILE: cannot read /nope"):
        FleetSettings.from_env({"MERCHANT_REDIS_URL": "", "MERCHANT_REDIS_URL_FILE": "/nope"})
    assert FleetSettings.from_env({"MERCHANT_REDIS_URL": " ", "MERCHANT_REDIS_URL_FILE": ""}) == (
        FleetSettings()
    )


def test_an_empty_secret_variable_beside_its_file_is_unset(
    env: dict[str, str], secret_path: Path
) -> None:
    env |= {"MERCHANT_API_SECRET": "", "MERCHANT_API_SECRET_FILE": str(secret_path)}
    assert Settings.from_env(env).secret.path == secret_path


@pytest.mark.parametrize(
    "url",
    [
        "https://api.example.com",
        "https://API.Example.com/",
        "https://api.example.com:443",
        "https://api.example.com.",
        "https://api.example.com:443/open-api",
    ],
)
def test_the_origin_is_scheme_lower_case_host_without_trailing_dot_and_effective_port(
    url: str,
) -> None:
    assert origin(url) == "https://api.example.com:443"


def test_origins_differ_by_scheme_and_port() -> None:
    assert origin("http://api.example.com") == "http://api.example.com:80"
    assert origin("https://api.example.com:8443") == "https://api.example.com:8443"


def test_a_file_that_is_not_utf8_is_an_error_naming_the_variable(
    env: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "binary"
    path.write_bytes(os.urandom(8) + b"\xff\xfe")
    for name in ("MERCHANT_API_SECRET", "MERCHANT_KEY_PREFIX", "MERCHANT_REDIS_URL"):
        variables = {k: v for k, v in env.items() if k != name} | {f"{name}_FILE": str(path)}
        with pytest.raises(ConfigurationError, match=rf"{name}_FILE: .* is not UTF-8 text"):
            Settings.from_env(variables)


def test_an_empty_file_is_an_error_naming_the_variable(env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.write_text(" \n", encoding="utf-8")
    env["MERCHANT_KEY_PREFIX_FILE"] = str(path)
    with pytest.raises(ConfigurationError, match=r"MERCHANT_KEY_PREFIX_FILE: .* is empty"):
        Settings.from_env(env)


@pytest.mark.parametrize(
    "damage",
    [
        lambda path: path.unlink(),
        lambda path: path.write_bytes(b"\xff\xfe\x00binary"),
        lambda path: path.write_text("", encoding="utf-8"),
    ],
    ids=["removed", "not-utf8", "empty"],
)
def test_a_secret_file_unreadable_at_a_rotation_keeps_the_last_good_secret_and_says_why(
    secret_path: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], object]
) -> None:
    secret = Secret(path=secret_path)
    assert secret.reveal() == SECRET
    damage(secret_path)
    with caplog.at_level(logging.WARNING, logger="merchant_tasks.settings"):
        assert secret.reveal() == SECRET
    [record] = caplog.records
    assert record.getMessage().startswith("MERCHANT_API_SECRET_FILE: ")
    assert str(secret_path) in record.getMessage()
    assert record.getMessage().endswith("; keeping the secret read before")
    secret_path.write_text("rotated-secret-1a2b", encoding="utf-8")
    assert secret.reveal() == "rotated-secret-1a2b"


def test_beat_checks_the_accounts_without_reading_the_secret(env: dict[str, str]) -> None:
    env = {k: v for k, v in env.items() if k != "MERCHANT_API_SECRET"}
    env["MERCHANT_API_SECRET_FILE"] = "/run/secrets/not-mounted-here"
    assert Settings.from_env(env, read_secret=False).api_key == API_KEY
    with pytest.raises(ConfigurationError, match="MERCHANT_API_SECRET_FILE: cannot read"):
        Settings.from_env(env)
