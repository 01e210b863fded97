"""Data protection: what is encrypted at rest, and how keys are rotated and an owner erased.

It knows nothing of ``HttpRequest``: the HTTP core, the flows and the outbox call it with plain
values, and the commands and the admin call :func:`rotate_keys` and :func:`erase_owner`.

**What is sealed** (with the newest of ``ENCRYPTION_KEYS``, :mod:`.keys`), when keys are set:

* a completed record's response: its headers and body go, together, into ``response_body``,
  and ``response_headers`` keeps only the marker ``{"@sealed": "<key id>"}``; the seal
  (format 0x02, :mod:`.keys`) is bound to the record's owner, key and status, so a status
  changed in the database does not open (0x01, owner and key only, still opens until the
  rotation rewrites it);
* a flow run's ``request`` (method, path and query, host, body, principal) and ``results``,
  each as ``{"@sealed": "<key id>", "@data": "<base64>"}``;
* with ``OUTBOX_ENCRYPT``, an outbox message's ``payload``, in that same form.

Nothing that locates a row is sealed (the status is bound, not sealed): a record's owner,
key, fingerprint, method, path, status and times; an event id, a destination, an ordering
key. Claims, replays, the relay's order and every index work as they do without keys. With
no keys set, nothing here runs on a request: the same statements store the same bytes as
before.

A marker key starts with ``@``, which no header name can contain (``@not-replayable`` already
marks a response that was not stored), so a stored header is never taken for one.

**Erasure** (:func:`erase_owner`) replaces each completed record of an owner with a tombstone:
``response_headers = {"@erased": "<when>"}``, no body, no fingerprint, no path, a new token; its
flow run is deleted. The record keeps its owner, key and expiry, so a retry of the key is
answered ``410`` (``response-erased``) until the record expires, and the view never runs again.

**Rotation** (:func:`rotate_keys`) re-seals, with the newest key, every completed record, flow
run and unsent outbox message that is sealed with an older key (or not at all), and every
response sealed in format 0x01 (not bound to its status), in batches.

**Decrypt-only** (``ENCRYPTION_MODE = "decrypt-only"``): new values are stored in plaintext and
sealed ones still open with the listed keys; :func:`decrypt_stored` then writes every sealed
value in plaintext, with the rotation's batches and compare-and-swap writes, so the keys can go.

Why this module is long: the sealing, the opening, the rotation and the decryption are one
format read and written four ways; the rotation and the decryption share one batch loop over
the same tables, and splitting them from the format they rewrite would spread it over modules.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from django_idempotency.conf import DECRYPT_ONLY, SETTING_NAME, conf
from django_idempotency.exceptions import (
    IdempotencyError,
    ProblemError,
    ResponseErased,
    ResponseUndecryptable,
    log_text,
)
from django_idempotency.http.owner import display_owner
from django_idempotency.managers import _batch_size, _max_seconds
from django_idempotency.protection.keys import (
    V1,
    V2,
    Keyring,
    Undecryptable,
    keyring,
    open_sealed,
    sealing_keyring,
)
from django_idempotency.protection.store import (
    FlowRunRow,
    OutboxRow,
    ProtectionStore,
    RecordRow,
)

__all__ = [
    "DATA",
    "ERASED",
    "SEALED",
    "Erased",
    "ErasureResult",
    "RotationResult",
    "Undecryptable",
    "decrypt_stored",
    "erase_owner",
    "open_response",
    "open_value",
    "protected",
    "rotate_keys",
    "seal_response",
    "seal_value",
    "stored_key_id",
]

logger = logging.getLogger("django_idempotency")

SEALED = "@sealed"
"""The marker of a sealed value; its value is the key id."""
DATA = "@data"
"""Where a sealed JSON value keeps its ciphertext, in base64."""
ERASED = "@erased"
"""The marker of an erased record's headers; its value is when it was erased."""

_BODY = b"b"
_NO_BODY = b"-"
_COMPACT = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
"""Compact JSON, built once (``json.dumps`` with arguments builds an encoder per call)."""


class Erased(IdempotencyError):
    """The record was erased (:func:`erase_owner`): its response is gone for good."""


# --- Contexts: what each sealed value is bound to ------------------------------------------------


def _context(kind: bytes, *parts: str) -> bytes:
    """``kind`` and each part, length-prefixed, so no two different places give one context."""
    out = [kind]
    for part in parts:
        raw = part.encode("utf-8", "surrogatepass")
        out.append(len(raw).to_bytes(4, "big") + raw)
    return b"\0".join(out)


