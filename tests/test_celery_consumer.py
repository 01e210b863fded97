"""The Celery consumer base, eagerly and as a unit (real workers: tests/test_celery_worker.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Task
from celery.contrib.django.task import DjangoTask
from celery.exceptions import Ignore, Reject, Retry
from django.db import OperationalError, connection, connections, transaction
from django.test import override_settings

from django_idempotency import new_event_id
from django_idempotency.events.celery import (
    IdempotentConsumer,
    IdempotentConsumerMixin,
    redis_flags_restores,
)
from django_idempotency.events.core import OUTAGE
from django_idempotency.exceptions import EventParked, MissingEventId, OnCommitFailed
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


@app.task(base=IdempotentConsumer, bind=True, name="tests.pay")
def pay(self: IdempotentConsumer, event_id: str, payment_id: str) -> str:
    Effect.objects.create(name="pay", payload=f"{event_id}/{payment_id}")
    return "applied"


@app.task(base=IdempotentConsumer, bind=True, name="tests.ignored")
def ignored(self: IdempotentConsumer, event_id: str) -> None:
    Effect.objects.create(name="ignored", payload=event_id)
    raise Ignore("handled elsewhere")


@app.task(base=IdempotentConsumer, bind=True, name="tests.replaced")
def replaced(self: IdempotentConsumer, event_id: str) -> None:
    Effect.objects.create(name="replaced", payload=event_id)
    raise self.replace(effect.si(event_id=f"{event_id}-next"))


@app.task(base=IdempotentConsumer, bind=True, name="tests.after_commit")
def after_commit_fails(self: IdempotentConsumer, event_id: str) -> None:
    Effect.objects.create(name="after_commit", payload=event_id)

    def notify() -> None:
        raise OperationalError("server closed the connection (in an on_commit callback)")

    transaction.on_commit(notify)


@app.task(base=IdempotentConsumer, bind=True, name="tests.fragile", max_deliveries=1)
def fragile(self: IdempotentConsumer, event_id: str) -> None:
    raise Boom("always")


@app.task(base=IdempotentConsumer, bind=True, name="tests.not_late", acks_late=False)
def not_late(self: IdempotentConsumer, event_id: str) -> None:
    return None


@app.task(
    base=IdempotentConsumer,
    bind=True,
    name="tests.always_retried",
    autoretry_for=(Boom,),
    max_retries=3,
    default_retry_delay=0,
    max_deliveries=5,
)
def always_retried(self: IdempotentConsumer, event_id: str) -> None:
    Effect.objects.create(name="always_retried", payload=event_id)
    raise Boom("always")


@app.task(base=IdempotentConsumer, bind=True, name="tests.retried_by_hand", default_retry_delay=0)
def retried_by_hand(self: IdempotentConsumer, event_id: str, then: str = "raise") -> str:
    """``self.retry(throw=False)``, then: raise the retry, return, raise a database error, or
    raise ``Ignore``."""
    retry = self.retry(exc=Boom("by hand"), throw=False)
    Effect.objects.create(name="retried_by_hand", payload=event_id)
    if then == "raise":
        raise retry
    if then == "database":
        raise OperationalError("deadlock detected (simulated by the task body)")
    if then == "ignore":
        raise Ignore("handled elsewhere")
    return "applied"


@app.task(
    base=IdempotentConsumer,
    bind=True,
    name="tests.retry_unpublishable",
    max_retries=3,
    default_retry_delay=0,
)
def retry_unpublishable(self: IdempotentConsumer, event_id: str) -> None:
    # retry=False: one try at the broker, no backoff (the broker is unreachable in the test).
    raise self.retry(exc=Boom("retried"), retry=False)


@app.task(
    base=IdempotentConsumer,
    bind=True,
    name="tests.retries_exhausted",
    autoretry_for=(Boom,),
    max_retries=0,
    default_retry_delay=0,
)
def retries_exhausted(self: IdempotentConsumer, event_id: str) -> None:
    Effect.objects.create(name="retries_exhausted", payload=event_id)
    raise Boom("no retries left")


@app.task(base=IdempotentConsumer, bind=True, name="tests.calls_itself", default_retry_delay=0)
def calls_itself(self: IdempotentConsumer, event_id: str, inner: bool = False) -> None:
    """Call itself directly (a delivery of another event, nested in this one), then retry."""
    Effect.objects.create(name="calls_itself", payload=event_id)
    if not inner:
        calls_itself(event_id=f"{event_id}-inner", inner=True)
        raise self.retry(exc=Boom("after the nested call"))


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
    assert delivery.last_error == ""  # the success cleared the first attempt's error


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
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"event_id": ""},
        {"event_id": "x" * 256},
        # Unstorable: the driver raised UnicodeEncodeError (the surrogate) or DataError (the NUL,
        # on PostgreSQL) inside the task, which failed and was acked, neither applied nor parked.
        {"event_id": "\ud800abc"},
        {"event_id": "evt\x00"},
        {"event_id": 4.5},
    ],
)
def test_from_a_broker_a_message_without_a_valid_id_is_parked_not_dropped(
    kwargs: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.ERROR, logger="django_idempotency"),
        pytest.raises(Reject) as raised,
    ):
        from_broker(effect, lambda: effect(**kwargs))
    assert raised.value.requeue is False
    assert isinstance(raised.value.reason, MissingEventId)
    assert "MESSAGE PARKED, no usable event id: consumer shop.effect" in caplog.text
    assert not Effect.objects.exists()
    parked = EventDelivery.objects.get()  # where the admin lists parked deliveries
    assert (parked.consumer, parked.event_id) == ("shop.effect", "no-event-id:task-id")
    assert parked.parked_at is not None
    assert "MissingEventId" in parked.last_error
    assert "kwargs=" in parked.last_error  # enough to republish it by hand


@pytest.mark.django_db
def test_from_a_broker_a_task_id_that_cannot_be_stored_still_parks_the_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The task id names the parked row; it comes from the message, so it is escaped too."""
    effect.push_request(id="task\x00\ud800\nid", is_eager=False, called_directly=False)
    try:
        with caplog.at_level(logging.ERROR, logger="django_idempotency"), pytest.raises(Reject):
            effect(event_id="\ud800")
    finally:
        effect.pop_request()
    parked = EventDelivery.objects.get()
    assert parked.event_id == "no-event-id:task\\x00\\ud800\nid"
    assert "InvalidEventId" in parked.last_error or "lone surrogate" in parked.last_error
    # The newline in the task id forged no log line.
    assert all("\n" not in record.getMessage() for record in caplog.records)


