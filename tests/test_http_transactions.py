"""One transaction per first execution: statement counts, ATOMIC_REQUESTS, the view's own
atomic blocks, and a concurrent duplicate (409, or a replay within ``WAIT``)."""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency.exceptions import RequestInProgress
from django_idempotency.http.core import Captured, Command, Idempotency, Policy, Replay
from django_idempotency.http.fingerprint import fingerprint
from django_idempotency.models import IdempotencyRecord
from testproject.shop.models import Effect
from testproject.shop.probe_views import ProbeError
from tests.probes import body, effects, in_thread, post, problem

URL = "/probe/effect/"
TABLE = IdempotencyRecord._meta.db_table
BOUNDARIES = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE SAVEPOINT")


def captured(action: Callable[[], Any]) -> list[str]:
    with CaptureQueriesContext(connection) as queries:
        action()
    return [str(query["sql"]).strip() for query in queries.captured_queries]


def boundaries(queries: list[str]) -> list[str]:
    """Transaction control that Django logs alongside the statements."""
    return [sql.split()[0] for sql in queries if sql.startswith(BOUNDARIES)]


def statements(queries: list[str]) -> list[str]:
    # MySQLdb reports a statement that failed (the duplicate insert) as "None".
    return [sql for sql in queries if not sql.startswith(BOUNDARIES)]


# -- statement counts -------------------------------------------------------------------------


def assert_claim(sql: str) -> None:
    """The claim: on PostgreSQL a short call of the claim function (its plan is cached per
    session, see migrations 0005 and 0008), elsewhere an INSERT into the records table."""
    if connection.vendor == "postgresql":
        assert sql.startswith("SELECT * FROM django_idempotency_claim_v2("), sql
        assert TABLE not in sql
    else:
        assert TABLE in sql, sql


def is_psycopg3() -> bool:
    return connection.vendor == "postgresql" and connection.Database.__name__ == "psycopg"


def assert_store(sql: str, *, commit: bool) -> None:
    """Storing the response: on PostgreSQL a call of the function from migration 0008 that
    writes a new key's record, completed, with the ``COMMIT`` in the same round trip when leaving
    the decorator's block commits (psycopg 3); elsewhere an UPDATE of the records table."""
    if connection.vendor != "postgresql":
        assert sql.startswith("UPDATE") and TABLE in sql, sql
        return
    assert sql.startswith("SELECT django_idempotency_insert_completed_v1("), sql
    assert TABLE not in sql
    assert sql.endswith("; COMMIT") == (commit and is_psycopg3()), sql


@pytest.mark.django_db(transaction=True)
def test_statements_added_by_a_first_execution_and_a_replay(client: Client) -> None:
    bare = captured(lambda: post(client, "/probe/mw/effect/", "bare"))
    first = captured(lambda: post(client, URL, "k"))
    replay = captured(lambda: post(client, URL, "k"))
    assert effects() == 2

    # The bare view runs one statement (its Effect insert) in autocommit mode.
    assert statements(bare) == [statements(bare)[0]]
    assert boundaries(bare) == []
    # The decorated view adds two statements: the claim and the store; and one transaction.
    added = statements(first)[:1] + statements(first)[2:]
    assert len(statements(first)) == 3, first
    assert_claim(added[0])
    assert_store(added[1], commit=True)
    # Django still logs its COMMIT; on psycopg 3 the driver finds nothing left to send.
    assert boundaries(first) == ["BEGIN", "COMMIT"]
    # A replay is one statement on PostgreSQL (the claim finds the completed row and takes no
    # lock), two elsewhere (the insert that meets the duplicate, then the read).
    assert len(statements(replay)) == (1 if connection.vendor == "postgresql" else 2), replay
    if connection.vendor == "postgresql":
        assert_claim(statements(replay)[0])
    print(
        f"\nSQL on {connection.vendor}: first execution adds {len(statements(first)) - 1} "
        f"statements + {boundaries(first)}; replay {len(statements(replay))} statements + "
        f"{boundaries(replay)}"
    )


@pytest.mark.django_db(transaction=True)
def test_statements_with_atomic_requests(client: Client, atomic_requests: None) -> None:
    first = captured(lambda: post(client, URL, "k"))
    replay = captured(lambda: post(client, URL, "k"))
    # Inside the request's transaction the decorator's block is a savepoint, so the store
    # never carries a COMMIT.
    assert len(statements(first)) == 3
    assert_store(statements(first)[2], commit=False)
    assert boundaries(first) == ["BEGIN", "SAVEPOINT", "RELEASE", "COMMIT"]
    assert len(statements(replay)) == (1 if connection.vendor == "postgresql" else 2)
    print(
        f"\nSQL on {connection.vendor} with ATOMIC_REQUESTS: first execution adds "
        f"{len(statements(first)) - 1} statements + {boundaries(first)}; replay "
        f"{len(statements(replay))} statements + {boundaries(replay)}"
    )


