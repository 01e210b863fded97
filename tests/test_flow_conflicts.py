"""A phased flow (``@idempotent(phases=True)``) that meets another transaction: a ``503`` with
``Retry-After`` and the run kept, never the driver's ``500``, never a committed phase run twice,
never a failure lost. Two gaps an outside review found after the store's conflicts were answered
(``tests/test_http_store_conflicts_review.py``):

* Storing a failed flow's answer (``_FlowCore._store_failure``, its own transaction) had no
  conflict handling: a lock wait that ran out there (or a deadlock, a serialization failure)
  escaped as the driver's error, a ``500``. It is a ``503``; the record and the run stay, the run
  marked ``failed`` (before the compensations ran), and the next run, the client's retry or the
  completer's, rolls it forward again (no compensation runs twice) and stores the failure. A
  client's retry of a flow the completer rolled forward no longer resumes it.
* A phase's fence (``Flow._fence``) took every PostgreSQL serialization failure for a lost claim
  (``409``, the lease kept until it ran out). ``SERIALIZABLE``'s failure for read/write
  dependencies (a write skew) is no lost claim: it is a ``503`` with the run kept and the lease
  given up, and the retry resumes. So is any conflict at the fence (a lock wait that ran out, on
  MariaDB too), which raised the driver's error from the view and then again from its pause.

Real connections and threads; each interleaving is set up with a neighbour transaction on its own
connection, and every wait is on a lock the test holds.
"""

from __future__ import annotations

import json
import logging
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory
from django.utils import timezone

from django_idempotency import idempotent
from django_idempotency.flows.completer import complete_abandoned
from django_idempotency.flows.phases import Flow, FlowFailed
from django_idempotency.models import FlowRun, IdempotencyRecord
from testproject.shop.models import Effect
from testproject.shop.probe_flows import ProbeError
from tests.probes import effects, in_thread
from tests.test_http_store_conflicts import assert_503, holding_row, write_skew
from tests.test_http_store_conflicts_review import Paused

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, databases=["default", "repeatable_read"]),
]

NEIGHBOUR = "repeatable_read"
TABLE = IdempotencyRecord._meta.db_table
RUNS = FlowRun._meta.db_table
LOCK_TIMEOUT = "SET lock_timeout = '500ms'"
"""PostgreSQL: the request's lock waits run out (``55P03``), set in autocommit so that no
rollback undoes it. MariaDB's own is set by each view (:func:`short_lock_waits`)."""


def short_lock_waits() -> None:
    """MariaDB: the request's lock waits run out after a second (1205); a session variable, so a
    rollback does not undo it."""
    if connection.vendor == "mysql":
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")


def before() -> str | None:
    return LOCK_TIMEOUT if connection.vendor == "postgresql" else None


def post(key: str, **headers: str) -> HttpRequest:
    return RequestFactory().post(
        "/review/", b"{}", content_type="application/json",
        headers={"Idempotency-Key": key, **headers},
    )  # fmt: skip


def expire_lease(key: str) -> None:
    """As if the lease had run out (a release that met the same lock kept it)."""
    IdempotencyRecord.objects.filter(key=key).update(
        locked_until=timezone.now() - timedelta(seconds=1)
    )


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# --- 1. Storing a failed flow's answer ----------------------------------------------------------

FAILING = Paused()


def undo_one(result: dict[str, Any], key: str) -> None:
    Effect.objects.create(name="fc-undo-one", payload=result["key"])
    FAILING.reached()  # in the compensation's transaction: the run's mark has committed


@idempotent(phases=True, lease=timedelta(seconds=60), name="flow_conflicts_failing")
def failing_flow(request: HttpRequest, flow: Flow) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    short_lock_waits()
    flow.phase(
        "one",
        lambda: {"key": key, "id": Effect.objects.create(name="fc-one", payload=key).pk},
        compensate=undo_one,
    )

    def book(call_key: str) -> dict[str, Any]:
        Effect.objects.create(name="fc-booked", payload=key)  # autocommit: the call's effect
        if request.headers.get("X-Raise"):
            raise ProbeError("the courier timed out")
        return {"booked": call_key}

    flow.call("two", book, resumable=False)
    return JsonResponse({}, status=201)


def run_failure_store_against_a_held_run(key: str, caplog: pytest.LogCaptureFixture) -> Any:
    """The flow rolls forward; while its compensation runs, the neighbour locks the run's row;
    storing the failure then waits on it until its lock wait runs out. Returns the response."""
    future = FAILING.send(failing_flow, key, before())
    record = IdempotencyRecord.objects.get(key=key).pk
    run = FlowRun.objects.get(record_id=record)
    with holding_row(RUNS, run.pk, caplog):
        FAILING.go()
        response = future.result(60)
    return response


