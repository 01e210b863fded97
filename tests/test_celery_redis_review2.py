"""Review of a0082f5: a Redis batch hands a message it does not cover to kombu's own publish.

Generated calls mix messages the pipeline writes, messages kombu publishes (another exchange,
a queue with ``x-expires``, a task's own compression) and messages that fail in kombu (an
unknown compression), with a connection lost at a drawn moment (a flush, the last pipeline,
kombu's publish before or after it wrote). Whatever happens, what ``send`` reports sent is in
Redis, once, in the call's order, and no message is reported sent after an earlier one of its
key failed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu import Exchange, Producer, Queue

from django_idempotency.outbox import celery_redis
from django_idempotency.outbox.transports import CeleryTransport, OutboxMessage
from tests.conftest import require_service
from tests.services import BROKER_URLS
from tests.transport_helpers import celery_app, message
from tests.workers import delete_queue, new_queue_name

pytestmark = pytest.mark.broker

URL = BROKER_URLS["redis"]
KINDS = ["plain", "compressed", "expiring", "exchange", "bad", "bad-ours"]
BAD = {"bad", "bad-ours"}


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    require_service("redis")
    connection = redis.Redis.from_url(URL)
    yield connection
    connection.close()


def mixed_app(base: str) -> Any:
    app = celery_app(URL)
    app.conf.task_default_queue = base
    exchange = Exchange(f"{base}-ex", type="direct")
    app.conf.task_queues = [
        Queue(base, routing_key=base),
        Queue(f"{base}-exp", routing_key=f"{base}-exp", expires=60),
        Queue(f"{base}-ex", exchange, routing_key="x"),
    ]

    @app.task(name="review2.compressed", compression="zlib", shared=False)
    def compressed(*args: Any, **kwargs: Any) -> None:  # pragma: no cover - never run
        pass

    app.finalize()
    return app


def build(base: str, n: int, kind: str, key: str | None) -> OutboxMessage:
    if kind == "plain":
        return message(base, n, key=key)
    if kind == "compressed":
        return dataclasses.replace(message(base, n, key=key), destination="review2.compressed")
    if kind == "expiring":
        return message(f"{base}-exp", n, key=key)
    if kind == "exchange":
        return message(f"{base}-ex", n, key=key, exchange=f"{base}-ex", routing_key="x")
    if kind == "bad":  # kombu's publish fails (not a connection error)
        return message(base, n, key=key, compression="zlib", serializer="no-such-serializer")
    return message(base, n, key=key, serializer="no-such-serializer")  # fails in the batch


def landed(client: Any, base: str) -> dict[str, list[str]]:
    """Task ids per list of the test's queues (priority lists too), oldest first."""
    found: dict[str, list[str]] = {}
    for key in sorted(client.scan_iter(match=f"{base}*")):
        if client.type(key) != b"list":
            continue
        ids = [json.loads(raw)["headers"]["id"] for raw in reversed(client.lrange(key, 0, -1))]
        found[key.decode()] = ids
    return found


class Faults:
    """A connection lost at the n-th pipeline write, or the n-th kombu publish (before it
    writes, or after)."""

    def __init__(self, where: str, at: int) -> None:
        self.where, self.at = where, at
        self.executes = self.publishes = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_execute = celery_redis.RedisBatch.execute
        real_publish = Producer.publish
        faults = self

        def execute(batch: celery_redis.RedisBatch, client: Any) -> None:
            faults.executes += 1
            if faults.where == "execute" and faults.executes == faults.at:
                raise redis.exceptions.ConnectionError("lost (pipeline)")
            real_execute(batch, client)

        def publish(producer: Any, body: Any, **options: Any) -> Any:
            faults.publishes += 1
            hit = faults.publishes == faults.at
            if hit and faults.where == "publish-before":
                raise redis.exceptions.ConnectionError("lost (before kombu wrote)")
            result = real_publish(producer, body, **options)
            if hit and faults.where == "publish-after":
                raise redis.exceptions.ConnectionError("lost (after kombu wrote)")
            return result

        monkeypatch.setattr(celery_redis.RedisBatch, "execute", execute)
        monkeypatch.setattr(Producer, "publish", publish)


