"""An idempotent consumer's ``link`` callbacks and chain steps run exactly once, with real
workers and real brokers (issue 36, "Signatures").

Celery's worker applies a task's callbacks and its chain's next task after each delivery that
succeeds; a duplicate delivery of an idempotent consumer returns None, so Celery alone would run
them again, with None. The consumer takes them over
(:mod:`django_idempotency.events.celery_steps`): the delivery that applies the event writes them
to the outbox in the effect's transaction, a duplicate writes none, and the relay (here, in the
test process) sends them.

* the same event delivered twice with a ``link`` callback: the callback runs once, with the
  result;
* a chain ``consumer | follow_up | follow_up`` delivered twice: each step runs once;
* a worker child SIGKILLed after the commit, before the ack: the redelivery is a duplicate, and
  the callback the first delivery committed runs once, with its result (Celery alone would have
  sent none from the killed child, then one with None from the redelivery);
* a worker child SIGKILLed mid-transaction: its callback rolled back with its effect, and the
  redelivery that applies the event sends the one callback;
* a result the outbox cannot store: the delivery fails and rolls back, the effect and the
  callback with it (nothing in the outbox).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from celery import chain
from celery.result import ResultSet

from django_idempotency import new_event_id
from django_idempotency.models import OutboxEntry, ProcessedEvent
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.transports import CeleryTransport
from testproject.shop.models import Effect
from tests.workers import WorkerGroup, broker_workers_fixture

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.django_db(transaction=True),
]

TIMEOUT = 120.0  # a guard against a hang: real workers on a loaded CI machine


group = broker_workers_fixture(
    "group",
    "canvas",
    workers=1,
    redis_only=dict.fromkeys(
        ("mysql", "sqlite"),
        "MariaDB and SQLite passes: on Redis only (as tests/test_celery_worker.py)",
    ),
)


def wait(group: WorkerGroup, results: list[Any]) -> list[Any]:
    try:
        return list(
            ResultSet(results).join_native(timeout=TIMEOUT, propagate=False, interval=0.05)
        )
    except TimeoutError:
        pytest.fail(f"messages not processed within {TIMEOUT}s\n{group.logs()}")


def relay(group: WorkerGroup) -> int:
    """Send what the consumers wrote to the outbox; how many messages."""
    assert group.publisher is not None
    transport = CeleryTransport(app=group.publisher, broker_url=group.broker_url)
    try:
        return Relay(transports={"default": transport}).drain().sent
    finally:
        transport.close()


def effects(name: str) -> list[str]:
    return sorted(Effect.objects.filter(name=name).values_list("payload", flat=True))


def settled(group: WorkerGroup, names: list[str], expected: int, quiet: float = 2.0) -> None:
    """Wait until the ``names`` Effects number ``expected``, then ``quiet`` seconds more for one
    that would run twice."""
    deadline = time.monotonic() + TIMEOUT
    while sum(len(effects(name)) for name in names) < expected:
        if time.monotonic() > deadline:
            pytest.fail(f"{names}: {[effects(n) for n in names]}\n{group.logs()}")
        time.sleep(0.1)
    time.sleep(quiet)


def signature(group: WorkerGroup, name: str, **kwargs: Any) -> Any:
    assert group.publisher is not None
    return group.publisher.signature(name, kwargs=kwargs, queue=group.queue)


def test_a_callback_runs_once_across_a_duplicate_delivery(group: WorkerGroup) -> None:
    event_id = str(new_event_id())
    tag = f":{event_id}"
    callback = signature(group, "shop.follow_up", tag=tag)
    assert group.publisher is not None
    results = [
        group.publisher.send_task(
            "shop.effect_result",
            kwargs={"event_id": event_id},
            queue=group.queue,
            link=callback,
        )
        for _ in range(2)
    ]

    assert sorted(wait(group, results), key=str) == [f"{event_id}:result", None]
    assert Effect.objects.filter(name="shop.effect_result", payload=event_id).count() == 1
    assert relay(group) == 1  # the delivery that applied it; the duplicate wrote nothing
    settled(group, [f"shop.follow_up{tag}"], 1)
    # Once, with the result: Celery alone would also have run it with the duplicate's None.
    assert effects(f"shop.follow_up{tag}") == [f"{event_id}:result"]


def test_each_step_of_a_chain_runs_once_across_a_duplicate_delivery(group: WorkerGroup) -> None:
    event_id = str(new_event_id())
    assert group.publisher is not None
    first = group.publisher.signature(
        "shop.effect_result", kwargs={"event_id": event_id}, queue=group.queue, immutable=True
    )
    two, three = f":{event_id}:2", f":{event_id}:3"
    # The third step is the plain task's own chain step: Celery's, after the second.
    calls = [
        chain(
            first.clone(),
            signature(group, "shop.follow_up", tag=two),
            signature(group, "shop.follow_up", tag=three),
        ).apply_async()
        for _ in range(2)
    ]
    roots: list[Any] = []
    for call in calls:
        root: Any = call
        while root.parent is not None:
            root = root.parent
        roots.append(root)

    assert sorted(wait(group, roots), key=str) == [f"{event_id}:result", None]
    assert relay(group) == 1
    settled(group, [f"shop.follow_up{two}", f"shop.follow_up{three}"], 2)
    assert effects(f"shop.follow_up{two}") == [f"{event_id}:result"]
    assert effects(f"shop.follow_up{three}") == [f"{event_id}:result+{two}"]


@pytest.mark.parametrize("task", ["shop.crash_after_commit", "shop.crash_before_commit"])
def test_a_callback_runs_once_across_a_sigkill_of_the_worker_child(
    group: WorkerGroup, tmp_path: Path, task: str
) -> None:
    event_id = str(new_event_id())
    tag = f":{event_id}"
    assert group.publisher is not None
    result = group.publisher.send_task(
        task,
        kwargs={"event_id": event_id, "marker": str(tmp_path / "killed")},
        queue=group.queue,
        link=signature(group, "shop.follow_up", tag=tag),
    )

    after_commit = task == "shop.crash_after_commit"
    assert wait(group, [result]) == [None if after_commit else "applied"]
    assert (tmp_path / "killed").exists()
    assert Effect.objects.filter(name=task, payload=event_id).count() == 1
    assert relay(group) == 1
    settled(group, [f"shop.follow_up{tag}"], 1)
    assert effects(f"shop.follow_up{tag}") == ["applied"]


def test_a_rolled_back_effect_publishes_no_callback(group: WorkerGroup) -> None:
    event_id = str(new_event_id())
    tag = f":{event_id}"
    assert group.publisher is not None
    written = OutboxEntry.objects.count()
    result = group.publisher.send_task(
        "shop.effect_result",
        kwargs={"event_id": event_id, "unstorable": True},
        queue=group.queue,
        link=signature(group, "shop.follow_up", tag=tag),
    )

    [outcome] = wait(group, [result])
    assert isinstance(outcome, Exception), outcome
    assert "through the outbox" in str(outcome) and "rolled back" in str(outcome)
    assert Effect.objects.filter(name="shop.effect_result", payload=event_id).count() == 0
    assert not ProcessedEvent.objects.filter(consumer="shop.effect_result", event_id=event_id)
    assert OutboxEntry.objects.count() == written
    time.sleep(2)
    assert effects(f"shop.follow_up{tag}") == []  # nor did Celery's worker run it
