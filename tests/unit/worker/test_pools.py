"""How a worker's connection pools are sized for its concurrency at start (worker/pools.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from merchant_tasks.worker.app import VISIBILITY_TIMEOUT, package_defaults
from merchant_tasks.worker.pools import CONSUMER_CONNECTIONS, size_pools, worker_concurrency


def _conf(**overrides: Any) -> Any:
    app = Celery("sizing", set_as_current=False)
    app.conf.update({**package_defaults({}), **overrides})
    return app.conf


def test_a_worker_of_50_gets_broker_pools_of_50_plus_the_consumers_own_connections() -> None:
    conf = _conf()
    sizes = size_pools(conf, 50)
    assert sizes.connections == 50 + CONSUMER_CONNECTIONS
    assert conf.broker_transport_options == {
        "visibility_timeout": VISIBILITY_TIMEOUT,  # kept
        "max_connections": 60,
    }
    assert conf.broker_pool_limit == 60
    assert conf.redis_max_connections is None  # redis-py's default of 100 is enough


def test_a_worker_of_200_gets_a_result_backend_pool_of_210() -> None:
    conf = _conf()
    size_pools(conf, 200)
    assert conf.redis_max_connections == 210
    assert conf.broker_transport_options["max_connections"] == 210


def test_larger_or_unlimited_pools_are_left_alone() -> None:
    conf = _conf(
        broker_transport_options={"max_connections": 500},
        redis_max_connections=400,
        broker_pool_limit=None,
    )
    assert size_pools(conf, 50).raised == ()
    assert conf.broker_transport_options == {"max_connections": 500}
    assert conf.redis_max_connections == 400
    assert conf.broker_pool_limit is None


def test_a_cap_set_too_small_is_raised_with_a_warning_naming_the_setting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    conf = _conf(broker_transport_options={"max_connections": 10, "visibility_timeout": 60})
    with caplog.at_level(logging.WARNING, logger="merchant_tasks.worker.pools"):
        size_pools(conf, 50)
    assert conf.broker_transport_options == {"max_connections": 60, "visibility_timeout": 60}
    assert "broker_transport_options['max_connections'] allows 10 connections" in caplog.text


def test_an_amqp_broker_gets_no_redis_transport_cap_but_a_pool_limit() -> None:
    conf = _conf(broker_url="amqp://guest:guest@127.0.0.1:5672//", broker_transport_options={})
    size_pools(conf, 50)
    assert conf.broker_transport_options == {}  # max_connections is a Redis transport option
    assert conf.broker_pool_limit == 60


def test_the_concurrency_is_the_autoscale_maximum_when_larger() -> None:
    assert worker_concurrency(SimpleNamespace(concurrency=4, max_concurrency=None)) == 4
    assert worker_concurrency(SimpleNamespace(concurrency=4, max_concurrency=40)) == 40
