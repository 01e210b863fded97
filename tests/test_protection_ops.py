"""Key rotation, erasure by owner and the checks of data protection (issue 37), on every backend.

The rotation under live traffic and after a SIGKILL is in tests/test_protection_rotation.py.
"""

from __future__ import annotations

import base64
import json
import sys
import uuid
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client, override_settings

from django_idempotency.checks import check_settings
from django_idempotency.models import FlowRun, IdempotencyRecord
from django_idempotency.protection import erase_owner, rotate_keys
from django_idempotency.protection.checks import check_encryption
from django_idempotency.protection.core import ERASED, SEALED, RotationError, stored_key_id
from django_idempotency.protection.keys import V1, key_id
from testproject.shop.probe_flows import ProbeError
from tests.probes import effects, post, problem
from tests.protection_helpers import keys, leaked, new_key

pytestmark = pytest.mark.django_db

URL = "/probe/secret/"
K1, K2 = new_key(), new_key()


def kid(key: str) -> str:
    return key_id(base64.urlsafe_b64decode(key))


def secret() -> str:
    return f"s3cr3t{uuid.uuid4().hex}"


def send(client: Client, key: str, text: str) -> Any:
    return post(client, URL, key, {"secret": text})


def key_ids() -> list[str | None]:
    return [
        stored_key_id(h)
        for h in IdempotencyRecord.objects.values_list("response_headers", flat=True)
    ]


# --- Rotation ----------------------------------------------------------------------------------


def test_rotation_reseals_old_key_and_plaintext_records_and_they_replay(client: Client) -> None:
    texts = {f"k{i}": secret() for i in range(5)}
    firsts = {}
    firsts["k0"] = send(client, "k0", texts["k0"])  # before any key: plaintext
    with keys(K1):
        for name in ("k1", "k2", "k3", "k4"):
            firsts[name] = send(client, name, texts[name])
    with keys(K2, K1):
        results = rotate_keys(batch_size=2)
        assert [r.table for r in results] == [
            "idempotency records",
            "flow runs",
            "outbox messages",
        ]
        assert results[0].resealed == 5 and results[0].batches == 3 and results[0].finished
        assert key_ids() == [kid(K2)] * 5
        assert rotate_keys()[0].resealed == 0  # nothing left: a second run writes nothing
    with keys(K2):  # the old key is gone: every record still replays, byte for byte
        for name, text in texts.items():
            again = send(client, name, text)
            assert again["Idempotent-Replayed"] == "true"
            assert again.content == firsts[name].content
            assert again["Location"] == firsts[name]["Location"]
        assert all(leaked(text) == [] for text in texts.values())
    assert effects("secret") == 5


