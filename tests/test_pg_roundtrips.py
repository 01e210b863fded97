"""PostgreSQL with psycopg 3: the ``BEGIN`` that travels with the first statement of a
transaction, and the ``COMMIT`` that travels with the last (``django_idempotency.pg_roundtrips``).

The round trips are read off libpq's own trace of the messages the client sent (``pgconn.trace``,
one ``Query`` message per round trip), not from Django's query log, which logs a ``BEGIN`` and a
``COMMIT`` whether or not the driver sends them.
"""

from __future__ import annotations

import select
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

import pytest
from django.db import DataError, ProgrammingError, connection, transaction
from django.test.utils import CaptureQueriesContext

from django_idempotency import try_reserve
from django_idempotency.events.core import process_event
from django_idempotency.http.core import Captured, Command, Idempotency, Policy, Replay
from django_idempotency.http.fingerprint import fingerprint
from django_idempotency.models import EventDelivery, IdempotencyRecord, ProcessedEvent
from django_idempotency.pg_roundtrips import (
    _exchange,
    _merged,
    apart_may_travel,
    begin_statement,
    commit_travels,
    execute_apart_first,
    execute_first,
)
from testproject.shop.models import Effect

pytestmark = pytest.mark.postgres

CLAIM = "SELECT * FROM django_idempotency_claim_v2("
STORE = "SELECT django_idempotency_insert_completed_v1("
UPDATE = "SELECT django_idempotency_complete_v1("
RESERVE = "SELECT django_idempotency_reserve_v2("


@pytest.fixture(autouse=True)
def psycopg3() -> None:
    if connection.Database.__name__ != "psycopg":
        pytest.skip("the BEGIN and the COMMIT travel with psycopg 3 only")


@contextmanager
def sent() -> Iterator[list[str]]:
    """The queries the client sends meanwhile, one per round trip, as libpq traces them (a
    statement bound on the server shows as its Parse message)."""
    import psycopg

    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    queries: list[str] = []
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield queries
        finally:
            pgconn.untrace()
            trace.seek(0)
            for line in trace:
                direction, _, kind, *text = line.rstrip("\n").split("\t")
                if direction != "F":
                    continue
                if kind == "Query":  # the simple protocol: one round trip
                    queries.append(" ".join(text).strip().strip('"'))
                elif kind == "Parse":  # server-side binding: its statement, unnamed
                    queries.append(" ".join(text).strip().removeprefix('"" "').split('"')[0])


def command(key: str) -> Command:
    return Command("anonymous", key, "POST", "/trips", fingerprint("POST", "/trips", b""))


def run_view(key: str, view: Callable[[], str] | None = None) -> str | Replay:
    def insert() -> str:
        Effect.objects.create(name="trip")
        return "made"

    return Idempotency(Policy(using=connection.alias)).run(
        command(key), view or insert, lambda result: Captured(201, {}, result.encode())
    )


@pytest.mark.pooler
@pytest.mark.django_db(transaction=True)
def test_a_first_execution_is_three_round_trips_and_a_replay_two() -> None:
    with sent() as first:
        assert run_view("k") == "made"
    with sent() as replay:
        again = run_view("k")

    assert isinstance(again, Replay) and again.body == b"made"
    # The claim opens the transaction, the view's insert, the store closes it.
    assert len(first) == 3, first
    assert first[0].startswith(f"BEGIN; {CLAIM}"), first[0]
    assert first[1].startswith('INSERT INTO "shop_effect"'), first[1]
    assert first[2].startswith(STORE) and first[2].endswith("; COMMIT"), first[2]
    # A replay: the claim with its BEGIN, then the COMMIT of a transaction that wrote nothing.
    assert len(replay) == 2, replay
    assert replay[0].startswith(f"BEGIN; {CLAIM}")
    assert replay[1] == "COMMIT"
    assert Effect.objects.count() == 1


