"""Real Celery workers and beat against a private Redis and the sandbox emulator.

Every test starts its own ``redis-server`` (broker, result backend and token store), so no
queue, result or token carries over from one test to the next. Workers and beat run as
child processes (``python -m celery -A merchant_tasks worker|beat``) in their own sessions,
with DEBUG logs written to files in the test's tmp_path; every process group is killed at
teardown and checked gone. The test process enqueues with a separate Celery app configured
like the workers; it never imports ``merchant_tasks.tasks`` and never runs a task eagerly.
"""

from __future__ import annotations

import base64
import math
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from kombu import Exchange, Queue

from merchant_tasks.exceptions import ApiError, CredentialsRejected
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import wait_until
from merchant_tasks.store.token_store import TokenStore
from merchant_tasks.worker.routing import CALLS_QUEUE, RENEWAL_QUEUE
from support.account import TEST_SECRET
from support.celery_fleet import (
    CALL_API,
    ECHO,
    READY_TIMEOUT,
    RENEW_INTERVAL,
    RESULT_TIMEOUT,
    Fleet,
    echo_calls,
    kill_the_worker_running,
    running_on,
)
from support.leaks import redis_value, shows
from support.routes import PING

pytestmark = pytest.mark.integration

API_LATENCY = 3.0  # the emulator's delay on business calls in the worker-loss tests: time
# to see which worker runs the call and kill it while the API processes it
KILL_VISIBILITY_TIMEOUT = 5  # seconds; above the time to kill, and the re-run has no latency
# Windows of the tests that wait for beat's renewals (seconds). The advisory window is two
# beat intervals, so beat renews exactly QUICK_RENEW_BEFORE ahead (due.renewal_point):
# renewals come about QUICK_LIFETIME - QUICK_RENEW_BEFORE = 1.5 s apart.
QUICK_LIFETIME = 3.0
QUICK_RENEW_BEFORE = 1.5
QUICK_RENEW_MANDATORY = 1.0  # as the default short windows: the margin of a call in flight
QUICK_RENEW_INTERVAL = 0.25


def _settled_exchanges(fleet: Fleet, sandbox: MerchantSandbox) -> tuple[int, dict[str, int]]:
    """Tokens the emulator issued and the store's counters, read while no renewal is between
    the two (the emulator counts a renewal first, the worker's store after): beat goes on
    renewing while a test reads them."""
    store = fleet.store()
    seen: list[tuple[int, dict[str, int]]] = []

    def settled() -> bool:
        before = store.records.counters()
        issued = sandbox.exchanges()["ok"]
        after = store.records.counters()
        recorded = sum(
            v for k, v in after.items() if k.startswith("renewals:") and k.endswith(":ok")
        )
        seen.append((issued, after))
        return before == after and recorded == issued

    wait_until(settled, "the emulator's and the store's exchange counts to agree", 10.0)
    return seen[-1]


def _quick_windows(fleet: Fleet) -> None:
    fleet.windows(QUICK_LIFETIME, QUICK_RENEW_BEFORE, QUICK_RENEW_MANDATORY, QUICK_RENEW_INTERVAL)


def _before_the_first_exchange(sandbox: MerchantSandbox) -> float:
    """A ``time.monotonic()`` before the emulator's first token exchange, at most one poll
    before it: the start of a span that holds every exchange."""
    before = time.monotonic()

    def exchanged() -> bool:
        nonlocal before
        polled = time.monotonic()
        if sandbox.exchanges()["ok"] >= 1:
            return True
        before = polled
        return False

    wait_until(exchanged, "a first scheduled renewal", 60.0)
    return before


# -- 1. plain calls ------------------------------------------------------------------------


def test_call_api_through_a_real_worker_returns_the_decoded_json_body(
    fleet: Fleet, merchant_sandbox: MerchantSandbox
) -> None:
    fleet.long_windows()
    fleet.start_worker("w", concurrency=1)
    fleet.wait_ready()

    body = {"amount": 1250, "currency": "EUR", "items": [{"sku": "a-1", "qty": 2}], "x": None}
    assert fleet.get(fleet.call("GET", PING)) == {"ok": True}
    assert fleet.get(fleet.call("POST", ECHO, json=body)) == {"echo": body}
    assert merchant_sandbox.exchanges()["ok"] == 1
    assert merchant_sandbox.calls()["ok"] == 3


