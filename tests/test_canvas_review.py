"""Review of issue 36's canvas takeover (an idempotent consumer's ``link`` callbacks and chain
step through the outbox): a poisoned callback or chain step, the parent's priority, duplicates
run eagerly. Without a worker: deliveries are pushed requests, as tests/test_review_s3_canvas.py
does; the real workers are tests/test_celery_canvas_worker.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction

from django_idempotency.events import celery_steps
from django_idempotency.models import OutboxEntry, ProcessedEvent
from testproject.shop.models import Effect
from testproject.shop.tasks import effect_result, follow_up

pytestmark = pytest.mark.django_db(transaction=True)


def deliver(event_id: str, **request: Any) -> Any:
    """One delivery of ``effect_result`` as a worker runs it (from a broker); the request it ran
    under, as the worker reads it afterwards (its callbacks and chain)."""
    effect_result.push_request(
        id=f"task-{event_id}", is_eager=False, called_directly=False, **request
    )
    try:
        ran = effect_result.request
        effect_result(event_id=event_id)
        return ran
    finally:
        effect_result.pop_request()


def _deep(levels: int) -> Any:
    value: Any = "bottom"
    for _ in range(levels):
        value = [value]
    return value


POISONS = {
    # Celery passes an option it does not know on to the broker (message properties).
    "unknown option": lambda: follow_up.s(tag=":p").set(expiration=60),
    # Celery's worker would publish these as they are; the outbox refuses them.
    "over the payload limit": lambda: follow_up.s(tag=":p" + "x" * (1024 * 1024 + 10)),
    "nested too deep": lambda: follow_up.s(_deep(40), tag=":p"),
    "a tuple for pickle": lambda: follow_up.s((1, 2), tag=":p").set(serializer="pickle"),
}


@pytest.fixture(params=sorted(POISONS))
def poison(request: pytest.FixtureRequest) -> dict[str, Any]:
    return dict(POISONS[request.param]())


def test_a_poisoned_callback_is_left_to_celery_and_the_event_is_applied(
    poison: dict[str, Any],
) -> None:
    """A callback the outbox refuses whatever the result (its own arguments or options): the
    takeover failed every delivery, so the event was never applied (the task failed for good,
    the message was acked) where Celery alone would have applied it and published the callback.
    It is left to Celery's worker, as a group is; the healthy callback still leaves through the
    outbox, once."""
    healthy = dict(follow_up.s(tag=":ok"))

    ran = deliver("evt-poison", callbacks=[healthy, poison], chain=None)

    assert ProcessedEvent.objects.filter(event_id="evt-poison").exists()
    assert Effect.objects.filter(name="shop.effect_result").count() == 1
    [row] = OutboxEntry.objects.all()
    assert row.payload["kwargs"] == {"tag": ":ok"}
    assert row.payload["args"] == ["evt-poison:result"]
    assert ran.callbacks == [poison]  # Celery's worker publishes it

    again = deliver("evt-poison", callbacks=[healthy, poison], chain=None)  # a duplicate

    assert OutboxEntry.objects.count() == 1
    assert again.callbacks == [poison]  # as a group: Celery's, on every delivery


def test_a_poisoned_chain_step_is_left_to_celery_and_the_event_is_applied(
    poison: dict[str, Any],
) -> None:
    ran = deliver("evt-poison-chain", callbacks=None, chain=[poison])

    assert ProcessedEvent.objects.filter(event_id="evt-poison-chain").exists()
    assert not OutboxEntry.objects.exists()
    assert ran.chain == [poison]


def test_a_callback_holding_a_nul_is_left_to_celery_on_postgresql() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's jsonb alone refuses a NUL")
    nul = dict(follow_up.s("a\x00b", tag=":nul"))

    ran = deliver("evt-nul", callbacks=[nul], chain=None)

    assert ProcessedEvent.objects.filter(event_id="evt-nul").exists()
    assert ran.callbacks == [nul]


def test_a_chain_step_holding_a_lone_surrogate_is_left_to_celery() -> None:
    """A JSON message may carry ``"\\ud800"``, which decodes to a lone surrogate: Celery's
    worker publishes it again as such, PostgreSQL's and MariaDB's JSON columns refuse it."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite stores a lone surrogate")
    step = dict(follow_up.s("a\ud800b", tag=":surrogate").set(task_id="step-surrogate"))

    ran = deliver("evt-surrogate", callbacks=None, chain=[step])

    assert ProcessedEvent.objects.filter(event_id="evt-surrogate").exists()
    assert ran.chain == [step]


