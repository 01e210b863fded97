"""Arbitrary ``apply_async`` arguments through ``outbox.publish()``, the database and a relay,
on every database (issue 36): kombu's types, text with lone surrogates and NUL characters,
bytes, deep nesting, huge values, floats jsonb would change, mappings shaped like kombu's tags.

Each call is either refused at ``publish()`` with ``TypeError`` or ``ValueError`` (never a
database error; nothing written; the caller's transaction usable), or stored and then relayed:
a real :class:`~django_idempotency.outbox.relay.Relay` through a real
:class:`~django_idempotency.outbox.transports.CeleryTransport`, to kombu's in-memory broker,
whose message is decoded as a worker decodes it. The task must get what ``apply_async`` would
give it: the arguments through the serializer (kombu's JSON, pickle or YAML), types included.
A call made only of what every database stores must be stored, not refused.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import transaction
from django.test import override_settings
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kombu import serialization

from django_idempotency.events.ids import checked_event_id
from django_idempotency.exceptions import InvalidEventId
from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.celery_calls import _difference
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.transports import CeleryTransport
from testproject.shop.call_probe import Money
from tests.transport_helpers import celery_app, take

pytestmark = pytest.mark.django_db(transaction=True)

MEMORY = "memory://"
QUEUE = "idem-hypothesis-calls"

TEXT = st.one_of(
    st.text(
        alphabet=st.one_of(
            st.characters(codec=None),
            st.sampled_from(["\x00", "\ud800", "\udfff", "\\", "u", "é", '"', "A"]),
        ),
        max_size=20,
    ),
    st.just("\\u0000"),  # a backslash, then "u0000": text, not a NUL
)
MOMENTS = st.datetimes(
    min_value=datetime(1, 1, 2),
    max_value=datetime(9998, 12, 30),
    timezones=st.none() | st.just(UTC),
)
TAGGED = st.fixed_dictionaries(
    {"__type__": st.sampled_from(["decimal", "uuid", "nope", "bytes"]), "__value__": TEXT}
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e16, -1.5e300, 5e-324, 1e-5, -0.0, 2.0**53]),
    TEXT,
    st.uuids(),
    MOMENTS,
    st.dates(),
    st.times(),
    st.decimals(allow_nan=True, allow_infinity=True, places=None),
    st.binary(max_size=12),
    st.builds(Money, st.decimals(allow_nan=False, allow_infinity=False), TEXT),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.tuples(children, children),
        st.dictionaries(TEXT, children, max_size=4),
        st.dictionaries(st.integers(-3, 3), children, max_size=2),
        TAGGED,
    ),
    max_leaves=16,
)


def nested(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = [value]
    return value


CALLS = st.fixed_dictionaries(
    {
        "args": st.lists(
            st.one_of(
                VALUES,
                st.integers(20, 40).map(nested),
                st.just(100_000).map(nested),
                st.just(1024 * 1024 + 1).map(lambda size: "x" * size),
            ),
            max_size=3,
        ),
        "kwargs": st.dictionaries(st.sampled_from(["a", "b", "event_id"]), VALUES, max_size=2),
        "serializer": st.sampled_from(["json", "json", "json", "pickle", "yaml"]),
    }
)


@pytest.fixture
def relay() -> Iterator[tuple[Any, Relay]]:
    from django.conf import settings as django_settings

    app = celery_app(MEMORY)
    app.conf.task_default_queue = QUEUE
    backend = "django_idempotency.outbox.transports.CeleryTransport"
    transports = {"default": {"BACKEND": backend, "OPTIONS": {"broker_url": MEMORY}}}
    transport = CeleryTransport(app=app, broker_url=MEMORY)
    with override_settings(
        IDEMPOTENCY={**django_settings.IDEMPOTENCY, "OUTBOX_TRANSPORTS": transports}
    ):
        yield app, Relay(transports={"default": transport})
    transport.close()
    app.close()


def expected(args: list[Any], kwargs: dict[str, Any], serializer: str) -> Any:
    """What a worker gets after ``apply_async``: the call through the serializer and back."""
    content_type, encoding, data = serialization.dumps((args, kwargs), serializer=serializer)
    return serialization.loads(data, content_type, encoding, accept=[content_type])


def _walk(value: Any) -> Iterator[Any]:
    pending = [value]
    while pending:
        item = pending.pop()
        yield item
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif isinstance(item, Money):
            pending.extend([item.amount, item.currency])


def _depth(value: Any) -> int:
    deepest, pending = 0, [(value, 0)]
    while pending:
        item, level = pending.pop()
        deepest = max(deepest, level)
        if level > 60:
            return level
        if isinstance(item, dict):
            pending.extend((v, level + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend((v, level + 1) for v in item)
    return deepest


def must_be_stored(args: list[Any], kwargs: dict[str, Any], serializer: str) -> bool:
    """Whether the call holds only what every database stores, with kombu's JSON (a rough
    lower bound: a call it says yes to must not be refused)."""
    if serializer != "json" or _depth([args, kwargs]) > 24:
        return False
    if kwargs.get("event_id") is not None:
        try:
            checked_event_id(kwargs["event_id"])
        except InvalidEventId:
            return False  # refused: the event id of the message
    for item in _walk([args, kwargs]):
        if isinstance(item, float) and (
            not math.isfinite(item) or (item == 0 and math.copysign(1, item) < 0)
        ):
            return False
        if isinstance(item, str) and (
            len(item) > 100_000 or "\x00" in item or any(0xD800 <= ord(c) <= 0xDFFF for c in item)
        ):
            return False
        if isinstance(item, dict) and "__type__" in item:
            return False  # a tag kombu may not decode
    return True


CHECKS = settings(
    max_examples=int(os.environ.get("HYPOTHESIS_CALLS", "60")),
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


@CHECKS
@given(call=CALLS)
# Celery's saferepr writes b"\x00" with a NUL character, which PostgreSQL refused.
@example(call={"args": [b"\x00"], "kwargs": {}, "serializer": "json"})
# jsonb gave 1e+16 back as an int, and keeps -0.0 as 0.0.
@example(call={"args": [1e16, 5e-324], "kwargs": {}, "serializer": "json"})
@example(call={"args": [-0.0], "kwargs": {}, "serializer": "json"})
def test_a_call_is_delivered_as_apply_async_would_or_refused(
    call: dict[str, Any], relay: tuple[Any, Relay]
) -> None:
    app, the_relay = relay
    task = app.tasks["shop.probe_call"]
    args, kwargs, serializer = call["args"], call["kwargs"], call["serializer"]
    with transaction.atomic():
        try:
            event_id = outbox.publish(task, args, kwargs, queue=QUEUE, serializer=serializer)
        except (TypeError, ValueError) as error:
            assert str(error), "a refusal says why"
            assert not must_be_stored(args, kwargs, serializer), f"refused: {error}"
            assert not OutboxEntry.objects.exists()
            outbox.send("after", {"args": [], "kwargs": {}})  # the transaction is usable
            transaction.set_rollback(True)
            return
    try:
        result = the_relay.drain()
        assert result.sent == 1, (result, OutboxEntry.objects.values_list("last_error"))
        message = take(MEMORY, QUEUE, timeout=2)
        got_args, got_kwargs, _ = message.decode()
        want = expected(args, kwargs, serializer)
        difference = _difference(list(want[0]), list(got_args), "args") or _difference(
            want[1], got_kwargs, "kwargs"
        )
        assert difference is None, difference
        assert message.headers["id"] == event_id
    finally:
        OutboxEntry.objects.all().delete()
