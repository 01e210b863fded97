"""The Celery consumer base, eagerly and as a unit (real workers: tests/test_celery_worker.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from celery import Task
from celery.contrib.django.task import DjangoTask
from celery.exceptions import Reject
from django.db import OperationalError, transaction

from django_idempotency import new_event_id
from django_idempotency.celery import IdempotentConsumer, IdempotentConsumerMixin
from django_idempotency.exceptions import EventParked, MissingEventId
from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.celery import app
from testproject.shop.models import Effect, LedgerEntry, Order
from testproject.shop.tasks import apply_order_confirmed, effect, effect_audit


class Boom(Exception):
    pass


attempts: list[str] = []
traced: list[str] = []


@app.task(
    base=IdempotentConsumer,
    bind=True,
    name="tests.flaky",
    autoretry_for=(Boom,),
    max_retries=3,
    default_retry_delay=0,
)
def flaky(self: IdempotentConsumer, event_id: str) -> str:
    Effect.objects.create(name="flaky", payload=event_id)
    attempts.append(event_id)
    if len(attempts) == 1:
        raise Boom("first attempt")
    return "applied"


@app.task(base=IdempotentConsumer, bind=True, name="tests.db_error")
def db_error(self: IdempotentConsumer, event_id: str) -> None:
    raise OperationalError("deadlock detected (simulated by the task body)")


@app.task(base=IdempotentConsumer, bind=True, name="tests.fragile", max_deliveries=1)
def fragile(self: IdempotentConsumer, event_id: str) -> None:
    raise Boom("always")


@app.task(base=IdempotentConsumer, bind=True, name="tests.not_late", acks_late=False)
def not_late(self: IdempotentConsumer, event_id: str) -> None:
    return None


class EnvelopeConsumer(IdempotentConsumer):
    """Messages shaped (envelope_id, body): the id is the first positional argument."""

    def get_event_id(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
        return str(args[0]) if args else None


@app.task(base=EnvelopeConsumer, bind=True, name="tests.envelope", consumer="envelopes")
def envelope(self: EnvelopeConsumer, envelope_id: str, body: str) -> str:
    Effect.objects.create(name="envelope", payload=self.request.event_id)
    return body


class TracingTask(Task):  # type: ignore[type-arg]
    """A project's own Task base, to combine with the mixin."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        traced.append(self.name)
        return super().__call__(*args, **kwargs)


class TracedConsumer(IdempotentConsumerMixin, TracingTask):
    """The mixin goes first, so that its ``__call__`` wraps the base's."""


@app.task(base=TracedConsumer, bind=True, name="tests.traced")
def traced_task(self: TracedConsumer, event_id: str) -> str:
    Effect.objects.create(name="traced", payload=event_id)
    return "applied"


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    attempts.clear()
    traced.clear()
    yield


def effects(name: str) -> int:
    return Effect.objects.filter(name=name).count()


def from_broker(task: Any, call: Callable[[], Any]) -> Any:
    """Call ``task`` as a worker would: a request that is neither eager nor a direct call."""
    task.push_request(id="task-id", is_eager=False, called_directly=False)
    try:
        return call()
    finally:
        task.pop_request()


# --- Defaults -----------------------------------------------------------------------------------


def test_defaults_ack_late_and_reject_on_worker_lost() -> None:
    assert effect.acks_late is True
    assert effect.reject_on_worker_lost is True
    assert not_late.acks_late is False  # a task option still overrides the default


def test_the_consumer_name_defaults_to_the_task_name() -> None:
    assert effect.consumer_name == "shop.effect"
    assert effect_audit.consumer_name == "shop.audit"
    assert apply_order_confirmed.consumer_name == "billing.ledger"


def test_the_ready_made_class_keeps_delay_on_commit() -> None:
    assert issubclass(IdempotentConsumer, DjangoTask)
    assert issubclass(IdempotentConsumer, IdempotentConsumerMixin)
    assert callable(apply_order_confirmed.delay_on_commit)


# --- Eager mode ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_eager_delivery_runs_the_body_once(caplog: pytest.LogCaptureFixture) -> None:
    event_id = str(new_event_id())
    with caplog.at_level(logging.INFO, logger="django_idempotency"):
        assert effect.delay(event_id=event_id).get() == "applied"
        assert effect.delay(event_id=event_id).get() is None
    assert effects("shop.effect") == 1
    assert f"duplicate ignored: event {event_id}, consumer shop.effect" in caplog.text


@pytest.mark.django_db
def test_event_id_from_a_header() -> None:
    event_id = str(new_event_id())
    assert effect.apply_async(headers={"event_id": event_id}).get() == "applied"
    assert effect.apply_async(headers={"event_id": event_id}).get() is None
    assert Effect.objects.get().payload == event_id


@pytest.mark.django_db
def test_the_keyword_argument_wins_over_the_header() -> None:
    effect.apply_async(kwargs={"event_id": "from-kwarg"}, headers={"event_id": "from-header"})
    assert Effect.objects.get().payload == "from-kwarg"


@pytest.mark.django_db
def test_event_id_from_the_first_mapping_argument() -> None:
    order = Order.objects.create(reference="A-1", amount_cents=1200)
    event = {"event_id": str(new_event_id()), "order_id": order.pk, "amount_cents": 1200}
    entry_pk = apply_order_confirmed.delay(event).get()
    assert apply_order_confirmed.delay(event).get() is None
    assert list(LedgerEntry.objects.values_list("pk", "event_id", "amount_cents")) == [
        (entry_pk, event["event_id"], 1200)
    ]
    assert ProcessedEvent.objects.get().consumer == "billing.ledger"