def test_a_conflict_while_a_failed_flows_answer_is_stored_is_503_and_the_retry_stores_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A non-resumable call was interrupted; the retry rolls the flow forward (compensates phase
    ``one``) and stores ``flow-failed``. The neighbour holds the run's row: that store ran out of
    lock wait (MariaDB 1205, PostgreSQL ``55P03``) and the driver's error was the answer (a
    ``500``). Now: ``503``, the record kept in progress and the run marked failed; the next
    retry stores the failure without calling out or compensating again, and it is replayed."""
    key = f"fc-fail-{uuid.uuid4()}"
    with pytest.raises(ProbeError):
        failing_flow(post(key, **{"X-Raise": "1"}))  # type: ignore[call-arg]
    assert FlowRun.objects.get(record__key=key).started == "two"

    FAILING.inside.clear()
    FAILING.released.clear()
    response = run_failure_store_against_a_held_run(key, caplog)
    assert_503(response)
    warnings = warnings_of(caplog)
    assert any("idempotency unavailable" in w and key in w for w in warnings), warnings
    # Its release (giving up the lease) met the same lock: logged, the lease kept.
    assert any("idempotency release_failed" in w and key in w for w in warnings), warnings
    record = IdempotencyRecord.objects.get(key=key)
    assert record.state == IdempotencyRecord.State.IN_PROGRESS
    run = FlowRun.objects.get(record=record)
    assert (run.state, run.recovery_point) == (FlowRun.State.FAILED, "one")
    assert effects("fc-undo-one", key) == 1

    expire_lease(key)
    FAILING.inside.clear()
    FAILING.released.set()
    retry = FAILING.send(failing_flow, key).result(60)
    assert isinstance(retry, HttpResponse), retry
    assert retry.status_code == FlowFailed.status, retry.content
    failed = json.loads(retry.content)
    assert (failed["interrupted"], failed["compensated"]) == ("two", ["one"])
    assert effects("fc-undo-one", key) == 1, "a compensation ran twice"
    assert effects("fc-booked", key) == 1, "the call that takes no key ran again"
    assert effects("fc-one", key) == 1
    assert IdempotencyRecord.objects.get(key=key).state == IdempotencyRecord.State.COMPLETED
    assert FlowRun.objects.get(record__key=key).state == FlowRun.State.FAILED
    replay = failing_flow(post(key))  # type: ignore[call-arg]
    assert replay["Idempotent-Replayed"] == "true"
    assert replay.status_code == FlowFailed.status


COMPLETER = Paused()
STEPS = {"raise": True}


def undo_first(result: dict[str, Any], key: str) -> None:
    Effect.objects.create(name="fc-undo-first", payload=result["key"])
    COMPLETER.reached()


@idempotent(phases=True, lease=timedelta(seconds=60), name="flow_conflicts_completer")
def completer_flow(request: HttpRequest, flow: Flow) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    short_lock_waits()
    flow.phase(
        "first",
        lambda: {"key": key, "id": Effect.objects.create(name="fc-first", payload=key).pk},
        compensate=undo_first,
    )
    if STEPS["raise"]:
        raise ProbeError("the second step is down")
    flow.phase("second", lambda: Effect.objects.create(name="fc-second", payload=key).pk)
    return JsonResponse({}, status=201)


def test_a_flow_the_completer_rolled_forward_stays_failed_when_its_answer_is_not_stored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The completer rolls a flow forward after ``max_attempts``; storing its failure meets the
    neighbour's lock on the run (``503``, reported ``paused``). The client's retry must not
    resume the flow whose compensation ran (phase ``second`` on top of an undone ``first``,
    and a ``201`` stored): it rolls it forward again and gets ``flow-failed``."""
    key = f"fc-completer-{uuid.uuid4()}"
    STEPS["raise"] = True
    try:
        with pytest.raises(ProbeError):
            completer_flow(post(key))  # type: ignore[call-arg]
    finally:
        STEPS["raise"] = False
    assert FlowRun.objects.get(record__key=key).attempts == 1

    COMPLETER.inside.clear()
    COMPLETER.released.clear()

    def complete() -> Any:
        try:
            statement = before()
            if statement is not None:
                with connection.cursor() as cursor:
                    cursor.execute(statement)
            return complete_abandoned(max_attempts=1)
        finally:
            COMPLETER.inside.set()
            connections.close_all()

    thread, outcome = in_thread(complete)
    assert COMPLETER.inside.wait(60), outcome
    run = FlowRun.objects.get(record__key=key)
    with holding_row(RUNS, run.pk, caplog):
        COMPLETER.go()
        thread.join(60)
    assert "error" not in outcome, outcome
    [done] = outcome["result"]
    assert (done.outcome, done.status) == ("paused", 503), done
    assert IdempotencyRecord.objects.get(key=key).state == IdempotencyRecord.State.IN_PROGRESS
    assert FlowRun.objects.get(record__key=key).state == FlowRun.State.FAILED
    assert effects("fc-undo-first", key) == 1

    expire_lease(key)
    COMPLETER.inside.clear()
    COMPLETER.released.set()
    retry = COMPLETER.send(completer_flow, key).result(60)
    assert isinstance(retry, HttpResponse), retry
    assert retry.status_code == FlowFailed.status, retry.content
    assert json.loads(retry.content)["compensated"] == ["first"]
    assert effects("fc-second", key) == 0, "the retry resumed a flow whose compensation ran"
    assert effects("fc-undo-first", key) == 1, "a compensation ran twice"
    assert effects("fc-first", key) == 1
    assert IdempotencyRecord.objects.get(key=key).state == IdempotencyRecord.State.COMPLETED
    assert complete_abandoned() == []


