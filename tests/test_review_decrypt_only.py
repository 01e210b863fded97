"""An outside review of turning encryption off (``ENCRYPTION_MODE = "decrypt-only"``,
``idempotency_rotate_keys --decrypt``), on every backend.

Each test is one attack on the decryption beside live traffic. A concurrent write is made
deterministic by running it, for real and on its own connection where it matters, between the
pass's read of a batch and its compare-and-swap write (the store's write method is wrapped; the
database is never mocked):

* a phased request resumed, or paused again, between the read of its flow run and the write
  (the write's compare-and-swap fails): the run must not be left sealed while the command says
  "Done", or the keys' removal afterwards loses the stored request that the completer needs;
* an erasure between the read and the write: the tombstone stays, nothing is revived;
* the relay sending a message between the read and the write: sent once, opened;
* a batch whose write another transaction undoes (PostgreSQL at REPEATABLE READ) is read and
  written again, instead of the command failing;
* a phased request holding its lease inside a foreign call, and threads resuming runs or
  relays sending messages beside the pass;
* a connection cut at a batch's ``COMMIT`` (before or after the server answered);
* a sealed response, flow request or payload copied to another row does not open there (the
  associated data binds it), and keys differing only in case keep their own binding;
* undecryptable rows in the middle of a batch of each table are left and the rest done;
* a partial pass, then back to ``encrypt`` and a rotation: everything sealed again, replays the
  same;
* "Done" names every setting to remove (``OUTBOX_ENCRYPT`` too, when W053 let it stay);
* the admin never shows a key, in decrypt-only mode, before and after the pass.

Why this module is long: one review, one attack per test, each against every backend; split,
the shared hook (:func:`before_write`) and fixtures would be spread over files.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from contextlib import contextmanager
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection, transaction
from django.test import Client
from django.urls import reverse

from django_idempotency.flows.completer import stored_request
from django_idempotency.models import FlowRun, IdempotencyRecord, OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.relay import Relay
from django_idempotency.protection import core
from django_idempotency.protection.keys import key_id
from django_idempotency.protection.store import ProtectionStore
from testproject.shop.probe_flows import ProbeError
from tests.probes import effects, post
from tests.protection_helpers import forms_of, keys, new_key, raw_tables
from tests.test_protection_outbox import Recording

pytestmark = pytest.mark.django_db

URL = "/probe/secret/"
FLOW = "/probe/flow/"
K1, K2 = new_key(), new_key()
RAW1, RAW2 = base64.urlsafe_b64decode(K1), base64.urlsafe_b64decode(K2)
KID1, KID2 = key_id(RAW1), key_id(RAW2)
MARKER = b"@sealed"


@contextmanager
def decrypt_only(*listed: str, **more: Any) -> Iterator[None]:
    with keys(*listed, ENCRYPTION_MODE="decrypt-only", **more):
        yield


@contextmanager
def before_write(
    monkeypatch: pytest.MonkeyPatch, method: str, meanwhile: Any, times: int = 1
) -> Iterator[list[Any]]:
    """Run ``meanwhile()`` between the pass's read of a batch and its write (``method`` of the
    store), on the first ``times`` batches that write anything; yields what it returned."""
    original = getattr(ProtectionStore, method)
    done: list[Any] = []

    def wrapped(self: ProtectionStore, rows: Any) -> int:
        rows = list(rows)
        if rows and len(done) < times:
            done.append(meanwhile())
        return int(original(self, rows))

    with monkeypatch.context() as patch:
        patch.setattr(ProtectionStore, method, wrapped)
        yield done


def run_decrypt(**options: Any) -> str:
    out = StringIO()
    call_command("idempotency_rotate_keys", decrypt=True, stdout=out, stderr=StringIO(), **options)
    return out.getvalue()


def raw_column(model: Any, column: str, pk: int) -> str:
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {quote(column)} FROM {quote(model._meta.db_table)} WHERE id = %s", [pk]
        )
        (value,) = cursor.fetchone()
    return bytes(value).decode("latin-1") if isinstance(value, (bytes, memoryview)) else str(value)


def paused_flow(client: Client, key: str, card: str) -> FlowRun:
    """A phased request that stopped after phase two, with keys K1: its run sealed."""
    with keys(K1), pytest.raises(ProbeError):
        post(client, FLOW, key, {"card": card}, headers={"X-Flow-Raise": "two"})
    run = FlowRun.objects.get(record__key=key)
    assert core.SEALED in run.request and core.SEALED in run.results
    return run


# --- Flow runs changed between the read and the write -------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls")
@pytest.mark.parametrize("retry", ["pauses-again", "completes"])
def test_a_flow_run_changed_during_its_batch_is_not_left_sealed(
    client: Client, monkeypatch: pytest.MonkeyPatch, retry: str
) -> None:
    """A retry resumes the run while its batch is decrypted: the retry writes the results in
    plaintext but never the request, and moves ``updated_at``, so the pass's compare-and-swap
    writes nothing. The request must not stay sealed under a "Done" (the keys go next, and the
    completer could no longer rebuild the request)."""
    card = f"4111{retry}"
    run = paused_flow(client, "f", card)
    headers = {"X-Flow-Raise": "three"} if retry == "pauses-again" else {}

    def resume() -> int | str:
        try:
            return post(Client(), FLOW, "f", {"card": card}, headers=headers).status_code
        except ProbeError:
            return "paused"

    with decrypt_only(K1), before_write(monkeypatch, "reseal_flow_runs", resume) as retried:
        out = run_decrypt()
    assert retried == ["paused" if retry == "pauses-again" else 201]
    assert FlowRun.objects.get(pk=run.pk).updated_at != run.updated_at  # the retry wrote
    assert "Done: nothing is stored encrypted any more" in out, out
    with keys():  # the keys removed, as "Done" says: the stored request still opens
        assert stored_request(FlowRun.objects.get(pk=run.pk))["method"] == "POST"
    assert "flow runs: decrypted 1 in" in out, out
    assert core.SEALED not in raw_column(FlowRun, "request", run.pk)
    assert MARKER not in raw_tables()
    with keys():
        if retry == "pauses-again":
            done: Any = post(client, FLOW, "f", {"card": card})
            assert done.status_code == 201 and json.loads(done.content)["resumed"] is True
    assert effects("flow-three") == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls")
def test_a_flow_run_changed_in_every_attempt_is_reported_not_done(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose ``updated_at`` moves before each write the pass tries: it is not written
    over (the phase's results stay), and the command says the next run goes on instead of
    "Done"."""
    run = paused_flow(client, "busy", "4111busy")

    def touch() -> None:  # what a pause or a state change writes, from a request meanwhile
        from django.utils import timezone

        FlowRun.objects.filter(pk=run.pk).update(updated_at=timezone.now())

    with decrypt_only(K1), before_write(monkeypatch, "reseal_flow_runs", touch, times=100):
        out = run_decrypt()
    assert "Done: nothing is stored encrypted" not in out, out
    assert "changed meanwhile" in out, out
    assert core.SEALED in raw_column(FlowRun, "request", run.pk)  # left for the next run
    with decrypt_only(K1):
        assert "Done: nothing is stored encrypted any more" in run_decrypt()
    assert MARKER not in raw_tables()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls")
