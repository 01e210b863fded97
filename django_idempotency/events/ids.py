"""Event ids: what one is, where a message carries it, and how a producer makes one.

* :func:`checked_event_id` (also :func:`normalize_event_id`) turns what a message carries (a
  ``str``, a :class:`uuid.UUID`, or an ``int`` such as an outbox primary key) into the stored
  string, or raises :class:`~django_idempotency.exceptions.InvalidEventId` for one that cannot
  be stored.
* :func:`find_event_id` finds the id among a consumer's arguments: bound to the consumer's own
  signature when it is given one, so ``apply_payment.delay(eid, pid)`` and
  ``apply_payment.delay(event_id=eid, payment_id=pid)`` name the same id.
* :func:`new_event_id` makes a time-ordered UUIDv7 for a producer.
"""

from __future__ import annotations

import inspect
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from django_idempotency.exceptions import InvalidEventId

__all__ = [
    "EVENT_ID_KEY",
    "MAX_ID_LENGTH",
    "EventId",
    "argument_event_id",
    "checked_event_id",
    "find_event_id",
    "new_event_id",
    "normalize_event_id",
]

EventId = str | uuid.UUID | int
"""An event id: a string, a :class:`uuid.UUID` (stored as ``str(uuid)``) or an integer (stored
as its decimal string)."""

EVENT_ID_KEY = "event_id"
"""The parameter, keyword argument, header and mapping key that carry an event id by default."""

MAX_ID_LENGTH = 255
"""The longest event id, consumer name or topic: the width of their columns."""


def _unstorable(what: str, value: str, *, allow_empty: bool = False) -> str | None:
    """Why ``value`` cannot be stored in a 255-character text column; None when it can."""
    if not allow_empty and not value.strip():
        return f"The {what} is empty."
    if len(value) > MAX_ID_LENGTH:
        return (
            f"The {what} is {len(value)} characters long; the most is {MAX_ID_LENGTH}: "
            f"{value[:40]!r}..."
        )
    if "\x00" in value:
        # PostgreSQL's text refuses NUL; MariaDB would store it, and the two would disagree.
        return f"The {what} contains a NUL character: {value[:80]!r}."
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate is not UTF-8: no driver can send it, so the write itself would fail.
        return f"The {what} contains a lone surrogate, which is not UTF-8: {value[:80]!r}."
    return None


def checked_name(what: str, value: object, *, allow_empty: bool = False) -> str:
    """``value`` as stored in a 255-character name column; else ValueError or TypeError."""
    if isinstance(value, uuid.UUID):
        value = str(value)
    if not isinstance(value, str):
        raise TypeError(f"The {what} must be a str or a uuid.UUID, not {type(value).__name__}.")
    problem = _unstorable(what, value, allow_empty=allow_empty)
    if problem is not None:
        raise ValueError(problem)
    return value


def checked_event_id(value: object) -> str:
    """The stored form of an event id taken from a message, or :exc:`InvalidEventId`.

    Every loop that reads an id from a message (the Celery and Django-tasks consumers, the Kafka
    runner, :func:`try_reserve`) calls this before the database sees the id. An id that cannot
    be stored (not a str, :class:`uuid.UUID` or ``int``; blank; over 255 characters; with a NUL
    or a lone surrogate) raises :class:`~django_idempotency.exceptions.InvalidEventId`, a
    :class:`~django_idempotency.exceptions.MissingEventId`: the message is parked or
    dead-lettered like one without an id. Left to the driver, a lone surrogate raised
    ``UnicodeEncodeError`` before the delivery was counted, so the message was retried forever.

    A :class:`uuid.UUID` becomes its canonical ``str`` (lowercase, hyphenated); an ``int``
    (``True`` and ``False`` are not ids) its decimal string. A string is kept exactly as given:
    ids compare byte for byte, case and trailing spaces included, on every database.
    """
    if (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, uuid.UUID):
        value = str(value)
    if not isinstance(value, str):
        raise InvalidEventId(
            f"The event id must be a str, an int or a uuid.UUID, not {type(value).__name__}: "
            f"{_preview(value)}."
        )
    problem = _unstorable("event id", value)
    if problem is not None:
        raise InvalidEventId(problem)
    return value