# -- the COMMIT that travels with the store (PostgreSQL, psycopg 3) ---------------------------


def run_view(key: str, view: Callable[[], str]) -> str | Replay:
    policy = Policy(using=connection.alias)
    return Idempotency(policy).run(
        command(key), view, lambda result: Captured(201, {}, result.encode())
    )


@pytest.mark.django_db(transaction=True)
def test_a_view_that_marks_its_transaction_for_rollback_commits_nothing() -> None:
    """``set_rollback(True)`` without raising: Django rolls the block back on exit. The client
    gets the view's answer, nothing is stored (the store would have raised
    TransactionManagementError, a 500), and nothing committed on the way."""
    from django.db import transaction

    def view() -> str:
        Effect.objects.create(name="marked", payload="x")
        transaction.set_rollback(True)
        return "rolled back"

    with CaptureQueriesContext(connection) as queries:
        assert run_view("marked", view) == "rolled back"
    assert effects("marked") == 0
    assert not IdempotencyRecord.objects.filter(key="marked").exists()
    assert not any("; COMMIT" in str(query["sql"]) for query in queries.captured_queries)
    # The key is free: a retry runs the view again.
    assert run_view("marked", lambda: "again") == "again"


@pytest.mark.django_db(transaction=True)
def test_on_commit_callbacks_run_once_after_the_commit() -> None:
    from django.db import transaction

    seen: list[tuple[int, bool]] = []

    def view() -> str:
        Effect.objects.create(name="hooked", payload="x")
        transaction.on_commit(lambda: seen.append((effects("hooked"), connection.in_atomic_block)))
        return "hooked"

    assert run_view("hooked", view) == "hooked"
    # Once, outside any transaction, and the effect is committed by then.
    assert seen == [(1, False)]
    assert isinstance(run_view("hooked", view), Replay)
    assert seen == [(1, False)]


@pytest.mark.django_db(transaction=True)
def test_with_server_side_binding_the_commit_goes_on_its_own() -> None:
    """Django's ``OPTIONS = {"server_side_binding": True}`` makes psycopg bind on the server
    (``psycopg.Cursor``), where one statement cannot carry another: the store is then sent alone
    and Django's commit follows, as before."""
    if not is_psycopg3():
        pytest.skip("psycopg 3 on PostgreSQL only")
    import psycopg

    connection.ensure_connection()
    raw = connection.connection
    client_binding = raw.cursor_factory
    raw.cursor_factory = psycopg.Cursor  # what server_side_binding=True sets
    try:
        with CaptureQueriesContext(connection) as queries:
            assert run_view("bound", lambda: "bound") == "bound"
        assert isinstance(run_view("bound", lambda: "again"), Replay)
    finally:
        raw.cursor_factory = client_binding
    sent = [str(query["sql"]) for query in queries.captured_queries]
    stores = [sql for sql in sent if "insert_completed_v1" in sql]
    assert len(stores) == 1 and not stores[0].endswith("; COMMIT"), sent
    assert sent[-1] == "COMMIT"


@pytest.mark.django_db(transaction=True)
def test_a_store_that_finds_its_claim_lost_commits_nothing() -> None:
    """The store's function raises on a lost claim, before the COMMIT that travels with it: the
    view's writes roll back and the client gets a 409. The key has an expired record, which the
    claim takes over (on PostgreSQL that writes the record at once, with this request's token);
    the claim is lost here by changing the record's token while the view runs, as a takeover by
    a retry would."""
    expired_record("lost")

    def view() -> str:
        Effect.objects.create(name="lost", payload="x")
        IdempotencyRecord.objects.filter(key="lost").update(token=uuid.uuid4())
        return "lost"

    with CaptureQueriesContext(connection) as queries, pytest.raises(RequestInProgress):
        run_view("lost", view)
    sent = [str(query["sql"]) for query in queries.captured_queries]
    assert any(sql.endswith("; COMMIT") for sql in sent) == is_psycopg3(), sent
    assert effects("lost") == 0
    # The takeover rolled back with the view: the expired record is as it was.
    (record,) = IdempotencyRecord.objects.filter(key="lost")
    assert record.expires_at < timezone.now() and record.response_body == b"old"
    assert not connection.in_atomic_block


