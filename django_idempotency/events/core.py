"""Idempotent message consumers: an event's effect applies once per consumer.

Brokers deliver at least once. A consumer makes that *effectively once* by writing a
:class:`~django_idempotency.models.ProcessedEvent` row for ``(consumer, event_id)`` **in the same
transaction** as the event's business effect. The unique constraint on that pair does the rest:
the first transaction to insert the row applies the effect; every later delivery finds the row and
skips the body; a delivery whose transaction rolls back leaves no row behind, so the next delivery
runs again.

This module is the one core that decides: reserve, count, park. How each of those reads and
writes its rows, per backend, is :mod:`django_idempotency.events.store`'s. It offers:

* :func:`try_reserve`, the primitive: one insert that does nothing on conflict, inside the
  caller's ``transaction.atomic``;
* :func:`count_delivery`, the delivery counter committed apart (see below);
* :func:`process_event`, which counts the delivery, opens the transaction, reserves the event and
  runs a body only the first time. :func:`~django_idempotency.events.consumers.idempotent_consumer`
  (for plain loops) and :class:`django_idempotency.events.celery.IdempotentConsumer` are thin
  adapters
  over it;
* :func:`park_message`, which parks a message that carries no usable event id where the admin
  shows it.

What an event id is and where a message carries it lives in :mod:`django_idempotency.events.ids`
(:func:`new_event_id` too); both are re-exported here.

Poison messages
---------------
A message that kills its worker (a segfault, the OOM killer, ``SIGKILL``) never reaches the end of
its transaction, so nothing in the business transaction can remember that it was tried. Each
delivery is therefore counted in an :class:`~django_idempotency.models.EventDelivery` row that is
committed **apart** from the business transaction: :func:`count_delivery` runs in its own
``transaction.atomic`` *before* the business transaction opens, and commits at once. (Two
transactions cannot be nested on one connection and still commit separately, so the count has to
come first.) When an event has been delivered more than ``MAX_DELIVERIES`` times without being
processed, it is parked: ``parked_at`` is set, :class:`~django_idempotency.exceptions.EventParked`
is raised, and the adapter rejects the message without requeueing it.

The count is one statement that also reads the processed event: it counts the delivery only
``WHERE NOT EXISTS`` a :class:`~django_idempotency.models.ProcessedEvent` row, so a duplicate of a
processed event writes nothing and is answered there (duplicates are not counted). A first
delivery still commits twice, the count and then the business transaction, and each commit waits
on its WAL flush. On PostgreSQL with psycopg 3 the count needs no round trip of its own: it
commits in the same query that opens the business transaction with the reservation
(:func:`~django_idempotency.events.store.count_and_reserve`); elsewhere it is a statement of its
own, and a duplicate opens no transaction. ``IDEMPOTENCY["ASYNC_DELIVERY_COUNT"]`` (PostgreSQL,
off by default) lets the count's own statement commit without waiting on its flush: it stays
visible at once and survives the worker's death, and the business transaction's synchronous
commit flushes it along; only a crash of the database server in between can lose that one
increment, which delays parking by one delivery (docs/consumers.md, "What a delivery costs").

When the consumer is itself called inside an outer ``transaction.atomic`` on the same database
(eager Celery tasks inside a request or a test, a loop that batches messages in one transaction),
the count joins that outer transaction and is only as durable as it is. A worker calls its tasks
outside any transaction, so there the count always commits on its own.

Why this module is long: every decision about one delivery (count, reserve, run, park, the
signals) reads in order, top to bottom, as the delivery goes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, Generic, NamedTuple, NoReturn, TypeVar

from django.db import DatabaseError, connections, transaction
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from django_idempotency import signals, telemetry
from django_idempotency.conf import conf
from django_idempotency.events import store as event_store
from django_idempotency.events.ids import (
    EVENT_ID_KEY,
    MAX_ID_LENGTH,
    EventId,
    checked_name,
    find_event_id,
    new_event_id,
    normalize_event_id,
)
from django_idempotency.events.store import PARKED, PROCESSED, RESERVED, Delivery
from django_idempotency.exceptions import EventParked, MissingEventId, OnCommitFailed, log_text
from django_idempotency.outages import Outage, connection_lost
from django_idempotency.pg_roundtrips import apart_may_travel

__all__ = [
    "EVENT_ID_KEY",
    "MAX_ID_LENGTH",
    "Delivery",
    "EventId",
    "Processed",
    "count_delivery",
    "find_event_id",
    "new_event_id",
    "normalize_event_id",
    "park_message",
    "process_event",
    "process_first_deliveries",
    "try_reserve",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


# --- Validation ---------------------------------------------------------------------------------


def _checked_topic(topic: object) -> str:
    return "" if topic is None else checked_name("topic", topic, allow_empty=True)


def _ttl(ttl: timedelta | float | None) -> timedelta:
    if ttl is None:
        return conf.EVENT_TTL
    if isinstance(ttl, bool) or not isinstance(ttl, (timedelta, int, float)):
        raise TypeError(f"ttl must be a timedelta or a number of seconds, not {ttl!r}.")
    duration = ttl if isinstance(ttl, timedelta) else timedelta(seconds=ttl)
    if duration <= timedelta(0):
        raise ValueError(f"ttl must be longer than zero, not {duration}.")
    return duration


def _alias(using: str | None) -> str:
    return using if using is not None else conf.DATABASE


OUTAGE = Outage("django_idempotency consumers", logger)
"""This process's outages of the consumers' database: one WARNING line when one starts, its
other errors at DEBUG, one line when a delivery succeeds again (issue 35: a 5-second outage
under load logged 320 warnings and 1,280 tracebacks)."""


def note_outage(
    using: str | None, exc: BaseException, tally: str, message: str, *args: Any
) -> bool:
    """If ``exc`` says that the database of ``using`` cannot be reached, note it in
    :data:`OUTAGE` (``tally`` names what it cost, ``message % args`` is its DEBUG line) and
    return True; else return False, and the caller logs the error as it always did."""
    if not connection_lost(connections[_alias(using)], exc):
        return False
    OUTAGE.failed(exc, tally, message, *args)
    return True


# --- The reservation ----------------------------------------------------------------------------


@telemetry.traced("idempotency.reserve")
def try_reserve(
    event_id: EventId,
    consumer: str,
    *,
    topic: str | None = None,
    ttl: timedelta | float | None = None,
    using: str | None = None,
    occurred_at: datetime | None = None,
) -> bool:
    """Reserve ``event_id`` for ``consumer`` in the current transaction.

    Returns True if this call inserted the :class:`~django_idempotency.models.ProcessedEvent` row,
    so the caller should apply the event's effect, and False if the row was already there, so the
    event was processed before and the caller should skip it.

    It must run inside ``transaction.atomic(using=...)`` on the database that holds the business
    data, together with the effect: the row commits or rolls back with it. When two transactions
    race on one id, the second waits for the first to finish, then returns False if the first
    committed and True if it rolled back.

    Retryable errors (a lock wait timeout, a deadlock, a serialization failure) and every other
    database error propagate; they never read as "already processed".

    :param event_id: the event's id, a ``str`` or a :class:`uuid.UUID`; 1 to 255 characters.
    :param consumer: the consumer's stable name; each consumer processes an event once.
    :param topic: optional, informational (shown in the admin).
    :param ttl: how long the row is kept (a ``timedelta`` or seconds); default ``EVENT_TTL``. It
        must outlast the longest time a duplicate can still arrive.
    :param using: the database alias; default the ``DATABASE`` setting.
    :param occurred_at: only for the partitioned PostgreSQL layout
        (``IDEMPOTENCY["EVENT_PARTITIONS"]``): the event's own time, read from the message, for
        an id that is not a UUIDv7. Never the time of processing.
    :raises ValueError: the event id or consumer is empty or longer than 255 characters.
    :raises TransactionManagementError: called outside ``transaction.atomic`` on that database.
    """
    event = normalize_event_id(event_id)
    name = checked_name("consumer name", consumer)
    topic_value = _checked_topic(topic)
    duration = _ttl(ttl)
    alias = _alias(using)
    connection = connections[alias]
    if not connection.in_atomic_block:
        raise TransactionManagementError(
            f"try_reserve() must run inside transaction.atomic(using={alias!r}), in the same "
            "transaction as the event's effect. Outside one, the reservation would commit on "
            "its own and a crash before the effect would lose the event."
        )
    now = timezone.now()
    state = event_store.reserve(
        connection, name, event, topic_value, now, now + duration, occurred_at=occurred_at
    )
    return state == RESERVED


@telemetry.traced("idempotency.reserve")
def _reserve_first_delivery(event: str, name: str, topic: str, ttl: Any, alias: str) -> str:
    """Reserve a delivery the broker vouches was never made before (``redelivered=False``).

    Its count was skipped, so the reservation reads what the count would have: a parked event
    is refused (PARKED: the caller rolls the reservation back), and an error an earlier failed
    delivery left on the counter is cleared with this delivery's success. The counter is read
    after the insert, which waits for any delivery that holds the event, so it sees the error
    a failed delivery recorded while holding it (:func:`_fail_first_delivery`); see
    :func:`~django_idempotency.events.store.reserve`. Under ``REPEATABLE READ`` or
    ``SERIALIZABLE`` a counter that such a delivery committed after this transaction's
    snapshot raises a serialization failure on PostgreSQL (the read would not see it); the
    failure counts this delivery, which is then refused if the event is parked.
    """
    now = timezone.now()
    return event_store.reserve(
        connections[alias], name, event, topic, now, now + _ttl(ttl), first_delivery=True
    )


# --- Counting deliveries (poison messages) ------------------------------------------------------


def count_delivery(
    event_id: EventId,
    consumer: str,
    *,
    topic: str | None = None,
    ttl: timedelta | float | None = None,
    using: str | None = None,
) -> Delivery:
    """Count one delivery of an event, in a transaction of its own that commits at once.

    Call it before the business transaction opens: the count must survive a process that dies
    inside the business transaction. Inside an outer ``atomic`` block it joins that block (see the
    module notes). One upsert (plus one ``SELECT`` on MySQL/MariaDB). On PostgreSQL and SQLite,
    outside a transaction, the upsert runs in autocommit: one statement that commits itself, as
    durable as a transaction of its own and without its ``BEGIN`` and ``COMMIT`` round trips.
    """
    event = normalize_event_id(event_id)
    name = checked_name("consumer name", consumer)
    topic_value = _checked_topic(topic)
    connection = connections[_alias(using)]
    values = event_store.delivery_values(name, event, topic_value, _ttl(ttl))
    counted = event_store.count(connection, values)
    assert counted is not None  # without a guard, every delivery is counted
    return Delivery(name, event, topic_value, *counted)


def _count_unless_processed(
    event: str,
    name: str,
    topic: str,
    ttl: timedelta | float | None,
    alias: str,
    *,
    redelivered: bool = False,
) -> Delivery | None:
    """Count the delivery unless the event is processed already; None if it is.

    One statement on PostgreSQL and SQLite: the upsert's row is selected only ``WHERE NOT
    EXISTS`` a processed-event row, so a duplicate writes nothing, waits on no WAL flush and
    returns no row. On PostgreSQL (default layout) the statement is a call of
    ``django_idempotency_count_v1`` (migration ``0006_event_functions``), planned once per server
    session. On MySQL/MariaDB a plain ``SELECT`` comes first. With ``ASYNC_DELIVERY_COUNT``
    (PostgreSQL, outside a transaction) the count commits without waiting on its WAL flush; see
    :data:`~django_idempotency.events.store.ASYNC_COMMIT`.

    ``redelivered``: the broker says the event was delivered before, so a counter that is not
    there yet starts at 2: the earlier delivery was a first one, which skips its count.
    """
    connection = connections[alias]
    guard: dict[str, Any] = {"consumer": name, "event_id": event}
    deliveries = 2 if redelivered else 1
    asynchronous = conf.ASYNC_DELIVERY_COUNT
    duration = _ttl(ttl)
    layout = event_store.sql_layout(connection, event)
    if layout is None:
        counted = event_store.call_count(
            connection, name, event, topic, duration, deliveries, asynchronous
        )
        return None if counted is None else Delivery(name, event, topic, *counted)
    # The partitioned layout keys a processed event by its partition column too; the guard asks
    # what try_reserve's conflict target would find (and prunes to one partition).
    guard.update(zip(layout.columns, layout.values, strict=True))
    values = event_store.delivery_values(name, event, topic, duration, deliveries)
    counted = event_store.count(connection, values, guard=guard, asynchronous=asynchronous)
    return None if counted is None else Delivery(name, event, topic, *counted)


def _count_travels(event: str, alias: str) -> bool:
    """Whether the count can travel with the reservation
    (:func:`~django_idempotency.events.store.count_and_reserve`): on
    PostgreSQL with psycopg 3 (default layout), outside any transaction."""
    connection = connections[alias]
    return event_store.sql_layout(connection, event) is None and apart_may_travel(connection)


# --- Processing one event -----------------------------------------------------------------------


class Processed(NamedTuple, Generic[T]):
    """What :func:`process_event` did."""

    applied: bool
    """True if the body ran and its transaction committed; False for a duplicate."""
    result: T | None
    """The body's return value, or None for a duplicate."""


