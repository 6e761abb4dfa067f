"""OpenTelemetry traces and metrics (the ``otel`` extra): one call's story, across processes.

Spans (docs/tracing.md draws a trace):

- ``merchant_tasks.request``: one per client call, a child of the current span (the Celery
  task's when the Celery instrumentation is on);
- ``merchant_tasks.renewal``: one per renewal this process runs or waits for, a child of
  the request that needed it (or of beat's task);
- ``merchant_tasks.exchange``: one per HTTP attempt at the token endpoint, a child of the
  renewal.

The renewer stores its renewal span's context (a W3C ``traceparent``, never the token)
beside the token it saves, so a call in another process that gets that token after a 401
links its request span to the renewal that fixed it.

Without the OpenTelemetry API installed, or while the application has configured no SDK
(the API's proxy providers), every function here returns a shared no-op: the hot path
pays one global read. Nothing here puts a token, a secret or a header into telemetry;
attributes are methods, paths without query, host names, counts and outcomes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Protocol

try:
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed
    _trace = None  # type: ignore[assignment]
    _metrics = None  # type: ignore[assignment]

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
HTTP_METHOD = "http.request.method"
HTTP_STATUS = "http.response.status_code"
RESEND_COUNT = "http.request.resend_count"
SERVER_ADDRESS = "server.address"
URL_PATH = "url.path"
ERROR_TYPE = "error.type"

AttributeValue = str | bool | int | float


class Recorder(Protocol):
    """What instrumented code may do with its span; the no-op does nothing."""

    def set(self, key: str, value: AttributeValue) -> None: ...

    def link(self, traceparent: str | None) -> None: ...

    def failed(self, error: BaseException) -> None: ...

    def traceparent(self) -> str | None: ...


class _NoSpan:
    """The span of a process that traces nothing: every method is a no-op."""

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def set(self, key: str, value: AttributeValue) -> None:
        pass

    def link(self, traceparent: str | None) -> None:
        pass

    def failed(self, error: BaseException) -> None:
        pass

    def traceparent(self) -> str | None:
        return None


NO_SPAN = _NoSpan()


class _Span:
    """A live span, current while its ``with`` block runs."""

    def __init__(self, tracer: Any, name: str, kind: Any, attributes: Mapping[str, Any]) -> None:
        self._manager = tracer.start_as_current_span(
            name, kind=kind, attributes=dict(attributes), record_exception=False
        )
        self._span: Any = None
        self._linked: set[str] = set()

    def __enter__(self) -> _Span:
        self._span = self._manager.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if error is not None:
            self.failed(error)
        self._manager.__exit__(kind, error, traceback)

    def set(self, key: str, value: AttributeValue) -> None:
        self._span.set_attribute(key, value)

    def link(self, traceparent: str | None) -> None:
        """Link to the span that ``traceparent`` names (another process's renewal)."""
        if not traceparent or traceparent in self._linked or traceparent == self.traceparent():
            return
        context = _remote_context(traceparent)
        if context is not None:
            self._linked.add(traceparent)
            self._span.add_link(context)

    def failed(self, error: BaseException) -> None:
        # the error's type only: messages may quote an error body, never worth the risk
        self._span.set_attribute(ERROR_TYPE, type(error).__name__)
        self._span.set_status(_trace.Status(_trace.StatusCode.ERROR, type(error).__name__))

    def traceparent(self) -> str | None:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(
            carrier, context=_trace.set_span_in_context(self._span)
        )
        return carrier.get("traceparent")


def request_span(method: str, path: str, account: str) -> Recorder:
    """The span of one client call (``path`` without its query)."""
    return _start(
        REQUEST_SPAN,
        "CLIENT",
        {HTTP_METHOD: method, URL_PATH: path.split("?", 1)[0], ACCOUNT: account},
    )


def renewal_span(reason: str, account: str) -> Recorder:
    """The span of one renewal this process runs or waits for."""
    return _start(RENEWAL_SPAN, "INTERNAL", {REASON: reason, ACCOUNT: account})


def exchange_span(host: str) -> Recorder:
    """The span of one HTTP attempt at the token endpoint."""
    return _start(EXCHANGE_SPAN, "CLIENT", {HTTP_METHOD: "POST", SERVER_ADDRESS: host})


def _start(name: str, kind: str, attributes: Mapping[str, Any]) -> Recorder:
    tracer = _tracer()
    if tracer is None:
        return NO_SPAN
    return _Span(tracer, name, getattr(_trace.SpanKind, kind), attributes)


_cached_tracer: tuple[object, Any] | None = None


def _tracer() -> Any:
    """This scope's tracer from the configured provider, or None when nothing records."""
    global _cached_tracer
    if _trace is None:
        return None
    provider = _trace.get_tracer_provider()
    if isinstance(provider, _trace.ProxyTracerProvider | _trace.NoOpTracerProvider):
        return None
    if _cached_tracer is None or _cached_tracer[0] is not provider:
        _cached_tracer = (provider, provider.get_tracer(SCOPE, _version()))
    return _cached_tracer[1]


def _remote_context(traceparent: str) -> Any:
    """The span context a ``traceparent`` names, or None if it does not parse."""
    context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    span_context = _trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


def _version() -> str:
    from . import __version__

    return __version__


# -- metrics -------------------------------------------------------------------------------


class _Instruments:
    """The meter's instruments, made once per meter provider."""

    def __init__(self, meter: Any) -> None:
        self.exchanges = meter.create_counter(
            "merchant_tasks.exchanges",
            unit="{exchange}",
            description="Token exchange attempts by reason and outcome.",
        )
        self.exchange_duration = meter.create_histogram(
            "merchant_tasks.exchange.duration",
            unit="s",
            description="Seconds one token exchange attempt took, any outcome.",
        )
        self.lock_wait = meter.create_histogram(
            "merchant_tasks.lock_wait.duration",
            unit="s",
            description="Seconds a caller waited for another's renewal.",
        )
        self.breaker_openings = meter.create_counter(
            "merchant_tasks.breaker.openings",
            unit="{opening}",
            description="Times exchanges were paused, by kind.",
        )
        self.calls = meter.create_counter(
            "merchant_tasks.calls",
            unit="{call}",
            description="Client calls by outcome (ok, or the error's type).",
        )


_cached_instruments: tuple[object, _Instruments] | None = None


def _instruments() -> _Instruments | None:
    global _cached_instruments
    if _metrics is None:
        return None
    provider = _metrics.get_meter_provider()
    if isinstance(provider, _metrics.NoOpMeterProvider) or type(provider).__name__ == (
        "_ProxyMeterProvider"
    ):
        return None
    if _cached_instruments is None or _cached_instruments[0] is not provider:
        meter = provider.get_meter(SCOPE, _version())
        _cached_instruments = (provider, _Instruments(meter))
    return _cached_instruments[1]


def count_exchange(account: str, reason: str, outcome: str) -> None:
    instruments = _instruments()
    if instruments is not None:
        instruments.exchanges.add(1, {ACCOUNT: account, REASON: reason, OUTCOME: outcome})


def observe_exchange(account: str, seconds: float) -> None:
    instruments = _instruments()
    if instruments is not None:
        instruments.exchange_duration.record(seconds, {ACCOUNT: account})


def observe_lock_wait(account: str, seconds: float) -> None:
    instruments = _instruments()
    if instruments is not None:
        instruments.lock_wait.record(seconds, {ACCOUNT: account})


def count_breaker_opening(account: str, kind: str) -> None:
    instruments = _instruments()
    if instruments is not None:
        instruments.breaker_openings.add(1, {ACCOUNT: account, "merchant_tasks.breaker.kind": kind})


def count_call(account: str, outcome: str) -> None:
    instruments = _instruments()
    if instruments is not None:
        instruments.calls.add(1, {ACCOUNT: account, "merchant_tasks.call.outcome": outcome})


@contextmanager
def no_telemetry() -> Iterator[None]:
    """For tests: forget the cached tracer and instruments around a block."""
    global _cached_tracer, _cached_instruments
    try:
        yield
    finally:
        _cached_tracer = _cached_instruments = None
