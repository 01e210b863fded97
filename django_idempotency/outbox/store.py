"""The outbox's rows: what the relay's claim, its outcomes and its wake-ups read and write.

:mod:`django_idempotency.outbox.relay` decides (which claimed rows may go now without overtaking
their key, how long a failed message waits, when it is parked); this module is how each of
those reaches the database, per backend, as :mod:`django_idempotency.http.store` is for the HTTP
core. It reads no setting and makes no decision: the relay passes in what it resolved (the
time, the lease, the backoff), and gets back what the database found.

* The claim: :func:`claim_transaction` (``BEGIN IMMEDIATE`` on SQLite, READ COMMITTED elsewhere),
  :func:`candidates` (pending, due rows that no earlier message of their key holds back, locked
  with ``SKIP LOCKED`` where the database has it), :func:`unsent_of_keys` (what the ordering
  rule compares against) and :func:`lease` (the claim's write).
* The outcomes: :func:`mark_sent`, :func:`release`, :func:`park`, :func:`retry_later`, each
  guarded by the claim's lease where a takeover must win.
* The wake-ups: :class:`Listener`, a connection of its own that ``LISTEN``\\s on
  :data:`NOTIFY_CHANNEL` (PostgreSQL).
"""

from __future__ import annotations

import json
import logging
import select
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Exists, F, OuterRef, Q

from django_idempotency.exceptions import log_text
from django_idempotency.models import OUTBOX_TOUCHED, OutboxEntry

#: The relay's logger: what goes wrong here is reported where the relay reports.
logger = logging.getLogger("django_idempotency.outbox.relay")

NOTIFY_CHANNEL = "django_idempotency_outbox"
"""The PostgreSQL ``LISTEN``/``NOTIFY`` channel that wakes relays."""

PENDING, SENT, PARKED = (
    OutboxEntry.State.PENDING,
    OutboxEntry.State.SENT,
    OutboxEntry.State.PARKED,
)
UNSENT = (PENDING, PARKED)


# --- The claim -----------------------------------------------------------------------------------


#: The planner methods the claim turns off on PostgreSQL, for its own transaction only.
PLANNER_SWITCHES = (
    "enable_seqscan",
    "enable_bitmapscan",
    "enable_sort",
    "enable_hashjoin",
    "enable_mergejoin",
)


@contextmanager
def claim_transaction(connection: BaseDatabaseWrapper) -> Iterator[None]:
    """The claim's transaction: ``BEGIN IMMEDIATE`` on SQLite, READ COMMITTED on MySQL and
    PostgreSQL (whatever the alias's isolation level, unless it runs inside the caller's
    transaction), and on PostgreSQL a plan that does not depend on the table's statistics.

    PostgreSQL: statistics taken while nothing was pending (the normal quiet state, and
    autovacuum may be slow) made the planner read every pending row once per candidate (a
    bitmap scan of all pending rows inside the ``NOT EXISTS`` loop, or a sort of them all):
    2.7 s per batch at 5,000 pending rows, minutes at 100,000. With sequential scans, bitmap
    scans, sorts, hash and merge joins turned off for this transaction (``set_config(..., true)``,
    i.e. ``SET LOCAL``), the only plan left is the one meant: walk ``idem_outbox_pending_idx``
    in id order, and for each candidate probe ``idem_outbox_touched_idx`` for its key's earlier
    touched rows; the ``LIMIT`` stops the walk after a batch (about 1.5 ms at 100,000 pending
    rows over 1,000 keys, with the table analyzed empty). Inside a caller's transaction the
    switches are put back as they were when the claim ends. Every query the relay runs in
    this transaction must have a plan without those methods that reads only the rows it needs
    (:func:`unsent_of_keys` sorts its rows itself for that reason).
    """
    if connection.vendor == "sqlite":
        # Take the write lock first, so two relays serialise instead of both reading the same
        # rows (SQLite has no SELECT ... FOR UPDATE).
        if connection.in_atomic_block:
            with transaction.atomic(using=connection.alias):
                yield
            return
        connection.ensure_connection()
        with connection.cursor() as cursor:
            cursor.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
            cursor.execute("COMMIT")
        return
    outermost = not connection.in_atomic_block
    with transaction.atomic(using=connection.alias):
        if outermost:
            # READ COMMITTED whatever the alias's level, as the first statement (it must
            # come before any query of the transaction). MySQL: no gap locks; under
            # REPEATABLE READ the claim's locking read would block producers inserting new
            # messages until it commits. PostgreSQL: under REPEATABLE READ (or SERIALIZABLE)
            # the planner statement below takes the transaction's snapshot, and a row another
            # relay leased or marked sent after it makes ``FOR UPDATE SKIP LOCKED`` fail with
            # "could not serialize access due to concurrent update"; at READ COMMITTED the
            # locking read skips or re-reads such a row instead.
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        if connection.vendor != "postgresql":
            yield
            return
        with connection.cursor() as cursor:
            previous = _set_planner(cursor, {name: "off" for name in PLANNER_SWITCHES})
        yield
        if not outermost:
            with connection.cursor() as cursor:
                _set_planner(cursor, previous)


