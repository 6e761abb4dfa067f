"""Traces and meters (``telemetry``) through the OpenTelemetry SDK's in-memory exporter and
reader, against the emulator and a real Redis; and one trace end to end through a real
worker with the Celery instrumentation.

The SDK's global providers can be set once per process: ``sdk`` sets them once for the
session (other tests in the process are traced too, which changes nothing they see); the
test of a process without an SDK runs in a subprocess. Every test's exported spans are
searched for the secret, every token the emulator issued and any Authorization header.
"""

from __future__ import annotations

import gc
import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import redis
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import StatusCode

from merchant_tasks.accounts import FleetClient, client_for
from merchant_tasks.exceptions import CredentialsRejected
from merchant_tasks.flows import Flow
from merchant_tasks.sandbox.fixtures import MerchantSandbox
from merchant_tasks.sandbox.processes import wait_until
from merchant_tasks.settings import Secret, Settings
from merchant_tasks.store.token_store import BreakerRecord
from merchant_tasks.telemetry import (
    ACCOUNT,
    ATTEMPTS,
    BREAKER_KIND,
    CALL_OUTCOME,
    ERROR_TYPE,
    EXCHANGE_SPAN,
    GENERATION_AFTER,
    GENERATION_BEFORE,
    HTTP_METHOD,
    HTTP_STATUS,
    OUTCOME,
    REASON,
    RENEWAL_SPAN,
    REQUEST_SPAN,
    SERVER_ADDRESS,
    UNAUTHORIZED,
    URL_PATH,
    WAITED,
)
from merchant_tasks.token import BreakerKind, CounterName, IssuedToken, Token
from support.account import TEST_SECRET
from support.at_once import at_once
from support.celery_fleet import CALL_API, READY_TIMEOUT, Fleet
from support.programs import run_python
from support.redis_conditions import dead_redis
from support.routes import PING
from support.traced_worker import SPANS_FILE

pytestmark = pytest.mark.integration

THREADS = 8
LOCK_WAIT_DURATION = "merchant_tasks.lock_wait.duration"
BREAKER_OPEN = "merchant_tasks.breaker.open"
WRONG_SECRET = "wrong-secret-9d2e51c0"  # searched for too
Attributes = frozenset[tuple[str, Any]]


@dataclass
class Telemetry:
    """The session's span exporter and metric reader."""

    exporter: InMemorySpanExporter
    reader: InMemoryMetricReader

    def spans(self, name: str) -> list[ReadableSpan]:
        """This test's finished spans called ``name``, in the order they ended."""
        return [span for span in self.exporter.get_finished_spans() if span.name == name]

    def points(self, metric: str, account: str) -> dict[Attributes, Any]:
        """``metric``'s data points of ``account``: each attribute set (without the account)
        to its value (a histogram's: its count)."""
        found: dict[Attributes, Any] = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for each in scope.metrics:
                    if each.name != metric:
                        continue
                    for point in each.data.data_points:
                        attributes = dict(point.attributes or {})
                        if attributes.pop(ACCOUNT, None) == account:
                            value = getattr(point, "value", None)
                            found[frozenset(attributes.items())] = (
                                point.count if value is None else value  # type: ignore[union-attr]
                            )
        return found


class Switch(Sampler):
    """Samples while ``on``: this module's tests trace, the tests that share its process do
    not (a token of theirs carries no ``traceparent``, as without the SDK)."""

    on = False

    def should_sample(
        self,
        parent_context: Any,
        trace_id: int,
        name: str,
        kind: Any = None,
        attributes: Any = None,
        links: Any = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        # the span starts with the attributes the sampler hands back
        decision = Decision.RECORD_AND_SAMPLE if self.on else Decision.DROP
        return SamplingResult(decision, attributes if self.on else None)

    def get_description(self) -> str:
        return "Switch"


SWITCH = Switch()


@pytest.fixture(scope="session")
def sdk() -> Telemetry:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=SWITCH)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    return Telemetry(exporter, reader)


@pytest.fixture
def traced(sdk: Telemetry, merchant_sandbox: MerchantSandbox) -> Iterator[Telemetry]:
    """The SDK, its spans cleared; afterwards, its spans searched for secrets."""
    sdk.exporter.clear()
    SWITCH.on = True
    yield sdk
    SWITCH.on = False
    exported = [span.to_json() for span in sdk.exporter.get_finished_spans()]
    assert_no_secret_in("\n".join(exported), merchant_sandbox)


def assert_no_secret_in(text: str, merchant_sandbox: MerchantSandbox) -> None:
    for secret in (TEST_SECRET, WRONG_SECRET, *merchant_sandbox.app.issued_tokens()):
        assert secret not in text
    assert "bearer" not in text.lower()
    assert "authorization" not in text.lower()