def test_rotation_leaves_an_undecryptable_record_and_logs_it(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with keys(K1):
        send(client, "lost", secret())
    lost = IdempotencyRecord.objects.get(key="lost")
    with keys(K2):
        send(client, "kept", secret())
        [records, *_] = rotate_keys()
    assert (records.resealed, records.undecryptable) == (0, 1)
    assert f"record id={lost.pk} key_id={kid(K1)}" in caplog.text
    assert stored_key_id(IdempotencyRecord.objects.get(key="lost").response_headers) == kid(K1)


def test_rotation_without_keys_is_refused() -> None:
    with pytest.raises(RotationError, match="ENCRYPTION_KEYS is empty"):
        rotate_keys()
    with pytest.raises(CommandError, match="ENCRYPTION_KEYS is empty"):
        call_command("idempotency_rotate_keys", verbosity=0)


def test_the_rotation_does_not_overwrite_a_record_that_changed_meanwhile(client: Client) -> None:
    """The write is a compare-and-swap on the token: a record erased (or taken over) after the
    rotation read it keeps what it has now."""
    from django_idempotency.protection.store import ProtectionStore

    with keys(K1):
        send(client, "k", secret())
    store = ProtectionStore("default")
    [row] = store.records_to_reseal(
        0, 10, sealed=SEALED, erased=ERASED, key_id=kid(K2), old_format=V1
    )
    record = IdempotencyRecord.objects.get(key="k")
    erase_owner(record.owner)
    assert store.reseal_records([(row, row.headers, row.body)]) == 0
    assert ERASED in IdempotencyRecord.objects.get(key="k").response_headers


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls")
def test_rotation_reseals_flow_runs_and_the_run_resumes(client: Client) -> None:
    text = secret()
    with keys(K1), pytest.raises(ProbeError):
        post(client, "/probe/flow/", "f", {"card": text}, headers={"X-Flow-Raise": "two"})
    before = FlowRun.objects.get()
    with keys(K2, K1):
        [_, runs, _] = rotate_keys()
    assert (runs.resealed, runs.finished) == (1, True)
    run = FlowRun.objects.get()
    assert stored_key_id(run.request) == stored_key_id(run.results) == kid(K2)
    assert run.updated_at == before.updated_at  # the completer's order is not disturbed
    with keys(K2):
        done = post(client, "/probe/flow/", "f", {"card": text})
    assert done.status_code == 201 and json.loads(done.content)["resumed"] is True
    assert effects("flow-one") == 1


def test_the_command_prints_progress_and_a_result(client: Client) -> None:
    with keys(K1):
        for index in range(3):
            send(client, f"k{index}", secret())
    out, err = StringIO(), StringIO()
    with keys(K2, K1):
        call_command("idempotency_rotate_keys", batch_size=1, stdout=out, stderr=err)
    assert f"Newest key: {kid(K2)}; older keys still read: {kid(K1)}." in out.getvalue()
    assert "idempotency records: re-encrypted 3 in 3 batches" in out.getvalue()
    assert f"Done: everything is sealed with key {kid(K2)}" in out.getvalue()
    assert "idempotency records: [" in err.getvalue() and "100%" in err.getvalue()
    assert K1 not in out.getvalue() + err.getvalue() and K2 not in out.getvalue()


def test_generate_key_prints_a_key_the_setting_takes() -> None:
    out = StringIO()
    call_command("idempotency_rotate_keys", generate_key=True, stdout=out)
    key = out.getvalue().strip()
    assert len(base64.urlsafe_b64decode(key)) == 32
    with keys(key):
        assert check_settings(None) == []


# --- Erasure -----------------------------------------------------------------------------------


@pytest.mark.parametrize("listed", [(), (K1,)], ids=["plaintext", "encrypted"])
def test_an_erased_key_is_answered_410_never_runs_again_and_other_owners_keep_theirs(
    listed: tuple[str, ...],
) -> None:
    ann, bob = User.objects.create_user("ann"), User.objects.create_user("bob")
    clients = {name: Client() for name in ("ann", "bob")}
    clients["ann"].force_login(ann)
    clients["bob"].force_login(bob)
    texts = {name: secret() for name in ("ann", "bob")}
    with keys(*listed):
        firsts = {name: send(clients[name], "same-key", texts[name]) for name in clients}
        send(clients["ann"], "second", texts["ann"])
        result = erase_owner(f"user:{ann.pk}")
        assert (result.records, result.unfinished) == (2, 0)
        for body in (texts["ann"], "a different request"):  # no fingerprint is left to compare
            details = problem(send(clients["ann"], "same-key", body), 410)
            assert details["type"].endswith("#response-erased")
        again = send(clients["bob"], "same-key", texts["bob"])
    assert again.content == firsts["bob"].content and again["Idempotent-Replayed"] == "true"
    assert effects("secret") == 3  # ann twice, bob once: no second execution
    assert leaked(texts["ann"]) == []
    assert not listed or leaked(texts["bob"]) == []
    for record in IdempotencyRecord.objects.filter(owner=f"user:{ann.pk}"):
        assert set(record.response_headers) == {ERASED}
        assert record.response_body is None and record.fingerprint == "" and record.path == ""
        assert record.state == IdempotencyRecord.State.COMPLETED
    bob_record = IdempotencyRecord.objects.get(owner=f"user:{bob.pk}")
    assert ERASED not in bob_record.response_headers and bob_record.fingerprint
    assert erase_owner(f"user:{ann.pk}").records == 0  # already erased


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls")
def test_erasure_deletes_a_finished_run_and_leaves_an_unfinished_one(client: Client) -> None:
    with pytest.raises(ProbeError):
        post(client, "/probe/flow/", "paused", {"card": "x"}, headers={"X-Flow-Raise": "two"})
    assert post(client, "/probe/flow/", "done", {"card": "y"}).status_code == 201
    assert FlowRun.objects.count() == 2
    result = erase_owner("anonymous")
    assert (result.records, result.unfinished) == (1, 1)
    assert list(FlowRun.objects.values_list("record__key", flat=True)) == ["paused"]
    problem(post(client, "/probe/flow/", "done", {"card": "y"}), 410)
    assert effects("flow-three") == 1
    out = StringIO()
    call_command("idempotency_erase", owner="anonymous", stdout=out)
    assert "Erased 0 records of anonymous" in out.getvalue()
    assert "1 record of anonymous still in progress were left" in out.getvalue()


def test_the_erase_command(client: Client) -> None:
    send(client, "k", secret())
    out = StringIO()
    call_command("idempotency_erase", owner="anonymous", json=True, stdout=out)
    assert json.loads(out.getvalue())["records"] == 1
    with pytest.raises(CommandError, match="owner must be a non-empty string"):
        call_command("idempotency_erase", owner="")
    with pytest.raises(CommandError, match="Unknown database alias 'nope'"):
        call_command("idempotency_erase", owner="x", database="nope")


# --- Checks --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (["not base64!"], "key 0 is not base64"),
        ([base64.b64encode(b"k" * 16).decode()], "key 0 is 16 bytes, shorter than the 32"),
        ([K1, base64.b64encode(b"k" * 48).decode()], "key 1 is 48 bytes, longer than the 32"),
        ([K1, K1], "key 1 is listed twice"),
        (12, "must be a list of base64 keys"),
        ([12], "key 0 is a int"),
    ],
)
def test_a_malformed_or_short_key_fails_the_check_without_showing_it(
    value: Any, expected: str
) -> None:
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": value}):
        errors = check_settings(None)
    assert [error.id for error in errors] == ["django_idempotency.E002"]
    assert expected in errors[0].msg
    assert K1 not in errors[0].msg + str(errors[0].hint)


