"""Celery configuration per broker: Redis-only transport options, Sentinel's master name."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from merchant_tasks.celery_app import (
    PUBLISH_RETRY_POLICY,
    REDIS_ONLY_TRANSPORT_OPTIONS,
    VISIBILITY_TIMEOUT,
    load_config,
)

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