class _ParkInstead(Exception):
    """Rolls the reservation back when an over-delivered event must be parked, not run."""


def process_event(
    consumer: str,
    event_id: EventId,
    body: Callable[[], T],
    *,
    topic: str | None = None,
    ttl: timedelta | float | None = None,
    using: str | None = None,
    max_deliveries: int | None = None,
    count_deliveries: bool = True,
    redelivered: bool | None = None,
) -> Processed[T]:
    """Run ``body`` once for ``(consumer, event_id)``, in one transaction with the reservation.

    1. Count the delivery in its own committed transaction (unless ``count_deliveries`` is
       False), in one statement that counts only if the event is not processed yet: a duplicate
       of a processed event returns ``Processed(False, None)``, having written nothing (logged
       and signalled as in step 2). An event already parked raises :class:`EventParked`.
    2. Open ``transaction.atomic(using=...)`` and :func:`try_reserve` the event. A duplicate
       returns ``Processed(False, None)``, logs ``duplicate ignored`` and sends
       :data:`~django_idempotency.signals.event_duplicate`.

       On PostgreSQL with psycopg 3, outside any transaction, steps 1 and 2 are one round trip
       (:func:`~django_idempotency.events.store.count_and_reserve`): the count commits, then the
       reservation opens the transaction. A parked event's reservation is then rolled back
       before it is refused.
    3. If the event has been delivered more than ``max_deliveries`` times (default
       ``MAX_DELIVERIES``) and the reservation shows it was never processed, roll back, park it,
       log at ERROR, send :data:`~django_idempotency.signals.event_parked` and raise
       :class:`EventParked`. (The parking decision waits on the reservation, so a delivery that
       is merely concurrent with a successful one is never parked.)
    4. Otherwise run ``body`` in the transaction; its exception rolls the reservation back and
       propagates unchanged, so the next delivery runs again. A success clears the
       ``last_error`` an earlier failed delivery left on the counter.
    5. An exception raised *after* the transaction committed (by an ``on_commit`` callback the
       body registered) is raised as :class:`~django_idempotency.exceptions.OnCommitFailed`,
       with the original as its ``__cause__``: the event is applied and a redelivery would be
       skipped as a duplicate, so it must not be read as "nothing applied".

    ``redelivered`` is what the broker says of this message, where it says it reliably:

    * ``None`` (the default): unknown; every delivery is counted as above.
    * ``False``: the broker vouches that this message was never delivered before (AMQP's
      ``redelivered`` flag, which RabbitMQ sets on every message it delivers again). Step 1 is
      skipped: its commit is what makes a first delivery cost twice the effect alone. Nothing
      is lost by it: if this delivery dies with its process, the broker's next delivery says
      ``redelivered=True`` and counts for both. Step 2 still refuses (and counts) a parked
      event, and a delivery that fails counts itself after its rollback, then parks the event
      once it has failed ``max_deliveries`` times, so its body runs at most that often and a
      loop of retries ends.
    * ``True``: the message may have been delivered before. It is counted as in step 1, and a
      counter that does not exist yet starts at 2, for the uncounted first delivery.

    Never pass ``False`` from a broker that does not set the flag for certain: a message that
    kills its worker on every delivery would then never be counted, and never parked.
    """
    event = normalize_event_id(event_id)
    name = checked_name("consumer name", consumer)
    topic_value = _checked_topic(topic)
    alias = _alias(using)
    limit = conf.MAX_DELIVERIES if max_deliveries is None else max_deliveries
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"max_deliveries must be a positive integer, not {limit!r}.")
    if redelivered is not None and not isinstance(redelivered, bool):
        raise TypeError(f"redelivered must be True, False or None, not {redelivered!r}.")

    # The broker vouches for a first delivery: its count is skipped (see above).
    first = count_deliveries and redelivered is False
    counted = count_deliveries and not first
    # On PostgreSQL the count travels with the reservation (count_and_reserve), where it can.
    travels = counted and _count_travels(event, alias)
    delivery = None
    if counted and not travels:
        delivery = _count_unless_processed(
            event, name, topic_value, ttl, alias, redelivered=bool(redelivered)
        )
        if delivery is None:  # processed before: answered by the count's one read
            _duplicate_ignored(event, name, topic_value)
            return Processed(False, None)
        if delivery.parked:
            _reject_parked(event, name, topic_value, delivery.count)
    committed: list[bool] = []
    applied = False

    try:
        with transaction.atomic(using=alias):
            # Registered first, so it runs first among the commit hooks: once it has run, the
            # transaction has committed, whatever a later hook raises.
            transaction.on_commit(lambda: committed.append(True), using=alias)
            if travels:
                delivery, state = telemetry.traced("idempotency.reserve")(
                    event_store.count_and_reserve
                )(
                    connections[alias],
                    name,
                    event,
                    topic_value,
                    _ttl(ttl),
                    redelivered=bool(redelivered),
                    asynchronous=conf.ASYNC_DELIVERY_COUNT,
                )
            elif first:
                state = _reserve_first_delivery(event, name, topic_value, ttl, alias)
            else:
                reserved = try_reserve(event, name, topic=topic_value, ttl=ttl, using=alias)
                state = RESERVED if reserved else PROCESSED
            if state == PROCESSED:
                applied = False
                result = None
            elif state == PARKED or (
                delivery is not None and (delivery.parked or delivery.count > limit)
            ):
                raise _ParkInstead
            else:
                applied = True
                result = body()
                if event_store.transaction_doomed(connections[alias]):
                    # Its COMMIT would roll the effect and the reservation back without an
                    # error, and the caller would ack a message that took no effect.
                    raise TransactionManagementError(
                        f"the body of event {event} for consumer {name!r} left the transaction "
                        "unable to commit (an error caught without a savepoint, or "
                        "set_rollback(True)): it is a failed delivery, retried and counted."
                    )
                if delivery is not None and delivery.count > 1:
                    event_store.clear_error(delivery, alias)
    except _ParkInstead:
        if delivery is None:  # a first delivery found the event parked: counted, refused
            delivery = _count_skipped(event, name, topic_value, ttl, alias)
            _reject_parked(event, name, topic_value, None if delivery is None else delivery.count)
        if delivery.parked:  # counted with the reservation, which it rolled back
            _reject_parked(event, name, topic_value, delivery.count)
        _park_and_raise(delivery, limit, alias)
    except BaseException as exc:
        if isinstance(exc, Exception):
            if first and not committed:
                # Its count was skipped: the failure counts itself, after the rollback.
                failed = _fail_first_delivery(
                    event, name, topic_value, ttl, alias, exc, limit, ran=applied
                )
                if failed is not None and failed.parked and not applied:
                    # It failed before its body ran, and the event is parked: refused as its
                    # reservation would have refused it (under REPEATABLE READ on PostgreSQL,
                    # the counter parked after its snapshot raised a serialization failure).
                    _reject_parked(event, name, topic_value, failed.count)
            elif first:
                delivery = _count_skipped(event, name, topic_value, ttl, alias)
            if committed:
                _after_commit_failed(event, name, delivery, exc, alias)
            if delivery is not None and not first:
                event_store.record_error(delivery, exc, alias, unless_processed=True)
        telemetry.delivery(name, "failed")
        raise

    OUTAGE.recovered()
    if not applied:
        _duplicate_ignored(event, name, topic_value)
    else:
        telemetry.delivery(name, "applied")
    return Processed(applied, result)


