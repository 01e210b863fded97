"""Review of the lost-database fixes (the batch commands' ``resumable_on_loss``, the idle
timeouts in ``outages.connection_lost``, the completer's ``_drop_if_lost``, SQLite's ``database
is locked`` as a conflict), against the real servers.

Defects found:

* ``resumable_on_loss`` judged the error against every alias it was given. An alias not
  connected yet reads as "could not connect" to ``connection_lost``, so ``idempotency_purge
  --database default --database other`` whose first database failed a statement on a live
  connection (a lock wait that ran out) ended with "The connection to the database 'other' was
  lost ... Nothing is lost", hiding the real error behind a database it had not touched.
* The completer reopened only its own alias between runs: a view whose data lives on another
  alias, whose connection died during the pass, failed every later run of the pass on the dead
  connection (each ``raised``, an attempt counted), where the next request would have
  reconnected (Django closes a connection that had errors and is unusable at each request's
  end).

Probes that found nothing wrong, kept at the end: PostgreSQL's ``25P02`` (an ``InternalError``
on a live connection) is no loss; SQLite's atomic claim that meets the write lock is still
``409``; a SQLite rotation that meets it never says ``Done``.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import OperationalError, connection, connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory, override_settings

from django_idempotency import idempotent
from django_idempotency.flows.completer import complete_abandoned
from django_idempotency.flows.phases import Flow
from django_idempotency.models import IdempotencyRecord
from testproject.shop.models import Effect
from testproject.shop.probe_flows import ProbeError
from tests.test_purge import make_record

RECORDS = IdempotencyRecord._meta.db_table


@contextmanager
def records_locked_by_another_connection() -> Iterator[None]:
    """Another connection holds the records table (SQLite: the whole database) for the block,
    and this thread's ``default`` connection gives up waiting for it after a fraction of a
    second: its next statement there fails with a lock wait that ran out (PostgreSQL ``55P03``,
    MariaDB 1205, SQLite ``database is locked``), an error on a live connection."""
    settings = connection.settings_dict
    vendor = connection.vendor
    with connection.cursor() as cursor:
        cursor.execute(
            {
                "postgresql": "SET lock_timeout = '300ms'",
                "mysql": "SET SESSION lock_wait_timeout = 1",
                "sqlite": "PRAGMA busy_timeout = 300",
            }[vendor]
        )
    holder: Any
    if vendor == "postgresql":
        import psycopg

        holder = psycopg.connect(
            host=settings["HOST"] or None,
            port=settings["PORT"] or None,
            user=settings["USER"],
            password=settings["PASSWORD"] or None,
            dbname=settings["NAME"],
        )
        holder.execute(f"LOCK TABLE {RECORDS} IN ACCESS EXCLUSIVE MODE")
    elif vendor == "mysql":
        import MySQLdb  # type: ignore[import-untyped]

        holder = MySQLdb.connect(
            host=settings["HOST"],
            port=int(settings["PORT"] or 3306),
            user=settings["USER"],
            password=settings["PASSWORD"],
            database=settings["NAME"],
        )
        holder.cursor().execute(f"LOCK TABLES {RECORDS} WRITE")
    else:
        holder = sqlite3.connect(settings["NAME"], isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        if vendor == "mysql":
            holder.cursor().execute("UNLOCK TABLES")
        else:
            holder.rollback() if vendor == "postgresql" else holder.execute("ROLLBACK")
        holder.close()
        connection.close()  # its session's lock timeout goes with it


@pytest.mark.postgres
@pytest.mark.mysql
@pytest.mark.sqlite
@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_a_purge_whose_first_database_fails_a_statement_is_not_the_second_one_lost() -> None:
    """``--database default --database other``: ``default`` meets a lock wait that ran out,
    ``other`` is not connected yet. The purge ended with "The connection to the database
    'other' was lost (...). Nothing is lost", about a database it had not reached, and the lock
    error of ``default`` was hidden. It is the driver's error, as for one database."""
    make_record(f"rf-{uuid.uuid4()}", timedelta(days=-1))
    connections["other"].close()  # as in a fresh purge process: not reached before default
    with records_locked_by_another_connection(), pytest.raises(OperationalError) as raised:
        try:
            call_command("idempotency_purge", database=["default", "other"], verbosity=0)
        except CommandError as error:
            pytest.fail(f"a lock wait on 'default' reported as a loss: {error}")
    text = str(raised.value).lower()
    assert "lock" in text, raised.value  # PostgreSQL, MariaDB: lock ...; SQLite: locked


