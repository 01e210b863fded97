"""An outside review of the roll-forward's conflicts (merge 73e84bc): a conflict or a lost database
at a compensation's fence, reservation or COMMIT is a ``503`` with the run kept (the completer's
outcome ``paused``), and a second roll-forward stores the first one's ``interrupted`` phase (kept
in ``FlowRun.started`` of a run marked ``failed``) and the compensations an earlier one ran.

Each suspicion is a test, against real databases:

* a second roll-forward whose compensations partly ran, and whose view now reaches fewer
  phases: every compensation once, each named once in ``compensated``, newest first;
* a run marked ``failed`` by an older version, which cleared ``FlowRun.started``: rolled forward
  again once, by the client's retry or the completer;
* the completer and the client's retry racing for the same failed run (threads): one rolls it
  forward, the other is told to wait (``409``, or MariaDB's ``503`` for a claim that meets the
  row lock), never a ``500``, never a compensation twice;
* the ``paused`` outcome: a database's ``503`` was not counted as an attempt, so a run whose
  connection the server kills at every pass (MariaDB's ``idle_transaction_timeout`` shorter
  than a phase) was paused on every pass and never rolled forward. The completer's pass that
  loses the database at a phase now counts.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone

from django_idempotency import idempotent
from django_idempotency.flows.completer import complete_abandoned
from django_idempotency.flows.phases import Flow, FlowFailed
from django_idempotency.models import FlowRun, IdempotencyRecord
from testproject.shop.models import Effect
from testproject.shop.probe_flows import ProbeError
from tests.test_flow_compensation_conflicts import post

ALL = [pytest.mark.sqlite, pytest.mark.postgres, pytest.mark.mysql]
ALL.append(pytest.mark.django_db(transaction=True))
SERVERS = [pytest.mark.postgres, pytest.mark.mysql, pytest.mark.django_db(transaction=True)]

CONTROL: dict[str, Any] = {}
"""``call_raises``: the call ``three`` (no key) fails; ``undo_one_raises``: ``one``'s
compensation fails (its own error); ``raise_first`` / ``raise_after_one``: the view raises
before any phase / after ``one``; ``hook``: called inside ``one``'s compensation."""


@pytest.fixture(autouse=True)
def control() -> Iterator[None]:
    CONTROL.clear()
    yield
    CONTROL.clear()


