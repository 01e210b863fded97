"""The Celery transport's own Redis pipeline writes what kombu writes, message by message.

``CeleryTransport`` on Redis writes a batch in a pipeline of its own
(:mod:`django_idempotency.outbox.celery_redis`): the first message of a kind built by Celery
and a stand-in for kombu's ``Producer.publish``, the others copies of it. Each test sends the
same messages both ways (``fast_redis=False`` is kombu's ``Producer.batch``) and compares the
raw entries of every Redis list they landed in; only the delivery tag (a fresh uuid per
message) and an ``expires`` moment (computed at each publish) may differ.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import signals
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu import Queue

from django_idempotency.outbox import celery_redis
from django_idempotency.outbox.transports import CeleryTransport, OutboxMessage
from tests.conftest import require_service
from tests.services import BROKER_URLS
from tests.transport_helpers import celery_app, message
from tests.workers import delete_queue, new_queue_name

pytestmark = pytest.mark.broker

URL = BROKER_URLS["redis"]


@pytest.fixture(scope="module")
def redis_client() -> Any:
    require_service("redis")
    import redis

    client = redis.Redis.from_url(URL)
    yield client
    client.close()


@pytest.fixture
def queue() -> Iterator[str]:
    require_service("redis")
    name = new_queue_name("celery-redis")
    yield name
    delete_queue(URL, name)


def written(client: Any, queue: str) -> dict[bytes, list[dict[str, Any]]]:
    """Every entry of every list of ``queue`` (its priority lists too), oldest first, taken
    off Redis; the delivery tag and the expiry moment set aside."""
    lists: dict[bytes, list[dict[str, Any]]] = {}
    for key in sorted(client.scan_iter(match=f"{queue}*")):
        if client.type(key) != b"list":
            continue
        entries = [json.loads(raw) for raw in reversed(client.lrange(key, 0, -1))]
        client.delete(key)
        for entry in entries:
            assert entry["properties"].pop("delivery_tag")
            if entry["headers"].get("expires") is not None:
                entry["headers"]["expires"] = "<a moment>"
                assert entry["properties"].pop("expiration")
        lists[key] = entries
    return lists


@contextmanager
def counting_copies() -> Iterator[list[int]]:
    """Count the messages :meth:`RedisBatch.copy` makes as copies while the block runs, in
    the one-item list it yields."""
    copies = [0]
    real_copy = celery_redis.RedisBatch.copy

    def counted(self: celery_redis.RedisBatch, *args: Any, **kwargs: Any) -> bool:
        made = real_copy(self, *args, **kwargs)
        copies[0] += made
        return made

    celery_redis.RedisBatch.copy = counted  # type: ignore[method-assign]
    try:
        yield copies
    finally:
        celery_redis.RedisBatch.copy = real_copy  # type: ignore[method-assign]


def both_ways(
    client: Any, app: Any, queue: str, messages: list[OutboxMessage]
) -> tuple[dict[bytes, list[dict[str, Any]]], dict[bytes, list[dict[str, Any]]], int]:
    """``(kombu's lists, ours, copies made)`` for the same messages, sent one way then the
    other."""
    kombu = CeleryTransport(app=app, fast_redis=False)
    try:
        assert kombu.send(messages) == [None] * len(messages)
    finally:
        kombu.close()
    by_kombu = written(client, queue)
    ours = CeleryTransport(app=app)
    try:
        with counting_copies() as copies:
            assert ours.send(messages) == [None] * len(messages)
    finally:
        ours.close()
    return by_kombu, written(client, queue), copies[0]


# --- Generated messages ------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
header_names = st.sampled_from(["tenant", "traceparent", "id", "argsrepr", "origin", "x-a"])


@st.composite
def batches(draw: st.DrawFn, queue: str) -> list[OutboxMessage]:
    count = draw(st.integers(min_value=1, max_value=6))
    # A few kinds per batch, so that most messages are copies of an earlier one.
    kinds = draw(
        st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "priority": st.integers(min_value=0, max_value=9),
                    "routing_key": st.just(queue),
                    "expires": st.sampled_from([600, 3600.5]),
                },
            ),
            min_size=1,
            max_size=3,
        )
    )
    header_sets = draw(st.lists(st.lists(header_names, unique=True, max_size=3), min_size=1))
    messages = []
    for n in range(count):
        options = draw(st.sampled_from(kinds))
        names = draw(st.sampled_from(header_sets))
        outgoing = message(queue, n, key=draw(st.sampled_from([None, "a", "b"])), **options)
        payload = {
            "args": draw(st.lists(json_values, max_size=3)),
            "kwargs": draw(st.dictionaries(st.text(max_size=8), json_values, max_size=3)),
            "options": {"queue": queue, **options},
        }
        headers = {name: draw(st.text(max_size=12)) for name in names}
        destination = draw(st.sampled_from(["shop.effect", "celery_redis.own_options"]))
        messages.append(
            dataclasses.replace(
                outgoing, destination=destination, payload=payload, headers=headers
            )
        )
    return messages


def generated_app(queue: str) -> Any:
    app = celery_app(URL)
    app.conf.task_default_queue = queue
    app.conf.task_routes = {"celery_redis.own_options": {"priority": 2}}  # a map: by name

    @app.task(name="celery_redis.own_options", time_limit=30, shared=False)
    def own_options(*args: Any, **kwargs: Any) -> None:  # pragma: no cover - never run
        pass

    app.finalize()
    return app


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_generated_batches_land_as_kombu_writes_them(
    redis_client: Any, data: st.DataObject
) -> None:
    queue = new_queue_name("celery-redis-gen")
    try:
        app = generated_app(queue)
        messages = data.draw(batches(queue))
        by_kombu, ours, _ = both_ways(redis_client, app, queue, messages)
        assert ours == by_kombu
        assert sum(len(entries) for entries in ours.values()) == len(messages)
    finally:
        delete_queue(URL, queue)


# --- Copies, and what they leave to Celery -----------------------------------------------------


def test_a_batch_of_one_kind_is_one_message_built_and_copies(
    redis_client: Any, queue: str
) -> None:
    app = celery_app(URL)
    messages = [message(queue, n, key=f"k{n % 3}", priority=4) for n in range(20)]

    by_kombu, ours, copies = both_ways(redis_client, app, queue, messages)

    assert ours == by_kombu
    assert copies == 19
    (entries,) = ours.values()  # one list: the priority's
    assert [entry["headers"]["id"] for entry in entries] == [m.event_id for m in messages]


def test_every_message_a_batch_writes_has_a_delivery_tag_of_its_own(
    redis_client: Any, queue: str
) -> None:
    """Issue 35 item 21: kombu keeps a worker's unacknowledged Redis messages by delivery tag
    (the ``unacked`` hash it restores when a worker dies): two messages sharing a tag are one
    entry there, and a worker that died holding both gives one back. Two batches, each of
    copies of one message (one kind), messages Celery builds one by one (an expiry) and another
    kind (another priority's list): every entry written has its own tag, the copies' too."""
    app = celery_app(URL)
    transport = CeleryTransport(app=app)
    sent = 0
    try:
        with counting_copies() as copies:
            for _ in range(2):
                messages = [
                    *(message(queue, n, key=f"k{n % 3}", priority=4) for n in range(12)),
                    *(message(queue, 12 + n, expires=600) for n in range(3)),
                    *(message(queue, 15 + n, key="k0") for n in range(3)),
                ]
                assert transport.send(messages) == [None] * len(messages)
                sent += len(messages)
    finally:
        transport.close()

    tags = [
        json.loads(raw)["properties"]["delivery_tag"]
        for key in redis_client.scan_iter(match=f"{queue}*")
        if redis_client.type(key) == b"list"
        for raw in redis_client.lrange(key, 0, -1)
    ]
    assert copies[0] == 2 * (11 + 2)  # per batch: 11 of the first kind, 2 of the third
    assert len(tags) == sent
    assert len(set(tags)) == sent, sorted(tags)


def test_messages_with_an_expiry_are_each_built_by_celery(redis_client: Any, queue: str) -> None:
    app = celery_app(URL)
    messages = [message(queue, n, expires=600) for n in range(5)]

    by_kombu, ours, copies = both_ways(redis_client, app, queue, messages)

    assert ours == by_kombu
    assert copies == 0


def test_a_publish_signal_receiver_sees_every_message(redis_client: Any, queue: str) -> None:
    app = celery_app(URL)
    seen: list[str] = []

    def stamp(sender: Any = None, headers: Any = None, **kwargs: Any) -> None:
        seen.append(headers["id"])
        headers["stamped"] = "yes"

    signals.before_task_publish.connect(stamp, weak=False)
    try:
        messages = [message(queue, n) for n in range(4)]
        by_kombu, ours, copies = both_ways(redis_client, app, queue, messages)
    finally:
        signals.before_task_publish.disconnect(stamp)

    assert copies == 0
    assert ours == by_kombu
    assert [entry["headers"]["stamped"] for entry in ours[queue.encode()]] == ["yes"] * 4
    assert len(seen) == 8  # each message, each way


def test_a_router_function_routes_every_message(redis_client: Any, queue: str) -> None:
    app = celery_app(URL)
    odd = f"{queue}-odd"

    def by_argument(name: str, args: Any, kwargs: Any, options: Any, **_: Any) -> Any:
        return {"queue": odd} if kwargs.get("n", 0) % 2 else None

    app.conf.task_routes = (by_argument,)
    messages = [
        dataclasses.replace(message(queue, n), payload={"args": [], "kwargs": {"n": n}})
        for n in range(4)
    ]
    app.conf.task_default_queue = queue
    try:
        by_kombu, ours, copies = both_ways(redis_client, app, queue, messages)
    finally:
        delete_queue(URL, odd)

    assert copies == 0
    assert ours == by_kombu
    assert {key.decode() for key in ours} == {queue, odd}


@pytest.mark.parametrize("case", ["exchange", "x-expires"])
def test_what_it_does_not_cover_goes_through_kombu(
    redis_client: Any, queue: str, case: str
) -> None:
    app = celery_app(URL)
    if case == "exchange":
        from kombu import Exchange

        exchange = Exchange(f"{queue}-ex", type="direct")
        app.conf.task_queues = [Queue(queue, exchange, routing_key=queue)]
        options: dict[str, Any] = {"exchange": exchange.name, "routing_key": queue}
    else:
        app.conf.task_queues = [Queue(queue, routing_key=queue, expires=60)]
        options = {}
    messages = [message(queue, n, **options) for n in range(3)]
    written_by_us: list[str] = []
    real = celery_redis.RedisBatch.execute

    def recorded(self: celery_redis.RedisBatch, client: Any) -> None:
        written_by_us.extend(self.lists)
        real(self, client)

    celery_redis.RedisBatch.execute = recorded  # type: ignore[method-assign]
    try:
        by_kombu, ours, _ = both_ways(redis_client, app, queue, messages)
    finally:
        celery_redis.RedisBatch.execute = real  # type: ignore[method-assign]

    assert written_by_us == []  # nothing of the batch was written by the pipeline of our own
    assert ours == by_kombu
    assert sum(len(entries) for entries in ours.values()) == 3


def test_task_sent_events_are_published_as_kombu_publishes_them(
    redis_client: Any, queue: str
) -> None:
    """With ``task_send_sent_event``, each message's ``task-sent`` event goes out too.

    On Redis, Celery's event exchange is a fanout (a ``PUBLISH``). The event is published
    through the producer ``send_task_message`` was given: a :class:`RedisBatch` refused it
    (review of d6510f5), and the event dispatcher swallowed that (``buffer_while_offline``), so
    the events were never sent and piled up in the app's default dispatcher's buffer."""
    import time

    app = celery_app(URL)
    app.conf.task_default_queue = queue
    app.conf.task_send_sent_event = True
    db = URL.rsplit("/", 1)[1]
    messages = [message(queue, n) for n in range(3)]
    seen: dict[bool, list[bytes]] = {}
    for fast in (False, True):
        pubsub = redis_client.pubsub()
        pubsub.psubscribe(f"/{db}.celeryev/*")
        pubsub.get_message(timeout=1)  # the subscription's confirmation
        transport = CeleryTransport(app=app, fast_redis=fast)
        try:
            assert transport.send(messages) == [None] * 3
        finally:
            transport.close()
        events: list[bytes] = []
        deadline = time.monotonic() + 30  # a guard: the loop ends at the third event
        while len(events) < 3 and time.monotonic() < deadline:
            item = pubsub.get_message(timeout=0.1)
            if item and item["type"] == "pmessage":
                events.append(item["channel"])
        pubsub.close()
        seen[fast] = events
        assert redis_client.llen(queue) == 3
        redis_client.delete(queue)

    assert seen[True] == seen[False] == [f"/{db}.celeryev/task.sent".encode()] * 3
    assert not app.amqp._event_dispatcher._outbound_buffer


def test_publish_signal_receivers_see_each_message_once_when_a_batch_needs_kombu(
    redis_client: Any, queue: str
) -> None:
    """A message the pipeline does not cover goes through kombu. With a receiver on the publish
    signals (OpenTelemetry's Celery instrumentation is one), each message is announced once:
    the batch used to be built a second time through kombu, so the messages built before the
    one not covered were announced twice, published once (review of d6510f5)."""
    from kombu import Exchange

    app = celery_app(URL)
    app.conf.task_default_queue = queue
    other = f"{queue}-ex"
    exchange = Exchange(other, type="direct")
    app.conf.task_queues = [Queue(queue, routing_key=queue), Queue(other, exchange, "x")]
    seen: list[tuple[str, str]] = []

    def before(headers: Any = None, **_: Any) -> None:
        seen.append(("before", headers["id"]))

    def after(headers: Any = None, **_: Any) -> None:
        seen.append(("after", headers["id"]))

    messages = [
        message(queue, 0),
        message(queue, 1),
        message(other, 2, exchange=exchange.name, routing_key="x"),
    ]
    expected = [(when, m.event_id) for m in messages for when in ("before", "after")]
    signals.before_task_publish.connect(before, weak=False)
    signals.after_task_publish.connect(after, weak=False)
    try:
        for fast in (False, True):
            seen.clear()
            transport = CeleryTransport(app=app, fast_redis=fast)
            try:
                assert transport.send(messages) == [None] * 3
            finally:
                transport.close()
            assert seen == expected
            assert redis_client.llen(queue) == 2
            assert redis_client.llen(other) == 1
            redis_client.delete(queue, other)
    finally:
        signals.before_task_publish.disconnect(before)
        signals.after_task_publish.disconnect(after)
        delete_queue(URL, other)


def test_a_batch_that_needs_kombu_has_one_send_span_a_message(
    redis_client: Any, queue: str
) -> None:
    """One ``idempotency.outbox.send`` span a message, also when one of the batch goes through
    kombu (a batch built again used to give its earlier messages a second span)."""
    from kombu import Exchange

    from tests.otel_helpers import sdk

    otel = sdk()
    app = celery_app(URL)
    app.conf.task_default_queue = queue
    other = f"{queue}-ex"
    exchange = Exchange(other, type="direct")
    app.conf.task_queues = [Queue(queue, routing_key=queue), Queue(other, exchange, "x")]
    messages = [
        message(queue, 0),
        message(queue, 1),
        message(other, 2, exchange=exchange.name, routing_key="x"),
    ]
    spans: dict[bool, list[str]] = {}
    try:
        for fast in (False, True):
            otel.spans.clear()
            transport = CeleryTransport(app=app, fast_redis=fast)
            try:
                assert transport.send(messages) == [None] * 3
            finally:
                transport.close()
            spans[fast] = [span.name for span in otel.finished()]
            redis_client.delete(queue, other)
    finally:
        delete_queue(URL, other)
    assert spans[False] == ["idempotency.outbox.send"] * 3
    assert spans[True] == spans[False]


def compressed_app(queue: str) -> Any:
    app = celery_app(URL)
    app.conf.task_default_queue = queue

    @app.task(name="celery_redis.compressed", compression="zlib", shared=False)
    def compressed(*args: Any, **kwargs: Any) -> None:  # pragma: no cover - never run
        pass

    app.finalize()
    return app


def test_a_message_kombu_publishes_keeps_its_place_in_the_list(
    redis_client: Any, queue: str
) -> None:
    """The batch writes what it holds before kombu publishes a message it does not cover (a
    task with its own compression), so one list keeps the call's order."""
    app = compressed_app(queue)
    messages = [
        dataclasses.replace(message(queue, n, key="k"), destination=destination)
        for n, destination in enumerate(
            ["shop.effect", "celery_redis.compressed", "shop.effect", "shop.effect"]
        )
    ]

    by_kombu, ours, _ = both_ways(redis_client, app, queue, messages)

    assert ours == by_kombu
    assert [entry["headers"]["id"] for entry in ours[queue.encode()]] == [
        m.event_id for m in messages
    ]


def test_what_was_written_before_a_failure_counts_as_sent(redis_client: Any, queue: str) -> None:
    """The messages written before kombu published one (and that one) are sent, even when the
    batch's last pipeline then fails: only the rest is reported failed, and sent again."""
    app = compressed_app(queue)
    messages = [
        dataclasses.replace(message(queue, n), destination=destination)
        for n, destination in enumerate(
            ["shop.effect", "celery_redis.compressed", "shop.effect", "shop.effect"]
        )
    ]
    real = celery_redis.RedisBatch.execute
    calls = 0

    def fails_last(self: celery_redis.RedisBatch, client: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # the first is the flush before kombu's publish
            raise ConnectionError("Redis went away")
        real(self, client)

    transport = CeleryTransport(app=app)
    celery_redis.RedisBatch.execute = fails_last  # type: ignore[method-assign]
    try:
        results = transport.send(messages)
    finally:
        celery_redis.RedisBatch.execute = real  # type: ignore[method-assign]
        transport.close()

    assert results[:2] == [None, None]
    assert all(isinstance(result, ConnectionError) for result in results[2:]), results
    written = [entry["headers"]["id"] for entry in written_entries(redis_client, queue)]
    assert written == [messages[0].event_id, messages[1].event_id]


def written_entries(client: Any, queue: str) -> list[dict[str, Any]]:
    return [entry for entries in written(client, queue).values() for entry in entries]