def linked_to(span: ReadableSpan) -> list[int]:
    """The span ids ``span`` links to."""
    return [link.context.span_id for link in span.links]


def traceparent_of(span: ReadableSpan) -> str:
    context = span.context
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def test_a_revoke_all_under_8_threads_makes_one_renewal_every_request_reaches(
    traced: Telemetry,
    merchant_settings: Settings,
    redis_client: redis.Redis,
    merchant_sandbox: MerchantSandbox,
) -> None:
    client = client_for(merchant_settings, redis_client=redis_client, name="storm")
    client.request("GET", PING)
    merchant_sandbox.app.revoke_all()
    traced.exporter.clear()
    # the exchange waits until every thread has met the refused token (a 401, or a sibling
    # renewing it), so that no thread can start late with the new token
    refused = threading.Semaphore(0)
    replacement = client.manager.life._replacement
    exchange = client.manager.exchange

    def counted(stale: Token, route: str, new_401: bool) -> Flow[Token]:
        refused.release()
        return replacement(stale, route, new_401)

    def after_every_refusal() -> IssuedToken:
        for _ in range(THREADS):
            assert refused.acquire(timeout=60)
        return exchange()

    client.manager.life._replacement = counted  # type: ignore[method-assign]
    client.manager.exchange = after_every_refusal
    results = at_once(THREADS, lambda _: client.request("GET", PING))
    assert results == [{"ok": True}] * THREADS
    assert merchant_sandbox.exchanges()["ok"] == 2  # the first token, then one for the storm
    (renewal,) = traced.spans(RENEWAL_SPAN)
    (exchanged,) = traced.spans(EXCHANGE_SPAN)
    requests = traced.spans(REQUEST_SPAN)
    assert len(requests) == THREADS
    assert renewal.parent is not None
    assert exchanged.parent is not None
    assert exchanged.parent.span_id == renewal.context.span_id
    parent = [r for r in requests if r.context.span_id == renewal.parent.span_id]
    linked = [r for r in requests if linked_to(r) == [renewal.context.span_id]]
    assert len(parent) == 1
    assert len(linked) == THREADS - 1
    assert parent[0].attributes is not None
    assert parent[0].attributes[UNAUTHORIZED] == 1
    assert dict(renewal.attributes or {}) == {
        REASON: "forced",
        ACCOUNT: "storm",
        GENERATION_BEFORE: 1,
        GENERATION_AFTER: 2,
        WAITED: False,
        OUTCOME: "ok",
    }
    assert dict(exchanged.attributes or {}) == {
        HTTP_METHOD: "POST",
        SERVER_ADDRESS: "127.0.0.1",
        HTTP_STATUS: 200,
    }
    for request in requests:
        attributes = dict(request.attributes or {})
        assert attributes[HTTP_METHOD] == "GET"
        assert attributes[URL_PATH] == PING
        assert attributes[HTTP_STATUS] == 200
        # sent once and refused, then again; or held back while a sibling renewed
        assert (attributes[ATTEMPTS], attributes.get(UNAUTHORIZED, 0)) in {(2, 1), (1, 0)}
    # the meter: the same counts as the store's counters, per account
    ok = "ok"
    assert traced.points("merchant_tasks.renewals", "storm") == {
        frozenset({(REASON, "mandatory"), (OUTCOME, ok)}): 1,
        frozenset({(REASON, "forced"), (OUTCOME, ok)}): 1,
    }
    assert traced.points("merchant_tasks.exchange.attempts", "storm") == {
        frozenset({(REASON, "mandatory"), (OUTCOME, ok)}): 1,
        frozenset({(REASON, "forced"), (OUTCOME, ok)}): 1,
    }
    assert traced.points("merchant_tasks.exchange.duration", "storm") == {frozenset(): 2}
    assert traced.points("merchant_tasks.calls", "storm") == {
        frozenset({(CALL_OUTCOME, ok)}): THREADS + 1
    }


def two_processes(
    settings: Settings, redis_client: redis.Redis, other_name: str
) -> tuple[FleetClient, FleetClient]:
    """Two clients of one account with their own copies of the token, as two processes have,
    both holding the first token; the second keeps sending its copy (it meets a 401 itself)."""
    renewing = client_for(settings, redis_client=redis_client, name="renewing")
    other = client_for(settings, redis_client=redis_client, name=other_name)
    other.manager.life.copy_ttl = 600.0
    renewing.request("GET", PING)
    other.request("GET", PING)
    return renewing, other