def process_first_deliveries(
    consumer: str,
    items: Sequence[tuple[EventId, Callable[[], T]]],
    *,
    topic: str | None = None,
    ttl: timedelta | float | None = None,
    using: str | None = None,
    on_commit_failed: Callable[[int, OnCommitFailed], object] | None = None,
) -> list[Processed[T]]:
    """Run each body once per ``(consumer, event_id)``, all in the caller's transaction: a batch
    of first deliveries (:func:`process_event` with ``redelivered=False``, for many at once).

    It must run inside ``transaction.atomic(using=...)``, which the caller commits or rolls back
    as one. Each event still gets its own reservation, in that transaction with its body's
    effects; an event processed before is a duplicate (``Processed(False, None)``, logged and
    signalled), and so is a second occurrence of an id in ``items``. The reservations are made
    for all of them up front, in a few statements
    (:func:`~django_idempotency.events.store.reserve_first_deliveries`), and the bodies then run
    without a savepoint each: any exception (a body's, a database error, a reservation that
    another transaction made meanwhile, :class:`EventParked` for an event found parked, or
    ``TransactionManagementError`` after a body that left the transaction unable to commit
    without raising: an error it caught without a savepoint on PostgreSQL, or
    ``set_rollback(True)``) propagates, and the caller must roll the whole transaction back
    and process the events one at a time with :func:`process_event`, which counts, isolates
    and parks. Nothing is counted here, as for any first delivery. The metric
    ``idempotency.consumer.deliveries`` counts the batch's events (applied, duplicate) when
    the caller's transaction commits: never for a batch that rolls back, whose events count
    once, when they are processed again one at a time.

    The ``on_commit`` callbacks a body registers run when the caller's transaction commits, as
    if the body had had a transaction of its own: one that raises skips the later callbacks of
    the same body (as Django skips a transaction's), never another body's, and it raises
    nothing out of the caller's ``atomic``. The event stays applied, and the failure is handled
    as :func:`process_event` handles it: logged at ERROR and kept in the event's counter
    (``last_error``, as :class:`~django_idempotency.exceptions.OnCommitFailed`); then
    ``on_commit_failed`` is called, if given, with the item's index and that
    ``OnCommitFailed`` (the callback's error as its ``__cause__``). A ``robust=True`` callback
    that raises is logged by Django, as ever, and the later ones run.

    On PostgreSQL's partitioned layout (``EVENT_PARTITIONS``) the events are processed one
    after another with :func:`process_event`, in a savepoint each.
    """
    name = checked_name("consumer name", consumer)
    topic_value = _checked_topic(topic)
    alias = _alias(using)
    events = [normalize_event_id(event_id) for event_id, _ in items]
    connection = connections[alias]
    if not connection.in_atomic_block:
        raise TransactionManagementError(
            f"process_first_deliveries() must run inside transaction.atomic(using={alias!r}): "
            "its caller rolls back all of it when one event fails."
        )
    if not events:
        return []
    # The deliveries are counted once the caller's transaction commits: a batch that rolls
    # back counts none, and its events count once, when they go one at a time.
    with telemetry.held_deliveries() as held:
        results = _first_deliveries(
            connection, name, topic_value, ttl, alias, events, items, on_commit_failed
        )
    if held:
        transaction.on_commit(functools.partial(telemetry.deliveries, held), using=alias)
    return results


