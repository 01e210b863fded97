"""The SQL behind the core: claim, complete and release an idempotency record.

Each backend gets the statements that let the unique ``(owner, key)`` index decide races
without ever waiting on another request's open transaction:

PostgreSQL
    One statement claims: it reads the existing row, takes a transaction-scoped advisory lock on
    a 64-bit hash of ``(owner, key)`` with ``pg_try_advisory_xact_lock`` (never waits), and only
    if it got the lock inserts the row with ``INSERT ... ON CONFLICT (owner, key) DO UPDATE ...
    WHERE <expired or stale lease>``, which also takes over an expired record in the same
    statement. A request that finds a completed row takes no lock at all. A plain ``INSERT``
    would block on an uncommitted duplicate until its transaction ends; the advisory lock
    answers "someone is running this key right now" at once, and the database drops it when
    that transaction commits, rolls back, or its process dies. The statement lives in the
    PL/pgSQL function ``django_idempotency_claim_v2`` (migration ``0008_write_once``, after
    ``0005_claim_function``'s ``_v1``): the request sends a short call, and PostgreSQL keeps the
    function's plan for the session, which also holds behind PgBouncer in transaction pooling
    mode (no prepared statement is used). In atomic mode, a key with no record at all is claimed
    by the lock alone: nobody else could see the row before it commits anyway, so the record is
    written once, completed, by :meth:`RecordStore.complete` (``ClaimResult.deferred``). After
    taking the lock the function looks again, in a new statement whose snapshot sees a record
    that the lock's previous holder committed. Under ``REPEATABLE READ`` or ``SERIALIZABLE``, a
    rival that committed the key after the transaction's snapshot makes the insert fail with a
    serialization failure (``40001``): that is answered as "in progress", so the client's retry
    gets the replay.
MariaDB / MySQL
    ``SET STATEMENT innodb_lock_wait_timeout=0 FOR INSERT ...``: an uncommitted duplicate makes
    the insert fail at once with error 1205 (lock wait timeout) instead of waiting; a committed
    one fails with 1062 (duplicate key), and a locking read (``LOCK IN SHARE MODE``, which sees
    the latest committed row even under ``REPEATABLE READ``) fetches it. Both errors only undo
    the statement, not the transaction. A 1205 can also come from a lock that is not this
    key's: another transaction's gap lock on the unique index where the new key goes (a
    locking range read at ``REPEATABLE READ``). So a 1205 is followed by the same locking read,
    which never waits either: this key's uncommitted record makes it fail with 1205 too ("in
    progress", 409); no record at all means the lock was someone else's, and the insert is
    tried again, twice, waiting up to ``TAKEOVER_LOCK_WAIT`` seconds each time. A lock that
    outlasts that is answered 503 (``ClaimResult.busy``), never 409.
    When the locking read fails with 1205 while the record's latest committed version (a plain
    read, which never waits) is completed, the lock is another writer's on a finished record
    (a key rotation's batch, an erasure): the claim is tried again once, waiting up to
    ``TAKEOVER_LOCK_WAIT`` seconds, and replays what it then reads.

    Taking over a stale record is the other statement that waits (up to
    ``TAKEOVER_LOCK_WAIT`` seconds): concurrent contenders all hold a shared lock on the
    record, so without waiting none of them could ever take it over; waiting, they deadlock,
    InnoDB rolls victims back at once, and one of them wins.
SQLite
    ``INSERT ... ON CONFLICT DO NOTHING``. SQLite has one writer at a time, so a duplicate waits
    for the database lock (the connection's ``timeout``) and then sees the committed row; if
    the timeout runs out first, ``database is locked`` is answered as "in progress".

Storing the response and releasing a record are hand-written statements, built once per backend
(:func:`_statements`), not ORM queries compiled on every request. On PostgreSQL the response is
stored by the PL/pgSQL function ``django_idempotency_complete_v1`` (migration
``0007_complete_function``), or written with its new record by
``django_idempotency_insert_completed_v1`` (``0008_write_once``), and the ``COMMIT`` that follows
can travel in the same query (:meth:`RecordStore.complete`).

Every time comparison uses the database clock (``STATEMENT_TIMESTAMP()``,
``UTC_TIMESTAMP(6)``, SQLite's ``'now'``), so app servers with skewed clocks agree on expiry
and leases.

Why this module is long: the claim and the stored response are written out per backend
(PostgreSQL's functions, MariaDB, SQLite) side by side, so that their locking reads as one.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import (
    DatabaseError,
    IntegrityError,
    NotSupportedError,
    OperationalError,
    connections,
)
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.exceptions import StaleClaim
from django_idempotency.models import IdempotencyRecord
from django_idempotency.outages import connection_lost, sqlstate
from django_idempotency.pg_roundtrips import execute_first, execute_last

IN_PROGRESS = IdempotencyRecord.State.IN_PROGRESS.value
COMPLETED = IdempotencyRecord.State.COMPLETED.value

# MariaDB/MySQL error numbers.
ER_DUP_ENTRY = 1062
ER_LOCK_WAIT_TIMEOUT = 1205
ER_LOCK_DEADLOCK = 1213
TAKEOVER_LOCK_WAIT = 1
"""MariaDB: seconds a takeover waits for the record's lock (see :func:`_statements`)."""

