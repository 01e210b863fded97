"""A batch's copies (:mod:`django_idempotency.outbox.celery_copies`) are the messages Celery
builds, on RabbitMQ (confirms and transactions) and on Redis through kombu.

Each test sends the same generated messages twice, with copies and with every message built by
Celery, and compares what a consumer receives: headers, properties, body and content type.
Only the delivery tag and an ``expires`` moment (computed at each publish) may differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_idempotency.outbox import celery_copies
from django_idempotency.outbox.transports import CeleryTransport, OutboxMessage
from tests.conftest import require_service
from tests.services import BROKER_URLS
from tests.test_celery_redis import json_values
from tests.transport_helpers import celery_app, drain, message
from tests.workers import delete_queue, new_queue_name

pytestmark = pytest.mark.broker

#: (broker, CeleryTransport options)
MODES = {
    "rabbitmq-confirms": ("rabbitmq", {}),
    "rabbitmq-transactions": ("rabbitmq", {"transactions": True}),
    "redis-through-kombu": ("redis", {"fast_redis": False}),
}
VARYING = {"delivery_tag", "delivery_info", "body_encoding", "expiration", "application_headers"}
"""Set aside: tags, routing (compared through the queue) and what holds an expiry moment; the
headers are compared on their own."""


@pytest.fixture(params=sorted(MODES))
def mode(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, Any]]]:
    broker, options = MODES[request.param]
    require_service(broker)
    yield BROKER_URLS[broker], options


def received(item: Any) -> dict[str, Any]:
    headers = dict(item.headers)
    if headers.get("expires") is not None:
        headers["expires"] = "<a moment>"
    return {
        "headers": headers,
        "properties": {k: v for k, v in item.properties.items() if k not in VARYING},
        "payload": item.payload,
        "content_type": item.content_type,
        "content_encoding": item.content_encoding,
    }


def both_ways(
    url: str, options: dict[str, Any], app: Any, queue: str, messages: list[OutboxMessage]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """``(as Celery builds them, with copies, copies published)``."""
    copies = 0
    real_publish = celery_copies.Copies.publish

    def counted(self: celery_copies.Copies, *args: Any, **kwargs: Any) -> bool:
        nonlocal copies
        made = real_publish(self, *args, **kwargs)
        copies += made
        return made

    real_copiable = celery_copies.copiable
    celery_copies.copiable = lambda app, sent_event: False  # type: ignore[assignment]
    built = CeleryTransport(app=app, **options)
    try:
        assert built.send(messages) == [None] * len(messages)
    finally:
        celery_copies.copiable = real_copiable
        built.close()
    by_celery = [received(item) for item in drain(url, queue, len(messages))]

    celery_copies.Copies.publish = counted  # type: ignore[method-assign]
    copying = CeleryTransport(app=app, **options)
    try:
        assert copying.send(messages) == [None] * len(messages)
    finally:
        celery_copies.Copies.publish = real_publish  # type: ignore[method-assign]
        copying.close()
    with_copies = [received(item) for item in drain(url, queue, len(messages))]
    return by_celery, with_copies, copies


@st.composite
def batches(draw: st.DrawFn, queue: str) -> list[OutboxMessage]:
    kinds = draw(
        st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "priority": st.integers(min_value=0, max_value=9),
                    "expires": st.just(600),
                },
            ),
            min_size=1,
            max_size=2,
        )
    )
    names = draw(st.lists(st.sampled_from(["tenant", "id", "kwargsrepr", "x"]), unique=True))
    messages = []
    for n in range(draw(st.integers(min_value=1, max_value=5))):
        options = draw(st.sampled_from(kinds))
        payload = {
            "args": draw(st.lists(json_values, max_size=2)),
            "kwargs": draw(st.dictionaries(st.text(max_size=6), json_values, max_size=2)),
            "options": {"queue": queue, **options},
        }
        headers = {name: draw(st.text(max_size=8)) for name in names}
        key = draw(st.sampled_from([None, "a"]))
        messages.append(
            dataclasses.replace(message(queue, n, key=key), payload=payload, headers=headers)
        )
    return messages


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_copies_are_what_celery_builds(
    mode: tuple[str, dict[str, Any]], data: st.DataObject
) -> None:
    url, options = mode
    queue = new_queue_name("copies-gen")
    try:
        app = celery_app(url)
        messages = data.draw(batches(queue))
        by_celery, with_copies, _ = both_ways(url, options, app, queue, messages)
        assert with_copies == by_celery
    finally:
        delete_queue(url, queue)


def test_one_kind_is_built_once_and_copied(mode: tuple[str, dict[str, Any]]) -> None:
    url, options = mode
    queue = new_queue_name("copies")
    try:
        app = celery_app(url)
        messages = [message(queue, n, key=f"k{n % 2}") for n in range(6)]
        by_celery, with_copies, copies = both_ways(url, options, app, queue, messages)
    finally:
        delete_queue(url, queue)
    assert with_copies == by_celery
    assert copies == 5
    assert [item["headers"]["id"] for item in with_copies] == [m.event_id for m in messages]
