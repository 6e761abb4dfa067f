"""A call delivered again: never run twice once it succeeded, and what is left to the API.

Real workers, a redis-server per test and the emulator. A redelivery keeps the task id, so
the tests deliver a call again the ways the broker does: the same message sent twice (what
a failed acknowledgement amounts to), a worker SIGKILLed while the API processes the call,
and a worker that ran the call but never acknowledged it, redelivered by the visibility
timeout to another worker.
"""

from __future__ import annotations

import os
import signal
import uuid
from typing import Any

import pytest

from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import Child, wait_until
from merchant_tasks.token import CounterName
from support.celery_fleet import (
    Fleet,
    running_on,
)

pytestmark = pytest.mark.integration

PAYMENTS = "/open-api/v1/payments"
API_LATENCY = 3.0  # seconds the emulator takes per call: time to stop or kill the worker
VISIBILITY_TIMEOUT = 6  # seconds; short, so the broker redelivers within the test, and above
# API_LATENCY with room to spare, so that a call still running is not delivered again
REDELIVERY_TIMEOUT = 90.0  # the visibility timeout, the restore sweep and a busy machine


def _two_workers_and_a_slow_api(fleet: Fleet, sandbox: MerchantSandbox) -> dict[str, Child]:
    """Workers "a" and "b" (prefork, one child each) that redeliver quickly, both consuming,
    and an API that takes API_LATENCY per call; long windows: no renewal interferes."""
    fleet.long_windows()
    config_dir = fleet.short_visibility_dir(VISIBILITY_TIMEOUT)
    workers = {label: fleet.start_worker(label, 1, cwd=config_dir) for label in ("a", "b")}
    fleet.wait_ready()
    fleet.wait_for_nodes(2)
    sandbox.app.configure({"api_latency": API_LATENCY})
    return workers


def _label(node: str) -> str:
    """The worker label in a node name such as ``mt-it-1234-a@host``."""
    return node.split("@")[0].rsplit("-", 1)[1]


def _redelivered(fleet: Fleet) -> int:
    return fleet.store().records.counters().get(CounterName.REDELIVERED, 0)


def test_a_call_delivered_again_after_it_succeeded_returns_its_result_without_calling_the_api(
    fleet: Fleet, merchant_sandbox: MerchantSandbox
) -> None:
    fleet.long_windows()
    fleet.start_worker("w", concurrency=2)
    fleet.wait_ready()
    task_id = str(uuid.uuid4())

    first = fleet.get(fleet.call("POST", PAYMENTS, json={"amount": 1200}, task_id=task_id))
    # a failed ack leaves the message to be delivered again, with the same task id (whose
    # result the backend already holds: wait for the worker, not for the result)
    again = fleet.call("POST", PAYMENTS, json={"amount": 1200}, task_id=task_id)
    wait_until(lambda: _redelivered(fleet) == 1, "the second delivery answered", 30.0)

    assert first == fleet.get(again) == {"id": "pay_1", "amount": 1200, "status": "created"}
    assert merchant_sandbox.app.arrived(PAYMENTS) == 1
    other = fleet.get(fleet.call("POST", PAYMENTS, json={"amount": 5}))
    assert other["id"] == "pay_2"  # another task id is another call


@pytest.mark.parametrize("idempotency_key", [None, "order-4711"], ids=["no-key", "with-key"])
def test_a_worker_killed_while_the_api_processes_a_call_leaves_it_to_the_idempotency_key(
    fleet: Fleet, merchant_sandbox: MerchantSandbox, idempotency_key: str | None
) -> None:
    workers = _two_workers_and_a_slow_api(fleet, merchant_sandbox)
    options: dict[str, Any] = (
        {} if idempotency_key is None else {"idempotency_key": idempotency_key}
    )

    result = fleet.call("POST", PAYMENTS, json={"amount": 990}, **options)
    node, _ = running_on(fleet, result)
    wait_until(
        lambda: merchant_sandbox.app.arrived(PAYMENTS) == 1, "the call reaching the API", 20.0
    )
    victim = workers[_label(node)]
    victim.kill()  # the API goes on and creates the payment
    # the survivor calls after the visibility timeout, when the payment exists: at once
    merchant_sandbox.app.configure({"api_latency": 0.0})

    payment = fleet.get(result, REDELIVERY_TIMEOUT)
    assert (
        merchant_sandbox.app.arrived(PAYMENTS) == 2
    )  # the survivor had no record: it called again
    assert _redelivered(fleet) == 0
    ids = _payment_ids(merchant_sandbox)
    if idempotency_key is None:
        assert ids == ["pay_1", "pay_2"]  # the window a completion record cannot close
    else:
        assert ids == ["pay_1"]  # the API knew the key: one payment, returned again
        assert payment["id"] == "pay_1"


def test_a_call_run_but_never_acked_is_redelivered_after_the_visibility_timeout_and_not_rerun(
    fleet: Fleet, merchant_sandbox: MerchantSandbox
) -> None:
    workers = _two_workers_and_a_slow_api(fleet, merchant_sandbox)

    result = fleet.call("POST", PAYMENTS, json={"amount": 321})
    node, child_pid = running_on(fleet, result)
    label = _label(node)
    stopped, survivor = workers[label], workers["b" if label == "a" else "a"]
    assert child_pid != stopped.process.pid
    # the worker's main process acknowledges; stopped, it never will. Its pool child runs on,
    # calls the API, writes the completion record and the result.
    os.kill(stopped.process.pid, signal.SIGSTOP)
    try:
        assert fleet.get(result, REDELIVERY_TIMEOUT) == {
            "id": "pay_1",
            "amount": 321,
            "status": "created",
        }
        wait_until(
            lambda: _redelivered(fleet) == 1,
            "the visibility timeout's redelivery to the other worker",
            REDELIVERY_TIMEOUT,
        )
    finally:
        stopped.kill()
    assert merchant_sandbox.app.arrived(PAYMENTS) == 1
    assert _payment_ids(merchant_sandbox) == ["pay_1"]
    wait_until(
        lambda: f"call_api[{result.id}] succeeded" in survivor.log_text(),
        "the redelivered call's success in the other worker's log",
        REDELIVERY_TIMEOUT,
    )


def _payment_ids(sandbox: MerchantSandbox) -> list[str]:
    """The payments the emulator created (a replayed idempotency key creates none)."""
    return [payment["id"] for payment in sandbox.app.payments()]