def _set_planner(cursor: Any, values: dict[str, str]) -> dict[str, str]:
    """Set planner settings for the transaction (``SET LOCAL``); returns their old values."""
    names = list(values)
    olds = ", ".join("current_setting(%s)" for _ in names)
    news = ", ".join("set_config(%s, %s, true)" for _ in names)
    cursor.execute(
        f"SELECT {olds}, {news}", [*names, *(x for name in names for x in (name, values[name]))]
    )
    row = cursor.fetchone()
    return dict(zip(names, row[: len(names)], strict=True))


@dataclass(slots=True)
class Claimed:
    """A claimed outbox row: the columns the relay and the transports read, no more.

    A plain row, not an :class:`OutboxEntry`: building 500 model instances (converters,
    ``Model.from_db``) cost about 30 µs a row where this costs 19 µs (the claim of 500 rows on
    PostgreSQL, median of 15 alternating rounds, on the 2-core development machine).
    """

    pk: int
    event_id: str
    destination: str
    transport: str
    payload: Any
    headers: dict[str, str]
    ordering_key: str | None
    attempts: int
    locked_until: datetime | None
    created_at: datetime
    due_at: datetime | None


#: The columns of :class:`Claimed`, in its order.
CLAIMED_COLUMNS = tuple("id" if name == "pk" else name for name in Claimed.__dataclass_fields__)


def _json(value: Any) -> Any:
    """A JSON column's value as the ORM gives it (a driver may return the text)."""
    return json.loads(value) if isinstance(value, (str, bytes)) else value


def candidates(using: str, now: datetime, limit: int) -> list[Claimed]:
    """Up to ``limit`` pending rows that are due and unleased, in id order, locked where the
    database can skip what another relay holds.

    An earlier message of the same key that cannot go now (parked, in backoff, leased by
    another relay) holds back the rest of its key: those rows are left out here, so a long
    queue behind a blocked head never fills the batch and starves the other keys. Only a row
    a relay has touched (:data:`~django_idempotency.models.OUTBOX_TOUCHED`) can be such a
    head, so the ``NOT EXISTS`` names that condition too: it is the predicate of the partial
    index ``idem_outbox_touched_idx``, which holds a handful of rows per key where the pending
    index holds the whole backlog. Run it inside :func:`claim_transaction`.
    """
    connection = connections[using]
    rows = OutboxEntry.objects.using(using)
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(_pg_claim_sql(connection), [now, now, now, now, limit])
            found = cursor.fetchall()
        return [
            Claimed(pk, event, destination, transport, _json(payload), _json(headers), *rest)
            for pk, event, destination, transport, payload, headers, *rest in found
        ]
    blocked_before = (
        rows.filter(ordering_key=OuterRef("ordering_key"), id__lt=OuterRef("id"))
        .filter(OUTBOX_TOUCHED)
        .filter(Q(state=PARKED) | Q(available_at__gt=now) | Q(locked_until__gte=now))
    )
    queryset = (
        rows.filter(state=PENDING)
        .filter(Q(available_at__isnull=True) | Q(available_at__lte=now))
        .filter(Q(locked_until__isnull=True) | Q(locked_until__lt=now))
        .filter(~Exists(blocked_before))
        .order_by("id")
    )
    if connection.features.has_select_for_update_skip_locked:
        queryset = queryset.select_for_update(skip_locked=True)
    return [Claimed(*row) for row in queryset.values_list(*CLAIMED_COLUMNS)[:limit]]


