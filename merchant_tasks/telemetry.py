"""OpenTelemetry traces and metrics (the ``otel`` extra): one call's story, across processes.

Spans (docs/tracing.md draws a trace):

- ``merchant_tasks.request``: one per client call, a child of the current span (the Celery
  task's when the Celery instrumentation is on);
- ``merchant_tasks.renewal``: one per renewal this process runs or waits for, a child of
  the request that needed it (or of beat's task);
- ``merchant_tasks.exchange``: one per HTTP attempt at the token endpoint, a child of the
  renewal.

The renewer stores its renewal span's context (a W3C ``traceparent``, never the token)
beside the token it saves (``Token.traceparent``), so a call that gets that token after a
401 links its request span to the renewal that fixed it, in whatever process it ran. When
the renewal ran under the request itself it is already the request's child: no link.

Without the OpenTelemetry API installed, or while the application has configured no SDK
(the API's proxy providers), every function here returns a shared no-op: the hot path
pays one global read. Nothing here puts a token, a secret or a header into telemetry:
attributes are methods, paths without query, host names, counts and outcomes, and an
error is recorded by its type only (its message may quote an error body).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

from merchant_tasks.extras import package_version

try:
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
    from opentelemetry.metrics import _internal as _metrics_state
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed
    _trace = None  # type: ignore[assignment]
    _metrics = None  # type: ignore[assignment]
    _metrics_state = None  # type: ignore[assignment]

# The API keeps each global provider in a module variable, None until the application sets
# one: reading it is the hot path's one global read (``get_tracer_provider()`` also looks
# up an environment variable, each call). A provider named by that variable, or an API
# without the module variable, takes the public way.
_TRACER_BY_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
_METER_BY_ENV = "OTEL_PYTHON_METER_PROVIDER" in os.environ

SCOPE = "merchant_tasks"  # the instrumentation scope every span and instrument belongs to
REQUEST_SPAN = "merchant_tasks.request"
RENEWAL_SPAN = "merchant_tasks.renewal"
EXCHANGE_SPAN = "merchant_tasks.exchange"

# attribute names: OpenTelemetry's semantic conventions where one exists, ours otherwise
ACCOUNT = "merchant_tasks.account"
ATTEMPTS = "merchant_tasks.attempts"
UNAUTHORIZED = "merchant_tasks.unauthorized"
REASON = "merchant_tasks.renewal.reason"
OUTCOME = "merchant_tasks.renewal.outcome"
WAITED = "merchant_tasks.renewal.waited"
GENERATION_BEFORE = "merchant_tasks.generation.before"
GENERATION_AFTER = "merchant_tasks.generation.after"
BREAKER_KIND = "merchant_tasks.breaker.kind"
CALL_OUTCOME = "merchant_tasks.call.outcome"
HTTP_METHOD = "http.request.method"
HTTP_STATUS = "http.response.status_code"
SERVER_ADDRESS = "server.address"
URL_PATH = "url.path"
ERROR_TYPE = "error.type"

AttributeValue = str | bool | int | float
T = TypeVar("T")

log = logging.getLogger(__name__)


class Recorder(Protocol):
    """What instrumented code may do with its span; the no-op does nothing."""

    def __enter__(self) -> Recorder: ...

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...

    def set(self, key: str, value: AttributeValue) -> None: ...

    def count(self, key: str) -> None:
        """Add one to the integer attribute ``key`` (attempts, 401s met)."""


class _NoSpan:
    """The span of a process that traces nothing: every method is a no-op."""

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def set(self, key: str, value: AttributeValue) -> None:
        pass

    def count(self, key: str) -> None:
        pass


NO_SPAN = _NoSpan()

# the request and the renewal span current in this thread (or task), if any is recorded
_REQUEST: ContextVar[_Span | None] = ContextVar("merchant_tasks_request", default=None)
_RENEWAL: ContextVar[_Span | None] = ContextVar("merchant_tasks_renewal", default=None)


class _Span:
    """A live span, current while its ``with`` block runs."""

    def __init__(
        self,
        tracer: Any,
        name: str,
        kind: Any,
        attributes: Mapping[str, AttributeValue],
        role: ContextVar[_Span | None] | None,
    ) -> None:
        # exceptions are recorded by type only (``__exit__``): their messages stay out
        self._manager = tracer.start_as_current_span(
            name,
            kind=kind,
            attributes=dict(attributes),
            record_exception=False,
            set_status_on_exception=False,
        )
        self._role = role
        self._span: Any = None
        self._counts: dict[str, int] = {}
        self._related: set[str] = set()  # traceparents linked, or of renewals run under it

    def __enter__(self) -> _Span:
        self._span = self._manager.__enter__()
        self._reset = self._role.set(self) if self._role is not None else None
        request = _REQUEST.get()
        if self._role is _RENEWAL and request is not None:
            request._related.add(self.traceparent())  # its child: never linked too
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._role is not None and self._reset is not None:
            self._role.reset(self._reset)
        if error is not None:
            self._span.set_attribute(ERROR_TYPE, type(error).__name__)
            self._span.set_status(_trace.Status(_trace.StatusCode.ERROR, type(error).__name__))
        self._manager.__exit__(kind, error, traceback)

    def set(self, key: str, value: AttributeValue) -> None:
        self._span.set_attribute(key, value)

    def count(self, key: str) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1
        self._span.set_attribute(key, self._counts[key])

    def link(self, traceparent: str) -> None:
        """Link to the span ``traceparent`` names (a renewal another thread or process ran)."""
        if not traceparent or traceparent in self._related:
            return
        context = _remote_context(traceparent)
        if context is not None:
            self._related.add(traceparent)
            self._span.add_link(context)

    def recording(self) -> bool:
        return bool(self._span.is_recording())

    def traceparent(self) -> str:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(
            carrier, context=_trace.set_span_in_context(self._span)
        )
        return carrier.get("traceparent", "")


def request_span(method: str, path: str, account: str) -> Recorder:
    """The span of one client call (``path`` without its query)."""
    tracer = _tracer()
    if tracer is None:
        return NO_SPAN
    attributes = {HTTP_METHOD: method, URL_PATH: path.split("?", 1)[0], ACCOUNT: account}
    return _Span(tracer, REQUEST_SPAN, _trace.SpanKind.CLIENT, attributes, _REQUEST)


def renewal_span(reason: str, account: str) -> Recorder:
    """The span of one renewal this process runs or waits for."""
    tracer = _tracer()
    if tracer is None:
        return NO_SPAN
    attributes = {REASON: reason, ACCOUNT: account}
    return _Span(tracer, RENEWAL_SPAN, _trace.SpanKind.INTERNAL, attributes, _RENEWAL)


def exchange_span(server: str) -> Recorder:
    """The span of one HTTP attempt at the token endpoint on host ``server``."""
    tracer = _tracer()
    if tracer is None:
        return NO_SPAN
    attributes = {HTTP_METHOD: "POST", SERVER_ADDRESS: server}
    return _Span(tracer, EXCHANGE_SPAN, _trace.SpanKind.CLIENT, attributes, None)


def link_renewal(traceparent: str) -> None:
    """Link the current request's span to the renewal ``traceparent`` names, unless that
    renewal ran under it (then it is its child)."""
    request = _REQUEST.get()
    if request is not None:
        request.link(traceparent)


def renewal_traceparent() -> str:
    """The current renewal span's ``traceparent``, stored with the token it makes ("" when
    nothing is traced, or the sampler dropped it: no link could lead anywhere)."""
    renewal = _RENEWAL.get()
    return renewal.traceparent() if renewal is not None and renewal.recording() else ""


class _Provided(Generic[T]):
    """What this scope makes of a global provider (its tracer, its instruments), made once
    per provider; None when nothing records: the otel extra missing, no provider set (the
    API's ``state.slot`` is None and no environment variable names one), or the API's
    no-op or proxy (``provider`` returns None)."""

    def __init__(
        self,
        state: Any,
        slot: str,
        by_env: bool,
        provider: Callable[[], Any],
        make: Callable[[Any], T],
    ) -> None:
        self._state, self._slot, self._by_env = state, slot, by_env
        self._provider, self._make = provider, make
        self._cached: tuple[object, T] | None = None

    def __call__(self) -> T | None:
        if self._state is None:
            return None
        if getattr(self._state, self._slot, True) is None and not self._by_env:
            return None
        provider = self._provider()
        if provider is None:
            return None
        cached = self._cached
        if cached is None or cached[0] is not provider:
            cached = self._cached = (provider, self._make(provider))
        return cached[1]


def _tracer_provider() -> Any:
    provider = _trace.get_tracer_provider()
    if isinstance(provider, _trace.ProxyTracerProvider | _trace.NoOpTracerProvider):
        return None
    return provider


_tracer: _Provided[Any] = _Provided(
    _trace,
    "_TRACER_PROVIDER",
    _TRACER_BY_ENV,
    _tracer_provider,
    lambda provider: provider.get_tracer(SCOPE, package_version()),
)


def _remote_context(traceparent: str) -> Any:
    """The span context a ``traceparent`` names, or None if it does not parse."""
    context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    span_context = _trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


# -- metrics: the same instruments as the Prometheus exporter (ops.metrics) ----------------


# the meter's instruments: (attribute, kind, name, unit, description)
_INSTRUMENTS = (
    (
        "renewals",
        "counter",
        "merchant_tasks.renewals",
        "{renewal}",
        "Renewals by reason and outcome: one each, however many HTTP attempts.",
    ),
    (
        "exchange_attempts",
        "counter",
        "merchant_tasks.exchange.attempts",
        "{attempt}",
        "HTTP requests to the token endpoint, by the renewal's reason and their outcome.",
    ),
    (
        "exchange_duration",
        "histogram",
        "merchant_tasks.exchange.duration",
        "s",
        "Seconds one token exchange attempt took, any outcome.",
    ),
    (
        "lock_wait_duration",
        "histogram",
        "merchant_tasks.lock_wait.duration",
        "s",
        "Seconds from a caller finding another's renewal under way to a token being stored; "
        "recorded by the process whose write stored it.",
    ),
    (
        "breaker_openings",
        "counter",
        "merchant_tasks.breaker.openings",
        "{opening}",
        "Times exchanges were paused, by kind.",
    ),
    (
        "calls",
        "counter",
        "merchant_tasks.calls",
        "{call}",
        "Client calls by outcome (ok, or the error's type).",
    ),
)


class _Instruments:
    """The meter's instruments, made once per meter provider."""

    renewals: Any
    exchange_attempts: Any
    exchange_duration: Any
    lock_wait_duration: Any
    breaker_openings: Any
    calls: Any

    def __init__(self, meter: Any) -> None:
        make = {"counter": meter.create_counter, "histogram": meter.create_histogram}
        for attribute, kind, name, unit, description in _INSTRUMENTS:
            setattr(self, attribute, make[kind](name, unit=unit, description=description))
        self.breaker_open = meter.create_observable_gauge(
            "merchant_tasks.breaker.open",
            callbacks=[_observe_breakers],
            unit="1",
            description="1 while token exchanges are paused, by kind; read from Redis at "
            "each collection, the fleet's state (the same in every process).",
        )


# the breaker gauge's readings by account: the store (held weakly) and how to read it
_breakers: dict[str, tuple[weakref.ref[Any], Callable[[Any], Iterable[tuple[str, int]]]]] = {}


def _meter_provider() -> Any:
    provider = _metrics.get_meter_provider()
    # the API's proxy (no SDK set yet) is private: told apart by its class name
    if isinstance(provider, _metrics.NoOpMeterProvider) or type(provider).__name__ == (
        "_ProxyMeterProvider"
    ):
        return None
    return provider


_instruments: _Provided[_Instruments] = _Provided(
    _metrics_state,
    "_METER_PROVIDER",
    _METER_BY_ENV,
    _meter_provider,
    lambda provider: _Instruments(provider.get_meter(SCOPE, package_version())),
)


def count_renewal(account: str, reason: str, outcome: str) -> None:
    """One renewal ended with ``outcome``: counted, and told to its span."""
    renewal = _RENEWAL.get()
    if renewal is not None:
        renewal.set(OUTCOME, outcome)
    _measure(lambda i: i.renewals.add(1, {ACCOUNT: account, REASON: reason, OUTCOME: outcome}))


def count_exchange_attempt(account: str, reason: str, outcome: str) -> None:
    attributes = {ACCOUNT: account, REASON: reason, OUTCOME: outcome}
    _measure(lambda i: i.exchange_attempts.add(1, attributes))


def observe_exchange(account: str, seconds: float) -> None:
    _measure(lambda i: i.exchange_duration.record(seconds, {ACCOUNT: account}))


def observe_lock_wait(account: str, seconds: float) -> None:
    _measure(lambda i: i.lock_wait_duration.record(seconds, {ACCOUNT: account}))


def watch_breaker(account: str, store: T, read: Callable[[T], Iterable[tuple[str, int]]]) -> None:
    """Report ``account``'s breaker on the ``merchant_tasks.breaker.open`` gauge: at each
    collection, ``read(store)`` gives each kind with its value (1 paused, 0 not). The store is
    held weakly, so a client dropped leaves the gauge; the last one watched per account
    is the one read."""
    _breakers[account] = (weakref.ref(store), read)
    _instruments()  # the gauge is read from now on, even before anything is measured


def count_breaker_opening(account: str, kind: str) -> None:
    _measure(lambda i: i.breaker_openings.add(1, {ACCOUNT: account, BREAKER_KIND: kind}))


def count_call(account: str, outcome: str) -> None:
    _measure(lambda i: i.calls.add(1, {ACCOUNT: account, CALL_OUTCOME: outcome}))


def _observe_breakers(_: Any) -> Iterator[Any]:
    """The breaker gauge's callback: every watched account's reading, as observations."""
    for account, (store_ref, read) in list(_breakers.items()):
        store = store_ref()
        if store is None:  # its client is gone; a new one of the account replaces the entry
            continue
        try:
            states = list(read(store))
        except Exception as exc:  # Redis down: leave this account out of this collection
            # rather than raise into the SDK, which would drop every account's reading
            log.warning("could not read %s's breaker for the meter: %s", account, exc)
            continue
        for kind, value in states:
            yield _metrics.Observation(value, {ACCOUNT: account, BREAKER_KIND: kind})


def _measure(record: Callable[[_Instruments], None]) -> None:
    """Run ``record`` with the instruments, if anything records."""
    instruments = _instruments()
    if instruments is not None:
        record(instruments)