def test_a_refused_request_links_to_the_renewal_another_process_stored(
    traced: Telemetry,
    merchant_settings: Settings,
    redis_client: redis.Redis,
    merchant_sandbox: MerchantSandbox,
) -> None:
    renewing, other = two_processes(merchant_settings, redis_client, "other")
    merchant_sandbox.app.revoke_all()
    traced.exporter.clear()

    renewing.request("GET", PING)  # 401: renews under its request
    other.request("GET", PING)  # 401: finds the token stored by the other one

    (renewal,) = traced.spans(RENEWAL_SPAN)
    first, second = traced.spans(REQUEST_SPAN)
    assert renewal.parent is not None
    assert renewal.parent.span_id == first.context.span_id
    assert first.links == ()
    assert linked_to(second) == [renewal.context.span_id]
    assert dict(second.attributes or {})[UNAUTHORIZED] == 1
    stored = renewing.manager.store.load()
    assert stored is not None
    assert stored.traceparent == traceparent_of(renewal)


def test_a_process_that_waited_for_another_renewal_shows_its_wait_and_links_to_it(
    traced: Telemetry,
    merchant_settings: Settings,
    redis_client: redis.Redis,
    merchant_sandbox: MerchantSandbox,
) -> None:
    renewing, waiting = two_processes(merchant_settings, redis_client, "waiting")
    merchant_sandbox.app.revoke_all()
    traced.exporter.clear()
    store = renewing.manager.store
    exchange = renewing.manager.exchange
    other_waits = threading.Event()

    def once_the_other_waits() -> IssuedToken:
        assert other_waits.wait(timeout=60)
        return exchange()

    renewing.manager.exchange = once_the_other_waits
    waits_before = traced.points(LOCK_WAIT_DURATION, "renewing").get(frozenset(), 0)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(renewing.request, "GET", PING)
        wait_until(lambda: store.lock_holder() is not None, "the renewal lock taken", 30.0)
        second = pool.submit(waiting.request, "GET", PING)
        wait_until(
            lambda: store.records.counters().get(CounterName.LOCK_WAITS, 0) == 1,
            "the other process waiting for the lock",
            30.0,
        )
        other_waits.set()
        assert first.result(timeout=60) == second.result(timeout=60) == {"ok": True}

    ran = next(s for s in traced.spans(RENEWAL_SPAN) if dict(s.attributes or {})[WAITED] is False)
    (waited,) = [s for s in traced.spans(RENEWAL_SPAN) if s is not ran]
    parent = parent_id(waited)
    request = next(s for s in traced.spans(REQUEST_SPAN) if s.context.span_id == parent)
    assert dict(waited.attributes or {}) == {
        REASON: "forced",
        ACCOUNT: "waiting",
        GENERATION_BEFORE: 1,
        GENERATION_AFTER: 2,
        WAITED: True,
        OUTCOME: "ok",
    }
    assert dict(request.attributes or {})[ACCOUNT] == "waiting"
    assert linked_to(request) == [ran.context.span_id]
    assert len(traced.spans(EXCHANGE_SPAN)) == 1
    # the wait is on the meter of the process whose write ended it, as in Redis
    assert traced.points(LOCK_WAIT_DURATION, "renewing") == {frozenset(): waits_before + 1}
    assert traced.points(LOCK_WAIT_DURATION, "waiting") == {}


def parent_id(span: ReadableSpan) -> int:
    assert span.parent is not None
    return span.parent.span_id


