"""``link``, ``link_error`` and chains through the outbox (issue 36, "Signatures"): what
``publish()`` stores, what the eager relay runs, and an idempotent consumer's takeover of its
callbacks and chain (:mod:`django_idempotency.events.celery_steps`), without a worker. The
parity with ``apply_async`` on real brokers and workers is ``tests/test_celery_call_parity.py``;
exactly once across duplicate deliveries, ``tests/test_celery_canvas_worker.py``."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery, chain
from celery.app.task import Context
from django.db import transaction

from django_idempotency.events import celery_steps
from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.transports import CeleryTransport
from testproject.shop.call_probe import probe_call
from testproject.shop.tasks import effect_result, follow_up

pytestmark = pytest.mark.django_db(transaction=True)


def published(target: Any, *args: Any, **options: Any) -> OutboxEntry:
    with transaction.atomic():
        event_id = outbox.publish(target, *args, **options)
    return OutboxEntry.objects.get(event_id=event_id)


def test_a_chain_is_its_first_task_and_the_rest_its_chain_option_last_first() -> None:
    row = published(
        chain(probe_call.s(1), probe_call.s(2).set(queue="q2"), probe_call.si(3)),
        link_error=probe_call.si("failed"),
    )

    assert row.destination == "shop.probe_call"
    assert row.payload["args"] == [1]
    steps = row.payload["options"]["chain"]
    assert [(s["args"], s["immutable"]) for s in steps] == [([3], True), ([2], False)]
    assert steps[1]["options"]["queue"] == "q2"
    assert all(s["options"]["task_id"] for s in steps)  # frozen, as _chain.run freezes them
    # link_error goes to every task, as prepare_steps links it.
    assert row.payload["options"]["link_error"][0]["args"] == ["failed"]
    assert [s["options"]["link_error"][0]["args"] for s in steps] == [["failed"], ["failed"]]


def test_a_chains_task_id_and_link_go_to_its_last_task_and_args_to_its_first() -> None:
    row = published(
        probe_call.s(1) | probe_call.s(2), [0], task_id="last-one", link=probe_call.si("done")
    )

    assert row.payload["args"] == [0, 1]
    [last] = row.payload["options"]["chain"]
    assert last["options"]["task_id"] == "last-one"
    assert last["options"]["link"][0]["args"] == ["done"]
    assert "link" not in row.payload["options"]


def test_link_and_a_signatures_own_link_are_stored_as_signature_dicts() -> None:
    row = published(probe_call.s(1).set(link=probe_call.s(9)), link_error=[probe_call.si(7)])

    assert row.payload["options"]["link"] == [
        {
            "task": "shop.probe_call",
            "args": [9],
            "kwargs": {},
            "options": {},
            "subtask_type": None,
            "immutable": False,
        }
    ]
    assert row.payload["options"]["link_error"][0]["args"] == [7]


def test_the_eager_relay_runs_the_callbacks_and_the_chain() -> None:
    app = Celery("eager-canvas", set_as_current=False)
    app.conf.task_always_eager = True
    ran: list[tuple[str, Any]] = []

    @app.task(name="canvas.step")
    def step(previous: Any = None, name: str = "") -> str:
        ran.append((name, previous))
        return name

    with transaction.atomic():
        outbox.publish(step.s(name="a"), link=step.s(name="linked"))
        outbox.publish(chain(step.s(name="1"), step.s(name="2"), step.s(name="3")))

    result = Relay(transports={"default": CeleryTransport(app=app)}).drain()

    assert result.sent == 2
    assert ran == [("a", None), ("linked", "a"), ("1", None), ("2", "1"), ("3", "2")]


def request_with(**fields: Any) -> Context:
    return Context({"id": "parent-id", "root_id": "root-id", **fields})


def test_a_consumer_takes_over_its_callbacks_and_chain_step_in_its_transaction() -> None:
    callback = dict(follow_up.s(tag=":link"))
    rest = [dict(follow_up.s(tag=":3").set(task_id="step-3"))]
    step = dict(follow_up.s(tag=":2").set(task_id="step-2"))
    request = request_with(callbacks=[callback], chain=[*rest, step])

    with transaction.atomic():
        celery_steps.take_over(effect_result, request, "E:result", "E")

    assert request.callbacks is None and request.chain is None  # the worker publishes none
    rows = {row.event_id: row.payload for row in OutboxEntry.objects.all()}
    assert rows.pop("step-2") == {
        "args": ["E:result"],
        "kwargs": {"tag": ":2"},
        "options": {"chain": [{**rest[0], "args": []}]},
    }
    [(_, linked)] = rows.items()
    assert linked == {"args": ["E:result"], "kwargs": {"tag": ":link"}, "options": {}}


def test_a_result_the_outbox_cannot_store_fails_the_delivery_and_publishes_nothing() -> None:
    request = request_with(callbacks=[dict(follow_up.s())], chain=None)

    with (
        pytest.raises(TypeError, match=r"through the outbox.*rolled back"),
        transaction.atomic(),
    ):
        celery_steps.take_over(effect_result, request, object(), "E")

    assert request.callbacks  # left as they were: the delivery failed
    assert not OutboxEntry.objects.exists()