def check(
    messages: list[OutboxMessage], results: list[BaseException | None], found: dict[str, Any]
) -> None:
    ids = [m.event_id for m in messages]
    everywhere = [task_id for entries in found.values() for task_id in entries]
    assert len(everywhere) == len(set(everywhere)), "a message written twice"
    position = {task_id: (name, at) for name, entries in found.items() for at, task_id in
                enumerate(entries)}  # fmt: skip
    for index, result in enumerate(results):
        if result is None:
            assert ids[index] in position, f"message {index} reported sent, not in Redis"
    failed_keys: set[str] = set()
    for index, m in enumerate(messages):
        if results[index] is not None and m.ordering_key is not None:
            failed_keys.add(m.ordering_key)
        elif m.ordering_key in failed_keys:
            raise AssertionError(f"message {index} sent after an earlier one of its key failed")
    # Per list, one key's messages are in the call's order.
    for entries in found.values():
        order = [ids.index(task_id) for task_id in entries]
        for key in {m.ordering_key for m in messages} - {None}:
            mine = [i for i in order if messages[i].ordering_key == key]
            assert mine == sorted(mine), (key, mine)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=8),
    keys=st.lists(st.sampled_from([None, "a", "b"]), min_size=8, max_size=8),
    where=st.sampled_from(["none", "execute", "publish-before", "publish-after"]),
    at=st.integers(min_value=1, max_value=4),
)
def test_what_is_reported_sent_is_in_redis_in_order(
    client: Any, kinds: list[str], keys: list[str | None], where: str, at: int
) -> None:
    base = new_queue_name("rv2")
    monkeypatch = pytest.MonkeyPatch()
    try:
        app = mixed_app(base)
        messages = [build(base, n, kind, keys[n]) for n, kind in enumerate(kinds)]
        Faults(where, at).install(monkeypatch)
        transport = CeleryTransport(app=app)
        try:
            results = transport.send(messages)
        finally:
            transport.close()
        monkeypatch.undo()
        for index, kind in enumerate(kinds):
            if kind == "bad":
                assert results[index] is not None
        check(messages, results, landed(client, base))
        if where == "none":
            # Without a lost connection, all but the bad ones (and their keys' later ones).
            assert all(
                (r is None) == (kinds[i] not in BAD and not held(messages, kinds, i))
                for i, r in enumerate(results)
            ), (kinds, results)
    finally:
        monkeypatch.undo()
        for suffix in ("", "-exp", "-ex"):
            delete_queue(URL, base + suffix)


def held(messages: list[OutboxMessage], kinds: list[str], index: int) -> bool:
    key = messages[index].ordering_key
    return key is not None and any(
        kinds[i] in BAD and messages[i].ordering_key == key for i in range(index)
    )


def test_a_queue_with_x_expires_keeps_its_expiry_when_kombu_writes_after_a_flush(
    client: Any,
) -> None:
    """Kombu's publish of a message to a queue with ``x-expires`` sets the lists' expiry, also
    for the later messages of the call (declared once: ``declare=[]``)."""
    base = new_queue_name("rv2-exp")
    try:
        app = mixed_app(base)
        messages = [build(base, 0, "plain", "k")] + [
            build(base, n, "expiring", "k") for n in range(1, 4)
        ]
        transport = CeleryTransport(app=app)
        try:
            assert transport.send(messages) == [None] * 4
        finally:
            transport.close()
        found = landed(client, base)
        assert found[f"{base}-exp"] == [m.event_id for m in messages[1:]]
        assert 0 < client.pttl(f"{base}-exp") <= 60_000
    finally:
        for suffix in ("", "-exp", "-ex"):
            delete_queue(URL, base + suffix)


