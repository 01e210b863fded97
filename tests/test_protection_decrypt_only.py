"""Turning encryption off (``ENCRYPTION_MODE = "decrypt-only"`` and ``idempotency_rotate_keys
--decrypt``), on every backend.

* In decrypt-only mode new values are stored in plaintext (read back with raw SQL), and what was
  sealed still opens with the listed keys: a replay is the same bytes.
* ``--decrypt`` writes every sealed record, flow run and outbox message in plaintext (no
  ``@sealed`` marker is left in any column, read with raw SQL), goes on where it was stopped
  (between two batches, or by a ``SIGKILL`` of the command), and replays beside it stay
  byte-identical; afterwards everything works with no key at all.
* It is refused unless the mode is decrypt-only and keys are listed; the checks name what to
  change.

``decrypt_stored`` is looked up on ``core`` when a test runs, so that on a version without it
each test fails on its own assertion rather than the module failing to import.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, connections, transaction
from django.test import Client
from django.urls import reverse

from django_idempotency.checks import check_settings
from django_idempotency.models import FlowRun, IdempotencyRecord, OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.relay import Relay
from django_idempotency.protection import core
from django_idempotency.protection.checks import check_encryption
from django_idempotency.protection.keys import Keyring, key_id
from testproject.shop.probe_flows import ProbeError
from tests.probes import effects, post
from tests.protection_helpers import keys, kill_half_way, leaked, new_key, raw_tables
from tests.servers import REPO, database_url
from tests.test_protection_outbox import Recording
from tests.test_protection_rotation import seed

pytestmark = pytest.mark.django_db

URL = "/probe/secret/"
K1, K2 = new_key(), new_key()
KID1 = key_id(base64.urlsafe_b64decode(K1))
MARKER = b"@sealed"


@contextmanager
def decrypt_only(*listed: str, **more: Any) -> Iterator[None]:
    with keys(*listed, ENCRYPTION_MODE="decrypt-only", **more):
        yield


def secret() -> str:
    return f"s3cr3t{uuid.uuid4().hex}"


def send(client: Client, key: str, text: str) -> Any:
    return post(client, URL, key, {"secret": text})


def answer(response: Any) -> tuple[int, bytes, str, str]:
    """What a replay must repeat byte for byte: status, body and the replayed headers."""
    return (
        response.status_code,
        response.content,
        response["Location"],
        response["Content-Disposition"],
    )


def assert_replays(client: Client, firsts: dict[str, tuple[str, Any]]) -> None:
    for key, (text, first) in firsts.items():
        again = send(client, key, text)
        assert again.get("Idempotent-Replayed") == "true", (key, again.status_code)
        assert answer(again) == answer(first), key


def raw_response(key: str) -> tuple[str, bytes]:
    """A record's ``response_headers`` and ``response_body`` as raw SQL reads them."""
    quote = connection.ops.quote_name
    table = quote(IdempotencyRecord._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT response_headers, response_body FROM {table} WHERE {quote('key')} = %s",
            [key],
        )
        headers, body = cursor.fetchone()
    return str(headers), bytes(body)


def sealed_records() -> int:
    """Records whose raw ``response_headers`` hold the sealed marker."""
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT response_headers FROM {quote(IdempotencyRecord._meta.db_table)}")
        return sum("@sealed" in str(headers) for (headers,) in cursor.fetchall())


def decrypt(**options: Any) -> list[Any]:
    return core.decrypt_stored(**options)


# --- The mode ----------------------------------------------------------------------------------