@pytest.mark.django_db
def test_from_a_broker_a_parked_event_is_rejected_for_good() -> None:
    with pytest.raises(Boom):
        from_broker(fragile, lambda: fragile(event_id="evt"))
    with pytest.raises(Reject) as raised:
        from_broker(fragile, lambda: fragile(event_id="evt"))
    assert raised.value.requeue is False
    assert isinstance(raised.value.reason, EventParked)
    assert EventDelivery.objects.get().parked_at is not None


def delivered(task: Any, delivery_info: dict[str, Any] | None) -> bool | None:
    task.push_request(id="task-id", delivery_info=delivery_info)
    try:
        return task.broker_redelivered()  # type: ignore[no-any-return]
    finally:
        task.pop_request()


@pytest.mark.parametrize(
    ("broker_url", "flag", "expected"),
    [
        # AMQP vouches for a first delivery: False skips its count.
        ("amqp://guest:guest@127.0.0.1:5672//", False, False),
        ("pyamqp://guest:guest@127.0.0.1:5672//", False, False),
        ("amqp://guest:guest@127.0.0.1:5672//", None, None),  # no delivery information
        ("amqp://guest:guest@127.0.0.1:5672//", True, True),
        # Kombu's Redis transport flags every message it restores (kombu 5.2.4 and later), so
        # a missing flag vouches there too.
        ("redis://127.0.0.1:6379/15", False, False),
        ("redis://127.0.0.1:6379/15", True, True),
        # Elsewhere a missing flag proves nothing (Celery reads it as False): every delivery is
        # counted; a flag that is set is still believed.
        ("memory://", False, None),
        ("memory://", True, True),
    ],
)
def test_the_broker_vouches_for_a_first_delivery_over_amqp_and_redis(
    broker_url: str, flag: bool | None, expected: bool | None
) -> None:
    saved = app.conf.broker_url
    app.conf.broker_url = broker_url
    try:
        info = None if flag is None else {"redelivered": flag}
        assert delivered(effect, info) is expected
    finally:
        app.conf.broker_url = saved


