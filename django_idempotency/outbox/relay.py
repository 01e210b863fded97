"""The outbox relay: sends committed outbox messages through their transport, then marks them sent.

One batch (:meth:`Relay.run_once`) takes three steps:

1. **Claim**, in a short transaction: select pending rows that are due, in id order, with
   ``FOR UPDATE SKIP LOCKED`` where the database has it (PostgreSQL, MariaDB 10.6+, MySQL 8), so
   relays running at once take different rows and never wait on each other. SQLite has no row
   locks: the claim opens with ``BEGIN IMMEDIATE``, which serialises relays on the file lock.
   Rows behind a message of their key that cannot go now (parked, backing off, leased) are left
   out by the query itself, so a long queue behind a blocked message never starves other keys.
   Then keep only rows that may go now (see *Ordering*), and lease them: ``locked_until`` moves
   ``lease`` seconds ahead and ``attempts`` goes up by one. The transaction commits.
2. **Send** the claimed messages through their transports, outside any transaction.
3. **Record**, in a second short transaction: acknowledged messages become ``sent`` (with
   ``expires_at = sent_at + OUTBOX_TTL``, for the purge); failed ones get ``available_at`` after
   an exponential backoff with jitter, and after ``OUTBOX_MAX_ATTEMPTS`` attempts they are
   ``parked``: never dropped, shown in the admin, sent again only when someone requeues them.

A relay that dies between 1 and 3 (a SIGKILL, a lost host) leaves its rows leased: once the
lease runs out another relay takes them and sends them again. Delivery is therefore *at least
once*; the consumer's processed events (:mod:`django_idempotency.events.core`) make the effect
once.

Ordering
--------
A message with an ordering key is claimed only when every unsent (pending or parked) message with
that key and a smaller id is in the same claim and goes through the same transport. So the first
unsent message of a key blocks the ones after it, whether it is leased by another relay, waiting
out a backoff, or parked; a batch may carry a run of one key's messages, which the transport sends
in order, stopping at the first failure. Several relays never send one key's messages out of
order, because a message is sent only after all earlier ones of its key were acknowledged.

"Earlier" is id order as the relay sees committed rows. Two transactions that write the same key
at the same time are ordered by the order in which they commit, as far as the relay can tell
(ids are taken at insert time, so a message with a smaller id that commits later is sent after
the other). Serialise such writers on the aggregate (``select_for_update`` on the order row)
when their order matters.

Waking up
---------
:meth:`Relay.serve` loops: a batch, and when there was nothing to send, a wait of
``poll_interval`` seconds. On PostgreSQL it also listens (``LISTEN``) on the outbox channel,
and the producer's ``NOTIFY`` (sent on commit) ends the wait at once; there, a batch that saw
everything due is followed by the wait too, since a commit made during it has notified (one
claim per wake-up, not two). A lost notification only costs one poll interval, and a lost
``LISTEN`` connection is opened again a few seconds later
(:class:`~django_idempotency.outbox.store.Listener`), so a database restart leaves no relay on
polling alone. The wait ends early, too, when a held message or a backoff is due before the
poll interval is over (:func:`~django_idempotency.outbox.schedule.next_due`).

Delayed messages
----------------
A message with a countdown or an eta (:func:`~django_idempotency.outbox.core.send`) has a due
time. One whose transport delivers late messages itself (Celery, which passes it on as the
task's eta) is sent at once; the others wait in the table (``available_at``), which the claim
already skips, holding back the later messages of their key only. A countdown counts from the
commit: the producer's ``on_commit`` hook starts it, or, when the producer died first, the relay
(:meth:`Relay.schedule`); until then no relay claims the message.

Database faults
---------------
A batch that fails on a database error closes the connection and is tried again after
``poll_interval``. A lost connection (an outage, a failover, a cut connection:
:func:`~django_idempotency.outages.connection_lost`) is logged as one WARNING that names the
cause when the outage begins and one line when the database answers again (with what was
retried); each failure's traceback goes to DEBUG. Any other database error (a missing table,
bad SQL, a violated constraint) is a bug, not an outage: ERROR with its traceback, at each
failed batch. A claim whose COMMIT went unanswered may have leased its rows without the relay
knowing: the next claim takes back the rows that still hold that claim's lease, so they are
sent at once instead of after the lease; a suspect among them keeps that lease (see
:meth:`Relay._claim`). A lost ``LISTEN`` connection is one WARNING, or an INFO when the
relay's own outage WARNING already says that the database is gone.

The SQL of each step (the claim's query and transaction, the writes that record outcomes, the
``LISTEN`` connection) is in :mod:`django_idempotency.outbox.store`; this module decides.

Why this module is long: the relay's one loop and its three steps, the ordering rule, the
suspects of lost leases and the database faults are one state machine around one lease, and
read best together; the SQL is already apart in the store.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta

from django.db import DatabaseError, connections
from django.utils import timezone

from django_idempotency import telemetry
from django_idempotency.conf import conf
from django_idempotency.exceptions import error_text, log_text
from django_idempotency.outages import connection_lost
from django_idempotency.outbox import schedule, store
from django_idempotency.outbox.transports import OutboxMessage, Transport, get_transport
from django_idempotency.protection.core import (
    Undecryptable,
    is_sealed_value,
    open_value,
    outbox_context,
)

__all__ = ["BatchResult", "Relay"]

logger = logging.getLogger(__name__)

WAIT_SLICE = 0.5
"""The longest a wait blocks without checking whether the relay was asked to stop."""

SCHEDULE_EVERY = 2.0
"""Seconds between two looks for messages whose countdown no producer started
(:meth:`Relay.schedule`)."""

OUTAGE_REMINDER = 300.0
"""Seconds between two WARNINGs of one database outage: one line when it begins, one when it
ends, and one every five minutes while it lasts (each failure and its traceback at DEBUG)."""


def _message(row: store.Claimed) -> OutboxMessage:
    """The message of a claimed row, its payload decrypted just before it is sent when it was
    written encrypted (``OUTBOX_ENCRYPT``). Undecryptable: one ERROR line names the row."""
    message = OutboxMessage.from_entry(row)
    if not is_sealed_value(row.payload):
        return message
    try:
        payload = open_value(row.payload, outbox_context(row.event_id))
    except Undecryptable as exc:
        logger.error(
            "idempotency undecryptable outbox message id=%s event_id=%s key_id=%s: %s",
            row.pk,
            log_text(row.event_id),
            exc.key_id,
            log_text(exc),
        )
        raise
    return replace(message, payload=payload)


@dataclass
class BatchResult:
    """What one or more batches did."""

    claimed: int = 0
    sent: int = 0
    failed: int = 0
    """Attempts that failed and will be retried (parked ones not included)."""
    parked: int = 0
    released: int = 0
    """Messages put back without an attempt counted: behind a failed message of their key."""
    batches: int = 0

    def add(self, other: BatchResult) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class _Outage:
    """A run of batches that failed on database errors: when it began, how many failed."""

    started: float
    taken_back: int
    """:attr:`Relay.taken_back` when it began."""
    reported: float
    """When it was last logged."""
    failures: int = 0


class Relay:
    """Sends the outbox of one database.

    :param using: the database alias; default the ``DATABASE`` setting.
    :param batch_size: the most messages claimed (and sent) per batch.
    :param lease: seconds a claim is held; a relay that has not recorded its batch by then is
        presumed dead, and others may send the messages again. Keep it above the longest send.
    :param backoff: seconds before the first retry; each further failure doubles it.
    :param max_backoff: the longest wait between two attempts.
    :param max_attempts: attempts before a message is parked; default ``OUTBOX_MAX_ATTEMPTS``.
    :param transports: transports by name, instead of those built from
        ``IDEMPOTENCY["OUTBOX_TRANSPORTS"]`` (for tests and embedding).
    """

    def __init__(
        self,
        *,
        using: str | None = None,
        batch_size: int = 500,
        lease: float = 60.0,
        backoff: float = 1.0,
        max_backoff: float = 300.0,
        max_attempts: int | None = None,
        transports: Mapping[str, Transport] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}.")
        if lease <= 0 or backoff <= 0 or max_backoff < backoff:
            raise ValueError("lease and backoff must be positive, and max_backoff >= backoff.")
        self.using = using if using is not None else conf.DATABASE
        self.batch_size = batch_size
        self.lease = timedelta(seconds=lease)
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_attempts = max_attempts if max_attempts is not None else conf.OUTBOX_MAX_ATTEMPTS
        # Read here, so a bad setting raises before a batch is sent (not when it is recorded).
        self.ttl = conf.OUTBOX_TTL
        self._transports = dict(transports) if transports is not None else None
        self._stopping = threading.Event()
        self.listener: store.Listener | None = None
        """The ``LISTEN`` connection while :meth:`serve` runs (PostgreSQL)."""
        self._left_behind = False
        """Whether the last claim left due rows for the next batch (it sent a suspect alone, or
        its candidates filled the batch, so more may be due behind them)."""
        self._unanswered: list[tuple[datetime, list[int]]] = []
        """Claims that failed at or after their lease (the connection cut at the COMMIT): the
        lease (the token that fences every write to a claimed row) and the rows. Whether the
        COMMIT took effect is unknown; the next claim takes back what is still leased under
        that token (see :meth:`_claim`)."""
        self.taken_back = 0
        """Messages taken back from unanswered claims since the relay started."""
        self._outage: _Outage | None = None
        self._next_schedule = 0.0
        """When :meth:`schedule` looks next (``time.monotonic()``)."""

    # --- One batch ----------------------------------------------------------------------------

    def run_once(self) -> BatchResult:
        """Claim, send and record one batch; returns what it did (all zeros when idle)."""
        self.schedule()
        result = BatchResult()
        claimed = self._claim(result)
        result.claimed = len(claimed)
        result.batches = 1 if claimed else 0
        if not claimed:
            return result
        with telemetry.relay_batch(len(claimed)):
            outcomes = self._send(claimed)
            self._record(claimed, outcomes, result)
        return result

    def drain(self, max_seconds: float | None = None) -> BatchResult:
        """Run batches until nothing is due (or ``max_seconds`` have passed, or :meth:`stop`)."""
        total = BatchResult()
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        while not self._stopping.is_set():
            result = self.run_once()
            total.add(result)
            if not self._more_due(result):
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
        return total

    def _more_due(self, result: BatchResult, listening: bool = False) -> bool:
        """Whether another batch may find something due at once.

        ``listening``: a ``LISTEN`` connection is open, so a message committed since the last
        claim has queued a notification, and the wait after this batch ends at once. Then only
        what this claim saw left behind (a full batch, rows held back for a suspect, rows it
        parked) calls for another batch; a batch that sent a few messages does not, since
        looking again would cost a claim (two statements and a commit) for every wake-up,
        while the commits that did happen meanwhile wake the relay anyway.
        """
        if result.parked or result.claimed >= self.batch_size:
            return True
        if result.claimed and self._left_behind:
            return True
        return bool(result.sent) and not listening

    def _claim(self, result: BatchResult | None = None) -> list[store.Claimed]:
        """Claim a batch: the rows chosen, leased until now + lease, their attempt counted.

        A claim whose transaction fails once its lease is written (the connection cut at the
        COMMIT, before its answer) may have committed: its rows would then stay leased, and
        unsent, until the lease runs out (60 s by default). The relay keeps such a claim's lease
        and rows (:attr:`_unanswered`), and the next claim first takes back, in its own
        transaction, those rows that still hold that exact lease: no other relay can hold it
        (a takeover writes its own), and this relay never sent them. They lose the uncounted
        attempt and are claimed again at once, as any due row. Not a suspect (a row whose last
        lease ran out without an outcome): its previous sender, stalled past its lease, may
        still deliver it and mark it sent, and the lease is what holds the other relays off it
        meanwhile. It keeps the lease, and is claimed again once the lease runs out.
        """
        connection = connections[self.using]
        now = timezone.now()
        until = now + self.lease
        self._left_behind = False
        chosen: list[store.Claimed] = []
        taken_back = 0
        # A lease that has run out is left to the ordinary claim (which takes such rows as any
        # other relay would): the list stays short however long the database keeps failing.
        self._unanswered = [(token, ids) for token, ids in self._unanswered if token > now]
        try:
            with store.claim_transaction(connection):
                for token, ids in self._unanswered:
                    taken_back += store.release(self.using, ids, token)
                candidates = store.candidates(self.using, now, self.batch_size)
                if candidates:
                    full = len(candidates) >= self.batch_size
                    candidates = self._park_lost(candidates, result)
                    chosen = self._choose(candidates)
                    self._left_behind = self._left_behind or full
                    if chosen:
                        store.lease(self.using, [row.pk for row in chosen], until)
        except DatabaseError:
            # The lease was written, or was being written: it may have committed. Only rows
            # that never lost a lease are taken back. A suspect (its last lease ran out with no
            # outcome) may still be on its way from its previous sender, a relay stalled past
            # its lease, whose sent mark always stands: the lease this claim wrote is what
            # holds other relays off it meanwhile, so it keeps it, and is claimed again, as a
            # suspect, once that lease runs out.
            fresh = [row.pk for row in chosen if row.locked_until is None]
            if fresh:
                self._unanswered.append((until, fresh))
            raise
        if self._unanswered:
            self._unanswered = []
            self.taken_back += taken_back
            if taken_back:  # INFO: the outage's closing WARNING counts them too
                logger.info(
                    "outbox relay: took back %d message(s) of a claim whose COMMIT went "
                    "unanswered; they are sent now instead of after the lease",
                    taken_back,
                )
        for row in chosen:
            row.attempts += 1
            row.locked_until = until
        return chosen

    def _park_lost(
        self, candidates: list[store.Claimed], result: BatchResult | None
    ) -> list[store.Claimed]:
        """Park the candidates whose every attempt ended in a lost lease; returns the others.

        A row whose lease ran out (``locked_until`` set and past: every recorded outcome clears
        it) was claimed by a relay that never recorded it: the relay died while sending (OOM, a
        segfault in a client library, ``os._exit``) or hung past the lease. Its ``attempts``
        went up at each claim, but parking used to happen only when an outcome was recorded,
        so a message that kills the relay was sent for ever. Here it is parked once its
        attempts are used up, as a recorded failure would be.
        """
        kept: list[store.Claimed] = []
        for row in candidates:
            if row.locked_until is None or row.attempts < self.max_attempts:
                kept.append(row)
                continue
            text = (
                f"The relay's lease ran out {row.attempts} times without an outcome: a relay "
                "died or hung while sending this message (out of memory, a crash in the "
                "transport, a send that never returns)."
            )
            store.park(self.using, row.pk, row.locked_until, text)
            if result is not None:
                result.parked += 1
            logger.error(
                "OUTBOX MESSAGE PARKED after %d attempts with no outcome (the relay died or "
                "hung while sending it): event %s to %s (%s). Its ordering key waits until it is "
                "requeued in the admin.",
                row.attempts,
                log_text(row.event_id),
                log_text(row.destination),
                log_text(row.transport),
            )
        return kept

    def _choose(self, candidates: list[store.Claimed]) -> list[store.Claimed]:
        """The batch: a suspect alone, or rows that never lost a lease.

        A suspect is a row whose last lease ran out without an outcome: it may be the message
        that killed the relay. Sent alone, it can only take down batches of its own, so its
        healthy batch-mates on other keys are not sent again at each death (only once, with the
        batch in which it first killed the relay), and it holds back only its own key.
        """
        allowed = self._in_order(candidates)
        batch: list[store.Claimed] = []
        held: set[str] = set()  # keys with a suspect that waits for a batch of its own
        seen: set[str] = set()
        for row in allowed:
            key = row.ordering_key
            if row.locked_until is not None:
                if key is None or key not in seen:  # nothing of its key goes before it
                    batch = [row]
                    break
                held.add(key)
            elif key is None or key not in held:
                batch.append(row)
            if key is not None:
                seen.add(key)
        self._left_behind = len(batch) < len(allowed)
        return batch

    def _in_order(self, candidates: list[store.Claimed]) -> list[store.Claimed]:
        """The candidates that may go now without overtaking an unsent message of their key."""
        by_id = {row.pk: row for row in candidates}
        keys = {row.ordering_key for row in candidates if row.ordering_key is not None}
        allowed: set[int] = set()
        if keys:
            unsent = store.unsent_of_keys(self.using, keys, max(by_id))
            blocked: set[str] = set()
            transport_of: dict[str, str] = {}
            for pk, key in unsent:
                if key in blocked:
                    continue
                row = by_id.get(pk)
                if row is None or transport_of.setdefault(key, row.transport) != row.transport:
                    blocked.add(key)  # an earlier message of the key is not in this claim
                else:
                    allowed.add(pk)
        return [row for row in candidates if row.ordering_key is None or row.pk in allowed]

    def _send(self, rows: list[store.Claimed]) -> list[BaseException | None]:
        outcomes: list[BaseException | None] = [None] * len(rows)
        groups: dict[str, list[int]] = {}
        for index, row in enumerate(rows):
            groups.setdefault(row.transport, []).append(index)
        for name, grouped in groups.items():
            indexes, messages = [], []
            for index in grouped:
                try:
                    messages.append(_message(rows[index]))
                    indexes.append(index)
                except Undecryptable as exc:  # fails (and holds back its key), never leaves
                    outcomes[index] = exc
            if not messages:
                continue
            try:
                transport = self._transport(name)
                results = transport.send(messages)
                if not isinstance(results, Sequence) or isinstance(results, (str, bytes)):
                    raise TypeError(
                        f"transport {name!r} returned {results!r:.100}, not a list of "
                        f"{len(messages)} results (None or an exception per message)"
                    )
                if len(results) != len(messages):
                    raise RuntimeError(
                        f"transport {name!r} returned {len(results)} results for "
                        f"{len(messages)} messages"
                    )
            except Exception as exc:
                logger.exception("outbox transport %r failed on a batch", name)
                results = [exc] * len(messages)
            for index, outcome in zip(indexes, results, strict=True):
                if outcome is not None and not isinstance(outcome, BaseException):
                    outcome = TypeError(
                        f"transport {name!r} returned {outcome!r:.100} for event "
                        f"{rows[index].event_id}, not None (sent) or an exception"
                    )
                outcomes[index] = outcome
        return outcomes

    def _transport(self, name: str) -> Transport:
        if self._transports is not None:
            if name not in self._transports:
                raise LookupError(f"this relay has no transport named {name!r}")
            transport = self._transports[name]
        else:
            transport = get_transport(name)
        # A transport that can bound its broker calls keeps each batch within the lease, so a
        # silent broker fails the batch before another relay takes it over (and no SIGTERM waits
        # on a socket for ever). Calling it again with the same lease changes nothing.
        limit = getattr(transport, "limit_to_lease", None)
        if callable(limit):
            limit(self.lease.total_seconds())
        return transport

    def _record(
        self,
        rows: list[store.Claimed],
        outcomes: Sequence[BaseException | None],
        result: BatchResult,
    ) -> None:
        now = timezone.now()
        sent: list[int] = []
        released: list[int] = []
        failures: list[tuple[store.Claimed, BaseException]] = []
        failed_keys: set[str] = set()
        for row, outcome in zip(rows, outcomes, strict=True):
            if row.ordering_key is not None and row.ordering_key in failed_keys:
                released.append(row.pk)  # behind a failure: never sent ahead of it
            elif outcome is None:
                sent.append(row.pk)
            else:
                failures.append((row, outcome))
                if row.ordering_key is not None:
                    failed_keys.add(row.ordering_key)
        telemetry.outbox_sends(rows, outcomes, self.max_attempts, set(released))
        with store.record_transaction(self.using):
            if sent:
                store.mark_sent(self.using, sent, now, now + self.ttl)
            # A failure is recorded only while the lease is still this relay's: after a takeover
            # the row belongs to the other relay (a sent mark always stands: the broker has it).
            lease = rows[0].locked_until
            if released:
                store.release(self.using, released, lease)
            for row, error in failures:
                # Escaped so that every database stores it: left in, a NUL or a lone
                # surrogate failed this transaction, and with it the batch's sent marks.
                text = error_text(error)
                if row.attempts >= self.max_attempts:
                    store.park(self.using, row.pk, lease, text)
                    result.parked += 1
                    logger.error(
                        "OUTBOX MESSAGE PARKED after %d attempts: event %s to %s (%s). Its "
                        "ordering key waits until it is requeued in the admin. Last error: %s",
                        row.attempts,
                        log_text(row.event_id),
                        log_text(row.destination),
                        log_text(row.transport),
                        text,
                    )
                else:
                    available_at = now + timedelta(seconds=self._delay(row.attempts))
                    store.retry_later(self.using, row.pk, lease, available_at, text)
                    result.failed += 1
                    logger.warning(
                        "outbox message not sent (attempt %d of %d), retried later: event %s "
                        "to %s: %s",
                        row.attempts,
                        self.max_attempts,
                        log_text(row.event_id),
                        log_text(row.destination),
                        text,
                    )
        result.sent += len(sent)
        result.released += len(released)

    def _delay(self, attempts: int) -> float:
        """Exponential backoff with jitter: between half and all of backoff * 2**(attempts-1)."""
        ceiling = min(self.max_backoff, self.backoff * 2 ** min(attempts - 1, 30))
        return float(ceiling * (0.5 + random.random() / 2))

    # --- Delayed messages -----------------------------------------------------------------------

    def schedule(self, force: bool = False) -> int:
        """Start the countdowns that no producer started, at most every :data:`SCHEDULE_EVERY`
        seconds (``force``: now); returns how many.

        A message's countdown counts from its commit, and the producer's ``on_commit`` hook
        starts it (:mod:`~django_idempotency.outbox.schedule`). A producer that died between
        its COMMIT and that hook left it unstarted, and no relay claims such a message: here it
        starts from now, which is after the commit (the message is committed, since this relay
        sees it), so it is never sent early, only late by as long as the hook was missing.
        """
        if connections[self.using].in_atomic_block:
            # Inside a caller's transaction this connection also sees that transaction's own
            # uncommitted messages, whose producer hook has not run yet: it cannot tell them
            # from a dead producer's, so it starts none (the next run outside does).
            return 0
        now = time.monotonic()
        if not force and now < self._next_schedule:
            return 0
        self._next_schedule = now + SCHEDULE_EVERY
        started = 0
        for row in schedule.unscheduled(self.using, self.batch_size):
            try:
                late = bool(getattr(self._transport(row.transport), "delayed_delivery", False))
            except Exception:  # noqa: BLE001 - an unknown transport: its send fails with why
                late = False
            due = timezone.now() + timedelta(seconds=row.countdown)
            started += schedule.set_due(self.using, row.pk, due, hold=not late)
        if started:
            logger.info(
                "outbox relay: started the countdown of %d message(s) whose producer did not "
                "(it died after its COMMIT?): they are due that long from now",
                started,
            )
        return started

    def _pause(self, poll_interval: float) -> float:
        """How long to wait for a notification before the next batch: the poll interval, or
        less when a held message (or a backoff) is due sooner."""
        now = timezone.now()
        due = schedule.next_due(self.using, now)
        if due is None:
            return poll_interval
        return min(poll_interval, max(0.0, (due - now).total_seconds()))

    # --- The long-running loop ------------------------------------------------------------------

    def serve(
        self,
        poll_interval: float = 1.0,
        *,
        on_batch: Callable[[BatchResult], None] | None = None,
    ) -> BatchResult:
        """Send until :meth:`stop` is called; returns the totals.

        After a batch that sent something it goes on at once; when nothing was due it waits
        ``poll_interval`` seconds, or until a ``NOTIFY`` on PostgreSQL. While it listens, a batch
        that saw everything due (fewer candidates than ``batch_size``) is followed by the wait
        too: a commit made meanwhile has notified, and ends it at once. After a database error
        the connection is closed and the loop goes on after a wait; an outage is logged once
        when it begins and once when it ends (module docstring, *Database faults*).
        """
        total = BatchResult()
        telemetry.observe(self.using)  # the backlog gauges, reported by the relay alone
        listener = store.Listener.open(self.using) if conf.OUTBOX_NOTIFY else None
        self.listener = listener
        try:
            while not self._stopping.is_set():
                if listener is not None:
                    # Before every batch, not only when idle: unread, the notifications of a
                    # backlog's producer commits fill the socket, the listening backend stops
                    # reading PostgreSQL's notification queue, and once that queue is full
                    # every COMMIT that writes to the outbox fails. Before the claim, never
                    # after it: what this reads, the claim below sees; a notification read
                    # after the claim would be a commit it missed, and the wait below would
                    # sleep through it.
                    listener.drain()
                try:
                    result = self.run_once()
                    more = self._more_due(result, listener is not None and listener.listening)
                    pause = 0.0 if more else self._pause(poll_interval)
                except DatabaseError as error:
                    connection = connections[self.using]
                    lost = connection_lost(connection, error)
                    if listener is not None:  # reported by the outage's WARNING, if it is one
                        listener.report_loss(outage=lost)
                    if lost:
                        self._failed(error, poll_interval)
                    else:
                        self._broken(error, poll_interval)
                    connection.close()
                    self._wait(None, poll_interval)
                    continue
                if listener is not None:
                    listener.report_loss(outage=False)
                if self._outage is not None:
                    self._recovered(result)
                total.add(result)
                if on_batch is not None and result.claimed:
                    on_batch(result)
                if more:
                    continue
                self._wait(listener, pause)
        finally:
            self.listener = None
            if listener is not None:
                listener.close()
        return total

    def _failed(self, error: DatabaseError, poll_interval: float) -> None:
        """Log a batch that failed on a database error: one WARNING per outage, naming the
        cause; the traceback and each further failure at DEBUG."""
        now = time.monotonic()
        if self._outage is None:
            self._outage = _Outage(now, self.taken_back, reported=now)
            logger.warning(
                "outbox relay: database %r failed (%s); retrying every %.1f s until it answers",
                self.using,
                store.cause(error),
                poll_interval,
            )
        elif now - self._outage.reported >= OUTAGE_REMINDER:
            self._outage.reported = now
            logger.warning(
                "outbox relay: database %r still failing after %.0f s and %d failed batches (%s)",
                self.using,
                now - self._outage.started,
                self._outage.failures,
                store.cause(error),
            )
        self._outage.failures += 1
        logger.debug(
            "outbox relay: database error (failure %d of this outage)",
            self._outage.failures,
            exc_info=True,
        )

    def _broken(self, error: DatabaseError, poll_interval: float) -> None:
        """Log a batch that failed on a database error of a live connection (a missing table,
        bad SQL, a violated constraint, a deadlock): a bug or a schema that does not match, not
        an outage, so at ERROR with its traceback, at each failed batch."""
        logger.error(
            "outbox relay: a batch failed on database %r with an error that is not a lost "
            "connection (%s); retrying in %.1f s",
            self.using,
            store.cause(error),
            poll_interval,
            exc_info=error,
        )

    def _recovered(self, result: BatchResult) -> None:
        """Log the end of an outage, once: how long, and what was retried."""
        outage, self._outage = self._outage, None
        assert outage is not None
        logger.warning(
            "outbox relay: database %r answers again after %.1f s; %d failed batch(es) retried, "
            "%d message(s) of unanswered claims taken back, %d claimed now",
            self.using,
            time.monotonic() - outage.started,
            outage.failures,
            self.taken_back - outage.taken_back,
            result.claimed,
        )

    def stop(self) -> None:
        """Ask :meth:`serve` or :meth:`drain` to return after the current batch."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _wait(self, listener: store.Listener | None, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if listener is None:
                self._stopping.wait(min(left, WAIT_SLICE))
            elif listener.wait(min(left, WAIT_SLICE)):
                return
