"""A phased flow rolled forward to failure whose compensation meets another transaction, or loses
the database: a ``503`` with the record and the run kept, never the driver's ``500``, and each
compensation run exactly once across the ``503`` and the retry (or the completer's next pass).

* A compensation runs in a transaction of its own: the fence, the reservation that makes it run
  once (``try_reserve``), its effect, the COMMIT. A conflict in the reservation (a lock wait that
  ran out, a deadlock's victim) or at the COMMIT (a serialization failure for read/write
  dependencies), or a database lost there, escaped as the driver's error: a ``500`` for the
  request, ``raised`` (an attempt counted) in the completer. It is the core's ``503``
  (database-unavailable, ``Retry-After``), ``paused`` with status 503 in the completer with one
  WARNING line; the run stays marked ``failed`` and the next run rolls it forward again.
* A second roll-forward (the first one's failure was not stored) whose view raised before any
  phase stored ``interrupted: null`` and ``compensated: []``: it stores the phase the first one
  stopped at, kept on the run, and the compensations that ran.

Real connections; each conflict is built with a neighbour transaction on its own connection,
each lost connection with the proxy of ``tests/db_proxy.py``.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory, override_settings
from django.utils import timezone

from django_idempotency import idempotent
from django_idempotency.conf import conf
from django_idempotency.flows.completer import complete_abandoned
from django_idempotency.flows.phases import COMPENSATION_CONSUMER, Flow, FlowFailed
from django_idempotency.models import FlowRun, IdempotencyRecord, ProcessedEvent
from testproject.shop.models import Effect
from testproject.shop.probe_flows import ProbeError
from tests.db_proxy import PgProxy, proxy_for, repointed
from tests.lock_waits import session_of, wait_until_blocked
from tests.probes import in_thread
from tests.test_flow_conflicts import LOCK_TIMEOUT, short_lock_waits
from tests.test_http_store_conflicts import assert_503, heavy, write_skew
from tests.test_http_store_conflicts_review import Paused

SERVERS = [
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, databases=["default", "repeatable_read"]),
]


def on_servers(test: Callable[..., None]) -> Callable[..., None]:
    """PostgreSQL and MariaDB, with the neighbour's connection."""
    for mark in reversed(SERVERS):
        test = mark(test)
    return test


NEIGHBOUR = "repeatable_read"
TABLE = IdempotencyRecord._meta.db_table
EVENTS = ProcessedEvent._meta.db_table

CONTROL: dict[str, Any] = {}
"""What the view does this time: ``call_raises`` (the call ``three``, which takes no key, fails:
the next run rolls the flow forward), ``raise_first`` (the view raises before any phase),
``undo_one_raises`` (the compensation of ``one`` fails, its own error), ``hook`` (called inside
the compensation of ``one``, after its effect)."""
STARTED: dict[str, int] = {}
"""The session of the view's connection, for :func:`wait_until_blocked`."""
STARTING = threading.Event()


@pytest.fixture(autouse=True)
def control() -> Iterator[None]:
    CONTROL.clear()
    STARTED.clear()
    STARTING.clear()
    yield
    CONTROL.clear()
    STARTED.clear()


def undo(name: str) -> Callable[[dict[str, Any], str], None]:
    def compensate(result: dict[str, Any], key: str) -> None:
        alias = conf.DATABASE
        Effect.objects.using(alias).create(name=f"cc-undo-{name}", payload=result["key"])
        if name == "one":
            if CONTROL.get("undo_one_raises"):
                raise ProbeError("the refund was declined")
            hook = CONTROL.get("hook")
            if hook is not None:
                hook()
        with connections[alias].cursor() as cursor:  # the proxy's mark: the COMMIT is next
            cursor.execute(f"SELECT 'cc-undone-{name}'")

    return compensate