def test_refused_credentials_show_on_the_spans_and_meters_by_type_only(
    traced: Telemetry, merchant_settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong-secret"
    wrong.write_text(WRONG_SECRET + "\n")
    settings = replace(merchant_settings, secret=Secret(path=wrong))
    client = client_for(settings, redis_client=redis_client, name="wrong")

    with pytest.raises(CredentialsRejected):
        client.request("GET", PING)

    (request,) = traced.spans(REQUEST_SPAN)
    (renewal,) = traced.spans(RENEWAL_SPAN)
    (exchanged,) = traced.spans(EXCHANGE_SPAN)
    for span in (request, renewal, exchanged):
        assert span.status.status_code == StatusCode.ERROR
        assert span.status.description == "CredentialsRejected"
        assert dict(span.attributes or {})[ERROR_TYPE] == "CredentialsRejected"
        assert not span.events  # no exception event: its message is not exported
    assert dict(renewal.attributes or {})[OUTCOME] == "rejected"
    assert dict(exchanged.attributes or {})[HTTP_STATUS] == 401
    assert traced.points("merchant_tasks.breaker.openings", "wrong") == {
        frozenset({(BREAKER_KIND, "rejected")}): 1
    }
    assert traced.points("merchant_tasks.calls", "wrong") == {
        frozenset({(CALL_OUTCOME, "CredentialsRejected")}): 1
    }
    assert traced.points(BREAKER_OPEN, "wrong") == breaker_gauge(BreakerKind.REJECTED)


def breaker_gauge(open_kind: BreakerKind | None) -> dict[Attributes, int]:
    """The breaker gauge's points of one account whose paused kind is ``open_kind``."""
    return {frozenset({(BREAKER_KIND, kind.value)}): int(kind == open_kind) for kind in BreakerKind}


def test_the_breaker_gauge_reads_each_accounts_redis_and_leaves_out_one_it_cannot_read(
    traced: Telemetry,
    merchant_settings: Settings,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    closed = client_for(merchant_settings, redis_client=redis_client, name="closed")
    unreachable = client_for(merchant_settings, redis_client=dead_redis(), name="unreachable")
    assert traced.points(BREAKER_OPEN, "closed") == breaker_gauge(None)
    assert traced.points(BREAKER_OPEN, "unreachable") == {}
    assert "could not read unreachable's breaker for the meter" in caplog.text
    now = closed.manager.store.time()  # another process's refused pause:
    pause = BreakerRecord(BreakerKind.REFUSED, now + 30.0, 2, "", "refused in a row", 1)
    closed.manager.store.records.open_breaker(pause, now)
    assert traced.points(BREAKER_OPEN, "closed") == breaker_gauge(BreakerKind.REFUSED)
    del closed, unreachable
    gc.collect()
    assert traced.points(BREAKER_OPEN, "closed") == {}  # a client dropped leaves the gauge


NO_OP_CHECK = """
import sys
if sys.argv[1] == "without the API":
    sys.modules["opentelemetry"] = None  # import fails, as without the otel extra
from merchant_tasks import telemetry
assert telemetry.request_span("GET", "/open-api/v1/ping", "a") is telemetry.NO_SPAN
assert telemetry.renewal_span("forced", "a") is telemetry.NO_SPAN
assert telemetry.exchange_span("localhost") is telemetry.NO_SPAN
assert telemetry.renewal_traceparent() == ""
telemetry.count_call("a", "ok")
telemetry.observe_lock_wait("a", 0.5)
telemetry.watch_breaker("a", telemetry, lambda module: [("rejected", 1)])
telemetry.link_renewal("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
print("no-op")
"""


@pytest.mark.parametrize("process", ["without an SDK", "without the API"])
def test_a_process_that_traces_nothing_gets_the_shared_no_op(process: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    run = run_python("-c", NO_OP_CHECK, process, timeout=120, env=env)
    assert run.stdout.strip() == "no-op", run.stderr


def test_one_trace_from_the_enqueue_through_the_worker_to_the_request_and_its_renewal(
    traced: Telemetry, fleet: Fleet, merchant_sandbox: MerchantSandbox, tmp_path: Path
) -> None:
    spans_file = tmp_path / "worker-spans.jsonl"
    fleet.long_windows()
    fleet.load_app("support.traced_worker")
    fleet.env[SPANS_FILE] = str(spans_file)
    fleet.start_worker("traced", concurrency=1)

    def worker_spans() -> dict[str, dict[str, Any]]:
        lines = spans_file.read_text().splitlines() if spans_file.exists() else []
        return {span["name"]: span for span in map(json.loads, lines)}

    instrumentor = CeleryInstrumentor()  # type: ignore[no-untyped-call]
    instrumentor.instrument()
    try:
        call_api = fleet.app.signature(CALL_API)  # the test never imports the tasks
        assert fleet.get(call_api.delay("GET", PING), READY_TIMEOUT) == {"ok": True}
    finally:
        instrumentor.uninstrument()
    # the task's span ends after its result is stored
    wait_until(lambda: f"run/{CALL_API}" in worker_spans(), "the task's span", 30.0)

    (enqueued,) = traced.spans(f"apply_async/{CALL_API}")
    spans = worker_spans()
    run, request = spans[f"run/{CALL_API}"], spans[REQUEST_SPAN]
    renewal, exchanged = spans[RENEWAL_SPAN], spans[EXCHANGE_SPAN]
    trace_id = f"0x{enqueued.context.trace_id:032x}"
    assert {span["context"]["trace_id"] for span in spans.values()} == {trace_id}
    assert run["parent_id"] == f"0x{enqueued.context.span_id:016x}"
    assert request["parent_id"] == run["context"]["span_id"]
    assert renewal["parent_id"] == request["context"]["span_id"]
    assert exchanged["parent_id"] == renewal["context"]["span_id"]
    assert request["attributes"][HTTP_STATUS] == 200
    assert renewal["attributes"][REASON] == "mandatory"
    assert renewal["attributes"][OUTCOME] == "ok"
    assert_no_secret_in(spans_file.read_text(), merchant_sandbox)