def _pg_claim_sql(connection: BaseDatabaseWrapper) -> str:
    """The claim on PostgreSQL: :func:`candidates`' query, with ``OFFSET 0`` in the
    ``NOT EXISTS``, which keeps it a subplan run per candidate with the candidate's key and id
    as constants (an index probe of ``idem_outbox_touched_idx``); pulled up into an anti-join,
    the planner could instead scan every touched row once per candidate."""
    table = connection.ops.quote_name(OutboxEntry._meta.db_table)
    columns = ", ".join(f"o.{connection.ops.quote_name(name)}" for name in CLAIMED_COLUMNS)
    return (
        f"SELECT {columns} FROM {table} AS o "
        "WHERE o.state = 'pending' AND (o.available_at IS NULL OR o.available_at <= %s) "
        "AND (o.locked_until IS NULL OR o.locked_until < %s) "
        f"AND NOT EXISTS (SELECT 1 FROM {table} AS b "
        "WHERE b.ordering_key = o.ordering_key AND b.id < o.id "
        # OUTBOX_TOUCHED, as the partial index's predicate says it:
        "AND NOT (b.state = 'sent') "
        "AND (b.state = 'parked' OR b.available_at IS NOT NULL OR b.locked_until IS NOT NULL) "
        "AND (b.state = 'parked' OR b.available_at > %s OR b.locked_until >= %s) "
        "OFFSET 0) "
        "ORDER BY o.id LIMIT %s FOR UPDATE OF o SKIP LOCKED"
    )


def unsent_of_keys(using: str, keys: Iterable[str], max_id: int) -> list[tuple[int, str]]:
    """``(id, ordering_key)`` of every unsent (pending or parked) message of ``keys`` with an
    id up to ``max_id``, in id order.

    Sorted here, not by the database: this runs inside :func:`claim_transaction`, whose
    planner switches turn sorts off on PostgreSQL, and an ``ORDER BY id`` then left one plan,
    a walk of the primary key over every row up to ``max_id``, sent rows included (0.25 s per
    batch at a million sent rows, seconds at ten million: issue 28). Unsorted, the query reads
    ``idem_outbox_key_idx`` (``ordering_key, state, id``): the few unsent rows of ``keys``.
    """
    rows = (
        OutboxEntry.objects.using(using)
        .filter(ordering_key__in=list(keys), state__in=UNSENT, id__lte=max_id)
        .order_by()
        .values_list("id", "ordering_key")
    )
    # filtered on ordering_key__in, so never None
    return sorted((pk, key) for pk, key in rows if key is not None)


def lease(using: str, ids: list[int], until: datetime) -> None:
    """Lease the claimed rows until ``until`` and count their attempt."""
    if _by_array(using, "locked_until = %s, attempts = attempts + 1", [until], ids):
        return
    OutboxEntry.objects.using(using).filter(id__in=ids).update(
        locked_until=until, attempts=F("attempts") + 1
    )


def _by_array(using: str, assignments: str, params: list[Any], ids: list[int]) -> bool:
    """PostgreSQL: ``UPDATE ... SET assignments WHERE id = ANY(ids)``; False elsewhere.

    The ORM writes ``id IN (%s, %s, ...)``, one placeholder per row, which psycopg splits and
    binds and PostgreSQL parses each time: in batches of 500, the lease cost 24.4 µs a row that
    way and 18.7 µs with one array parameter (median of 6 alternating rounds of 10,000 rows,
    PostgreSQL 15 on the 2-core development machine; ``bench/outbox.py`` measures the relay).
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        return False
    table = connection.ops.quote_name(OutboxEntry._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET {assignments} WHERE id = ANY(%s::bigint[])", [*params, ids]
        )
    return True


# --- The outcomes --------------------------------------------------------------------------------


@contextmanager
def record_transaction(using: str) -> Iterator[None]:
    """One transaction for a batch's outcomes."""
    with transaction.atomic(using=using):
        yield


