"""At worker and beat start the token store is checked, and a WARNING names
MERCHANT_REDIS_URL (host only) while it cannot be used: real workers and beat."""

from __future__ import annotations

import pytest
import redis

from merchant_tasks.sandbox.processes import RedisServer, free_port, wait_until
from support.celery_fleet import Fleet

pytestmark = pytest.mark.integration

WARNING_DEADLINE = 20.0  # seconds from start: a generous deadline, not a measured time
PASSWORD = "store-pw-never-logged"


@pytest.fixture
def fleet(fleet: Fleet) -> Fleet:
    """conftest's fleet, its children rechecking the store every second, not every 10 s."""
    fleet.load_app("support.quick_recheck_worker")
    return fleet


def _warnings(text: str) -> list[str]:
    return [
        line for line in text.splitlines() if "WARNING" in line and "MERCHANT_REDIS_URL" in line
    ]


@pytest.mark.parametrize("process", ["worker", "beat"])
def test_an_unreachable_token_store_is_a_warning_naming_the_url_within_20_s_of_start(
    fleet: Fleet, process: str
) -> None:
    port = free_port()
    fleet.env.update(
        CELERY_BROKER_URL=fleet.redis_url,  # the broker is fine
        CELERY_RESULT_BACKEND=fleet.redis_url,
        MERCHANT_REDIS_URL=f"redis://:{PASSWORD}@127.0.0.1:{port}/0",
    )
    child = fleet.start_worker("w") if process == "worker" else fleet.start_beat("b")
    wait_until(lambda: bool(_warnings(child.log_text())), "the warning", WARNING_DEADLINE)
    [first, *_] = _warnings(child.log_text())
    assert f"127.0.0.1:{port}" in first
    assert "unavailable: ConnectionError" in first
    # repeated while it lasts
    wait_until(lambda: len(_warnings(child.log_text())) >= 2, "a second warning", 30.0)
    assert PASSWORD not in child.log_text()


def test_a_read_only_token_store_is_named_and_the_warning_stops_once_it_takes_writes(
    fleet: Fleet,
) -> None:
    with RedisServer(
        fleet.tmp_path / "replica", "--replicaof", "127.0.0.1", str(free_port())
    ) as replica:
        fleet.env.update(
            CELERY_BROKER_URL=fleet.redis_url,
            CELERY_RESULT_BACKEND=fleet.redis_url,
            MERCHANT_REDIS_URL=replica.url,
        )
        worker = fleet.start_worker("w")
        wait_until(lambda: bool(_warnings(worker.log_text())), "the warning", WARNING_DEADLINE)
        assert "read-only replica" in _warnings(worker.log_text())[0]
        admin = redis.Redis(port=replica.port)
        admin.replicaof("NO", "ONE")
        admin.close()
        wait_until(lambda: "answers again" in worker.log_text(), "the store answering again", 30.0)
