"""Saga steps and compensations: each once, a compensation never for a step that did not run."""

from __future__ import annotations

import threading
import uuid

import pytest

from django_idempotency.flows.sagas import Saga
from django_idempotency.models import ProcessedEvent
from testproject.shop import checkout_saga
from testproject.shop.models import Effect
from tests.probes import effects, in_thread

pytestmark = pytest.mark.django_db(transaction=True)


def effect(name: str, saga_id: str) -> object:
    return lambda: Effect.objects.create(name=name, payload=saga_id)


def test_a_step_runs_once_with_its_reservation() -> None:
    saga = Saga("order", uuid.uuid4())
    first = saga.step("charge", effect("charge", saga.saga_id))
    again = saga.step("charge", effect("charge", saga.saga_id))
    assert (first.status, again.status) == ("applied", "duplicate")
    assert first.applied and not again.applied
    assert effects("charge", saga.saga_id) == 1
    assert saga.happened("charge")
    assert ProcessedEvent.objects.filter(consumer="saga:order:charge").count() == 1


def test_a_step_that_raises_leaves_no_reservation() -> None:
    saga = Saga("order", uuid.uuid4())

    def fail() -> None:
        Effect.objects.create(name="charge", payload=saga.saga_id)
        raise RuntimeError("card declined")

    with pytest.raises(RuntimeError):
        saga.step("charge", fail)
    assert effects("charge", saga.saga_id) == 0
    assert not saga.happened("charge")
    assert saga.step("charge", effect("charge", saga.saga_id)).applied


def test_a_compensation_runs_once_after_its_step() -> None:
    saga = Saga("order", uuid.uuid4())
    saga.step("charge", effect("charge", saga.saga_id))
    outcomes = [saga.compensate("charge", effect("refund", saga.saga_id)).status for _ in "ab"]
    assert outcomes == ["applied", "duplicate"]
    assert effects("refund", saga.saga_id) == 1
    # The step's message redelivered after its compensation: a duplicate, not a cancellation.
    assert saga.step("charge", effect("charge", saga.saga_id)).status == "duplicate"
    assert effects("charge", saga.saga_id) == 1


def test_a_compensation_never_runs_for_a_step_that_did_not_happen() -> None:
    saga = Saga("order", uuid.uuid4())
    assert saga.compensate("ship", effect("unship", saga.saga_id)).status == "not_needed"
    assert effects("unship", saga.saga_id) == 0
    # The step's message arrives late: it is cancelled, and never runs.
    late = saga.step("ship", effect("ship", saga.saga_id))
    assert late.status == "cancelled"
    assert effects("ship", saga.saga_id) == 0
    assert not saga.happened("ship")
    assert saga.compensate("ship", effect("unship", saga.saga_id)).status == "duplicate"


def test_two_sagas_and_two_saga_names_are_apart() -> None:
    saga_id = str(uuid.uuid4())
    for name in ("order", "refund"):
        assert Saga(name, saga_id).step("charge", effect(f"{name}-charge", saga_id)).applied
    assert Saga("order", uuid.uuid4()).step("charge", effect("other", saga_id)).applied


def test_bad_names_are_refused() -> None:
    with pytest.raises(ValueError):
        Saga("", "x")
    with pytest.raises(ValueError):
        Saga("a:b", "x")
    with pytest.raises(ValueError):
        Saga("order", "")
    with pytest.raises(ValueError):
        Saga("order", "x").step("", lambda: None)


def race_step_and_compensation() -> tuple[set[str], int, int]:
    """Start a step and its compensation at once; their statuses and effect counts."""
    saga = Saga("race", uuid.uuid4())
    barrier = threading.Barrier(2)

    def step() -> str:
        barrier.wait()
        return saga.step("charge", effect("charge", saga.saga_id)).status

    def undo() -> str:
        barrier.wait()
        return saga.compensate("charge", effect("refund", saga.saga_id)).status

    threads = [in_thread(step), in_thread(undo)]
    for thread, _ in threads:
        thread.join(30)
    statuses = {outcome["result"] for _, outcome in threads}
    return statuses, effects("charge", saga.saga_id), effects("refund", saga.saga_id)


@pytest.mark.postgres
@pytest.mark.mysql
def test_a_step_racing_its_compensation_yields_one_coherent_outcome() -> None:
    """Either the step ran and its compensation too, or neither ever runs."""
    for _ in range(10):
        statuses, charged, refunded = race_step_and_compensation()
        assert statuses in ({"applied"}, {"cancelled", "not_needed"}), statuses
        assert charged == refunded == (1 if statuses == {"applied"} else 0)


def test_the_checkout_saga_compensates_each_step_once_when_shipping_fails() -> None:
    """Eagerly, in one process (the worker proof is tests/test_sagas_worker.py)."""
    saga_id = str(uuid.uuid4())
    plan = {"fail_at": "ship", "queue": None, "crash": None}
    checkout_saga.start(saga_id, plan)
    checkout_saga.start(saga_id, plan)  # the whole saga delivered twice
    counts = {
        name: effects(name, saga_id)
        for name in (
            "saga.reserve_stock",
            "saga.charge",
            "saga.ship",
            "saga.reserve_stock.compensate",
            "saga.charge.compensate",
            "saga.ship.compensate",
        )
    }
    assert counts == {
        "saga.reserve_stock": 1,
        "saga.charge": 1,
        "saga.ship": 0,
        "saga.reserve_stock.compensate": 1,
        "saga.charge.compensate": 1,
        "saga.ship.compensate": 0,
    }
