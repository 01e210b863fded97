"""OpenTelemetry for the test suite's subprocesses: spans written to a file as JSON lines.

``IDEMPOTENCY_SPANS_FILE=/path`` (read by testproject/settings.py) installs an SDK tracer
provider whose spans are appended to that file, one JSON object a line, as each span ends. A
test starts a web server, a relay and a worker with the same file, then reads every process's
spans back and checks they share one trace. Appends of one short line each, from several
processes, do not interleave.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One span as a plain dict: ids in hex, times in nanoseconds."""
    context = span.get_span_context()
    assert context is not None
    parent = span.parent
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": None if parent is None else f"{parent.span_id:016x}",
        "links": [
            f"{link.context.trace_id:032x}:{link.context.span_id:016x}" for link in span.links
        ],
        "start": span.start_time,
        "end": span.end_time,
        "attributes": dict(span.attributes or {}),
        "process": span.resource.attributes.get("service.name"),
        "pid": os.getpid(),
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span to ``path`` as one JSON line."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(span), default=str) + "\n" for span in spans)
        with open(self.path, "a", encoding="utf-8") as file:
            file.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def export_spans_to(path: str, service: str, *, celery: bool = False) -> None:
    """Install a tracer provider that writes every span to ``path``; with ``celery``, also
    opentelemetry-instrumentation-celery (its publish and run spans, and its propagation)."""
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    trace.set_tracer_provider(provider)
    if celery:
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        CeleryInstrumentor().instrument()  # type: ignore[no-untyped-call]
