"""The relay's decisions, against the real database, with an in-process transport.

Claim, send, record; ordering keys never overtaken (a failure, a backoff, a lease or a parked
message blocks the messages after it); backoff, parking, requeue; the command and the beat task.
Real brokers and real processes are in ``test_outbox_proofs.py``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from io import StringIO
from typing import Any
from unittest import mock

import pytest
from django.core.checks import run_checks
from django.core.management import call_command
from django.db import close_old_connections, transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.capture import is_change_capture
from django_idempotency.outbox.relay import BatchResult, Relay
from django_idempotency.outbox.transports import (
    CeleryTransport,
    OutboxMessage,
    Transport,
    build_transport,
    close_transports,
    get_transport,
)
from django_idempotency.retention.purge import purge_all
from django_idempotency.tasks import relay_outbox

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("null_default_transport")]


class RecordingTransport:
    """Acknowledges every message (or fails the ones ``fail`` picks) and remembers the calls."""

    def __init__(self, fail: Callable[[OutboxMessage], BaseException | None] | None = None):
        self.fail = fail
        self.calls: list[list[OutboxMessage]] = []
        self.closed = False

    def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        self.calls.append(list(messages))
        results: list[BaseException | None] = []
        failed: set[str] = set()
        for message in messages:
            if message.ordering_key is not None and message.ordering_key in failed:
                results.append(RuntimeError("behind a failure"))
                continue
            error = self.fail(message) if self.fail else None
            if error is not None and message.ordering_key is not None:
                failed.add(message.ordering_key)
            results.append(error)
        return results

    def close(self) -> None:
        self.closed = True

    @property
    def sent(self) -> list[str]:
        return [m.destination for call in self.calls for m in call]


def write(*destinations: str, key: str | None = None, transport: str = "default") -> list[str]:
    with transaction.atomic():
        return [outbox.send(d, {"d": d}, key=key, transport=transport) for d in destinations]


def states() -> dict[str, str]:
    return dict(OutboxEntry.objects.values_list("destination", "state"))


def relay(transport: Transport, **kwargs: Any) -> Relay:
    return Relay(transports={"default": transport}, backoff=0.001, max_backoff=0.001, **kwargs)


def test_idle_relay_does_nothing() -> None:
    result = relay(RecordingTransport()).run_once()
    assert (result.claimed, result.sent, result.batches) == (0, 0, 0)


def test_sends_in_id_order_then_marks_sent_with_an_expiry() -> None:
    write("a", "b", key="k")
    write("c")
    transport = RecordingTransport()

    result = relay(transport).run_once()

    assert (result.claimed, result.sent) == (3, 3)
    assert transport.sent == ["a", "b", "c"]
    message = transport.calls[0][0]
    assert (message.attempts, message.ordering_key, message.payload) == (1, "k", {"d": "a"})
    for row in OutboxEntry.objects.all():
        assert row.state == "sent"
        assert row.sent_at is not None and row.expires_at is not None
        assert row.expires_at - row.sent_at == timedelta(days=7)
        assert row.locked_until is None
    assert relay(transport).run_once().claimed == 0  # sent once


def test_batch_size_bounds_a_batch_and_drain_empties_the_outbox() -> None:
    write(*[f"m{i}" for i in range(7)])
    transport = RecordingTransport()

    assert relay(transport, batch_size=3).run_once().sent == 3
    total = relay(transport, batch_size=3).drain()

    assert (total.sent, total.batches) == (4, 2)
    assert transport.sent == [f"m{i}" for i in range(7)]


def test_a_failure_blocks_the_rest_of_its_key_but_not_other_keys() -> None:
    write("k1", "k2", "k3", key="k")
    write("other")
    transport = RecordingTransport(
        lambda m: ConnectionError("nope") if m.destination == "k2" else None
    )

    result = relay(transport).run_once()

    assert (result.sent, result.failed, result.released) == (2, 1, 1)
    assert states() == {"k1": "sent", "k2": "pending", "k3": "pending", "other": "sent"}
    k2 = OutboxEntry.objects.get(destination="k2")
    k3 = OutboxEntry.objects.get(destination="k3")
    assert (k2.attempts, k2.last_error) == (1, "ConnectionError: nope")
    assert k2.available_at is not None
    assert (k3.attempts, k3.last_error, k3.available_at) == (0, "", None)  # not counted


def test_the_relay_never_marks_sent_a_message_behind_a_failure() -> None:
    """Even if a transport breaks the contract and acknowledges it."""
    write("first", "second", key="k")

    def only_first_fails(message: OutboxMessage) -> BaseException | None:
        return OSError("down") if message.destination == "first" else None

    class Careless(RecordingTransport):
        def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
            self.calls.append(list(messages))
            return [only_first_fails(m) for m in messages]

    relay(Careless()).run_once()

    assert states() == {"first": "pending", "second": "pending"}


def test_a_message_in_backoff_blocks_its_key() -> None:
    write("first", key="k")
    failing = RecordingTransport(lambda m: OSError("down"))
    Relay(transports={"default": failing}, backoff=3600, max_backoff=3600).run_once()
    write("second", key="k")
    write("free")
    transport = RecordingTransport()

    relay(transport).run_once()

    assert transport.sent == ["free"]
    assert states() == {"first": "pending", "second": "pending", "free": "sent"}


def test_retries_after_the_backoff_and_succeeds() -> None:
    write("m", key="k")
    flaky = iter([OSError("down"), None])
    transport = RecordingTransport(lambda m: next(flaky))

    # A backoff of an hour (at least half of it with the jitter): the second run is in it
    # however slow the machine, and the test moves available_at to end it.
    first = Relay(transports={"default": transport}, backoff=3600, max_backoff=3600)
    assert first.run_once().failed == 1
    assert first.run_once().claimed == 0  # still in backoff
    OutboxEntry.objects.update(available_at=timezone.now() - timedelta(seconds=1))
    assert first.run_once().sent == 1
    row = OutboxEntry.objects.get()
    assert (row.state, row.attempts, row.last_error) == ("sent", 2, "")


def test_backoff_doubles_with_jitter_and_is_capped() -> None:
    subject = Relay(backoff=1.0, max_backoff=10.0)
    for attempts, ceiling in [(1, 1), (2, 2), (3, 4), (4, 8), (5, 10), (40, 10)]:
        delays = [subject._delay(attempts) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)


def test_parked_after_the_cap_never_dropped_and_blocking_its_key() -> None:
    write("poison", "next", key="k")
    transport = RecordingTransport(
        lambda m: ValueError("bad") if m.destination == "poison" else None
    )
    subject = relay(transport, max_attempts=3)

    for _ in range(3):
        OutboxEntry.objects.update(available_at=None)
        subject.run_once()

    poison = OutboxEntry.objects.get(destination="poison")
    assert (poison.state, poison.attempts, poison.last_error) == ("parked", 3, "ValueError: bad")
    assert poison.expires_at is None  # never purged
    assert subject.run_once().claimed == 0  # "next" waits behind the parked message
    assert states()["next"] == "pending"
    purge_all()
    assert OutboxEntry.objects.count() == 2

    # Requeued (the admin action does this), it goes again, and "next" follows.
    OutboxEntry.objects.filter(state="parked").update(state="pending", attempts=0)
    transport.fail = None
    assert subject.drain().sent == 2
    assert transport.sent[-2:] == ["poison", "next"]


def test_a_leased_message_is_not_taken_until_its_lease_runs_out() -> None:
    write("a", "b", key="k")

    class Dies(RecordingTransport):
        def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
            raise KeyboardInterrupt  # the relay dies mid-batch: nothing recorded

    with pytest.raises(KeyboardInterrupt):
        relay(Dies(), lease=3600).run_once()

    other = RecordingTransport()
    assert relay(other).run_once().claimed == 0  # leased, and "b" waits behind "a"
    OutboxEntry.objects.update(locked_until=timezone.now() - timedelta(seconds=1))
    # Each row whose lease ran out goes alone: it may be the one that killed the relay.
    assert relay(other).drain().as_dict() == {
        **BatchResult().as_dict(),
        "claimed": 2,
        "sent": 2,
        "batches": 2,
    }
    assert [len(call) for call in other.calls] == [1, 1]
    assert other.sent == ["a", "b"]
    assert OutboxEntry.objects.get(destination="a").attempts == 2  # the lost attempt counts


class DiesOn(RecordingTransport):
    """Sends what comes before the message to ``poison`` in its batch, then the relay "dies"
    (nothing recorded), as a segfault or an ``os._exit`` in a client library would."""

    def __init__(self, poison: str) -> None:
        super().__init__()
        self.poison = poison

    def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        self.calls.append(list(messages))
        if any(m.destination == self.poison for m in messages):
            raise KeyboardInterrupt
        return [None] * len(messages)


def expire_leases() -> None:
    OutboxEntry.objects.filter(locked_until__isnull=False).update(
        locked_until=timezone.now() - timedelta(seconds=1)
    )


def test_a_message_that_kills_the_relay_is_parked_at_claim_once_its_attempts_are_used() -> None:
    """Issue 25 item 5: parking happened only when an outcome was recorded, so a message whose
    send killed the relay was sent for ever, and took its healthy batch-mates with it."""
    write("poison", key="bad")
    write("then", key="bad")
    write("healthy", key="good")
    transport = DiesOn("poison")
    deaths = 0
    for _ in range(10):
        try:
            result = relay(transport, max_attempts=3).drain()
        except KeyboardInterrupt:
            deaths += 1
            expire_leases()
            continue
        break
    assert deaths == 3
    assert result.parked == 1
    row = OutboxEntry.objects.get(destination="poison")
    assert (row.state, row.attempts, row.locked_until) == ("parked", 3, None)
    assert "lease ran out 3 times" in row.last_error
    # The healthy message went out with the first (fatal) batch only, then alone, once.
    sends = [m.destination for call in transport.calls for m in call]
    assert sends.count("poison") == 3
    assert sends.count("healthy") == 2  # the fatal batch, then its own batch
    assert states() == {"poison": "parked", "then": "pending", "healthy": "sent"}
    # The poison message holds back its own key only, until it is requeued.
    assert relay(RecordingTransport()).drain().claimed == 0


def test_a_suspect_goes_alone_and_its_batch_mates_are_not_resent_each_death() -> None:
    write("poison", key="bad")
    write(*[f"ok-{n}" for n in range(5)], key="fine")
    write(*[f"free-{n}" for n in range(5)])
    transport = DiesOn("poison")
    deaths = 0
    for _ in range(20):
        try:
            relay(transport, max_attempts=5).drain()
        except KeyboardInterrupt:
            deaths += 1
            expire_leases()
            continue
        break
    assert deaths == 5
    sends = [m.destination for call in transport.calls for m in call]
    assert sends.count("poison") == 5
    # Each healthy message: once in the fatal first batch, and once alone or in a later batch.
    assert all(sends.count(d) <= 2 for d in sends if d != "poison"), sends
    assert OutboxEntry.objects.exclude(destination="poison").filter(state="sent").count() == 10


def test_a_key_spanning_two_transports_keeps_its_order() -> None:
    transports = {
        "default": {"BACKEND": "tests.outbox_helpers.NullTransport"},
        "other": {"BACKEND": "tests.test_relay.RecordingTransport"},
    }
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": transports}):
        write("d1", key="k")
        write("o1", key="k", transport="other")
        write("d2", key="k")
    default, other = RecordingTransport(), RecordingTransport()
    subject = Relay(transports={"default": default, "other": other})

    assert subject.run_once().sent == 1
    assert subject.run_once().sent == 1
    assert subject.run_once().sent == 1
    assert (default.sent, other.sent) == (["d1", "d2"], ["o1"])
    by_time = OutboxEntry.objects.order_by("sent_at", "id")
    assert list(by_time.values_list("destination", flat=True)) == ["d1", "o1", "d2"]


def test_a_transport_that_raises_fails_its_batch_and_nothing_is_lost() -> None:
    write("a", "b")

    class Broken(RecordingTransport):
        def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
            raise RuntimeError("bug in the transport")

    result = relay(Broken()).run_once()

    assert (result.failed, result.sent) == (2, 0)
    assert set(OutboxEntry.objects.values_list("last_error", flat=True)) == {
        "RuntimeError: bug in the transport"
    }


def test_a_bad_outbox_ttl_raises_before_anything_is_sent() -> None:
    """OUTBOX_TTL was first read when the batch was recorded, after the broker had it: the
    relay raised there and left the batch leased, and every run (a beat task, which no system
    check guards) sent it again, attempts climbing and never parked."""
    from django.core.exceptions import ImproperlyConfigured

    write("a")
    transport = RecordingTransport()

    with (
        override_settings(IDEMPOTENCY={"OUTBOX_TTL": "7 days"}),
        pytest.raises(ImproperlyConfigured, match="OUTBOX_TTL"),
    ):
        relay(transport).run_once()

    assert transport.calls == []
    row = OutboxEntry.objects.get()
    assert (row.state, row.attempts, row.locked_until) == ("pending", 0, None)


@pytest.mark.parametrize(
    ("message", "kept"),
    [("disk\x00full", "disk\\x00full"), ("no file caf\udce9", "no file caf\\udce9")],
    ids=["nul", "lone-surrogate"],
)
def test_an_error_the_database_cannot_store_is_recorded_escaped(message: str, kept: str) -> None:
    """A NUL (refused by PostgreSQL's text columns) or a lone surrogate (an undecodable file
    name, not UTF-8) in an error failed the record's transaction: the acknowledged message of
    the batch was not marked sent, so it was sent again after every lease, and the failing one
    never parked."""
    write("bad")
    write("good")
    transport = RecordingTransport(lambda m: OSError(message) if m.destination == "bad" else None)

    result = relay(transport, max_attempts=1).run_once()

    assert (result.sent, result.parked) == (1, 1)
    assert states() == {"bad": "parked", "good": "sent"}
    assert OutboxEntry.objects.get(destination="bad").last_error == f"OSError: {kept}"


@pytest.mark.parametrize(
    ("returned", "error"),
    [
        (None, "returned None, not a list of 2 results"),
        ("ok", "returned 'ok', not a list of 2 results"),
        ([True, True], "returned True for event .*, not None \\(sent\\) or an exception"),
    ],
    ids=["none", "a-string", "not-results"],
)
def test_a_transport_that_returns_garbage_fails_with_a_clear_error(
    returned: Any, error: str
) -> None:
    """Not a list (None), or results that are neither None nor an exception, were recorded as
    "TypeError: object of type 'NoneType' has no len()" or "bool: True": retried, but nothing
    said that the transport broke its contract."""
    write("a", "b")

    class Garbage(RecordingTransport):
        def send(self, messages: Sequence[OutboxMessage]) -> Any:
            return returned

    result = relay(Garbage()).run_once()

    assert (result.sent, result.failed) == (0, 2)
    for row in OutboxEntry.objects.all():
        assert row.state == "pending" and row.available_at is not None
        assert re.search(f"^[A-Za-z]+Error: transport 'default' {error}", row.last_error)


def test_eager_celery_a_failing_task_fails_its_own_message_only() -> None:
    """With ``task_always_eager`` the Celery transport has no broker connection, and took a
    task's exception for a lost broker: every later message of the batch, of any key or of
    none, was reported failed with that task's error and had an attempt counted."""
    from celery import Celery

    app = Celery("eager-outbox", set_as_current=False)
    app.conf.task_always_eager = True
    ran: list[int] = []

    @app.task(name="outbox.fails")
    def fails(n: int) -> None:
        raise ValueError("the task failed")

    @app.task(name="outbox.works")
    def works(n: int) -> None:
        ran.append(n)

    with transaction.atomic():
        outbox.publish("outbox.fails", kwargs={"n": 0}, key="a")
        outbox.publish("outbox.works", kwargs={"n": 1}, key="b")
        outbox.publish("outbox.works", kwargs={"n": 2})

    result = relay(CeleryTransport(app=app)).run_once()

    assert (result.sent, result.failed) == (2, 1)
    assert ran == [1, 2]
    rows = OutboxEntry.objects.order_by("id").values_list("state", "attempts", "last_error")
    assert list(rows) == [
        ("pending", 1, "ValueError: the task failed"),
        ("sent", 1, ""),
        ("sent", 1, ""),
    ]


