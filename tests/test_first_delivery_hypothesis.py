"""Hypothesis at a first delivery's read of its counters, on PostgreSQL and MariaDB, at READ
COMMITTED and REPEATABLE READ.

A first delivery's reservation reads the event's delivery counter after its insert, in its
latest committed state (``events.store._read_counters``; on PostgreSQL's default layout
``django_idempotency_reserve_v2``): at REPEATABLE READ, PostgreSQL's read also inserts the
counters it does not find, ``ON CONFLICT DO NOTHING``, and deletes them again. For any ids
(differing only by case, a trailing space or Unicode normalisation), each with no counter or a
committed one (clean, failed or parked), a batch of them and each of them alone must answer
what the counters say: a parked event is PARKED, any other RESERVED, an error is cleared for
the reserved ones only, and no counter is added, lost or changed otherwise, byte for byte.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections, transaction
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_idempotency.events.store import PARKED, RESERVED, reserve, reserve_first_deliveries
from django_idempotency.models import EventDelivery
from tests.test_event_ids_hypothesis import storable, variants

RR = "repeatable_read"

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, databases=["default", RR]),
]

ID_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=30)
STATES = st.sampled_from([None, "clean", "failed", "parked"])


class Rollback(Exception):
    """Leaves the reservations' transaction, undone."""


def make_counters(name: str, wanted: dict[str, str | None]) -> None:
    """The counters, committed before the reservations' transaction takes its snapshot."""
    now = timezone.now()
    EventDelivery.objects.bulk_create(
        EventDelivery(
            consumer=name,
            event_id=event,
            deliveries=3,
            last_error="RuntimeError: before" if state in ("failed", "parked") else "",
            parked_at=now if state == "parked" else None,
            expires_at=now + timedelta(days=1),
        )
        for event, state in wanted.items()
        if state is not None
    )


def counters(name: str, alias: str) -> dict[bytes, tuple[Any, ...]]:
    rows = EventDelivery.objects.using(alias).filter(consumer=name)
    return {
        event.encode("utf-8"): (deliveries, parked_at is not None, error)
        for event, deliveries, parked_at, error in rows.values_list(
            "event_id", "deliveries", "parked_at", "last_error"
        )
    }


def expected_counters(
    before: dict[bytes, tuple[Any, ...]], states: dict[str, str], reserved: list[str]
) -> dict[bytes, tuple[Any, ...]]:
    after = dict(before)
    for event in reserved:
        key = event.encode("utf-8")
        if key in after and states[event] == RESERVED:
            deliveries, parked, _ = after[key]
            after[key] = (deliveries, parked, "")
    return after


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
@pytest.mark.parametrize("alias", ["default", RR])
def test_the_counters_answer_for_each_id_alone_and_in_a_batch(alias: str, data: Any) -> None:
    base = data.draw(st.lists(ID_TEXT.filter(storable), min_size=1, max_size=5, unique=True))
    pool = sorted({v for b in base for v in (b, *variants(b))})
    wanted = {event: data.draw(STATES) for event in pool}
    batch = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=12, unique=True))
    names = {how: f"hyp-{how}-{uuid.uuid4().hex[:12]}" for how in ("batch", "alone")}
    for name in names.values():
        make_counters(name, wanted)
    expected = {e: PARKED if wanted[e] == "parked" else RESERVED for e in batch}
    connection = connections[alias]
    now = timezone.now()
    later = now + timedelta(days=1)
    before = counters(names["batch"], "default")
    assert before == counters(names["alone"], "default")

    with pytest.raises(Rollback), transaction.atomic(using=alias):
        states = reserve_first_deliveries(connection, names["batch"], batch, "t", now, later)
        assert states == expected
        assert counters(names["batch"], alias) == expected_counters(before, states, batch)
        alone = {
            event: reserve(connection, names["alone"], event, "t", now, later, first_delivery=True)
            for event in batch
        }
        assert alone == expected
        assert counters(names["alone"], alias) == expected_counters(before, alone, batch)
        raise Rollback
    # Rolled back: the counters are as they were.
    assert counters(names["batch"], "default") == before
    assert counters(names["alone"], "default") == before
