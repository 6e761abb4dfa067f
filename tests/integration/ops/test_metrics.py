"""The Prometheus exporter: every counter from the first scrape, histograms, Redis down."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from merchant_tasks.accounts import AccountClients, FleetClient
from merchant_tasks.ops.metrics import FleetCollector
from merchant_tasks.ops.status import account_statuses
from merchant_tasks.sandbox.processes import free_port, running
from merchant_tasks.token import BreakerKind, Outcome, RenewalReason

pytestmark = pytest.mark.integration

START_TIMEOUT = 60.0  # the exporter's start on a busy machine
ACCOUNT = (("account", "default"), ("environment", "sandbox"))

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(env: dict[str, str]) -> Samples:
    with AccountClients.from_env(env) as fleet:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(FleetCollector(lambda: account_statuses(fleet)))  # as the exporter
        return _parse(generate_latest(registry).decode())


def _parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _labels(**extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((*ACCOUNT, *extra.items())))


def test_every_counter_has_a_zero_sample_for_an_account_before_its_first_event(
    merchant_env: dict[str, str],
) -> None:
    samples = _scrape(merchant_env)
    assert samples[("merchant_tasks_up", ())] == 1
    for reason in RenewalReason:
        for outcome in Outcome:
            labels = _labels(reason=reason, outcome=outcome)
            assert samples[("merchant_tasks_renewals_total", labels)] == 0
            assert samples[("merchant_tasks_exchange_attempts_total", labels)] == 0
    for kind in BreakerKind:
        assert samples[("merchant_tasks_breaker_openings_total", _labels(kind=kind))] == 0
    for name in ("unauthorized", "forced_renewals", "lock_waits", "never_accepted_rejected"):
        assert samples[(f"merchant_tasks_{name}_total", _labels())] == 0
    for name in ("exchange_seconds", "lock_wait_seconds"):
        assert samples[(f"merchant_tasks_{name}_count", _labels())] == 0
    assert not any(name == "merchant_tasks_exchanges_last_hour" for name, _ in samples)


def test_exchange_latency_is_a_histogram_of_every_attempt(
    merchant_env: dict[str, str], merchant_client: FleetClient
) -> None:
    merchant_client.request("GET", "/open-api/v1/ping")
    merchant_client.manager.renew(force=True)
    samples = _scrape(merchant_env)
    assert samples[("merchant_tasks_exchange_seconds_count", _labels())] == 2
    assert samples[("merchant_tasks_exchange_seconds_bucket", _labels(le="+Inf"))] == 2
    assert samples[("merchant_tasks_exchange_seconds_sum", _labels())] > 0


def test_a_renewal_waiting_for_another_holder_of_the_lock_is_in_the_lock_wait_histogram(
    merchant_env: dict[str, str], merchant_client: FleetClient, redis_client: redis.Redis
) -> None:
    store = merchant_client.manager.store
    assert store.take_lock("another-host:1:aa:1", "another-host:1:aa:", 60.0)
    # the other process gives up its lock soon; our caller then renews itself
    letting_go = threading.Timer(0.3, redis_client.delete, args=[store.keys.lock])
    letting_go.start()
    try:
        assert merchant_client.request("GET", "/open-api/v1/ping") == {"ok": True}
    finally:
        letting_go.join()
    samples = _scrape(merchant_env)
    assert samples[("merchant_tasks_lock_waits_total", _labels())] == 1
    assert samples[("merchant_tasks_lock_wait_seconds_count", _labels())] == 1
    assert samples[("merchant_tasks_lock_wait_seconds_bucket", _labels(le="+Inf"))] == 1


@pytest.fixture
def exporter_with_redis_down(merchant_env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    """`merchant-tasks metrics` in its own process, its Redis unreachable."""
    port = free_port()
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("MERCHANT_")}
    child_env |= {**merchant_env, "MERCHANT_REDIS_URL": "redis://ops:hunter2-pw@127.0.0.1:1/0"}
    argv = [sys.executable, "-m", "merchant_tasks.ops.cli", "metrics", "--port", str(port)]
    url = f"http://127.0.0.1:{port}/metrics"

    def answers() -> bool:
        try:
            requests.get(url, timeout=5)
        except requests.ConnectionError:
            return False
        return True

    log = tmp_path / "metrics.log"
    with running("the exporter", argv, log, answers, timeout=START_TIMEOUT, env=child_env):
        yield url


def test_a_scrape_with_redis_down_answers_200_with_up_0_and_the_error(
    exporter_with_redis_down: str,
) -> None:
    response = requests.get(exporter_with_redis_down, timeout=30)
    assert response.status_code == 200
    samples = _parse(response.text)
    assert samples[("merchant_tasks_up", ())] == 0
    assert samples[("merchant_tasks_scrape_error", (("type", "StoreUnavailable"),))] == 1
    assert "Traceback" not in response.text
    assert "hunter2-pw" not in response.text
