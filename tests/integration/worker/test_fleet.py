"""Fleets sharing one Redis never run each other's calls, and no queue shape runs a call twice.

Real workers of two fleets (each its own emulator, API key and MERCHANT_KEY_PREFIX) on one
private ``redis-server``; the test enqueues as fleet A's code would.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout

from merchant_tasks.exceptions import ConfigurationError
from merchant_tasks.sandbox.emulator import SandboxApp, SandboxConfig, SandboxServer
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import RedisServer, wait_until
from merchant_tasks.worker.routing import CALLS_QUEUE, RENEWAL_QUEUE
from merchant_tasks.worker.task_bodies import RENEW_ACCOUNT
from support.celery_fleet import CALL_API, ECHO, RESULT_TIMEOUT, Fleet, echo_calls

pytestmark = pytest.mark.integration

CALLS = 20


@pytest.fixture
def other_sandbox(tmp_path: Path) -> Iterator[MerchantSandbox]:
    """Fleet B's own emulator and account."""
    config = SandboxConfig(api_key=f"b-{uuid.uuid4().hex[:10]}", secret=secrets.token_urlsafe(24))
    secret_file = tmp_path / "b-secret"
    secret_file.write_text(config.secret)
    secret_file.chmod(0o600)
    app = SandboxApp(config)
    with SandboxServer(app) as server:
        yield MerchantSandbox(app, server, config.api_key, secret_file)


@pytest.fixture
def two_fleets(
    tmp_path: Path,
    merchant_sandbox: MerchantSandbox,
    merchant_secret_file: Path,
    other_sandbox: MerchantSandbox,
    merchant_key_prefix: str,
) -> Iterator[tuple[Fleet, Fleet]]:
    """Fleets A and B on one private Redis, no process started yet."""
    with RedisServer(tmp_path / "redis") as server:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        a = Fleet(
            tmp_path / "a", merchant_sandbox, server.url, merchant_key_prefix, merchant_secret_file
        )
        b_prefix = f"{merchant_key_prefix}-b"
        b = Fleet(tmp_path / "b", other_sandbox, server.url, b_prefix, other_sandbox.secret_file)
        with a, b:
            a.long_windows()
            b.long_windows()
            yield a, b


def test_two_fleets_on_one_redis_each_run_only_their_own_calls(
    two_fleets: tuple[Fleet, Fleet],
) -> None:
    """Broker and results at their default (MERCHANT_REDIS_URL): 20 of A's calls all reach
    A's API, none B's, though B's worker is idle on the same Redis."""
    a, b = two_fleets
    a.start_worker("a", concurrency=2)
    b.start_worker("b", concurrency=2)
    a.wait_ready()
    b.wait_ready()
    results = [a.call("POST", ECHO, json={"n": n}) for n in range(CALLS)]
    assert [a.get(r) for r in results] == [{"echo": {"n": n}} for n in range(CALLS)]
    assert echo_calls(a.sandbox) == CALLS
    assert echo_calls(b.sandbox) == 0


