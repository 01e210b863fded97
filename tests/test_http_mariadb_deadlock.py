"""MariaDB: a deadlock (1213) at the claim of a fresh key is a retryable ``503`` whose one
``WARNING`` line names the deadlock (issue 35, item 3, review).

InnoDB breaks a deadlock by rolling a whole transaction back; it picks the one that wrote least,
which is the claim's. The claim's first insert never waits (a lock in its way fails it with
1205 at once, and InnoDB looks for deadlocks only before a wait); its second insert, after a
1205 with no record, waits briefly, and its own locking read holds a gap lock by then. Built
deterministically at ``REPEATABLE READ`` (gap locks do not conflict with each other, but each
blocks the other transaction's insert into its gap), an unrelated transaction that inserts into
that gap closes the cycle. It was answered 503, but the log line said "its lock stayed held by
another transaction": an operator looked for a long transaction, not a deadlock.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connections, transaction
from django.test import RequestFactory, override_settings

from django_idempotency.models import IdempotencyRecord
from testproject.shop import probe_views
from tests.lock_waits import session_of, wait_until_blocked
from tests.probes import effects
from tests.test_http_mariadb_gaps import claim_in_thread, ended

pytestmark = [
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, databases=["default", "repeatable_read"]),
]

ALIAS = "repeatable_read"
TABLE = IdempotencyRecord._meta.db_table
INSERT = (
    f"INSERT INTO {TABLE} (owner, `key`, fingerprint, method, path, state, token, "
    "response_headers, created_at, expires_at) VALUES (%s, %s, 'f', 'POST', '/', 'completed', "
    "%s, '{}', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 DAY)"
)


@contextmanager
def heavy_neighbour(prefix: str) -> Iterator[Any]:
    """An unrelated transaction at REPEATABLE READ on its own connection: it writes rows of
    another owner first (so InnoDB rolls back the claim, not it, when they deadlock), then
    holds a gap lock over ``<prefix>-a``..``<prefix>-z`` of anonymous' keys. Yields its cursor."""
    with transaction.atomic(using=ALIAS), connections[ALIAS].cursor() as cursor:
        for n in range(30):
            key = f"{prefix}-{uuid.uuid4()}-{n}"
            cursor.execute(INSERT, ["user:heavy", key, uuid.uuid4().hex])
        cursor.execute(
            f"SELECT id FROM {TABLE} WHERE owner = 'anonymous' AND `key` BETWEEN %s AND %s "
            "FOR UPDATE",
            [f"{prefix}-a", f"{prefix}-z"],
        )
        cursor.fetchall()
        yield cursor
        transaction.set_rollback(True, using=ALIAS)


def assert_deadlock_answered(status: int, headers: Any, body: bytes, warnings: list[str]) -> None:
    assert status == 503, body
    assert headers["Retry-After"] == "1"
    assert json.loads(body)["type"].endswith("#database-unavailable")
    [line] = [w for w in warnings if "idempotency unavailable" in w]
    assert "deadlock" in line and "1213" in line, line


def test_a_deadlock_of_the_waiting_insert_is_503_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = f"dl-m-{uuid.uuid4()}"
    with (
        override_settings(IDEMPOTENCY={"DATABASE": ALIAS}),
        caplog.at_level(logging.INFO, logger="django_idempotency"),
        heavy_neighbour("dl") as cursor,
    ):
        future, session = claim_in_thread(key, ALIAS)
        wait_until_blocked(session, "the claim's second insert", lambda: ended(future))
        # Into the gap the claim's locking read holds: a cycle, and the claim is the victim.
        cursor.execute(INSERT, ["anonymous", "dl-n", uuid.uuid4().hex])
        reply = future.result(30)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert_deadlock_answered(reply.status, reply.headers, reply.body, warnings)
    assert effects(key=key) == 0
    assert not IdempotencyRecord.objects.using(ALIAS).filter(key=key).exists()


def test_a_deadlock_inside_a_callers_transaction_is_503_and_ends_that_transaction(
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = f"dl2-m-{uuid.uuid4()}"
    locked = threading.Event()
    go = threading.Event()
    sessions: list[int] = []
    doomed: list[bool] = []

    def request() -> Any:
        """A decorated view called inside the caller's transaction, which first took a gap
        lock over the key's place (a locking read of a key that has no record)."""
        try:
            sessions.append(session_of(ALIAS))
            with transaction.atomic(using=ALIAS), connections[ALIAS].cursor() as cursor:
                cursor.execute(
                    f"SELECT id FROM {TABLE} WHERE owner = 'anonymous' AND `key` = %s "
                    "LOCK IN SHARE MODE",
                    ["dl2-x"],
                )
                cursor.fetchall()
                locked.set()
                assert go.wait(30)
                http = RequestFactory().post(
                    "/probe/effect/", b"{}", content_type="application/json",
                    headers={"Idempotency-Key": key},
                )  # fmt: skip
                response = probe_views.effect(http)
                # InnoDB rolled the caller's transaction back too: it must not go on as if not.
                doomed.append(connections[ALIAS].needs_rollback)
                return response
        finally:
            locked.set()
            connections.close_all()

    with (
        override_settings(IDEMPOTENCY={"DATABASE": ALIAS}),
        caplog.at_level(logging.INFO, logger="django_idempotency"),
        heavy_neighbour("dl2"),
    ):
        future = ThreadPoolExecutor(1).submit(request)
        assert locked.wait(30) and sessions, future.exception(1)
        with ThreadPoolExecutor(1) as pool:
            raw = connections[ALIAS].connection  # the neighbour's, used by one thread at a time
            neighbour_session = session_of(ALIAS)

            def neighbour_insert() -> None:
                with raw.cursor() as raw_cursor:
                    raw_cursor.execute(INSERT, ["anonymous", "dl2-n", uuid.uuid4().hex])

            # The neighbour's insert waits on the caller's gap lock...
            neighbour = pool.submit(neighbour_insert)
            wait_until_blocked(neighbour_session, "the neighbour's insert")
            go.set()  # ...and the claim's insert on the neighbour's: a cycle
            response = future.result(30)
            neighbour.result(30)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert_deadlock_answered(response.status_code, response, response.content, warnings)
    assert doomed == [True]
    assert effects(key=key) == 0
