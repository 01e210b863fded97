"""The view ran, and storing its response lost a deadlock: a retryable ``503``, never a ``500``.

A CI run of issue 35's fresh-key load on MariaDB raised the driver's 1213 out of the library
(a ``500``) when two requests stored their responses at once: the UPDATE had read the records'
``state`` index instead of the primary key, and each locked the other's in-progress entry. The
statements now name the primary key (``FORCE INDEX``), and a conflict that still rolls the
request back while its response is stored or committed (a deadlock's victim, a serialization
failure, a lock wait that ran out) is answered ``503`` with ``Retry-After``: nothing of the
request took effect, and a retry with the same key runs it once. In lease mode the claim,
committed on its own, is released, so that retry runs at once.

Each deadlock is built deterministically, with a neighbour transaction on its own connection:

* MariaDB: the neighbour holds a locking range read over the ``state`` index's completed
  entries at ``REPEATABLE READ`` (the gap where the stored record's entry goes), then waits on
  the view's anchor row; storing the response needs that gap. The neighbour wrote more rows
  first, so InnoDB rolls the request back, not it.
* PostgreSQL, lease mode: the neighbour locks the committed claim's row (an admin action, a
  report), then waits on a row the view updated; storing the response needs the record's row.
  Its ``deadlock_timeout`` is 30 s, so the request's check (1 s) finds the cycle and loses.
* PostgreSQL, atomic mode: the record is written only when the response is stored, so the
  neighbour writes an uncommitted row of the same key; the request's insert waits on it.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory

from django_idempotency.http.decorators import idempotent
from django_idempotency.models import IdempotencyRecord
from testproject.shop.models import Effect
from tests.lock_waits import session_of, wait_until_blocked
from tests.probes import effects

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "repeatable_read"])

NEIGHBOUR = "repeatable_read"
TABLE = IdempotencyRecord._meta.db_table
EFFECTS = Effect._meta.db_table
MODES = pytest.mark.parametrize("lease", [False, True], ids=["atomic", "lease"])


class PausedView:
    """A decorated view that writes its effect row and touches a committed row (the anchor,
    which the neighbour then waits on: PostgreSQL never waits on a row that is not committed
    yet, it does not see it), says so, and waits for :meth:`go` before it answers."""

    def __init__(self, lease: bool) -> None:
        self.inside = threading.Event()
        self.released = threading.Event()
        self.effect_ids: list[int] = []
        self.anchor = Effect.objects.create(name="anchor").pk
        options: dict[str, Any] = {"atomic": False, "lease": 60} if lease else {}

        @idempotent(**options)
        def view(request: HttpRequest) -> HttpResponse:
            key = request.headers["Idempotency-Key"]
            effect = Effect.objects.create(name="paused", payload=key)
            Effect.objects.filter(pk=self.anchor).update(name="anchor, touched")
            self.effect_ids.append(effect.pk)
            self.inside.set()
            assert self.released.wait(60), "the test never let the view answer"
            return JsonResponse({"effect": effect.pk}, status=201)

        self.view = view

    def send(self, key: str) -> Future[HttpResponse]:
        def run() -> HttpResponse:
            try:
                request = RequestFactory().post(
                    "/paused/", b"{}", content_type="application/json",
                    headers={"Idempotency-Key": key},
                )  # fmt: skip
                return self.view(request)
            finally:
                self.inside.set()
                connections.close_all()

        future = ThreadPoolExecutor(1).submit(run)
        assert self.inside.wait(60), future.exception(1)
        assert self.effect_ids, future.exception(1)
        return future

    def go(self) -> None:
        self.released.set()


def deadlock_at_store(lease: bool, key: str, hold: Callable[[Any, int | None], None]) -> Any:
    """Run ``key`` through a :class:`PausedView`; while it waits, the neighbour (``hold``, on
    its own connection, in a transaction) takes its locks, then waits on the view's anchor row;
    then the view answers and stores its response. Returns the view's response, after the
    neighbour's transaction rolled back."""
    paused = PausedView(lease)
    future = paused.send(key)
    record = IdempotencyRecord.objects.filter(key=key).values_list("id", flat=True).first()
    with (
        ThreadPoolExecutor(1) as pool,
        transaction.atomic(using=NEIGHBOUR),
        connections[NEIGHBOUR].cursor() as cursor,
    ):
        hold(cursor, record)
        raw = connections[NEIGHBOUR].connection  # used by one thread at a time
        session = session_of(NEIGHBOUR)

        def wait_on_the_anchor() -> None:
            with raw.cursor() as raw_cursor:
                raw_cursor.execute(
                    f"SELECT id FROM {EFFECTS} WHERE id = %s FOR UPDATE", [paused.anchor]
                )
                raw_cursor.fetchall()

        waiting = pool.submit(wait_on_the_anchor)
        wait_until_blocked(session, "the neighbour's read of the anchor row")
        paused.go()  # storing the response closes the cycle; the request is the victim
        waiting.result(60)  # granted once the request's transaction rolled back
        transaction.set_rollback(True, using=NEIGHBOUR)
    return future.result(60)


def heavy(cursor: Any) -> None:
    """MariaDB: make the neighbour's transaction the heavier one (30 rows of another owner), so
    that InnoDB rolls the request back, not it, when they deadlock."""
    for n in range(30):
        cursor.execute(
            f"INSERT INTO {TABLE} (owner, `key`, fingerprint, method, path, state, token, "
            "response_headers, created_at, expires_at) VALUES ('user:heavy', %s, 'f', "
            "'POST', '/', 'completed', %s, '{}', UTC_TIMESTAMP(6), "
            "UTC_TIMESTAMP(6) + INTERVAL 1 DAY)",
            [f"heavy-{uuid.uuid4()}-{n}", uuid.uuid4().hex],
        )