def test_on_a_shared_broker_a_worker_refuses_another_fleets_calls(
    two_fleets: tuple[Fleet, Fleet], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both fleets given one broker of the user's choosing (no key prefix): they consume one
    queue, and B's worker refuses A's calls instead of running them as B."""
    a, b = two_fleets
    shared = a.redis_url.rsplit("/", 1)[0] + "/1"  # not the token store's: no key prefix
    for fleet in (a, b):
        fleet.env["CELERY_BROKER_URL"] = fleet.env["CELERY_RESULT_BACKEND"] = shared
    a.start_worker("a", concurrency=2)
    b.start_worker("b", concurrency=2)
    for name, value in a.env.items():  # this process sends as fleet A's code does
        if name.startswith("MERCHANT_"):
            monkeypatch.setenv(name, value)
    a.wait_for_nodes(1)
    b.wait_for_nodes(1)
    results = [a.call("POST", ECHO, json={"n": n}) for n in range(CALLS)]
    succeeded = refused = 0
    refusals: list[str] = []
    for result in results:
        try:
            assert result.get(timeout=RESULT_TIMEOUT) is not None
            succeeded += 1
        except ConfigurationError as exc:
            refused += 1
            refusals.append(str(exc))
        except CeleryTimeout as exc:
            raise AssertionError(a.log_tails() + b.log_tails()) from exc
    assert succeeded + refused == CALLS
    assert all(a.key_prefix in text and f"{b.key_prefix!r}" in text for text in refusals)
    assert echo_calls(b.sandbox) == 0  # never with B's credentials
    assert echo_calls(a.sandbox) == succeeded
    assert refused >= 1  # B's idle worker took some of the 20 (14 in the run recorded)


def test_on_a_shared_broker_a_worker_leaves_another_fleets_renewals_alone(
    two_fleets: tuple[Fleet, Fleet], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One broker of the user's choosing: A's renewal task for its account "default",
    taken by B's worker (B has a "default" too), is not run. It renewed B's account with
    B's credentials and freed B's own claim instead."""
    a, b = two_fleets
    shared = a.redis_url.rsplit("/", 1)[0] + "/1"  # not the token store's: no key prefix
    for fleet in (a, b):
        fleet.env["CELERY_BROKER_URL"] = fleet.env["CELERY_RESULT_BACKEND"] = shared
    worker = b.start_worker("b", concurrency=1)
    b.wait_for_nodes(1)
    for name, value in a.env.items():  # this process sends as fleet A's beat does
        if name.startswith("MERCHANT_"):
            monkeypatch.setenv(name, value)
    a.app.send_task(RENEW_ACCOUNT, ("default",), queue=RENEWAL_QUEUE)
    wait_until(
        lambda: f"was sent by fleet {a.key_prefix!r}" in worker.log_text(),
        "B's worker refusing A's renewal",
        60.0,
    )
    assert b.sandbox.exchanges()["ok"] == 0  # B's credentials never served A's renewal
    assert a.sandbox.exchanges()["ok"] == 0


def test_the_renewal_queue_listed_by_name_runs_each_call_once(fleet: Fleet) -> None:
    """task_queues = (Queue("celery"), Queue("merchant-renewal")): 15 calls by delay(), 15
    published to exchange celery with routing key celery; the API receives exactly 30."""
    fleet.long_windows()
    config_dir = fleet.tmp_path / "named-queues"
    config_dir.mkdir()
    (config_dir / "celeryconfig.py").write_text(
        "from kombu import Queue\n"
        f"task_queues = (Queue({CALLS_QUEUE!r}), Queue({RENEWAL_QUEUE!r}))\n"
    )
    fleet.start_worker("w", concurrency=2, cwd=config_dir)
    fleet.wait_ready()
    before = echo_calls(fleet.sandbox)
    sent: list[Any] = []
    for n in range(15):
        sent.append(fleet.call("POST", ECHO, json={"n": n}))
        sent.append(
            fleet.app.send_task(
                CALL_API,
                args=["POST", ECHO],
                kwargs={"json": {"n": 100 + n}},
                exchange=CALLS_QUEUE,
                routing_key=CALLS_QUEUE,
            )
        )
    for result in sent:
        fleet.get(result)

    def drained() -> bool:
        client = fleet.store().redis
        queues = [fleet.broker_key(q) for q in (CALLS_QUEUE, RENEWAL_QUEUE)]
        return not any(client.llen(q) for q in queues) and not client.hlen(
            fleet.broker_key("unacked")
        )

    wait_until(drained, "every queue empty and nothing unacknowledged", RESULT_TIMEOUT)
    assert echo_calls(fleet.sandbox) - before == 30
    assert "task_queues bind" not in fleet.logs()["worker-w.log"]


def test_a_worker_whose_queues_would_run_a_call_twice_stops_at_start_with_one_line(
    fleet: Fleet,
) -> None:
    config_dir = fleet.tmp_path / "unsafe-queues"
    config_dir.mkdir()
    (config_dir / "celeryconfig.py").write_text(
        f"from kombu import Queue\ntask_queues = (Queue({CALLS_QUEUE!r}), Queue('shop'))\n"
    )
    worker = fleet.start_worker("w", cwd=config_dir)
    assert worker.process.wait(timeout=RESULT_TIMEOUT) == 2
    errors = [line for line in worker.log_text().splitlines() if line.startswith("error:")]
    assert errors == [
        "error: ConfigurationError: task_queues bind celery, shop to exchange 'celery' with "
        "routing key 'celery': a message sent there lands in each of them and a call runs 2 "
        "times; give each queue its own routing key, e.g. Queue('shop', Exchange('shop'), "
        "routing_key='shop')"
    ]
    assert "Traceback" not in worker.log_text()