@idempotent(phases=True, lease=timedelta(seconds=60), name="compensation_conflicts")
def flow_view(request: HttpRequest, flow: Flow) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    alias = conf.DATABASE
    short_lock_waits()
    if connection.vendor != "sqlite":
        STARTED["session"] = session_of(alias)
        STARTING.set()
    if CONTROL.get("raise_first"):
        raise ProbeError("the view fails before its first phase now")
    for name in ("one", "two"):
        flow.phase(
            name,
            lambda name=name: {  # type: ignore[misc]
                "key": key,
                "id": Effect.objects.using(alias).create(name=f"cc-{name}", payload=key).pk,
            },
            compensate=undo(name),
        )

    def book(call_key: str) -> dict[str, str]:
        Effect.objects.using(alias).create(name="cc-booked", payload=key)
        if CONTROL.get("call_raises"):
            raise ProbeError("the courier timed out")
        return {"booked": call_key}

    flow.call("three", book, resumable=False)
    return JsonResponse({}, status=201)


def post(key: str) -> HttpRequest:
    return RequestFactory().post(
        "/cc/", b"{}", content_type="application/json", headers={"Idempotency-Key": key}
    )


def send(key: str, before: str | None = None) -> Future[Any]:
    """Run the view for ``key`` in a thread of its own (``before``: a statement for its
    connection, in autocommit, first); the future holds the response, or the database error
    raised (the library's ``500``)."""

    def run() -> Any:
        try:
            if before is not None:
                with connection.cursor() as cursor:
                    cursor.execute(before)
            return flow_view(post(key))  # type: ignore[call-arg]
        except DatabaseError as exc:
            return exc
        finally:
            connections.close_all()

    return ThreadPoolExecutor(1).submit(run)


def effects(name: str, key: str, alias: str = "default") -> int:
    return Effect.objects.using(alias).filter(name=name, payload=key).count()


def interrupted_call(key: str, alias: str = "default") -> FlowRun:
    """Phases ``one`` and ``two`` commit, the call ``three`` (no key) fails: the next run of
    the flow rolls it forward, compensating ``two`` and then ``one``. (Its ``raised`` line is
    not one a test looks for: call ``caplog.clear()`` next.)"""
    CONTROL["call_raises"] = True
    with pytest.raises(ProbeError):
        flow_view(post(key))  # type: ignore[call-arg]
    CONTROL.pop("call_raises")
    run = FlowRun.objects.using(alias).get(record__key=key)
    assert (run.recovery_point, run.started) == ("two", "three")
    return run


def key_warnings(caplog: pytest.LogCaptureFixture, key: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and key in r.getMessage()
    ]


def assert_kept_failed(key: str, alias: str = "default") -> None:
    """The record is still in progress, its run marked failed with the phase it stopped at."""
    record = IdempotencyRecord.objects.using(alias).get(key=key)
    assert record.state == IdempotencyRecord.State.IN_PROGRESS
    run = FlowRun.objects.using(alias).get(record=record)
    assert (run.state, run.recovery_point, run.started) == (FlowRun.State.FAILED, "two", "three")


def assert_failed_once(response: Any, key: str, alias: str = "default") -> None:
    """The retry stored ``flow-failed``; every compensation ran once, no call again."""
    assert isinstance(response, HttpResponse), f"a 500: {response!r}"
    assert response.status_code == FlowFailed.status, response.content
    problem = json.loads(response.content)
    assert (problem["interrupted"], problem["compensated"]) == ("three", ["two", "one"])
    assert effects("cc-undo-two", key, alias) == 1, "a compensation ran twice"
    assert effects("cc-undo-one", key, alias) == 1, "a compensation ran twice, or never"
    assert effects("cc-booked", key, alias) == 1, "the call that takes no key ran again"
    assert effects("cc-one", key, alias) == effects("cc-two", key, alias) == 1
    record = IdempotencyRecord.objects.using(alias).get(key=key)
    assert record.state == IdempotencyRecord.State.COMPLETED
    replay = flow_view(post(key))  # type: ignore[call-arg]
    assert replay["Idempotent-Replayed"] == "true"
    assert json.loads(replay.content) == problem


def lease_given_up(key: str) -> bool:
    locked_until = IdempotencyRecord.objects.get(key=key).locked_until
    return locked_until is not None and locked_until <= timezone.now()


def before() -> str | None:
    return LOCK_TIMEOUT if connection.vendor == "postgresql" else None


def reserved_by_neighbour(run: FlowRun, phase: str) -> None:
    """The neighbour's uncommitted reservation of ``phase``'s compensation: the request's
    ``try_reserve`` of it waits on the neighbour's transaction."""
    ProcessedEvent.objects.using(NEIGHBOUR).create(
        consumer=COMPENSATION_CONSUMER,
        event_id=f"{run.pk}:{phase}",
        expires_at=timezone.now() + timedelta(days=1),
    )