def test_the_relay_keeps_its_transports_broker_calls_within_a_quarter_of_its_lease() -> None:
    """A silent broker must fail the batch before the lease runs out and another relay sends
    it again: the relay hands its lease to a transport that can bound its calls."""
    from celery import Celery

    transport = CeleryTransport(app=Celery("lease-bound", set_as_current=False), timeout=10.0)
    # The transport the relay sends a batch with (nothing is sent: no broker is needed here).
    assert relay(transport, lease=8)._transport("default") is transport
    assert (transport.timeout, transport.connect_timeout) == (2.0, 2.0)
    relay(transport, lease=60)._transport("default")  # a longer lease never loosens the bound
    assert transport.timeout == 2.0


def test_an_unknown_transport_name_fails_the_message_with_the_reason() -> None:
    write("a")
    OutboxEntry.objects.update(transport="gone")

    relay(RecordingTransport()).run_once()

    assert "no transport named 'gone'" in OutboxEntry.objects.get().last_error


@pytest.mark.django_db(transaction=True)
def test_two_relays_in_threads_send_each_message_once_in_key_order() -> None:
    for key in range(10):
        write(*[f"{key}:{seq}" for seq in range(20)], key=str(key))
    write(*[f"free:{n}" for n in range(50)])
    sent: list[str] = []
    lock = threading.Lock()

    class Shared(RecordingTransport):
        def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
            with lock:
                sent.extend(m.destination for m in messages)
            return [None] * len(messages)

    errors: list[BaseException] = []

    def run() -> None:
        try:
            Relay(transports={"default": Shared()}, batch_size=7).drain()
        except BaseException as exc:  # noqa: BLE001 (collected, and the test fails on it)
            errors.append(exc)
        finally:
            close_old_connections()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    # A claim that took SQLite's lock late (a deferred BEGIN) crashed one relay with
    # "database is locked", and the other relay then sent everything: that passed unseen.
    assert errors == [], errors
    Relay(transports={"default": Shared()}).drain()  # what the two left behind a lease, if any

    assert sorted(sent) == sorted(set(sent)) and len(sent) == 250
    for key in range(10):
        assert [d for d in sent if d.startswith(f"{key}:")] == [f"{key}:{s}" for s in range(20)]


