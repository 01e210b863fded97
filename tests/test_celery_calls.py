"""What ``outbox.publish()`` stores of a Celery call, and what the relay makes of it, value by
value (issue 36): kombu's JSON as kombu writes it, readable in the admin; what the database
would change is refused or written so that it comes back the same. The parity with
``apply_async`` call by call is ``tests/test_celery_call_parity.py``; arbitrary values are
``tests/test_celery_calls_hypothesis.py``."""

from __future__ import annotations

import math
import uuid
from decimal import Decimal

import pytest
from django.db import connection, transaction

from django_idempotency.admin import OutboxEntryAdmin
from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.celery_calls import decode
from testproject.shop.call_probe import Money, probe_call

pytestmark = pytest.mark.django_db


def stored(*args: object, **kwargs: object) -> OutboxEntry:
    with transaction.atomic():
        event_id = outbox.publish(probe_call, args, kwargs)
    return OutboxEntry.objects.get(event_id=event_id)


def test_kombus_types_are_stored_as_kombu_writes_them_and_shown_decoded() -> None:
    row = stored(uuid.UUID(int=1), Decimal("1.10"), b"\x00\x01", money=Money(Decimal("2"), "EUR"))

    assert row.payload["args"] == [
        {"__type__": "uuid", "__value__": {"hex": "0" * 31 + "1"}},
        {"__type__": "decimal", "__value__": "1.10"},
        {"__type__": "base64", "__value__": "AAE="},  # a NUL: base64, which every database stores
    ]
    assert row.payload["kwargs"] == {
        "money": {"__type__": "money", "__value__": {"amount": "2", "currency": "EUR"}}
    }
    assert decode(row.payload["args"]) == [uuid.UUID(int=1), Decimal("1.10"), b"\x00\x01"]
    call = OutboxEntryAdmin.call(None, row)  # type: ignore[arg-type]
    assert call == (
        "shop.probe_call(UUID('00000000-0000-0000-0000-000000000001'), Decimal('1.10'), "
        "b'\\x00\\x01', money=Money(amount=Decimal('2'), currency='EUR'))"
    )
    assert row.payload["options"] == {}  # the relay writes argsrepr, of the values


def test_a_float_comes_back_a_float() -> None:
    """PostgreSQL's jsonb gave 1e+16 back as the integer 10000000000000000."""
    row = stored(1e16, 1.5e300, 5e-324, 1e-05)

    got = row.payload["args"]
    assert [type(value) for value in got] == [float] * 4
    assert got == [1e16, 1.5e300, 5e-324, 1e-05]


def test_a_negative_zero_is_refused_on_postgresql_and_kept_elsewhere() -> None:
    if connection.vendor == "postgresql":
        with transaction.atomic(), pytest.raises(TypeError, match=r"-0\.0"):
            outbox.publish(probe_call, [-0.0])
        return
    (value,) = stored(-0.0).payload["args"]
    assert math.copysign(1.0, value) == -1.0


def test_a_mapping_shaped_like_a_tag_kombu_cannot_decode_is_refused() -> None:
    with transaction.atomic(), pytest.raises(ValueError, match="kombu cannot decode"):
        outbox.publish(probe_call, [{"__type__": "nope", "__value__": 1}])


def test_a_value_kombus_json_cannot_write_is_refused_as_apply_async_refuses_it() -> None:
    with transaction.atomic(), pytest.raises(TypeError, match="what kombu's JSON writes"):
        outbox.publish(probe_call, [object()])