def test_a_flow_run_changed_during_its_rotation_batch_is_not_left_with_the_old_key(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race in a key rotation (the loop is shared): "Done: the older keys can be
    removed" must not leave a run's request sealed with the older key."""
    run = paused_flow(client, "rot", "4111rot")

    def pause_again() -> str:
        with pytest.raises(ProbeError):
            post(Client(), FLOW, "rot", {"card": "4111rot"}, headers={"X-Flow-Raise": "three"})
        return "paused"

    out = StringIO()
    with keys(K2, K1), before_write(monkeypatch, "reseal_flow_runs", pause_again) as paused:
        call_command("idempotency_rotate_keys", stdout=out, stderr=StringIO())
    assert paused == ["paused"]
    assert f"Done: everything is sealed with key {KID2}" in out.getvalue(), out.getvalue()
    with keys(K2):  # the older key removed, as "Done" says
        assert stored_request(FlowRun.objects.get(pk=run.pk))["method"] == "POST"
        done: Any = post(client, FLOW, "rot", {"card": "4111rot"})
    assert done.status_code == 201 and json.loads(done.content)["resumed"] is True
    assert KID1.encode() not in raw_tables()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls")
def test_a_phased_request_in_progress_during_the_decryption(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed run holds its lease inside its foreign call (phase two) while the whole pass
    runs: the pass neither waits for it nor touches its record, it decrypts the run's stored
    request and results, and the request then completes, once, with nothing left sealed."""
    import threading

    from django.db import connections

    from testproject.shop import probe_flows

    with keys(K1), pytest.raises(ProbeError):
        post(client, FLOW, "busy", {"card": "4111busy"}, headers={"X-Flow-Raise": "one"})
    inside, go_on = threading.Event(), threading.Event()
    replies: list[Any] = []
    remote = probe_flows._remote

    def slow_remote(key: str, request: Any) -> Any:
        inside.set()
        assert go_on.wait(30)
        return remote(key, request)

    monkeypatch.setattr(probe_flows, "_remote", slow_remote)

    def resume() -> None:
        try:
            replies.append(post(Client(), FLOW, "busy", {"card": "4111busy"}))
        finally:
            connections.close_all()

    with decrypt_only(K1):
        thread = threading.Thread(target=resume)
        thread.start()
        assert inside.wait(30)
        [records, runs, _] = core.decrypt_stored(batch_size=1)
        assert (records.resealed, runs.resealed, runs.as_dict().get("changed", 0)) == (0, 1, 0)
        go_on.set()
        thread.join(30)
        [reply] = replies
        assert reply.status_code == 201 and json.loads(reply.content)["resumed"] is True
        again: Any = post(client, FLOW, "busy", {"card": "4111busy"})
        assert again["Idempotent-Replayed"] == "true" and again.content == reply.content
    assert MARKER not in raw_tables()
    assert effects("flow-one") == 1 and effects("flow-remote-call") == 1


# --- Erasure between the read and the write ----------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls")
def test_an_erasure_between_the_read_and_the_write_stays_erased(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "s3cr3t-erased"
    with keys(K1):
        post(client, URL, "gone", {"secret": text})
    paused_flow(client, "gone-flow", "4111gone")
    record = IdempotencyRecord.objects.get(key="gone")
    owner = record.owner

    def erase() -> int:
        out = StringIO()
        call_command("idempotency_erase", owner=owner, stdout=out)
        return IdempotencyRecord.objects.filter(key="gone", response_body=None).count()

    with decrypt_only(K1), before_write(monkeypatch, "reseal_records", erase) as erased:
        [records, runs, _] = core.decrypt_stored()
    assert erased == [1]
    assert records.resealed == 0 and runs.resealed == 1  # the paused run's record is not done
    after = IdempotencyRecord.objects.get(pk=record.pk)
    assert core.ERASED in after.response_headers and after.response_body is None
    assert text.encode() not in raw_tables() and MARKER not in raw_tables()
    with keys():
        again: Any = post(client, URL, "gone", {"secret": text})
    assert again.status_code == 410 and again["Content-Type"] == "application/problem+json"
    assert effects("secret") == 1


def test_an_erased_record_is_not_decrypted_or_revived(client: Client) -> None:
    with keys(K1):
        post(client, URL, "e", {"secret": "s3cr3t-e"})
    owner = IdempotencyRecord.objects.get(key="e").owner
    with decrypt_only(K1):
        core.erase_owner(owner)
        [records, *_] = core.decrypt_stored()
    assert (records.resealed, records.undecryptable) == (0, 0)
    row = IdempotencyRecord.objects.get(key="e")
    assert set(row.response_headers) == {core.ERASED} and row.response_body is None


# --- The relay between the read and the write --------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("null_default_transport")
def test_the_relay_sending_between_the_read_and_the_write_sends_once_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with keys(K1, OUTBOX_ENCRYPT=True):
        for n in range(3):
            with transaction.atomic():
                outbox.send("topic", {"n": n})
    transport = Recording()

    def drain() -> Any:
        return Relay(transports={"default": transport}).drain()

    with decrypt_only(K1), before_write(monkeypatch, "reseal_outbox", drain):
        [_, _, messages] = core.decrypt_stored(batch_size=2)
        Relay(transports={"default": transport}).drain()  # nothing left to send
    assert messages.resealed == 3 and messages.finished
    assert [m.payload for m in transport.sent] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert set(OutboxEntry.objects.values_list("state", flat=True)) == {OutboxEntry.State.SENT}
    assert MARKER not in raw_tables()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("null_default_transport")
def test_relays_sending_beside_the_decryption_send_each_message_once_opened() -> None:
    """Two relays, each on its own connection, send 60 sealed messages one at a time while
    the decryption rewrites them in batches of 2: each is sent exactly once, with the payload
    it was given (never the sealed form), and none is left sealed."""
    import threading

    from django.db import connections

    count = 60
    with keys(K1, OUTBOX_ENCRYPT=True):
        for n in range(count):
            with transaction.atomic():
                outbox.send("topic", {"n": n})
    transport, problems = Recording(), []
    lock = threading.Lock()

    class Locked(Recording):
        def send(self, messages: Any) -> list[BaseException | None]:
            with lock:
                return transport.send(messages)

    def relay() -> None:
        try:
            Relay(transports={"default": Locked()}, batch_size=1).drain()
        except Exception as exc:  # noqa: BLE001 - handed to the test thread, which asserts
            problems.append(repr(exc))
        finally:
            connections.close_all()

    with decrypt_only(K1):
        threads = [threading.Thread(target=relay) for _ in range(2)]
        for thread in threads:
            thread.start()
        [_, _, messages] = core.decrypt_stored(batch_size=2)
        for thread in threads:
            thread.join(120)
        Relay(transports={"default": transport}).drain()  # what the relays had not reached
    assert not problems, problems
    assert messages.finished and messages.undecryptable == 0
    assert messages.as_dict().get("changed", 0) == 0
    assert sorted(m.payload["n"] for m in transport.sent) == list(range(count))
    assert set(OutboxEntry.objects.values_list("state", flat=True)) == {OutboxEntry.State.SENT}
    assert MARKER not in raw_tables()


@pytest.mark.usefixtures("null_default_transport")
def test_done_names_outbox_encrypt_when_it_is_still_set() -> None:
    """W053 lets ``OUTBOX_ENCRYPT`` stay in decrypt-only mode. Removing only the two settings
    that "Done" names would leave it without keys: E051, and ``outbox.send()`` raising."""
    with keys(K1, OUTBOX_ENCRYPT=True), transaction.atomic():
        outbox.send("topic", {"n": 1})
    with decrypt_only(K1, OUTBOX_ENCRYPT=True):
        out = run_decrypt()
    assert "Done: nothing is stored encrypted any more" in out, out
    assert "remove ENCRYPTION_KEYS, ENCRYPTION_MODE and OUTBOX_ENCRYPT together" in out, out
    with decrypt_only(K1):
        out = run_decrypt()
    assert "remove ENCRYPTION_KEYS and ENCRYPTION_MODE together" in out, out


# --- The associated data still binds sealed values ---------------------------------------------


def test_a_sealed_response_copied_to_another_record_does_not_open_there(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with keys(K1):
        post(client, URL, "victim", {"secret": "s3cr3t-victim"})
        post(client, URL, "thief", {"secret": "s3cr3t-thief"})
    victim = IdempotencyRecord.objects.get(key="victim")
    IdempotencyRecord.objects.filter(key="thief").update(
        response_headers=victim.response_headers, response_body=victim.response_body
    )
    thief = IdempotencyRecord.objects.get(key="thief")
    with decrypt_only(K1):
        replay: Any = post(client, URL, "thief", {"secret": "s3cr3t-thief"})
        assert replay.status_code == 422 and b"s3cr3t-victim" not in replay.content
        assert replay["Content-Type"] == "application/problem+json"
        [records, *_] = core.decrypt_stored()
    assert (records.resealed, records.undecryptable) == (1, 1)
    assert f"record id={thief.pk} key_id={KID1}" in caplog.text
    assert "s3cr3t-victim" not in raw_column(IdempotencyRecord, "response_body", thief.pk)
    assert "s3cr3t-victim" in raw_column(IdempotencyRecord, "response_body", victim.pk)


@pytest.mark.usefixtures("null_default_transport")
def test_a_sealed_payload_copied_to_another_message_does_not_open_there() -> None:
    with keys(K1, OUTBOX_ENCRYPT=True):
        for n in range(2):
            with transaction.atomic():
                outbox.send("topic", {"n": n})
    first, second = OutboxEntry.objects.order_by("pk")
    OutboxEntry.objects.filter(pk=second.pk).update(payload=first.payload)
    with decrypt_only(K1):
        [_, _, messages] = core.decrypt_stored()
    assert (messages.resealed, messages.undecryptable) == (1, 1)
    assert OutboxEntry.objects.get(pk=first.pk).payload == {"n": 0}
    assert core.SEALED in OutboxEntry.objects.get(pk=second.pk).payload


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls")
def test_a_sealed_flow_request_copied_to_another_run_does_not_open_there(client: Client) -> None:
    victim = paused_flow(client, "victim-flow", "4111-victim")
    thief = paused_flow(client, "thief-flow", "4111-thief")
    FlowRun.objects.filter(pk=thief.pk).update(request=victim.request)
    with decrypt_only(K1):
        [_, runs, _] = core.decrypt_stored()
    assert (runs.resealed, runs.undecryptable) == (1, 1)
    stolen = raw_column(FlowRun, "request", thief.pk).encode("latin-1")
    assert not [form for form in forms_of("4111-victim") if form in stolen]
    opened = FlowRun.objects.get(pk=victim.pk).request
    assert b"4111-victim" in base64.b64decode(opened["body"])
    with keys(K1), pytest.raises(ValueError, match="cannot be decrypted"):
        stored_request(FlowRun.objects.get(pk=thief.pk))


@pytest.mark.parametrize("other", ["order-7", "ORDER-7", "Order-7x"])
def test_keys_that_differ_only_in_case_are_each_decrypted_with_their_own_binding(
    client: Client, other: str
) -> None:
    """MariaDB's default collations ignore case: the records of ``Order-7`` and of a key that
    differs only in case stay two records, each bound to its own key, and each opens."""
    with keys(K1):
        first: Any = post(client, URL, "Order-7", {"secret": "s3cr3t-a"})
        second: Any = post(client, URL, other, {"secret": "s3cr3t-b"})
    with decrypt_only(K1):
        [records, *_] = core.decrypt_stored()
    assert (records.resealed, records.undecryptable) == (2, 0)
    with keys():
        for key, text, reply in (("Order-7", "s3cr3t-a", first), (other, "s3cr3t-b", second)):
            again: Any = post(client, URL, key, {"secret": text})
            assert again["Idempotent-Replayed"] == "true" and again.content == reply.content


# --- Undecryptable rows in the middle of a batch -----------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls", "null_default_transport")
def test_undecryptable_rows_in_the_middle_of_each_batch_are_left_and_the_rest_done(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    for index, key in enumerate([K1, K2, K1]):
        with keys(key, OUTBOX_ENCRYPT=True):
            post(client, URL, f"r{index}", {"secret": f"s3cr3t-r{index}"})
            with transaction.atomic():
                outbox.send("topic", {"n": index})
            with pytest.raises(ProbeError):
                post(client, FLOW, f"f{index}", {"card": "4111"}, headers={"X-Flow-Raise": "two"})
    with decrypt_only(K1):
        out = run_decrypt(batch_size=3)
    for table in ("idempotency records", "flow runs", "outbox messages"):
        assert (
            f"{table}: decrypted 2 in 1 batch " in out
            and "1 undecryptable left as they are" in out
        )
    assert "Done" not in out and "Put their key back and run again" in out
    assert raw_tables().count(KID2.encode()) == 4  # the record's marker, run's two, message's
    assert KID1.encode() not in raw_tables()
    assert caplog.text.count(f"key_id={KID2}") == 3
    with decrypt_only(K2, K1):  # the key put back: the next run does the rest
        assert "Done: nothing is stored encrypted any more" in run_decrypt()
    assert MARKER not in raw_tables()


# --- Back to encrypt after a partial pass ------------------------------------------------------


class Stop(Exception):
    pass


def test_back_to_encrypt_after_a_partial_pass_seals_everything_again(client: Client) -> None:
    firsts: dict[str, tuple[str, Any]] = {}
    with keys(K1):
        for index in range(6):
            text = f"s3cr3t-{index}"
            firsts[f"k{index}"] = (text, post(client, URL, f"k{index}", {"secret": text}))

    def stop(*args: Any) -> None:
        raise Stop

    with decrypt_only(K1), pytest.raises(Stop):
        core.decrypt_stored(batch_size=3, progress=stop)
    stored = [
        core.stored_key_id(h)
        for h in IdempotencyRecord.objects.values_list("response_headers", flat=True).order_by(
            "pk"
        )
    ]
    assert stored == [None] * 3 + [KID1] * 3
    with keys(K2, K1):  # encryption back on, with a new key first
        text = "s3cr3t-new"
        firsts["new"] = (text, post(client, URL, "new", {"secret": text}))
        [records, *_] = core.rotate_keys()
        assert records.resealed == 6 and records.finished
        for key, (text, first) in firsts.items():
            again: Any = post(client, URL, key, {"secret": text})
            assert again["Idempotent-Replayed"] == "true"
            assert (again.status_code, again.content) == (first.status_code, first.content)
    assert {
        core.stored_key_id(h)
        for h in IdempotencyRecord.objects.values_list("response_headers", flat=True)
    } == {KID2}
    assert b"s3cr3t" not in raw_tables()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls")
def test_phased_requests_resumed_beside_the_decryption_are_all_left_in_plaintext() -> None:
    """Threads resume (half of them to pause again after phase three) 30 sealed paused runs
    while the decryption runs in batches of 2: no 500, every run done once, and nothing
    sealed once the command (run again if it says so) says Done."""
    import threading

    from django.db import connections

    count = 30
    client = Client()
    for index in range(count):
        paused_flow(client, f"p{index}", f"4111p{index}")
    problems: list[str] = []
    statuses: list[Any] = []

    def resume(indexes: range) -> None:
        mine = Client()
        try:
            for index in indexes:
                headers = {"X-Flow-Raise": "three"} if index % 2 else {}
                try:
                    reply: Any = post(
                        mine, FLOW, f"p{index}", {"card": f"4111p{index}"}, headers=headers
                    )
                    statuses.append(reply.status_code)
                    if reply.status_code >= 500:
                        problems.append(f"p{index}: {reply.status_code} {reply.content[:200]!r}")
                except ProbeError:
                    statuses.append("paused")
        except Exception as exc:  # noqa: BLE001 - handed to the test thread, which asserts
            problems.append(repr(exc))
        finally:
            connections.close_all()

    with decrypt_only(K1):
        threads = [threading.Thread(target=resume, args=(range(n, count, 3),)) for n in range(3)]
        for thread in threads:
            thread.start()
        outs = [run_decrypt(batch_size=2)]
        for thread in threads:
            thread.join(120)
        while "Done: nothing is stored encrypted any more" not in outs[-1]:
            assert len(outs) < 3, outs
            outs.append(run_decrypt())
    assert not problems, problems[:5]
    assert MARKER not in raw_tables(), outs
    with keys():  # the keys removed: each paused run resumes and completes
        for index in range(1, count, 2):
            if FlowRun.objects.get(record__key=f"p{index}").state != FlowRun.State.COMPLETED:
                done: Any = post(client, FLOW, f"p{index}", {"card": f"4111p{index}"})
                assert done.status_code == 201, done.content
    assert effects("flow-three") == count


# --- REPEATABLE READ ---------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.mysql
@pytest.mark.django_db(transaction=True, databases=["default", "repeatable_read"])
@pytest.mark.parametrize("using", ["default", "repeatable_read"])
def test_an_erasure_committed_while_a_batch_waits_for_its_lock(
    client: Client, monkeypatch: pytest.MonkeyPatch, using: str
) -> None:
    """An erasure holds a record's lock when the batch's write reaches it, and commits while
    the write waits: at READ COMMITTED and at REPEATABLE READ (PostgreSQL fails such a write
    with a serialization failure instead of skipping it), the pass skips the erased record, does
    the others, and the tombstone stays."""
    import threading
    import time
    import uuid

    from django.db import connections

    with keys(K1):
        for index in range(3):
            post(client, URL, f"r{index}", {"secret": f"s3cr3t-r{index}"})
    locked, problems = threading.Event(), []

    def erase_slowly() -> None:
        try:
            with transaction.atomic():
                IdempotencyRecord.objects.select_for_update().filter(key="r1").update(
                    token=uuid.uuid4(), response_headers={core.ERASED: "now"}, response_body=None
                )
                locked.set()
                time.sleep(0.5)  # the batch's write waits for this lock meanwhile
        except Exception as exc:  # noqa: BLE001 - handed to the test thread, which asserts
            problems.append(repr(exc))
        finally:
            connections.close_all()

    eraser = threading.Thread(target=erase_slowly)

    def lock_first() -> None:
        eraser.start()
        assert locked.wait(10)

    with decrypt_only(K1), before_write(monkeypatch, "reseal_records", lock_first):
        [records, *_] = core.decrypt_stored(using=using)
    eraser.join(10)
    assert not problems, problems
    assert (records.resealed, records.undecryptable) == (2, 0)
    assert records.as_dict().get("changed", 0) == 0  # written again after the conflict
    erased = IdempotencyRecord.objects.get(key="r1")
    assert erased.response_headers == {core.ERASED: "now"} and erased.response_body is None
    assert MARKER not in raw_tables()


# --- A connection cut in the middle of the pass -------------------------------------------------


@pytest.mark.postgres
@pytest.mark.mysql
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_connection_cut_at_a_batch_commit_loses_nothing_and_the_next_run_finishes(
    when: str,
) -> None:
    """The pass's connection cut at its second batch's ``COMMIT``, before the server gets it
    (the batch rolls back) or after it answered (the batch took effect, unheard): each record
    is sealed or in plaintext, none broken, and the next run does exactly the rest. (A network
    cut needs a server: PostgreSQL and MariaDB.)"""
    from django.db import DatabaseError, InterfaceError

    from django_idempotency.protection.keys import Keyring
    from tests.db_proxy import proxy_for, repointed
    from tests.test_db_faults import COMMIT
    from tests.test_protection_rotation import seed

    bodies = seed(Keyring((RAW1,)), 9)
    with proxy_for(connection.settings_dict) as proxy:
        armed: list[Any] = []

        def cut_next_commit(*args: Any) -> None:  # after the first batch committed
            if not armed:
                armed.append(proxy.cut(COMMIT, when=when))

        with (
            decrypt_only(K1),
            repointed("default", proxy.port),
            pytest.raises((DatabaseError, InterfaceError)),
        ):
            core.decrypt_stored(batch_size=3, progress=cut_next_commit)
        assert proxy.faults[f"cut_{when}"] == 1
    left = 6 if when == "before" else 3
    stored = IdempotencyRecord.objects.values_list("response_headers", flat=True)
    assert sum(core.SEALED in headers for headers in stored) == left
    with decrypt_only(K1):
        [records, *_] = core.decrypt_stored(batch_size=3)
    assert (records.resealed, records.undecryptable, records.finished) == (left, 0, True)
    for key, headers, body in IdempotencyRecord.objects.values_list(
        "key", "response_headers", "response_body"
    ):
        assert (headers, bytes(body or b"-")) == ({"Content-Type": "x/y"}, bodies[key])


# --- The admin ---------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("remote_calls", "null_default_transport")
def test_the_admin_never_shows_a_key_in_decrypt_only_mode(client: Client) -> None:
    with keys(K1, OUTBOX_ENCRYPT=True):
        post(client, URL, "r", {"secret": "s3cr3t-r"})
        with transaction.atomic():
            outbox.send("topic", {"n": 1})
        with pytest.raises(ProbeError):
            post(client, FLOW, "f", {"card": "4111"}, headers={"X-Flow-Raise": "two"})
    admin = Client()
    admin.force_login(User.objects.create_superuser("root", "root@example.com", "x"))
    pages = [
        reverse("admin:django_idempotency_idempotencyrecord_changelist"),
        reverse("admin:django_idempotency_flowrun_changelist"),
        reverse("admin:django_idempotency_outboxentry_changelist"),
        reverse(
            "admin:django_idempotency_idempotencyrecord_change",
            args=[IdempotencyRecord.objects.get(key="r").pk],
        ),
        reverse("admin:django_idempotency_flowrun_change", args=[FlowRun.objects.get().pk]),
        reverse(
            "admin:django_idempotency_outboxentry_change", args=[OutboxEntry.objects.get().pk]
        ),
    ]
    forms = [K1, RAW1.hex(), base64.b64encode(RAW1).decode(), K1.rstrip("=")]
    with decrypt_only(K1):
        for moment in ("before", "after"):
            for page in pages:
                response = admin.get(page)
                assert response.status_code == 200, (moment, page)
                text = response.content.decode()
                assert not [form for form in forms if form in text], (moment, page)
            core.decrypt_stored()