def record_context(owner: str, key: str) -> bytes:
    """The context of a response sealed in format 0x01: its owner and key, not its status."""
    return _context(b"django-idempotency/record", owner, key)


def record_contexts(owner: str, key: str, status: int | None) -> dict[int, bytes]:
    """The context of a stored response, by format: 0x02 (what is sealed now) names its status
    too; 0x01 (sealed before) does not, and still opens."""
    named = "" if status is None else str(status)
    return {
        V1: record_context(owner, key),
        V2: _context(b"django-idempotency/record", owner, key, named),
    }


def flow_context(record_id: int, field: str) -> bytes:
    return _context(b"django-idempotency/flow-run", str(record_id), field)


def outbox_context(event_id: str) -> bytes:
    return _context(b"django-idempotency/outbox", event_id)


# --- A record's response ------------------------------------------------------------------------


def protected(headers: dict[str, Any]) -> bool:
    """Whether stored ``headers`` are a marker (sealed or erased) rather than the headers."""
    return SEALED in headers or ERASED in headers


def seal_response(
    ring: Keyring,
    owner: str,
    key: str,
    headers: dict[str, str],
    body: bytes | None,
    *,
    status: int | None,
) -> tuple[dict[str, str], bytes]:
    """The ``response_headers`` and ``response_body`` that store a response sealed, bound to
    the record's owner, key and ``status`` (``response_status``)."""
    text = _COMPACT.encode(headers).encode("ascii")
    envelope = (_BODY if body is not None else _NO_BODY) + text + b"\n" + (body or b"")
    context = record_contexts(owner, key, status)[V2]
    return {SEALED: ring.newest_id}, ring.seal(envelope, context, version=V2)


def open_response(
    owner: str, key: str, headers: dict[str, Any], body: bytes | None, *, status: int | None
) -> tuple[dict[str, Any], bytes | None]:
    """The response a record stores: as it is, or opened when sealed (with the record's
    ``status``, which a response sealed in format 0x02 is bound to).

    Raises :class:`Erased` for an erased record and :class:`Undecryptable` for one that no
    configured key opens (or whose status or place was changed).
    """
    if ERASED in headers:
        raise Erased(f"the record was erased at {headers[ERASED]}")
    if SEALED not in headers:
        return headers, body
    if body is None:
        raise Undecryptable("the sealed response has no body", key_id=str(headers[SEALED]))
    envelope = open_sealed(keyring(), body, record_contexts(owner, key, status))
    end = envelope.index(b"\n")
    opened: dict[str, Any] = json.loads(envelope[1:end].decode("ascii"))
    return opened, envelope[end + 1 :] if envelope[:1] == _BODY else None


def stored_response(
    owner: str, key: str, headers: dict[str, str], body: bytes | None, *, status: int | None
) -> tuple[dict[str, str], bytes | None]:
    """A response as a record stores it: sealed when ``ENCRYPTION_KEYS`` is set (and
    ``ENCRYPTION_MODE`` is not ``"decrypt-only"``), as it is otherwise (the same values, so the
    same statement stores the same bytes as before)."""
    return response_as_stored(sealing_keyring(), owner, key, headers, body, status=status)


def response_as_stored(
    ring: Keyring | None,
    owner: str,
    key: str,
    headers: dict[str, Any],
    body: bytes | None,
    *,
    status: int | None,
) -> tuple[dict[str, Any], bytes | None]:
    """A response sealed with ``ring``'s newest key, or as it is when ``ring`` is None."""
    if ring is None:
        return headers, body
    return seal_response(ring, owner, key, headers, body, status=status)


def replay_problem(error: Erased | Undecryptable, status: int | None) -> ProblemError:
    """The problem that answers a retry of an erased or undecryptable record."""
    if isinstance(error, Erased):
        return ResponseErased(
            "The request with this idempotency key was already processed, and its stored "
            "response has since been erased. It will not run again with this key: look the "
            "result up instead, or send a new request with a new key."
        )
    return ResponseUndecryptable(
        "The request with this idempotency key was already processed, but its stored response "
        "cannot be decrypted, so it cannot be replayed. Do not retry it; look the result up "
        "instead.",
        original_status=status,
    )


def stored_key_id(value: Any) -> str | None:
    """The key id a stored value (a record's headers, a sealed JSON value) names, if sealed."""
    if isinstance(value, dict) and SEALED in value:
        return str(value[SEALED])
    return None


def erased_at(headers: Any) -> str | None:
    """When a record was erased, or None."""
    if isinstance(headers, dict) and ERASED in headers:
        return str(headers[ERASED])
    return None


# --- JSON values: flow runs and outbox payloads -------------------------------------------------


