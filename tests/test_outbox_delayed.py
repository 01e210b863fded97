"""Delayed outbox messages (issue 36): a countdown counts from the COMMIT, an eta is a moment; a
transport that delivers late messages itself (Celery's eta) gets them at once with their due
time, and for the others (Kafka, Dramatiq) the relay holds them until due, holding back the
later messages of their key and never another key.

Real relays (:class:`~django_idempotency.outbox.relay.Relay`) on the real database, with
transports that record what they are given. The proofs with real worker and relay processes,
and a SIGKILL of the relay while it holds a message, are in
``tests/test_outbox_delayed_proofs.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency.models import OUTBOX_UNSCHEDULED, OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.transports import OutboxMessage
from django_idempotency.status import collect

pytestmark = pytest.mark.django_db(transaction=True)


class Held:
    """A transport without delayed delivery (as Kafka's): records what it is given, when."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, OutboxMessage]] = []

    def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        now = time.time()
        self.sent += [(now, message) for message in messages]
        return [None] * len(messages)

    def close(self) -> None:
        pass

    @property
    def order(self) -> list[str]:
        return [message.destination for _, message in self.sent]


class Late(Held):
    """A transport that delivers a late message itself (as Celery, with the task's eta)."""

    delayed_delivery = True


TRANSPORTS = {
    "default": {"BACKEND": f"{__name__}.Held"},
    "late": {"BACKEND": f"{__name__}.Late"},
}


@pytest.fixture(autouse=True)
def transports() -> Iterator[None]:
    from django.conf import settings

    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "OUTBOX_TRANSPORTS": TRANSPORTS}):
        yield


@pytest.fixture
def relay() -> tuple[Relay, Held, Late]:
    held, late = Held(), Late()
    return Relay(transports={"default": held, "late": late}), held, late


def row(event_id: str) -> OutboxEntry:
    return OutboxEntry.objects.get(event_id=event_id)


def commit(**kwargs: Any) -> tuple[str, float]:
    """Send one message in a transaction of its own: ``(event id, when its COMMIT began)``.

    The countdown starts in the commit's first ``on_commit`` hook, after the COMMIT: never
    before this moment (a midpoint of the COMMIT's window could be later than the hook)."""
    with transaction.atomic():
        event_id = outbox.send(kwargs.pop("destination", "t"), {}, **kwargs)
        before = time.time()
    return event_id, before


def test_a_countdown_counts_from_the_commit_not_from_the_call(relay: Any) -> None:
    relay, held, _ = relay
    with transaction.atomic():
        # 4 s, not 1: the relay's first look must come before the due time on a loaded CI lane
        event_id = outbox.send("reminder", {}, countdown=4)
        time.sleep(4.2)  # a long transaction: due 4 s after its COMMIT, not after the call
        before = time.time()
    after = time.time()

    entry = row(event_id)
    assert entry.due_at is not None
    assert before + 4 <= entry.due_at.timestamp() <= after + 4
    assert entry.available_at == entry.due_at  # held by the relay until then
    assert relay.run_once().claimed == 0
    while time.time() < entry.due_at.timestamp():
        time.sleep(0.05)
    assert relay.run_once().sent == 1
    assert held.order == ["reminder"]
    assert held.sent[0][0] >= entry.due_at.timestamp()


def test_until_its_commit_a_countdown_message_is_claimed_by_no_relay(relay: Any) -> None:
    relay, _, _ = relay
    with transaction.atomic():
        event_id = outbox.send("reminder", {}, countdown=0.01)
        assert row(event_id).available_at == OUTBOX_UNSCHEDULED
        # The transaction is open: no relay sees the row. Its own connection would: still not,
        # nor does it start the countdown as a dead producer's (a CI run claimed it once the
        # 0.01 s had passed), even forced.
        time.sleep(0.05)
        assert relay.schedule(force=True) == 0
        assert relay.run_once().claimed == 0
    time.sleep(0.05)
    assert relay.run_once().sent == 1