COLUMNS = (
    "id",
    "fingerprint",
    "state",
    "token",
    "response_status",
    "response_headers",
    "response_body",
)


@dataclass(frozen=True)
class Existing:
    """A record that was already there when a request tried to claim its key."""

    id: int
    fingerprint: str
    state: str
    token: uuid.UUID
    response_status: int | None
    response_headers: dict[str, str]
    response_body: bytes | None
    expired: bool
    """``expires_at`` has passed (database clock): the key counts as new."""
    lease_live: bool
    """The record is ``in_progress`` under a lease that has not run out."""

    @property
    def completed(self) -> bool:
        return self.state == COMPLETED


@dataclass(frozen=True)
class ClaimResult:
    """What a claim attempt found.

    * ``record_id`` set: the caller owns the record (new, or taken over from ``existing``).
    * ``record_id`` None, ``existing`` set: someone else's record, to replay or refuse.
    * both None: another transaction is claiming or running this key right now.
    """

    record_id: int | None
    existing: Existing | None
    deferred: ClaimValues | None = None
    """Set when the caller owns a key that has no record yet, and none was written (PostgreSQL,
    atomic mode, see :meth:`RecordStore.claim`): :meth:`RecordStore.complete` writes the record
    from these values, and :meth:`RecordStore.release` has nothing to delete."""

    busy: bool = False
    """MariaDB: the key has no record, yet its insert kept meeting another transaction's lock
    (a gap lock on the index) after the retries :meth:`RecordStore.claim` allows, or InnoDB
    chose the claim's transaction as a deadlock's victim. Not "in progress": no request holds
    this key."""

    cause: str = ""
    """Why a ``busy`` claim failed, for the log line: which lock error, in a few words."""

    @property
    def claimed(self) -> bool:
        return self.record_id is not None or self.deferred is not None


