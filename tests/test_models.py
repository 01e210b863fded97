"""The shipped constraints hold on every database: duplicates raise IntegrityError."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from django_idempotency.models import EventDelivery, IdempotencyRecord, ProcessedEvent

pytestmark = pytest.mark.django_db


def make_record(owner: str = "user:1", key: str = "k-1") -> IdempotencyRecord:
    return IdempotencyRecord.objects.create(
        owner=owner,
        key=key,
        fingerprint="0" * 64,
        method="POST",
        path="/api/orders/",
        expires_at=timezone.now() + timedelta(days=1),
    )


def make_event(consumer: str = "billing", event_id: str = "evt-1") -> ProcessedEvent:
    return ProcessedEvent.objects.create(
        consumer=consumer, event_id=event_id, expires_at=timezone.now() + timedelta(days=7)
    )


def test_record_defaults() -> None:
    record = make_record()
    record.refresh_from_db()
    assert record.state == IdempotencyRecord.State.IN_PROGRESS
    assert record.response_headers == {}
    assert record.response_body is None
    assert record.token is not None
    assert str(record) == "POST /api/orders/ [k-1]"


def test_duplicate_owner_and_key_raises() -> None:
    make_record()
    with pytest.raises(IntegrityError), transaction.atomic():
        make_record()


def test_same_key_for_two_owners_is_allowed() -> None:
    make_record(owner="user:1")
    make_record(owner="user:2")
    assert IdempotencyRecord.objects.filter(key="k-1").count() == 2


def test_duplicate_consumer_and_event_raises() -> None:
    make_event()
    with pytest.raises(IntegrityError), transaction.atomic():
        make_event()


def test_same_event_for_two_consumers_is_allowed() -> None:
    make_event(consumer="billing")
    make_event(consumer="shipping")
    assert ProcessedEvent.objects.filter(event_id="evt-1").count() == 2


def test_duplicate_delivery_counter_raises() -> None:
    expires = timezone.now() + timedelta(days=7)
    EventDelivery.objects.create(consumer="billing", event_id="evt-1", expires_at=expires)
    with pytest.raises(IntegrityError), transaction.atomic():
        EventDelivery.objects.create(consumer="billing", event_id="evt-1", expires_at=expires)


def test_binary_body_and_json_headers_round_trip() -> None:
    record = make_record()
    body = bytes(range(256)) * 4
    record.response_body = body
    record.response_headers = {"Content-Type": "application/octet-stream", "Location": "/x/é"}
    record.response_status = 201
    record.save()
    record.refresh_from_db()
    assert bytes(record.response_body) == body
    assert record.response_headers["Location"] == "/x/é"


def test_named_indexes_exist_in_the_database() -> None:
    with connection.cursor() as cursor:
        record_constraints = connection.introspection.get_constraints(
            cursor, IdempotencyRecord._meta.db_table
        )
        event_constraints = connection.introspection.get_constraints(
            cursor, ProcessedEvent._meta.db_table
        )
    # The key (or event id) leads, so that the admin's search by key alone uses the index.
    assert record_constraints["idempotency_record_key_owner_uniq"]["unique"]
    assert record_constraints["idempotency_record_key_owner_uniq"]["columns"] == ["key", "owner"]
    assert record_constraints["idem_record_expires_idx"]["columns"] == ["expires_at"]
    assert event_constraints["idempotency_event_consumer_uniq"]["columns"] == [
        "event_id",
        "consumer",
    ]
    assert event_constraints["idem_event_expires_idx"]["columns"] == ["expires_at"]