# --- 2. A phase's fence -------------------------------------------------------------------------

FENCED = Paused()
ANCHOR: dict[str, int] = {}


@idempotent(phases=True, lease=timedelta(seconds=60), name="flow_conflicts_fenced")
def fenced_flow(request: HttpRequest, flow: Flow) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    short_lock_waits()
    flow.phase("one", lambda: Effect.objects.create(name="fc-fence-one", payload=key).pk)

    def two() -> int:
        effect = Effect.objects.create(name="fc-fence-two", payload=key)
        if "pk" in ANCHOR:
            Effect.objects.filter(pk=ANCHOR["pk"]).exists()  # read: the neighbour writes it
        FENCED.reached()  # the fence, next, is the phase's first write to the record
        return effect.pk

    flow.phase("two", two)
    return JsonResponse({}, status=201)


def assert_kept_and_resumed(key: str, record: int) -> None:
    kept = IdempotencyRecord.objects.get(key=key)
    assert kept.pk == record and kept.state == IdempotencyRecord.State.IN_PROGRESS
    run = FlowRun.objects.get(record_id=record)
    assert (run.state, run.recovery_point, run.attempts) == (FlowRun.State.RUNNING, "one", 0)
    assert effects("fc-fence-two", key) == 0, "the rolled back phase committed"
    FENCED.inside.clear()
    FENCED.released.set()
    retry = FENCED.send(fenced_flow, key).result(60)
    assert isinstance(retry, HttpResponse), retry
    assert retry.status_code == 201, retry.content
    assert effects("fc-fence-one", key) == 1, "the retry ran a committed phase again"
    assert effects("fc-fence-two", key) == 1
    assert IdempotencyRecord.objects.get(key=key).state == IdempotencyRecord.State.COMPLETED


def test_a_write_skew_at_a_phases_fence_is_503_with_the_run_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """PostgreSQL, SERIALIZABLE: phase ``two`` read a row that a neighbour then wrote, and the
    neighbour read the record and committed first. The fence's update of the record fails with
    a serialization failure for read/write dependencies ("Reason code: ..."), which the fence
    took for a takeover: ``409`` "a retry took it over", logged ``stale`` at ERROR, and the
    lease left held until it ran out (every retry ``409``). It is a conflict: ``503``, phase
    ``two`` rolled back, the run kept and the lease given up, so the retry resumes at once."""
    if connection.vendor != "postgresql":
        pytest.skip("MariaDB has no serialization failure of its own (InnoDB locks instead)")
    key = f"fc-skew-{uuid.uuid4()}"
    ANCHOR["pk"] = Effect.objects.create(name="fc-anchor").pk
    FENCED.inside.clear()
    FENCED.released.clear()
    serializable = "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE"
    try:
        future = FENCED.send(fenced_flow, key, serializable)
        record = IdempotencyRecord.objects.get(key=key).pk
        read = f"SELECT id FROM {TABLE} WHERE id = %s"
        write_skew(read, [record], ANCHOR["pk"], "fc-anchor, written")
        with caplog.at_level(logging.INFO, logger="django_idempotency"):
            FENCED.go()
            response = future.result(60)
    finally:
        ANCHOR.clear()
    assert_503(response)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    [line] = [w for w in lines if key in w]
    assert "idempotency unavailable" in line and "read/write dependencies" in line, line
    locked_until = IdempotencyRecord.objects.get(pk=record).locked_until
    assert locked_until is not None and locked_until <= timezone.now(), "the lease was kept"
    assert_kept_and_resumed(key, record)


def test_a_lock_wait_that_runs_out_at_a_phases_fence_is_503_with_the_run_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The neighbour holds the record's row (an admin edit, a report) while phase ``two`` runs:
    its fence runs out of lock wait (MariaDB 1205, PostgreSQL ``55P03``). The view raised the
    driver's error, and its pause then met the same lock and raised it again: a ``500``. Now:
    ``503``, the phase rolled back, the pause that met the lock logged (``release_failed``, the
    lease kept), the run kept; the retry after the lease resumes at ``two``."""
    key = f"fc-wait-{uuid.uuid4()}"
    FENCED.inside.clear()
    FENCED.released.clear()
    future = FENCED.send(fenced_flow, key, before())
    record = IdempotencyRecord.objects.get(key=key).pk
    with holding_row(TABLE, record, caplog):
        FENCED.go()
        response = future.result(60)
    assert not isinstance(response, DatabaseError), f"a 500: {response!r}"
    assert_503(response)
    warnings = warnings_of(caplog)
    assert any("idempotency unavailable" in w and key in w for w in warnings), warnings
    assert any("idempotency release_failed" in w and key in w for w in warnings), warnings
    expire_lease(key)
    assert_kept_and_resumed(key, record)