@pytest.mark.pooler
@pytest.mark.django_db(transaction=True)
def test_try_reserve_opens_the_transaction_it_runs_in() -> None:
    def consume(event_id: str) -> bool:
        with transaction.atomic():
            reserved = try_reserve(event_id, "trips")
            if reserved:
                Effect.objects.create(name=event_id)
        return reserved

    with sent() as first:
        assert consume("evt-1") is True
    with sent() as duplicate:
        assert consume("evt-1") is False

    assert len(first) == 3, first
    assert first[0].startswith(f"BEGIN; {RESERVE}")
    assert first[1].startswith('INSERT INTO "shop_effect"')
    assert first[2] == "COMMIT"
    assert len(duplicate) == 2 and duplicate[0].startswith(f"BEGIN; {RESERVE}"), duplicate
    assert ProcessedEvent.objects.count() == 1 and Effect.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_inside_an_open_transaction_the_claim_goes_alone() -> None:
    """In a block whose transaction is already open (a statement ran; ATOMIC_REQUESTS'
    savepoint is such a statement), psycopg has sent its BEGIN: none travels."""
    with sent() as queries, transaction.atomic():
        Effect.objects.create(name="before")
        assert begin_statement(connection) is None
        assert run_view("k") == "made"

    assert queries[0] == "BEGIN"
    claims = [query for query in queries if CLAIM in query]
    assert len(claims) == 1 and claims[0].startswith(CLAIM), queries
    assert IdempotencyRecord.objects.get().state == IdempotencyRecord.State.COMPLETED


@pytest.mark.django_db(transaction=True)
def test_the_isolation_level_of_options_travels_in_the_begin() -> None:
    import psycopg

    connection.ensure_connection()
    raw = connection.connection
    raw.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
    seen: list[str] = []

    def view() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('transaction_isolation')")
            seen.append(cursor.fetchone()[0])
        return "made"

    try:
        with sent() as queries:
            assert run_view("k", view) == "made"
    finally:
        raw.isolation_level = None
    assert queries[0].startswith(f"BEGIN ISOLATION LEVEL SERIALIZABLE; {CLAIM}"), queries
    assert seen == ["serializable"]
    # Above READ COMMITTED the claim writes the record at once (its snapshot could not see a
    # record committed while it waited for nothing), and the store updates it.
    assert queries[-1].startswith(UPDATE) and queries[-1].endswith("; COMMIT"), queries


@pytest.mark.django_db(transaction=True)
def test_a_read_only_connection_is_left_to_psycopg() -> None:
    connection.ensure_connection()
    raw = connection.connection
    raw.read_only = False
    try:
        with transaction.atomic():
            assert begin_statement(connection) is None
        with sent() as queries:
            assert run_view("k") == "made"
    finally:
        raw.read_only = None
    assert queries[0] == "BEGIN READ WRITE", queries
    assert queries[1].startswith(CLAIM)


@pytest.mark.pooler
@pytest.mark.django_db(transaction=True)
def test_an_error_is_raised_as_a_django_cursor_raises_it() -> None:
    import psycopg

    with pytest.raises(ProgrammingError) as missing, transaction.atomic():
        execute_first(connection, "SELECT * FROM django_idempotency_no_such_function(%s)", [1])
    assert isinstance(missing.value.__cause__, psycopg.errors.UndefinedFunction)
    assert missing.value.__cause__.sqlstate == "42883"
    assert "django_idempotency_no_such_function" in str(missing.value)
    assert "does not exist" in missing.value.__cause__.diag.message_primary

    with pytest.raises(DataError) as divided, transaction.atomic():
        execute_first(connection, "SELECT 1 / %s", [0])
    assert isinstance(divided.value.__cause__, psycopg.errors.DivisionByZero)

    # The atomic blocks rolled the failed transactions back: the connection goes on.
    assert connection.connection.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with transaction.atomic():
        assert execute_first(connection, "SELECT %s::int + 1", [41]) == [(42,)]


@pytest.mark.django_db(transaction=True)
def test_a_block_marked_for_rollback_refuses_the_statement_as_django_does() -> None:
    from django.db.transaction import TransactionManagementError

    with transaction.atomic():
        transaction.set_rollback(True)
        with pytest.raises(TransactionManagementError):
            execute_first(connection, "SELECT 1", [])


@pytest.mark.django_db(transaction=True)
def test_no_commit_travels_from_a_block_marked_for_rollback() -> None:
    """``commit_travels`` says no by itself once the block is marked for rollback: its callers
    must not have to check first, or a COMMIT would carry writes meant to be rolled back."""
    with transaction.atomic():
        execute_first(connection, "SELECT 1", [])  # the transaction is open on the server
        assert commit_travels(connection)
        transaction.set_rollback(True)
        assert not commit_travels(connection)
        transaction.set_rollback(False)
        assert commit_travels(connection)
        with transaction.atomic():
            transaction.set_rollback(True)  # a savepoint marked: the outer block would commit
            assert not commit_travels(connection)


