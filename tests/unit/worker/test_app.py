"""The Celery app's configuration (worker/app.py): built from the validated settings (one
door), per broker (Redis-only transport options, Sentinel's master name), the start-up
checks of worker and beat, and clear errors."""

from __future__ import annotations

import os
import re
import ssl
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery import Celery

from merchant_tasks import accounts
from merchant_tasks.worker import app as celery_app
from merchant_tasks.worker import install as hosting
from merchant_tasks.worker.app import (
    PUBLISH_RETRY_POLICY,
    REDIS_ONLY_TRANSPORT_OPTIONS,
    VISIBILITY_TIMEOUT,
    load_config,
    package_defaults,
    write_config_module,
)
from support.celery_config import write_celeryconfig
from support.paths import ROOT

pytestmark = pytest.mark.usefixtures("empty_celeryconfig")


AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
SENTINELS = "sentinel://:master-pw@127.0.0.1:26379/0;sentinel://:master-pw@127.0.0.1:26380/0"


def test_a_redis_broker_gets_the_visibility_timeout() -> None:
    config = load_config({"MERCHANT_REDIS_URL": "redis://127.0.0.1:6379/0"})
    assert config["broker_transport_options"] == {"visibility_timeout": VISIBILITY_TIMEOUT}
    assert config["result_backend_transport_options"] == {"visibility_timeout": VISIBILITY_TIMEOUT}


def test_an_amqp_broker_gets_no_redis_only_transport_option(tmp_path: Path) -> None:
    write_celeryconfig(
        tmp_path,
        "broker_transport_options = {'visibility_timeout': 60, 'unacked_restore_interval': 1,"
        " 'confirm_publish': True}\n",
    )
    config = load_config({"CELERY_BROKER_URL": AMQP_URL})
    assert config["broker_url"] == AMQP_URL
    assert config["broker_transport_options"] == {"confirm_publish": True}
    assert not REDIS_ONLY_TRANSPORT_OPTIONS & set(config["broker_transport_options"])
    # the result backend stays on the token store's Redis, with its options
    assert config["result_backend_transport_options"] == {"visibility_timeout": VISIBILITY_TIMEOUT}


def test_a_sentinel_url_gives_broker_and_backend_the_master_name_and_sentinel_password() -> None:
    config = load_config(
        {
            "MERCHANT_REDIS_URL": SENTINELS,
            "MERCHANT_REDIS_SENTINEL_MASTER": "payments",
            "MERCHANT_REDIS_SENTINEL_PASSWORD": "sentinel-pw",
        }
    )
    assert config["broker_url"] == config["result_backend"] == SENTINELS
    for name in ("broker_transport_options", "result_backend_transport_options"):
        assert config[name] == {
            "visibility_timeout": VISIBILITY_TIMEOUT,
            "master_name": "payments",
            "sentinel_kwargs": {"password": "sentinel-pw"},
        }


def test_the_sentinel_master_name_defaults_to_mymaster_and_celeryconfig_wins(
    tmp_path: Path,
) -> None:
    assert load_config({"MERCHANT_REDIS_URL": SENTINELS})["broker_transport_options"] == {
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "master_name": "mymaster",
    }
    write_celeryconfig(tmp_path, "broker_transport_options = {'master_name': 'other'}\n")
    options = load_config({"MERCHANT_REDIS_URL": SENTINELS})["broker_transport_options"]
    assert options["master_name"] == "other"


def test_publishing_waits_out_a_broker_away_for_about_a_minute() -> None:
    policy = load_config({})["task_publish_retry_policy"]
    assert policy == PUBLISH_RETRY_POLICY
    waits, wait = [], float(policy["interval_start"])
    for _ in range(policy["max_retries"]):
        waits.append(wait)
        wait = min(wait + policy["interval_step"], policy["interval_max"])
    assert 50 <= sum(waits) <= 70  # Celery's default gives up after 0.6 s


# -- built from the validated settings; configuration errors -------------------------------


def test_broker_and_backend_follow_the_redis_url_file(tmp_path: Path) -> None:
    path = tmp_path / "redis-url"
    path.write_text("redis://:pw@cache.example.test:6380/4\n", encoding="utf-8")
    config = package_defaults({"MERCHANT_REDIS_URL_FILE": str(path)})
    assert (
        config["broker_url"] == config["result_backend"] == "redis://:pw@cache.example.test:6380/4"
    )


def test_celery_urls_from_the_environment_override_the_defaults() -> None:
    config = load_config(
        {"CELERY_BROKER_URL": "amqp://rabbit//", "CELERY_RESULT_BACKEND": "redis://r/1"}
    )
    assert (config["broker_url"], config["result_backend"]) == ("amqp://rabbit//", "redis://r/1")


def test_the_top_level_celeryconfig_sets_nothing_and_comments_only_real_settings() -> None:
    from celery.app.defaults import NAMESPACES, flatten

    text = (ROOT / "celeryconfig.py").read_text()
    namespace: dict[str, object] = {}
    exec(compile(text, "celeryconfig.py", "exec"), namespace)  # noqa: S102 - our own file
    assert [k for k in namespace if not k.startswith("__")] == []  # package defaults apply
    commented = re.findall(r"^# ([a-z_]+) = ", text, re.MULTILINE)
    assert commented  # it shows what may be overridden
    assert set(commented) <= {name for name, _ in flatten(NAMESPACES)}


