"""RabbitMQ as Celery's broker, the token store and results on Redis.

RabbitMQ is the machine's (127.0.0.1:5672, guest/guest), shared by every test run: each
module (on each xdist worker) gets a virtual host of its own (``rabbitmqctl add_vhost``,
removed at the end), so queues and messages of parallel runs never meet; its queues are
purged before each test (each rabbitmqctl command starts an Erlang node: seconds of CPU on
a busy machine). Redis is a private redis-server per test.
Workers and beat are real child processes (``Fleet``); the broker URL reaches them through
CELERY_BROKER_URL, as in production.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection

from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import RedisServer, wait_until
from merchant_tasks.worker.app import REDIS_ONLY_TRANSPORT_OPTIONS, RENEWAL_QUEUE, load_config
from merchant_tasks.worker.routing import CALLS_QUEUE
from support.celery_fleet import ECHO, LIFETIME, RENEW_INTERVAL, Fleet, kill_the_worker_running

pytestmark = pytest.mark.integration

RABBITMQ = ("127.0.0.1", 5672)
RABBITMQCTL_TIMEOUT = 60.0  # seconds; the CLI starts an Erlang node for each command
API_LATENCY = 6.0  # the emulator's delay on business calls: the worker dies during one
KILL_DEADLINE = 60.0  # the re-run's result, after a worker vanished
WIDE_WORKER = 20  # threads: more than kombu's Redis channel cap of 10


def rabbitmqctl(*args: str) -> str:
    binary = shutil.which("rabbitmqctl")
    if binary is None:
        pytest.skip("rabbitmqctl is not on PATH: no RabbitMQ to test against")
    done = subprocess.run(
        [binary, *args], capture_output=True, text=True, timeout=RABBITMQCTL_TIMEOUT, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"rabbitmqctl {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


@pytest.fixture(scope="module")
def amqp_vhost_url() -> Iterator[str]:
    """A virtual host of this module's own on the machine's RabbitMQ, deleted afterwards."""
    try:
        socket.create_connection(RABBITMQ, timeout=1.0).close()
    except OSError:
        pytest.skip("no RabbitMQ on 127.0.0.1:5672")
    vhost = f"mt-test-{uuid.uuid4().hex[:12]}"
    rabbitmqctl("add_vhost", vhost)
    try:
        rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@{RABBITMQ[0]}:{RABBITMQ[1]}/{vhost}"
    finally:
        rabbitmqctl("delete_vhost", vhost)


@pytest.fixture
def amqp_url(amqp_vhost_url: str) -> str:
    """The module's virtual host, its queues emptied of what an earlier test left."""
    with Connection(amqp_vhost_url) as connection:
        channel = connection.default_channel
        for queue in (CALLS_QUEUE, RENEWAL_QUEUE):
            try:
                channel.queue_purge(queue)
            except connection.channel_errors:  # not declared yet (closes the channel)
                channel = connection.channel()
    return amqp_vhost_url


class AmqpFleet(Fleet):
    """A fleet whose broker is RabbitMQ; the token store and results stay on its Redis."""

    def __init__(self, broker_url: str, *args: Any) -> None:
        super().__init__(*args)
        self.broker_url = broker_url
        self.env["CELERY_BROKER_URL"] = broker_url

    @property
    def app(self) -> Any:
        if self._app is None:
            app = Celery("test-client")
            config = load_config({**self.env, "CELERY_RESULT_BACKEND": self.redis_url})
            config["imports"] = ()  # the client never imports the tasks module
            app.conf.update(config)
            self._app = app
        return self._app

    @property
    def vhost(self) -> str:
        return self.broker_url.rsplit("/", 1)[1]

    def queues(self) -> dict[str, int]:
        """The vhost's queues and their consumer counts, as RabbitMQ reports them."""
        listed = rabbitmqctl("list_queues", "-p", self.vhost, "-q", "--no-table-headers",
                             "name", "consumers")  # fmt: skip
        return {name: int(count) for name, count in (line.split() for line in listed.splitlines())}


@pytest.fixture
def private_redis_url(tmp_path: Path) -> Iterator[str]:
    """The URL of a redis-server of this test's own: the token store and the result backend."""
    with RedisServer(tmp_path / "redis") as server:
        yield server.url


@pytest.fixture
def fleet(
    amqp_url: str,
    tmp_path: Path,
    merchant_sandbox: MerchantSandbox,
    private_redis_url: str,
    merchant_key_prefix: str,
    merchant_secret_file: Path,
) -> Iterator[AmqpFleet]:
    with AmqpFleet(
        amqp_url,
        tmp_path,
        merchant_sandbox,
        private_redis_url,
        merchant_key_prefix,
        merchant_secret_file,
    ) as fleet:
        yield fleet
    wait_until(lambda: not fleet.leftovers(), "the fleet's processes gone", 10.0)


