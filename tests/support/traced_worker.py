"""A traced worker for the end-to-end tracing test: ``celery -A support.traced_worker worker``
(``tests/`` on the ``PYTHONPATH``).

merchant-tasks' own Celery app, with the OpenTelemetry SDK and the Celery instrumentation
set up in every worker process (after the fork, as the instrumentation asks). Each finished
span is appended as one JSON line to the file named by ``TRACED_WORKER_SPANS``, which the
test reads.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from celery.signals import worker_process_init
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from merchant_tasks.worker.app import app

SPANS_FILE = "TRACED_WORKER_SPANS"  # the variable naming the file spans are appended to

__all__ = ["app"]


class JsonLinesExporter(SpanExporter):
    """Appends each span (its OpenTelemetry JSON form, on one line) to a file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(json.loads(span.to_json())) + "\n" for span in spans)
        with self._lock, open(self.path, "a") as out:
            out.write(lines)
        return SpanExportResult.SUCCESS


@worker_process_init.connect(weak=False)
def trace_this_process(**_: Any) -> None:
    # the three lines of docs/tracing.md, with a file for the exporter
    trace.set_tracer_provider(provider := TracerProvider())
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(os.environ[SPANS_FILE])))
    CeleryInstrumentor().instrument()  # type: ignore[no-untyped-call]