def advisory_lock_id(owner: str, key: str) -> int:
    """A signed 64-bit PostgreSQL advisory lock id for ``(owner, key)``."""
    digest = hashlib.sha256(f"django_idempotency\0{owner}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


PATH_LENGTH: int = IdempotencyRecord._meta.get_field("path").max_length  # type: ignore[assignment]
"""``IdempotencyRecord.path``'s ``max_length``."""
METHOD_LENGTH: int = IdempotencyRecord._meta.get_field("method").max_length  # type: ignore[assignment]
"""``IdempotencyRecord.method``'s ``max_length``. ``METHODS`` may list a longer method
(``MKWORKSPACE``, ``VERSION-CONTROL``): the record keeps it cut, as it keeps a long path; the
fingerprint holds it whole."""


def stored_path(path: str) -> str:
    """The request path as the record keeps it (for the admin and the logs): a NUL character,
    which a path may carry (``%00``) and a PostgreSQL text column cannot, written back as
    ``%00``, then cut to the column's length. The fingerprint, not this, tells requests apart."""
    return path.replace("\x00", "%00")[:PATH_LENGTH]


def _seconds(duration: timedelta | None) -> float | None:
    return None if duration is None else duration.total_seconds()


def _microseconds(duration: timedelta | None) -> int | None:
    return None if duration is None else duration // timedelta(microseconds=1)


class RecordStore:
    """Claims, completes and releases :class:`IdempotencyRecord` rows on one database alias."""

    def __init__(self, using: str) -> None:
        self.using = using

    @property
    def connection(self) -> BaseDatabaseWrapper:
        return connections[self.using]

    # -- claim ------------------------------------------------------------------------------

    def claim(
        self,
        *,
        owner: str,
        key: str,
        fingerprint: str,
        method: str,
        path: str,
        token: uuid.UUID,
        ttl: timedelta,
        lease: timedelta | None,
    ) -> ClaimResult:
        """Try to own ``(owner, key)`` with a fresh ``token``; never waits on another claim.

        A record whose TTL ran out is taken over as a new key. An ``in_progress`` record whose
        lease ran out is taken over when the fingerprint matches (the retry of a crashed
        holder). Must run inside a transaction on :attr:`using`.

        On PostgreSQL, a new key in atomic mode (``lease`` None) at ``READ COMMITTED`` is claimed
        by the advisory lock alone: no row is written until :meth:`complete` writes it,
        completed, in the same transaction (``ClaimResult.deferred``; migration
        ``0008_write_once``).
        """
        method = method[:METHOD_LENGTH]
        values = ClaimValues(owner, key, fingerprint, method, stored_path(path), token, ttl, lease)
        vendor = self.connection.vendor
        blocked = False
        for _ in range(3):
            if vendor == "postgresql":
                result = self._claim_postgresql(values)
            elif vendor == "mysql":
                result = self._claim_mysql(values, wait=blocked)
                blocked = result is BLOCKED or result is FINISHED_LOCKED
                if blocked:
                    continue
            elif vendor == "sqlite":
                result = self._claim_sqlite(values)
            else:
                raise NotSupportedError(
                    f"django-idempotency supports PostgreSQL, MariaDB/MySQL and SQLite, not "
                    f"{vendor!r} (database alias {self.using!r})."
                )
            if result is not None:
                return result
        if result is FINISHED_LOCKED:
            # MariaDB: the key's finished record stayed locked by another writer, and the
            # attempts in between found no record: answered "in progress", as before the wait.
            return ClaimResult(None, None)
        if blocked:
            # MariaDB: no record, and the insert met another transaction's lock three times,
            # the last two after waiting TAKEOVER_LOCK_WAIT seconds each: the database is too
            # busy, not the key (503 with Retry-After).
            return ClaimResult(None, None, busy=True, cause=LOCK_STAYED)
        # The row vanished between the insert and the read three times in a row (purged or
        # released each time): answer "in progress" and let the client retry.
        return ClaimResult(None, None)

    def _claim_postgresql(self, v: ClaimValues) -> ClaimResult | None:
        params: list[Any] = [v.owner, v.key, v.fingerprint, v.method, v.path, v.token]
        params += [v.lease, v.ttl, advisory_lock_id(v.owner, v.key)]
        # The claim is the first statement of the transaction: its BEGIN travels with it.
        try:
            rows = execute_first(self.connection, CLAIM_POSTGRESQL, params)
        except OperationalError as exc:
            if sqlstate(exc) != SERIALIZATION_FAILURE:
                raise
            # REPEATABLE READ or SERIALIZABLE, and a rival committed this key after the
            # transaction's snapshot was taken (under ATOMIC_REQUESTS, by a session lookup
            # before the view): the insert's ON CONFLICT meets a row the snapshot cannot see.
            # No statement in this transaction can read that row, so the answer is "in
            # progress" (409 with Retry-After), and the client's retry, in a new transaction,
            # gets the replay. It answered 500 before.
            self.connection.needs_rollback = self.connection.in_atomic_block
            return ClaimResult(None, None)
        got, claimed_id, *row, deferred = rows[0]
        if deferred:
            return ClaimResult(None, None, v)
        existing = self._existing(row) if row[0] is not None else None
        if claimed_id is not None:
            return ClaimResult(claimed_id, existing)
        if existing is None and got:
            # We held the lock yet the insert met a row this statement's snapshot could not
            # see: it was committed a moment ago. Run the claim again to read it.
            return None
        return ClaimResult(None, existing)

    def _claim_mysql(self, v: ClaimValues, *, wait: bool = False) -> ClaimResult | None:
        """One attempt. Returns :data:`BLOCKED` when the insert met a lock (1205) and yet the
        key has no record: another transaction's gap or insert-intention lock on the unique
        index around the new key, not a request of this key. :meth:`claim` then tries again,
        ``wait``-ing up to ``TAKEOVER_LOCK_WAIT`` seconds for that lock.

        A 1205 used to be answered as "in progress" without looking: an unrelated transaction
        that held a gap lock at the new key's place in the index got a fresh key a 409."""
        sql = _statements(self.connection)
        params: list[Any] = [v.owner, v.key, v.fingerprint, v.method, v.path, v.token.hex]
        params += [_microseconds(v.lease), _microseconds(v.ttl)]
        with self.connection.cursor() as cursor:
            try:
                cursor.execute(sql.insert_waiting if wait else sql.insert, params)
                return ClaimResult(cursor.lastrowid, None)
            except (IntegrityError, OperationalError) as exc:
                code = _mysql_errno(exc)
                if code == ER_LOCK_DEADLOCK:
                    # InnoDB chose this transaction as a deadlock's victim and rolled it all
                    # back: nothing more can be read in it. Met by the insert that waits (after
                    # a 1205 with no record: the claim's own locking read holds a gap lock, and
                    # another transaction inserting into that gap closes the cycle), so it is
                    # a lock of another key's transaction, not a request of this key: 503 with
                    # Retry-After, the log naming the deadlock. (The insert that does not wait
                    # fails 1205 instead: InnoDB looks for deadlocks only before a wait.)
                    self._after_mysql_lock_error(code)
                    return ClaimResult(None, None, busy=True, cause=deadlock(exc))
                if code not in (ER_DUP_ENTRY, ER_LOCK_WAIT_TIMEOUT):
                    raise
                locked = code == ER_LOCK_WAIT_TIMEOUT
            # Look for the key's record. The read takes no wait either: an uncommitted record
            # of this key (a request that runs it now) makes it fail with 1205, "in progress".
            try:
                cursor.execute(sql.select, [v.owner, v.key])
            except OperationalError as exc:
                code = _mysql_errno(exc)
                if code not in (ER_LOCK_WAIT_TIMEOUT, ER_LOCK_DEADLOCK):
                    raise
                self._after_mysql_lock_error(code)
                if code == ER_LOCK_DEADLOCK:  # rolled back before it could look: not this key's
                    return ClaimResult(None, None, busy=True, cause=deadlock(exc))
                if not wait and self._finished_mysql(cursor, v):
                    return FINISHED_LOCKED
                return ClaimResult(None, None)
            row = cursor.fetchone()
        if row is None:
            # 1205 and no record: a lock that is not this key's. 1062 and no record: the
            # record went away between the insert and the read (purged, released).
            return BLOCKED if locked else None
        return self._take_over_or_report(v, self._existing(row))

    def _finished_mysql(self, cursor: Any, v: ClaimValues) -> bool:
        """MariaDB, after the locking read of the key's record met a lock (1205): whether the
        record's latest committed version (a plain read, which never waits) is completed.

        Then the lock is another writer's on a finished record (a key rotation's batch, an
        erasure, a purge, an admin edit), not a request that runs this key: :meth:`claim` tries
        again, waiting up to ``TAKEOVER_LOCK_WAIT`` seconds for it, and replays what it finds,
        where it used to answer "in progress". An uncommitted record (a request of this key
        that runs now, atomic mode) is invisible to the plain read, and a committed one in
        progress (lease mode) is not completed: both stay "in progress" at once."""
        cursor.execute(_statements(self.connection).finished, [v.owner, v.key])
        row = cursor.fetchone()
        return row is not None and row[0] == COMPLETED

    def _after_mysql_lock_error(self, code: int) -> None:
        if code == ER_LOCK_DEADLOCK:
            # InnoDB rolled the whole transaction back: tell Django, so it does not commit
            # (or release savepoints) as though nothing happened.
            self.connection.needs_rollback = self.connection.in_atomic_block

    def _claim_sqlite(self, v: ClaimValues) -> ClaimResult | None:
        sql = _statements(self.connection)
        params: list[Any] = [v.owner, v.key, v.fingerprint, v.method, v.path, v.token.hex]
        params += [_sqlite_modifier(v.lease), _sqlite_modifier(v.ttl)]
        with self.connection.cursor() as cursor:
            try:
                cursor.execute(sql.insert, params)
            except OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                return ClaimResult(None, None)
            if cursor.rowcount == 1:
                return ClaimResult(cursor.lastrowid, None)
            cursor.execute(sql.select, [v.owner, v.key])
            row = cursor.fetchone()
        if row is None:
            return None
        return self._take_over_or_report(v, self._existing(row))

    def _take_over_or_report(self, v: ClaimValues, existing: Existing) -> ClaimResult:
        """MariaDB and SQLite: take over an expired record or a stale lease, compare-and-swap."""
        if existing.lease_live or not (
            existing.expired
            or (existing.state == IN_PROGRESS and existing.fingerprint == v.fingerprint)
        ):
            return ClaimResult(None, existing)
        mysql = self.connection.vendor == "mysql"
        params: list[Any] = [v.fingerprint, v.method, v.path, v.token.hex]
        if mysql:
            params += [_microseconds(v.lease), _microseconds(v.ttl)]
        else:
            params += [_sqlite_modifier(v.lease), _sqlite_modifier(v.ttl)]
        params += [existing.id, existing.token.hex]
        with self.connection.cursor() as cursor:
            try:
                cursor.execute(_statements(self.connection).take_over, params)
            except OperationalError as exc:
                code = _mysql_errno(exc) if mysql else None
                if code not in (ER_LOCK_WAIT_TIMEOUT, ER_LOCK_DEADLOCK):
                    raise
                self._after_mysql_lock_error(code)
                return ClaimResult(None, existing)
            taken = cursor.rowcount == 1
        return ClaimResult(existing.id if taken else None, existing)

    # -- complete and release ---------------------------------------------------------------

    def complete(
        self,
        record_id: int | None,
        token: uuid.UUID,
        *,
        status: int,
        headers: dict[str, str],
        body: bytes | None,
        commit: bool = False,
        deferred: ClaimValues | None = None,
    ) -> int:
        """Store the response; raise :class:`StaleClaim` unless ``token`` still owns the record.
        Returns the record's id.

        ``deferred`` is the claim's :attr:`ClaimResult.deferred`: the record is then written
        here, completed (PostgreSQL's ``django_idempotency_insert_completed_v1``). A row that
        appeared meanwhile, which the advisory lock rules out, raises :class:`StaleClaim` too.

        ``commit=True`` says that the caller commits right after, by leaving its outermost
        ``transaction.atomic``. On PostgreSQL with psycopg 3 binding on the client (Django's
        default), the ``COMMIT`` then travels with the statement, and Django's own commit finds
        nothing left to do: one round trip less (:func:`~django_idempotency.pg_roundtrips.
        execute_last`). The function raises on a lost claim, which stops the query before that
        ``COMMIT``. Anywhere else (nested in another atomic block, marked for rollback, another
        driver or backend), it is a plain statement.
        """
        connection = self.connection
        if connection.vendor == "postgresql":
            if deferred is not None:
                v = deferred
                sql = INSERT_COMPLETED_POSTGRESQL
                params: list[Any] = [v.owner, v.key, v.fingerprint, v.method, v.path, token]
                params += [v.ttl, status, json.dumps(headers), body]
            else:
                sql = COMPLETE_POSTGRESQL
                params = [record_id, token, status, json.dumps(headers), body]
            try:
                if commit:
                    rows = execute_last(connection, sql, params)
                else:
                    with connection.cursor() as cursor:
                        cursor.execute(sql, params)
                        rows = cursor.fetchall()
                return int(rows[0][0]) if deferred is not None else int(record_id or 0)
            except DatabaseError as exc:
                # At REPEATABLE READ or SERIALIZABLE, a takeover (or a purge) that committed
                # after this transaction's snapshot makes the update fail with a serialization
                # failure instead of finding the token gone: the claim is lost all the same,
                # and the view's writes roll back. It answered 500. (Not SERIALIZABLE's failure
                # for read/write dependencies: the claim is still this request's, see
                # _dependencies.)
                if sqlstate(exc) not in (NO_DATA_FOUND, SERIALIZATION_FAILURE) or _dependencies(
                    exc
                ):
                    raise
            if deferred is not None:
                raise StaleClaim(
                    f"Key {deferred.key!r} got a record while token {token} held its claim, so "
                    "this response was not stored."
                )
        else:
            params = [status, json.dumps(headers), body, record_id, self._token(token)]
            with connection.cursor() as cursor:
                cursor.execute(_statements(connection).complete, params)
                if cursor.rowcount == 1:
                    return int(record_id or 0)
        raise StaleClaim(
            f"Record {record_id} is no longer held by token {token}: its lease ran out and "
            "another request took it over, so this response was not stored."
        )

    def release(
        self, record_id: int | None, token: uuid.UUID, *, deferred: ClaimValues | None = None
    ) -> None:
        """Delete an unfinished record so a retry executes afresh; checks ``token`` likewise.
        A deferred claim (:attr:`ClaimResult.deferred`) wrote no record: nothing to delete."""
        if deferred is not None:
            return
        with self.connection.cursor() as cursor:
            try:
                cursor.execute(
                    _statements(self.connection).release, [record_id, self._token(token)]
                )
            except OperationalError as exc:
                # As in complete(): a takeover after this transaction's snapshot.
                if sqlstate(exc) != SERIALIZATION_FAILURE or _dependencies(exc):
                    raise
                deleted = 0
            else:
                deleted = cursor.rowcount
        if deleted != 1:
            raise StaleClaim(
                f"Record {record_id} is no longer held by token {token}; it was not released."
            )

    def extend(self, record_id: int | None, token: uuid.UUID, lease: timedelta) -> int:
        """Move an ``in_progress`` record's ``locked_until`` to ``lease`` from now (database
        clock; ``timedelta(0)``: now, the lease given up) while ``token`` holds it; a
        compare-and-swap for a phased flow's fence and pause. Returns the rows updated, 0 or 1.
        """
        vendor = self.connection.vendor
        until: Any = lease
        if vendor == "mysql":
            until = _microseconds(lease)
        elif vendor == "sqlite":
            until = _sqlite_modifier(lease)
        with self.connection.cursor() as cursor:
            cursor.execute(
                _statements(self.connection).extend, [until, record_id, self._token(token)]
            )
            return int(cursor.rowcount)

    # -- an unreachable database -------------------------------------------------------------

    def unreachable(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised while claiming, says that the database cannot be reached:
        the connection could not be opened, or it broke (the server closed it, the network cut
        it, the backend was terminated), rather than a statement failing on a live connection.
        """
        return connection_lost(self.connection, exc)

    def conflicted(self, exc: BaseException) -> bool:
        """Whether ``exc`` says that the database undid this transaction's work because of
        another transaction, on a live connection: a deadlock's victim (MariaDB 1213,
        PostgreSQL ``40P01``), a serialization failure (``40001``), a lock that was not granted
        in time (MariaDB 1205, PostgreSQL ``55P03``). The transaction must roll back, and
        nothing of it takes effect: a retry may run it again. On SQLite, ``database is
        locked``: another connection held the write lock past the connection's ``timeout``
        (an atomic claim holds the lock already, but a lease-mode transaction takes it only
        when the response is stored).
        """
        return transaction_conflicted(self.connection, exc)

    # -- helpers ----------------------------------------------------------------------------

    def _token(self, token: uuid.UUID) -> uuid.UUID | str:
        """A token as the driver takes it: native on PostgreSQL, 32 hex digits elsewhere."""
        return token if self.connection.vendor == "postgresql" else token.hex

    @staticmethod
    def _existing(row: Sequence[Any]) -> Existing:
        record_id, fingerprint, state, token, status, headers, body, expired, lease_live = row
        if isinstance(headers, (str, bytes)):
            headers = json.loads(headers)
        return Existing(
            id=int(record_id),
            fingerprint=fingerprint,
            state=state,
            token=token if isinstance(token, uuid.UUID) else uuid.UUID(str(token)),
            response_status=status,
            response_headers=dict(headers or {}),
            response_body=None if body is None else bytes(body),
            expired=bool(expired),
            lease_live=bool(lease_live),
        )


CLAIM_POSTGRESQL = "SELECT * FROM django_idempotency_claim_v2(%s, %s, %s, %s, %s, %s, %s, %s, %s)"
"""The claim on PostgreSQL: a call of the function that migration ``0008_write_once`` creates
(``0005_claim_function``'s, which leaves a new key in atomic mode unwritten). A short statement
to parse, and the function's own plan is cached per session."""

INSERT_COMPLETED_POSTGRESQL = (
    "SELECT django_idempotency_insert_completed_v1(%s, %s, %s, %s, %s, %s, %s, %s, %s::jsonb, %s)"
)
"""Writing a deferred claim's record, completed, on PostgreSQL (migration ``0008_write_once``).
It raises ``NO_DATA_FOUND`` if the key has a record already."""


COMPLETE_POSTGRESQL = "SELECT django_idempotency_complete_v1(%s, %s, %s, %s::jsonb, %s)"
"""Storing a response on PostgreSQL: a call of the function that migration
``0007_complete_function`` creates. It raises ``NO_DATA_FOUND`` when the token no longer owns
the record."""
NO_DATA_FOUND = "P0002"
SERIALIZATION_FAILURE = "40001"
DEADLOCK_DETECTED = "40P01"
LOCK_NOT_AVAILABLE = "55P03"


def transaction_conflicted(connection: BaseDatabaseWrapper, exc: BaseException) -> bool:
    """Whether ``exc``, raised on ``connection``, is another transaction's doing that undid
    this one (:meth:`RecordStore.conflicted`); the data-protection batches use it too."""
    if not isinstance(exc, OperationalError):
        return False
    vendor = connection.vendor
    if vendor == "postgresql":
        return sqlstate(exc) in (SERIALIZATION_FAILURE, DEADLOCK_DETECTED, LOCK_NOT_AVAILABLE)
    if vendor == "mysql":
        args: Sequence[Any] = getattr(exc.__cause__ or exc, "args", ())
        return bool(args) and args[0] in (ER_LOCK_WAIT_TIMEOUT, ER_LOCK_DEADLOCK)
    if vendor == "sqlite":
        # Another connection held the database's write lock past the connection's timeout:
        # SQLite's lock wait that ran out (only a lease-mode or phased transaction, whose first
        # write comes late, meets it after the view ran; an atomic claim takes it first).
        return "database is locked" in str(exc)
    return False


def _dependencies(exc: DatabaseError) -> bool:
    """Whether ``exc``, a serialization failure, is SERIALIZABLE's for read/write dependencies
    among transactions (a write skew: the statement's rows did not change), not a row this
    statement writes that changed after the snapshot ("concurrent update", a takeover or a
    purge). PostgreSQL gives the former, and only it, a detail "Reason code: ...", which it
    never translates (``errdetail_internal``). The claim is then still this request's: the
    failure is a conflict (:meth:`RecordStore.conflicted`, a ``503``), not a lost claim
    (:class:`StaleClaim`, a ``409`` that leaves a lease claim held until its lease runs out).
    """
    diag = getattr(exc.__cause__, "diag", None)
    detail = getattr(diag, "message_detail", None) or ""
    return detail.startswith("Reason code:")


LOCK_STAYED = "another transaction's lock on the records' index (1205) stayed in the way"
"""The ``cause`` of a claim that met a lock that is not its key's, three times."""

BLOCKED = ClaimResult(None, None, busy=True, cause=LOCK_STAYED)

FINISHED_LOCKED = ClaimResult(None, None)
"""MariaDB: one claim attempt met a lock on the key's record, whose latest committed version is
completed (:meth:`RecordStore._finished_mysql`): another writer's lock, waited for next."""
"""MariaDB: one claim attempt met another transaction's lock, and the key has no record."""


def deadlock(exc: DatabaseError) -> str:
    """The ``cause`` of a claim rolled back as a deadlock's victim (1213), with the server's
    words."""
    args: Sequence[Any] = getattr(exc.__cause__ or exc, "args", ())
    said = " ".join(str(args[1]).split()) if len(args) > 1 else ""
    return f"a deadlock (1213): InnoDB rolled the claim's transaction back ({said})"


@dataclass(frozen=True)
class _Statements:
    """The hand-written SQL of one backend, built once per vendor (see :func:`_statements`)."""

    complete: str
    release: str
    extend: str
    insert: str = ""
    insert_waiting: str = ""
    select: str = ""
    take_over: str = ""
    finished: str = ""


_STATEMENTS: dict[str, _Statements] = {}


def _statements(connection: BaseDatabaseWrapper) -> _Statements:
    """The statements for ``connection``'s backend, built on first use and then reused.

    The ORM's ``filter().update()`` compiles its query on every call; this is the same SQL
    written once. Every time comes from the database clock.
    """
    vendor = connection.vendor
    cached = _STATEMENTS.get(vendor)
    if cached is None:
        cached = _STATEMENTS[vendor] = _build_statements(connection)
    return cached


def _build_statements(connection: BaseDatabaseWrapper) -> _Statements:
    quote = connection.ops.quote_name
    t = quote(IdempotencyRecord._meta.db_table)
    k = quote("key")
    vendor = connection.vendor
    if vendor == "postgresql":
        now, headers, later = "STATEMENT_TIMESTAMP()", "%s::jsonb", ""
    elif vendor == "mysql":
        now, headers = "UTC_TIMESTAMP(6)", "%s"
        later = f"{now} + INTERVAL %s MICROSECOND"
    elif vendor == "sqlite":
        now, headers = "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now')", "%s"
        later = "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s)"
    else:
        raise NotSupportedError(
            f"django-idempotency supports PostgreSQL, MariaDB/MySQL and SQLite, not {vendor!r}."
        )
    # MariaDB: the record is found by its primary key, always. Left to choose, the optimizer
    # once read ``state = 'in_progress'`` from idem_record_state_idx instead (a fresh table's
    # statistics): that read locks every other request's in-progress entry, so two requests
    # storing their responses at once deadlocked (1213, CI run of issue 35's fresh-key load).
    by_id = f"{t} FORCE INDEX (PRIMARY)" if vendor == "mysql" else t
    complete = (
        f"UPDATE {by_id} SET state = '{COMPLETED}', locked_until = NULL, response_status = %s, "
        f"response_headers = {headers}, response_body = %s, completed_at = {now} "
        f"WHERE id = %s AND token = %s AND state = '{IN_PROGRESS}'"
    )
    # (MariaDB takes index hints in a DELETE only in its multi-table form.)
    release = (
        f"DELETE r FROM {t} AS r FORCE INDEX (PRIMARY) WHERE r.id = %s AND r.token = %s "
        f"AND r.state = '{IN_PROGRESS}'"
        if vendor == "mysql"
        else f"DELETE FROM {t} WHERE id = %s AND token = %s AND state = '{IN_PROGRESS}'"
    )
    # A phased flow's fence and pause (django_idempotency.flows.phases): the lease moves on,
    # while the token holds the record. By its primary key too, as ``complete``.
    until = "STATEMENT_TIMESTAMP() + %s" if vendor == "postgresql" else later
    extend = (
        f"UPDATE {by_id} SET locked_until = {until} "
        f"WHERE id = %s AND token = %s AND state = '{IN_PROGRESS}'"
    )
    if vendor == "postgresql":
        return _Statements(complete, release, extend)
    # MariaDB: never wait on another transaction's row lock (see the module docstring).
    nowait = "SET STATEMENT innodb_lock_wait_timeout=0 FOR " if vendor == "mysql" else ""
    insert = (
        f"{nowait}INSERT INTO {t} (owner, {k}, fingerprint, method, path, state, token, "
        f"locked_until, response_headers, created_at, expires_at) "
        f"VALUES (%s, %s, %s, %s, %s, '{IN_PROGRESS}', %s, {later}, '{{}}', {now}, {later})"
    )
    if vendor == "sqlite":
        insert += f" ON CONFLICT (owner, {k}) DO NOTHING"
    select = (
        f"{nowait}SELECT {', '.join(COLUMNS)}, expires_at <= {now}, "
        f"(state = '{IN_PROGRESS}' AND locked_until > {now}) "
        f"FROM {t} WHERE owner = %s AND {k} = %s"
    )
    if vendor == "mysql":
        # A locking read sees the latest committed row even under REPEATABLE READ.
        select += " LOCK IN SHARE MODE"
    # The takeover does wait, briefly: every contender for one stale record holds a shared
    # lock on it (its failed insert and its locking read took one), so none could ever take the
    # exclusive lock without waiting. Waiting, they form a deadlock, which InnoDB breaks at
    # once by rolling victims back (1213): the last one standing takes the record over.
    briefly = (
        f"SET STATEMENT innodb_lock_wait_timeout={TAKEOVER_LOCK_WAIT} FOR "
        if vendor == "mysql"
        else ""
    )
    take_over = (
        f"{briefly}UPDATE {t} SET fingerprint = %s, method = %s, path = %s, "
        f"state = '{IN_PROGRESS}', token = %s, locked_until = {later}, response_status = NULL, "
        f"response_headers = '{{}}', response_body = NULL, created_at = {now}, "
        f"completed_at = NULL, expires_at = {later} WHERE id = %s AND token = %s"
    )
    # A retry of an insert that met a lock while the key had no record (see _claim_mysql).
    insert_waiting = insert.replace(nowait, briefly, 1) if vendor == "mysql" else insert
    return _Statements(
        complete,
        release,
        extend,
        insert=insert,
        insert_waiting=insert_waiting,
        select=select,
        take_over=take_over,
        # A plain read (no lock, never waits): the latest committed version of the key's record.
        finished=f"SELECT state FROM {t} WHERE owner = %s AND {k} = %s",
    )


@dataclass(frozen=True)
class ClaimValues:
    """What a claim writes into a record (``method`` and ``path`` already cut to their columns'
    lengths)."""

    owner: str
    key: str
    fingerprint: str
    method: str
    path: str
    token: uuid.UUID
    ttl: timedelta
    lease: timedelta | None


def _sqlite_modifier(duration: timedelta | None) -> str | None:
    seconds = _seconds(duration)
    return None if seconds is None else f"{seconds:+.6f} seconds"


def _mysql_errno(exc: DatabaseError) -> int | None:
    cause = exc.__cause__ or exc
    args = getattr(cause, "args", ())
    return args[0] if args and isinstance(args[0], int) else None