def is_sealed_value(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 2 and SEALED in value and DATA in value


def seal_value(ring: Keyring, value: Any, context: bytes) -> dict[str, str]:
    """A JSON value sealed, as a JSON object a ``JSONField`` stores."""
    text = _COMPACT.encode(value).encode("ascii")
    sealed = ring.seal(text, context)
    return {SEALED: ring.newest_id, DATA: base64.b64encode(sealed).decode("ascii")}


def open_value(value: Any, context: bytes) -> Any:
    """A stored JSON value: as it is, or opened when sealed; raises :class:`Undecryptable`."""
    if not is_sealed_value(value):
        return value
    try:
        sealed = base64.b64decode(value[DATA], validate=True)
    except (ValueError, TypeError):
        raise Undecryptable("the sealed value is not base64", key_id=str(value[SEALED])) from None
    return json.loads(open_sealed(keyring(), sealed, context))


def value_as_stored(ring: Keyring | None, value: Any, context: bytes) -> Any:
    """A JSON value sealed with ``ring``'s newest key, or as it is when ``ring`` is None."""
    return value if ring is None else seal_value(ring, value, context)


def seal_value_if_keys(value: Any, context: bytes) -> Any:
    """``value`` sealed when keys are set (and the mode is not decrypt-only); as it is
    otherwise."""
    return value_as_stored(sealing_keyring(), value, context)


def seal_outbox_payload(payload: Any, event_id: str) -> Any:
    """An outbox payload encrypted with the newest key (``OUTBOX_ENCRYPT``); the relay opens
    it just before it sends. As it is in decrypt-only mode, which seals nothing new (W053)."""
    if conf.ENCRYPTION_MODE == DECRYPT_ONLY:
        return payload
    ring = keyring()
    if ring is None:
        raise ImproperlyConfigured(
            f"{SETTING_NAME}['OUTBOX_ENCRYPT'] is True, but ENCRYPTION_KEYS is empty (check "
            "E051): set a key, or turn OUTBOX_ENCRYPT off."
        )
    return seal_value(ring, payload, outbox_context(event_id))


# --- Erasure ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ErasureResult:
    """What :func:`erase_owner` did."""

    owner: str
    records: int
    """Completed records turned into tombstones (their flow runs deleted)."""
    unfinished: int
    """The owner's records still in progress, left as they are: erase again once they end."""
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "owner": self.owner,
            "records": self.records,
            "unfinished": self.unfinished,
            "seconds": round(self.seconds, 3),
        }


def erase_owner(
    owner: str, *, using: str | None = None, batch_size: int | None = None
) -> ErasureResult:
    """Erase what the records of ``owner`` store (an erasure request), keeping tombstones.

    Each completed record of ``owner`` loses its response (headers and body), fingerprint and
    path, and its flow run (the phased request's body and results) is deleted. The record itself
    stays until it expires, marked erased, so that a retry of its key is answered ``410``
    (``response-erased``) and never runs the view again. Records still in progress are left and
    counted (:attr:`ErasureResult.unfinished`): run the erasure again once they have ended.

    ``owner`` is the owner scope as stored (``user:42`` for the user with pk 42, by default).
    Runs in batches of ``batch_size`` (default ``PURGE_BATCH_SIZE``), one short transaction each.
    Processed events and outbox messages hold no owner and are left as they are.
    """
    if not isinstance(owner, str) or not owner:
        raise ValueError(f"owner must be a non-empty string, not {owner!r}.")
    size = _batch_size(batch_size)
    store = ProtectionStore(using or conf.DATABASE)
    started = time.monotonic()
    tombstone = {ERASED: timezone.now().isoformat(timespec="seconds")}
    erased = 0
    after = 0
    while True:
        ids = store.records_of_owner(owner, after, size, erased=ERASED)
        if not ids:
            break
        erased += store.erase_records(owner, ids, tombstone)
        after = ids[-1]
    unfinished = store.unfinished_of_owner(owner)
    result = ErasureResult(owner, erased, unfinished, time.monotonic() - started)
    logger.info(
        "idempotency erased owner=%s records=%d unfinished=%d",
        log_text(display_owner(owner)),
        erased,
        unfinished,
        extra={"idempotency_outcome": "erased"},
    )
    return result


