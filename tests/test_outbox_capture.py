"""A transport read from the log (Debezium) in place of the relay: ``ChangeCaptureTransport``.

Its messages are written ``external`` with an expiry, so that no relay claims them and the purge
deletes them after ``OUTBOX_TTL``, as it deletes sent ones. Runs on every backend; the
``NOTIFY`` test in the PostgreSQL pass. That the rows reach PostgreSQL's change stream, and that a
publication filtered on the transport keeps the relay's rows out of it, is
``tests/test_logical_decoding.py``'s.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency.checks import check_outbox_transports
from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.capture import ChangeCaptureTransport, is_change_capture
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.transports import OutboxMessage
from django_idempotency.retention.purge import purge_all
from testproject.shop.tasks import apply_order_confirmed
from tests.outbox_helpers import NULL_TRANSPORTS
from tests.test_logical_decoding import connector_properties, router_columns
from tests.test_outbox import listener, notifications

CAPTURE = "django_idempotency.outbox.capture.ChangeCaptureTransport"
TRANSPORTS = {**NULL_TRANSPORTS, "cdc": {"BACKEND": CAPTURE}}

pytestmark = pytest.mark.django_db


class Recording:
    def __init__(self) -> None:
        self.sent: list[OutboxMessage] = []

    def send(self, messages: list[OutboxMessage]) -> list[BaseException | None]:
        self.sent.extend(messages)
        return [None] * len(messages)

    def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def capture_transport() -> Iterator[None]:
    with override_settings(
        IDEMPOTENCY={
            **settings.IDEMPOTENCY,
            "OUTBOX_TRANSPORTS": TRANSPORTS,
            "OUTBOX_TTL": timedelta(days=2),
        }
    ):
        yield


def test_a_message_for_a_change_capture_transport_is_written_external_with_its_expiry() -> None:
    before = timezone.now()
    with transaction.atomic():
        event_id = outbox.send("orders.confirmed", {"order_id": 1}, key="o-1", transport="cdc")
    row = OutboxEntry.objects.get()
    assert (row.event_id, row.transport, row.state) == (event_id, "cdc", "external")
    assert row.expires_at == row.created_at + timedelta(days=2)
    assert row.created_at >= before
    assert (row.sent_at, row.locked_until, row.available_at, row.attempts) == (None, None, None, 0)


def test_the_relay_never_claims_it_and_still_sends_the_other_transports() -> None:
    with transaction.atomic():
        outbox.send("orders.confirmed", {"n": 1}, key="k", transport="cdc")
        relayed = outbox.send("orders.confirmed", {"n": 2}, key="k")  # same key, behind it
    null = Recording()
    result = Relay(transports={"default": null, "cdc": ChangeCaptureTransport()}).drain()
    assert (result.sent, result.failed, result.parked) == (1, 0, 0)
    assert [message.event_id for message in null.sent] == [relayed]
    states = dict(OutboxEntry.objects.values_list("transport", "state"))
    assert states == {"cdc": "external", "default": "sent"}


def test_status_counts_it_neither_pending_nor_as_lag() -> None:
    with transaction.atomic():
        outbox.send("orders.confirmed", {"n": 1}, transport="cdc")
    OutboxEntry.objects.update(created_at=timezone.now() - timedelta(hours=5))
    stats = OutboxEntry.objects.stats()
    assert (stats.counts["pending"], stats.counts["parked"], stats.counts["lag_seconds"]) == (
        0,
        0,
        0,
    )


def test_the_purge_deletes_it_once_expired_and_not_before() -> None:
    with transaction.atomic():
        outbox.send("orders.confirmed", {"n": 1}, transport="cdc")
        outbox.send("orders.confirmed", {"n": 2}, transport="cdc")
    old, young = OutboxEntry.objects.order_by("pk")
    OutboxEntry.objects.filter(pk=old.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    purge_all()
    assert list(OutboxEntry.objects.values_list("pk", flat=True)) == [young.pk]
    out = StringIO()
    call_command("idempotency_purge", stdout=out)
    assert OutboxEntry.objects.filter(pk=young.pk).exists()


def test_a_pending_row_written_before_the_switch_fails_with_the_reason_and_parks() -> None:
    """Nothing shows that the connector read a row written before its transport was switched:
    the relay fails it, with the reason, and parks it after OUTBOX_MAX_ATTEMPTS."""
    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "OUTBOX_TRANSPORTS": {
        **NULL_TRANSPORTS, "cdc": NULL_TRANSPORTS["default"]}}), transaction.atomic():  # fmt: skip
        event_id = outbox.send("orders.confirmed", {"n": 1}, transport="cdc")
    assert OutboxEntry.objects.get().state == "pending"
    relay = Relay(transports={"cdc": ChangeCaptureTransport()}, max_attempts=1)
    result = relay.run_once()
    assert result.parked == 1
    row = OutboxEntry.objects.get()
    assert row.state == "parked"
    assert f"event {event_id} was written pending" in row.last_error
    assert "ChangeCaptureTransport" in row.last_error


@pytest.mark.parametrize("destination", ["orders confirmed", "orders/confirmed", "x" * 250, ".."])
def test_a_destination_the_connector_cannot_route_is_refused_and_writes_nothing(
    destination: str,
) -> None:
    """The router sends to the topic the destination names: a name Kafka refuses would stop the
    connector on that message, and every message behind it, at each restart."""
    with transaction.atomic(), pytest.raises(ValueError, match="not a Kafka topic name"):
        outbox.send(destination, {"n": 1}, transport="cdc")
    assert not OutboxEntry.objects.exists()


def test_publish_through_it_is_refused_and_writes_nothing() -> None:
    with transaction.atomic(), pytest.raises(ValueError, match="ChangeCaptureTransport"):
        outbox.publish(apply_order_confirmed, args=[{"order_id": 1}], transport="cdc")
    assert not OutboxEntry.objects.exists()


def test_options_for_it_fail_check_e032() -> None:
    transports = {**TRANSPORTS, "cdc": {"BACKEND": CAPTURE, "OPTIONS": {"topic": "x"}}}
    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "OUTBOX_TRANSPORTS": transports}):
        ids = [message.id for message in check_outbox_transports(None)]
    assert "django_idempotency.E032" in ids


def test_is_change_capture_reads_the_class_not_the_name() -> None:
    assert is_change_capture(CAPTURE)
    assert not is_change_capture(NULL_TRANSPORTS["default"]["BACKEND"])
    assert not is_change_capture("django_idempotency.outbox.transports.CeleryTransport")
    assert not is_change_capture("no.such.Transport")


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_no_notify_wakes_a_relay_for_it() -> None:
    wrapper = listener()
    try:
        with transaction.atomic():
            outbox.send("orders.confirmed", {}, transport="cdc")
        assert notifications(wrapper, 0.5) == 0
        with transaction.atomic():
            outbox.send("orders.confirmed", {})  # the relay's transport: notified
        assert notifications(wrapper, 2.0) == 1
    finally:
        wrapper.close()


def test_the_scale_guide_block_writes_an_external_row() -> None:
    """docs/scale.md's settings and ``send()``, run as the page shows them."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "scale.md").read_text()
    (block,) = [
        code
        for code in re.findall(r"```python\n(.*?)```", page, re.S)
        if "ChangeCaptureTransport" in code
    ]
    settings_part, _, code_part = block.partition("\nfrom django.db import transaction")
    namespace: dict[str, Any] = {}
    exec(settings_part, namespace)
    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, **namespace["IDEMPOTENCY"]}):
        exec("from django.db import transaction" + code_part, {})
    row = OutboxEntry.objects.get()
    assert (row.transport, row.state, row.payload) == ("cdc", "external", {"order_id": 42})