def test_fanout_and_topic_messages_kombu_publishes_land_as_kombu_writes_them(client: Any) -> None:
    """A message to a fanout exchange (kombu's ``PUBLISH``) or a topic exchange (its bound
    lists) is kombu's own publish, after the batch's earlier messages are written; both ways
    it reports and writes the same."""
    base = new_queue_name("rv2-fan")
    app = celery_app(URL)
    app.conf.task_default_queue = base
    fanout = Exchange(f"{base}-fx", type="fanout")
    topic = Exchange(f"{base}-tx", type="topic")
    app.conf.task_queues = [
        Queue(base, routing_key=base),
        Queue(f"{base}-f", fanout),
        Queue(f"{base}-t", topic, routing_key="t.#"),
    ]
    db = URL.rsplit("/", 1)[1]
    messages = [
        message(base, 0, key="k"),
        message(f"{base}-f", 1, key="k"),
        message(base, 2, key="k"),
        message(f"{base}-t", 3, key="k", routing_key="t.x"),
        message(base, 4, key="k"),
    ]
    seen: dict[bool, tuple[list[str], dict[str, list[str]]]] = {}
    try:
        for fast in (False, True):
            pubsub = client.pubsub()
            pubsub.psubscribe(f"/{db}.{base}-fx*")
            pubsub.get_message(timeout=1)
            transport = CeleryTransport(app=app, fast_redis=fast)
            try:
                assert transport.send(messages) == [None] * 5
            finally:
                transport.close()
            got: list[str] = []
            deadline = time.monotonic() + 30  # a guard: the loop ends at the first message
            while not got and time.monotonic() < deadline:
                item = pubsub.get_message(timeout=0.1)
                if item and item["type"] == "pmessage":
                    got.append(json.loads(item["data"])["headers"]["id"])
            pubsub.close()
            seen[fast] = (got, landed(client, base))
            client.delete(base, f"{base}-t", f"{base}-f")
    finally:
        for suffix in ("", "-f", "-t"):
            delete_queue(URL, base + suffix)
    ids = [m.event_id for m in messages]
    assert seen[True] == seen[False]
    assert seen[True] == ([ids[1]], {base: [ids[0], ids[2], ids[4]], f"{base}-t": [ids[3]]})


def test_a_message_that_fails_after_its_list_append_holds_back_its_key(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message whose build fails after the batch took its entry (here: remembering it as a
    template) is reported failed (it may be in Redis: sent again, at least once); the later
    messages of its key are held back, not reported sent, even when a later flush writes."""
    base = new_queue_name("rv2-mid")
    real = celery_redis.RedisBatch.remember

    def fails_second(batch: celery_redis.RedisBatch, kind: tuple[Any, ...]) -> None:
        if batch.index == 2:
            raise ValueError("after the append")
        real(batch, kind)

    monkeypatch.setattr(celery_redis.RedisBatch, "remember", fails_second)
    try:
        app = mixed_app(base)
        messages = [
            build(base, 0, "plain", "a"),
            build(base, 1, "expiring", "k"),  # kombu's: remember is called, nothing held
            message(base, 2, key="k", priority=3),  # built, then fails after its append
            build(base, 3, "compressed", "k"),  # held back
            build(base, 4, "exchange", "b"),  # a flush: writes 0 and 2
            build(base, 5, "plain", "k"),  # held back
        ]
        transport = CeleryTransport(app=app)
        try:
            results = transport.send(messages)
        finally:
            transport.close()
        assert [r is None for r in results] == [True, True, False, False, True, False]
        found = landed(client, base)
        check(messages, results, found)
        everywhere = {task_id for entries in found.values() for task_id in entries}
        assert messages[2].event_id in everywhere  # failed, yet written: sent again later
        assert messages[3].event_id not in everywhere and messages[5].event_id not in everywhere
    finally:
        for suffix in ("", "-exp", "-ex"):
            delete_queue(URL, base + suffix)