# -- 2. beat renews in the advisory window -------------------------------------------------


def test_beat_renews_in_the_advisory_window_while_calls_flow_without_a_401(
    fleet: Fleet, merchant_sandbox: MerchantSandbox
) -> None:
    # an advisory window of 4 s: 8 beat ticks, so a stalled tick or two changes nothing; the
    # token is fresh for 1 s, so renewals come 1 to 4 s apart (due.renewal_point)
    lifetime, before, mandatory = 6.0, 5.0, 1.0
    fleet.windows(lifetime, before, mandatory, RENEW_INTERVAL)
    fleet.start_worker("w", concurrency=2)
    fleet.start_beat("b")
    fleet.wait_ready()
    # the first token may come from that call, if it ran before beat's first tick
    first_mandatory = fleet.store().records.counters().get("renewals:mandatory:ok", 0)

    results = fleet.send_calls_until(
        lambda: merchant_sandbox.exchanges()["ok"] >= 3,
        "the first token and two renewals",
        4 * lifetime,
    )
    fleet.expect_all_ok(results)

    _, counters = _settled_exchanges(fleet, merchant_sandbox)
    assert counters.get("renewals:scheduled:ok", 0) >= 2, counters
    assert counters.get("renewals:mandatory:ok", 0) == first_mandatory, counters
    assert counters.get("renewals:forced:ok", 0) == 0, counters
    assert merchant_sandbox.calls()["unauthorized"] == 0


# -- 3. revoke-all storm -------------------------------------------------------------------


def test_a_revoke_all_storm_through_tasks_costs_exactly_one_exchange(
    fleet: Fleet, merchant_sandbox: MerchantSandbox
) -> None:
    fleet.long_windows()
    fleet.start_worker("w", concurrency=4)
    fleet.wait_ready()
    before = merchant_sandbox.exchanges()["ok"]

    merchant_sandbox.app.revoke_all()
    results = [fleet.call("GET", PING) for _ in range(40)]

    assert [fleet.get(r) for r in results] == [{"ok": True}] * 40
    assert merchant_sandbox.exchanges()["ok"] == before + 1
    assert merchant_sandbox.calls()["unauthorized"] >= 1  # the storm did meet the revoked token
    assert fleet.store().records.counters().get("renewals:forced:ok", 0) == 1


# -- 4. two beats --------------------------------------------------------------------------


def test_two_beats_at_once_do_not_double_the_token_exchanges(
    fleet: Fleet, merchant_sandbox: MerchantSandbox
) -> None:
    _quick_windows(fleet)
    fleet.start_worker("w", concurrency=2)
    fleet.start_beat("b1")
    fleet.start_beat("b2")
    started = _before_the_first_exchange(merchant_sandbox)

    time.sleep(2 * QUICK_LIFETIME)  # about four exchanges, eight if the beats doubled them
    exchanges, counters = _settled_exchanges(fleet, merchant_sandbox)
    run = time.monotonic() - started  # every exchange counted happened inside this span

    # consecutive renewals are at least lifetime - renew_before apart, whoever asks
    spacing = QUICK_LIFETIME - QUICK_RENEW_BEFORE
    assert exchanges <= math.ceil(run / spacing) + 1, (exchanges, run)
    assert exchanges >= 2
    assert counters.get("renewals:scheduled:ok", 0) == exchanges, counters
    assert merchant_sandbox.exchanges()["rejected"] == 0


# -- 4b. several accounts: one renewal task each --------------------------------------------


def test_beat_renews_each_account_in_its_own_task_and_a_failing_account_delays_no_other(
    fleet: Fleet, merchant_sandbox: MerchantSandbox, tmp_path: Path, merchant_secret_file: Path
) -> None:
    refused_key = "a-key-the-api-does-not-know"
    accounts_file = tmp_path / "accounts.toml"
    accounts_file.write_text(
        f'[accounts.refused]\napi_key = "{refused_key}"\n'
        f'api_secret_file = "{merchant_secret_file}"\nbase_url = "{merchant_sandbox.url}"\n'
    )
    _quick_windows(fleet)
    fleet.env["MERCHANT_ACCOUNTS_FILE"] = str(accounts_file)  # beside "default"
    fleet.start_worker("w", concurrency=2)
    fleet.start_beat("b")
    default = fleet.store()
    wait_until(lambda: default.generation() >= 3, "two scheduled renewals of 'default'", 60.0)

    worker_log = fleet.logs()["worker-w.log"]
    assert "merchant_tasks.renew_account" in worker_log
    assert "scheduled token renewal of account refused failed" in worker_log
    refused = TokenStore(
        default.redis,
        TokenStore.namespace_for(fleet.key_prefix, "sandbox", refused_key),
    )
    assert refused.generation() == 0
    assert refused.records.counters().get("renewals:scheduled:rejected", 0) >= 1
    counters = default.records.counters()
    assert counters.get("renewals:scheduled:ok", 0) >= 2, counters
    assert counters.get("renewals:mandatory:ok", 0) == 0, counters