def test_a_result_the_outbox_refuses_still_fails_the_delivery() -> None:
    """The takeover's rule stays for the result: a result the outbox cannot store fails the
    delivery (its callbacks are not left to Celery, which would publish it for ever more)."""
    big = "x" * (1024 * 1024 + 10)
    effect_result.push_request(
        id="task-big", is_eager=False, called_directly=False, callbacks=[dict(follow_up.s())]
    )
    try:
        with (
            pytest.raises(ValueError, match="the task's result goes to its link callback"),
            transaction.atomic(),
        ):
            celery_steps.take_over(effect_result, effect_result.request, big, "E")
    finally:
        effect_result.pop_request()
    assert not OutboxEntry.objects.exists()


@pytest.fixture
def inherit_priority() -> Iterator[None]:
    conf = effect_result.app.conf
    saved = conf.task_inherit_parent_priority
    conf.task_inherit_parent_priority = True
    try:
        yield
    finally:
        conf.task_inherit_parent_priority = saved


def test_a_taken_over_callback_gets_the_parents_priority_as_celery_gives_it(
    inherit_priority: None,
) -> None:
    """``task_inherit_parent_priority``: Celery's worker applies each callback and the chain's
    next task with ``priority=`` the delivery's, over the signature's own."""
    callback = dict(follow_up.s(tag=":link").set(priority=2))
    step = dict(follow_up.s(tag=":2").set(task_id="step-2"))

    deliver(
        "evt-priority",
        callbacks=[callback],
        chain=[step],
        delivery_info={"priority": 7},
    )

    rows = list(OutboxEntry.objects.order_by("id"))
    assert [row.payload["options"].get("priority") for row in rows] == [7, 7]


def test_without_inheritance_a_callback_keeps_its_own_priority() -> None:
    callback = dict(follow_up.s(tag=":link").set(priority=2))

    deliver("evt-own-priority", callbacks=[callback], delivery_info={"priority": 7})

    [row] = OutboxEntry.objects.all()
    assert row.payload["options"].get("priority") == 2


def test_eagerly_a_duplicate_runs_no_link_callback() -> None:
    """Eagerly (``task_always_eager``, and the outbox's eager relay, which calls ``apply()``),
    Celery runs the link callbacks after the task returns. A duplicate returns None: they ran
    again, with None, where a worker's duplicate publishes none."""
    assert effect_result.app.conf.task_always_eager
    link = follow_up.s(tag=":eager")

    effect_result.apply(kwargs={"event_id": "evt-eager"}, link=link, throw=True)
    effect_result.apply(kwargs={"event_id": "evt-eager"}, link=link, throw=True)

    assert list(Effect.objects.filter(name="shop.follow_up:eager").values_list("payload")) == [
        ("evt-eager:result",)
    ]


@pytest.fixture
def at_repeatable_read() -> Iterator[None]:
    """``effect_result`` runs its deliveries (and its takeover) on the ``repeatable_read`` alias:
    the test database at REPEATABLE READ (testproject/settings.py)."""
    saved = effect_result.database
    effect_result.database = "repeatable_read"
    try:
        yield
    finally:
        effect_result.database = saved


@pytest.mark.skipif(
    "repeatable_read" not in settings.DATABASES, reason="SQLite has no isolation level to choose"
)
@pytest.mark.django_db(transaction=True, databases=["default", "repeatable_read"])
def test_at_repeatable_read_the_takeover_sends_each_step_once(at_repeatable_read: None) -> None:
    callback = dict(follow_up.s(tag=":link"))
    step = dict(follow_up.s(tag=":2").set(task_id="step-rr"))

    first = deliver("evt-rr", callbacks=[callback], chain=[step])
    again = deliver("evt-rr", callbacks=[callback], chain=[step])

    assert first.callbacks is None and first.chain is None
    assert again.callbacks is None and again.chain is None
    tags = sorted(row.payload["kwargs"]["tag"] for row in OutboxEntry.objects.all())
    assert tags == [":2", ":link"]
