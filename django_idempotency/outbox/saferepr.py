"""Celery's ``saferepr`` of a task's arguments, the same string in a twentieth of the time.

A task message carries ``argsrepr`` and ``kwargsrepr`` headers, which Celery computes with
``celery.utils.saferepr.saferepr``: a ``repr`` bounded in length and depth. For the small JSON
arguments an outbox message usually carries, it cost about 17 µs a call, two calls a message:
a tenth of what the relay spent on a message sent to Redis (``python -m bench.outbox``). Where
the value is plain (JSON scalars, printable ASCII strings without quotes or backslashes, within
the depth), ``saferepr`` returns exactly ``repr``; :func:`task_repr` takes that path then and
calls ``saferepr`` for everything else, and for a value whose ``repr`` would be cut, found
without walking it all (a long list or string costs what ``saferepr`` costs, not more).
``tests/test_outbox_saferepr.py`` compares the two on generated values.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["task_repr"]


#: The scalars whose ``repr`` is what ``saferepr`` writes (``str``, for a number). Exact types: a
#: subclass (an ``IntEnum``, a ``str`` with its own ``__repr__``) may write another ``repr``.
_SCALARS = (type(None), bool, int, float)


def task_repr(value: Any, maxsize: int | None, maxlevels: int | None) -> str:
    """``saferepr(value, maxsize, maxlevels=maxlevels)``, the same string.

    ``maxsize`` None is no bound on the length, ``maxlevels`` 0 or None none on the depth, as
    for ``saferepr`` (the fast path then is not taken for a container).
    """
    if maxlevels and _plain(value, maxlevels, sys.maxsize if maxsize is None else maxsize) >= 0:
        text: str | None
        try:
            text = repr(value)
        except ValueError:
            # An int past sys.get_int_max_str_digits(): saferepr writes it only if it comes
            # before the cut (and raises then too); past the cut it leaves it out.
            text = None
        if text is not None and (maxsize is None or len(text) < maxsize):
            return text
    from celery.utils.saferepr import saferepr

    return saferepr(value, maxsize, maxlevels=maxlevels or 0)  # None and 0: no bound, alike


def _plain(value: Any, levels: int, room: int) -> int:
    """What is left of ``room`` after a lower bound of ``len(repr(value))``, when ``saferepr``
    of ``value`` is its ``repr``; below 0 when it is not, or when that bound already leaves no
    room (``repr`` would be cut: ``saferepr`` is called then, without ``repr`` of the whole).

    The bound stops the walk of a large value (a long list, a long string) once it has seen
    ``maxsize`` characters' worth, where walking it all and then ``repr`` took longer than
    ``saferepr`` itself.
    """
    kind = type(value)
    if kind in _SCALARS:
        return room - 1
    if kind is str:
        if len(value) + 2 > room or not _plain_text(value):
            return -1
        return room - len(value) - 2
    if levels <= 0:
        return -1
    if kind is list or kind is tuple:  # a tuple: send_task's empty args
        room -= 2 * max(len(value), 1)  # the brackets and the ", " between items
        for item in value:
            if room < 0:
                return -1
            room = _plain(item, levels - 1, room)
        return room
    if kind is dict:
        room -= 2 * max(len(value), 1) + 2 * len(value)  # the braces, ", " and ": "
        for key, item in value.items():
            if room < 0 or type(key) is not str:
                return -1
            room = _plain(key, levels, room)
            if room >= 0:
                room = _plain(item, levels - 1, room)
        return room
    return -1


def _plain_text(text: str) -> bool:
    return text.isascii() and text.isprintable() and "\\" not in text and "'" not in text
