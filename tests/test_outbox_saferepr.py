"""``task_repr`` is Celery's ``saferepr``, the same string: on generated JSON values (plain and
not), at every size and depth bound, and on the values where ``repr`` and ``saferepr`` part."""

from __future__ import annotations

import enum
from typing import Any

import pytest
from celery.utils.saferepr import saferepr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_idempotency.outbox.saferepr import task_repr

TEXT = st.text(alphabet=st.characters(max_codepoint=0x7F) | st.characters(), max_size=8)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT
    | st.text(alphabet="ab'\" \\", min_size=30, max_size=300),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TEXT, inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    value=st.lists(JSON, max_size=4)
    | st.lists(JSON, max_size=3).map(tuple)
    | st.dictionaries(TEXT, JSON, max_size=4),
    maxsize=st.integers(10, 1024),
    maxlevels=st.integers(0, 4),
)
def test_task_repr_is_saferepr(value: Any, maxsize: int, maxlevels: int) -> None:
    assert task_repr(value, maxsize, maxlevels) == saferepr(value, maxsize, maxlevels=maxlevels)


@pytest.mark.parametrize(
    "value",
    [
        [{"k\u00e9y": 1}],  # a non-ASCII key: saferepr leaves it unescaped
        [{"a\\b": None}],  # a backslash: repr doubles it
        [None, "'"],  # a quote: repr switches to double quotes
        [[[[1]]]],  # deeper than the bound: saferepr elides it
        ["x" * 2000],  # longer than the bound: saferepr cuts it
        (),  # send_task's empty args
        (1,),
        {},
    ],
)
def test_task_repr_where_repr_and_saferepr_part(value: Any) -> None:
    assert task_repr(value, 1024, 3) == saferepr(value, 1024, maxlevels=3)


class Colour(enum.IntEnum):
    RED = 1


class Tagged(str):
    def __repr__(self) -> str:
        return f"Tagged({str(self)!r})"


@pytest.mark.parametrize(
    "value",
    [
        [Colour.RED],  # saferepr writes str() of a number: "1", where repr is "<Colour.RED: 1>"
        [Tagged("a")],  # a str subclass: saferepr quotes the text, repr is the subclass's own
        {"k": Tagged("b")},
        {Tagged("k"): 1},
    ],
)
def test_task_repr_of_a_subclass_is_saferepr(value: Any) -> None:
    assert task_repr(value, 1024, 3) == saferepr(value, 1024, maxlevels=3)


@pytest.mark.parametrize(("maxsize", "maxlevels"), [(None, 3), (1024, None), (None, None)])
def test_task_repr_takes_no_bound_as_saferepr_does(maxsize: Any, maxlevels: Any) -> None:
    """``saferepr`` reads None as no bound (Celery passes ``task_repr_maxlevels`` as set)."""
    value = [1, {"a": ["b"]}, "x" * 2000]
    assert task_repr(value, maxsize, maxlevels) == saferepr(value, maxsize, maxlevels=maxlevels)


def test_task_repr_of_an_int_past_the_digit_limit_past_the_cut_is_saferepr() -> None:
    """``repr`` of an int past ``sys.get_int_max_str_digits()`` raises ``ValueError``; saferepr
    never writes one that comes after its cut."""
    value = ["x" * 200, "y", 10**5000]
    assert task_repr(value, 100, 3) == saferepr(value, 100, maxlevels=3)
    with pytest.raises(ValueError):
        task_repr([10**5000], 100, 3)  # before the cut: saferepr raises as well
    with pytest.raises(ValueError):
        saferepr([10**5000], 100, maxlevels=3)


def test_task_repr_stops_walking_a_large_value_at_maxsize(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long list or string is cut by saferepr at ``maxsize``: task_repr stops looking at it
    there too, instead of walking it all (and then ``repr`` of it all), which took longer than
    saferepr itself. Counted in calls, not timed."""
    from django_idempotency.outbox import saferepr as module

    calls = {"_plain": 0, "_plain_text": 0}
    for name in calls:
        original = getattr(module, name)

        def counted(*args: Any, _name: str = name, _original: Any = original) -> Any:
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(module, name, counted)
    long_list = [list(range(100_000))]
    assert task_repr(long_list, 1024, 3) == saferepr(long_list, 1024, maxlevels=3)
    assert calls["_plain"] <= 1024
    long_text = [1, "x" * 1_000_000]
    assert task_repr(long_text, 1024, 3) == saferepr(long_text, 1024, maxlevels=3)
    assert calls["_plain_text"] == 0  # the long string is not scanned