def mark_sent(using: str, ids: list[int], now: datetime, expires_at: datetime) -> None:
    """The broker has them: sent, whoever holds the lease now."""
    assignments = "state = %s, sent_at = %s, expires_at = %s, locked_until = NULL, last_error = ''"
    if _by_array(using, assignments, [SENT.value, now, expires_at], ids):
        return
    OutboxEntry.objects.using(using).filter(id__in=ids).update(
        state=SENT, sent_at=now, expires_at=expires_at, locked_until=None, last_error=""
    )


def release(using: str, ids: list[int], lease: datetime | None) -> int:
    """Put back rows that were not tried (behind a failure of their key, or claimed by a claim
    whose COMMIT went unanswered), uncounting the attempt, while the lease is still ``lease``;
    the number of rows put back."""
    return (
        OutboxEntry.objects.using(using)
        .filter(id__in=ids, locked_until=lease)
        .update(locked_until=None, attempts=F("attempts") - 1)
    )


def park(using: str, pk: int, lease: datetime | None, error: str) -> int:
    """Park one row while the lease is still ``lease``; the number of rows parked."""
    return (
        OutboxEntry.objects.using(using)
        .filter(pk=pk, locked_until=lease)
        .update(state=PARKED, locked_until=None, last_error=error)
    )


def retry_later(
    using: str, pk: int, lease: datetime | None, available_at: datetime, error: str
) -> int:
    """Let one row wait until ``available_at`` while the lease is still ``lease``."""
    return (
        OutboxEntry.objects.using(using)
        .filter(pk=pk, locked_until=lease)
        .update(available_at=available_at, locked_until=None, last_error=error)
    )


# --- The wake-ups --------------------------------------------------------------------------------


def cause(error: BaseException) -> str:
    """One log line naming a database error: its class and first line, and those of the error
    it was raised from (Django wraps the driver's error; a connection error chains the socket's)
    when they say more. Tracebacks of an outage go to DEBUG; this line is what a WARNING says."""
    parts: list[str] = []
    seen: BaseException | None = error
    while seen is not None and len(parts) < 2:
        lines = str(seen).strip().splitlines()
        first = lines[0] if lines else ""
        if not parts or (first and first not in parts[-1]):
            parts.append(f"{type(seen).__name__}: {first}" if first else type(seen).__name__)
        seen = seen.__cause__
    return log_text("; from ".join(parts))


