"""Proofs against real Dramatiq workers (``python -m dramatiq tests.dramatiq_app``), real
brokers (RabbitMQ and Redis) and real SIGKILLs, for ``idempotent_actor``.

Where each proof runs: PostgreSQL pass, on RabbitMQ and Redis; MariaDB and SQLite passes, on
Redis (the broker behaviours are proven on both brokers in the PostgreSQL pass).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("dramatiq")

from django.db import connection

from django_idempotency import new_event_id
from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.shop.models import Effect
from tests.conftest import require_service
from tests.dramatiq_workers import DramatiqGroup, dramatiq_group
from tests.services import BROKER_URLS
from tests.workers import database_url

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.django_db(transaction=True)]


@pytest.fixture(params=sorted(BROKER_URLS))
def group(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DramatiqGroup]:
    broker = request.param
    if connection.vendor != "postgresql" and broker != "redis":
        pytest.skip("MariaDB and SQLite passes: Dramatiq proofs run on Redis only")
    require_service(broker)
    with dramatiq_group(
        broker_url=BROKER_URLS[broker],
        db_url=database_url(connection.settings_dict),
        log_dir=tmp_path,
        label=broker,
    ) as started:
        yield started


def effects(consumer: str, event_id: object) -> int:
    return Effect.objects.filter(name=consumer, payload=str(event_id)).count()


def processed(consumer: str, event_id: object) -> bool:
    return ProcessedEvent.objects.filter(consumer=consumer, event_id=str(event_id)).exists()


def test_an_event_sent_twice_applies_once(group: DramatiqGroup) -> None:
    event_id = str(new_event_id())
    group.send("effect", event_id=event_id)
    group.send("effect", event_id=event_id)
    group.wait_for(lambda: processed("dq.effect", event_id), "the event")
    group.wait_for(lambda: "duplicate ignored" in group.logs(), "the duplicate")
    assert effects("dq.effect", event_id) == 1


def test_killed_before_the_commit_the_redelivery_applies_once(
    group: DramatiqGroup, tmp_path: Path
) -> None:
    event_id = str(new_event_id())
    marker = tmp_path / "killed-before"
    group.send("crash_before_commit", event_id=event_id, marker=str(marker))
    group.wait_for(marker.exists, "the SIGKILL inside the transaction")
    group.wait_exit(group.workers[-1])
    assert effects("dq.crash_before_commit", event_id) == 0  # rolled back with the process
    group.start()
    group.wait_for(lambda: processed("dq.crash_before_commit", event_id), "the redelivery")
    assert effects("dq.crash_before_commit", event_id) == 1
    # Both deliveries counted: on Redis each counts itself; on RabbitMQ the first one skipped
    # its count (redelivered flag unset) and the flagged redelivery counted for both.
    delivery = EventDelivery.objects.get(consumer="dq.crash_before_commit", event_id=event_id)
    assert delivery.deliveries == 2


def test_killed_after_the_commit_the_redelivery_is_skipped(
    group: DramatiqGroup, tmp_path: Path
) -> None:
    event_id = str(new_event_id())
    marker = tmp_path / "killed-after"
    group.send("crash_after_commit", event_id=event_id, marker=str(marker))
    group.wait_for(marker.exists, "the SIGKILL after the commit")
    group.wait_exit(group.workers[-1])
    assert effects("dq.crash_after_commit", event_id) == 1  # committed, never acknowledged
    group.start()
    group.wait_for(lambda: "duplicate ignored" in group.workers[-1].output(), "the redelivery")
    assert effects("dq.crash_after_commit", event_id) == 1


def test_poison_is_parked_within_its_limit_and_healthy_messages_apply_once(
    group: DramatiqGroup,
) -> None:
    raises = str(new_event_id())
    healthy = [str(new_event_id()) for _ in range(5)]
    bad_ids = {"nul": "evt\x00nul", "surrogate": "evt-\ud800", "huge": "x" * 1_000_000}
    group.send("poison", event_id=raises)
    for name, bad in bad_ids.items():
        group.send("effect", event_id=bad, payload=name)
    group.send("effect", payload="no event id")
    for event_id in healthy:
        group.send("effect", event_id=event_id, payload="y" * 100_000)  # big but healthy
        group.send("effect", event_id=event_id)

    def parked_poison() -> bool:
        row = EventDelivery.objects.filter(consumer="dq.poison", event_id=raises).first()
        return row is not None and row.parked_at is not None

    group.wait_for(parked_poison, "the raising message to be parked")
    group.wait_for(lambda: all(processed("dq.effect", e) for e in healthy), "the healthy messages")
    no_id = EventDelivery.objects.filter(consumer="dq.effect", event_id__startswith="no-event-id:")
    group.wait_for(lambda: no_id.count() == 4, "the four messages without a usable id")
    assert all(row.parked_at is not None for row in no_id)
    poison = EventDelivery.objects.get(consumer="dq.poison", event_id=raises)
    assert poison.deliveries == 4  # max_deliveries=3 ran and failed, the fourth was parked
    assert effects("dq.poison", raises) == 0  # every attempt rolled back
    assert not processed("dq.poison", raises)
    for event_id in healthy:
        assert effects("dq.effect", event_id) == 1
    assert group.workers[-1].process.poll() is None  # the worker went on


# --- In process (no worker): declaration and direct calls ----------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_direct_call_applies_once_and_raises_its_errors() -> None:
    """Called directly there is no broker to give a message back to: the errors are raised."""
    from dramatiq.brokers.stub import StubBroker

    from django_idempotency.events.dramatiq import IdempotentMessages, idempotent_actor
    from django_idempotency.exceptions import MissingEventId

    bare = StubBroker(middleware=[])  # no Retries: no "throws" option to extend
    full = StubBroker()

    for broker in (bare, full):

        @idempotent_actor(broker=broker, consumer=f"dq.direct-{id(broker)}")
        def apply(event_id: str) -> None:
            Effect.objects.create(name="dq.direct", payload=event_id)

        assert any(isinstance(m, IdempotentMessages) for m in broker.middleware)
        event_id = str(new_event_id())
        apply(event_id)
        apply(event_id)
        assert effects("dq.direct", event_id) == 1
        with pytest.raises(MissingEventId):
            apply(None)  # type: ignore[arg-type]
    actor = full.get_actor("apply")
    assert set(actor.options["throws"]) >= {MissingEventId}