# --- A conflict in the compensation's reservation -----------------------------------------------


@on_servers
def test_a_lock_wait_in_a_compensations_reservation_is_503_and_the_retry_runs_it_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The retry rolls the flow forward: ``two``'s compensation commits, ``one``'s reservation
    waits on the neighbour's uncommitted one until its lock wait runs out (MariaDB 1205,
    PostgreSQL ``55P03``). That was the driver's error, a ``500``. Now: ``503``, one WARNING
    line, the lease given up, the run marked failed; the next retry runs ``one``'s compensation
    once, not ``two``'s again, and stores the failure."""
    key = f"cc-wait-{uuid.uuid4()}"
    run = interrupted_call(key)
    caplog.clear()
    with (
        caplog.at_level(logging.INFO, logger="django_idempotency"),
        transaction.atomic(using=NEIGHBOUR),
    ):
        reserved_by_neighbour(run, "one")
        response = send(key, before()).result(60)
        transaction.set_rollback(True, using=NEIGHBOUR)
    assert_503(response)
    [line] = key_warnings(caplog, key)
    assert "idempotency unavailable" in line, line
    assert_kept_failed(key)
    assert lease_given_up(key)
    assert effects("cc-undo-two", key) == 1
    assert effects("cc-undo-one", key) == 0, "the rolled back compensation committed"
    assert_failed_once(send(key).result(60), key)


@on_servers
def test_a_deadlock_in_a_compensations_reservation_is_503_and_the_retry_runs_it_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``one``'s reservation waits on the neighbour's uncommitted one; the neighbour then waits
    on the record's row, which the compensation's fence holds: a deadlock, and the request is
    its victim (MariaDB 1213, the neighbour wrote more; PostgreSQL ``40P01``, the neighbour
    looks after 30 s)."""
    key = f"cc-deadlock-{uuid.uuid4()}"
    run = interrupted_call(key)
    caplog.clear()
    record = run.record_id
    with (
        caplog.at_level(logging.INFO, logger="django_idempotency"),
        ThreadPoolExecutor(1) as pool,
        transaction.atomic(using=NEIGHBOUR),
        connections[NEIGHBOUR].cursor() as cursor,
    ):
        if connection.vendor == "mysql":
            heavy(cursor)
        else:
            # The fence's update of the record committed after a REPEATABLE READ snapshot: its
            # lock would fail (concurrent update) instead of waiting.
            cursor.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            cursor.execute("SET LOCAL deadlock_timeout = '30s'")
        reserved_by_neighbour(run, "one")
        STARTING.clear()
        future = send(key)
        wait_until_blocked(
            started_session(future),
            "the reservation of one's compensation",
            lambda: future.exception(0) if future.done() else None,
        )
        raw = connections[NEIGHBOUR].connection  # used by one thread at a time

        def wait_on_the_record() -> None:
            with raw.cursor() as raw_cursor:
                raw_cursor.execute(f"SELECT id FROM {TABLE} WHERE id = %s FOR UPDATE", [record])
                raw_cursor.fetchall()

        pool.submit(wait_on_the_record).result(60)  # granted once the request rolled back
        transaction.set_rollback(True, using=NEIGHBOUR)
    response = future.result(60)
    assert_503(response)
    [line] = key_warnings(caplog, key)
    assert "idempotency unavailable" in line, line
    assert ("1213" if connection.vendor == "mysql" else "deadlock") in line, line
    assert_kept_failed(key)
    assert effects("cc-undo-one", key) == 0
    assert_failed_once(send(key).result(60), key)


def started_session(future: Future[Any]) -> int:
    """The session of the view that ``future`` runs, once it started."""
    assert STARTING.wait(60), future.result(1)
    return STARTED["session"]


# --- A conflict at the compensation's COMMIT ----------------------------------------------------

PAUSED = Paused()


@on_servers
def test_a_write_skew_at_a_compensations_commit_is_503_and_the_retry_runs_it_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """PostgreSQL, SERIALIZABLE: ``one``'s compensation read a row that a neighbour then wrote,
    and the neighbour read the compensation's reservation and committed first. The COMMIT of
    the compensation fails for read/write dependencies (``40001``), which was the driver's
    error, a ``500``. Now: ``503``, the compensation rolled back; the retry runs it once."""
    if connection.vendor != "postgresql":
        pytest.skip("MariaDB has no serialization failure of its own (InnoDB locks instead)")
    key = f"cc-skew-{uuid.uuid4()}"
    run = interrupted_call(key)
    caplog.clear()
    anchor = Effect.objects.create(name="cc-anchor").pk

    def read_the_anchor() -> None:
        Effect.objects.filter(pk=anchor).exists()  # the neighbour writes it
        PAUSED.reached()  # the reservation and the effect are written: the COMMIT is next

    CONTROL["hook"] = read_the_anchor
    PAUSED.inside.clear()
    PAUSED.released.clear()
    serializable = "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE"
    future = send(key, serializable)
    assert PAUSED.inside.wait(60), future.result(1)
    CONTROL.pop("hook")
    read = f"SELECT id FROM {EVENTS} WHERE consumer = %s AND event_id = %s"
    write_skew(read, [COMPENSATION_CONSUMER, f"{run.pk}:one"], anchor, "cc-anchor, written")
    with caplog.at_level(logging.INFO, logger="django_idempotency"):
        PAUSED.go()
        response = future.result(60)
    assert_503(response)
    [line] = key_warnings(caplog, key)
    assert "idempotency unavailable" in line and "read/write dependencies" in line, line
    assert_kept_failed(key)
    assert lease_given_up(key)
    assert effects("cc-undo-one", key) == 0, "the rolled back compensation committed"
    assert_failed_once(send(key).result(60), key)


# --- The database lost in the compensation's reservation or at its COMMIT -----------------------

RESERVE = rf"(django_idempotency_reserve_v2|INSERT INTO \S*{EVENTS}).*'{{run}}:one'"
"""The reservation of ``one``'s compensation: PostgreSQL's function, MariaDB's insert (the
drivers send their parameters inlined)."""
COMMIT = r"(^|;)\s*COMMIT\s*(;|$)"
CUTS = {
    "reserve": (RESERVE, "before", None),
    "commit-unsent": (COMMIT, "before", "cc-undone-one"),
    "commit-unheard": (COMMIT, "after", "cc-undone-one"),
}


@pytest.fixture
def proxy() -> Iterator[PgProxy]:
    """``other``, where the records, the runs and the view's effects are, through a proxy."""
    with (
        proxy_for(connections["other"].settings_dict) as running,
        repointed("other", running.port),
        override_settings(IDEMPOTENCY={"DATABASE": "other"}),
    ):
        yield running