# --- Configuration, command, task, purge, checks ---------------------------------------------


def test_transports_are_built_from_the_setting_once_per_process() -> None:
    transports = {
        "default": {"BACKEND": "tests.test_relay.RecordingTransport", "OPTIONS": {"fail": None}},
    }
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": transports}):
        close_transports()
        first = get_transport("default")
        assert isinstance(first, RecordingTransport)
        assert get_transport("default") is first
        close_transports()
        assert first.closed
        assert get_transport("default") is not first
        close_transports()


class OtherRecordingTransport(RecordingTransport):
    """What a test patches in at ``RecordingTransport``'s dotted path."""


def test_a_class_patched_at_the_backend_path_is_built_once_the_setting_changes() -> None:
    """``mock.patch`` of a transport class at its ``BACKEND`` path, then ``override_settings``
    (or ``close_transports()``): the next transport is built from the patched class, and
    ``send()`` asks the patched class, as when every build imported the path afresh."""
    path = "tests.test_relay.RecordingTransport"
    transports = {"default": {"BACKEND": path}}
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": transports}):
        assert type(get_transport("default")) is RecordingTransport
    with (
        mock.patch(path, OtherRecordingTransport),
        override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": transports}),
    ):
        assert type(get_transport("default")) is OtherRecordingTransport
    with (
        mock.patch(path, OtherRecordingTransport),
        mock.patch.object(OtherRecordingTransport, "change_capture", True, create=True),
    ):
        close_transports()
        assert is_change_capture(path)
    close_transports()
    assert not is_change_capture(path)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"BACKEND": "tests.test_relay.Missing"}, "cannot import"),
        ({"BACKEND": "tests.test_relay.RecordingTransport", "OPTIONS": {"x": 1}}, "failed"),
        ({"BACKEND": "tests.test_relay.states"}, "send"),
    ],
    ids=["missing", "bad-options", "not-a-transport"],
)
def test_a_bad_transport_raises_improperly_configured(entry: dict[str, Any], match: str) -> None:
    from django.core.exceptions import ImproperlyConfigured

    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": {"default": entry}}):
        with pytest.raises(ImproperlyConfigured, match=match):
            build_transport("default")
        with pytest.raises(ImproperlyConfigured, match="No outbox transport named 'x'"):
            build_transport("x")