@pytest.mark.postgres
@pytest.mark.mysql
@pytest.mark.sqlite
@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_the_purge_that_cannot_reach_its_second_database_still_says_so() -> None:
    """The other side of the fix above: a loss of the database that raised (the second one,
    which cannot be connected to) is still the CommandError naming it."""
    other = connections["other"]
    other.close()
    saved = dict(other.settings_dict)
    other.settings_dict.update(_unreachable(saved))
    try:
        with pytest.raises(CommandError) as raised:
            call_command("idempotency_purge", database=["default", "other"], verbosity=0)
    finally:
        other.close()
        other.settings_dict.clear()
        other.settings_dict.update(saved)
    assert "connection to the database 'other' was lost" in str(raised.value), raised.value


def _unreachable(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` pointed at a port where nothing listens (SQLite: a file in a directory
    that does not exist, which cannot be opened)."""
    if settings["ENGINE"].endswith("sqlite3"):
        return {"NAME": "/nonexistent-review-faults/db.sqlite3"}
    return {"HOST": "127.0.0.1", "PORT": "9"}


# -- the completer, with the view's data on another alias --------------------------------------

CRASH: set[str] = set()
KILL: list[bool] = []
"""One element while the next run to finish should end its own ``default`` session (a server
restart of the view's database between two of the completer's runs)."""


@idempotent(phases=True, lease=timedelta(seconds=60), name="review_faults_other_alias")
def other_alias_view(request: HttpRequest, flow: Flow) -> HttpResponse:
    key = request.headers["Idempotency-Key"]

    def step(name: str) -> int:
        return int(Effect.objects.using("default").create(name=f"rf-{name}", payload=key).pk)

    one = flow.phase("one", lambda: step("one"))
    if key in CRASH:
        CRASH.discard(key)
        raise ProbeError("the worker died after phase one")
    two = flow.phase("two", lambda: step("two"))
    if KILL:
        KILL.clear()
        _terminate(connections["default"])
    return JsonResponse({"one": one, "two": two}, status=201)


def _terminate(wrapper: Any) -> None:
    """End ``wrapper``'s session from another connection, and wait until it has ended."""
    import psycopg

    pid = wrapper.connection.info.backend_pid
    settings = wrapper.settings_dict
    with psycopg.connect(
        host=settings["HOST"] or None,
        port=settings["PORT"] or None,
        user=settings["USER"],
        password=settings["PASSWORD"] or None,
        dbname="postgres",
        autocommit=True,
    ) as killer:
        killer.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_the_completer_reconnects_the_views_own_database_too() -> None:
    """``IDEMPOTENCY["DATABASE"]`` is ``other``; the view writes to ``default``. The first
    run of the pass finishes, then ``default``'s session ends (a restart). The second run
    meets the dead connection (``raised``, as the next request would once); every run after it
    met it too, each ``raised`` with an attempt counted, because only ``other`` was opened
    again between runs. Django closes such a connection at a request's end: so does the
    completer, between runs, on every alias."""
    if connection.vendor != "postgresql":
        pytest.skip("pg_terminate_backend")
    with override_settings(IDEMPOTENCY={"DATABASE": "other"}):
        keys = [f"rf-{uuid.uuid4()}" for _ in range(3)]
        for key in keys:
            CRASH.add(key)
            request = RequestFactory().post(
                "/rf/", b"{}", content_type="application/json", headers={"Idempotency-Key": key}
            )
            with pytest.raises(ProbeError):
                other_alias_view(request)  # type: ignore[call-arg]
            time.sleep(0.01)  # the runs' order (updated_at) is the keys' order
        KILL.append(True)

        def pass_() -> Any:
            try:
                return complete_abandoned(using="other")
            finally:
                connections.close_all()

        done = ThreadPoolExecutor(1).submit(pass_).result(60)
    KILL.clear()
    outcomes = {d.key: d.outcome for d in done}
    assert [outcomes[key] for key in keys] == ["completed", "raised", "completed"], done
    assert Effect.objects.filter(name="rf-two", payload=keys[2]).count() == 1


# -- probes that found nothing wrong (kept: each could fail) -----------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_an_aborted_transactions_internal_error_is_not_a_lost_database() -> None:
    """``25P03`` made ``connection_lost`` read some ``InternalError``s (class 25) as a loss:
    not the commonest one, ``25P02`` (a statement after a failed one in the same
    transaction), on a live connection."""
    from django.db import DataError, InternalError, transaction

    from django_idempotency.outages import connection_lost

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's SQLSTATEs")
    judged: list[bool] = []
    with pytest.raises(InternalError), transaction.atomic(), connection.cursor() as cursor:
        with pytest.raises(DataError):
            cursor.execute("SELECT 1 / 0")
        try:
            cursor.execute("SELECT 1")
        except InternalError as exc:
            assert getattr(exc.__cause__, "sqlstate", None) == "25P02", exc.__cause__
            judged.append(connection_lost(connection, exc))
            raise
    assert judged == [False]
    assert connection.is_usable()


SQLITE_CALLS: list[str] = []


@idempotent
def atomic_view(request: HttpRequest) -> HttpResponse:
    SQLITE_CALLS.append(request.headers["Idempotency-Key"])
    return JsonResponse({"ok": True}, status=201)


@pytest.mark.sqlite
@pytest.mark.django_db(transaction=True)
def test_sqlite_an_atomic_claim_that_meets_the_write_lock_is_still_409() -> None:
    """``database is locked`` is a conflict (``503``) now when a response is stored; the claim
    catches it itself and answers ``409`` in progress, as docs/http.md says, never ``503``."""
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's write lock")
    SQLITE_CALLS.clear()
    key = f"rf-{uuid.uuid4()}"
    with records_locked_by_another_connection():
        request = RequestFactory().post(
            "/rf/", b"{}", content_type="application/json", headers={"Idempotency-Key": key}
        )
        response = atomic_view(request)
    assert response.status_code == 409, response.content
    assert json.loads(response.content)["type"].endswith("#in-progress"), response.content
    assert SQLITE_CALLS == []


@pytest.mark.sqlite
@pytest.mark.django_db(transaction=True)
def test_sqlite_a_rotation_that_meets_the_write_lock_never_says_done() -> None:
    """``database is locked`` is a conflict for the rotation's batches now (they were the
    driver's error): a batch that meets another connection's write lock writes nothing, is read
    again twice, then is left and counted as changed meanwhile. The rotation must then not say
    ``Done`` (the operator would remove the old key), and every row keeps the key it had."""
    from io import StringIO

    from django_idempotency.protection import core
    from django_idempotency.protection.keys import Keyring, key_id
    from tests.protection_helpers import keys, new_key
    from tests.test_protection_rotation import seed
    from tests.test_review_decrypt_only import K1, RAW1

    if connection.vendor != "sqlite":
        pytest.skip("SQLite's write lock")
    seed(Keyring((RAW1,)), 4)
    newer = new_key()
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA busy_timeout = 200")
    holder = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # readers go on, writers wait
    out = StringIO()
    try:
        with keys(newer, K1):
            call_command("idempotency_rotate_keys", stdout=out, stderr=StringIO(), batch_size=2)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        connection.close()
    printed = out.getvalue()
    assert "Done" not in printed, printed
    assert "changed meanwhile" in printed, printed
    headers = IdempotencyRecord.objects.values_list("response_headers", flat=True)
    assert {core.stored_key_id(h) for h in headers} == {key_id(RAW1)}