def on(marks: list[Any]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def mark(test: Callable[..., None]) -> Callable[..., None]:
        for each in reversed(marks):
            test = each(test)
        return test

    return mark


def undo(name: str) -> Callable[[dict[str, Any], str], None]:
    def compensate(result: dict[str, Any], key: str) -> None:
        Effect.objects.create(name=f"rc-undo-{name}", payload=result["key"])
        if name == "one":
            if CONTROL.get("undo_one_raises"):
                raise ProbeError("the refund was declined")
            hook = CONTROL.get("hook")
            if hook is not None:
                hook()

    return compensate


@idempotent(phases=True, lease=timedelta(seconds=60), name="review_flow_comp")
def flow_view(request: HttpRequest, flow: Flow) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    if CONTROL.get("raise_first"):
        raise ProbeError("the view fails before its first phase now")
    for name in ("one", "two"):
        flow.phase(
            name,
            lambda name=name: {  # type: ignore[misc]
                "key": key,
                "id": Effect.objects.create(name=f"rc-{name}", payload=key).pk,
            },
            compensate=undo(name),
        )
        if name == "one" and CONTROL.get("raise_after_one"):
            raise ProbeError("the view fails after phase one now")

    def book(call_key: str) -> dict[str, str]:
        Effect.objects.create(name="rc-booked", payload=key)
        if CONTROL.get("call_raises"):
            raise ProbeError("the courier timed out")
        return {"booked": call_key}

    flow.call("three", book, resumable=False)
    return JsonResponse({}, status=201)


def effects(name: str, key: str) -> int:
    return Effect.objects.filter(name=name, payload=key).count()


def failed_once_then(key: str) -> FlowRun:
    """Phases ``one`` and ``two`` commit, the call ``three`` (no key) fails; the retry rolls
    the flow forward, compensates ``two``, and ``one``'s compensation raises (its own error):
    the run stays marked ``failed`` with ``three``, its answer not stored."""
    CONTROL["call_raises"] = True
    with pytest.raises(ProbeError):
        flow_view(post(key))  # type: ignore[call-arg]
    CONTROL.pop("call_raises")
    CONTROL["undo_one_raises"] = True
    with pytest.raises(ProbeError):
        flow_view(post(key))  # type: ignore[call-arg]
    CONTROL.pop("undo_one_raises")
    run = FlowRun.objects.get(record__key=key)
    assert (run.state, run.started, run.recovery_point) == (FlowRun.State.FAILED, "three", "two")
    assert effects("rc-undo-two", key) == 1 and effects("rc-undo-one", key) == 0
    assert IdempotencyRecord.objects.get(key=key).state == IdempotencyRecord.State.IN_PROGRESS
    return run


def assert_failed(
    response: Any, key: str, interrupted: str | None, compensated: list[str]
) -> None:
    """The stored ``flow-failed`` answer; each compensation ran at most once, ``one``'s once
    when it is named; the call that takes no key never ran again."""
    assert isinstance(response, HttpResponse), f"a 500: {response!r}"
    assert response.status_code == FlowFailed.status, response.content
    problem = json.loads(response.content)
    assert (problem["interrupted"], problem["compensated"]) == (interrupted, compensated), problem
    assert effects("rc-undo-two", key) == 1, "a compensation ran twice"
    assert effects("rc-undo-one", key) == int("one" in compensated)
    assert effects("rc-booked", key) == 1, "the call that takes no key ran again"
    assert effects("rc-one", key) == effects("rc-two", key) == 1
    record = IdempotencyRecord.objects.get(key=key)
    assert record.state == IdempotencyRecord.State.COMPLETED
    replay = flow_view(post(key))  # type: ignore[call-arg]
    assert replay["Idempotent-Replayed"] == "true"
    assert json.loads(replay.content) == problem


def roll_forward_again(key: str, by: str) -> Any:
    """Roll the failed run forward again by the client's retry, or by the completer (then the
    client's retry gets the stored failure as a replay)."""
    if by == "completer":
        [done] = complete_abandoned()
        assert (done.outcome, done.status) == ("failed", FlowFailed.status), done
        response = flow_view(post(key))  # type: ignore[call-arg]
        assert response["Idempotent-Replayed"] == "true"
        return response
    return flow_view(post(key))  # type: ignore[call-arg]


# --- A second roll-forward whose compensations partly ran ---------------------------------------


@on(ALL)
@pytest.mark.parametrize("by", ["retry", "completer"])
def test_a_second_roll_forward_that_reaches_fewer_phases_names_each_compensation_once(
    by: str,
) -> None:
    """The first roll-forward compensated ``two``; ``one``'s compensation raised. The second
    one's view raises after ``one`` (it no longer reaches ``two``): it runs ``one``'s
    compensation once, does not run ``two``'s again, and names both, newest first, each once."""
    key = f"rc-fewer-{by}-{uuid.uuid4()}"
    failed_once_then(key)
    CONTROL["raise_after_one"] = True
    response = roll_forward_again(key, by)
    CONTROL.pop("raise_after_one")
    assert_failed(response, key, "three", ["two", "one"])


@on(ALL)
def test_a_third_roll_forward_after_two_partial_ones_runs_each_compensation_once() -> None:
    """Two roll-forwards in a row stop at ``one``'s compensation (its own error); the third
    reaches every phase: ``two``'s compensation ran once (the first), ``one``'s runs now."""
    key = f"rc-third-{uuid.uuid4()}"
    failed_once_then(key)
    CONTROL["undo_one_raises"] = True
    with pytest.raises(ProbeError):
        flow_view(post(key))  # type: ignore[call-arg]
    CONTROL.pop("undo_one_raises")
    assert effects("rc-undo-two", key) == 1
    assert_failed(flow_view(post(key)), key, "three", ["two", "one"])  # type: ignore[call-arg]


# --- A run marked failed by an older version ----------------------------------------------------


def as_an_older_version_marked_it(run: FlowRun) -> None:
    """Before 73e84bc the mark cleared ``started`` (the phase it stopped at was not kept)."""
    FlowRun.objects.filter(pk=run.pk).update(started="")


@on(ALL)
@pytest.mark.parametrize("by", ["retry", "completer"])
def test_a_run_an_older_version_marked_failed_is_rolled_forward_once(by: str) -> None:
    """The run's ``started`` is empty: the next roll-forward stops where its view stops now
    (the call ``three``, not run again), runs ``one``'s compensation once and not ``two``'s."""
    key = f"rc-older-{by}-{uuid.uuid4()}"
    as_an_older_version_marked_it(failed_once_then(key))
    assert_failed(roll_forward_again(key, by), key, "three", ["two", "one"])
    run = FlowRun.objects.get(record__key=key)
    assert (run.state, run.started) == (FlowRun.State.FAILED, "three")


@on(ALL)
def test_a_run_an_older_version_marked_failed_whose_view_now_raises_first_is_stored() -> None:
    """Nothing says where the first roll-forward stopped, and the view now raises before any
    phase: ``interrupted`` is null, ``compensated`` names ``two`` (its reservation says it
    ran), and ``one``'s compensation, reached by no roll-forward, is not run."""
    key = f"rc-older-first-{uuid.uuid4()}"
    as_an_older_version_marked_it(failed_once_then(key))
    CONTROL["raise_first"] = True
    response = flow_view(post(key))  # type: ignore[call-arg]
    CONTROL.pop("raise_first")
    assert_failed(response, key, None, ["two"])


# --- The completer and the client's retry racing for one failed run -----------------------------


def client(key: str) -> Any:
    try:
        return flow_view(post(key))  # type: ignore[call-arg]
    except DatabaseError as exc:  # the library's 500
        return exc
    finally:
        connections.close_all()


def completer() -> Any:
    try:
        return complete_abandoned()
    finally:
        connections.close_all()


def held_in_one() -> tuple[threading.Event, threading.Event]:
    """``(inside, release)``: ``one``'s compensation, once its effect is written, sets
    ``inside`` and waits for ``release``."""
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        inside.set()
        assert release.wait(60), "the test never let the compensation finish"

    CONTROL["hook"] = hold
    return inside, release


WAIT_STATUSES = (409, 503)
"""A claim that finds the record held: ``409`` in progress, or on MariaDB ``503`` for a claim
that meets the holder's row lock (it never waits for it)."""


@on(SERVERS)
def test_a_client_retry_while_the_completer_rolls_the_run_forward_waits() -> None:
    """The completer rolls the failed run forward and is inside ``one``'s compensation when
    the client retries: the client is told to wait (or, on PostgreSQL, whose claim waits for
    the compensation's transaction, may get the failure the completer stored), and the
    client's next retry gets the failure; each compensation once."""
    key = f"rc-race-completer-{uuid.uuid4()}"
    failed_once_then(key)
    inside, release = held_in_one()
    with ThreadPoolExecutor(2) as pool:
        passing = pool.submit(completer)
        assert inside.wait(60), passing.result(1)
        # On PostgreSQL the claim's insert waits for the compensation's transaction, whose
        # fence updated the record: it is let go a moment later.
        retrying = pool.submit(client, key)
        time.sleep(0.5)
        release.set()
        [done] = passing.result(60)
        retry = retrying.result(60)
    assert isinstance(retry, HttpResponse), f"a 500: {retry!r}"
    replayed = retry.status_code == FlowFailed.status and retry["Idempotent-Replayed"] == "true"
    assert retry.status_code in WAIT_STATUSES or replayed, (retry.status_code, retry.content)
    assert (done.outcome, done.status) == ("failed", FlowFailed.status), done
    CONTROL.pop("hook")
    assert_failed(client(key), key, "three", ["two", "one"])


@on(SERVERS)
def test_the_completer_leaves_a_failed_run_a_client_retry_is_rolling_forward() -> None:
    """The client's retry is inside ``one``'s compensation (its fence renewed the lease): the
    completer does not take the run up; the retry stores the failure."""
    key = f"rc-race-client-{uuid.uuid4()}"
    failed_once_then(key)
    inside, release = held_in_one()
    with ThreadPoolExecutor(1) as pool:
        retrying = pool.submit(client, key)
        assert inside.wait(60), retrying.result(1)
        passed = completer()
        release.set()
        response = retrying.result(60)
    assert passed == [], passed
    CONTROL.pop("hook")
    assert_failed(response, key, "three", ["two", "one"])


@on(SERVERS)
@pytest.mark.parametrize("round_", range(3))
def test_the_completer_and_a_client_retry_started_together_roll_forward_once(
    round_: int,
) -> None:
    """Both start at once (a barrier): one of them rolls the run forward; the other is told to
    wait (the client), or leaves it (the completer: ``busy``, ``replayed``, ``paused`` with
    ``503``, or nothing to do). No ``500``, no compensation twice; the failure is stored once
    the loser tries again."""
    key = f"rc-race-{round_}-{uuid.uuid4()}"
    failed_once_then(key)
    barrier = threading.Barrier(2)

    def together(target: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            barrier.wait(30)
            return target()

        return run

    with ThreadPoolExecutor(2) as pool:
        passing = pool.submit(together(completer))
        retrying = pool.submit(together(lambda: client(key)))
        passed, response = passing.result(60), retrying.result(60)
    assert isinstance(response, HttpResponse), f"a 500: {response!r}"
    assert response.status_code in (FlowFailed.status, *WAIT_STATUSES), response.content
    outcomes = {(done.outcome, done.status) for done in passed}
    allowed = {
        ("failed", FlowFailed.status),
        ("busy", 409),
        ("replayed", FlowFailed.status),
        ("paused", 503),
    }
    assert outcomes <= allowed, passed
    assert effects("rc-undo-two", key) == 1, "a compensation ran twice"
    assert effects("rc-undo-one", key) <= 1, "a compensation ran twice"
    final = client(key)
    if final.status_code in WAIT_STATUSES:  # neither finished (both lost the claim's race)
        IdempotencyRecord.objects.filter(key=key).update(
            locked_until=timezone.now() - timedelta(seconds=1)
        )
        final = client(key)
    assert_failed(final, key, "three", ["two", "one"])


# --- Paused for ever ----------------------------------------------------------------------------

KILLED_AFTER = 1
"""MariaDB's ``idle_transaction_timeout`` (seconds) in the test below."""


@idempotent(phases=True, lease=timedelta(seconds=1), name="review_flow_comp_idle")
def idle_view(request: HttpRequest, flow: Flow) -> HttpResponse:
    """Phase ``slow`` waits longer than the server lets a transaction idle, after its write:
    the server kills the connection, and the phase's fence meets a lost database every time."""
    key = request.headers["Idempotency-Key"]
    with connection.cursor() as cursor:
        cursor.execute(f"SET SESSION idle_transaction_timeout = {KILLED_AFTER}")
    flow.phase("one", lambda: {"id": Effect.objects.create(name="rc-idle-one", payload=key).pk})

    def slow() -> dict[str, Any]:
        effect = Effect.objects.create(name="rc-idle-slow", payload=key).pk
        time.sleep(KILLED_AFTER + 0.6)  # a call to another system, inside the transaction
        return {"id": effect}

    flow.phase("slow", slow)
    return JsonResponse({}, status=201)


@pytest.mark.slow  # each pass waits for the server to kill the idle transaction (2 s)
@pytest.mark.mysql
@pytest.mark.django_db(transaction=True)
def test_a_run_whose_connection_is_killed_at_every_pass_is_not_paused_for_ever() -> None:
    """MariaDB kills the connection of a transaction left idle longer than
    ``idle_transaction_timeout``: phase ``slow`` loses the database at its fence on every
    run (``503``, the lease kept). A lost database was not counted as an attempt, so every
    pass of the completer paused the run again, for ever. Each pass of the completer that
    loses the database at a phase now counts: after ``max_attempts`` passes the run is rolled
    forward to failure, as a view that raises every time is. (The client's own ``503`` is not
    counted: a client gives up.)"""
    if connection.vendor != "mysql":
        pytest.skip("MariaDB's idle_transaction_timeout")
    key = f"rc-idle-{uuid.uuid4()}"
    response = idle_view(post(key))  # type: ignore[call-arg]
    assert response.status_code == 503, response.content
    assert FlowRun.objects.get(record__key=key).attempts == 0
    outcomes = []
    for _ in range(3):
        IdempotencyRecord.objects.filter(key=key).update(
            locked_until=timezone.now() - timedelta(seconds=1)
        )
        [done] = complete_abandoned(max_attempts=2)
        outcomes.append((done.outcome, done.status))
    assert outcomes == [("paused", 503), ("paused", 503), ("failed", FlowFailed.status)]
    assert effects("rc-idle-one", key) == 1 and effects("rc-idle-slow", key) == 0
    assert complete_abandoned() == []