@pytest.mark.parametrize(
    ("value", "check_id"),
    [
        ({"kafka": {"BACKEND": "a.B"}}, "django_idempotency.E002"),
        ({"default": {"BACKEND": "nodots"}}, "django_idempotency.E002"),
        ({"default": {"BACKEND": "a.B", "OPTS": {}}}, "django_idempotency.E002"),
        ({"default": {"BACKEND": "no_such_module.Transport"}}, "django_idempotency.E030"),
        ({"default": {"BACKEND": "tests.test_relay.states"}}, "django_idempotency.E031"),
        # A misspelt option passed every check, then failed every message until it was parked.
        (
            {
                "default": {
                    "BACKEND": "django_idempotency.outbox.transports.CeleryTransport",
                    "OPTIONS": {"transaction": True},
                }
            },
            "django_idempotency.E032",
        ),
    ],
    ids=[
        "no-default",
        "not-dotted",
        "unknown-key",
        "not-importable",
        "not-a-transport",
        "unknown-option",
    ],
)
def test_system_checks_catch_bad_transports(value: Any, check_id: str) -> None:
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": value}):
        ids = [message.id for message in run_checks()]
    assert check_id in ids


@pytest.mark.parametrize(
    ("backend", "module", "extra"),
    [
        ("django_idempotency.outbox.transports.CeleryTransport", "celery", "celery"),
        ("tests.outbox_helpers.TimedTransport", "celery", "celery"),  # a subclass
        ("django_idempotency.kafka.transport.KafkaTransport", "confluent_kafka", "kafka"),
    ],
)
def test_a_transport_whose_library_is_missing_fails_check_e033_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, backend: str, module: str, extra: str
) -> None:
    """Issue 25 item 17: a bare install (no Celery) with an outbox used the Celery transport
    anyway; the relay failed with a raw ModuleNotFoundError 20 times, then parked."""
    import sys

    value = {"default": {"BACKEND": backend}}
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": value}):
        assert "django_idempotency.E033" not in [m.id for m in run_checks()]
        monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
        (message,) = [m for m in run_checks() if m.id == "django_idempotency.E033"]
    assert f"needs {module}" in message.msg
    assert f"django-idempotency[{extra}]" in str(message.hint)