def _first_deliveries(
    connection: Any,
    name: str,
    topic_value: str,
    ttl: timedelta | float | None,
    alias: str,
    events: list[str],
    items: Sequence[tuple[EventId, Callable[[], T]]],
    on_commit_failed: Callable[[int, OnCommitFailed], object] | None,
) -> list[Processed[T]]:
    """The work of :func:`process_first_deliveries`, once its arguments are checked."""
    layout = event_store.sql_layout(connection, events[0])

    def own_callbacks(index: int, start: int) -> None:
        """The callbacks the body of item ``index`` registered, from ``start`` on: its own."""
        _isolate_commit_hooks(
            connection,
            start,
            events[index],
            name,
            topic_value,
            ttl,
            alias,
            index,
            on_commit_failed,
        )

    if layout is not None and layout.columns:
        processed: list[Processed[T]] = []
        for index, (event, (_, body)) in enumerate(zip(events, items, strict=True)):
            start = len(connection.run_on_commit)
            processed.append(
                process_event(
                    name, event, body, topic=topic_value, ttl=ttl, using=alias, redelivered=False
                )
            )
            own_callbacks(index, start)
        return processed
    now = timezone.now()
    distinct = list(dict.fromkeys(events))
    states = telemetry.traced("idempotency.reserve")(event_store.reserve_first_deliveries)(
        connection, name, distinct, topic_value, now, now + _ttl(ttl)
    )
    parked = [event for event in distinct if states[event] == PARKED]
    if parked:
        raise EventParked(
            f"{len(parked)} event(s) of the batch for consumer {name!r} are parked, among "
            f"them {parked[0]}: process the batch one event at a time."
        )
    results: list[Processed[T]] = []
    for index, (event, (_, body)) in enumerate(zip(events, items, strict=True)):
        if states[event] == RESERVED:
            states[event] = PROCESSED  # a second occurrence in the batch is a duplicate
            start = len(connection.run_on_commit)
            results.append(Processed(True, body()))
            if event_store.transaction_doomed(connection):
                # Its COMMIT would roll every event of the batch back, silently.
                raise TransactionManagementError(
                    f"the body of event {event} for consumer {name!r} left the transaction "
                    "unable to commit (an error caught without a savepoint, or set_rollback): "
                    "process the batch one event at a time."
                )
            own_callbacks(index, start)
            telemetry.delivery(name, "applied")
        else:
            _duplicate_ignored(event, name, topic_value)
            results.append(Processed(False, None))
    return results