@pytest.mark.slow  # waits for the lease after the cut (3 s)
@pytest.mark.postgres
@pytest.mark.mysql
@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@pytest.mark.parametrize("cut", sorted(CUTS))
def test_a_database_lost_by_a_compensation_is_503_and_the_retry_runs_it_once(
    proxy: PgProxy, cut: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The connection is cut before ``one``'s reservation reaches the server, before its COMMIT
    does, or after the server committed it and before the answer came back. That was the
    driver's error, a ``500``. Now: ``503`` (whether it took effect is unknown); the record and
    the run marked failed stay; the retry after the lease runs the compensation once, or finds
    it reserved when its COMMIT took effect."""
    key = f"cc-lost-{cut}-{uuid.uuid4()}"
    run = interrupted_call(key, "other")
    caplog.clear()
    pattern, when, following = CUTS[cut]
    rule = proxy.cut(pattern.format(run=run.pk), when=when, following=following)
    with caplog.at_level(logging.INFO, logger="django_idempotency"):
        response = send(key).result(60)
    proxy.clear()
    assert rule.hits == 1
    assert isinstance(response, HttpResponse), f"a 500: {response!r}"
    assert response.status_code == 503, response.content
    assert response["Content-Type"] == "application/problem+json"
    assert response["Retry-After"] == "1"
    problem = json.loads(response.content)
    assert problem["type"].endswith("#database-unavailable")
    assert "whether it took effect is unknown" in problem["detail"]
    [line] = key_warnings(caplog, key)
    assert "idempotency unavailable" in line and "database=other" in line, line
    assert_kept_failed(key, "other")
    committed = cut == "commit-unheard"
    assert effects("cc-undo-one", key, "other") == int(committed)
    assert effects("cc-undo-two", key, "other") == 1
    expire_lease_on(key, "other")  # the lost database kept it
    assert_failed_once(send(key).result(60), key, "other")


def expire_lease_on(key: str, alias: str) -> None:
    IdempotencyRecord.objects.using(alias).filter(key=key).update(
        locked_until=timezone.now() - timedelta(seconds=1)
    )


# --- The completer ------------------------------------------------------------------------------


@on_servers
def test_the_completer_leaves_a_run_whose_compensation_met_a_conflict_for_its_next_pass(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The completer rolls the flow forward; ``one``'s reservation runs out of lock wait on
    the neighbour's. That was ``raised`` (a traceback, and an attempt counted). Now the outcome
    is ``paused`` with status 503 and one WARNING line; the next pass runs the compensation once
    and stores the failure."""
    key = f"cc-completer-{uuid.uuid4()}"
    run = interrupted_call(key)
    caplog.clear()
    attempts = FlowRun.objects.get(pk=run.pk).attempts

    def complete() -> Any:
        statement = before()
        if statement is not None:
            with connection.cursor() as cursor:
                cursor.execute(statement)
        return complete_abandoned()

    with (
        caplog.at_level(logging.INFO, logger="django_idempotency"),
        transaction.atomic(using=NEIGHBOUR),
    ):
        reserved_by_neighbour(run, "one")
        thread, outcome = in_thread(complete)
        thread.join(60)
        transaction.set_rollback(True, using=NEIGHBOUR)
    assert "error" not in outcome, outcome
    [done] = outcome["result"]
    assert (done.outcome, done.status) == ("paused", 503), done
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "idempotency unavailable" in warnings[0], warnings
    assert_kept_failed(key)
    assert FlowRun.objects.get(pk=run.pk).attempts == attempts, "a conflict counted"
    assert effects("cc-undo-one", key) == 0

    [again] = complete_abandoned()
    assert (again.outcome, again.status) == ("failed", FlowFailed.status), again
    assert_failed_once(flow_view(post(key)), key)  # type: ignore[call-arg]
    assert complete_abandoned() == []


# --- A second roll-forward whose view stops before any phase ------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("by", ["retry", "completer"])
def test_a_second_roll_forward_stores_where_the_first_stopped(by: str) -> None:
    """The first roll-forward (the retry) stopped at the call ``three``, compensated ``two``,
    and ``one``'s compensation raised: its failure was not stored. The second one (a retry or
    the completer) runs a view that raises before any phase: it stored ``interrupted: null``
    and ``compensated: []``. It stores ``three``, kept on the run by the first, and ``two``,
    whose compensation ran; ``one``'s, which the view no longer reaches, did not run."""
    key = f"cc-second-{uuid.uuid4()}"
    interrupted_call(key)
    CONTROL["undo_one_raises"] = True
    with pytest.raises(ProbeError):
        flow_view(post(key))  # type: ignore[call-arg]
    CONTROL.pop("undo_one_raises")
    assert FlowRun.objects.get(record__key=key).state == FlowRun.State.FAILED
    assert effects("cc-undo-two", key) == 1

    CONTROL["raise_first"] = True
    if by == "retry":
        response = flow_view(post(key))  # type: ignore[call-arg]
    else:
        [done] = complete_abandoned()
        assert done.outcome == "failed", done
        response = flow_view(post(key))  # type: ignore[call-arg]
        assert response["Idempotent-Replayed"] == "true"
    assert response.status_code == FlowFailed.status, response.content
    problem = json.loads(response.content)
    assert problem["interrupted"] == "three", problem
    assert problem["compensated"] == ["two"], problem
    assert problem["recovery_point"] == "two"
    assert effects("cc-undo-two", key) == 1, "a compensation ran twice"
    assert effects("cc-undo-one", key) == 0
    assert effects("cc-booked", key) == 1
    run = FlowRun.objects.get(record__key=key)
    assert (run.state, run.started) == (FlowRun.State.FAILED, "three")
    assert IdempotencyRecord.objects.get(key=key).state == IdempotencyRecord.State.COMPLETED