def test_decrypt_only_stores_new_responses_in_plaintext_and_replays_sealed_ones(
    client: Client,
) -> None:
    old, new = secret(), secret()
    with keys(K1):
        first_old = send(client, "old", old)
    with decrypt_only(K1):
        first_new = send(client, "new", new)
        assert first_new.status_code == 201
        headers, body = raw_response("new")
        assert new.encode() in body and f"/probe/secrets/{new}" in headers
        assert "@sealed" not in headers
        headers, body = raw_response("old")  # what was sealed stays sealed until --decrypt
        assert "@sealed" in headers and old.encode() not in body
        assert_replays(client, {"old": (old, first_old), "new": (new, first_new)})
    assert effects("secret") == 2


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls")
def test_flow_runs_decrypt_only_plaintext_then_decrypted_and_resumed_without_keys(
    client: Client,
) -> None:
    from testproject.shop.probe_flows import REMOTE_CALLS

    cards = {"f": secret(), "g": secret()}
    with keys(K1), pytest.raises(ProbeError):
        post(client, "/probe/flow/", "f", {"card": cards["f"]}, headers={"X-Flow-Raise": "two"})
    with decrypt_only(K1):
        with pytest.raises(ProbeError):
            post(
                client, "/probe/flow/", "g", {"card": cards["g"]}, headers={"X-Flow-Raise": "two"}
            )
        plain = FlowRun.objects.get(record__key="g")
        assert core.SEALED not in plain.request and core.SEALED not in plain.results
        assert leaked(cards["g"]) != [] and leaked(cards["f"]) == []
        sealed = FlowRun.objects.get(record__key="f")
        [_, runs, _] = decrypt()
    assert (runs.resealed, runs.undecryptable, runs.finished) == (1, 0, True)
    assert MARKER not in raw_tables()
    assert FlowRun.objects.get(pk=sealed.pk).updated_at == sealed.updated_at
    with keys():  # keys and mode removed: both runs resume
        for key, card in cards.items():
            done: Any = post(client, "/probe/flow/", key, {"card": card})
            assert done.status_code == 201 and json.loads(done.content)["resumed"] is True
    assert sum(REMOTE_CALLS.values()) == 2
    assert effects("flow-one") == 2 and effects("flow-three") == 2


@pytest.mark.usefixtures("null_default_transport")
def test_outbox_payloads_plaintext_in_decrypt_only_then_decrypted_and_sent_without_keys() -> None:
    def write(payload: Any) -> None:
        with transaction.atomic():
            outbox.send("topic", payload)

    transport = Recording()
    with keys(K1, OUTBOX_ENCRYPT=True):
        write({"n": 1})
        Relay(transports={"default": transport}).drain()  # sent, and kept sealed until purged
        write({"n": 2})
    with decrypt_only(K1, OUTBOX_ENCRYPT=True):  # the mode wins over OUTBOX_ENCRYPT (W053)
        write({"n": 3})
        assert OutboxEntry.objects.order_by("pk").last().payload == {"n": 3}  # type: ignore[union-attr]
        [_, _, messages] = decrypt(batch_size=1)
    assert (messages.resealed, messages.batches) == (2, 2)  # the sent one too
    assert MARKER not in raw_tables()
    assert [row.payload for row in OutboxEntry.objects.order_by("pk")] == [
        {"n": 1},
        {"n": 2},
        {"n": 3},
    ]
    with keys():
        Relay(transports={"default": transport}).drain()
    assert [m.payload for m in transport.sent] == [{"n": 1}, {"n": 2}, {"n": 3}]


# --- The decryption ----------------------------------------------------------------------------


class Interrupted(Exception):
    """Raised from the progress callback: the run stops after a batch committed."""


def test_decrypt_is_resumable_and_leaves_no_sealed_value(client: Client) -> None:
    firsts: dict[str, tuple[str, Any]] = {}
    text = secret()
    firsts["plain"] = (text, send(client, "plain", text))  # before any key
    with keys(K1):
        for index in range(9):
            text = secret()
            firsts[f"k{index}"] = (text, send(client, f"k{index}", text))
    assert sealed_records() == 9
    batches: list[int] = []

    def stop_after_two(table: str, done: int, last: int, written: int) -> None:
        batches.append(written)
        if len(batches) == 2:
            raise Interrupted

    with decrypt_only(K1):
        with pytest.raises(Interrupted):
            decrypt(batch_size=2, progress=stop_after_two)
        assert batches == [2, 4] and sealed_records() == 5  # two batches done, kept
        assert_replays(client, firsts)  # half plaintext, half sealed: the same bytes
        out = StringIO()
        call_command("idempotency_rotate_keys", decrypt=True, batch_size=3, stdout=out)
    assert "idempotency records: decrypted 5 in 2 batches" in out.getvalue()
    assert "Done: nothing is stored encrypted any more" in out.getvalue()
    assert K1 not in out.getvalue()
    assert sealed_records() == 0 and MARKER not in raw_tables()
    with keys():  # the keys are gone: everything still replays
        assert_replays(client, firsts)
    assert effects("secret") == 10
    with decrypt_only(K1):  # nothing left: a second run writes nothing
        assert [result.resealed for result in decrypt()] == [0, 0, 0]


