"""Holes in the ``503`` for a request the database rolled back while its response was stored
(``tests/test_http_store_conflicts.py``), and in its neighbours, found in review:

* A phased flow (``@idempotent(phases=True)``) whose phases had committed lost its record: the
  lease claim was released (deleted) like a plain lease-mode claim, its run was stranded, and
  the retry, a new record, ran the committed phases again. It now keeps the record and its
  recovery point and gives up the lease, as a pause does: the retry resumes.
* The release of a lease-mode claim after that ``503`` met the same conflict again (the other
  transaction still held the record's row: a lock wait that ran out, MariaDB 1205, PostgreSQL
  ``55P03``), and the driver's error replaced the ``503`` with a ``500``. It is now one
  ``release_failed`` WARNING line, as for a release that lost the database: the claim stays
  under its lease.
* PostgreSQL at ``SERIALIZABLE``: a write skew's serialization failure while the response was
  stored was taken for a takeover (``409``, the lease claim left held); it is a ``503``.
* MariaDB: a phased flow's fence and pause had the plan that storing a response had before
  (``idem_record_state_idx`` on a fresh table); they now name the primary key.
* A conflict on a phased flow's run as it completes leaked the driver's error and left the
  thread's connection inside the store's transaction.

Real connections and threads; each interleaving is set up with a neighbour transaction on its
own connection, and every wait is on a lock the test can see (``tests/lock_waits.py``).
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory

from django_idempotency import idempotent
from django_idempotency.flows.phases import Flow
from django_idempotency.models import FlowRun, IdempotencyRecord
from testproject.shop.models import Effect
from tests.lock_waits import session_of, wait_until_blocked
from tests.probes import effects
from tests.test_http_store_conflicts import heavy, holding_row, write_skew

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, databases=["default", "repeatable_read"]),
]

NEIGHBOUR = "repeatable_read"
TABLE = IdempotencyRecord._meta.db_table
RUNS = FlowRun._meta.db_table


class Paused:
    """A view (built by the test) that does its work, says so with its connection's session,
    and waits for :meth:`go` before it answers ``201``."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.released = threading.Event()
        self.session: int | None = None

    def reached(self) -> None:
        self.session = session_of()
        self.inside.set()
        assert self.released.wait(60), "the test never let the view answer"

    def send(self, view: Any, key: str, before: str | None = None) -> Future[Any]:
        """Run ``view`` in a thread of its own (``before``: a statement for its connection,
        in autocommit, first); the future holds the response, or the exception raised."""

        def run() -> Any:
            try:
                if before is not None:
                    with connection.cursor() as cursor:
                        cursor.execute(before)
                request = RequestFactory().post(
                    "/review/", b"{}", content_type="application/json",
                    headers={"Idempotency-Key": key},
                )  # fmt: skip
                return view(request)
            except DatabaseError as exc:  # the test asserts on it: the 500 of the library's
                return exc
            finally:
                self.inside.set()
                connections.close_all()

        future = ThreadPoolExecutor(1).submit(run)
        assert self.inside.wait(60), future.result(1)
        return future

    def go(self) -> None:
        self.released.set()


FLOW = Paused()


@idempotent(phases=True, lease=timedelta(seconds=60), name="review_store_paused")
def paused_flow(request: HttpRequest, flow: Flow) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    one = flow.phase("one", lambda: Effect.objects.create(name="review-flow-one", payload=key))
    if connection.vendor == "postgresql":
        # The request, which waits first, must be the one to find the deadlock; the neighbour
        # looks after 60 s. (A margin for the neighbour to start waiting, never asserted.)
        with connection.cursor() as cursor:
            cursor.execute("SET deadlock_timeout = '5s'")
    FLOW.reached()
    return JsonResponse({"one": one.pk}, status=201)