def test_redis_vouches_only_with_a_kombu_that_flags_its_restores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before kombu 5.2.4 a restored Redis message carried the flag only in a header Celery does
    not read: a missing flag proved nothing, and believing it would skip every count of a
    message that kills its worker, so it would never be parked."""
    import kombu

    assert redis_flags_restores((5, 2, 4, "", ""))
    assert redis_flags_restores((5, 7, 0, "", ""))
    assert not redis_flags_restores((5, 2, 3, "", ""))
    saved = app.conf.broker_url
    app.conf.broker_url = "redis://127.0.0.1:6379/15"
    try:
        monkeypatch.setattr(kombu, "VERSION", (5, 2, 3, "", ""))
        assert delivered(effect, {"redelivered": False}) is None
        assert delivered(effect, {"redelivered": True}) is True
    finally:
        app.conf.broker_url = saved


def test_a_hard_time_limit_gives_the_message_back() -> None:
    """Acked at its time limit (Celery's default), a hung message left nothing behind."""
    assert effect.acks_on_timeout is False
    assert effect.reject_on_worker_lost is True


@pytest.mark.django_db
def test_from_an_amqp_broker_a_first_delivery_skips_its_count() -> None:
    saved = app.conf.broker_url
    app.conf.broker_url = "amqp://guest:guest@127.0.0.1:5672//"
    effect.push_request(id="task-id", is_eager=False, called_directly=False)
    try:
        effect.request.delivery_info = {"redelivered": False}
        assert effect(event_id="evt") == "applied"
        assert not EventDelivery.objects.exists()
        effect.request.delivery_info = {"redelivered": True}
        assert effect(event_id="evt") is None  # a duplicate, answered by the count's read
    finally:
        effect.pop_request()
        app.conf.broker_url = saved
    assert Effect.objects.count() == 1


@pytest.fixture
def memory_broker() -> Iterator[Any]:
    """Publish for real, to kombu's in-memory transport, instead of running tasks eagerly."""
    saved = app.conf.broker_url, app.conf.task_always_eager
    app.conf.broker_url, app.conf.task_always_eager = "memory://", False
    _drop_connections()
    try:
        with app.connection_for_write() as connection:
            queue = connection.SimpleQueue("celery")
            queue.clear()
            yield queue
            queue.close()
    finally:
        app.conf.broker_url, app.conf.task_always_eager = saved
        _drop_connections()


def _drop_connections() -> None:
    """Forget pooled broker connections, so the next publish connects to the current URL."""
    app._pool = None
    app.amqp._producer_pool = None


def published(queue: Any) -> list[Any]:
    messages = []
    while True:
        try:
            messages.append(queue.get(block=False))
        except queue.Empty:
            return messages


@pytest.mark.django_db
def test_from_a_broker_a_database_error_backs_off_with_a_countdown(
    memory_broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="django_idempotency"),
        pytest.raises(Retry) as raised,
    ):
        from_broker(db_error, lambda: db_error(event_id="evt"))
    assert isinstance(raised.value.exc, OperationalError)
    assert 0.5 <= float(raised.value.when) <= 1.0  # database_retry_delay=1, halved by jitter
    assert "database error, nothing applied, retrying in" in caplog.text
    assert not ProcessedEvent.objects.exists()
    assert EventDelivery.objects.get().deliveries == 1
    (message,) = published(memory_broker)  # the same message again, later, never lost
    assert message.headers["retries"] == 1
    assert message.headers["eta"] is not None
    assert message.decode()[1] == {"event_id": "evt"}