@pytest.mark.django_db
def test_get_event_id_can_be_overridden() -> None:
    assert envelope.delay("env-1", "hello").get() == "hello"
    assert envelope.delay("env-1", "hello").get() is None
    assert Effect.objects.get().payload == "env-1"
    assert ProcessedEvent.objects.get().consumer == "envelopes"


@pytest.mark.django_db
def test_two_consumers_of_one_event() -> None:
    event_id = str(new_event_id())
    for _ in range(2):
        effect.delay(event_id=event_id)
        effect_audit.delay(event_id=event_id)
    assert effects("shop.effect") == 1
    assert effects("shop.audit") == 1


@pytest.mark.django_db
def test_autoretry_runs_again_after_a_failed_attempt() -> None:
    event_id = str(new_event_id())
    # throw=False: with CELERY_TASK_EAGER_PROPAGATES, Celery raises an eager Retry instead of
    # retrying (any task does that); apply() retries eagerly when it does not propagate.
    assert flaky.apply(kwargs={"event_id": event_id}, throw=False).get() == "applied"
    assert attempts == [event_id, event_id]
    assert effects("flaky") == 1
    assert ProcessedEvent.objects.filter(event_id=event_id).count() == 1
    delivery = EventDelivery.objects.get()
    assert delivery.deliveries == 2
    assert "first attempt" in delivery.last_error


@pytest.mark.django_db(transaction=True)
def test_publishing_on_commit_delivers_after_the_commit() -> None:
    order = Order.objects.create(reference="A-2", amount_cents=700)
    event = {"event_id": str(new_event_id()), "order_id": order.pk, "amount_cents": 700}
    with transaction.atomic():
        apply_order_confirmed.delay_on_commit(event)
        assert not LedgerEntry.objects.exists()
    assert LedgerEntry.objects.get().amount_cents == 700


@pytest.mark.django_db(transaction=True)
def test_no_publish_when_the_transaction_rolls_back() -> None:
    order = Order.objects.create(reference="A-3", amount_cents=700)
    event = {"event_id": str(new_event_id()), "order_id": order.pk, "amount_cents": 700}
    with pytest.raises(Boom), transaction.atomic():
        apply_order_confirmed.delay_on_commit(event)
        raise Boom
    assert not LedgerEntry.objects.exists()


@pytest.mark.django_db
def test_a_mixin_with_a_project_base() -> None:
    event_id = str(new_event_id())
    assert traced_task.delay(event_id=event_id).get() == "applied"
    assert traced_task.delay(event_id=event_id).get() is None
    assert effects("traced") == 1
    assert traced == ["tests.traced"]  # the base's __call__ runs inside, around the body only
    assert traced_task.acks_late is True


def test_the_mixin_must_come_before_the_task_base() -> None:
    with pytest.raises(TypeError, match="before"):

        class Wrong(TracingTask, IdempotentConsumerMixin):
            pass


@pytest.mark.django_db
def test_eager_without_event_id_raises() -> None:
    with pytest.raises(MissingEventId, match="without an event id"):
        effect.delay()
    assert not EventDelivery.objects.exists()


@pytest.mark.django_db
def test_eager_parked_event_raises() -> None:
    with pytest.raises(Boom):
        fragile.delay(event_id="evt")
    with pytest.raises(EventParked):
        fragile.delay(event_id="evt")


@pytest.mark.django_db
def test_eager_database_error_raises() -> None:
    with pytest.raises(OperationalError):
        db_error.delay(event_id="evt")


# --- From a broker (unit: the request says so; real brokers in test_celery_worker.py) -----------


@pytest.mark.django_db
@pytest.mark.parametrize("kwargs", [{}, {"event_id": ""}, {"event_id": "x" * 256}])
def test_from_a_broker_a_message_without_a_valid_id_is_rejected_for_good(
    kwargs: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.ERROR, logger="django_idempotency"),
        pytest.raises(Reject) as raised,
    ):
        from_broker(effect, lambda: effect(**kwargs))
    assert raised.value.requeue is False
    assert isinstance(raised.value.reason, MissingEventId)
    assert "message rejected, no valid event id: task shop.effect" in caplog.text
    assert not Effect.objects.exists()


@pytest.mark.django_db
def test_from_a_broker_a_parked_event_is_rejected_for_good() -> None:
    with pytest.raises(Boom):
        from_broker(fragile, lambda: fragile(event_id="evt"))
    with pytest.raises(Reject) as raised:
        from_broker(fragile, lambda: fragile(event_id="evt"))
    assert raised.value.requeue is False
    assert isinstance(raised.value.reason, EventParked)
    assert EventDelivery.objects.get().parked_at is not None


@pytest.mark.django_db
def test_from_a_broker_a_database_error_requeues(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(Reject) as raised:
        from_broker(db_error, lambda: db_error(event_id="evt"))
    assert raised.value.requeue is True
    assert isinstance(raised.value.reason, OperationalError)
    assert not ProcessedEvent.objects.exists()
    assert EventDelivery.objects.get().deliveries == 1  # counted, so it cannot loop forever


@pytest.mark.django_db
def test_from_a_broker_a_header_sets_a_request_attribute() -> None:
    """A worker's request carries custom headers as attributes too (Celery protocol 2)."""
    effect.push_request(id="task-id", is_eager=False, called_directly=False, event_id="hdr-1")
    try:
        assert effect() == "applied"
    finally:
        effect.pop_request()
    assert Effect.objects.get().payload == "hdr-1"