def test_keys_come_from_the_environment_as_a_comma_separated_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django_idempotency.conf import conf

    monkeypatch.setenv("IDEMPOTENCY_ENCRYPTION_KEYS", f" {K2}, {K1} ,")
    with override_settings(IDEMPOTENCY={}):
        assert conf.ENCRYPTION_KEYS == tuple(base64.urlsafe_b64decode(k) for k in (K2, K1))
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": []}):
        assert conf.ENCRYPTION_KEYS == ()  # [] turns it off whatever the environment holds
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": f"{K1},{K2}"}):
        assert conf.ENCRYPTION_KEYS[0] == base64.urlsafe_b64decode(K1)
    monkeypatch.setenv("IDEMPOTENCY_ENCRYPTION_KEYS", "short")
    with override_settings(IDEMPOTENCY={}):
        [error] = check_settings(None)
    assert error.msg.startswith("The environment variable IDEMPOTENCY_ENCRYPTION_KEYS: key 0")


def test_outbox_encrypt_without_keys_fails_a_check() -> None:
    with override_settings(IDEMPOTENCY={"OUTBOX_ENCRYPT": True}):
        assert [e.id for e in check_encryption(None)] == ["django_idempotency.E051"]
    with keys(K1, OUTBOX_ENCRYPT=True):
        assert check_encryption(None) == []


def test_without_cryptography_keys_fail_a_check_naming_the_extra_and_nothing_else_needs_it(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django_idempotency.protection import keys as keys_module

    for name in [m for m in sys.modules if m == "cryptography" or m.startswith("cryptography.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cryptography", None)  # import cryptography fails
    monkeypatch.setattr(keys_module, "_cache", ((), None))
    text = secret()
    first = send(client, "k", text)  # no keys: nothing needs cryptography
    assert send(client, "k", text).content == first.content
    with keys(K1):
        [error] = check_encryption(None)
        assert error.id == "django_idempotency.E050"
        assert "pip install 'django-idempotency[crypto]'" in str(error.hint)
        with pytest.raises(ImportError, match=r"django-idempotency\[crypto\]"):
            send(client, "new", text)


def test_the_rotation_does_not_overwrite_a_flow_run_that_saved_a_phase_meanwhile(
    client: Client,
) -> None:
    """A flow run is rewritten only while its ``updated_at`` is the one read: a phase saved
    after the rotation read the run keeps its result."""
    from datetime import timedelta

    from django.utils import timezone

    from django_idempotency.protection.store import ProtectionStore

    send(client, "k", secret())
    record = IdempotencyRecord.objects.get(key="k")
    run = FlowRun.objects.create(record=record, flow="m:f", fingerprint="f" * 64, results={})
    store = ProtectionStore("default")
    [row] = store.flow_runs_to_reseal(0, 10, sealed=SEALED, key_id=kid(K1))
    FlowRun.objects.filter(pk=run.pk).update(
        results={"one": {"json": 1}}, updated_at=timezone.now() + timedelta(seconds=1)
    )
    assert store.reseal_flow_runs([(row, {"sealed": "request"}, {"stale": "results"})]) == 0
    assert FlowRun.objects.get(pk=run.pk).results == {"one": {"json": 1}}