@pytest.mark.django_db(transaction=True)
def test_execute_wrappers_see_and_may_change_the_statement() -> None:
    calls: list[tuple[str, Any, bool, set[str]]] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        calls.append((sql, params, many, set(context)))
        return execute(f"{sql} /* wrapped */", params, many, context)

    with connection.execute_wrapper(wrapper), sent() as queries:
        assert run_view("k") == "made"

    assert calls[0][0].startswith(CLAIM) and calls[0][1][1] == "k"
    assert calls[0][2] is False and calls[0][3] == {"connection", "cursor"}
    assert queries[0].startswith(f"BEGIN; {CLAIM}") and queries[0].endswith("/* wrapped */")


@pytest.mark.django_db(transaction=True)
def test_the_query_log_shows_the_statement_as_sent_without_its_begin() -> None:
    with CaptureQueriesContext(connection) as log:
        assert run_view("k") == "made"
    logged = [str(query["sql"]) for query in log.captured_queries]
    # Django logs the block's BEGIN itself; the claim is logged once, as a statement.
    assert logged[0] == "BEGIN"
    assert logged[1].startswith(CLAIM) and "'k'" in logged[1]


@pytest.mark.django_db(transaction=True)
def test_waiting_works_where_monkey_patching_took_poll_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gevent and eventlet remove ``select.poll`` so that libraries wait with their
    cooperative ``select``: the BEGIN still travels, and the answer is read."""
    monkeypatch.delattr(select, "poll")
    with sent() as queries:
        assert run_view(str(uuid.uuid4())) == "made"
    assert queries[0].startswith(f"BEGIN; {CLAIM}")


@pytest.mark.django_db(transaction=True)
def test_with_server_side_binding_begin_and_commit_go_apart() -> None:
    """Django's ``OPTIONS = {"server_side_binding": True}`` makes psycopg bind on the server
    (``cursor_factory`` is ``psycopg.Cursor``). The statements that travel are bound on the
    client, so such a connection keeps its BEGIN and COMMIT apart, as it asked."""
    import psycopg

    connection.ensure_connection()
    raw = connection.connection
    client_binding = raw.cursor_factory
    raw.cursor_factory = psycopg.Cursor  # what server_side_binding=True sets
    try:
        with sent() as queries:
            assert run_view("bound") == "made"
    finally:
        raw.cursor_factory = client_binding
    assert queries[0] == "BEGIN" and queries[1].startswith(CLAIM), queries
    assert queries[-2].startswith(STORE) and queries[-1] == "COMMIT", queries


@pytest.mark.django_db(transaction=True)
def test_a_connection_the_server_closed_fails_as_a_django_cursor_fails() -> None:
    """The server ends the session between two requests (a restart, an idle timeout): the claim
    that would carry the BEGIN raises Django's OperationalError, which the claim answers as 503
    (``DatabaseUnavailable``, issue 35 item 11); the connection is closed, and the next request
    runs on a new one."""
    from django.db import OperationalError, close_old_connections

    from django_idempotency.exceptions import DatabaseUnavailable

    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    other = connection.get_new_connection(connection.get_connection_params())
    try:
        other.autocommit = True
        # Waits (up to 5 s) until the session has ended, so the claim cannot outrun it.
        other.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])
    finally:
        other.close()

    with pytest.raises(DatabaseUnavailable) as raised:
        run_view("k")
    assert isinstance(raised.value.__cause__, OperationalError)
    close_old_connections()  # what Django runs when the request ends
    assert connection.connection is None
    assert run_view("k") == "made"
    assert connection.connection.info.backend_pid != pid


@pytest.mark.django_db(transaction=True)
def test_a_large_response_travels_whole_with_its_commit() -> None:
    """A body of a few megabytes (a query of twice that, in hex) is stored by the query that
    carries the COMMIT, and the replay returns it byte for byte."""
    body = bytes(range(256)) * (3 * 4096)  # 3 MiB, every byte value

    def view() -> str:
        return "big"

    policy = Policy(using=connection.alias)
    with sent() as queries:
        Idempotency(policy).run(command("big"), view, lambda _: Captured(201, {}, body))
    again = Idempotency(policy).run(command("big"), view, lambda _: Captured(201, {}, b""))

    assert queries[-1].startswith(STORE) and queries[-1].endswith("; COMMIT")
    assert isinstance(again, Replay) and again.body == body


# --- a statement committed apart, then the transaction's first --------------------------------

COUNT = "SELECT * FROM django_idempotency_count_v1("
INSERT_APART = "INSERT INTO shop_effect (name, payload, created_at) VALUES (%s, '', now())"


@pytest.mark.pooler
@pytest.mark.django_db(transaction=True)
def test_a_counted_delivery_is_three_round_trips_as_the_effect_alone_and_a_duplicate_two() -> None:
    def apply() -> None:
        Effect.objects.create(name="counted")

    with sent() as alone, transaction.atomic():
        apply()
    with sent() as first:
        assert process_event("ledger", "evt", apply).applied is True
    with sent() as duplicate:
        assert process_event("ledger", "evt", apply).applied is False

    assert alone == ["BEGIN", alone[1], "COMMIT"], alone
    # The count commits apart, then the reservation opens the business transaction: one round
    # trip where two were, so a counted delivery makes as many as the effect alone.
    assert len(first) == 3, first
    assert first[0].startswith(f"BEGIN; {COUNT}"), first[0]
    assert f"); COMMIT; BEGIN; {RESERVE}" in first[0], first[0]
    assert first[1].startswith('INSERT INTO "shop_effect"') and first[2] == "COMMIT", first
    # A duplicate learns it from that same round trip, then ends a transaction that wrote nothing.
    assert len(duplicate) == 2 and duplicate[0].startswith(f"BEGIN; {COUNT}"), duplicate
    assert duplicate[1] == "COMMIT"
    assert EventDelivery.objects.get().deliveries == 1
    assert ProcessedEvent.objects.count() == 1 and Effect.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_the_statement_apart_stays_committed_when_the_first_fails() -> None:
    calls: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        calls.append(sql)
        return execute(sql, params, many, context)

    with (
        connection.execute_wrapper(wrapper),
        pytest.raises(DataError),
        transaction.atomic(),
    ):
        execute_apart_first(connection, (INSERT_APART, ["apart"]), ("SELECT 1 / %s", [0]))

    assert list(Effect.objects.values_list("name", flat=True)) == ["apart"]
    # The wrappers see the query without its leading BEGIN, as for a statement that opens one.
    assert calls == [f"{INSERT_APART}; COMMIT; BEGIN; SELECT 1 / %s"]


@pytest.mark.django_db(transaction=True)
def test_a_failed_statement_apart_stops_the_query() -> None:
    import psycopg

    with pytest.raises(DataError), transaction.atomic():
        execute_apart_first(connection, ("SELECT 1 / %s", [0]), (INSERT_APART, ["first"]))

    assert not Effect.objects.exists()
    assert connection.connection.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE


@pytest.mark.django_db(transaction=True)
def test_the_statement_apart_runs_at_the_servers_isolation_level() -> None:
    """As it would in autocommit; the block's own level goes into the block's BEGIN."""
    import psycopg

    level = "SELECT current_setting('transaction_isolation')"
    connection.ensure_connection()
    raw = connection.connection
    raw.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
    try:
        with sent() as queries, transaction.atomic():
            rows = execute_apart_first(connection, (level, []), (level, []))
    finally:
        raw.isolation_level = None

    assert rows == ([("read committed",)], [("serializable",)])
    assert queries[0] == f"BEGIN; {level}; COMMIT; BEGIN ISOLATION LEVEL SERIALIZABLE; {level}"


@pytest.mark.django_db(transaction=True)
def test_nothing_travels_apart_once_a_block_is_open_or_a_statement_ran() -> None:
    apart, first = ("SELECT 1", []), ("SELECT 2", [])
    assert apart_may_travel(connection) is True
    with transaction.atomic():
        assert apart_may_travel(connection) is False  # a count here would join the block
        with transaction.atomic():
            assert execute_apart_first(connection, apart, first) is None
        Effect.objects.create(name="ran")
        assert execute_apart_first(connection, apart, first) is None
    with transaction.atomic():
        assert execute_apart_first(connection, apart, first) == ([(1,)], [(2,)])


# --- the parameters merged as psycopg merges them ---------------------------------------------

MERGED = [
    "",
    "plain",
    "it's",
    "''",
    "back\\slash",
    "\\x41",
    "ünïcödé ✓ 🎉",
    "%s %% %(name)s",
    "-- not a comment",
    "/* nor this */ a;b",
    "new\nline\ttab\r",
    0,
    1,
    -1,
    2**31,
    -(2**31) - 1,
    2**63 - 1,
    -(2**63),
    2**70,
    True,
    False,
    None,
    datetime(2026, 12, 1, 4, 5, 6, 789, tzinfo=UTC),
    datetime(1, 1, 1, tzinfo=UTC),
    datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    datetime(2026, 6, 1, 12, tzinfo=dt_timezone(timedelta(hours=5, minutes=30))),
    datetime(2026, 6, 1, 12, tzinfo=dt_timezone(-timedelta(hours=3, seconds=15))),
    uuid.UUID(int=0),
    uuid.UUID("0190f6e4-8c1d-7b3e-9a2f-5d4c3b2a1908"),
    b"",
    bytes(range(256)),
    b"'\\",
    timedelta(0),
    timedelta(days=1),
    timedelta(days=-1, seconds=5, microseconds=7),
    timedelta(seconds=86399, microseconds=999999),
    timedelta(days=3650),
    timedelta(microseconds=-1),
]


@pytest.mark.pooler
@pytest.mark.django_db
@pytest.mark.parametrize("value", MERGED, ids=repr)
def test_a_merged_parameter_is_what_psycopg_would_send(value: Any) -> None:
    """The server reads the literal that ``_merged`` writes as the one psycopg's ``mogrify``
    writes: the same type, and the same value."""
    import psycopg

    connection.ensure_connection()
    raw = connection.connection
    ours = _merged(raw, "%s", [value])
    assert ours is not None
    theirs = psycopg.ClientCursor(raw).mogrify("%s", [value])
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_typeof(a)::text, pg_typeof(b)::text, a IS NOT DISTINCT FROM b, a::text "
            f"FROM (SELECT {ours} AS a, {theirs} AS b) AS t"
        )
        ours_type, their_type, same, text = cursor.fetchone()
    assert ours_type == their_type and same, (ours, theirs)
    if isinstance(value, str):
        assert text == value


@pytest.mark.django_db(transaction=True)
def test_what_is_not_merged_is_left_to_psycopg() -> None:
    """A string with NUL (psycopg refuses it), a naive datetime, other types, and a statement
    with placeholders other than ``%s``."""
    connection.ensure_connection()
    raw = connection.connection
    for value in ("nul\x00", datetime(2026, 1, 1), 1.5, bytearray(b"x"), [1], {"a": 1}):
        assert _merged(raw, "SELECT %s", [value]) is None, value
    assert _merged(raw, "SELECT %s %% 2", [1]) is None
    assert _merged(raw, "SELECT %(a)s", [1]) is None
    assert _merged(raw, "SELECT %s, %s", [1]) is None
    assert _merged(raw, "SELECT %s", (1,)) is None
    assert _merged(raw, "SELECT %s, %s", ["a", 2]) == "SELECT 'a', 2"

    with pytest.raises(DataError, match="NUL"), transaction.atomic():
        execute_first(connection, "SELECT %s", ["nul\x00"])
    with transaction.atomic():
        assert execute_first(connection, "SELECT %s::text", [1.5]) == [("1.5",)]


@pytest.mark.django_db(transaction=True)
def test_the_count_that_travels_makes_the_server_warn_of_nothing() -> None:
    """A ``COMMIT`` that ends an implicit transaction block (no ``BEGIN`` before it) would make
    the server warn "there is no transaction in progress", to the client and in its log, on
    every delivery: the query opens the count's transaction explicitly."""
    import psycopg

    def apply() -> None:
        Effect.objects.create(name="counted")

    connection.ensure_connection()
    raw = connection.connection
    notices: list[str] = []

    def notice(diagnostic: psycopg.errors.Diagnostic) -> None:
        notices.append(f"{diagnostic.severity}: {diagnostic.message_primary}")

    raw.add_notice_handler(notice)
    try:
        # The handler hears what the server says to the queries that travel.
        _exchange(raw, b"SELECT 1; COMMIT")
        assert notices == ["WARNING: there is no transaction in progress"]
        notices.clear()
        with sent() as queries:
            assert process_event("ledger", "evt", apply).applied is True
            assert process_event("ledger", "evt", apply).applied is False
    finally:
        raw.remove_notice_handler(notice)

    assert notices == []
    assert queries[0].startswith(f"BEGIN; {COUNT}"), queries
