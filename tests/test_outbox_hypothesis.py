"""Arbitrary payloads, ordering keys and headers through ``outbox.send()``, on every database.

Each message is either stored and read back equal (the payload as JSON, the key and the headers
as text), or refused before any statement with the documented error: ``TypeError`` for JSON the
database cannot store (NaN, a lone surrogate outside SQLite, a NUL on PostgreSQL), ``ValueError``
for an empty or over-long ordering key or one with a NUL or a lone surrogate, a payload nested
past 31 levels or one over ``OUTBOX_MAX_PAYLOAD_BYTES``. Never a database error, and the caller's
transaction stays usable either way. The transport takes any payload (the Celery one checks that
a payload is a task call, which is not the point here).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_idempotency import outbox
from django_idempotency.models import OutboxEntry
from django_idempotency.outbox.core import MAX_JSON_DEPTH
from tests.outbox_helpers import NULL_TRANSPORTS

pytestmark = pytest.mark.django_db

TEXT = st.text(
    alphabet=st.one_of(
        st.characters(codec=None),
        st.sampled_from([" ", "\x00", "\ud800", "\\", "u", "é", "\u0301", "A", "a"]),
    ),
    max_size=40,
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**53), max_value=2**53),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
)
JSON = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(TEXT, children, max_size=4)
    ),
    max_leaves=20,
)
KEYS = st.one_of(st.none(), TEXT, st.text(min_size=250, max_size=260))
HEADERS = st.dictionaries(TEXT, TEXT, max_size=3)


def texts(value: Any) -> list[str]:
    """Every string in ``value``, keys included."""
    found: list[str] = []
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            found.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return found


def floats(value: Any) -> list[float]:
    pending, found = [value], []
    while pending:
        item = pending.pop()
        if isinstance(item, float):
            found.append(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return found


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


def utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def same_json(a: Any, b: Any) -> bool:
    """The same JSON, numbers' types included: a float stays a float (PostgreSQL's ``jsonb``
    gave ``1e+16`` back as the integer ``10000000000000000`` until the outbox wrote such floats
    with a fraction); only the keys' order may change (``jsonb`` sorts them)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def storable_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return connection.vendor == "sqlite"
    return not ("\x00" in text and connection.vendor == "postgresql")


def expected_errors(payload: Any, key: str | None, headers: dict[str, str]) -> tuple[type, ...]:
    """The documented refusals this message earns (any one of them may come first); none if
    it must be stored."""
    errors: set[type] = set()
    if key is not None and not (key.strip() and len(key) <= 255):
        errors.add(ValueError)
    if key is not None and ("\x00" in key or not utf8(key)):
        errors.add(ValueError)  # no text column stores these, on any backend
    if depth(payload) > MAX_JSON_DEPTH:
        errors.add(ValueError)
    if any(not math.isfinite(f) for f in floats(payload)):
        errors.add(TypeError)
    if connection.vendor == "postgresql" and any(
        f == 0 and math.copysign(1.0, f) < 0 for f in floats(payload)
    ):
        errors.add(TypeError)  # jsonb has no negative zero
    if not all(storable_text(t) for t in [*texts(payload), *texts(headers)]):
        errors.add(TypeError)
    return tuple(sorted(errors, key=lambda e: e.__name__))


CHECKS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


#: The relay's transport, and one a change-capture connector reads (written ``external``).
TRANSPORTS = {
    **NULL_TRANSPORTS,
    "cdc": {"BACKEND": "django_idempotency.outbox.capture.ChangeCaptureTransport"},
}


@CHECKS
@given(payload=JSON, key=KEYS, headers=HEADERS, transport=st.sampled_from(sorted(TRANSPORTS)))
def test_a_message_is_stored_byte_for_byte_or_refused(
    payload: Any, key: str | None, headers: dict[str, str], transport: str
) -> None:
    errors = expected_errors(payload, key, headers)
    with (
        override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": TRANSPORTS}),
        transaction.atomic(),
    ):
        if errors:
            with pytest.raises(errors):
                outbox.send(
                    "orders.placed", payload, key=key, headers=headers, transport=transport
                )
            assert not OutboxEntry.objects.exists()  # nothing written, the transaction usable
            return
        event_id = outbox.send(
            "orders.placed", payload, key=key, headers=headers, transport=transport
        )
        row = OutboxEntry.objects.get(event_id=event_id)
        assert row.state == ("external" if transport == "cdc" else "pending")
        assert same_json(row.payload, payload)
        assert row.ordering_key == key
        assert {k: v for k, v in row.headers.items() if k in headers} == headers
        if key is not None:  # a key that differs by case or a trailing space is another key
            assert not OutboxEntry.objects.filter(ordering_key=key + " ").exists()
        transaction.set_rollback(True)
