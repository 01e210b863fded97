"""PostgreSQL, the deferred claim (``django_idempotency_claim_v2``, migration 0008): after it
takes the key's advisory lock, the claim reads the record again, and replays a record that was
committed between its first look and the lock.

tests/test_http_deferred_claim.py hunts that microsecond window with many threads; here it is
held open deterministically. The duplicate's session resolves ``pg_try_advisory_xact_lock``
through a schema placed before ``pg_catalog`` in its ``search_path``, whose function of that name
first waits on an advisory lock the test holds (the gate), then calls the real one. So the
duplicate stops right after its first look found nothing. Meanwhile the original runs and
commits; then the test opens the gate. A claim that skipped the second read would run the view
again and fail to store it; this one replays.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
from django.db import connection, connections
from django.http import HttpResponse

from tests.lock_waits import session_of, wait_until_blocked
from tests.probes import counted_view, effects

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, databases=["default", "repeatable_read"]),
]

HOOK = "idempotency_test_gate"
GATE = 35_020_020
send, RAN = counted_view("reread")


@pytest.fixture
def gated_lock() -> Iterator[None]:
    """``HOOK.pg_try_advisory_xact_lock``: waits for the gate to open, then takes the lock."""
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE SCHEMA IF NOT EXISTS {HOOK}")
        cursor.execute(
            f"CREATE OR REPLACE FUNCTION {HOOK}.pg_try_advisory_xact_lock(p_id bigint) "
            "RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$ BEGIN "
            f"PERFORM pg_catalog.pg_advisory_lock_shared({GATE}); "
            f"PERFORM pg_catalog.pg_advisory_unlock_shared({GATE}); "
            "RETURN pg_catalog.pg_try_advisory_xact_lock(p_id); END $$"
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP SCHEMA {HOOK} CASCADE")


@pytest.mark.usefixtures("gated_lock")
def test_a_record_committed_between_the_first_look_and_the_lock_is_replayed() -> None:
    key = str(uuid.uuid4())
    RAN.clear()
    gate = connections["repeatable_read"]  # another session, in autocommit
    with gate.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s)", [GATE])
    answers: list[HttpResponse] = []
    errors: list[BaseException] = []
    sessions: list[int] = []
    ready = threading.Event()

    def duplicate() -> None:
        try:
            with connection.cursor() as cursor:  # this thread's own connection
                cursor.execute(f'SET search_path TO {HOOK}, "$user", public, pg_catalog')
            sessions.append(session_of())
            ready.set()
            answers.append(send(key))
        except BaseException as error:  # noqa: BLE001 - reported by the test thread
            errors.append(error)
        finally:
            ready.set()
            connections.close_all()

    thread = threading.Thread(target=duplicate)
    thread.start()
    try:
        assert ready.wait(30) and sessions, errors
        # The duplicate looked, found no record, and now waits at the gate before the lock.
        wait_until_blocked(sessions[0], "the duplicate's claim", lambda: (errors or [None])[0])
        original = send(key)  # runs the view and commits its record
        assert original.status_code == 201 and "Idempotent-Replayed" not in original
        assert RAN[key] == 1
    finally:
        with gate.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [GATE])
        thread.join(30)
    assert not errors, errors
    [replay] = answers
    # Without the second read the duplicate found "no record", ran the view again (RAN == 2),
    # could not store it (the record is there) and answered 409.
    assert RAN[key] == 1, f"the view ran {RAN[key]} times"
    assert replay.status_code == 201, replay.content
    assert replay["Idempotent-Replayed"] == "true"
    assert replay.content == original.content
    assert effects("reread", key) == 1
