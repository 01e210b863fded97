"""Arbitrary event ids through ``idempotent_actor``, on every database pass.

Each message is either applied exactly once however often it is delivered, or, for an id that
cannot be stored, refused before the database sees it: from a broker it is parked under
``no-event-id:<message id>`` and failed without a retry (``MissingEventId``, which the actor's
``throws`` holds). Never a driver error, never a skipped or repeated effect.
"""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, given, settings

pytest.importorskip("dramatiq")

import dramatiq
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker

from django_idempotency.events.dramatiq import IdempotentMessages, idempotent_actor
from django_idempotency.exceptions import MissingEventId
from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.shop.models import Effect
from tests.test_event_ids_hypothesis import ANY_TEXT, storable

pytestmark = pytest.mark.django_db

BROKER = StubBroker()
MIDDLEWARE = IdempotentMessages()


@idempotent_actor(broker=BROKER, consumer="dq.hypothesis", actor_name="dq_hypothesis")
def apply(event_id: str) -> None:
    Effect.objects.create(name="dq.hypothesis", payload=str(len(event_id)))


def deliver(event_id: str) -> None:
    """As Dramatiq's worker runs a message: the middleware first, then the actor."""
    message = dramatiq.Message(
        queue_name="default",
        actor_name="dq_hypothesis",
        args=(event_id,),
        kwargs={},
        options={},
        message_id=str(uuid.uuid4()),
    )
    proxy = MessageProxy(message)
    MIDDLEWARE.before_process_message(BROKER, proxy)
    try:
        apply(*proxy.args)
    finally:
        MIDDLEWARE.after_process_message(BROKER, proxy)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(event_id=ANY_TEXT)
def test_every_id_applies_once_or_is_parked(event_id: str) -> None:
    Effect.objects.filter(name="dq.hypothesis").delete()
    parked_before = EventDelivery.objects.filter(
        consumer="dq.hypothesis", event_id__startswith="no-event-id:"
    ).count()
    if storable(event_id):
        deliver(event_id)
        deliver(event_id)  # redelivered: a duplicate
        assert Effect.objects.filter(name="dq.hypothesis").count() == 1
        EventDelivery.objects.filter(consumer="dq.hypothesis").delete()
        ProcessedEvent.objects.filter(consumer="dq.hypothesis").delete()
    else:
        with pytest.raises(MissingEventId):
            deliver(event_id)
        assert not Effect.objects.filter(name="dq.hypothesis").exists()
        parked = EventDelivery.objects.filter(
            consumer="dq.hypothesis", event_id__startswith="no-event-id:"
        )
        assert parked.count() == parked_before + 1
        assert all(row.parked_at is not None for row in parked)