def test_call_api_runs_end_to_end_with_rabbitmq_as_the_broker(
    fleet: AmqpFleet, merchant_sandbox: MerchantSandbox
) -> None:
    fleet.long_windows()
    fleet.start_worker("w", concurrency=2)
    fleet.wait_ready()

    body = {"amount": 1250, "currency": "EUR"}
    results = [fleet.call("POST", ECHO, json={**body, "n": n}) for n in range(10)]
    assert [fleet.get(r) for r in results] == [{"echo": {**body, "n": n}} for n in range(10)]
    assert merchant_sandbox.exchanges()["ok"] == 1

    # the calls went through RabbitMQ: its queues have the worker as consumer, and the
    # private Redis holds tokens and results but no queue
    assert fleet.queues()["celery"] == 1
    keys = {k.decode() for k in redis.Redis.from_url(fleet.redis_url).scan_iter()}
    assert not {"celery", RENEWAL_QUEUE, "_kombu.binding.celery"} & keys
    assert any("celery-task-meta-" in k for k in keys)  # under the fleet's key prefix


def test_no_redis_only_transport_option_reaches_the_amqp_broker(fleet: AmqpFleet) -> None:
    # a worker large enough that its start sizes the connection pools to its concurrency
    fleet.start_worker("w", concurrency=WIDE_WORKER, pool="threads")
    fleet.wait_ready()

    # what the running worker itself uses, asked over the broker (of that node alone, so
    # that the answer comes as soon as it replies, not at the timeout)
    node = f"{fleet.marker}-w@{socket.gethostname()}"
    replies = fleet.app.control.inspect([node], timeout=5.0).conf() or {}
    assert len(replies) == 1
    worker_conf = next(iter(replies.values()))
    assert worker_conf["broker_url"].startswith("amqp://")
    assert not REDIS_ONLY_TRANSPORT_OPTIONS & set(worker_conf.get("broker_transport_options", {}))
    assert worker_conf["broker_pool_limit"] >= WIDE_WORKER  # the sizing did run
    # the result backend is Redis and keeps its own
    assert "visibility_timeout" in worker_conf["result_backend_transport_options"]


def test_renewal_runs_on_its_own_rabbitmq_queue(
    fleet: AmqpFleet, merchant_sandbox: MerchantSandbox
) -> None:
    # renew from the first tick, then 1 s after each renewal: a mandatory window this
    # close to the advisory one leaves no spread to beat's renewal point (due.py)
    fleet.windows(LIFETIME, LIFETIME - 1.0, LIFETIME - 2.0, RENEW_INTERVAL)
    renewal_only = fleet._celery(
        "worker", "--pool=solo", "-Q", RENEWAL_QUEUE, "--without-gossip", "--without-mingle",
        "-n", f"{fleet.marker}-renewal@%h", "--loglevel=DEBUG",
    )  # fmt: skip
    worker = fleet._spawn("worker-renewal", renewal_only, fleet.workdir)
    fleet.start_beat("b")

    # only a worker of the renewal queue runs: the beat's renewals reach it there
    wait_until(lambda: merchant_sandbox.exchanges()["ok"] >= 2, "two scheduled renewals", 60.0)
    queues = fleet.queues()
    assert queues[RENEWAL_QUEUE] == 1
    assert queues.get("celery", 0) == 0  # nobody consumes calls; renewals never went there
    assert "merchant_tasks.renew_token" in worker.log_text()
    counters = fleet.store().records.counters()
    assert counters.get("renewals:scheduled:ok", 0) >= 2, counters


def test_a_worker_sigkilled_mid_task_has_its_call_redelivered_by_rabbitmq(
    fleet: AmqpFleet, merchant_sandbox: MerchantSandbox
) -> None:
    fleet.long_windows()
    workers = {label: fleet.start_worker(label, concurrency=1) for label in ("a", "b")}
    fleet.wait_ready()
    fleet.wait_for_nodes(2)
    merchant_sandbox.app.configure({"api_latency": API_LATENCY})

    result = fleet.call("POST", ECHO, json={"order": "kill-me"})
    survivor = kill_the_worker_running(fleet, workers, result)
    merchant_sandbox.app.configure({"api_latency": 0.0})  # the call run again answers at once

    # RabbitMQ requeues an unacknowledged message when its consumer's connection closes:
    # no visibility timeout to wait for
    assert fleet.get(result, KILL_DEADLINE) == {"echo": {"order": "kill-me"}}
    assert result.id in workers[survivor].log_text()
    # received by the killed worker's child (still sleeping its latency), then again
    assert merchant_sandbox.app.arrived(ECHO) == 2