# -- 5. beat down --------------------------------------------------------------------------


def test_with_beat_down_workers_renew_in_the_mandatory_window(
    fleet: Fleet, merchant_sandbox: MerchantSandbox
) -> None:
    # no beat: renew_before decides nothing; each token enters the mandatory window 2 s old
    lifetime, mandatory = 3.0, 1.0
    fleet.windows(lifetime, 2.0, mandatory, RENEW_INTERVAL)
    started = time.monotonic()
    fleet.start_worker("w", concurrency=2)
    fleet.wait_ready()

    results = fleet.send_calls_for(2 * lifetime)  # a span in which no renewal is extra
    fleet.expect_all_ok(results)
    exchanges = merchant_sandbox.exchanges()["ok"]
    run = time.monotonic() - started

    counters = fleet.store().records.counters()
    assert counters.get("renewals:mandatory:ok", 0) >= 2, counters
    assert counters.get("renewals:mandatory:ok", 0) == exchanges, counters
    assert exchanges <= math.ceil(run / (lifetime - mandatory)) + 1, (exchanges, run)
    assert merchant_sandbox.calls()["unauthorized"] == 0


# -- 6. worker loss ------------------------------------------------------------------------


def test_a_worker_killed_mid_task_has_its_call_rerun_by_another_worker(
    fleet: Fleet, merchant_sandbox: MerchantSandbox
) -> None:
    fleet.long_windows()
    config_dir = fleet.short_visibility_dir(KILL_VISIBILITY_TIMEOUT)
    workers = {
        label: fleet.start_worker(label, concurrency=1, cwd=config_dir) for label in ("a", "b")
    }
    fleet.wait_ready()
    fleet.wait_for_nodes(2)  # both workers consume (and answer remote control)
    merchant_sandbox.app.configure({"api_latency": API_LATENCY})

    result = fleet.call("POST", ECHO, json={"order": "kill-me"})
    survivor = kill_the_worker_running(fleet, workers, result)
    # the re-run comes after the visibility timeout and must end within the next: no latency
    merchant_sandbox.app.configure({"api_latency": 0.0})

    assert fleet.get(result, 60.0) == {"echo": {"order": "kill-me"}}
    assert result.id in workers[survivor].log_text()
    assert echo_calls(merchant_sandbox) == 2  # received by the killed worker's child, then again


def test_a_pool_child_killed_mid_task_has_its_call_requeued_at_once(
    fleet: Fleet, merchant_sandbox: MerchantSandbox
) -> None:
    # package defaults: the visibility timeout is an hour, so only the requeue can save it
    fleet.long_windows()
    worker = fleet.start_worker("w", concurrency=1)
    fleet.wait_ready()
    merchant_sandbox.app.configure({"api_latency": API_LATENCY})

    result = fleet.call("POST", ECHO, json={"order": "kill-my-child"})
    _, child_pid = running_on(fleet, result)
    assert child_pid != worker.process.pid
    wait_until(lambda: merchant_sandbox.app.arrived(ECHO) == 1, "the call reaching the API", 20.0)
    os.kill(child_pid, signal.SIGKILL)
    merchant_sandbox.app.configure({"api_latency": 0.0})  # the call run again answers at once

    assert fleet.get(result, 60.0) == {"echo": {"order": "kill-my-child"}}
    assert worker.process.poll() is None  # the worker itself lived on
    # received by the killed child (the API still sleeping its latency), then again
    assert merchant_sandbox.app.arrived(ECHO) == 2


# -- 7. no secret, no token outside the token key -------------------------------------------


