"""The OpenTelemetry SDK in the test process: an in-memory metric reader and span exporter.

OpenTelemetry lets a process set its global providers once, so :func:`sdk` installs them on
first use and every later test shares them; tests read deltas (:func:`counter_values` before
and after) and clear the span exporter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from django_idempotency import telemetry


@dataclass
class Sdk:
    reader: InMemoryMetricReader
    spans: InMemorySpanExporter

    def points(self) -> list[tuple[str, dict[str, Any], Any]]:
        """Every data point now: (metric name, attributes, value or histogram point)."""
        found = []
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        value = getattr(point, "value", point)
                        found.append((metric.name, dict(point.attributes or {}), value))
        return found

    def counter_values(self) -> dict[tuple[str, frozenset[tuple[str, Any]]], float]:
        """Counter and histogram totals (a histogram's count) by (name, attributes).

        Gauges are left out: once a test registered them they stay with the provider, and
        read whatever the tables hold at each collection."""
        totals: dict[tuple[str, frozenset[tuple[str, Any]]], float] = {}
        for name, attributes, value in self.points():
            if name not in telemetry.COUNTERS and name not in telemetry.HISTOGRAMS:
                continue
            number = value if isinstance(value, (int, float)) else value.count
            totals[name, frozenset(attributes.items())] = number
        return totals

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())


_sdk: Sdk | None = None


def sdk() -> Sdk:
    global _sdk
    if _sdk is None:
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        provider = TracerProvider()
        exporter = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _sdk = Sdk(reader, exporter)
    telemetry.reset()
    _sdk.spans.clear()
    return _sdk


def delta(
    before: dict[tuple[str, frozenset[tuple[str, Any]]], float],
    after: dict[tuple[str, frozenset[tuple[str, Any]]], float],
) -> dict[tuple[str, frozenset[tuple[str, Any]]], float]:
    """What changed between two :meth:`Sdk.counter_values` readings (zero changes left out)."""
    changed = {}
    for key, value in after.items():
        if value != before.get(key, 0):
            changed[key] = value - before.get(key, 0)
    return changed