@contextmanager
def queued_at_statements(queue: Any, model: type[Any]) -> Iterator[list[int]]:
    """The number of messages on ``queue`` at each statement that names ``model``'s table."""
    table = model._meta.db_table
    seen: list[int] = []

    def observe(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if table in sql:
            seen.append(queue.qsize())
        return execute(sql, params, many, context)

    with connection.execute_wrapper(observe):
        yield seen


@pytest.fixture
def vouched_first_delivery() -> Iterator[None]:
    """Read from an AMQP broker (never connected), which vouches for a first delivery, and
    publish to the in-memory one: the failure counts itself after its rollback."""
    saved = app.conf.get("broker_read_url")  # unset: the property would read broker_url
    app.conf.broker_read_url = "amqp://guest:guest@127.0.0.1:5672//"
    try:
        yield
    finally:
        app.conf.broker_read_url = saved


def from_broker_delivery(task: Any, call: Callable[[], Any], first: bool) -> Any:
    """:func:`from_broker`; ``first``: the broker vouches this is a first delivery."""
    task.push_request(id="task-id", is_eager=False, called_directly=False)
    if first:
        task.request.delivery_info = {"redelivered": False}
    try:
        return call()
    finally:
        task.pop_request()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first", [False, True], ids=["counted", "vouched-first-delivery"])
def test_from_a_broker_an_autoretry_is_published_after_the_failure_is_counted(
    memory_broker: Any, request: pytest.FixtureRequest, first: bool
) -> None:
    """Published inside the body, the retry could run in another pool child before this
    delivery had rolled back and counted its failure (tests/test_celery_worker.py races it)."""
    if first:
        request.getfixturevalue("vouched_first_delivery")
    with (
        queued_at_statements(memory_broker, EventDelivery) as seen,
        pytest.raises(Retry) as raised,
    ):
        from_broker_delivery(always_retried, lambda: always_retried(event_id="evt"), first)
    assert isinstance(raised.value.exc, Boom)
    # Counted (before the body, or by the failure itself) and the error recorded, all with
    # nothing on the broker yet.
    assert seen and set(seen) == {0}
    delivery = EventDelivery.objects.get()
    assert delivery.deliveries == 1
    assert "Boom" in delivery.last_error
    assert not effects("always_retried")  # rolled back
    (message,) = published(memory_broker)  # then the retry, once
    assert message.headers["retries"] == 1
    assert message.headers["id"] == "task-id"
    assert message.decode()[1] == {"event_id": "evt"}


@pytest.mark.django_db(transaction=True)
def test_from_a_broker_a_retry_by_hand_is_published_after_the_failure_is_counted(
    memory_broker: Any,
) -> None:
    with queued_at_statements(memory_broker, EventDelivery) as seen, pytest.raises(Retry):
        from_broker(retried_by_hand, lambda: retried_by_hand(event_id="evt"))
    assert seen and set(seen) == {0}
    assert EventDelivery.objects.get().deliveries == 1
    assert len(published(memory_broker)) == 1


@pytest.mark.django_db(transaction=True)
def test_a_retry_after_the_body_called_its_own_task_still_waits_for_the_count(
    memory_broker: Any,
) -> None:
    """The nested call holds its own retries while it runs; once it has returned, the outer
    body's retry is held again, not published inside the body."""
    with queued_at_statements(memory_broker, EventDelivery) as seen, pytest.raises(Retry):
        from_broker(calls_itself, lambda: calls_itself(event_id="evt"))
    assert seen and set(seen) == {0}
    assert "after the nested call" in EventDelivery.objects.get(event_id="evt").last_error
    assert not effects("calls_itself")  # the nested delivery rolled back with this one
    (message,) = published(memory_broker)
    assert message.decode()[1] == {"event_id": "evt"}


@pytest.mark.django_db(transaction=True)
def test_retry_with_throw_false_then_a_return_publishes_after_the_commit(
    memory_broker: Any,
) -> None:
    """Celery's meaning of ``throw=False`` holds (the retry is sent, the task succeeds); the
    retry waits for the commit, so it arrives as a duplicate."""
    with queued_at_statements(memory_broker, Effect) as seen:
        outcome = from_broker(
            retried_by_hand, lambda: retried_by_hand(event_id="evt", then="return")
        )
    assert outcome == "applied"
    assert seen == [0]  # the body's write: after retry(), before the commit
    assert effects("retried_by_hand") == 1
    (message,) = published(memory_broker)
    assert message.headers["retries"] == 1


@pytest.mark.django_db(transaction=True)
def test_retry_with_throw_false_then_ignore_publishes_after_the_commit(
    memory_broker: Any,
) -> None:
    with pytest.raises(Ignore):
        from_broker(retried_by_hand, lambda: retried_by_hand(event_id="evt", then="ignore"))
    assert effects("retried_by_hand") == 1  # committed, as for any Ignore
    assert len(published(memory_broker)) == 1


@pytest.mark.django_db(transaction=True)
def test_a_database_error_after_a_retry_by_hand_retries_once_with_the_backoff(
    memory_broker: Any,
) -> None:
    """The body's retry is dropped for the database's: one message, not two."""
    with pytest.raises(Retry) as raised:
        from_broker(retried_by_hand, lambda: retried_by_hand(event_id="evt", then="database"))
    assert isinstance(raised.value.exc, OperationalError)
    (message,) = published(memory_broker)
    assert message.headers["eta"] is not None  # the backoff's countdown, not the body's 0
    assert not effects("retried_by_hand")


@pytest.mark.django_db(transaction=True)
def test_max_retries_exceeded_raises_the_error_counted_and_publishes_nothing(
    memory_broker: Any,
) -> None:
    with pytest.raises(Boom):
        from_broker(retries_exhausted, lambda: retries_exhausted(event_id="evt"))
    assert not published(memory_broker)
    delivery = EventDelivery.objects.get()
    assert delivery.deliveries == 1
    assert "no retries left" in delivery.last_error
    assert not effects("retries_exhausted")


@pytest.mark.django_db(transaction=True)
def test_a_parked_event_publishes_no_retry(memory_broker: Any) -> None:
    for _ in range(5):  # max_deliveries=5: five failed deliveries, each retried
        with pytest.raises(Retry):
            from_broker(always_retried, lambda: always_retried(event_id="evt"))
    assert len(published(memory_broker)) == 5
    with pytest.raises(Reject) as raised:
        from_broker(always_retried, lambda: always_retried(event_id="evt"))
    assert isinstance(raised.value.reason, EventParked)
    assert not published(memory_broker)
    assert EventDelivery.objects.get().parked_at is not None


@pytest.fixture
def unreachable_broker() -> Iterator[None]:
    """Publish to a port where nothing listens: every publish fails, for real."""
    saved = app.conf.broker_url, app.conf.task_always_eager
    app.conf.broker_url, app.conf.task_always_eager = "redis://127.0.0.1:1/0", False
    _drop_connections()
    try:
        yield
    finally:
        app.conf.broker_url, app.conf.task_always_eager = saved
        _drop_connections()


@pytest.mark.django_db(transaction=True)
def test_a_retry_that_cannot_be_published_rejects_the_message_after_the_count(
    unreachable_broker: None, caplog: pytest.LogCaptureFixture
) -> None:
    """As Celery's retry() does: ``Reject(requeue=False)``; the failure is counted first."""
    with (
        caplog.at_level(logging.ERROR, logger="django_idempotency"),
        pytest.raises(Reject) as raised,
    ):
        from_broker(retry_unpublishable, lambda: retry_unpublishable(event_id="evt"))
    assert raised.value.requeue is False
    failure = raised.value.__cause__
    assert failure is raised.value.reason and "Connection refused" in str(failure)
    context: BaseException | None = failure
    while context is not None and not isinstance(context, Retry):
        context = context.__context__
    assert isinstance(context, Retry)  # raised while the retry it could not publish was
    delivery = EventDelivery.objects.get()
    assert delivery.deliveries == 1
    assert "Boom" in delivery.last_error
    assert "could not publish the retry of event evt" in caplog.text


def database_down(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
    """An execute wrapper: every statement fails as it does when the server is unreachable."""
    raise OperationalError("could not connect to server: Connection refused")


@pytest.mark.django_db
@pytest.mark.parametrize("kwargs", [{"event_id": "evt"}, {}], ids=["with-id", "without-id"])
def test_with_the_database_down_the_message_waits_with_a_countdown(
    memory_broker: Any, kwargs: dict[str, Any]
) -> None:
    """Not requeued at once in a hot loop, not dropped: retried later, until it answers."""
    with connection.execute_wrapper(database_down), pytest.raises(Retry) as raised:
        from_broker(effect, lambda: effect(**kwargs))
    assert 0.5 <= float(raised.value.when) <= 1.0
    (message,) = published(memory_broker)
    assert message.headers["retries"] == 1
    assert message.decode()[1] == kwargs


def lost_connection(vendor: str) -> OperationalError:
    """The error a statement raises when the server has gone away, as each backend says it."""
    if vendor == "mysql":
        return OperationalError(2013, "Lost connection to MySQL server during query")
    if vendor == "sqlite":
        return OperationalError("unable to open database file")
    return OperationalError("server closed the connection unexpectedly")


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_an_outage_of_the_idempotency_database_drops_that_alias_connection(
    memory_broker: Any,
) -> None:
    """IDEMPOTENCY["DATABASE"] names another alias than "default": the lost connection the
    consumer drops is that alias's, where the delivery ran; it used to close "default"'s (a
    healthy one) and leave the lost one open."""
    other = connections["other"]

    def server_gone(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        raise lost_connection(other.vendor)

    connection.ensure_connection()
    other.ensure_connection()
    try:
        with (
            override_settings(IDEMPOTENCY={"DATABASE": "other"}),
            other.execute_wrapper(server_gone),
            pytest.raises(Retry),
        ):
            from_broker(effect, lambda: effect(event_id="evt"))
        assert other.connection is None  # dropped: the next delivery connects again
        assert connection.connection is not None  # the healthy one is left alone
    finally:
        OUTAGE.recovered()  # this test's outage ends with it


def test_the_database_backoff_doubles_up_to_its_ceiling() -> None:
    for retries, low, high in [(0, 0.5, 1.0), (3, 4.0, 8.0), (6, 30.0, 60.0), (500, 30.0, 60.0)]:
        db_error.push_request(retries=retries)
        try:
            assert low <= db_error.database_retry_countdown() <= high
        finally:
            db_error.pop_request()


@pytest.mark.django_db(transaction=True)
def test_an_error_after_the_commit_is_not_a_requeue(memory_broker: Any) -> None:
    """An on_commit callback that raises OperationalError: applied, so never "retry later"."""
    with pytest.raises(OnCommitFailed) as raised:
        from_broker(after_commit_fails, lambda: after_commit_fails(event_id="evt"))
    assert isinstance(raised.value.__cause__, OperationalError)
    assert not published(memory_broker)  # no retry, no requeue
    assert effects("after_commit") == 1
    assert ProcessedEvent.objects.filter(consumer="tests.after_commit").exists()
    assert "OnCommitFailed" in EventDelivery.objects.get().last_error
    # A redelivery is a duplicate: which is why the error must not read as "nothing applied".
    assert from_broker(after_commit_fails, lambda: after_commit_fails(event_id="evt")) is None
    assert effects("after_commit") == 1


@pytest.mark.django_db(transaction=True)
def test_a_later_success_clears_the_last_error() -> None:
    event_id = str(new_event_id())
    assert flaky.apply(kwargs={"event_id": event_id}, throw=False).get() == "applied"
    assert attempts == [event_id, event_id]
    assert EventDelivery.objects.get().last_error == ""


@pytest.mark.django_db
def test_from_a_broker_a_header_sets_a_request_attribute() -> None:
    """A worker's request carries custom headers as attributes too (Celery protocol 2)."""
    effect.push_request(id="task-id", is_eager=False, called_directly=False, event_id="hdr-1")
    try:
        assert effect() == "applied"
    finally:
        effect.pop_request()
    assert Effect.objects.get().payload == "hdr-1"


# --- Where the event id is, and what a missing one does ------------------------------------------


@pytest.mark.django_db
def test_a_positional_event_id_is_found_by_the_signature() -> None:
    event_id = str(new_event_id())
    assert pay.delay(event_id, "p-1").get() == "applied"
    assert pay.delay(event_id, "p-1").get() is None
    assert pay.delay(event_id=event_id, payment_id="p-1").get() is None
    assert from_broker(pay, lambda: pay(event_id, "p-1")) is None
    assert effects("pay") == 1
    assert ProcessedEvent.objects.get().event_id == event_id


@pytest.mark.django_db
def test_an_integer_event_id_is_its_decimal_string() -> None:
    assert pay.delay(42, "p-1").get() == "applied"
    assert pay.delay("42", "p-1").get() is None
    assert ProcessedEvent.objects.get().event_id == "42"


@pytest.mark.django_db
def test_a_direct_call_without_an_event_id_raises_the_documented_error() -> None:
    """No broker to give the message back to: MissingEventId itself, never a Reject."""
    with pytest.raises(MissingEventId, match="without an event id"):
        effect()
    assert not EventDelivery.objects.exists()


@pytest.mark.django_db
def test_a_direct_call_with_a_database_error_raises_it() -> None:
    with pytest.raises(OperationalError):
        db_error(event_id="evt")


# --- Ignore and replace() -----------------------------------------------------------------------


@pytest.mark.django_db
def test_ignore_commits_before_it_is_raised() -> None:
    """Celery acks an Ignore and never redelivers: what the body did must commit."""
    with pytest.raises(Ignore):
        from_broker(ignored, lambda: ignored(event_id="evt"))
    assert effects("ignored") == 1
    assert ProcessedEvent.objects.filter(consumer="tests.ignored", event_id="evt").exists()
    assert from_broker(ignored, lambda: ignored(event_id="evt")) is None  # a duplicate now
    assert effects("ignored") == 1


@pytest.mark.django_db
def test_replace_commits_and_a_duplicate_does_not_publish_again(memory_broker: Any) -> None:
    with pytest.raises(Ignore):
        from_broker(replaced, lambda: replaced(event_id="evt"))
    assert from_broker(replaced, lambda: replaced(event_id="evt")) is None  # a duplicate
    assert effects("replaced") == 1
    messages = published(memory_broker)
    assert [message.decode()[1] for message in messages] == [{"event_id": "evt-next"}]
