"""Arbitrary event ids and consumer names through ``try_reserve``, on every database.

Each pair is either stored and compared byte for byte (an id that differs only by a trailing
space, by case or by Unicode normalisation is another event, and the same bytes are a
duplicate), or refused before the database sees it: :class:`InvalidEventId` for the id, a
``ValueError`` for the consumer name. Never a driver error, never a skipped event. The
MariaDB pass runs on the NO PAD collation of migration 0009; the PostgreSQL pass on ``text``
columns that refuse NUL.
"""

from __future__ import annotations

import unicodedata

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_idempotency import try_reserve
from django_idempotency.events.ids import MAX_ID_LENGTH
from django_idempotency.exceptions import InvalidEventId
from django_idempotency.models import ProcessedEvent

pytestmark = pytest.mark.django_db

# Every code point, lone surrogates and NUL included, with the edge cases made likely.
ANY_TEXT = st.text(
    alphabet=st.one_of(
        st.characters(codec=None),
        st.sampled_from([" ", "\x00", "\ud800", "\udfff", "e", "\u0301", "\u00e9", "A", "a", "ß"]),
    ),
    max_size=MAX_ID_LENGTH + 5,
)


def storable(value: str) -> bool:
    """What the documented rule accepts: 1 to 255 characters, not blank, no NUL, UTF-8."""
    if not value.strip() or len(value) > MAX_ID_LENGTH or "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def variants(value: str) -> set[str]:
    """Other ids that a case-, space- or normalisation-folding database would take for it."""
    candidates = {
        value + " ",
        value.upper(),
        value.lower(),
        unicodedata.normalize("NFC", value),
        unicodedata.normalize("NFD", value),
    }
    return {c for c in candidates if c != value and storable(c)}


CHECKS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@CHECKS
@given(event_id=ANY_TEXT, consumer=ANY_TEXT)
def test_an_id_is_stored_byte_for_byte_or_refused(event_id: str, consumer: str) -> None:
    with transaction.atomic():
        if not storable(consumer):
            with pytest.raises(ValueError):
                try_reserve("evt", consumer)
            return
        if not storable(event_id):
            with pytest.raises(InvalidEventId):
                try_reserve(event_id, consumer)
            assert not ProcessedEvent.objects.filter(consumer=consumer).exists()
            return
        assert try_reserve(event_id, consumer) is True
        row = ProcessedEvent.objects.get(consumer=consumer, event_id=event_id)
        assert (row.consumer, row.event_id) == (consumer, event_id)  # the same bytes back
        for other in sorted(variants(event_id)):
            assert try_reserve(other, consumer) is True, f"{other!r} taken for {event_id!r}"
        for other in sorted(variants(consumer)):
            assert try_reserve(event_id, other) is True, f"{other!r} taken for {consumer!r}"
        assert try_reserve(event_id, consumer) is False  # the same bytes: a duplicate
        transaction.set_rollback(True)