def test_the_admin_shows_no_lag_for_it() -> None:
    from django.contrib.admin.sites import site

    with transaction.atomic():
        outbox.send("orders.confirmed", {"n": 1}, transport="cdc")
    OutboxEntry.objects.update(created_at=timezone.now() - timedelta(hours=5))
    model_admin = site._registry[OutboxEntry]
    assert model_admin.lag(OutboxEntry.objects.get()) == "-"  # type: ignore[attr-defined]


def test_the_scale_guide_connector_reads_columns_it_can_take() -> None:
    """docs/scale.md's connector: every column the router reads is the table's, and none is a
    ``timestamptz`` where the router wants an integer timestamp. The PostgreSQL connector emits
    a ``timestamptz`` as a string (``io.debezium.time.ZonedTimestamp``), and the router's
    ``table.field.event.timestamp`` fails the connector's task on one."""
    properties = connector_properties()
    columns = {field.column: field for field in OutboxEntry._meta.concrete_fields}
    assert set(router_columns(properties)) <= set(columns)
    timestamp = properties.get("transforms.outbox.table.field.event.timestamp")
    if timestamp is not None:
        assert columns[timestamp].get_internal_type() != "DateTimeField", timestamp


def test_the_scale_guide_connector_takes_no_snapshot_of_the_table() -> None:
    """A first snapshot reads every row of the table, whatever its transport or state (the
    relay's Celery task calls, messages already sent), and the router routes a snapshot's rows
    like inserts; a publication's row filter does not apply to it."""
    assert connector_properties().get("snapshot.mode") in ("no_data", "never")


def test_the_scale_guide_connector_confirms_its_position_without_events() -> None:
    """The publication streams the connector's rows only: without a heartbeat, a slot that
    gets none of them for a while holds the database's WAL on disk all that time."""
    assert int(connector_properties().get("heartbeat.interval.ms", "0")) > 0


def test_the_outbox_imports_without_the_kafka_extra() -> None:
    """``outbox.send()`` (and so this transport) needs no confluent-kafka."""
    code = (
        "import sys; sys.modules['confluent_kafka'] = None\n"
        "import django; django.setup()\n"
        "from django_idempotency.outbox import core, capture\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "testproject.settings"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
