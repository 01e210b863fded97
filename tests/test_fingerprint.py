"""Request fingerprints: JSON canonicalisation (property-based) and raw bodies."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from django_idempotency.http.fingerprint import canonical_body, fingerprint, is_json

JSON = "application/json"

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=25,
)


def shuffled(value: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys in a random order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {key: shuffled(item, rng) for key, item in items}
    if isinstance(value, list):
        return [shuffled(item, rng) for item in value]
    return value


@given(json_values, st.integers(), st.sampled_from([None, 0, 2, "\t"]), st.booleans())
def test_key_order_and_whitespace_do_not_matter(
    value: Any, seed: int, indent: int | str | None, ascii_only: bool
) -> None:
    compact = json.dumps(value, separators=(",", ":"))
    other = json.dumps(
        shuffled(value, random.Random(seed)), indent=indent, ensure_ascii=ascii_only
    )
    assert fingerprint("POST", "/orders/", compact.encode(), JSON) == fingerprint(
        "POST", "/orders/", other.encode(), JSON
    )


@given(json_values, json_values)
def test_different_json_documents_differ(first: Any, second: Any) -> None:
    same = json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    a = fingerprint("POST", "/x", json.dumps(first).encode(), JSON)
    b = fingerprint("POST", "/x", json.dumps(second).encode(), JSON)
    assert (a == b) == same


@given(st.binary(max_size=200), st.binary(max_size=200))
def test_raw_bodies_are_compared_byte_for_byte(first: bytes, second: bytes) -> None:
    a = fingerprint("POST", "/x", first, "application/octet-stream")
    b = fingerprint("POST", "/x", second, "application/octet-stream")
    assert (a == b) == (first == second)


@given(st.text(max_size=30), st.text(max_size=30))
def test_parts_cannot_run_into_each_other(path_tail: str, body: str) -> None:
    # "/a" + "b..." and "/ab" + "..." must not hash the same bytes.
    one = fingerprint("POST", "/a" + path_tail, body.encode(), "text/plain")
    two = fingerprint("POST", "/a", (path_tail + body).encode(), "text/plain")
    assert (one == two) == (path_tail == "")


def test_method_path_and_query_count() -> None:
    base = fingerprint("POST", "/orders/?a=1", b"{}", JSON)
    assert fingerprint("post", "/orders/?a=1", b"{}", JSON) == base
    assert fingerprint("PATCH", "/orders/?a=1", b"{}", JSON) != base
    assert fingerprint("POST", "/orders/?a=2", b"{}", JSON) != base
    assert fingerprint("POST", "/orders/", b"{}", JSON) != base
    assert len(base) == 64


def test_whitespace_matters_outside_json() -> None:
    assert fingerprint("POST", "/", b'{"a": 1}', "text/plain") != fingerprint(
        "POST", "/", b'{"a":1}', "text/plain"
    )
    assert fingerprint("POST", "/", b'{"a": 1}', JSON) == fingerprint(
        "POST", "/", b'{"a":1}', JSON
    )


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        ("application/json", True),
        ("application/json; charset=utf-8", True),
        ("Application/JSON", True),
        ("application/problem+json", True),
        ("application/vnd.api+json", True),
        ("text/json", False),
        ("text/plain", False),
        ("multipart/form-data; boundary=x", False),
        ("", False),
        (None, False),
    ],
)
def test_is_json(content_type: str | None, expected: bool) -> None:
    assert is_json(content_type) is expected


def test_invalid_json_falls_back_to_raw_bytes() -> None:
    assert canonical_body(b"{not json", JSON) == b"{not json"
    assert canonical_body(b"\xff\xfe", JSON) == b"\xff\xfe"
    assert canonical_body(b'{"b": 1, "a": "\\u00e9"}', JSON) == '{"a":"\u00e9","b":1}'.encode()