def _reject_parked(event: str, consumer: str, topic: str, count: int | None) -> NoReturn:
    times = "" if count is None else f" ({count} deliveries)"
    telemetry.delivery(consumer, "parked")
    logger.error(
        "parked event delivered again and rejected: event %s, consumer %s%s. Delete its "
        "EventDelivery row to let it run again.",
        log_text(event),
        log_text(consumer),
        times,
        extra={"event_id": event, "consumer": consumer, "topic": topic},
    )
    raise EventParked(f"Event {event} for consumer {consumer!r} is parked{times}.")


def _fail_first_delivery(
    event: str,
    name: str,
    topic: str,
    ttl: Any,
    alias: str,
    error: BaseException,
    limit: int,
    *,
    ran: bool,
) -> Delivery | None:
    """Count a failed first delivery (its count was skipped), keep its error, park if due;
    return the delivery as counted, or None if nothing was counted.

    It runs in a transaction that first reserves the event, and gives the reservation up again
    before it commits. That reservation orders it against every other delivery of the event:

    * a delivery that applied the event meanwhile (another copy of the message, or a retry an
      adapter published before this one ended; the Celery consumer's waits for it) has it
      reserved: the insert waits for it, then finds it processed, and nothing is
      recorded, so no stale error lands on a processed event;
    * a delivery that comes meanwhile waits for this transaction, then reads the counter as it
      left it: it clears the error if it succeeds, and it is refused if the event got parked.

    The event is parked in the same transaction once it has failed ``limit`` times, so its
    body runs at most ``limit`` times, as when every delivery is counted before it runs (there,
    delivery ``limit + 1`` is parked without running).

    A delivery that failed before its body ran (``ran`` False: its reservation raised) and
    finds the event parked keeps the error that parked it: the admin and a dead-letter
    message show why the event is parked, not a serialization failure of a later delivery.
    A database error here is logged and never hides the body's own error, which propagates.
    """
    try:
        with transaction.atomic(using=alias):
            if not try_reserve(event, name, topic=topic, ttl=ttl, using=alias):
                return None  # applied meanwhile: this error is stale
            delivery = count_delivery(event, name, topic=topic, ttl=ttl, using=alias)
            park = delivery.count >= limit and not delivery.parked
            kept = None if delivery.parked and not ran else error
            event_store.fail_reserved(alias, name, event, kept, park=park)
    except DatabaseError as exc:
        message = "could not count the failed delivery of event %s for consumer %s"
        shown = log_text(event), log_text(name)
        if not note_outage(alias, exc, "failed deliveries not counted", message, *shown):
            logger.warning(message, *shown, exc_info=True)
        return None
    if park:
        _parked(delivery, limit, newly=True)
    return delivery