def test_the_secret_and_tokens_appear_nowhere_in_broker_results_or_logs(
    fleet: Fleet, merchant_sandbox: MerchantSandbox, merchant_key_prefix: str
) -> None:
    _quick_windows(fleet)
    fleet.env["MERCHANT_REJECTED_RETRY_WINDOW"] = "0"  # fail at once, no slow retries
    monitor = fleet.start_monitor()  # first, so it sees every command of the run
    fleet.start_worker("w", concurrency=2)
    fleet.start_beat("b")
    fleet.wait_ready()
    store = fleet.store()
    results = []

    canary = f"canary-{uuid.uuid4().hex}"  # must be found: the search sees what tasks carry
    ok = [fleet.call("GET", PING) for _ in range(4)]
    ok += [fleet.call("POST", ECHO, json={"n": n, "note": canary}) for n in range(4)]
    assert [fleet.get(r) for r in ok] == [{"ok": True}] * 4 + [
        {"echo": {"n": n, "note": canary}} for n in range(4)
    ]
    results += ok

    # every worker process meets a 401 and recovers through a forced renewal. Beat renews every
    # 1.5 s here: a scheduled renewal landing between the revoke-all and the first call spares
    # the calls the 401, and one landing between a 401 and its forced renewal replaces the
    # refused token first (the call then simply uses it); try again until the forced path ran
    for _ in range(6):
        merchant_sandbox.app.revoke_all()
        recovered = [fleet.call("GET", PING) for _ in range(8)]
        assert [fleet.get(r) for r in recovered] == [{"ok": True}] * 8
        results += recovered
        if store.records.counters().get("renewals:forced:ok", 0) >= 1:
            break
    assert merchant_sandbox.calls()["unauthorized"] >= 1
    assert store.records.counters().get("renewals:forced:ok", 0) >= 1

    missing = fleet.call("GET", "/open-api/v1/payments/pay_does_not_exist")
    assert isinstance(missing.get(timeout=RESULT_TIMEOUT, propagate=False), ApiError)
    assert "404" in str(missing.result)
    results.append(missing)

    # a token renewed after a 401 that gets 401 again means TokenRejected; wait until beat
    # has replaced the forced token so the reset secret shows as rejected credentials
    def renewed_by_beat() -> bool:
        token = store.load()
        return token is not None and token.reason == "scheduled"

    wait_until(renewed_by_beat, "a scheduled renewal after the storm", 3 * QUICK_LIFETIME)
    new_secret = merchant_sandbox.app.reset_secret()
    refused = fleet.call("GET", PING)
    outcome = refused.get(timeout=RESULT_TIMEOUT, propagate=False)
    assert isinstance(outcome, CredentialsRejected), repr(outcome)
    results.append(refused)

    texts: dict[str, bytes] = {}
    for result in results:
        texts[f"result {result.id}"] = "\n".join(
            [result.state, repr(result.result), str(result.result), str(result.traceback)]
        ).encode()
    fleet.stop()  # logs complete and flushed, monitor stopped; Redis still up
    logs = fleet.logs()
    for name in ("worker-w.log", "beat-b.log"):
        assert "DEBUG" in logs[name], f"{name} has no DEBUG lines"
    assert "renew" in logs["worker-w.log"]
    for name, text in logs.items():
        if name == monitor.log.name:
            continue
        texts[name] = text.encode()
    token_key = store.keys.token
    lines = monitor.log_text().splitlines()
    assert len(lines) > 100, "the monitor saw almost nothing"
    # the one place a token may be: commands writing or reading the token key
    texts["redis MONITOR"] = "\n".join(line for line in lines if token_key not in line).encode()
    for key in store.redis.scan_iter(count=1000):
        if key != token_key.encode():
            texts[f"redis key {key!r}"] = redis_value(store.redis, key)
    assert any("celery-task-meta-" in key for key in texts)
    assert any(key.startswith(f"redis key b'{merchant_key_prefix}:") for key in texts)

    # positive controls: a value sent as a task argument shows in the message bodies
    # (base64 on the broker) and in the stored results
    assert shows(canary, texts["redis MONITOR"])
    assert shows(canary, base64.b64encode(f'{{"note": "{canary}"}}'.encode()))
    assert any(shows(canary, text) for key, text in texts.items() if "celery-task-meta" in key)

    tokens = merchant_sandbox.app.issued_tokens()
    assert len(tokens) >= 3  # first, after revoke-all, and beat's
    needles = {"the secret": TEST_SECRET, "the new secret": new_secret}
    needles.update({f"token #{n}": token for n, token in enumerate(tokens)})
    leaks = [
        f"{what} in {where}"
        for what, needle in needles.items()
        for where, text in texts.items()
        if shows(needle, text)
    ]
    assert not leaks, leaks


