"""The queries of data protection: batches to re-encrypt (or to decrypt), compare-and-swap
writes, erasure.

Every write is a compare-and-swap, so that the rotation, the decryption and the erasure run
beside live traffic without overwriting what a request wrote meanwhile:

* a record is rewritten only while it is ``completed`` under the token that was read (every
  claim, takeover and erasure draws a new token);
* a flow run only while its ``updated_at`` is the one that was read (every save of a phase,
  pause or end sets it);
* an outbox message's payload is written once and never changed by a relay, so the rotation's
  write needs no condition: a relay sending it meanwhile opens the old value or the new one,
  with the same result.

A batch is written in one transaction. When another transaction undoes it (PostgreSQL's
serialization failure at REPEATABLE READ for a row a request changed meanwhile, a deadlock, a
lock wait that ran out), nothing of it is written and the write counts 0: the core reads the
rows again, as it does for a compare-and-swap that wrote nothing.

Batches are read in primary key order after a given id (keyset pagination), so a batch costs
the same at the end of a large table as at its start, and a run stopped anywhere can go on.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import OperationalError, connections, transaction
from django.db.models import BinaryField, Q
from django.db.models.functions import Substr

from django_idempotency.http.store import transaction_conflicted
from django_idempotency.models import FlowRun, IdempotencyRecord, OutboxEntry

COMPLETED = IdempotencyRecord.State.COMPLETED.value

_RECORD_COLUMNS = (  # in the order of RecordRow's fields
    "pk",
    "owner",
    "key",
    "token",
    "response_status",
    "response_headers",
    "response_body",
)

__all__ = ["FlowRunRow", "OutboxRow", "ProtectionStore", "RecordRow"]


@dataclass(frozen=True)
class RecordRow:
    id: int
    owner: str
    key: str
    token: uuid.UUID
    status: int | None
    headers: dict[str, Any]
    body: bytes | None


@dataclass(frozen=True)
class FlowRunRow:
    id: int
    record_id: int
    updated_at: datetime
    request: Any
    results: Any


@dataclass(frozen=True)
class OutboxRow:
    id: int
    event_id: str
    payload: Any


class ProtectionStore:
    """The rows of one database alias that the rotation and the erasure read and write."""

    def __init__(self, using: str) -> None:
        self.using = using

    # -- records -----------------------------------------------------------------------------

    def records_to_reseal(
        self,
        after: int,
        size: int,
        *,
        sealed: str,
        erased: str,
        key_id: str | None,
        old_format: int,
    ) -> list[RecordRow]:
        """Up to ``size`` completed records after id ``after`` that are not sealed with
        ``key_id`` (None: that are sealed at all), or are sealed with it in ``old_format`` (the
        first byte of the sealed body), and not erased, in id order.

        The format is read from the sealed body itself, not from a marker beside it: a body
        whose first byte was changed does not open (the byte is in the associated data), so no
        edit of the row can make the rotation skip a response of the old format."""
        wanted = _not_stored_as("response_headers", sealed, key_id)
        if key_id is not None:
            wanted |= Q(sealed_format=bytes([old_format]))
        rows = (
            IdempotencyRecord.objects.using(self.using)
            .filter(pk__gt=after, state=COMPLETED)
            .exclude(response_headers__has_key=erased)
            .annotate(sealed_format=Substr("response_body", 1, 1, output_field=BinaryField()))
            .filter(wanted)
            .order_by("pk")
            .values_list(*_RECORD_COLUMNS)[:size]
        )
        return [
            RecordRow(pk, owner, key, token, status, dict(headers or {}), _bytes(body))
            for pk, owner, key, token, status, headers, body in rows
        ]

    def reseal_records(
        self, rows: Iterable[tuple[RecordRow, dict[str, Any], bytes | None]]
    ) -> int:
        """Write each row's new headers and body while it is completed under the token that was
        read; one transaction, one statement on PostgreSQL (an ``UPDATE ... FROM (VALUES ...)``),
        one prepared statement run per row elsewhere. Returns how many were written."""
        batch = [(row, json.dumps(headers), body) for row, headers, body in rows]
        if not batch:
            return 0
        return self._in_one_transaction(lambda: self._write_records(batch))

    def _write_records(self, batch: list[tuple[RecordRow, str, bytes | None]]) -> int:
        connection = connections[self.using]
        quote = connection.ops.quote_name
        table = quote(IdempotencyRecord._meta.db_table)
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                values = ", ".join(["(%s::bigint, %s::uuid, %s::jsonb, %s::bytea)"] * len(batch))
                params: list[Any] = []
                for row, headers, body in batch:
                    params += [row.id, row.token, headers, body]
                cursor.execute(
                    f"UPDATE {table} AS t SET response_headers = v.headers, "
                    f"response_body = v.body FROM (VALUES {values}) "
                    "AS v(id, token, headers, body) "
                    f"WHERE t.id = v.id AND t.token = v.token AND t.state = '{COMPLETED}'",
                    params,
                )
                return int(cursor.rowcount)
            written = 0
            sql = (
                f"UPDATE {table} SET response_headers = %s, response_body = %s "
                f"WHERE id = %s AND token = %s AND state = '{COMPLETED}'"
            )
            for row, headers, body in batch:
                cursor.execute(sql, [headers, body, row.id, row.token.hex])
                written += cursor.rowcount
            return written

    def last_record_id(self) -> int:
        last = IdempotencyRecord.objects.using(self.using).order_by("-pk").values_list("pk")[:1]
        return int(last[0][0]) if last else 0

    # -- erasure -----------------------------------------------------------------------------

    def records_of_owner(self, owner: str, after: int, size: int, *, erased: str) -> list[int]:
        """Up to ``size`` ids of ``owner``'s completed records after ``after``, not yet erased."""
        return list(
            IdempotencyRecord.objects.using(self.using)
            .filter(owner=owner, pk__gt=after, state=COMPLETED)
            .exclude(response_headers__has_key=erased)
            .order_by("pk")
            .values_list("pk", flat=True)[:size]
        )

    def erase_records(self, owner: str, ids: Sequence[int], tombstone: dict[str, Any]) -> int:
        """Replace the response, fingerprint and path of ``owner``'s completed records ``ids``
        with ``tombstone``, draw them a new token, and delete their flow runs; one transaction.
        Returns how many records were erased."""
        if not ids:
            return 0
        with transaction.atomic(using=self.using):
            erased = (
                IdempotencyRecord.objects.using(self.using)
                .filter(pk__in=ids, owner=owner, state=COMPLETED)
                .update(
                    response_headers=tombstone,
                    response_body=None,
                    fingerprint="",
                    path="",
                    token=uuid.uuid4(),
                )
            )
            FlowRun.objects.using(self.using).filter(record_id__in=ids).delete()
        return int(erased)

    def unfinished_of_owner(self, owner: str) -> int:
        """``owner``'s records still in progress (a request runs, or a phased one paused)."""
        return (
            IdempotencyRecord.objects.using(self.using)
            .filter(owner=owner)
            .exclude(state=COMPLETED)
            .count()
        )

    # -- flow runs ---------------------------------------------------------------------------

    def flow_runs_to_reseal(
        self, after: int, size: int, *, sealed: str, key_id: str | None
    ) -> list[FlowRunRow]:
        """Flow runs after ``after`` whose request or results are not sealed with ``key_id``
        (None: are sealed at all)."""
        rows = (
            FlowRun.objects.using(self.using)
            .filter(pk__gt=after)
            .filter(
                _not_stored_as("request", sealed, key_id)
                | _not_stored_as("results", sealed, key_id)
            )
            .order_by("pk")
            .values_list("pk", "record_id", "updated_at", "request", "results")[:size]
        )
        return [FlowRunRow(*row) for row in rows]

    def reseal_flow_runs(self, rows: Iterable[tuple[FlowRunRow, Any, Any]]) -> int:
        runs = FlowRun.objects.using(self.using)
        return self._in_one_transaction(
            lambda: sum(
                runs.filter(pk=row.id, updated_at=row.updated_at).update(
                    request=request, results=results
                )
                for row, request, results in rows
            )
        )

    def last_flow_run_id(self) -> int:
        last = FlowRun.objects.using(self.using).order_by("-pk").values_list("pk")[:1]
        return int(last[0][0]) if last else 0

    # -- outbox ------------------------------------------------------------------------------

    def outbox_to_reseal(
        self, after: int, size: int, *, sealed: str, key_id: str | None, plaintext_too: bool
    ) -> list[OutboxRow]:
        """Unsent messages after ``after`` sealed with another key than ``key_id`` (and, with
        ``plaintext_too``, those in plaintext); with ``key_id`` None, every sealed message, sent
        ones too (they are kept, and shown, until the purge)."""
        entries = OutboxEntry.objects.using(self.using).filter(pk__gt=after)
        other_key = _not_stored_as("payload", sealed, None)
        if key_id is not None:
            entries = entries.exclude(state=OutboxEntry.State.SENT)
            other_key &= ~Q(**{f"payload__{sealed}": key_id})
        wanted = _not_stored_as("payload", sealed, key_id) if plaintext_too else other_key
        rows = (
            entries.filter(wanted).order_by("pk").values_list("pk", "event_id", "payload")[:size]
        )
        return [OutboxRow(*row) for row in rows]

    def reseal_outbox(self, rows: Iterable[tuple[OutboxRow, Any]]) -> int:
        entries = OutboxEntry.objects.using(self.using)
        return self._in_one_transaction(
            lambda: sum(entries.filter(pk=row.id).update(payload=payload) for row, payload in rows)
        )

    def last_outbox_id(self) -> int:
        last = OutboxEntry.objects.using(self.using).order_by("-pk").values_list("pk")[:1]
        return int(last[0][0]) if last else 0

    def _in_one_transaction(self, write: Callable[[], int]) -> int:
        """``write()``'s count, in one transaction; 0 when another transaction undid it (a
        serialization failure at REPEATABLE READ, a deadlock, a lock wait that ran out): nothing
        of the batch was written, and the core reads its rows again."""
        try:
            with transaction.atomic(using=self.using):
                return write()
        except OperationalError as exc:
            if transaction_conflicted(connections[self.using], exc):
                return 0
            raise


def _not_stored_as(field: str, marker: str, key_id: str | None) -> Q:
    """Rows whose JSON ``field`` is not in the form a pass writes. ``key_id``: it does not name
    ``key_id`` under ``marker`` (in plaintext, or sealed with another key); None (a pass that
    writes plaintext): it has the marker."""
    if key_id is None:
        return Q(**{f"{field}__{marker}__isnull": False})
    return Q(**{f"{field}__{marker}__isnull": True}) | ~Q(**{f"{field}__{marker}": key_id})


def _bytes(value: bytes | memoryview | None) -> bytes | None:
    return None if value is None else bytes(value)
