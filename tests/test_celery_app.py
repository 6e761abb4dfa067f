"""The Celery app's configuration: built from the validated settings (one door), per broker
(Redis-only transport options, Sentinel's master name), and clear errors."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from merchant_tasks.celery_app import (
    PUBLISH_RETRY_POLICY,
    REDIS_ONLY_TRANSPORT_OPTIONS,
    VISIBILITY_TIMEOUT,
    load_config,
    package_defaults,
)
from merchant_tasks.routing import CALLS_QUEUE, RENEWAL_QUEUE

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
SENTINELS = "sentinel://:master-pw@127.0.0.1:26379/0;sentinel://:master-pw@127.0.0.1:26380/0"


@pytest.fixture(autouse=True)
def empty_celeryconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An empty celeryconfig.py first on the path (not the repo's), unless a test writes one."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    write_celeryconfig(tmp_path, "")
    yield
    sys.modules.pop("celeryconfig", None)


def write_celeryconfig(directory: Path, text: str) -> None:
    (directory / "celeryconfig.py").write_text(text)
    sys.modules.pop("celeryconfig", None)
    importlib.invalidate_caches()  # the directory was listed before the file existed


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

START_TIMEOUT = 120.0  # seconds for a celery command on a busy machine


def _clean_env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MERCHANT_", "CELERY_"))}
    return {**env, **variables}


def _celery(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "merchant_tasks", *args],
        env=env,
        cwd=tmp_path,  # no celeryconfig.py here
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        check=False,
    )


def test_broker_and_backend_follow_the_redis_url_file(tmp_path: Path) -> None:
    path = tmp_path / "redis-url"
    path.write_text("redis://:pw@cache.example.test:6380/4\n", encoding="utf-8")
    config = package_defaults({"MERCHANT_REDIS_URL_FILE": str(path)})
    assert (
        config["broker_url"] == config["result_backend"] == "redis://:pw@cache.example.test:6380/4"
    )


def test_beat_schedule_follows_the_validated_renew_interval() -> None:
    config = package_defaults({"MERCHANT_RENEW_INTERVAL": "7.5"})
    entry = config["beat_schedule"]["renew-merchant-token"]
    assert entry["schedule"] == entry["options"]["expires"] == 7.5


def test_celery_urls_from_the_environment_override_the_defaults() -> None:
    config = load_config(
        {"CELERY_BROKER_URL": "amqp://rabbit//", "CELERY_RESULT_BACKEND": "redis://r/1"}
    )
    assert (config["broker_url"], config["result_backend"]) == ("amqp://rabbit//", "redis://r/1")


def test_each_queue_is_bound_to_its_own_exchange_and_routing_key() -> None:
    queues = {q.name: q for q in package_defaults({})["task_queues"]}
    assert set(queues) == {CALLS_QUEUE, RENEWAL_QUEUE}
    for name, queue in queues.items():
        assert (queue.exchange.name, queue.routing_key) == (name, name)


@pytest.mark.parametrize(
    ("raw", "message"),
    [("abc", "must be a number of seconds"), ("-5", "must be a positive, finite number")],
)
def test_a_bad_renew_interval_stops_the_celery_command_with_one_line_naming_it(
    tmp_path: Path, raw: str, message: str
) -> None:
    done = _celery(tmp_path, _clean_env(MERCHANT_RENEW_INTERVAL=raw), "report")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr + done.stdout
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: ConfigurationError: MERCHANT_RENEW_INTERVAL {message}")


def test_a_library_import_with_a_bad_setting_raises_the_configuration_error(
    tmp_path: Path,
) -> None:
    code = (
        "from merchant_tasks.exceptions import ConfigurationError\n"
        "try:\n    import merchant_tasks.celery_app\n"
        "except ConfigurationError as exc:\n    print('raised:', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=_clean_env(MERCHANT_RENEW_INTERVAL="abc"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("raised: MERCHANT_RENEW_INTERVAL must be a number")


def test_the_celery_command_loads_the_app_without_any_account(tmp_path: Path) -> None:
    done = _celery(tmp_path, _clean_env(), "report")
    assert done.returncode == 0, done.stderr
    assert "merchant_tasks.celery_app" in done.stdout or "merchant_tasks" in done.stdout


def test_a_worker_without_any_account_stops_at_start_with_the_configuration_message(
    tmp_path: Path, merchant_redis_url: str
) -> None:
    done = _celery(
        tmp_path,
        _clean_env(MERCHANT_REDIS_URL=merchant_redis_url),
        "worker",
        "--pool=solo",
        "--without-gossip",
        "--without-mingle",
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr + done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ConfigurationError: no account configured: set MERCHANT_API_KEY")
    assert "ready" not in done.stdout + done.stderr
