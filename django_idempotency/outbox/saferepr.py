"""Celery's ``saferepr`` of a task's arguments, the same string in a twentieth of the time.

A task message carries ``argsrepr`` and ``kwargsrepr`` headers, which Celery computes with
``celery.utils.saferepr.saferepr``: a ``repr`` bounded in length and depth. For the small JSON
arguments an outbox message usually carries, it cost about 17 µs a call, two calls a message:
a tenth of what the relay spent on a message sent to Redis (``python -m bench.outbox``). Where
the value is plain (JSON scalars, printable ASCII strings without quotes or backslashes, within
the depth), ``saferepr`` returns exactly ``repr``; :func:`task_repr` takes that path then and
calls ``saferepr`` for everything else. ``tests/test_outbox_saferepr.py`` compares the two on
generated values.
"""

from __future__ import annotations

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
    if maxlevels and _plain(value, maxlevels):
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


def _plain(value: Any, levels: int) -> bool:
    """Whether ``saferepr`` of ``value`` is its ``repr`` (given the length fits)."""
    if type(value) in _SCALARS:
        return True
    if type(value) is str:
        return _plain_text(value)
    if levels <= 0:
        return False
    if type(value) is list or type(value) is tuple:  # a tuple: send_task's empty args
        return all(_plain(item, levels - 1) for item in value)
    if type(value) is dict:
        return all(
            type(key) is str and _plain_text(key) and _plain(item, levels - 1)
            for key, item in value.items()
        )
    return False


def _plain_text(text: str) -> bool:
    return text.isascii() and text.isprintable() and "\\" not in text and "'" not in text