class Listener:
    """A connection of its own that listens on the outbox channel (PostgreSQL only), with
    psycopg 3 (its ``notifies()`` generator) or psycopg2 (``poll()`` and a ``select`` on the
    connection).

    When that connection is lost (a database restart, a failover, a pooler that closed it), or
    cannot be opened, the relay polls every ``poll_interval`` meanwhile and listens again
    ``RETRY_EVERY`` seconds later, for as long as it runs: a lost ``LISTEN`` never leaves a
    relay on polling alone for good. Listening again wakes the relay once, since a message may
    have been written while nobody listened.
    """

    RETRY_EVERY = 5.0
    """Seconds between two attempts to listen again."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.driver = "psycopg"
        """The driver module Django's backend loaded: ``psycopg`` (3) or ``psycopg2``."""
        self.wrapper: BaseDatabaseWrapper | None = None
        self.retry_at = 0.0
        self.failing = False
        """Whether this loss or failure to listen was logged already: the attempts that fail
        after it are logged at DEBUG (one line per outage, not one every few seconds)."""
        self.lost = ""
        """The cause of a lost connection that :meth:`report_loss` has not logged yet."""

    @classmethod
    def open(cls, using: str) -> Listener | None:
        """A listener, listening if it can; None where there is nothing to listen to."""
        if connections[using].vendor != "postgresql":
            return None
        driver = getattr(getattr(connections[using], "Database", None), "__name__", "")
        if driver not in ("psycopg", "psycopg2"):
            logger.warning(
                "outbox relay: LISTEN needs psycopg 3 or psycopg2; under %s the relay polls "
                "instead",
                log_text(driver or "this driver"),
            )
            return None
        listener = cls(using)
        listener.driver = driver
        listener._listen()
        return listener

    @property
    def listening(self) -> bool:
        return self.wrapper is not None

    def _listen(self) -> bool:
        wrapper = connections.create_connection(self.using)
        try:
            wrapper.ensure_connection()
            wrapper.set_autocommit(True)
            with wrapper.cursor() as cursor:
                cursor.execute(f"LISTEN {NOTIFY_CHANNEL}")
        except DatabaseError as error:
            logger.log(
                logging.DEBUG if self.failing else logging.WARNING,
                "outbox relay: cannot LISTEN (%s); polling meanwhile, trying again every %.0f s",
                cause(error),
                self.RETRY_EVERY,
            )
            logger.debug("outbox relay: LISTEN failed", exc_info=True)
            self.failing = True
            wrapper.close()
            self.retry_at = time.monotonic() + self.RETRY_EVERY
            return False
        self.wrapper = wrapper
        return True

    def wait(self, seconds: float) -> bool:
        """True if a notification arrived within ``seconds`` (pending ones are drained too),
        or if the relay should look now because it has just listened again."""
        if self.wrapper is None:
            if time.monotonic() >= self.retry_at and self._listen():
                self.failing = False
                logger.info("outbox relay: listening again on %s", NOTIFY_CHANNEL)
                return True
            time.sleep(seconds)
            return False
        raw: Any = self.wrapper.connection
        try:
            if self.driver == "psycopg2":
                woke = _psycopg2_notified(raw, seconds)
            else:
                woke = any(True for _ in raw.notifies(timeout=seconds, stop_after=1))
                if woke:
                    for _ in raw.notifies(timeout=0.0):
                        pass
        except Exception as error:
            # Any error of the driver (a connection the server or the network dropped, one
            # already closed): never raised into the relay's loop. Logged once the relay's next
            # batch says whether the database itself went away (report_loss).
            logger.debug("outbox relay: LISTEN connection lost", exc_info=True)
            self.lost = cause(error)
            self.failing = True
            self.close()
            self.retry_at = time.monotonic() + self.RETRY_EVERY
            return True  # a notification may have been lost with the connection: look now
        return woke

    def report_loss(self, *, outage: bool) -> None:
        """Log a lost connection once, after the relay's next batch: a WARNING when that batch
        reached the database (only the ``LISTEN`` connection went: a pooler or a proxy closed
        it, its backend was terminated), an INFO when it failed too, since the relay's outage
        WARNING already says that the database is gone (one WARNING per outage)."""
        lost, self.lost = self.lost, ""
        if not lost:
            return
        logger.log(
            logging.INFO if outage else logging.WARNING,
            "outbox relay: LISTEN connection lost (%s); polling meanwhile, listening again in "
            "%g s",
            lost,
            self.RETRY_EVERY,
        )

    DRAIN_READS = 1000
    """At most this many socket reads per :meth:`drain` (a read takes up to about 16 kB of
    notifications): producers that notify faster than it reads cannot hold the relay in it."""

    def drain(self) -> None:
        """Read the notifications that have arrived, without waiting (the relay is about to
        look at the outbox anyway). A lost connection is handled as :meth:`wait` does.

        Until a read finds none: one read of psycopg's ``notifies(timeout=0)`` takes what one
        ``recv`` returns, and behind a backlog of commits the rest would stay on the socket."""
        for _ in range(self.DRAIN_READS):
            if self.wrapper is None or not self.wait(0.0):
                return

    def close(self) -> None:
        if self.wrapper is not None:
            self.wrapper.close()
            self.wrapper = None


def _psycopg2_notified(raw: Any, seconds: float) -> bool:
    """psycopg2: whether a notification arrived within ``seconds`` (those pending are drained).

    psycopg2 has no ``notifies()`` generator: ``poll()`` reads what the socket holds and appends
    each notification to the list ``connection.notifies``; waiting is a ``select`` on the
    connection (its ``fileno()``). A lost connection makes ``poll()`` raise, as psycopg 3's
    generator does.
    """
    raw.poll()
    if not raw.notifies and seconds > 0 and select.select([raw], [], [], seconds)[0]:
        raw.poll()
    woke = bool(raw.notifies)
    del raw.notifies[:]
    return woke
