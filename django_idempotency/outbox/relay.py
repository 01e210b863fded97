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
polling alone.

The SQL of each step (the claim's query and transaction, the writes that record outcomes, the
``LISTEN`` connection) is in :mod:`django_idempotency.outbox.store`; this module decides.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta

from django.db import DatabaseError, connections
from django.utils import timezone

from django_idempotency import telemetry
from django_idempotency.conf import conf
from django_idempotency.exceptions import error_text, log_text
from django_idempotency.outbox import store
from django_idempotency.outbox.transports import OutboxMessage, Transport, get_transport

__all__ = ["BatchResult", "Relay"]

logger = logging.getLogger(__name__)

WAIT_SLICE = 0.5
"""The longest a wait blocks without checking whether the relay was asked to stop."""


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

    # --- One batch ----------------------------------------------------------------------------

    def run_once(self) -> BatchResult:
        """Claim, send and record one batch; returns what it did (all zeros when idle)."""
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
        connection = connections[self.using]
        now = timezone.now()
        self._left_behind = False
        with store.claim_transaction(connection):
            candidates = store.candidates(self.using, now, self.batch_size)
            if not candidates:
                return []
            full = len(candidates) >= self.batch_size
            candidates = self._park_lost(candidates, result)
            chosen = self._choose(candidates)
            self._left_behind = self._left_behind or full
            if chosen:
                store.lease(self.using, [row.pk for row in chosen], now + self.lease)
        for row in chosen:
            row.attempts += 1
            row.locked_until = now + self.lease
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
        for name, indexes in groups.items():
            messages = [OutboxMessage.from_entry(rows[index]) for index in indexes]
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
        telemetry.outbox_sends(rows, outcomes, self.max_attempts)
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
        too: a commit made meanwhile has notified, and ends it at once. A database error is
        logged, the connection closed, and the loop goes on after a wait.
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
                except DatabaseError:
                    logger.exception("outbox relay: database error; retrying after a pause")
                    connections[self.using].close()
                    self._wait(None, poll_interval)
                    continue
                total.add(result)
                if on_batch is not None and result.claimed:
                    on_batch(result)
                if self._more_due(result, listener is not None and listener.listening):
                    continue
                self._wait(listener, poll_interval)
        finally:
            self.listener = None
            if listener is not None:
                listener.close()
        return total

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