# -- routing and errors across the broker --------------------------------------------------


def _all_done(fleet: Fleet) -> bool:
    """No message waits in either queue, awaits its late acknowledgement, or runs."""
    client = fleet.store().redis
    queues = (fleet.broker_key(CALLS_QUEUE), fleet.broker_key(RENEWAL_QUEUE))
    if any(client.llen(q) for q in queues) or client.hlen(fleet.broker_key("unacked")):
        return False
    inspect = fleet.app.control.inspect(timeout=1.0)
    active, reserved = inspect.active(), inspect.reserved()
    if not active or not reserved:  # no answer from the worker yet
        return False
    return not any([*active.values(), *reserved.values()])


def test_a_call_sent_to_exchange_celery_with_routing_key_celery_runs_exactly_once(
    fleet: Fleet, merchant_sandbox: MerchantSandbox
) -> None:
    fleet.long_windows()
    # a broker that served an older release still binds the renewal queue to celery/celery
    with fleet.app.connection_for_write() as connection:
        old = Queue(RENEWAL_QUEUE, Exchange(CALLS_QUEUE), routing_key=CALLS_QUEUE)
        old.bind(connection.default_channel).declare()
    fleet.start_worker("w", concurrency=2)
    fleet.wait_ready()

    sent = fleet.app.send_task(
        CALL_API,
        args=["POST", ECHO],
        kwargs={"json": {"n": 1}},
        exchange=CALLS_QUEUE,
        routing_key=CALLS_QUEUE,
    )
    assert fleet.get(sent) == {"echo": {"n": 1}}
    # a second copy would be waiting in a queue, or running (acknowledged only after it ran)
    wait_until(lambda: _all_done(fleet), "queues empty and the worker idle", RESULT_TIMEOUT)
    assert echo_calls(merchant_sandbox) == 1


def test_an_api_error_comes_back_from_a_real_worker_with_status_code_and_excerpt(
    fleet: Fleet, merchant_sandbox: MerchantSandbox
) -> None:
    fleet.long_windows()
    fleet.start_worker("w", concurrency=1)
    fleet.wait_ready()
    missing = fleet.call("GET", "/open-api/v1/payments/pay_does_not_exist")
    error = missing.get(timeout=RESULT_TIMEOUT, propagate=False)
    assert type(error) is ApiError, repr(error)
    assert (error.status, error.code) == (404, "not_found")
    assert "no such payment" in error.excerpt
    assert "404" in str(error)


def test_rejected_credentials_come_back_from_a_real_worker_with_status_and_code(
    fleet: Fleet, merchant_sandbox: MerchantSandbox
) -> None:
    fleet.long_windows()
    fleet.env["MERCHANT_REJECTED_RETRY_WINDOW"] = "0"  # fail at once, no slow retries
    merchant_sandbox.app.reset_secret()
    fleet.start_worker("w", concurrency=1)
    error = fleet.call("GET", PING).get(timeout=READY_TIMEOUT, propagate=False)
    assert type(error) is CredentialsRejected, repr(error)
    assert error.status is not None
    assert 400 <= error.status < 500
    assert error.code
    assert "MERCHANT_API_SECRET" in str(error)


def test_a_worker_given_the_redis_url_as_a_file_uses_it_for_broker_and_results(
    fleet: Fleet, merchant_sandbox: MerchantSandbox, tmp_path: Path
) -> None:
    fleet.long_windows()
    url_file = tmp_path / "redis-url"
    url_file.write_text(fleet.redis_url + "\n")
    del fleet.env["MERCHANT_REDIS_URL"]
    fleet.env["MERCHANT_REDIS_URL_FILE"] = str(url_file)
    fleet.start_worker("w", concurrency=1)
    fleet.wait_ready()  # the test's app sends to the private Redis and reads results there
    assert merchant_sandbox.calls()["ok"] == 1