@pytest.mark.django_db(transaction=True)
def test_a_new_key_whose_record_appeared_meanwhile_commits_nothing() -> None:
    """PostgreSQL leaves a new key's record to the store (``ClaimResult.deferred``): the claim's
    advisory lock keeps every other claim out until the store writes it. Should a record be
    there all the same (here the view writes one, past the lock), the store's function raises
    before the travelling COMMIT: the view's writes roll back and the client gets a 409."""
    if connection.vendor != "postgresql":
        pytest.skip("the deferred record is PostgreSQL's")

    def view() -> str:
        Effect.objects.create(name="appeared", payload="x")
        expired_record("appeared", expires_in=timedelta(days=1))
        return "appeared"

    with CaptureQueriesContext(connection) as queries, pytest.raises(RequestInProgress):
        run_view("appeared", view)
    sent = [str(query["sql"]) for query in queries.captured_queries]
    assert (
        any("insert_completed_v1" in sql and sql.endswith("; COMMIT") for sql in sent)
        == is_psycopg3()
    ), sent
    assert effects("appeared") == 0
    assert not IdempotencyRecord.objects.filter(key="appeared").exists()
    assert not connection.in_atomic_block


def expired_record(key: str, *, expires_in: timedelta = -timedelta(seconds=1)) -> None:
    """A completed record of ``key`` for ``run_view``'s request, expired unless told."""
    IdempotencyRecord.objects.create(
        owner=command(key).owner,
        key=key,
        fingerprint=command(key).fingerprint,
        method="POST",
        path=command(key).path,
        state=IdempotencyRecord.State.COMPLETED,
        response_status=201,
        response_body=b"old",
        expires_at=timezone.now() + expires_in,
    )


@pytest.mark.django_db(transaction=True)
def test_a_commit_that_fails_with_the_store_leaves_nothing_and_a_usable_connection() -> None:
    """A deferred constraint fails at COMMIT, which here travels with the store: the error
    reaches the caller as it would from Django's own commit, nothing of the request is kept, the
    connection is usable, and a retry runs the view afresh."""
    if connection.vendor != "postgresql":
        pytest.skip("a deferred unique constraint, PostgreSQL")
    from django.db import IntegrityError

    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE deferred_probe (v integer, "
            "CONSTRAINT deferred_probe_v UNIQUE (v) DEFERRABLE INITIALLY DEFERRED)"
        )
    try:

        def view() -> str:
            Effect.objects.create(name="deferred", payload="x")
            with connection.cursor() as cursor:
                cursor.execute("INSERT INTO deferred_probe (v) VALUES (1), (1)")
            return "never kept"

        with CaptureQueriesContext(connection) as queries, pytest.raises(IntegrityError):
            run_view("deferred", view)
        sent = [str(query["sql"]) for query in queries.captured_queries]
        assert any(sql.endswith("; COMMIT") for sql in sent) == is_psycopg3(), sent
        assert not connection.in_atomic_block
        assert effects("deferred") == 0
        assert not IdempotencyRecord.objects.filter(key="deferred").exists()
        assert run_view("deferred", lambda: "afresh") == "afresh"
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE deferred_probe")


# -- ATOMIC_REQUESTS and the view's own atomic blocks ----------------------------------------


@pytest.fixture
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    yield


@pytest.mark.django_db(transaction=True)
def test_atomic_requests(client: Client, atomic_requests: None) -> None:
    first = post(client, URL, "k")
    again = post(client, URL, "k")
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    with pytest.raises(ProbeError):
        post(client, "/probe/raise/", "r")
    assert post(client, f"{URL}?status=500", "s").status_code == 500
    assert post(client, f"{URL}?status=429", "t").status_code == 429
    assert effects() == 2  # the first execution and the 429's own change
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["k"]


@pytest.mark.django_db(transaction=True)
def test_a_view_with_its_own_atomic_blocks(client: Client) -> None:
    first = post(client, "/probe/nested-atomic/", "k")
    again = post(client, "/probe/nested-atomic/", "k")
    assert first.status_code == 201
    assert again.content == first.content
    names = sorted(Effect.objects.values_list("name", flat=True))
    assert names == ["nested-inner", "nested-outer"]


# -- a concurrent duplicate --------------------------------------------------------------------


