"""Idempotency-Key parsing: structured-field strings and bare tokens, and what is malformed."""

from __future__ import annotations

import pytest
from django.test import Client
from hypothesis import given
from hypothesis import strategies as st

from django_idempotency.exceptions import MalformedKey
from django_idempotency.http.keys import parse_key, serialize_key
from tests.probes import effects, post, problem

VISIBLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
visible_keys = st.text(VISIBLE, min_size=1, max_size=255)


@pytest.mark.parametrize(
    ("header", "key"),
    [
        ('"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ("8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ('  "abc"\t', "abc"),
        ("  abc ", "abc"),
        (r'"a\"b\\c"', 'a"b\\c'),
        ('"a,b"', "a,b"),
        ("x" * 255, "x" * 255),
    ],
)
def test_valid_keys(header: str, key: str) -> None:
    assert parse_key(header, 255) == key


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ('""', "empty"),
        ("x" * 256, "longer than 255"),
        ('"' + "x" * 256 + '"', "longer than 255"),
        ("has space", "visible ASCII"),
        ('"has space"', "visible ASCII"),
        ("caf\u00e9", "visible ASCII"),
        ("tab\there", "visible ASCII"),
        ("nul\x00", "visible ASCII"),
        ('"unterminated', "structured-field"),
        ('"a"b"', "structured-field"),
        ('"a" , "b"', "structured-field"),
        (r'"bad\escape"', "structured-field"),
        ("a,b", "comma"),
        ("same,same", "comma"),
        ("same, same", "comma"),
        ('"caf\u00e9"', "structured-field"),
    ],
)
def test_malformed_keys(header: str, reason: str) -> None:
    with pytest.raises(MalformedKey, match=reason) as caught:
        parse_key(header, 255)
    assert caught.value.status == 400


def test_max_length_is_the_argument() -> None:
    assert parse_key("abcd", 4) == "abcd"
    with pytest.raises(MalformedKey):
        parse_key("abcde", 4)


@given(visible_keys)
def test_bare_and_quoted_forms_mean_the_same_key(key: str) -> None:
    quoted = serialize_key(key)
    assert parse_key(quoted, 255) == key
    if not key.startswith('"') and "," not in key:
        assert parse_key(key, 255) == key


@given(st.text(min_size=1, max_size=40))
def test_any_text_is_accepted_only_when_visible_ascii(text: str) -> None:
    stripped = text.strip(" \t")
    try:
        key = parse_key(text, 255)
    except MalformedKey:
        # Rejected: something in it is not visible ASCII, or it is a broken quoted string.
        assert (
            not stripped
            or any(not 0x21 <= ord(c) <= 0x7E for c in stripped)
            or stripped.startswith('"')
            or "," in stripped
        )
    else:
        assert key
        assert all(0x21 <= ord(c) <= 0x7E for c in key)
        assert len(key) <= 255


@given(visible_keys, st.integers(min_value=1, max_value=255))
def test_length_limit_is_exact(key: str, limit: int) -> None:
    quoted = serialize_key(key)
    if len(key) <= limit:
        assert parse_key(quoted, limit) == key
    else:
        with pytest.raises(MalformedKey):
            parse_key(quoted, limit)


@pytest.mark.django_db
def test_a_repeated_header_joined_with_a_comma_is_malformed_not_a_new_key() -> None:
    """gunicorn and Django's ASGI handler join a repeated header: ``same`` twice is ``same,same``.

    Taking that for a new key ran the command a second time."""
    client = Client()
    assert post(client, "/probe/effect/", "same").status_code == 201
    details = problem(post(client, "/probe/effect/", "same,same"), 400)
    assert details["type"].endswith("#malformed-key")
    assert effects() == 1
