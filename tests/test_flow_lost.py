"""A phased flow that loses the database at its own statements: a ``503`` with the record and the
run kept, never the driver's ``500`` nor a "taken over" ``409``, and each phase's effect exactly
once across the ``503`` and the retry (or the completer's next pass).

A phase's transaction holds the phase's writes, the fence (the compare-and-swap on the claim's
token that extends the lease), the move of the recovery point and the phase's stored result,
then its ``COMMIT``. The connection is cut (``tests/db_proxy.py``) before the fence or the move
of the recovery point reaches the server, before the ``COMMIT`` does, or after the server
committed it and before its answer came back. A conflict there was a ``503`` already
(``tests/test_flow_conflicts.py``); a lost database was the driver's error. Now it is the
core's ``503`` database-unavailable with ``Retry-After``, as every other lost-database path
(``Idempotency._saving_failed``): the record stays in progress under its lease (the server
cannot be told), the run keeps what committed, and the retry after the lease (or the completer)
resumes: a phase whose ``COMMIT`` took effect unheard is recorded by that same transaction, so it
never runs again; one that did not commit runs once. A foreign call's two transactions (the fence
before the call, the stored result after it) are covered the same way.

The phase's own function is not: a database error of its writes is the view's, as in lease
mode.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory, override_settings
from django.utils import timezone

from django_idempotency import idempotent
from django_idempotency.conf import conf
from django_idempotency.flows.completer import complete_abandoned
from django_idempotency.flows.phases import Flow
from django_idempotency.models import FlowRun, IdempotencyRecord
from testproject.shop.models import Effect
from testproject.shop.probe_flows import ProbeError
from tests.db_proxy import PgProxy, proxy_for, repointed

pytestmark = [
    pytest.mark.slow,  # a cut connection, then the retry through the proxy: 2-3 s each
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, databases=["default", "other"]),
]

RECORDS = IdempotencyRecord._meta.db_table
RUNS = FlowRun._meta.db_table
ALIAS = "other"
CRASH: set[str] = set()
"""Keys whose request raises after phase ``one``, as a process that died there leaves it."""


@idempotent(phases=True, lease=timedelta(seconds=60), name="flow_lost")
def flow_view(request: HttpRequest, flow: Flow) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    alias = conf.DATABASE

    def step(name: str) -> dict[str, Any]:
        effect = Effect.objects.using(alias).create(name=f"fl-{name}", payload=key).pk
        with connections[alias].cursor() as cursor:  # the proxy's mark: the fence is next
            cursor.execute(f"SELECT 'fl-ran-{name}'")
        return {"id": effect, "mark": f"fl-result-{name}"}

    def book(call_key: str) -> dict[str, Any]:
        # The other system's effect, made once per idempotency key: a call whose result was not
        # stored is made again, with the same key.
        Effect.objects.using(alias).get_or_create(name=f"fl-three {call_key}", payload=key)
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT 'fl-ran-three'")
        return {"booked": call_key, "mark": "fl-result-three"}

    one = flow.phase("one", lambda: step("one"))
    if key in CRASH:
        CRASH.discard(key)
        raise ProbeError("the worker died after phase one")
    two = flow.phase("two", lambda: step("two"))
    three = flow.call("three", book)
    return JsonResponse({"one": one["id"], "two": two["id"], "three": three["booked"]}, status=201)


def post(key: str) -> HttpRequest:
    return RequestFactory().post(
        "/fl/", b"{}", content_type="application/json", headers={"Idempotency-Key": key}
    )


def send(key: str) -> Future[Any]:
    """Run the view for ``key`` in a thread of its own; the future holds the response, or the
    database error raised (the library's ``500``)."""

    def run() -> Any:
        try:
            return flow_view(post(key))  # type: ignore[call-arg]
        except DatabaseError as exc:
            return exc
        finally:
            connections.close_all()

    return ThreadPoolExecutor(1).submit(run)


def completer() -> Future[Any]:
    def run() -> Any:
        try:
            return complete_abandoned(using=ALIAS)
        finally:
            connections.close_all()

    return ThreadPoolExecutor(1).submit(run)


@pytest.fixture
def proxy() -> Iterator[PgProxy]:
    """``other``, where the records, the runs and the view's effects are, through a proxy."""
    with (
        proxy_for(connections[ALIAS].settings_dict) as running,
        repointed(ALIAS, running.port),
        override_settings(IDEMPOTENCY={"DATABASE": ALIAS}),
    ):
        yield running


COMMIT = r"(^|;)\s*COMMIT\s*(;|$)"
FENCE = r"locked_until\s*="


def cut_rule(where: str, phase: str) -> tuple[str, str, str | None]:
    """The pattern, ``when`` and ``following`` of the cut at ``where`` in ``phase``'s
    transaction. The statements are told apart by the marks the phase writes: its function's
    last statement (``fl-ran-<phase>``), its stored result (``fl-result-<phase>``)."""
    saved = rf"{RUNS}.*fl-result-{phase}"  # the move of the recovery point with its result
    # The call's second transaction: the fence (its first statement), then the stored result.
    fence = (FENCE, "before", None if phase == "three" else f"fl-ran-{phase}")
    return {
        "fence": fence,
        "save": (saved, "before", FENCE),
        "commit-unsent": (COMMIT, "before", saved),
        "commit-unheard": (COMMIT, "after", saved),
    }[where]


def effects(name: str, key: str) -> int:
    """The effects of phase ``fl-<name>`` for ``key`` (the call's: one per key it was sent)."""
    return Effect.objects.using(ALIAS).filter(name__startswith=name, payload=key).count()


def key_warnings(caplog: pytest.LogCaptureFixture, key: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and key in r.getMessage()
    ]


def assert_unavailable(response: Any) -> None:
    assert isinstance(response, HttpResponse), f"a 500: {response!r}"
    assert response.status_code == 503, (response.status_code, response.content)
    assert response["Content-Type"] == "application/problem+json"
    assert response["Retry-After"] == "1"
    problem = json.loads(response.content)
    assert problem["type"].endswith("#database-unavailable"), problem
    assert "whether it took effect is unknown" in problem["detail"], problem


def expire_lease(key: str) -> None:
    """The lost database kept the lease (the server could not be told): as if it ran out."""
    IdempotencyRecord.objects.using(ALIAS).filter(key=key).update(
        locked_until=timezone.now() - timedelta(seconds=1)
    )


def recovery_point(key: str) -> str | None:
    run = FlowRun.objects.using(ALIAS).filter(record__key=key).first()
    return None if run is None else run.recovery_point


def assert_done_once(response: Any, key: str) -> None:
    """The flow finished; each phase's effect happened once."""
    assert isinstance(response, HttpResponse), f"a 500: {response!r}"
    assert response.status_code == 201, (response.status_code, response.content)
    for name in ("one", "two", "three"):
        assert effects(f"fl-{name}", key) == 1, f"phase {name} ran {effects(f'fl-{name}', key)}"
    record = IdempotencyRecord.objects.using(ALIAS).get(key=key)
    assert record.state == IdempotencyRecord.State.COMPLETED
    run = FlowRun.objects.using(ALIAS).get(record=record)
    assert run.state == FlowRun.State.COMPLETED
    replay = flow_view(post(key))  # type: ignore[call-arg]
    assert replay["Idempotent-Replayed"] == "true"
    assert json.loads(replay.content) == json.loads(response.content)


# phase, where: what committed before the 503 (the recovery point, None: no run).
CASES = {
    ("one", "fence"): None,
    ("one", "save"): None,
    ("one", "commit-unsent"): None,
    ("one", "commit-unheard"): "one",
    ("two", "fence"): "one",
    ("two", "save"): "one",
    ("two", "commit-unsent"): "one",
    ("two", "commit-unheard"): "two",
    ("three", "commit-unsent"): "two",
    ("three", "commit-unheard"): "three",
}


@pytest.mark.parametrize(
    ("phase", "where"), sorted(CASES), ids=[f"{p}-{w}" for p, w in sorted(CASES)]
)
@pytest.mark.parametrize("by", ["retry", "completer"])
def test_a_database_lost_at_a_phases_own_statements_is_503_and_each_phase_runs_once(
    proxy: PgProxy, phase: str, where: str, by: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The connection is cut at ``where`` in ``phase``'s transaction. That answered the
    driver's error (a ``500``; the claim's lease given up by the pause on a new connection).
    Now: ``503`` database-unavailable, one WARNING line, the record in progress under its
    lease, the run holding what committed; the retry after the lease (or the completer)
    resumes, and no phase runs twice."""
    key = f"fl-{phase}-{where}-{by}-{uuid.uuid4()}"
    pattern, when, following = cut_rule(where, phase)
    rule = proxy.cut(pattern, when=when, following=following)
    with caplog.at_level(logging.INFO, logger="django_idempotency"):
        response = send(key).result(60)
    proxy.clear()
    assert rule.hits == 1
    assert_unavailable(response)
    [line] = key_warnings(caplog, key)
    assert "idempotency unavailable" in line and f"database={ALIAS}" in line, line
    record = IdempotencyRecord.objects.using(ALIAS).get(key=key)
    assert record.state == IdempotencyRecord.State.IN_PROGRESS
    assert record.locked_until is not None and record.locked_until > timezone.now(), (
        "the lease was given up"
    )
    committed = CASES[phase, where]
    assert recovery_point(key) == committed
    if committed is not None:
        run = FlowRun.objects.using(ALIAS).get(record=record)
        assert (run.state, run.attempts) == (FlowRun.State.RUNNING, 0)
    order = ["one", "two", "three"]
    for name in order:
        # Before the cut phase: committed. The call's effect is made outside any transaction.
        before = order.index(name) < order.index(phase)
        expected = before or (name == phase and (committed == phase or phase == "three"))
        assert effects(f"fl-{name}", key) == int(expected), name

    expire_lease(key)
    if by == "retry":
        assert_done_once(send(key).result(60), key)
        return
    if committed is None:
        # No run committed: nothing for the completer; the client's retry runs the flow.
        assert completer().result(60) == []
        assert_done_once(send(key).result(60), key)
        return
    [done] = completer().result(60)
    assert (done.outcome, done.status) == ("completed", 201), done
    replay = send(key).result(60)
    assert replay["Idempotent-Replayed"] == "true"
    assert_done_once(replay, key)


@pytest.mark.parametrize("where", ["fence", "commit-unheard"])
def test_the_completer_pauses_a_run_that_lost_the_database_at_a_phase(
    proxy: PgProxy, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The client's request committed phase ``one`` and raised (its lease given up); the
    completer resumes the run and loses the database at ``two``'s fence, or after ``two``'s
    COMMIT took effect. That was ``raised`` with a traceback. Now the outcome is ``paused``
    with status ``503`` and one WARNING line, the lease kept; the pass counts as an attempt (a
    server that kills the connection at every pass must not pause the run for ever:
    ``tests/test_review_flow_comp.py``). The next pass after the lease finishes the flow,
    ``two`` run once."""
    key = f"fl-completer-{where}-{uuid.uuid4()}"
    CRASH.add(key)
    with pytest.raises(ProbeError):
        flow_view(post(key))  # type: ignore[call-arg]
    assert recovery_point(key) == "one"
    attempts = FlowRun.objects.using(ALIAS).get(record__key=key).attempts
    caplog.clear()
    pattern, when, following = cut_rule(where, "two")
    rule = proxy.cut(pattern, when=when, following=following)
    with caplog.at_level(logging.INFO, logger="django_idempotency"):
        [done] = completer().result(60)
    proxy.clear()
    assert rule.hits == 1
    assert (done.outcome, done.status) == ("paused", 503), done
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "idempotency unavailable" in warnings[0], warnings
    run = FlowRun.objects.using(ALIAS).get(record__key=key)
    assert run.attempts == attempts + 1, "the completer's lost pass was not counted"
    assert "server closed the connection" in run.last_error or "Lost connection" in run.last_error
    assert run.recovery_point == ("two" if where == "commit-unheard" else "one")
    assert completer().result(60) == [], "the lease was given up: a lost database keeps it"
    expire_lease(key)
    [again] = completer().result(60)
    assert (again.outcome, again.status) == ("completed", 201), again
    assert_done_once(send(key).result(60), key)