def _count_skipped(event: str, name: str, topic: str, ttl: Any, alias: str) -> Delivery | None:
    """Count a first delivery after all: one whose ``on_commit`` callback failed (the event is
    applied, and its counter is where the admin shows the error), or one that found the event
    parked (every delivery of a parked event is counted). None if the count failed (logged)."""
    try:
        return count_delivery(event, name, topic=topic, ttl=ttl, using=alias)
    except DatabaseError as exc:
        message = "could not count the delivery of event %s for consumer %s"
        shown = log_text(event), log_text(name)
        if not note_outage(alias, exc, "deliveries not counted", message, *shown):
            logger.warning(message, *shown, exc_info=True)
        return None


def _duplicate_ignored(event: str, consumer: str, topic: str) -> None:
    telemetry.delivery(consumer, "duplicate")
    logger.info(
        "duplicate ignored: event %s, consumer %s",
        log_text(event),
        log_text(consumer),
        extra={"event_id": event, "consumer": consumer, "topic": topic},
    )
    signals.event_duplicate.send(sender=consumer, event_id=event, topic=topic)


def _isolate_commit_hooks(
    connection: Any,  # django-stubs type run_on_commit as Django 4.1's pairs
    start: int,
    event: str,
    name: str,
    topic: str,
    ttl: Any,
    alias: str,
    index: int,
    report: Callable[[int, OnCommitFailed], object] | None,
) -> None:
    """Make the ``on_commit`` callbacks one body of a batch registered (the connection's from
    ``start`` on) behave as in a transaction of the body's own.

    Django runs a transaction's callbacks in order, and the first one that raises skips every
    later one and raises out of ``atomic``, after the ``COMMIT``: in a batch, the other events'
    callbacks were lost and the caller took the committed batch for a failed one. Each callback
    is wrapped here, in place (``run_on_commit`` holds ``(savepoint ids, callback, robust)``
    entries, on every Django this package supports): once one of this body's callbacks has
    raised, its later ones are skipped, and the error is recorded against this event (see
    :func:`process_first_deliveries`) instead of raised. The body's own savepoints are all
    closed by now, so its entries are exactly the ones past ``start``.
    """
    failed: list[Exception] = []

    def guarded(func: Callable[[], object], robust: bool) -> Callable[[], None]:
        @functools.wraps(func)
        def run() -> None:
            if failed:
                return  # skipped, as Django skips a transaction's later callbacks
            if robust:
                func()  # Django logs a robust callback's error, and goes on
                return
            try:
                func()
            except Exception as exc:  # noqa: BLE001 - logged and recorded as OnCommitFailed
                failed.append(exc)
                delivery = _count_skipped(event, name, topic, ttl, alias)
                failure = _commit_hook_failed(event, name, delivery, exc, alias)
                failure.__cause__ = exc
                if report is not None:
                    report(index, failure)

        return run

    hooks = connection.run_on_commit
    hooks[start:] = [(sids, guarded(func, robust), robust) for sids, func, robust in hooks[start:]]