def test_a_transport_that_delivers_late_gets_the_message_at_once_with_its_due_time(
    relay: Any,
) -> None:
    relay, _, late = relay
    event_id, committed = commit(transport="late", countdown=60)

    entry = row(event_id)
    assert entry.available_at is None
    assert entry.due_at is not None
    assert abs(entry.due_at.timestamp() - (committed + 60)) < 0.5
    assert relay.run_once().sent == 1
    ((sent_at, message),) = late.sent
    assert sent_at < committed + 5
    assert message.due_at == entry.due_at


def test_an_eta_is_a_moment(relay: Any) -> None:
    relay, held, late = relay
    eta = timezone.now() + timedelta(seconds=0.5)
    held_id, _ = commit(eta=eta)
    late_id, _ = commit(transport="late", eta=eta)

    assert (row(held_id).due_at, row(held_id).available_at) == (eta, eta)
    assert (row(late_id).due_at, row(late_id).available_at) == (eta, None)
    assert relay.run_once().sent == 1
    assert [m.due_at for _, m in late.sent] == [eta] and held.sent == []
    time.sleep(max(0.0, eta.timestamp() - time.time()) + 0.01)
    assert relay.run_once().sent == 1
    assert held.sent[0][0] >= eta.timestamp()


def test_a_held_message_holds_back_its_key_and_no_other(relay: Any) -> None:
    """Per-key order with a due message behind one that is not due yet: the later message of
    the key waits, the other key goes at once."""
    relay, held, _ = relay
    with transaction.atomic():
        outbox.send("k-first", {}, key="k", countdown=4)  # held past the first drain, loaded
        outbox.send("k-second", {}, key="k")  # due at once, behind the held one
        outbox.send("k-third", {}, key="k", eta=timezone.now() - timedelta(seconds=5))
        outbox.send("j-other", {}, key="j")
        outbox.send("no-key", {})

    relay.drain()
    assert sorted(held.order) == ["j-other", "no-key"]
    time.sleep(4.1)
    relay.drain()
    assert held.order[2:] == ["k-first", "k-second", "k-third"]


def test_the_relay_starts_a_countdown_its_producer_did_not(relay: Any) -> None:
    """The producer died between its COMMIT and its on_commit hook (here: an earlier on_commit
    callback raised, so Django ran none after it). The relay starts the countdown when it
    finds the message, after the commit: late, never early."""
    relay, held, _ = relay

    class Died(Exception):
        pass

    def die() -> None:
        raise Died

    with pytest.raises(Died), transaction.atomic():
        transaction.on_commit(die)
        event_id = outbox.send("orphan", {}, countdown=0.5)
        before = time.time()
    assert row(event_id).available_at == OUTBOX_UNSCHEDULED

    assert relay.run_once().claimed == 0  # its first batch looks for such messages
    entry = row(event_id)
    assert entry.available_at == entry.due_at
    assert entry.due_at is not None and entry.due_at.timestamp() >= before + 0.5
    assert relay.schedule(force=True) == 0  # started once
    time.sleep(max(0.0, entry.due_at.timestamp() - time.time()) + 0.01)
    assert relay.run_once().sent == 1 and held.order == ["orphan"]


def test_a_savepoint_rolled_back_takes_its_countdown_with_it(relay: Any) -> None:
    relay, held, _ = relay
    with transaction.atomic():
        kept = outbox.send("kept", {}, countdown=0.01)
        try:
            with transaction.atomic():
                outbox.send("gone", {}, countdown=0.01)
                raise LookupError
        except LookupError:
            pass
    time.sleep(0.05)
    relay.drain()
    assert held.order == ["kept"]
    assert list(OutboxEntry.objects.values_list("event_id", flat=True)) == [kept]


def serve_until_sent(relay: Relay, held: Held, commit_first: bool) -> tuple[float, float]:
    """``(committed, sent)``: a message with a countdown of 1 s, and a relay that polls every
    30 s, started before or after the commit."""

    def serve() -> None:
        try:
            relay.serve(poll_interval=30.0)
        finally:
            connections.close_all()  # this thread's

    thread = threading.Thread(target=serve, daemon=True)
    if commit_first:
        _, committed = commit(countdown=1)
    thread.start()
    try:
        time.sleep(0.3)  # idle, waiting
        if not commit_first:
            _, committed = commit(countdown=1)
        deadline = time.time() + 10
        while not held.sent and time.time() < deadline:
            time.sleep(0.02)
    finally:
        relay.stop()
        thread.join(10)
    assert held.sent, "the held message was not sent when due"
    return committed, held.sent[0][0]