def normalize_event_id(event_id: object) -> str:
    """Return the stored form of an event id, or raise
    :class:`~django_idempotency.exceptions.InvalidEventId` (a :exc:`ValueError` and a
    :exc:`TypeError`): the same as :func:`checked_event_id`, under its older name.

    A :class:`uuid.UUID` becomes its canonical ``str`` (lowercase, hyphenated), so the object and
    ``str(object)`` are the same id. An ``int`` (an outbox row's primary key, say) becomes its
    decimal string, so ``42`` and ``"42"`` are the same id; ``True`` and ``False`` are not ids. A
    string is kept exactly as given: ids compare byte for byte, case included, on every
    database.
    """
    return checked_event_id(event_id)


def _preview(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def find_event_id(
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    func: Callable[..., Any] | None = None,
) -> Any:
    """Find an event id among a consumer's arguments; None when there is none.

    Looked for, in order: the ``event_id`` argument (see :func:`argument_event_id`), then the
    ``"event_id"`` key of the first positional argument when that is a mapping.
    """
    value = argument_event_id(args, kwargs, func)
    if value is None and args and isinstance(args[0], Mapping):
        value = args[0].get(EVENT_ID_KEY)
    return value


def argument_event_id(
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    func: Callable[..., Any] | None = None,
) -> Any:
    """The ``event_id`` keyword argument, else the ``event_id`` parameter of ``func``.

    The parameter is found by binding ``args`` and ``kwargs`` to ``func``'s signature, so a
    positional ``f(eid, pid)`` names the same id as ``f(event_id=eid, payment_id=pid)``. None
    when there is neither.
    """
    if kwargs.get(EVENT_ID_KEY) is not None:
        return kwargs[EVENT_ID_KEY]
    if func is None:
        return None
    return _bound_argument(func, args, kwargs, EVENT_ID_KEY)


def _bound_argument(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any], name: str
) -> Any:
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        return None
    parameter = signature.parameters.get(name)
    if parameter is None or parameter.kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        return None
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:  # the call does not fit the signature; the call itself will say so
        return None
    return bound.arguments.get(name)


# --- Producer side: UUIDv7 ----------------------------------------------------------------------

_uuid7_lock = threading.Lock()
_uuid7_last_ms = 0
_uuid7_counter = 0
_COUNTER_BITS = 42


def _reset_uuid7_state() -> None:
    global _uuid7_last_ms, _uuid7_counter
    _uuid7_last_ms = 0
    _uuid7_counter = 0


if hasattr(os, "register_at_fork"):
    # A forked child must not continue the parent's counter in the same millisecond.
    os.register_at_fork(after_in_child=_reset_uuid7_state)


def new_event_id() -> uuid.UUID:
    """A new time-ordered UUID version 7 (RFC 9562), for a producer to stamp an event with.

    48 bits of Unix time in milliseconds, then a 42-bit counter that starts at a random value each
    millisecond and counts up within it (RFC 9562 section 6.2, method 1), then 32 random bits. Ids
    from one process are strictly increasing, even within a millisecond or if the clock steps
    back; ids from different processes are ordered by millisecond. Sorted ids keep a B-tree index
    compact, and the timestamp tells roughly when the event was created.
    """
    global _uuid7_last_ms, _uuid7_counter
    with _uuid7_lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _uuid7_last_ms:
            _uuid7_last_ms = now_ms
            # The top bit stays clear so the counter has room to count within the millisecond.
            _uuid7_counter = secrets.randbits(_COUNTER_BITS - 1)
        else:
            _uuid7_counter += 1
            if _uuid7_counter >> _COUNTER_BITS:
                # Counter overflow (or a clock that went back): borrow the next millisecond.
                _uuid7_last_ms += 1
                _uuid7_counter = secrets.randbits(_COUNTER_BITS - 1)
        timestamp, counter = _uuid7_last_ms, _uuid7_counter
    value = (
        (timestamp & 0xFFFF_FFFF_FFFF) << 80
        | 0x7 << 76  # version 7
        | (counter >> 30) << 64  # rand_a: the counter's high 12 bits
        | 0b10 << 62  # the RFC 9562 variant
        | (counter & 0x3FFF_FFFF) << 32  # the counter's low 30 bits
        | secrets.randbits(32)
    )
    return uuid.UUID(int=value)
