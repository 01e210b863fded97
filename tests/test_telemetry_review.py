"""Telemetry in trouble, reviewed (issue 35, items 1 and 12): once per outage or per kind of
failure, never once per call or per collection, and never into the caller.

* The gauges read their database at each collection (a periodic reader: every minute; a
  ``/metrics`` scrape: at each scrape). A database that cannot be read was a WARNING at every
  collection for as long as the outage lasted; it is one per outage, and one line when the
  figures can be read again.
* An SDK whose span processor, meter or propagator raises at run time was a WARNING with a
  traceback at every call (every request, every message); it is one per kind of failure, the
  others at DEBUG, and the caller is answered as ever.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections, transaction
from django.test import Client

pytest.importorskip("opentelemetry.sdk")

from django_idempotency import telemetry
from django_idempotency.events.core import process_event
from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.relay import Relay
from tests.otel_helpers import Sdk
from tests.probes import post
from tests.test_review2_telemetry import Broken, broken_sdk  # noqa: F401 - the fixture
from tests.test_telemetry import Answering, otel  # noqa: F401 - the fixture

LOGGER = "django_idempotency"


def telemetry_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == LOGGER and r.levelno >= logging.WARNING and "telemetry" in r.getMessage()
    ]


# --- 5. The gauges of a database that cannot be read ---------------------------------------------


def collect(otel: Sdk) -> dict[str, Any]:  # noqa: F811
    """One collection, reading the databases anew (figures are otherwise kept for a second)."""
    telemetry._state.figures.clear()
    return {
        attributes["idempotency.database"]: value
        for name, attributes, value in otel.points()
        if name == telemetry.OUTBOX_PENDING
    }


@pytest.fixture
def other_down() -> Iterator[Any]:
    """Call it to point the alias ``other`` at nothing (a port nobody listens on, a file that
    cannot be opened), and again with False to bring it back."""
    other = connections["other"]
    saved = dict(other.settings_dict)

    def down(is_down: bool = True) -> None:
        other.close()
        other.settings_dict.update(saved)
        if not is_down:
            return
        if other.vendor == "sqlite":
            other.settings_dict["NAME"] = "/nonexistent-directory/db.sqlite3"
        else:
            other.settings_dict["PORT"] = "1"

    yield down
    down(False)


@pytest.mark.django_db(databases=["default", "other"], transaction=True)
def test_a_database_that_cannot_be_read_is_one_warning_per_outage(
    otel: Sdk,  # noqa: F811
    other_down: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert telemetry.observe("default") and telemetry.observe("other")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert set(collect(otel)) == {"default", "other"}
        other_down()
        for _ in range(4):
            assert set(collect(otel)) == {"default"}
        other_down(False)
        assert set(collect(otel)) == {"default", "other"}
        other_down()  # a second outage is said again
        assert set(collect(otel)) == {"default"}
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= 20]
    figures = [line for line in lines if "figures of database 'other'" in line]
    assert len(figures) == 3, figures
    assert figures[0].startswith("telemetry: cannot read the figures of database 'other' (")
    assert "can be read again" in figures[1]
    assert figures[2].startswith("telemetry: cannot read the figures of database 'other' (")
    warnings = [r for r in caplog.records if "cannot read the figures" in r.getMessage()]
    assert [r.levelno for r in warnings] == [logging.WARNING, logging.WARNING]
    assert all(r.exc_info is None for r in warnings)
    debug = [
        r for r in caplog.records if r.levelno == logging.DEBUG and "figures" in r.getMessage()
    ]
    assert len(debug) >= 4  # every failed collection, with its traceback


# --- 9. An SDK that raises at run time --------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("null_default_transport", "broken_sdk")
def test_a_failing_sdk_is_one_warning_per_kind_not_per_call(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for n in range(5):
            response = post(client, "/probe/effect/", f"tel-review-{n}", {"n": n})
            assert response.status_code == 201, response.content
            processed = process_event("c.tel-review", str(uuid.uuid4()), lambda n=n: n)
            assert processed.result == n
            with transaction.atomic():
                outbox.send("tel.topic", {"n": n})
            Relay(transports={"default": Answering(set())}).run_once()
    assert OutboxEntry.objects.filter(state="sent").count() == 5
    warnings = telemetry_warnings(caplog)
    kinds = [r.getMessage() for r in warnings]
    assert len(kinds) == len(set(kinds)), kinds  # each kind once
    assert len(kinds) <= 8, kinds
    assert all("Broken" in k for k in kinds), kinds  # the cause, on the line
    assert all(r.exc_info is not None for r in warnings)  # its traceback, once
    repeats = [
        r for r in caplog.records if r.levelno == logging.DEBUG and "telemetry:" in r.getMessage()
    ]
    assert len(repeats) >= 20  # the others, at DEBUG


class RaisingPropagator:
    """A propagator (``OTEL_PROPAGATORS``, or set_global_textmap) that raises at run time."""

    fields: set[str] = {"traceparent"}

    def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
        raise Broken("propagator.inject")

    def extract(self, carrier: Any, context: Any = None, getter: Any = None) -> Any:
        raise Broken("propagator.extract")


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("null_default_transport")
def test_a_raising_propagator_is_one_warning_and_breaks_nothing(
    otel: Sdk,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opentelemetry import propagate, trace

    monkeypatch.setattr(propagate, "_HTTP_TEXT_FORMAT", RaisingPropagator())
    tracer = trace.get_tracer("test")
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for n in range(5):
            with tracer.start_as_current_span("request"), transaction.atomic():
                outbox.send("prop.topic", {"n": n})  # injects: raises
                outbox.send("prop.topic", {"n": n}, headers={"traceparent": parent})
            with telemetry.consuming("c.prop", {"traceparent": parent}):  # extracts: raises
                pass
        Relay(transports={"default": Answering(set())}).run_once()  # extracts: raises
    assert OutboxEntry.objects.filter(state="sent").count() == 10
    kinds = [r.getMessage() for r in telemetry_warnings(caplog)]
    assert len(kinds) == len(set(kinds)), kinds
    assert kinds and all("propagator" in k for k in kinds), kinds
