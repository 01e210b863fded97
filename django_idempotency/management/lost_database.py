"""What the commands that work in steps (the purge, the key rotation, the erasure, the
completer) answer when they lose the database.

Each of them works in short transactions (a batch, a flow's phase) and reads only what is left
to do, so a connection lost in the middle (a failover, a restart, a cut network) loses nothing:
what committed stays done, the step cut off rolled back (or took effect unheard), and the next
run goes on. The driver's traceback said none of that; :func:`resumable_on_loss` turns it into
a :class:`~django.core.management.base.CommandError` (exit status 1) that does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from django.core.management.base import CommandError
from django.db import DatabaseError, connections

from django_idempotency.outages import connection_lost

__all__ = ["resumable_on_loss"]


@contextmanager
def resumable_on_loss(aliases: Iterable[str], what: str) -> Iterator[None]:
    """Inside the block, a lost connection to one of ``aliases`` raises
    a ``CommandError`` saying that ``what`` goes on when run again; any other database error
    (a constraint, a bug) stays the driver's, with its traceback."""
    try:
        yield
    except DatabaseError as exc:
        for alias in aliases:
            if connection_lost(connections[alias], exc):
                raise CommandError(
                    f"The connection to the database {alias!r} was lost ({exc}). Nothing is "
                    f"lost: what committed stays done. Run the {what} again when the database "
                    "answers: it goes on where it stopped."
                ) from exc
        raise