def test_a_serving_relay_wakes_when_a_held_message_is_due(relay: Any) -> None:
    """The poll interval is 30 s: the relay wakes at the due time of the message it holds."""
    relay, held, _ = relay
    committed, sent_at = serve_until_sent(relay, held, commit_first=True)
    assert committed + 1 <= sent_at < committed + 2


@pytest.mark.postgres
def test_a_listening_relay_learns_of_a_new_held_message_from_its_commit(relay: Any) -> None:
    """PostgreSQL: the countdown's start notifies the relay, which then waits for its due time
    (elsewhere a relay learns of it at its next poll)."""
    relay, held, _ = relay
    committed, sent_at = serve_until_sent(relay, held, commit_first=False)
    assert committed + 1 <= sent_at < committed + 2


def test_the_lag_counts_a_delayed_message_from_when_it_is_due() -> None:
    commit(countdown=3600)
    assert collect().outbox_oldest_pending_seconds is None  # nothing due is pending
    with transaction.atomic():
        OutboxEntry.objects.update(created_at=timezone.now() - timedelta(seconds=100))
        outbox.send("now", {})
    lag = collect().outbox_oldest_pending_seconds
    assert lag is not None and lag < 50


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"countdown": 1, "eta": datetime.now(UTC)}, ValueError, "not both"),
        ({"eta": datetime(2030, 1, 1)}, TypeError, "aware"),
        ({"eta": "2030-01-01T00:00:00+00:00"}, TypeError, "aware datetime"),
        ({"countdown": "5"}, TypeError, "number of seconds"),
        ({"countdown": True}, TypeError, "number of seconds"),
        ({"countdown": 1e300}, ValueError, "out of range"),
        ({"countdown": float("nan")}, ValueError, "out of range"),
        ({"eta": datetime(9999, 6, 1, tzinfo=UTC)}, ValueError, "out of range"),
    ],
)
def test_a_bad_delay_is_refused_before_any_statement(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with transaction.atomic():
        with pytest.raises(error, match=match):
            outbox.send("t", {}, **kwargs)
        outbox.send("after", {})
    assert list(OutboxEntry.objects.values_list("destination", flat=True)) == ["after"]


def test_without_time_zone_support_delays_work_the_same(relay: Any) -> None:
    """``USE_TZ = False``: Django's datetimes are naive, and so is the row's provisional
    available_at; an eta (aware) is stored as Django stores a datetime then."""
    relay, held, _ = relay
    with override_settings(USE_TZ=False):
        # 5 s, not a fraction: on a loaded CI lane (nice 19) 0.3 s once passed before the first
        # drain, which then sent both.
        counted, began = commit(destination="counted", countdown=5)
        moment, _ = commit(destination="moment", eta=timezone.now().astimezone(UTC))
        assert row(counted).due_at is not None and row(moment).due_at is not None
        relay.drain()
        assert held.order == ["moment"]
        time.sleep(max(0.0, began + 5.1 - time.time()))
        relay.drain()
    assert held.order == ["moment", "counted"]


def test_a_change_capture_transport_cannot_hold_a_message() -> None:
    from django.conf import settings

    cdc = {"BACKEND": "django_idempotency.outbox.capture.ChangeCaptureTransport"}
    transports = {**TRANSPORTS, "cdc": cdc}
    with (
        override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "OUTBOX_TRANSPORTS": transports}),
        transaction.atomic(),
        pytest.raises(ValueError, match="cannot hold"),
    ):
        outbox.send("orders.placed", {}, transport="cdc", countdown=5)


def test_publish_refuses_a_countdown_out_of_range() -> None:
    with transaction.atomic(), pytest.raises(ValueError, match="out of range"):
        outbox.publish("shop.effect", countdown=10**12)


def test_the_index_of_waiting_messages_exists() -> None:
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, OutboxEntry._meta.db_table)
    assert "idem_outbox_avail_idx" in constraints
