"""The HTTP core's spans end: ``idempotency.claim`` and ``idempotency.store``, and the request's.

With the OpenTelemetry SDK and its in-memory exporter (tests/otel_helpers.py), for a first
execution, a replay, a view that raises, a key reused for another request, and a claim whose
database cannot be reached. A span processor notes every span that starts: each one must also
end (an exporter only ever sees ended spans, so a span left open would just be missing), be
exported, and hang under the request's span; and no span stays current after the request.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, connections
from django.test import Client, override_settings

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import StatusCode

from tests.lock_waits import session_of
from tests.otel_helpers import Sdk, sdk
from tests.probes import post

pytestmark = [pytest.mark.django_db(transaction=True)]

URL = "/probe/effect/"


class Started(SpanProcessor):
    """Every span started, by span id, and which of them ended."""

    def __init__(self) -> None:
        self.started: dict[int, str] = {}
        self.ended: set[int] = set()

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        self.started[span.context.span_id] = span.name

    def on_end(self, span: ReadableSpan) -> None:
        assert span.context is not None
        self.ended.add(span.context.span_id)


_STARTED: Started | None = None


@pytest.fixture
def otel() -> Iterator[tuple[Sdk, Started]]:
    global _STARTED
    found = sdk()
    if _STARTED is None:  # the SDK's provider is the process's for good: add it once
        _STARTED = Started()
        trace.get_tracer_provider().add_span_processor(_STARTED)  # type: ignore[attr-defined]
    _STARTED.started.clear()
    _STARTED.ended.clear()
    yield found, _STARTED
    found.spans.clear()


def request_spans(otel: tuple[Sdk, Started], expected: list[str]) -> dict[str, ReadableSpan]:
    """The spans of the one request just sent: all ended, exported, the request's children."""
    exported, started = otel
    open_spans = {
        span_id: name for span_id, name in started.started.items() if span_id not in started.ended
    }
    assert not open_spans, f"spans that never ended: {sorted(open_spans.values())}"
    spans = exported.finished()
    names = [span.name for span in spans]
    assert sorted(names) == sorted(expected), names
    assert len(started.started) == len(spans)  # every span started was exported
    by_name = {span.name: span for span in spans}
    request = by_name["idempotency.request"]
    for span in spans:
        assert span.end_time is not None and span.end_time >= (span.start_time or 0)
        if span is not request:
            assert span.parent is not None and span.parent.span_id == request.context.span_id
            assert span.end_time <= (request.end_time or 0)  # ended within the request
    assert not trace.get_current_span().get_span_context().is_valid  # nothing left current
    return by_name


def test_a_first_execution_ends_the_claim_and_the_store(otel: tuple[Sdk, Started]) -> None:
    assert post(Client(), URL, "span-first").status_code == 201
    spans = request_spans(otel, ["idempotency.claim", "idempotency.store", "idempotency.request"])
    assert spans["idempotency.request"].attributes == {
        "http.request.method": "POST",
        "idempotency.outcome": "first_execution",
    }


def test_a_replay_ends_its_claim(otel: tuple[Sdk, Started]) -> None:
    post(Client(), URL, "span-replay")
    otel[0].spans.clear()
    otel[1].started.clear()
    otel[1].ended.clear()
    response = post(Client(), URL, "span-replay")
    assert response["Idempotent-Replayed"] == "true"
    spans = request_spans(otel, ["idempotency.claim", "idempotency.request"])
    assert (spans["idempotency.request"].attributes or {})["idempotency.outcome"] == "replay"


def test_a_view_that_raises_ends_the_claim_and_the_request(otel: tuple[Sdk, Started]) -> None:
    with pytest.raises(Exception, match="raised on purpose"):
        post(Client(raise_request_exception=True), "/probe/raise/", "span-raise")
    spans = request_spans(otel, ["idempotency.claim", "idempotency.request"])
    request = spans["idempotency.request"]
    assert request.status.status_code == StatusCode.ERROR
    assert [event.name for event in request.events] == ["exception"]


def test_a_reused_key_ends_its_claim(otel: tuple[Sdk, Started]) -> None:
    post(Client(), URL, "span-reused", {"a": 1})
    otel[0].spans.clear()
    otel[1].started.clear()
    otel[1].ended.clear()
    assert post(Client(), URL, "span-reused", {"a": 2}).status_code == 422
    request_spans(otel, ["idempotency.claim", "idempotency.request"])


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_a_database_down_at_the_claim_ends_its_span_as_an_error(
    otel: tuple[Sdk, Started],
) -> None:
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no server to be unreachable")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings_dict = connections["default"].settings_dict
    # A fresh alias's connection is opened by the claim: point "other" at the closed port.
    other = connections["other"]
    saved = dict(other.settings_dict)
    other.close()
    other.settings_dict.update(
        HOST="127.0.0.1",
        PORT=port,
        OPTIONS={**settings_dict["OPTIONS"], "connect_timeout": 2},
    )
    try:
        with override_settings(IDEMPOTENCY={"DATABASE": "other"}):
            assert post(Client(), URL, f"span-down-{uuid.uuid4()}").status_code == 503
    finally:
        other.close()
        other.settings_dict.clear()
        other.settings_dict.update(saved)
    spans = request_spans(otel, ["idempotency.claim", "idempotency.request"])
    # The connection failed as the claim's transaction began: both spans end, with the error.
    for span in spans.values():
        assert span.status.status_code == StatusCode.ERROR
        assert [event.name for event in span.events] == ["exception"]
    assert (spans["idempotency.request"].attributes or {})["idempotency.outcome"] == "unavailable"


@pytest.mark.postgres
@pytest.mark.mysql
@pytest.mark.django_db(transaction=True, databases=["default", "repeatable_read"])
def test_a_connection_lost_in_the_claim_ends_the_claim_span_as_an_error(
    otel: tuple[Sdk, Started],
) -> None:
    session = session_of()
    with connections["repeatable_read"].cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_terminate_backend(%s)", [session])
        else:
            cursor.execute(f"KILL {int(session)}")
    assert post(Client(), URL, f"span-lost-{uuid.uuid4()}").status_code == 503
    spans = request_spans(otel, ["idempotency.claim", "idempotency.request"])
    claim = spans["idempotency.claim"]
    assert claim.status.status_code == StatusCode.ERROR
    assert [event.name for event in claim.events] == ["exception"]