def test_kafka_transport_without_confluent_kafka_fails_e033_not_e030(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 35 item 16: in a project without confluent-kafka, importing
    ``django_idempotency.kafka.transport`` itself fails (it imports confluent-kafka at its top),
    and the check reported E030 ("cannot be imported") where the docs promise E033 naming the
    extra. Simulated here by blocking the import and dropping the module already imported."""
    import sys

    monkeypatch.setitem(sys.modules, "confluent_kafka", None)  # import confluent_kafka fails
    monkeypatch.delitem(sys.modules, "django_idempotency.kafka.transport", raising=False)
    backend = "django_idempotency.kafka.transport.KafkaTransport"
    value = {"default": {"BACKEND": RECORDING_BACKEND}, "kafka": {"BACKEND": backend}}
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": value}):
        ours = [m for m in run_checks() if m.id.startswith("django_idempotency.")]
    assert [m.id for m in ours] == ["django_idempotency.E033"], [str(m) for m in ours]
    assert "['kafka']" in ours[0].msg
    assert "needs confluent_kafka" in ours[0].msg
    assert "django-idempotency[kafka]" in str(ours[0].hint)


def test_system_checks_accept_the_default_and_a_custom_transport() -> None:
    value = {
        "default": {
            "BACKEND": "django_idempotency.outbox.transports.CeleryTransport",
            "OPTIONS": {"transactions": False},
        },
        "other": {"BACKEND": "tests.test_relay.RecordingTransport"},
    }
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": value}):
        ids = [message.id for message in run_checks()]
    assert not [i for i in ids if i.startswith("django_idempotency.")]


RECORDING_BACKEND = "tests.test_relay.RecordingTransport"
RECORDING = {"default": {"BACKEND": RECORDING_BACKEND}}


def test_command_once_sends_what_is_due_and_prints_totals() -> None:
    write("a", "b")
    out = StringIO()
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": RECORDING}):
        close_transports()
        call_command("idempotency_relay", "--once", "--batch-size", "1", stdout=out)
    totals = json.loads(out.getvalue().strip().splitlines()[-1])
    assert (totals["sent"], totals["batches"]) == (2, 2)
    assert set(states().values()) == {"sent"}


def test_beat_task_sends_what_is_due() -> None:
    write("a")
    with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": RECORDING}):
        close_transports()
        totals = relay_outbox.delay(max_seconds=5).get()
        close_transports()
    assert totals["sent"] == 1
    assert states() == {"a": "sent"}


def test_purge_deletes_expired_sent_messages_only() -> None:
    write("old", "new", "pending")
    past = timezone.now() - timedelta(days=8)
    OutboxEntry.objects.filter(destination="old").update(
        state="sent", sent_at=past, expires_at=past + timedelta(days=7)
    )
    OutboxEntry.objects.filter(destination="new").update(
        state="sent", sent_at=timezone.now(), expires_at=timezone.now() + timedelta(days=7)
    )

    results = {r.label: r for r in purge_all()}

    assert results["django_idempotency.OutboxEntry"].deleted == 1
    assert states() == {"new": "sent", "pending": "pending"}
    stats = OutboxEntry.objects.stats()
    assert (stats.counts["pending"], stats.counts["parked"]) == (1, 0)


def test_lag_is_the_age_of_the_oldest_pending_message() -> None:
    assert OutboxEntry.objects.lag_seconds() == 0.0
    write("a")
    OutboxEntry.objects.update(created_at=timezone.now() - timedelta(seconds=30))
    assert 29 <= OutboxEntry.objects.lag_seconds() <= 60


def test_a_relay_that_lost_its_lease_does_not_clobber_the_new_holder() -> None:
    """Relay A's lease ran out and B took the row over; A's late failure changes nothing."""
    write("m", key="k")
    first, second = relay(RecordingTransport()), relay(RecordingTransport())
    (claimed_by_first,) = first._claim()
    OutboxEntry.objects.update(locked_until=timezone.now() - timedelta(seconds=1))
    (claimed_by_second,) = second._claim()

    first._record([claimed_by_first], [OSError("late")], BatchResult())

    row = OutboxEntry.objects.get()
    assert row.locked_until == claimed_by_second.locked_until
    assert (row.state, row.attempts, row.available_at, row.last_error) == ("pending", 2, None, "")
    # The holder's own outcome is recorded: the broker has it.
    second._record([claimed_by_second], [None], BatchResult())
    assert OutboxEntry.objects.get().state == "sent"


@pytest.mark.parametrize("blocker", ["parked", "backoff", "leased"])
def test_a_blocked_key_with_a_long_queue_does_not_starve_other_keys(blocker: str) -> None:
    """More messages wait behind a blocked head than a batch holds: other keys still go."""
    write("head", *[f"behind-{n}" for n in range(6)], key="stuck")
    write("free", key="other")
    blocked = {
        "parked": {"state": "parked"},
        "backoff": {"available_at": timezone.now() + timedelta(hours=1)},
        "leased": {"locked_until": timezone.now() + timedelta(hours=1)},
    }[blocker]
    OutboxEntry.objects.filter(destination="head").update(**blocked)
    transport = RecordingTransport()

    result = relay(transport, batch_size=3).run_once()

    assert transport.sent == ["free"]
    assert result.sent == 1
    assert OutboxEntry.objects.filter(ordering_key="stuck", state="sent").count() == 0


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--batch-size", "99999999999999999999"),
        ("--batch-size", "0"),
        ("--poll-interval", "nan"),
        ("--lease", "inf"),
        ("--backoff", "-1"),
    ],
)
def test_the_relay_command_refuses_options_out_of_range(option: str, value: str) -> None:
    """NaN, infinity and huge batch sizes were accepted, and failed later in the loop."""
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match=option.lstrip("-").split("-")[0]):
        call_command("idempotency_relay", "--once", option, value)


@pytest.mark.parametrize("mode", [["--once"], []], ids=["once", "serve"])
def test_the_relay_command_refuses_an_unknown_database(mode: list[str]) -> None:
    """``--database`` with a typo died with ConnectionDoesNotExist's traceback (after printing
    that the relay had started), where the purge command answers with a CommandError."""
    from django.core.management.base import CommandError

    out = StringIO()
    with pytest.raises(CommandError, match=r"Unknown database alias 'nosuch'.*DATABASES has"):
        call_command("idempotency_relay", *mode, "--database", "nosuch", stdout=out)
    assert out.getvalue() == ""


# --- Waking up: LISTEN/NOTIFY (PostgreSQL) ------------------------------------------------------


@contextmanager
def serving(relay: Relay) -> Iterator[threading.Thread]:
    """``relay.serve()`` with a poll interval far longer than any wait below: within them, only
    a notification (or listening again) can wake it. (The waits are guards against a hang, a
    minute each on a loaded machine; the poll interval, ten, keeps them far from a poll.)"""
    thread = threading.Thread(target=lambda: (relay.serve(poll_interval=600.0), close_conns()))
    thread.start()
    try:
        yield thread
    finally:
        relay.stop()
        thread.join(60)
        assert not thread.is_alive()


def close_conns() -> None:
    from django.db import connections

    connections.close_all()


def wait_for(condition: Callable[[], bool], seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def listener_pids() -> list[int]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE query = %s AND pid <> pg_backend_pid() "
            "AND datname = current_database()",  # other test runs listen on their databases
            [f"LISTEN {outbox.NOTIFY_CHANNEL}"],
        )
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.postgres
def test_under_another_driver_the_relay_polls_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A driver other than psycopg 3 and psycopg2 (whose LISTEN tests/test_relay_psycopg2.py
    shows): the relay polls and says why, once. (Django's backend names the driver module it
    loaded.)"""
    import types

    from django.db import connections

    from django_idempotency.outbox import store

    other = types.SimpleNamespace(__name__="otherpg")
    monkeypatch.setattr(connections["default"], "Database", other)
    with caplog.at_level("WARNING", logger="django_idempotency.outbox.relay"):
        assert store.Listener.open("default") is None
    assert [r.getMessage() for r in caplog.records] == [
        "outbox relay: LISTEN needs psycopg 3 or psycopg2; under otherpg the relay polls instead"
    ]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_notification_wakes_an_idle_relay() -> None:
    transport = RecordingTransport()
    with serving(relay(transport)):
        assert wait_for(lambda: bool(listener_pids()))
        write("woken")
        assert wait_for(lambda: transport.sent == ["woken"]), "no NOTIFY woke the relay"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_commit_notified_just_after_an_empty_claim_still_wakes_the_relay() -> None:
    """Regression: the relay read (and dropped) the waiting notifications after each batch, so
    a commit whose NOTIFY arrived between the claim and that read was slept through until the
    next poll (ten minutes here). CI saw it as a notification test that failed now and then."""
    transport = RecordingTransport()
    served = relay(transport)
    claim = served.run_once
    calls = 0

    def claim_then_commit() -> BatchResult:
        nonlocal calls
        calls += 1
        result = claim()
        if calls == 1:  # the claim found nothing; a producer commits before the relay waits
            write("late")
            time.sleep(0.3)  # its notification reaches the relay's socket
        return result

    served.run_once = claim_then_commit  # type: ignore[method-assign]
    with serving(served):
        assert wait_for(lambda: transport.sent == ["late"]), (
            "the relay slept through a notification"
        )


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_relay_listens_again_after_its_connection_is_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A database restart or a failover drops the LISTEN connection: the relay must listen
    again, not fall back to polling for the rest of its life."""
    from django.db import connection

    from django_idempotency.outbox.store import Listener as _Listener

    monkeypatch.setattr(_Listener, "RETRY_EVERY", 0.2)
    transport = RecordingTransport()
    with serving(relay(transport)):
        assert wait_for(lambda: bool(listener_pids()))
        (lost,) = listener_pids()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [lost])
        assert wait_for(lambda: listener_pids() not in ([], [lost]))
        write("after the loss")
        assert wait_for(lambda: transport.sent == ["after the loss"]), "polling only"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_busy_relay_reads_its_notifications_before_every_batch() -> None:
    """Issue 25 item 6: ``serve()`` read notifications only when idle. While a backlog was
    worked, each producer commit left one unread on the ``LISTEN`` socket; once the socket
    fills, the listening backend stops reading PostgreSQL's notification queue, and when that
    is full every COMMIT that writes to the outbox fails. Here a producer commits during each
    batch, and when the next batch is sent, that notification has been read."""
    import select

    write(*[f"backlog-{n}" for n in range(20)])
    unread_at_next_batch: list[bool] = []
    subject: Relay

    def socket_of_listener() -> int:
        assert subject.listener is not None and subject.listener.wrapper is not None
        return int(subject.listener.wrapper.connection.fileno())

    class Producing(RecordingTransport):
        def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
            if self.calls:  # the previous batch's producer notified: read before this claim?
                readable, _, _ = select.select([socket_of_listener()], [], [], 0)
                unread_at_next_batch.append(bool(readable))
            if len(self.calls) < 4:
                write(f"during-{len(self.calls)}")  # commits: a NOTIFY reaches the listener
                readable, _, _ = select.select([socket_of_listener()], [], [], 30)
                assert readable, "the producer's notification never reached the listener"
            return super().send(messages)

    transport = Producing()
    subject = relay(transport, batch_size=5)

    def serve() -> None:
        try:
            subject.serve(poll_interval=600.0)
        finally:
            close_conns()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        assert wait_for(lambda: len(transport.sent) == 24), transport.sent
    finally:
        subject.stop()
        thread.join(60)
    assert not thread.is_alive()
    assert len(unread_at_next_batch) >= 4
    assert not any(unread_at_next_batch), unread_at_next_batch


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_drain_reads_every_notification_waiting_not_one_socket_read() -> None:
    """Regression: drain() read the socket once (psycopg's ``notifies(timeout=0)`` stops after
    its first read, about 16 kB of notifications). Behind a backlog of producer commits the
    rest stayed unread: the socket filled up, as the comment in ``serve()`` fears, and every
    notification the claim had already seen woke the next wait for nothing."""
    import array
    import fcntl
    import termios

    from django.db import connection

    from django_idempotency.outbox import store

    count = 2000  # about 70 kB: several reads, and within the socket's buffers
    listener = store.Listener.open(connection.alias)
    assert listener is not None and listener.wrapper is not None
    try:
        with connection.cursor() as cursor:  # one commit, distinct notifications
            cursor.execute(
                "SELECT count(pg_notify(%s, g::text)) FROM generate_series(1, %s) g",
                [outbox.NOTIFY_CHANNEL, count],
            )
        # Each is a NotificationResponse: type, length, pid, channel and payload with their
        # terminating zeros. Wait until all of them are on the socket, unread.
        channel = len(outbox.NOTIFY_CHANNEL) + 1
        size = sum(1 + 4 + 4 + channel + len(str(n)) + 1 for n in range(1, count + 1))
        fileno = listener.wrapper.connection.fileno()

        def unread() -> int:
            buffer = array.array("i", [0])
            fcntl.ioctl(fileno, termios.FIONREAD, buffer)
            return buffer[0]

        assert wait_for(lambda: unread() >= size), (unread(), size)
        listener.drain()
        assert not listener.wait(0.0), "drain() left notifications unread"
    finally:
        listener.close()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_listening_relay_claims_once_per_notified_commit() -> None:
    """Regression (issue 28, COMMIT to effect p99): after every batch that sent something, a
    relay that listens claimed again at once, although a commit made meanwhile wakes it anyway:
    every other claim found nothing. Under a steady trickle of commits that doubled the claims
    (a transaction each, with the CPU they take from the worker on a small host). A batch that
    saw everything due now goes to the wait; a full batch still goes on at once."""
    write(*[f"backlog-{n}" for n in range(7)])  # committed before it listens: no notification
    transport = RecordingTransport()
    served = relay(transport, batch_size=3)
    claims: list[int] = []
    waiting = threading.Event()
    run_once, wait = served.run_once, served._wait

    def counted() -> BatchResult:
        waiting.clear()
        result = run_once()
        claims.append(result.claimed)
        return result

    def waits(listener: Any, seconds: float) -> None:
        waiting.set()
        wait(listener, seconds)

    served.run_once = counted  # type: ignore[method-assign]
    served._wait = waits  # type: ignore[method-assign]
    with serving(served):
        assert wait_for(waiting.is_set), "the relay never waited"
        assert len(transport.sent) == 7, "full batches must be followed by another at once"
        for n in range(3):
            waiting.clear()
            write(f"m{n}")

            def sent_then_waiting(count: int = 8 + n) -> bool:
                return len(transport.sent) == count and waiting.is_set()

            assert wait_for(sent_then_waiting)
    assert claims == [3, 3, 1, 1, 1, 1], claims