def test_any_exception_loading_the_accounts_at_start_stops_with_its_type_only(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    def fails(**_: object) -> None:
        raise UnicodeDecodeError("utf-8", b"\xffsecret-bytes", 0, 1, "invalid start byte")

    monkeypatch.setattr(accounts, "load_accounts", fails)
    for check in (hosting._check_accounts, hosting._check_beat_accounts):
        with pytest.raises(SystemExit) as stopped:
            check(sender=SimpleNamespace(app=celery_app.app))
        assert stopped.value.code == 2
        out, err = capfd.readouterr()
        assert (out, err) == ("", "error: loading the configuration raised UnicodeDecodeError\n")


def test_beat_starts_without_the_secret_file_a_worker_needs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in [n for n in os.environ if n.startswith("MERCHANT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MERCHANT_API_KEY", "k")
    monkeypatch.setenv("MERCHANT_API_SECRET_FILE", str(tmp_path / "mounted-for-workers-only"))
    hosting._check_beat_accounts(sender=SimpleNamespace(app=celery_app.app))  # no SystemExit
    with pytest.raises(SystemExit):
        hosting._check_accounts(sender=SimpleNamespace(app=celery_app.app))


def test_a_fleet_with_its_own_key_prefix_keeps_celerys_keys_under_it() -> None:
    env = {"MERCHANT_REDIS_URL": "redis://127.0.0.1:6379/3", "MERCHANT_KEY_PREFIX": "shop-eu"}
    config = load_config(env)
    for options in ("broker_transport_options", "result_backend_transport_options"):
        assert config[options]["global_keyprefix"] == "shop-eu:celery:"
    # the default prefix keeps the key names older releases wrote (their queued calls)
    plain = load_config({"MERCHANT_REDIS_URL": "redis://127.0.0.1:6379/3"})
    assert "global_keyprefix" not in plain["broker_transport_options"]


def test_the_store_url_given_again_as_celerys_gets_the_prefix_however_it_is_spelt() -> None:
    """CELERY_BROKER_URL naming the token store's own Redis (as MERCHANT_REDIS_URL does, or
    in the form Celery reads) is the fleet's Redis: its keys stay under the prefix."""
    store = "rediss://:pw@cache.example.test:6380/0"
    for given in (store, f"{store}?ssl_cert_reqs=required"):
        env = {"MERCHANT_REDIS_URL": store, "MERCHANT_KEY_PREFIX": "shop-eu"}
        config = load_config({**env, "CELERY_BROKER_URL": given})
        for options in ("broker_transport_options", "result_backend_transport_options"):
            assert config[options]["global_keyprefix"] == "shop-eu:celery:", (given, options)


def test_a_broker_of_the_users_choosing_gets_no_key_prefix_and_celeryconfig_wins(
    tmp_path: Path,
) -> None:
    env = {
        "MERCHANT_REDIS_URL": "redis://127.0.0.1:6379/3",
        "MERCHANT_KEY_PREFIX": "shop-eu",
        "CELERY_BROKER_URL": "redis://127.0.0.1:6379/5",
    }
    config = load_config(env)
    assert "global_keyprefix" not in config["broker_transport_options"]
    assert config["result_backend_transport_options"]["global_keyprefix"] == "shop-eu:celery:"
    write_celeryconfig(tmp_path, "broker_transport_options = {'global_keyprefix': 'mine:'}\n")
    env.pop("CELERY_BROKER_URL")
    assert load_config(env)["broker_transport_options"]["global_keyprefix"] == "mine:"


def test_a_written_config_module_is_never_readable_by_others(tmp_path: Path) -> None:
    """It may hold a Redis password: created with its owner-only mode whatever the umask,
    also over an older file others could read."""
    path = tmp_path / "celeryconfig.py"
    path.write_text("old = 1\n")
    path.chmod(0o644)
    old_umask = os.umask(0)
    try:
        write_config_module(path, {"broker_url": "redis://:pw@127.0.0.1:6379/0"})
    finally:
        os.umask(old_umask)
    assert path.stat().st_mode & 0o777 == 0o600
    assert "broker_url = 'redis://:pw@127.0.0.1:6379/0'" in path.read_text()
    assert "old" not in path.read_text()


def test_a_unix_socket_or_tls_redis_url_is_given_to_celery_in_the_form_it_reads() -> None:
    """redis-py's ``unix://`` is no transport of kombu's nor a backend of Celery's, and
    Celery's result backend refuses ``rediss://`` without ``ssl_cert_reqs``."""
    unix = package_defaults({"MERCHANT_REDIS_URL": "unix:///run/redis.sock?db=3"})
    assert (
        unix["broker_url"]
        == unix["result_backend"]
        == "redis+socket:///run/redis.sock?virtual_host=3"
    )
    assert unix["broker_transport_options"]["visibility_timeout"] == VISIBILITY_TIMEOUT
    tls = package_defaults({"MERCHANT_REDIS_URL": "rediss://cache.example.test:6380/2"})
    assert tls["result_backend"] == "rediss://cache.example.test:6380/2?ssl_cert_reqs=required"
    app = Celery("tls-check", broker=tls["broker_url"], backend=tls["result_backend"])
    try:
        assert app.backend.connparams["ssl_cert_reqs"] == ssl.CERT_REQUIRED  # accepted
    finally:
        app.close()
    chosen = {"MERCHANT_REDIS_URL": "rediss://cache.example.test:6380/2?ssl_cert_reqs=optional"}
    assert package_defaults(chosen)["broker_url"].endswith("?ssl_cert_reqs=optional")  # kept