class Gate:
    """A view for the core that writes an effect, then waits for the test to let it finish."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def view(self) -> str:
        Effect.objects.create(name="gated")
        self.started.set()
        assert self.release.wait(180), "the test never released the gate"
        return "done"


def capture(result: str) -> Captured:
    return Captured(201, {"Content-Type": "text/plain"}, result.encode())


def command(key: str) -> Command:
    return Command("anonymous", key, "POST", "/gated", fingerprint("POST", "/gated", b""))


def race_once(policy: Policy, *, release_after: float | None) -> dict[str, Any]:
    """Run A (gated) and, while it holds its transaction, B with the same key.

    ``release_after=None`` lets B finish before A may end (B must not wait for A); otherwise A
    is released after that many seconds, while B may still be waiting.
    """
    gate = Gate()
    key = str(uuid.uuid4())
    first, first_outcome = in_thread(
        lambda: Idempotency(policy).run(command(key), gate.view, capture)
    )
    assert gate.started.wait(60)
    second, second_outcome = in_thread(
        lambda: Idempotency(policy).run(command(key), lambda: "never", capture)
    )
    # B has this long to end while A holds (a guard: B that waits for A shows in its outcome).
    second.join(timeout=60 if release_after is None else release_after)
    gate.release.set()
    first.join(timeout=60)
    second.join(timeout=60)
    assert first_outcome == {"result": "done"}
    assert effects("gated") == 1
    return second_outcome


@pytest.mark.django_db(transaction=True)
def test_a_concurrent_duplicate_never_runs_and_gets_409_or_waits(client: Client) -> None:
    # SQLite has one writer: the duplicate waits for the database lock, so let A finish.
    release_after = 0.2 if connection.vendor == "sqlite" else None
    outcome = race_once(Policy(using=connection.alias, retry_after=3), release_after=release_after)
    if connection.vendor == "sqlite":
        assert isinstance(outcome["result"], Replay)
    else:
        error = outcome["error"]
        assert isinstance(error, RequestInProgress)
        assert error.as_response()["Retry-After"] == "3"


@pytest.mark.django_db(transaction=True)
def test_with_wait_the_duplicate_replays_once_the_first_finishes() -> None:
    outcome = race_once(Policy(using=connection.alias, wait=5), release_after=0.3)
    replay = outcome["result"]
    assert isinstance(replay, Replay)
    assert replay.body == b"done"
    assert replay.headers["Idempotent-Replayed"] == "true"


@pytest.mark.django_db
@override_settings(IDEMPOTENCY={"RETRY_AFTER": 7})
def test_409_is_problem_json_with_retry_after(client: Client) -> None:
    """A claim that is in progress elsewhere (here a live lease) answers 409 at once."""
    IdempotencyRecord.objects.create(
        owner="anonymous",
        key="k",
        fingerprint=fingerprint("POST", URL, b"{}", "application/json"),
        method="POST",
        path=URL,
        locked_until=timezone.now() + timedelta(minutes=1),
        expires_at=timezone.now() + timedelta(days=1),
    )
    response = post(client, URL, "k")
    details = problem(response, 409)
    assert details["type"].endswith("#in-progress")
    assert response["Retry-After"] == "7"
    assert effects() == 0
    # Not for a different request under the same key: that is a mismatch.
    problem(post(client, URL, "k", {"other": 1}), 422)
    assert body(post(client, URL, "other-key"))["effect"]


@pytest.mark.sqlite
@pytest.mark.django_db(transaction=True)
def test_sqlite_answers_409_when_the_database_lock_wait_runs_out(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(connection.settings_dict["OPTIONS"], "timeout", 0.2)
    connection.close()  # reconnect with the short lock timeout
    other = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another writer holds the database lock
    try:
        response = post(client, URL, "k")
    finally:
        other.execute("ROLLBACK")
        other.close()
        connection.close()
    problem(response, 409)
    assert effects() == 0


@pytest.mark.django_db(transaction=True)
def test_a_new_key_is_written_once_by_the_store_on_postgresql() -> None:
    """PostgreSQL, atomic mode, a key without a record: the claim writes nothing (its advisory
    lock keeps duplicates out), and the store writes the record, completed. Where a record is
    there already (here an expired one, taken over), the claim writes it at once, as before:
    the view sees it in progress under its own token."""
    if connection.vendor != "postgresql":
        pytest.skip("the deferred record is PostgreSQL's")
    seen: dict[str, list[str]] = {}

    def view_of(key: str) -> Callable[[], str]:
        def view() -> str:
            rows = IdempotencyRecord.objects.filter(key=key)
            seen[key] = [record.state for record in rows]
            return key

        return view

    assert run_view("fresh", view_of("fresh")) == "fresh"
    expired_record("again")
    assert run_view("again", view_of("again")) == "again"
    assert seen == {"fresh": [], "again": ["in_progress"]}
    for key in ("fresh", "again"):
        (record,) = IdempotencyRecord.objects.filter(key=key)
        assert record.state == "completed" and record.response_body == key.encode()
        assert record.created_at <= record.completed_at < record.expires_at
    assert isinstance(run_view("fresh", view_of("fresh")), Replay)
