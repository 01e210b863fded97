"""Review s3: an idempotent consumer's callbacks and chain step (celery_steps.take_over) when the
delivery that took them over does not commit."""

from __future__ import annotations

from typing import Any

import pytest
from celery.exceptions import Retry
from django.db import OperationalError, connection

from django_idempotency.models import OutboxEntry, ProcessedEvent
from testproject.shop.tasks import effect_result, follow_up
from tests.test_celery_consumer import memory_broker, published  # noqa: F401 - a fixture

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_database_lost_at_the_commit_keeps_the_callbacks_and_chain_in_the_retry(
    memory_broker: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """take_over cleared request.callbacks and request.chain inside the body; the COMMIT then
    fails with a lost database: nothing committed (no outbox row), and the consumer retries the
    message later from its request. That retry must still carry the link and the chain step,
    else they are lost for good."""
    callback = dict(follow_up.s(tag=":link"))
    step = dict(follow_up.s(tag=":2").set(task_id="step-2"))
    real_commit = connection._commit
    calls: list[int] = []

    def commit_once_lost() -> Any:
        if not calls and connection.run_on_commit:  # process_event's transaction
            calls.append(1)
            raise OperationalError("server closed the connection unexpectedly")
        return real_commit()

    monkeypatch.setattr(connection, "_commit", commit_once_lost)
    effect_result.push_request(
        id="task-id", is_eager=False, called_directly=False, callbacks=[callback], chain=[step]
    )
    try:
        with pytest.raises(Retry):
            effect_result(event_id="evt-commit-lost")
    finally:
        effect_result.pop_request()
    monkeypatch.undo()

    assert not ProcessedEvent.objects.exists()
    assert not OutboxEntry.objects.exists()  # rolled back with the effect
    (message,) = published(memory_broker)
    _, _, embed = message.decode()
    assert [c["kwargs"] for c in embed["callbacks"] or ()] == [{"tag": ":link"}]
    assert [c["kwargs"] for c in embed["chain"] or ()] == [{"tag": ":2"}]


def test_a_group_after_the_consumer_is_left_to_celery_not_a_delivery_failed_for_ever() -> None:
    """``consumer.s() | group(a.s(), b.s())`` and ``link=group(...)``: Celery runs them; the
    outbox carries no group. Taking them over failed every delivery (the event was never
    applied, then parked) where, before the takeover, Celery's worker published them."""
    from celery import group
    from celery.app.task import Context
    from django.db import transaction

    from django_idempotency.events import celery_steps

    fan_out = dict(group(follow_up.s(tag=":a"), follow_up.s(tag=":b")))
    plain = dict(follow_up.s(tag=":link"))
    request = Context(
        {"id": "pid", "root_id": "rid", "callbacks": [fan_out, plain], "chain": [fan_out]}
    )

    with transaction.atomic():
        celery_steps.take_over(effect_result, request, "E:result", "E")

    [row] = OutboxEntry.objects.all()  # the plain callback, through the outbox
    assert row.payload["kwargs"] == {"tag": ":link"}
    assert request.callbacks == [fan_out]  # the group: Celery's worker publishes it
    assert request.chain == [fan_out]

    duplicate = Context({"id": "pid", "callbacks": [fan_out, plain], "chain": [fan_out]})
    celery_steps.clear(duplicate)
    assert duplicate.callbacks == [fan_out] and duplicate.chain == [fan_out]


def test_a_chain_step_in_a_group_is_left_to_celery_not_a_delivery_failed_for_ever() -> None:
    """``group(a.s() | consumer.s() | b.s(), ...)``: Celery freezes ``b`` with the group's
    ``group_id`` and ``group_index`` (its result joins the group's), which the outbox refuses.
    Taken over, every delivery of the consumer failed."""
    from unittest import mock

    from celery import chain, group
    from celery.app.task import Context
    from django.db import transaction

    from django_idempotency.events import celery_steps

    chains: list[Any] = []

    def send_task(name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        chains.append(options.get("chain"))
        return mock.MagicMock()

    app = follow_up.app
    in_group = group(chain(follow_up.s(), effect_result.s(), follow_up.s(tag=":b")), follow_up.s())
    eager, app.conf.task_always_eager = app.conf.task_always_eager, False
    try:
        with mock.patch.object(app, "send_task", send_task):
            in_group.apply_async()
    finally:
        app.conf.task_always_eager = eager
    [rest] = [found for found in chains if found]  # the chain's first message carries the rest
    step = rest[0]  # b, which the consumer's delivery carries as its chain
    assert step["options"].get("group_id")  # as Celery sends it in the consumer's chain
    request = Context({"id": "pid", "root_id": "rid", "callbacks": None, "chain": [step]})

    with transaction.atomic():
        celery_steps.take_over(effect_result, request, "E:result", "E")

    assert not OutboxEntry.objects.exists()
    assert request.chain == [step]  # Celery's worker publishes it, in its group
