"""A stored response's seal is bound to the record's status (format 0x02), on every backend.

Whoever can write to the database could turn a stored ``402`` into a ``200`` (or a ``201`` into
a ``402``) with one ``UPDATE`` of ``response_status``: the sealed body still opened, and the
retry replayed it with the changed status. Now the retry is answered ``422
response-undecryptable`` (one ``ERROR`` line), and the view never runs again. A response sealed
before (format 0x01, bound to owner and key only) still replays byte for byte, the rotation
rewrites it as 0x02, and setting a 0x02 value's version byte to 0x01 does not open it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.urls import reverse

from django_idempotency.models import IdempotencyRecord
from django_idempotency.protection import decrypt_stored, rotate_keys
from django_idempotency.protection.core import (
    SEALED,
    open_response,
    record_context,
    record_contexts,
)
from django_idempotency.protection.keys import V1, V2, Keyring, Undecryptable, keyring
from tests.probes import effects, post, problem
from tests.protection_helpers import keys, new_key

pytestmark = pytest.mark.django_db

K1, K2 = new_key(), new_key()
URL = "/probe/effect/"


def send(client: Client, key: str, status: int) -> Any:
    return post(client, f"{URL}?status={status}", key, {"n": key})


def record(key: str) -> IdempotencyRecord:
    return IdempotencyRecord.objects.get(key=key)


def set_raw(key: str, **columns: Any) -> None:
    """``UPDATE`` the record's columns with raw SQL (someone with write access to the
    database), not through the ORM."""
    table = connection.ops.quote_name(IdempotencyRecord._meta.db_table)
    names = ", ".join(f"{connection.ops.quote_name(name)} = %s" for name in columns)
    with connection.cursor() as cursor:
        where = connection.ops.quote_name("key")
        cursor.execute(f"UPDATE {table} SET {names} WHERE {where} = %s", [*columns.values(), key])
        assert cursor.rowcount == 1


def body_of(key: str) -> bytes:
    body = record(key).response_body
    assert body is not None
    return bytes(body)


def reseal_as_v1(key: str) -> None:
    """Rewrite the record's sealed response as main sealed it before format 0x02: the same
    envelope (it is not changed), bound to the owner and key alone, with version byte 0x01."""
    row = record(key)
    ring = keyring()
    assert ring is not None
    opened, body = open_response(
        row.owner, row.key, row.response_headers, body_of(key), status=row.response_status
    )
    text = json.dumps(opened, separators=(",", ":")).encode("ascii")
    envelope = (b"b" if body is not None else b"-") + text + b"\n" + (body or b"")
    set_raw(key, response_body=ring.seal(envelope, record_context(row.owner, row.key), version=V1))
    assert body_of(key)[0] == V1


# --- A status changed in the database --------------------------------------------------------


@pytest.mark.parametrize(("stored", "forged"), [(402, 200), (201, 402)])
def test_a_status_changed_in_the_database_is_undecryptable_never_replayed(
    client: Client, caplog: pytest.LogCaptureFixture, stored: int, forged: int
) -> None:
    """On main before 0x02 the retry replayed the sealed body with the forged status."""
    caplog.set_level(logging.INFO, logger="django_idempotency")
    with keys(K1):
        first = send(client, "k", stored)
        assert first.status_code == stored
        assert body_of("k")[0] == V2
        set_raw("k", response_status=forged)
        for _ in range(2):
            answer = send(client, "k", stored)
            details = problem(answer, 422)
            assert details["type"].endswith("#response-undecryptable")
            assert details["original_status"] == forged  # what the row says, not a replay
            assert first.content not in answer.content
    assert effects("effect") == 1  # never a second execution
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all("undecryptable" in line for line in errors), errors
    assert all(f"record={record('k').pk}" in line for line in errors)


def test_the_status_put_back_replays_again(client: Client) -> None:
    with keys(K1):
        first = send(client, "k", 402)
        set_raw("k", response_status=200)
        problem(send(client, "k", 402), 422)
        set_raw("k", response_status=402)
        again = send(client, "k", 402)
    assert (again.status_code, again.content) == (402, first.content)
    assert again["Idempotent-Replayed"] == "true"
    assert effects("effect") == 1


# --- Format 0x01: sealed before, still replayed; downgrade refused ---------------------------


def test_a_response_sealed_in_format_1_still_replays_byte_identically(client: Client) -> None:
    with keys(K1):
        first = send(client, "old", 402)
        reseal_as_v1("old")
        again = send(client, "old", 402)
    assert again.status_code == 402
    assert again.content == first.content
    assert (
        again["Location"] == first["Location"] and again["Content-Type"] == first["Content-Type"]
    )
    assert again["Idempotent-Replayed"] == "true"
    assert effects("effect") == 1


def test_a_format_2_value_with_its_version_byte_set_to_1_does_not_open(client: Client) -> None:
    with keys(K1):
        first = send(client, "k", 201)
        sealed = body_of("k")
        downgraded = bytes([V1]) + sealed[1:]
        row = record("k")
        with pytest.raises(Undecryptable, match="does not open it"):
            open_response(row.owner, "k", row.response_headers, downgraded, status=201)
        set_raw("k", response_body=downgraded)
        details = problem(send(client, "k", 201), 422)
        assert details["type"].endswith("#response-undecryptable")
        set_raw("k", response_body=downgraded, response_status=200)  # and with a forged status
        problem(send(client, "k", 201), 422)
        set_raw("k", response_body=sealed, response_status=201)
        assert send(client, "k", 201).content == first.content  # the untouched value opens
    assert effects("effect") == 1


def test_the_version_byte_is_bound_both_ways() -> None:
    """Each format opens only with its own version byte and context: 0x01 set to 0x02 does not
    open either, and a version this record cannot have is refused before any key is tried."""
    ring = Keyring((b"\x01" * 32,))
    contexts = record_contexts("owner", "key", 201)
    for version in (V1, V2):
        sealed = ring.seal(b"response", contexts[version], version=version)
        assert ring.open(sealed, contexts) == b"response"
        other = V2 if version == V1 else V1
        with pytest.raises(Undecryptable, match="does not open it"):
            ring.open(bytes([other]) + sealed[1:], contexts)
    v2 = ring.seal(b"response", contexts[V2], version=V2)
    with pytest.raises(Undecryptable, match="format version 2"):
        ring.open(v2, contexts[V1])  # bytes: a place whose values are 0x01 only
    with pytest.raises(Undecryptable, match="does not open it"):
        ring.open(v2, record_contexts("owner", "key", 200))
    with pytest.raises(ValueError, match="unknown sealed format version"):
        ring.seal(b"x", b"", version=3)


# --- Rotation and decryption -----------------------------------------------------------------


def test_the_rotation_rewrites_format_1_as_format_2_under_the_same_key(client: Client) -> None:
    """Both records are under the newest key already: only their format makes the rotation
    read them; afterwards none is 0x01, they replay, and a forged status no longer opens."""
    firsts = {}
    with keys(K1):
        for name, status in (("a", 402), ("b", 201), ("new", 201)):
            firsts[name] = send(client, name, status)
        reseal_as_v1("a")
        reseal_as_v1("b")
        [records, *_] = rotate_keys(batch_size=1)
        assert (records.resealed, records.undecryptable, records.finished) == (2, 0, True)
        assert {key: body_of(key)[0] for key in firsts} == {key: V2 for key in firsts}
        assert rotate_keys()[0].resealed == 0  # nothing left in 0x01
        for name, status in (("a", 402), ("b", 201), ("new", 201)):
            again = send(client, name, status)
            assert (again.status_code, again.content) == (status, firsts[name].content)
        set_raw("a", response_status=200)
        problem(send(client, "a", 402), 422)
    assert effects("effect") == 3


def test_the_rotation_to_a_new_key_binds_the_status_and_leaves_a_forged_one(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with keys(K1):
        first = send(client, "old", 402)
        reseal_as_v1("old")
        send(client, "forged", 201)
        set_raw("forged", response_status=200)
    with keys(K2, K1):
        [records, *_] = rotate_keys()
    assert (records.resealed, records.undecryptable) == (1, 1)
    assert f"record id={record('forged').pk}" in caplog.text
    assert body_of("old")[0] == V2
    with keys(K2):
        again = send(client, "old", 402)
        assert (again.status_code, again.content) == (402, first.content)
        set_raw("old", response_status=200)
        problem(send(client, "old", 402), 422)


def test_decrypt_writes_both_formats_in_plaintext_with_their_status(client: Client) -> None:
    with keys(K1):
        firsts = {name: send(client, name, 402) for name in ("v1", "v2", "forged")}
        reseal_as_v1("v1")
        set_raw("forged", response_status=200)
    with keys(K1, ENCRYPTION_MODE="decrypt-only"):
        [records, *_] = decrypt_stored()
        assert (records.resealed, records.undecryptable) == (2, 1)
        for name in ("v1", "v2"):
            assert SEALED not in record(name).response_headers
            assert body_of(name) == firsts[name].content
            again = send(client, name, 402)
            assert (again.status_code, again.content) == (402, firsts[name].content)
    assert SEALED in record("forged").response_headers  # left as it is


# --- The admin ---------------------------------------------------------------------------------


def test_the_admin_shows_both_formats_and_refuses_a_forged_status(client: Client) -> None:
    viewer = User.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_idempotencyrecord"))
    admin = Client()
    admin.force_login(viewer)
    with keys(K1):
        firsts = {name: send(client, name, 402) for name in ("v1", "v2", "forged")}
        reseal_as_v1("v1")
        set_raw("forged", response_status=200)
        pages = {
            name: admin.get(
                reverse(
                    "admin:django_idempotency_idempotencyrecord_change", args=[record(name).pk]
                )
            ).content.decode()
            for name in firsts
        }
    for name in ("v1", "v2"):
        effect = json.loads(firsts[name].content)["effect"]
        assert f"/probe/effects/{effect}" in pages[name]  # the Location header, decrypted
        assert "it cannot be shown" not in pages[name]
    assert "it cannot be shown" in pages["forged"]
    assert "/probe/effects/" not in pages["forged"]