def test_decrypt_leaves_an_undecryptable_record_and_logs_it(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with keys(K2):
        send(client, "lost", secret())
    with keys(K1):
        send(client, "kept", secret())
    with decrypt_only(K1):
        [records, *_] = decrypt()
    assert (records.resealed, records.undecryptable) == (1, 1)
    lost = IdempotencyRecord.objects.get(key="lost")
    assert f"record id={lost.pk} key_id={key_id(base64.urlsafe_b64decode(K2))}" in caplog.text
    assert "@sealed" in raw_response("lost")[0] and "@sealed" not in raw_response("kept")[0]


def test_decrypt_is_refused_unless_decrypt_only_with_keys(client: Client) -> None:
    with keys(K1):
        send(client, "k", secret())
        with pytest.raises(CommandError, match=r"ENCRYPTION_MODE'\] is not 'decrypt-only'"):
            call_command("idempotency_rotate_keys", decrypt=True, verbosity=0)
    with (
        decrypt_only(),
        pytest.raises(CommandError, match="ENCRYPTION_KEYS is empty: no key opens"),
    ):
        call_command("idempotency_rotate_keys", decrypt=True, verbosity=0)
    with (
        decrypt_only(K2, K1),
        pytest.raises(CommandError, match="run idempotency_rotate_keys --decrypt"),
    ):
        call_command("idempotency_rotate_keys", verbosity=0)  # it would seal again
    assert sealed_records() == 1  # nothing was written


def test_the_admin_shows_which_records_are_still_sealed_and_with_which_key(
    client: Client,
) -> None:
    with keys(K1):
        send(client, "sealed", secret())
    text = secret()
    viewer = Client()
    user = User.objects.create_user("viewer", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_idempotencyrecord"))
    viewer.force_login(user)
    listing = reverse("admin:django_idempotency_idempotencyrecord_changelist")

    def page(key: str) -> str:
        pk = IdempotencyRecord.objects.get(key=key).pk
        url = reverse("admin:django_idempotency_idempotencyrecord_change", args=[pk])
        return viewer.get(url).content.decode()

    with decrypt_only(K1):
        send(client, "plain", text)
        assert f"Encrypted with key {KID1}" in page("sealed")
        assert "Not encrypted" in page("plain") and text in page("plain")
        assert viewer.get(listing).content.decode().count(KID1) == 1
        decrypt()
        assert "Not encrypted" in page("sealed")
        assert KID1 not in viewer.get(listing).content.decode()


# --- Checks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["decrypt_only", "Decrypt-Only", "off", True, None])
def test_a_misspelt_mode_is_e002_naming_both_modes(mode: Any) -> None:
    with keys(K1, ENCRYPTION_MODE=mode):
        errors = check_settings(None)
    assert [error.id for error in errors] == ["django_idempotency.E002"]
    assert "must be 'encrypt'" in errors[0].msg and "or 'decrypt-only'" in errors[0].msg
    assert f"not {mode!r}" in errors[0].msg


def test_decrypt_only_without_keys_is_e052_and_with_outbox_encrypt_w053() -> None:
    with decrypt_only():
        [error] = check_encryption(None)
    assert error.id == "django_idempotency.E052"
    assert "idempotency_rotate_keys --decrypt" in str(error.hint)
    with decrypt_only(K1, OUTBOX_ENCRYPT=True):
        [warning] = check_encryption(None)
    assert warning.id == "django_idempotency.W053"
    assert "Remove OUTBOX_ENCRYPT" in str(warning.hint)
    with decrypt_only(K1):
        assert check_encryption(None) == [] and check_settings(None) == []
    with keys(K1, ENCRYPTION_MODE="encrypt", OUTBOX_ENCRYPT=True):
        assert check_encryption(None) == [] and check_settings(None) == []


# --- Beside live traffic -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_replays_beside_the_decryption_are_byte_identical() -> None:
    client = Client()
    firsts: dict[str, tuple[str, Any]] = {}
    with keys(K1):
        for index in range(120):
            text = secret()
            firsts[f"old-{index}"] = (text, post(client, URL, f"old-{index}", {"secret": text}))
    stop = threading.Event()
    seen: Counter[str] = Counter()
    problems: list[str] = []

    def replay(offset: int) -> None:
        mine, names = Client(), list(firsts)
        try:
            for turn in range(offset, 10**9, 5):
                if stop.is_set():
                    break
                key = names[turn % len(names)]
                text, first = firsts[key]
                again = send(mine, key, text)
                if again.status_code == 409:  # a batch's lock on MariaDB or SQLite
                    seen["409"] += 1
                elif answer(again) != answer(first) or again["Idempotent-Replayed"] != "true":
                    problems.append(f"{key}: {again.status_code} {again.content[:80]!r}")
                else:
                    seen["replayed"] += 1
                fresh = f"new-{uuid.uuid4().hex}"
                if send(mine, fresh, fresh).status_code not in (201, 409):
                    problems.append(f"{fresh}: a new request failed")
        except Exception as exc:  # noqa: BLE001 - handed to the test thread, which asserts
            problems.append(repr(exc))
        finally:
            connections.close_all()

    with decrypt_only(K1):
        threads = [threading.Thread(target=replay, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)  # traffic first, then the decryption in the middle of it
        [records, *_] = decrypt(batch_size=4)
        time.sleep(0.3)
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not problems, problems[:5]
    assert records.finished and records.undecryptable == 0 and records.resealed == 120
    assert seen["replayed"] > 20, seen
    assert sealed_records() == 0 and MARKER not in raw_tables()
    with keys():
        assert_replays(client, dict(list(firsts.items())[::10]))
    assert effects("secret") == IdempotencyRecord.objects.count()  # nothing ran twice


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_decryption_goes_on_after_a_sigkill(tmp_path: Path) -> None:
    """``manage.py idempotency_rotate_keys --decrypt`` killed in the middle of its batches: each
    record is sealed or in plaintext, none broken, and the next run finishes the rest."""
    count = 3000
    bodies = seed(Keyring((base64.urlsafe_b64decode(K1),)), count)
    (tmp_path / "decrypt_only_settings.py").write_text(
        "from testproject.settings import *  # noqa: F403\n"
        'IDEMPOTENCY = {**IDEMPOTENCY, "ENCRYPTION_MODE": "decrypt-only"}  # noqa: F405\n'
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "decrypt_only_settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
        "DATABASE_URL": database_url(connection.settings_dict),
        "IDEMPOTENCY_ENCRYPTION_KEYS": K1,
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("COV_CORE_SOURCE", None)
    command = [sys.executable, "manage.py", "idempotency_rotate_keys", "--decrypt"]
    command += ["--batch-size", "10"]
    kill_half_way(command, env, lambda: sealed_records() <= count - count // 10)
    left = sealed_records()
    assert 0 < left < count, left
    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"idempotency records: decrypted {left} in" in rerun.stdout
    assert "Done: nothing is stored encrypted" in rerun.stdout
    assert sealed_records() == 0
    for key, headers, body in IdempotencyRecord.objects.values_list(
        "key", "response_headers", "response_body"
    ):  # every record in plaintext, as it was sealed: no row was lost or broken by the kill
        assert (headers, bytes(body or b"")) == ({"Content-Type": "x/y"}, bodies[key])