# --- Rotation -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RotationResult:
    """What :func:`rotate_keys` did to one table."""

    table: str
    resealed: int
    """Rows written again: sealed with the newest key (:func:`rotate_keys`), or in plaintext
    (:func:`decrypt_stored`)."""
    undecryptable: int
    """Rows that no configured key opens, left as they are (each logged at ERROR)."""
    batches: int
    seconds: float
    finished: bool
    """False when the time budget ran out first: run it again to go on."""
    changed: int = 0
    """Rows that a request changed between each read and write (:data:`REREADS`) and that are
    still not in the form written: left as they are, for the next run."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "resealed": self.resealed,
            "undecryptable": self.undecryptable,
            "changed": self.changed,
            "batches": self.batches,
            "seconds": round(self.seconds, 3),
            "finished": self.finished,
        }


REREADS = 2
"""How many times the rows of a batch whose compare-and-swap wrote nothing (a request changed
them after the read) are read again and written. A phase saved, paused or ended meanwhile
writes a flow run's results and ``updated_at``, never its request: skipped, the request would
stay in the old form while the run says it is done."""

Progress = Callable[[str, int, int, int], None]
"""``progress(table, last id done, last id of the table, rows written so far)``."""


class RotationError(IdempotencyError):
    """The rotation (or the decryption) cannot run: no keys are set, or the mode forbids it."""


def rotate_keys(
    *,
    using: str | None = None,
    batch_size: int | None = None,
    max_seconds: float | None = None,
    progress: Progress | None = None,
) -> list[RotationResult]:
    """Seal again, with the newest key, what is sealed with an older one or not at all.

    Completed records (those sealed in format 0x01 too, rewritten bound to their status), flow
    runs and unsent outbox messages (plaintext ones only with ``OUTBOX_ENCRYPT``) are read in
    id order, ``batch_size`` at a time (default
    ``PURGE_BATCH_SIZE``), and each batch is written in one short transaction with a
    compare-and-swap per row (:mod:`.store`): a row that a request changed meanwhile (taken
    over, erased, a phase saved) is not written over; it is read again and, still not under
    the newest key (a phase save rewrites a run's results, never its request), written again,
    up to :data:`REREADS` times (:attr:`RotationResult.changed` counts those left). A replay
    meanwhile reads the old value or the new one, and both open to the same bytes.

    Safe to stop at any point (a crash, a ``SIGKILL``, the time budget ``max_seconds``,
    default ``PURGE_MAX_SECONDS``, 0 for none): what is done stays done, and the next run finds
    what is left. A row that no configured key opens is left as it is and logged at ERROR.
    """
    ring = keyring()
    if ring is None:
        raise RotationError(
            "ENCRYPTION_KEYS is empty: there is no key to rotate to. Put the new key first in "
            "ENCRYPTION_KEYS, keep the old ones after it, and run the rotation again."
        )
    if conf.ENCRYPTION_MODE == DECRYPT_ONLY:
        raise RotationError(
            f"{SETTING_NAME}['ENCRYPTION_MODE'] is 'decrypt-only': the app stores new values "
            "in plaintext, so nothing is re-encrypted. To turn encryption off, run "
            "idempotency_rotate_keys --decrypt; to rotate, set ENCRYPTION_MODE back to "
            "'encrypt' (or remove it) and deploy first."
        )
    return _rewrite(ring, using, batch_size, max_seconds, progress, conf.OUTBOX_ENCRYPT)


def decrypt_stored(
    *,
    using: str | None = None,
    batch_size: int | None = None,
    max_seconds: float | None = None,
    progress: Progress | None = None,
) -> list[RotationResult]:
    """Write in plaintext every sealed value: completed records, flow runs, outbox messages.

    The way out of encryption at rest (docs/security.md, "Turning encryption off"): it runs
    only with ``ENCRYPTION_MODE = "decrypt-only"``, so that the app seals nothing again, and
    with the keys that sealed the values still listed. The same batches, compare-and-swap
    writes, time budget and resumption as :func:`rotate_keys`; a replay meanwhile reads the
    sealed value or the plaintext one, which are the same bytes. Outbox messages already sent
    are written in plaintext too (the admin shows them until the purge), and a row that no
    listed key opens is left as it is and logged at ERROR.
    """
    if conf.ENCRYPTION_MODE != DECRYPT_ONLY:
        raise RotationError(
            f"{SETTING_NAME}['ENCRYPTION_MODE'] is not 'decrypt-only': the app would seal new "
            "values again while they are decrypted. Set ENCRYPTION_MODE = 'decrypt-only' "
            "(keeping ENCRYPTION_KEYS), deploy every process, then run the decryption."
        )
    if keyring() is None:
        raise RotationError(
            "ENCRYPTION_KEYS is empty: no key opens the sealed values. Put back the keys that "
            "sealed them (ENCRYPTION_MODE stays 'decrypt-only') and run the decryption again."
        )
    return _rewrite(None, using, batch_size, max_seconds, progress, True)


def _rewrite(
    target: Keyring | None,
    using: str | None,
    batch_size: int | None,
    max_seconds: float | None,
    progress: Progress | None,
    plaintext_too: bool,
) -> list[RotationResult]:
    """Write each stored value again, sealed with ``target``'s newest key or, when ``target``
    is None, in plaintext: the batches of every table not yet in that form."""
    size = _batch_size(batch_size)
    budget = _max_seconds(max_seconds)
    store = ProtectionStore(using or conf.DATABASE)
    deadline = time.monotonic() + budget if budget else None
    wanted = None if target is None else target.newest_id

    def record(row: RecordRow) -> tuple[Any, ...] | None:
        try:
            headers, body = open_response(
                row.owner, row.key, row.headers, row.body, status=row.status
            )
        except Erased:  # erased after the batch was read: nothing left to seal
            return None
        return response_as_stored(target, row.owner, row.key, headers, body, status=row.status)

    def flow_run(row: FlowRunRow) -> tuple[Any, ...]:
        written = []
        for field, value in (("request", row.request), ("results", row.results)):
            context = flow_context(row.record_id, field)
            written.append(value_as_stored(target, open_value(value, context), context))
        return tuple(written)

    def message(row: OutboxRow) -> tuple[Any, ...]:
        context = outbox_context(row.event_id)
        return (value_as_stored(target, open_value(row.payload, context), context),)

    tables: list[tuple[str, str, Callable[[], int], Callable[[int], Sequence[Any]], Any, Any]] = [
        (
            "idempotency records",
            "record",
            store.last_record_id,
            lambda after: store.records_to_reseal(
                after, size, sealed=SEALED, erased=ERASED, key_id=wanted, old_format=V1
            ),
            record,
            store.reseal_records,
        ),
        (
            "flow runs",
            "flow run",
            store.last_flow_run_id,
            lambda after: store.flow_runs_to_reseal(after, size, sealed=SEALED, key_id=wanted),
            flow_run,
            store.reseal_flow_runs,
        ),
        (
            "outbox messages",
            "outbox message",
            store.last_outbox_id,
            lambda after: store.outbox_to_reseal(
                after, size, sealed=SEALED, key_id=wanted, plaintext_too=plaintext_too
            ),
            message,
            store.reseal_outbox,
        ),
    ]
    return [_rotate(*table, deadline=deadline, progress=progress) for table in tables]


def _rotate(
    table: str,
    kind: str,
    last_id: Callable[[], int],
    fetch: Callable[[int], Sequence[Any]],
    reseal: Callable[[Any], tuple[Any, ...] | None],
    write: Callable[[list[Any]], int],
    *,
    deadline: float | None,
    progress: Progress | None,
) -> RotationResult:
    """Rotate one table: batches of rows after the last id done, each opened, sealed again
    with the newest key (or left in plaintext) and written back (``write``, a compare-and-swap
    per row)."""
    started = time.monotonic()
    last = last_id()
    after = resealed = undecryptable = changed = batches = 0
    finished = False
    while not (deadline is not None and time.monotonic() >= deadline):
        rows = fetch(after)
        if not rows:
            finished = True
            break
        batch: Sequence[Any] = rows
        for reread in range(REREADS + 1):
            writes = []
            for row in batch:
                try:
                    sealed = reseal(row)
                except Undecryptable as error:
                    logger.error(
                        "idempotency undecryptable %s id=%s key_id=%s: %s",
                        kind,
                        row.id,
                        error.key_id,
                        log_text(error),
                        extra={"idempotency_outcome": "undecryptable"},
                    )
                    undecryptable += 1
                    continue
                if sealed is not None:
                    writes.append((row, *sealed))
            written = write(writes)
            resealed += written
            if written == len(writes):
                break
            # Changed after the read: those still not in the form written are read again.
            batch = _reread(fetch, {write[0].id for write in writes})
            if reread == REREADS:
                changed += len(batch)
        batches += 1
        after = rows[-1].id
        if progress is not None:
            progress(table, after, max(last, after), resealed)
    return RotationResult(
        table, resealed, undecryptable, batches, time.monotonic() - started, finished, changed
    )


def _reread(fetch: Callable[[int], Sequence[Any]], ids: set[int]) -> list[Any]:
    """The rows of ``ids`` that ``fetch`` still finds (still to be written), read again."""
    found: list[Any] = []
    after = min(ids) - 1
    while rows := fetch(after):
        found += [row for row in rows if row.id in ids]
        after = rows[-1].id
        if after >= max(ids):
            break
    return found