@contextmanager
def holding_row(table: str, pk: int, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The neighbour's row lock on row ``pk`` of ``table`` until the block ends (then its
    transaction rolls back), the library's log captured meanwhile."""
    with (
        caplog.at_level(logging.INFO, logger="django_idempotency"),
        transaction.atomic(using=NEIGHBOUR),
        connections[NEIGHBOUR].cursor() as cursor,
    ):
        cursor.execute(f"SELECT id FROM {table} WHERE id = %s FOR UPDATE", [pk])
        cursor.fetchall()
        yield
        transaction.set_rollback(True, using=NEIGHBOUR)


def write_skew(read: str, params: list[Any], anchor: int, name: str) -> None:
    """PostgreSQL: a neighbour at SERIALIZABLE that reads what the request writes (``read``)
    and writes the anchor row that the request read (renamed ``name``), and commits first: the
    request's transaction, SERIALIZABLE too, then fails for read/write dependencies."""
    with transaction.atomic(using=NEIGHBOUR), connections[NEIGHBOUR].cursor() as cursor:
        cursor.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        cursor.execute(read, params)
        cursor.fetchall()
        cursor.execute(f"UPDATE {EFFECTS} SET name = %s WHERE id = %s", [name, anchor])


def assert_503(response: Any) -> None:
    """``response`` is the retryable ``503`` of a request the database rolled back."""
    assert isinstance(response, HttpResponse), f"a 500: {response!r}"
    assert response.status_code == 503, response.content
    assert response["Content-Type"] == "application/problem+json"
    assert response["Retry-After"] == "1"
    problem = json.loads(response.content)
    assert problem["type"].endswith("#database-unavailable")
    assert "rolled this request back" in problem["detail"]


def assert_retryable(response: HttpResponse, key: str, warnings: list[str], code: str) -> None:
    assert_503(response)
    [line] = [w for w in warnings if "idempotency unavailable" in w]
    assert code in line and key in line, line
    assert effects(key=key) == 0, "the view's effect committed although the request got 503"
    assert not IdempotencyRecord.objects.filter(key=key).exists(), "the claim was left behind"


def retry_runs_once(lease: bool, key: str) -> None:
    paused = PausedView(lease)
    paused.released.set()
    response = paused.send(key).result(60)
    assert response.status_code == 201, response.content
    assert effects(key=key) == 1
    assert IdempotencyRecord.objects.get(key=key).state == "completed"


def answered_503_then_once(
    lease: bool,
    key: str,
    hold: Callable[[Any, int | None], None],
    code: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A deadlock at store (:func:`deadlock_at_store`) answers the retryable ``503`` whose
    WARNING line names ``code``, and a retry then runs the request once."""
    with caplog.at_level(logging.INFO, logger="django_idempotency"):
        response = deadlock_at_store(lease, key, hold)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert_retryable(response, key, warnings, code)
    retry_runs_once(lease, key)


@pytest.mark.mysql
@MODES
def test_mariadb_a_deadlock_while_the_response_is_stored_is_503_and_a_retry_runs_once(
    lease: bool, caplog: pytest.LogCaptureFixture
) -> None:
    key = f"store-dl-{uuid.uuid4()}"

    def hold(cursor: Any, record: int | None) -> None:
        heavy(cursor)  # InnoDB rolls back the transaction that wrote least
        cursor.execute(
            f"SELECT id FROM {TABLE} FORCE INDEX (idem_record_state_idx) "
            "WHERE state = 'completed' FOR UPDATE"
        )
        cursor.fetchall()

    answered_503_then_once(lease, key, hold, "1213", caplog)


@pytest.mark.postgres
@MODES
def test_postgresql_a_deadlock_while_the_response_is_stored_is_503_and_a_retry_runs_once(
    lease: bool, caplog: pytest.LogCaptureFixture
) -> None:
    key = f"store-dl-{uuid.uuid4()}"

    def hold(cursor: Any, record: int | None) -> None:
        cursor.execute("SET LOCAL deadlock_timeout = '30s'")  # the request's check comes first
        if lease:
            assert record is not None
            cursor.execute(f"SELECT id FROM {TABLE} WHERE id = %s FOR UPDATE", [record])
            cursor.fetchall()
        else:
            assert record is None  # atomic mode writes the record with the response
            cursor.execute(
                f"INSERT INTO {TABLE} (owner, key, fingerprint, method, path, state, token, "
                "response_headers, created_at, expires_at) VALUES ('anonymous', %s, 'f', "
                "'POST', '/', 'completed', %s, '{}', NOW(), NOW() + INTERVAL '1 day')",
                [key, uuid.uuid4()],
            )

    answered_503_then_once(lease, key, hold, "deadlock", caplog)


@pytest.mark.mysql
def test_mariadb_storing_and_releasing_read_the_record_by_its_primary_key() -> None:
    """The plan, not only the answer: ``EXPLAIN`` of the statements that store a response and
    release a claim names the primary key, whatever the statistics say."""
    from django_idempotency.http.store import _statements

    statements = _statements(connection)
    token = uuid.uuid4().hex
    with connection.cursor() as cursor:
        calls: list[tuple[str, list[Any]]] = [
            (statements.complete, [201, "{}", b"{}", 1, token]),
            (statements.release, [1, token]),
        ]
        for sql, params in calls:
            cursor.execute("EXPLAIN " + sql, params)
            columns = [c[0] for c in cursor.description]
            plans = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
            assert plans and all(plan["key"] in ("PRIMARY", None) for plan in plans), plans
            assert all(plan["possible_keys"] in ("PRIMARY", None) for plan in plans), plans