def _after_commit_failed(
    event: str, consumer: str, delivery: Delivery | None, error: Exception, using: str
) -> NoReturn:
    raise _commit_hook_failed(event, consumer, delivery, error, using) from error


def _commit_hook_failed(
    event: str, consumer: str, delivery: Delivery | None, error: Exception, using: str
) -> OnCommitFailed:
    """Log an event whose ``on_commit`` callback raised after its commit, keep the error in
    its counter (``delivery``), and return the :class:`OnCommitFailed` that says so."""
    logger.error(
        "event %s applied and committed for consumer %s, but an on_commit callback then "
        "failed: %s: %s. A redelivery is skipped as a duplicate, so the callback's work is "
        "not retried.",
        log_text(event),
        log_text(consumer),
        type(error).__name__,
        log_text(error),
        extra={"event_id": event, "consumer": consumer},
    )
    failure = OnCommitFailed(
        f"Event {event} for consumer {consumer!r} committed, then an on_commit callback "
        f"failed: {type(error).__name__}: {error}"
    )
    if delivery is not None:
        event_store.record_error(delivery, failure, using)
    return failure


def _park_and_raise(delivery: Delivery, limit: int, using: str) -> NoReturn:
    telemetry.delivery(delivery.consumer, "parked")
    _parked(delivery, limit, event_store.park(delivery, using))
    raise EventParked(
        f"Event {delivery.event_id} for consumer {delivery.consumer!r} was delivered "
        f"{delivery.count} times without being processed (limit {limit}) and is parked."
    )


