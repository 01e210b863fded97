"""Proofs against real Celery workers, real brokers and real SIGKILLs.

Every test publishes to a pair of ``celery -A testproject worker`` subprocesses (prefork pool,
concurrency 4 each) on a queue of its own, waits for the final state of every message it sent
(duplicates included, through the Redis result backend), and only then counts effects in the
database. The workers are started once per broker for the whole module; each test uses fresh
event ids.

Where each proof runs:

* PostgreSQL pass: every proof, on Redis and on RabbitMQ.
* MariaDB pass: every proof, on Redis only. The MariaDB code paths (a savepointed insert,
  errno 1062, the counting upsert) do not depend on the broker, and the broker behaviours
  (redelivery after a lost child, reject without requeue) are already proven on both brokers in
  the PostgreSQL pass; running them twice more would only cost time.
* SQLite pass: every proof but the volume one, on Redis only. SQLite is a development database
  that serializes all writers (every worker waits on one file lock), which the proofs survive,
  but 4,000 messages take over a minute.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from celery.result import ResultSet
from django.db import connection

from django_idempotency import new_event_id
from django_idempotency.events.celery import redis_flags_restores
from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.shop.models import Effect
from tests.workers import WorkerGroup, broker_workers_fixture

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.django_db(transaction=True),
]

RESULT_TIMEOUT = 120.0  # a guard against a hang: real workers on a loaded CI machine
SQLITE_SKIPS = {
    "test_two_thousand_events_delivered_twice_give_two_thousand_effects": (
        "SQLite pass: the volume proof runs on PostgreSQL and MariaDB; SQLite serializes every "
        "writer, and 4,000 messages take over a minute there"
    ),
}


workers = broker_workers_fixture(
    "workers",
    "workers",
    redis_only={
        "mysql": "MariaDB pass: worker proofs run on Redis only (see the module docstring)",
        "sqlite": "SQLite pass: worker proofs run on Redis only (see the module docstring)",
    },
    doc="Two worker processes (concurrency 4 each) on one broker, for the whole module.",
)


@pytest.fixture
def group(workers: WorkerGroup, request: pytest.FixtureRequest) -> WorkerGroup:
    if connection.vendor == "sqlite" and request.node.originalname in SQLITE_SKIPS:
        pytest.skip(SQLITE_SKIPS[request.node.originalname])
    return workers


def wait(group: WorkerGroup, results: list[Any], timeout: float = RESULT_TIMEOUT) -> list[Any]:
    """The final value of each result (the exception for a failed one), in order."""
    try:
        return list(
            ResultSet(results).join_native(timeout=timeout, propagate=False, interval=0.05)
        )
    except TimeoutError:
        pytest.fail(f"messages not processed within {timeout}s\n{group.logs()}")


def effects(consumer: str, event_id: object) -> int:
    return Effect.objects.filter(name=consumer, payload=str(event_id)).count()


def deliveries(consumer: str, event_id: object) -> EventDelivery:
    return EventDelivery.objects.get(consumer=consumer, event_id=str(event_id))


def counter(consumer: str, event_id: object) -> EventDelivery | None:
    return EventDelivery.objects.filter(consumer=consumer, event_id=str(event_id)).first()


def first_deliveries_counted(group: WorkerGroup) -> bool:
    """A first delivery skips its count where the broker's redelivered flag vouches for it
    (IdempotentConsumerMixin.broker_redelivered): AMQP's on RabbitMQ, and kombu's on Redis,
    which flags every message it restores since kombu 5.2.4."""
    if group.broker_url.startswith("amqp"):
        return False
    return not (group.broker_url.startswith("redis") and redis_flags_restores())


def test_same_event_published_twice_gives_one_effect(group: WorkerGroup) -> None:
    event_id = new_event_id()
    results = [group.publish("shop.effect", kwargs={"event_id": str(event_id)}) for _ in range(2)]

    assert Counter(wait(group, results)) == {"applied": 1, None: 1}
    assert effects("shop.effect", event_id) == 1
    assert (
        ProcessedEvent.objects.filter(consumer="shop.effect", event_id=str(event_id)).count() == 1
    )
    if first_deliveries_counted(group):
        # The copy that arrived after the commit was answered by the count's read, not counted.
        assert deliveries("shop.effect", event_id).deliveries in (1, 2)
    else:
        # Two first deliveries (two messages): neither counted, nothing failed.
        assert counter("shop.effect", event_id) is None


def test_event_id_in_a_message_header(group: WorkerGroup) -> None:
    event_id = str(new_event_id())
    results = [group.publish("shop.effect", headers={"event_id": event_id}) for _ in range(2)]

    assert Counter(wait(group, results)) == {"applied": 1, None: 1}
    assert effects("shop.effect", event_id) == 1


def test_message_without_event_id_is_parked_not_retried(group: WorkerGroup) -> None:
    (result,) = [group.publish("shop.effect")]

    (outcome,) = wait(group, [result])
    assert result.state == "FAILURE"
    assert "without an event id" in str(outcome)
    assert not Effect.objects.exists()
    parked = deliveries("shop.effect", f"no-event-id:{result.id}")
    assert parked.parked_at is not None
    assert "MissingEventId" in parked.last_error
    assert "MESSAGE PARKED, no usable event id" in group.logs()


def test_positional_event_id_published_twice_gives_one_effect(group: WorkerGroup) -> None:
    event_id = str(new_event_id())
    results = [group.publish("shop.effect", args=[event_id]) for _ in range(2)]

    assert Counter(wait(group, results)) == {"applied": 1, None: 1}
    assert effects("shop.effect", event_id) == 1


def test_ten_publishes_at_once_on_two_workers_give_one_effect(group: WorkerGroup) -> None:
    event_id = str(new_event_id())
    with group.producer() as producer:
        results = [
            group.publish(
                "shop.effect", kwargs={"event_id": event_id, "sleep": 0.3}, producer=producer
            )
            for _ in range(10)
        ]

    outcomes = wait(group, results)
    assert outcomes.count("applied") == 1
    assert outcomes.count(None) == 9
    assert effects("shop.effect", event_id) == 1
    if first_deliveries_counted(group):
        delivery = deliveries("shop.effect", event_id)
        # Copies counted while the first was in flight (a copy that arrives after its commit
        # is answered as a duplicate without being counted); concurrent duplicates are never
        # parked.
        assert 1 <= delivery.deliveries <= 10
        assert delivery.parked_at is None
    else:
        assert counter("shop.effect", event_id) is None  # ten first deliveries, none failed
    received = [
        sum(1 for r in results if f"[{r.id}] received" in w.output()) for w in group.workers
    ]
    assert all(received), f"both worker processes took messages: {received}"


def test_failure_then_autoretry_gives_one_effect(group: WorkerGroup, tmp_path: Path) -> None:
    event_id = str(new_event_id())
    marker = tmp_path / "attempted"
    result = group.publish(
        "shop.flaky_effect", kwargs={"event_id": event_id, "marker": str(marker)}
    )

    assert wait(group, [result]) == ["applied"]
    assert marker.exists()  # the first attempt ran and failed
    assert effects("shop.flaky_effect", event_id) == 1
    assert ProcessedEvent.objects.filter(event_id=event_id).count() == 1
    delivery = deliveries("shop.flaky_effect", event_id)
    if first_deliveries_counted(group):
        assert delivery.deliveries == 2  # both counted
    else:
        # The failure counted itself before its retry was published; the retry (a new message,
        # a first delivery) did not count.
        assert delivery.deliveries == 1
    assert delivery.last_error == ""  # the success cleared the failed attempt's error


@pytest.mark.parametrize("task", ["shop.retry_lingers", "shop.autoretry_lingers"])
def test_a_retry_runs_only_after_its_failed_delivery_is_counted(
    group: WorkerGroup, tmp_path: Path, task: str
) -> None:
    """Each run fails and lingers a second after ``self.retry()`` (its own call, or autoretry's),
    before the failure rolls back and counts. A retry published there would run meanwhile in
    another pool child and find one failure fewer counted (and could run once more than
    ``max_deliveries``); held until the failure is counted, it never overtakes it."""
    event_id = str(new_event_id())
    runs = tmp_path / "runs"
    runs.mkdir()
    result = group.publish(task, kwargs={"event_id": event_id, "marker_dir": str(runs)})

    (outcome,) = wait(group, [result])
    assert result.state == "FAILURE"
    assert "parked" in str(outcome)
    # Run n (retries n) found every earlier failure counted: n of them, one more if the broker
    # does not vouch for a first delivery (it is counted before it runs).
    before = 1 if first_deliveries_counted(group) else 0
    seen = sorted(marker.name for marker in runs.iterdir())
    assert seen == [f"{n}-{n + before}" for n in range(3)], group.logs()
    delivery = deliveries(task, event_id)
    assert delivery.parked_at is not None
    assert delivery.deliveries == 4  # max_deliveries=3 runs, then the retry refused
    assert effects(task, event_id) == 0


def test_database_errors_back_off_then_apply_once(group: WorkerGroup, tmp_path: Path) -> None:
    event_id = str(new_event_id())
    marker = tmp_path / "attempts"
    result = group.publish(
        "shop.database_unavailable", kwargs={"event_id": event_id, "marker": str(marker)}
    )

    assert wait(group, [result]) == ["applied"]
    assert marker.read_text() == "xx"  # two attempts failed before the third applied
    assert effects("shop.database_unavailable", event_id) == 1
    logs = group.logs()
    assert logs.count("retrying in") >= 2, logs  # a countdown each time, no hot requeue
    assert "(retry 1)" in logs and "(retry 2)" in logs


def test_replace_commits_and_a_duplicate_does_not_replace_again(group: WorkerGroup) -> None:
    event_id = str(new_event_id())
    results = [group.publish("shop.replaced", kwargs={"event_id": event_id}) for _ in range(2)]

    assert Counter(wait(group, results)) == {"applied": 1, None: 1}
    assert effects("shop.replaced", event_id) == 1  # committed, though the task raised Ignore
    assert effects("shop.effect", f"{event_id}-next") == 1  # the replacement ran once
    assert ProcessedEvent.objects.filter(consumer="shop.replaced", event_id=event_id).exists()


def test_worker_child_killed_mid_task_is_redelivered_and_applied_once(
    group: WorkerGroup, tmp_path: Path
) -> None:
    event_id = str(new_event_id())
    marker = tmp_path / "killed"
    result = group.publish(
        "shop.crash_before_commit", kwargs={"event_id": event_id, "marker": str(marker)}
    )

    assert wait(group, [result]) == ["applied"]
    assert marker.exists()
    assert effects("shop.crash_before_commit", event_id) == 1
    # On RabbitMQ the killed first delivery skipped its count; the redelivery counted for it.
    assert deliveries("shop.crash_before_commit", event_id).deliveries == 2
    assert "SIGKILL" in group.logs()
    assert all(w.process.poll() is None for w in group.workers)


def test_worker_killed_after_commit_before_ack_skips_the_redelivery(
    group: WorkerGroup, tmp_path: Path
) -> None:
    event_id = str(new_event_id())
    marker = tmp_path / "killed"
    result = group.publish(
        "shop.crash_after_commit", kwargs={"event_id": event_id, "marker": str(marker)}
    )

    # The first delivery committed, then died before its ack; the redelivery is a duplicate.
    assert wait(group, [result]) == [None]
    assert marker.exists()
    assert effects("shop.crash_after_commit", event_id) == 1
    if first_deliveries_counted(group):
        assert deliveries("shop.crash_after_commit", event_id).deliveries == 1  # not the copy
    else:
        # The first delivery skipped its count; the redelivery found the event processed.
        assert counter("shop.crash_after_commit", event_id) is None


def test_poison_message_is_parked_and_the_worker_goes_on(group: WorkerGroup) -> None:
    poison_id, next_id = str(new_event_id()), str(new_event_id())
    poison = group.publish("shop.poison", kwargs={"event_id": poison_id})
    after = group.publish("shop.effect", kwargs={"event_id": next_id})

    poison_outcome, after_outcome = wait(group, [poison, after])
    assert after_outcome == "applied"
    assert poison.state == "FAILURE"
    assert "parked" in str(poison_outcome)
    delivery = deliveries("shop.poison", poison_id)
    assert delivery.parked_at is not None
    assert delivery.deliveries == 3  # max_deliveries=2 on shop.poison, then parked
    assert effects("shop.poison", poison_id) == 0  # every attempt died before its commit
    assert not ProcessedEvent.objects.filter(consumer="shop.poison").exists()
    assert "EVENT PARKED" in group.logs()
    assert all(w.process.poll() is None for w in group.workers)


def test_two_consumers_of_one_event_apply_it_once_each(group: WorkerGroup) -> None:
    event_id = str(new_event_id())
    results = [
        group.publish(task, kwargs={"event_id": event_id})
        for task in ("shop.effect", "shop.effect_audit", "shop.effect", "shop.effect_audit")
    ]

    assert Counter(wait(group, results)) == {"applied": 2, None: 2}
    assert effects("shop.effect", event_id) == 1
    assert effects("shop.audit", event_id) == 1


def test_many_events_delivered_twice_give_one_effect_each(group: WorkerGroup) -> None:
    # Each event's two deliveries race on the group's concurrent workers; a few hundred events
    # give hundreds of such races, which is what the proof needs (thousands only add minutes).
    count = 400
    event_ids = [str(uuid.uuid4()) for _ in range(count)]
    started = time.monotonic()
    with group.producer() as producer:
        results = [
            group.publish("shop.effect", kwargs={"event_id": event_id}, producer=producer)
            for event_id in event_ids
            for _ in range(2)
        ]
    published = time.monotonic()

    outcomes = wait(group, results, timeout=240)
    done = time.monotonic()
    print(
        f"\n[{2 * count} messages: published in {published - started:.1f}s, "
        f"processed in {done - started:.1f}s, {2 * count / (done - started):.0f} msg/s]"
    )
    assert outcomes.count("applied") == count
    assert outcomes.count(None) == count
    assert Effect.objects.filter(name="shop.effect").count() == count
    assert Effect.objects.values("payload").distinct().count() == count
    assert ProcessedEvent.objects.filter(consumer="shop.effect").count() == count