def test_a_flow_whose_phases_committed_keeps_its_record_after_a_deadlock_at_store(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The store's transaction updates the run (``COMPLETED``), then the record; the neighbour
    holds the record's row and then waits on the run's: a deadlock, and the request is its
    victim. The answer is ``503``; the record and the run stay, and the retry resumes after
    phase ``one`` instead of running it again."""
    key = f"review-flow-{uuid.uuid4()}"
    FLOW.inside.clear()
    FLOW.released.clear()
    future = FLOW.send(paused_flow, key)
    record = IdempotencyRecord.objects.get(key=key).pk
    run = FlowRun.objects.get(record_id=record).pk
    assert FLOW.session is not None
    with (
        caplog.at_level(logging.INFO, logger="django_idempotency"),
        ThreadPoolExecutor(1) as pool,
        transaction.atomic(using=NEIGHBOUR),
        connections[NEIGHBOUR].cursor() as cursor,
    ):
        if connection.vendor == "mysql":
            heavy(cursor)
        else:
            cursor.execute("SET LOCAL deadlock_timeout = '60s'")
        cursor.execute(f"SELECT id FROM {TABLE} WHERE id = %s FOR UPDATE", [record])
        cursor.fetchall()
        raw = connections[NEIGHBOUR].connection  # used by one thread at a time
        FLOW.go()
        wait_until_blocked(FLOW.session, "the response's store, on the record's row")

        def wait_on_the_run() -> None:
            with raw.cursor() as raw_cursor:
                raw_cursor.execute(f"SELECT id FROM {RUNS} WHERE id = %s FOR UPDATE", [run])
                raw_cursor.fetchall()

        pool.submit(wait_on_the_run).result(60)  # granted once the request rolled back
        transaction.set_rollback(True, using=NEIGHBOUR)
    response = future.result(60)
    assert isinstance(response, HttpResponse), response
    assert response.status_code == 503, response.content
    assert response["Retry-After"] == "1"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("idempotency unavailable" in w and key in w for w in warnings), warnings
    kept = IdempotencyRecord.objects.get(key=key)
    assert kept.pk == record and kept.state == "in_progress", "the record was released"
    stored_run = FlowRun.objects.get(pk=run)
    assert (stored_run.record_id, stored_run.recovery_point) == (record, "one")
    assert stored_run.state == FlowRun.State.RUNNING

    FLOW.inside.clear()
    FLOW.released.set()
    retry = FLOW.send(paused_flow, key).result(60)
    assert isinstance(retry, HttpResponse), retry
    assert retry.status_code == 201, retry.content
    assert effects("review-flow-one", key) == 1, "the retry ran a committed phase again"
    assert json.loads(retry.content)["one"] == Effect.objects.get(payload=key).pk
    assert IdempotencyRecord.objects.get(key=key).state == "completed"


LEASED = Paused()


@idempotent(atomic=False, lease=60)
def leased_view(request: HttpRequest) -> HttpResponse:
    Effect.objects.create(name="review-leased", payload=request.headers["Idempotency-Key"])
    if connection.vendor == "mysql":  # a session variable: the rollback does not undo it
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
    LEASED.reached()
    return JsonResponse({}, status=201)


def test_a_release_that_meets_the_same_lock_keeps_the_503(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Lease mode; the neighbour holds the committed claim's row for the whole request. Storing
    the response runs out of lock wait (MariaDB 1205; PostgreSQL ``55P03``, a project's
    ``lock_timeout``): ``503``. The release then waits on the same row and runs out too: one
    ``release_failed`` line, the claim stays under its lease, and the answer is still the
    ``503``, not the driver's error."""
    key = f"review-leased-{uuid.uuid4()}"
    LEASED.inside.clear()
    LEASED.released.clear()
    # PostgreSQL: set in autocommit, so that the view's rollback does not undo it.
    before = "SET lock_timeout = '500ms'" if connection.vendor == "postgresql" else None
    future = LEASED.send(leased_view, key, before)
    record = IdempotencyRecord.objects.get(key=key).pk
    with holding_row(TABLE, record, caplog):
        LEASED.go()
        response = future.result(60)
    assert isinstance(response, HttpResponse), f"a 500: {response!r}"
    assert response.status_code == 503, response.content
    assert response["Content-Type"] == "application/problem+json"
    assert "rolled this request back" in json.loads(response.content)["detail"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    [failed] = [w for w in warnings if "idempotency release_failed" in w]
    assert key in failed and f"record={record}" in failed, failed
    assert any("idempotency unavailable" in w and key in w for w in warnings), warnings
    assert effects("review-leased", key) == 0
    assert IdempotencyRecord.objects.get(key=key).state == "in_progress"  # under its lease


SKEWED = Paused()
ANCHOR: dict[str, int] = {}


def skewed(request: HttpRequest) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    Effect.objects.create(name="review-skewed", payload=key)
    Effect.objects.filter(pk=ANCHOR["pk"]).exists()  # read: the neighbour then writes it
    SKEWED.reached()
    return JsonResponse({}, status=201)


skewed_atomic = idempotent(skewed)
skewed_leased = idempotent(atomic=False, lease=60)(skewed)


@pytest.mark.parametrize("lease", [False, True], ids=["atomic", "lease"])
def test_a_write_skew_at_serializable_is_503_not_a_stale_claim(
    lease: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL, SERIALIZABLE (the server's or the session's default): the view read a row
    that a neighbour then wrote, and the neighbour read the key's record and committed first.
    Storing the response fails with a serialization failure for read/write dependencies
    (``40001``, "Reason code: ..."), which is not a takeover: it answered ``409`` "a retry took
    it over", logged ``stale`` at ERROR, and a lease claim stayed held until its lease ran out
    (every retry ``409``). It is a conflict like a deadlock: ``503``, the claim released, and a
    retry runs once."""
    if connection.vendor != "postgresql":
        pytest.skip("MariaDB has no serialization failure of its own (InnoDB locks instead)")
    key = f"review-skew-{uuid.uuid4()}"
    view = skewed_leased if lease else skewed_atomic
    ANCHOR["pk"] = Effect.objects.create(name="review-anchor").pk
    SKEWED.inside.clear()
    SKEWED.released.clear()
    serializable = "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE"
    future = SKEWED.send(view, key, serializable)
    read = f"SELECT id FROM {TABLE} WHERE owner = 'anonymous' AND key = %s"
    write_skew(read, [key], ANCHOR["pk"], "review-anchor, written")
    with caplog.at_level(logging.INFO, logger="django_idempotency"):
        SKEWED.go()
        response = future.result(60)
    assert isinstance(response, HttpResponse), response
    assert response.status_code == 503, response.content
    assert "rolled this request back" in json.loads(response.content)["detail"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    [line] = [w for w in warnings if key in w]
    assert "idempotency unavailable" in line and "read/write dependencies" in line, line
    assert effects("review-skewed", key) == 0
    assert not IdempotencyRecord.objects.filter(key=key).exists(), "the claim was left held"

    SKEWED.inside.clear()
    SKEWED.released.set()
    retry = SKEWED.send(view, key, serializable).result(60)
    assert isinstance(retry, HttpResponse), retry
    assert retry.status_code == 201, retry.content
    assert effects("review-skewed", key) == 1


class Stop(RuntimeError):
    pass


@idempotent(phases=True, lease=timedelta(seconds=60), name="review_store_plans")
def planned_flow(request: HttpRequest, flow: Flow) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    flow.phase("one", lambda: Effect.objects.create(name="review-plan-one", payload=key))
    if request.headers.get("X-Stop"):
        raise Stop("after phase one: the run pauses")
    flow.phase("two", lambda: Effect.objects.create(name="review-plan-two", payload=key))
    return JsonResponse({}, status=201)


def test_mariadb_a_flows_fence_and_pause_read_the_record_by_its_primary_key() -> None:
    """The statements that move a phased flow's lease (its fence, in each phase, and its pause)
    had the shape that storing a response had (``id``, ``token`` and ``state``), and the same
    plan on a fresh table: ``idem_record_state_idx``, a read that waits on every other
    request's uncommitted in-progress record. ``EXPLAIN`` of each statement they send names
    the primary key only."""
    if connection.vendor != "mysql":
        pytest.skip("the plan of MariaDB's optimizer")
    from django.test.utils import CaptureQueriesContext

    key = f"review-plan-{uuid.uuid4()}"

    def send(**headers: str) -> Any:
        request = RequestFactory().post(
            "/review/", b"{}", content_type="application/json",
            headers={"Idempotency-Key": key, **headers},
        )  # fmt: skip
        return planned_flow(request)  # type: ignore[call-arg]  # the wrapper passes the flow

    with CaptureQueriesContext(connection) as queries:
        with pytest.raises(Stop):
            send(**{"X-Stop": "1"})
        assert send().status_code == 201
    moves = [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].lstrip().upper().startswith(("UPDATE", "SET STATEMENT"))
        and TABLE in q["sql"]
        and "SET `locked_until`" in q["sql"].replace("SET locked_until", "SET `locked_until`")
    ]
    assert len(moves) >= 3, queries.captured_queries  # fences of one and two, the pause
    with connection.cursor() as cursor:
        for sql in moves:
            cursor.execute("EXPLAIN " + sql)
            columns = [c[0] for c in cursor.description]
            plans = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
            assert plans and all(plan["key"] in ("PRIMARY", None) for plan in plans), (sql, plans)
            assert all(plan["possible_keys"] in ("PRIMARY", None) for plan in plans), (sql, plans)
    assert effects("review-plan-one", key) == effects("review-plan-two", key) == 1


STATED = Paused()


@idempotent(phases=True, lease=timedelta(seconds=60), name="review_store_state")
def stated_flow(request: HttpRequest, flow: Flow) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    flow.phase("one", lambda: Effect.objects.create(name="review-state-one", payload=key))
    if connection.vendor == "mysql":  # a session variable: the rollback does not undo it
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
    STATED.reached()
    return JsonResponse({}, status=201)


def test_a_conflict_on_the_flows_run_when_it_completes_is_503_and_leaves_no_transaction_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A phased flow's last transaction marks its run completed, then stores the response. The
    neighbour holds the run's row: the run's update runs out of lock wait. That update ran
    outside the store's error handling: the driver's error (a ``500``), and the transaction the
    store had opened was never left, so every later query on the thread's connection failed
    ("An error occurred in the current transaction"). Now: ``503``, the transaction left, the
    run kept for a retry to resume."""
    key = f"review-state-{uuid.uuid4()}"
    STATED.inside.clear()
    STATED.released.clear()
    after: dict[str, Any] = {}

    def view(request: HttpRequest) -> Any:
        try:
            return stated_flow(request)  # type: ignore[call-arg]  # the wrapper passes the flow
        finally:  # still on the request's thread and connection
            after["in_atomic_block"] = connection.in_atomic_block
            try:
                after["next query"] = Effect.objects.filter(payload=key).count()
            except DatabaseError as exc:
                after["next query"] = exc

    before = "SET lock_timeout = '500ms'" if connection.vendor == "postgresql" else None
    future = STATED.send(view, key, before)
    record = IdempotencyRecord.objects.get(key=key).pk
    run = FlowRun.objects.get(record_id=record).pk
    with holding_row(RUNS, run, caplog):
        STATED.go()
        response = future.result(60)
    assert after == {"in_atomic_block": False, "next query": 1}, after
    assert isinstance(response, HttpResponse), f"a 500: {response!r}"
    assert response.status_code == 503, response.content
    assert "rolled this request back" in json.loads(response.content)["detail"]
    kept = IdempotencyRecord.objects.get(key=key)
    assert kept.pk == record and kept.state == "in_progress"
    stored_run = FlowRun.objects.get(pk=run)
    assert (stored_run.state, stored_run.recovery_point) == (FlowRun.State.RUNNING, "one")