def _parked(delivery: Delivery, limit: int, newly: bool) -> None:
    """Log a parked event at ERROR, and signal it the first time."""
    logger.error(
        "EVENT PARKED: event %s, consumer %s, delivered %d times without being processed "
        "(MAX_DELIVERIES=%d). It will not run again. Find it in the admin under "
        "'event deliveries' (parked); delete that row to let it run again.",
        log_text(delivery.event_id),
        log_text(delivery.consumer),
        delivery.count,
        limit,
        extra={
            "event_id": delivery.event_id,
            "consumer": delivery.consumer,
            "topic": delivery.topic,
        },
    )
    if newly:
        signals.event_parked.send(
            sender=delivery.consumer,
            event_id=delivery.event_id,
            topic=delivery.topic,
            deliveries=delivery.count,
        )


MISSING_ID_PREFIX = "no-event-id:"
"""Prefix of the ``event_id`` under which :func:`park_message` parks a message without one."""


def park_message(
    consumer: str,
    message_ref: str,
    reason: str,
    *,
    topic: str | None = None,
    using: str | None = None,
) -> str:
    """Park a message that carries no usable event id, where the admin shows it; return its key.

    Such a message cannot be deduplicated, so it must not run, and it must not vanish either.
    It is recorded as a parked :class:`~django_idempotency.models.EventDelivery` row for
    ``consumer`` under the event id ``"no-event-id:<message_ref>"`` (the broker's message or
    task id), with ``reason`` (what was wrong, and the message's arguments) as its last error.
    The row lives ``EVENT_TTL`` like any other counter. Logged at ERROR;
    :data:`~django_idempotency.signals.event_parked` is sent the first time.
    """
    name = checked_name("consumer name", consumer)
    key = MISSING_ID_PREFIX + _storable_ref(message_ref)
    alias = _alias(using)
    delivery = count_delivery(key, name, topic=topic, using=alias)
    newly = event_store.park(delivery, alias)
    event_store.record_error(delivery, MissingEventId(reason), alias)
    telemetry.delivery(name, "parked")
    logger.error(
        "MESSAGE PARKED, no usable event id: consumer %s, message %s: %s. Find it in the admin "
        "under 'event deliveries' (parked), event id %s.",
        log_text(name),
        log_text(message_ref),
        log_text(reason, limit=2000),
        log_text(key),
        extra={"event_id": key, "consumer": name, "topic": delivery.topic},
    )
    if newly:
        signals.event_parked.send(
            sender=name, event_id=key, topic=delivery.topic, deliveries=delivery.count
        )
    return key


def _storable_ref(message_ref: object) -> str:
    """A message or task id as the parked row's event id can hold it. The id comes from the
    message too, so it may be as unstorable as the event id that sent the message here: a NUL
    and a lone surrogate are written as backslash escapes, and the text is cut to fit."""
    text = str(message_ref).replace("\x00", "\\x00")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text[: MAX_ID_LENGTH - len(MISSING_ID_PREFIX)]
