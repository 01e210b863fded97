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
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.outages import connection_lost

__all__ = ["resumable_on_loss"]


@contextmanager
def resumable_on_loss(aliases: Iterable[str], what: str) -> Iterator[None]:
    """Inside the block, a lost connection to one of ``aliases`` raises
    a ``CommandError`` saying that ``what`` goes on when run again; any other database error
    (a constraint, a lock wait that ran out, a bug) stays the driver's, with its traceback.

    The error is judged against the connection that raised it, when its traceback names one:
    an alias not connected yet (the purge's second database, while the first one fails) reads
    as "could not connect" to :func:`~django_idempotency.outages.connection_lost`, and any
    error of the first alias was reported as the second one lost."""
    try:
        yield
    except DatabaseError as exc:
        wanted = list(aliases)
        raised_on = _raised_on(exc)
        judged = [raised_on] if raised_on in wanted else wanted
        for alias in judged:
            if connection_lost(connections[alias], exc):
                raise CommandError(
                    f"The connection to the database {alias!r} was lost ({exc}). Nothing is "
                    f"lost: what committed stays done. Run the {what} again when the database "
                    "answers: it goes on where it stopped."
                ) from exc
        raise


def _raised_on(exc: BaseException) -> str | None:
    """The alias of the database wrapper whose statement, connect or COMMIT raised ``exc``: the
    innermost frame of its traceback run by a wrapper (its ``connect()``, ``commit()``...) or
    by something that holds one (Django's cursor's ``db``, a compiler's or a store's
    ``connection``); None when no frame says."""
    found: str | None = None
    trace = exc.__traceback__
    while trace is not None:
        owner = trace.tb_frame.f_locals.get("self")
        held = getattr(owner, "__dict__", {})  # instance attributes only: no property runs
        for wrapper in (owner, held.get("db"), held.get("connection")):
            if isinstance(wrapper, BaseDatabaseWrapper):
                found = wrapper.alias
                break
        trace = trace.tb_next
    return found
