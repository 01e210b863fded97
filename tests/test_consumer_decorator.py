"""@idempotent_consumer for plain consumer functions, and the money double protection recipe."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections, transaction

from django_idempotency import idempotent_consumer, new_event_id
from django_idempotency.exceptions import EventParked, MissingEventId, OnCommitFailed
from django_idempotency.models import EventDelivery, ProcessedEvent
from django_idempotency.signals import event_duplicate
from testproject.shop.models import Effect, Order, Payment
from testproject.shop.tasks import PaymentMismatch, on_payment_captured

JOIN_TIMEOUT = 60.0  # a guard against a hang, never a timing


class Boom(Exception):
    pass


@idempotent_consumer("billing.order-confirmed", event_id=lambda evt: evt["id"], topic="orders")
def on_order_confirmed(evt: dict[str, Any]) -> str:
    """Write one effect per event."""
    Effect.objects.create(name="billing", payload=evt["id"])
    return f"applied {evt['id']}"


@idempotent_consumer("shipping")
def by_default(*args: Any, **kwargs: Any) -> int:
    Effect.objects.create(name="shipping")
    return Effect.objects.filter(name="shipping").count()


@pytest.mark.django_db
def test_the_body_runs_once_per_event(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="django_idempotency"):
        assert on_order_confirmed({"id": "evt-1"}) == "applied evt-1"
        assert on_order_confirmed({"id": "evt-1"}) is None
        assert on_order_confirmed({"id": "evt-2"}) == "applied evt-2"
    assert Effect.objects.filter(name="billing").count() == 2
    assert "duplicate ignored: event evt-1, consumer billing.order-confirmed" in caplog.text
    assert ProcessedEvent.objects.get(event_id="evt-1").topic == "orders"


@pytest.mark.django_db
def test_a_duplicate_sends_the_signal() -> None:
    received: list[dict[str, Any]] = []

    def receiver(sender: str, **kwargs: Any) -> None:
        received.append({"sender": sender, "event_id": kwargs["event_id"]})

    event_duplicate.connect(receiver)
    try:
        on_order_confirmed({"id": "evt-1"})
        on_order_confirmed({"id": "evt-1"})
    finally:
        event_duplicate.disconnect(receiver)
    assert received == [{"sender": "billing.order-confirmed", "event_id": "evt-1"}]


@pytest.mark.django_db
def test_default_event_id_from_keyword_or_first_mapping() -> None:
    event_id = new_event_id()
    assert by_default(event_id=event_id) == 1
    assert by_default({"event_id": str(event_id)}) is None  # the same id, as a str
    assert by_default({"event_id": "other"}, "more") == 2
    assert sorted(ProcessedEvent.objects.values_list("event_id", flat=True)) == sorted(
        [str(event_id), "other"]
    )


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((), {}), (("not a mapping",), {}), (({"no": "id"},), {}), ((), {"event_id": None})],
)
def test_no_event_id_raises(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    with pytest.raises(MissingEventId, match="without an event id"):
        by_default(*args, **kwargs)
    assert not Effect.objects.exists()


@pytest.mark.django_db
def test_an_invalid_event_id_raises() -> None:
    with pytest.raises(ValueError, match="empty"):
        on_order_confirmed({"id": ""})


@pytest.mark.django_db(transaction=True)
def test_a_failing_body_leaves_no_effect_and_no_reservation() -> None:
    attempts: list[int] = []

    @idempotent_consumer("flaky")
    def flaky(event_id: str) -> str:
        Effect.objects.create(name="flaky")
        attempts.append(1)
        if len(attempts) == 1:
            raise Boom
        return "ok"

    with pytest.raises(Boom):
        flaky(event_id="evt")
    assert not Effect.objects.exists()
    assert not ProcessedEvent.objects.exists()
    assert flaky(event_id="evt") == "ok"
    assert Effect.objects.count() == 1
    assert EventDelivery.objects.get().deliveries == 2


@pytest.mark.django_db(transaction=True)
def test_inside_an_outer_transaction_the_reservation_rolls_back_with_it() -> None:
    with pytest.raises(Boom), transaction.atomic():
        assert on_order_confirmed({"id": "evt"}) == "applied evt"
        raise Boom
    assert not ProcessedEvent.objects.exists()
    assert on_order_confirmed({"id": "evt"}) == "applied evt"


@pytest.mark.django_db
def test_a_poison_event_is_parked() -> None:
    @idempotent_consumer("fragile", max_deliveries=1, topic=lambda evt: evt["topic"])
    def fragile(evt: dict[str, Any]) -> None:
        raise Boom

    with pytest.raises(Boom):
        fragile({"event_id": "evt", "topic": "t"})
    with pytest.raises(EventParked):
        fragile({"event_id": "evt", "topic": "t"})
    delivery = EventDelivery.objects.get()
    assert delivery.parked_at is not None
    assert delivery.topic == "t"


@pytest.mark.django_db(transaction=True)
def test_redelivered_is_read_from_each_message() -> None:
    @idempotent_consumer(
        "amqp-loop", event_id=lambda msg: msg["id"], redelivered=lambda msg: msg["redelivered"]
    )
    def handle(msg: dict[str, Any]) -> str:
        Effect.objects.create(name="amqp-loop", payload=msg["id"])
        return "applied"

    # The broker vouches for a first delivery: no count.
    assert handle({"id": "a", "redelivered": False}) == "applied"
    assert not EventDelivery.objects.exists()
    # A redelivery of an event whose first delivery died: counted for both.
    assert handle({"id": "b", "redelivered": True}) == "applied"
    assert EventDelivery.objects.get(event_id="b").deliveries == 2
    # No word from the broker: counted as every delivery is by default.
    assert handle({"id": "c", "redelivered": None}) == "applied"
    assert EventDelivery.objects.get(event_id="c").deliveries == 1
    assert Effect.objects.filter(name="amqp-loop").count() == 3


def test_the_wrapper_keeps_the_function_identity() -> None:
    assert on_order_confirmed.__name__ == "on_order_confirmed"
    assert on_order_confirmed.__doc__ == "Write one effect per event."


def test_a_coroutine_function_is_refused() -> None:
    with pytest.raises(TypeError, match="coroutine"):

        @idempotent_consumer("async")
        async def handler(evt: dict[str, Any]) -> None:  # pragma: no cover - never runs
            return None


@pytest.mark.parametrize("name", ["", "x" * 256])
def test_an_invalid_consumer_name_is_refused_at_decoration(name: str) -> None:
    with pytest.raises(ValueError):
        idempotent_consumer(name)


# --- Money double protection --------------------------------------------------------------------


@pytest.fixture
def order(db: None) -> Order:
    return Order.objects.create(reference="A-1", amount_cents=1999)


def captured(order: Order, event_id: str, external_id: str = "pi_123", amount: int = 1999) -> Any:
    return {
        "event_id": event_id,
        "order_id": order.pk,
        "provider": "stripe",
        "external_payment_id": external_id,
        "amount_cents": amount,
    }


def test_the_same_event_twice_records_one_payment(order: Order) -> None:
    event_id = str(new_event_id())
    payment_pk = on_payment_captured(captured(order, event_id))
    assert on_payment_captured(captured(order, event_id)) is None
    assert list(Payment.objects.values_list("pk", flat=True)) == [payment_pk]


def test_a_new_event_for_a_known_payment_returns_the_existing_row(order: Order) -> None:
    """The provider resends the webhook under a new event id: the unique constraint holds."""
    first = on_payment_captured(captured(order, str(new_event_id())))
    second = on_payment_captured(captured(order, str(new_event_id())))
    assert first == second
    assert Payment.objects.count() == 1
    assert ProcessedEvent.objects.filter(consumer="payments.captured").count() == 2


def test_a_conflicting_payment_is_refused_and_rolled_back(order: Order) -> None:
    on_payment_captured(captured(order, "evt-1"))
    with pytest.raises(PaymentMismatch, match="already recorded"):
        on_payment_captured(captured(order, "evt-2", amount=1))
    assert not ProcessedEvent.objects.filter(event_id="evt-2").exists()
    assert Payment.objects.get().amount_cents == 1999


@pytest.fixture
def committed_order(transactional_db: None) -> Iterator[Order]:
    yield Order.objects.create(reference="A-2", amount_cents=500)


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.mysql
def test_racing_events_for_one_payment_record_it_once(committed_order: Order) -> None:
    """Four deliveries under four event ids race on one provider payment id: one row."""
    count = 4
    barrier = threading.Barrier(count, timeout=JOIN_TIMEOUT)
    results: list[Any] = []
    errors: list[BaseException] = []

    def deliver(event_id: str) -> None:
        try:
            barrier.wait()
            results.append(on_payment_captured(captured(committed_order, event_id, amount=500)))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=deliver, args=(str(new_event_id()),)) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT)
    assert not errors, errors
    assert len(results) == count
    assert len(set(results)) == 1
    assert Payment.objects.count() == 1


@idempotent_consumer("payments.apply")
def apply_payment(event_id: str, payment_id: str) -> str:
    Effect.objects.create(name="payments", payload=f"{event_id}/{payment_id}")
    return "applied"


@pytest.mark.django_db
def test_a_positional_event_id_parameter_is_found() -> None:
    event_id = str(new_event_id())
    assert apply_payment(event_id, "p-1") == "applied"
    assert apply_payment(event_id, "p-1") is None
    assert apply_payment(event_id=event_id, payment_id="p-1") is None
    assert apply_payment(42, "p-2") == "applied"  # type: ignore[arg-type]
    assert apply_payment("42", "p-2") is None  # an integer id is its decimal string
    assert Effect.objects.filter(name="payments").count() == 2


@pytest.mark.django_db(transaction=True)
def test_an_error_after_the_commit_is_on_commit_failed() -> None:
    @idempotent_consumer("notify")
    def notify(event_id: str) -> None:
        Effect.objects.create(name="notify", payload=event_id)
        transaction.on_commit(lambda: (_ for _ in ()).throw(Boom("webhook down")))

    with pytest.raises(OnCommitFailed) as raised:
        notify("evt-1")
    assert isinstance(raised.value.__cause__, Boom)
    assert ProcessedEvent.objects.filter(consumer="notify", event_id="evt-1").exists()
    assert notify("evt-1") is None  # applied: a redelivery is a duplicate
    assert "OnCommitFailed: Event evt-1" in EventDelivery.objects.get().last_error
