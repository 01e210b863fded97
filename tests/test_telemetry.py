"""OpenTelemetry metrics and spans, read back with the SDK's in-memory reader and exporter.

Each outcome increments exactly its own counter (the delta of one action is that one data point
and nothing else), no metric attribute carries a key, an event id or an owner, and without the
``opentelemetry`` package nothing of it is imported at all.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import Client, override_settings
from django.utils import timezone

pytest.importorskip("opentelemetry.sdk")

from django_idempotency import telemetry
from django_idempotency.events.core import process_event, process_first_deliveries
from django_idempotency.events.ids import new_event_id
from django_idempotency.exceptions import EventParked
from django_idempotency.models import FlowRun, IdempotencyRecord, OutboxEntry
from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.transports import OutboxMessage
from tests.otel_helpers import Sdk, delta, sdk
from tests.outbox_helpers import NULL_TRANSPORTS
from tests.probes import post
from tests.workers import REPO

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("null_default_transport"),  # topic messages, no Celery task call
]

URL = "/probe/effect/"
Key = tuple[str, frozenset[tuple[str, Any]]]


@pytest.fixture
def otel() -> Iterator[Sdk]:
    # Forget what earlier tests of the process registered (a relay's serve() observes its
    # database's gauges once per process), then again afterwards.
    telemetry.reset()
    yield sdk()
    telemetry.reset()


def one(changes: dict[Key, float]) -> tuple[str, dict[str, Any], float]:
    """The single data point that changed; fails if none or several did."""
    assert len(changes) == 1, changes
    [((name, attributes), value)] = changes.items()
    return name, dict(attributes), value


def counted(otel: Sdk, action: Any, *, histograms: bool = False) -> dict[Key, float]:
    """The counters (and, if asked, histograms) that ``action()`` changed."""
    before = otel.counter_values()
    action()
    changes = delta(before, otel.counter_values())
    if not histograms:
        changes = {k: v for k, v in changes.items() if k[0] != telemetry.HTTP_DURATION}
    return changes


# --- HTTP ---------------------------------------------------------------------------------------


def requests_counter(outcome: str, result: str) -> tuple[str, dict[str, Any], float]:
    return (
        telemetry.HTTP_REQUESTS,
        {"idempotency.outcome": outcome, "idempotency.result": result},
        1,
    )


def test_a_first_execution_and_its_replay(client: Client, otel: Sdk) -> None:
    changes = counted(otel, lambda: post(client, URL, "k1"), histograms=True)
    assert changes.pop((telemetry.HTTP_DURATION, frozenset({("idempotency.step", "claim")}))) == 1
    assert changes.pop((telemetry.HTTP_DURATION, frozenset({("idempotency.step", "store")}))) == 1
    assert one(changes) == requests_counter("first_execution", "stored")
    replay = counted(otel, lambda: post(client, URL, "k1"), histograms=True)
    assert replay.pop((telemetry.HTTP_DURATION, frozenset({("idempotency.step", "claim")}))) == 1
    assert one(replay) == requests_counter("replay", "replayed")


def test_a_mismatch_is_counted_as_mismatch(client: Client, otel: Sdk) -> None:
    post(client, URL, "k2", {"a": 1})
    response: Any = None

    def again() -> None:
        nonlocal response
        response = post(client, URL, "k2", {"a": 2})

    assert one(counted(otel, again)) == requests_counter("mismatch", "mismatch")
    assert response.status_code == 422


@override_settings(IDEMPOTENCY={"WAIT": 0})
def test_a_conflict_is_counted_as_conflict(client: Client, otel: Sdk) -> None:
    post(client, "/probe/lease/", "seed")
    seed = IdempotencyRecord.objects.get(key="seed")
    IdempotencyRecord.objects.create(
        owner=seed.owner,
        key="busy",
        fingerprint=seed.fingerprint,
        method="POST",
        path="/probe/lease/",
        locked_until=timezone.now() + timedelta(hours=1),
        expires_at=timezone.now() + timedelta(days=1),
    )
    response: Any = None

    def busy() -> None:
        nonlocal response
        response = post(client, "/probe/lease/", "busy")

    assert one(counted(otel, busy)) == requests_counter("conflict", "conflict")
    assert response.status_code == 409


def test_a_response_that_was_not_stored(client: Client, otel: Sdk) -> None:
    first = counted(otel, lambda: b"".join(post(client, "/probe/stream/", "s").streaming_content))  # type: ignore[attr-defined]
    assert one(first) == requests_counter("first_execution", "stored_not_replayable")
    assert one(counted(otel, lambda: post(client, "/probe/stream/", "s"))) == requests_counter(
        "not_stored", "not_replayable"
    )


def test_an_erased_and_an_undecryptable_record(client: Client, otel: Sdk) -> None:
    from django_idempotency.protection import erase_owner
    from tests.protection_helpers import keys, new_key

    with keys(new_key()):
        post(client, URL, "sealed")
    with keys(new_key()):
        undecryptable = counted(otel, lambda: post(client, URL, "sealed"))
    assert one(undecryptable) == requests_counter("undecryptable", "undecryptable")
    post(client, URL, "erased")
    erase_owner("anonymous")
    erased = counted(otel, lambda: post(client, URL, "erased"))
    assert one(erased) == requests_counter("erased", "erased")


def test_a_malformed_and_a_missing_key(client: Client, otel: Sdk) -> None:
    malformed = counted(otel, lambda: post(client, URL, "a, b"))
    assert one(malformed) == requests_counter("malformed_key", "malformed_key")
    missing = counted(otel, lambda: post(client, "/probe/required/"))
    assert one(missing) == requests_counter("missing_key", "missing_key")


def test_a_server_error_is_a_first_execution_released(client: Client, otel: Sdk) -> None:
    changes = counted(otel, lambda: post(client, URL + "?status=503", "k5"))
    assert one(changes) == requests_counter("first_execution", "rolled_back")


def test_the_claim_and_the_store_are_spans(client: Client, otel: Sdk) -> None:
    post(client, URL, "k6")
    spans = {span.name: span for span in otel.finished()}
    assert list(spans) == ["idempotency.claim", "idempotency.store", "idempotency.request"]
    request = spans["idempotency.request"]
    assert request.parent is None  # no instrumentation here: the library's span is the root
    assert request.attributes == {
        "http.request.method": "POST",
        "idempotency.outcome": "first_execution",
    }
    for name in ("idempotency.claim", "idempotency.store"):
        parent = spans[name].parent
        assert parent is not None and parent.span_id == request.context.span_id


# --- Consumers ----------------------------------------------------------------------------------


def deliveries(consumer: str, outcome: str) -> tuple[str, dict[str, Any], float]:
    return (
        telemetry.CONSUMER_DELIVERIES,
        {"idempotency.consumer": consumer, "idempotency.outcome": outcome},
        1,
    )


class Boom(RuntimeError):
    pass


def fail() -> None:
    raise Boom("the consumer failed on purpose")


def test_consumer_outcomes_each_count_once(otel: Sdk) -> None:
    event = str(uuid.uuid4())
    applied = counted(otel, lambda: process_event("c.metrics", event, lambda: None))
    assert one(applied) == deliveries("c.metrics", "applied")
    duplicate = counted(otel, lambda: process_event("c.metrics", event, lambda: None))
    assert one(duplicate) == deliveries("c.metrics", "duplicate")

    poison = str(uuid.uuid4())

    def deliver() -> None:
        with pytest.raises((Boom, EventParked)):
            process_event("c.metrics", poison, fail, max_deliveries=1)

    assert one(counted(otel, deliver)) == deliveries("c.metrics", "failed")
    assert one(counted(otel, deliver)) == deliveries("c.metrics", "parked")  # 2nd > max 1
    assert one(counted(otel, deliver)) == deliveries("c.metrics", "parked")  # refused again


def outcomes(changes: dict[Key, float], consumer: str) -> dict[str, float]:
    """The changed ``idempotency.consumer.deliveries`` points of ``consumer``, by outcome."""
    found = {}
    for (name, attributes), value in changes.items():
        labels = dict(attributes)
        if name == telemetry.CONSUMER_DELIVERIES and labels["idempotency.consumer"] == consumer:
            found[labels["idempotency.outcome"]] = value
    return found


def batch(consumer: str, events: list[str], failing: str = "") -> None:
    """A batch of first deliveries in a transaction of its own, rolled back if ``failing``'s
    body raises (as the Kafka runner rolls a batch back)."""

    def body(event: str) -> Any:
        return fail if event == failing else lambda: None

    with transaction.atomic():
        process_first_deliveries(consumer, [(event, body(event)) for event in events])


@pytest.mark.parametrize("layout", ["default", "partitioned"])
def test_a_rolled_back_batch_counts_no_delivery(
    otel: Sdk, layout: str, request: pytest.FixtureRequest
) -> None:
    """Regression: a batch of first deliveries counted each message it applied, and each
    duplicate it skipped, before its transaction committed; a batch that then rolled back
    (a later message failed) had counted them, and the one-at-a-time deliveries that follow
    counted them again. They are counted once the caller's transaction commits now."""
    if layout == "partitioned":
        if connection.vendor != "postgresql":
            pytest.skip("the partitioned layout is PostgreSQL's")
        request.getfixturevalue("partitioned_events")
    consumer = f"c.batch-{layout}"
    applied, old, poison, after = (str(new_event_id()) for _ in range(4))
    process_event(consumer, old, lambda: None)

    def rolled_back() -> None:
        with pytest.raises(Boom):
            batch(consumer, [applied, old, poison, after], failing=poison)

    assert outcomes(counted(otel, rolled_back), consumer) == {}

    def one_at_a_time() -> None:
        for event in (applied, old, poison, after):
            with contextlib.suppress(Boom):
                process_event(consumer, event, fail if event == poison else lambda: None)

    changes = outcomes(counted(otel, one_at_a_time), consumer)
    assert changes == {"applied": 2, "duplicate": 1, "failed": 1}

    # A batch that commits is counted once, after its COMMIT.
    fresh, again = str(new_event_id()), str(new_event_id())
    before = otel.counter_values()
    with transaction.atomic():
        process_first_deliveries(
            consumer, [(e, lambda: None) for e in (fresh, applied, again, fresh)]
        )
        assert outcomes(delta(before, otel.counter_values()), consumer) == {}
    assert outcomes(delta(before, otel.counter_values()), consumer) == {
        "applied": 2,
        "duplicate": 2,
    }


@pytest.fixture
def partitioned_events() -> Iterator[None]:
    """The processed events in PostgreSQL's partitioned layout (``EVENT_PARTITIONS``), and
    the default layout again afterwards."""
    from django_idempotency.retention import partitioning

    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "EVENT_PARTITIONS": "day"}):
        partitioning.convert("default")
        try:
            yield
        finally:
            if partitioning.is_partitioned("default"):
                partitioning.revert("default")


def test_each_reservation_is_a_span(otel: Sdk) -> None:
    with transaction.atomic():
        from django_idempotency.events.core import try_reserve

        assert try_reserve(str(uuid.uuid4()), "c.span")
    assert [span.name for span in otel.finished()] == ["idempotency.reserve"]


# --- Outbox -------------------------------------------------------------------------------------


class Answering:
    """A transport that answers each message with what ``answers`` holds for its destination."""

    def __init__(self, failing: set[str]) -> None:
        self.failing = failing

    def send(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        return [
            ConnectionError("down") if m.destination in self.failing else None for m in messages
        ]

    def close(self) -> None:
        pass


def test_relay_sends_by_transport_and_outcome_and_its_batch_duration(otel: Sdk) -> None:
    with transaction.atomic():
        outbox.send("ok.topic", {"n": 1})
        outbox.send("ok.topic", {"n": 2})
        outbox.send("bad.topic", {"n": 3})
        outbox.send("worse.topic", {"n": 4})
    OutboxEntry.objects.filter(destination="worse.topic").update(attempts=1)
    relay = Relay(
        transports={"default": Answering({"bad.topic", "worse.topic"})},
        max_attempts=2,
    )
    changes = counted(otel, relay.run_once, histograms=True)
    sends = telemetry.OUTBOX_SENDS
    assert changes == {
        (
            sends,
            frozenset({("idempotency.transport", "default"), ("idempotency.outcome", "sent")}),
        ): 2,
        (
            sends,
            frozenset({("idempotency.transport", "default"), ("idempotency.outcome", "failed")}),
        ): 1,
        (
            sends,
            frozenset({("idempotency.transport", "default"), ("idempotency.outcome", "parked")}),
        ): 1,
        (telemetry.OUTBOX_BATCH_DURATION, frozenset()): 1,
    }
    assert OutboxEntry.objects.filter(state="parked").count() == 1
    batch = [span for span in otel.finished() if span.name == "idempotency.outbox.batch"]
    assert len(batch) == 1 and batch[0].attributes == {"messaging.batch.message_count": 4}
    # An idle poll makes no span and no point.
    otel.spans.clear()
    assert counted(otel, relay.run_once, histograms=True) == {}
    assert otel.finished() == []


def test_messages_held_back_behind_a_failure_count_as_held_not_failed(otel: Sdk) -> None:
    """One refusal in front of three messages of its key is one failed attempt: the three
    behind it were not attempted, and count as ``held`` (each is claimed again with it)."""
    with transaction.atomic():
        outbox.send("bad.topic", {"n": 0}, key="held-key")
        for n in range(1, 4):
            outbox.send("ok.topic", {"n": n}, key="held-key")
        outbox.send("ok.topic", {"n": 4})
    relay = Relay(transports={"default": Answering({"bad.topic"})}, max_attempts=5)
    sends = telemetry.OUTBOX_SENDS
    changes = {k: v for k, v in counted(otel, relay.run_once).items() if k[0] == sends}

    def outcome(word: str) -> tuple[str, frozenset[tuple[str, str]]]:
        return (
            sends,
            frozenset({("idempotency.transport", "default"), ("idempotency.outcome", word)}),
        )

    assert changes == {outcome("sent"): 1, outcome("failed"): 1, outcome("held"): 3}
    assert OutboxEntry.objects.filter(ordering_key="held-key", attempts=0).count() == 3


def test_outbox_gauges_read_pending_lag_parked_and_abandoned_runs(otel: Sdk) -> None:
    alias = connection.alias
    assert telemetry.observe(alias)
    assert not telemetry.observe(alias)  # once per database
    with transaction.atomic():
        for n in range(3):
            outbox.send("gauge.topic", {"n": n})
    OutboxEntry.objects.filter(pk=OutboxEntry.objects.order_by("id")[0].pk).update(
        state="parked", created_at=timezone.now() - timedelta(hours=1)
    )
    OutboxEntry.objects.filter(state="pending").update(
        created_at=timezone.now() - timedelta(minutes=10)
    )
    record = IdempotencyRecord.objects.create(
        owner="o",
        key="abandoned",
        fingerprint="f",
        method="POST",
        path="/p",
        locked_until=timezone.now() - timedelta(minutes=1),
        expires_at=timezone.now() + timedelta(days=1),
    )
    FlowRun.objects.create(record=record, flow="m:f", fingerprint="f")
    values = {name: value for name, _, value in otel.points()}
    assert values[telemetry.OUTBOX_PENDING] == 2
    assert values[telemetry.OUTBOX_PARKED] == 1
    assert 590 <= values[telemetry.OUTBOX_LAG] <= 3600
    assert values[telemetry.FLOW_ABANDONED] == 1
    assert values[telemetry.DELIVERIES_PARKED] == 0


# --- What the attributes may carry --------------------------------------------------------------


def test_no_metric_attribute_carries_a_key_an_event_id_or_an_owner(
    client: Client, otel: Sdk
) -> None:
    # The SDK's reader is the process's: points of earlier tests stay in it, with names of
    # their own (a consumer "fast-0000a1" once matched the card "0000" here), so only the
    # attribute sets this test made are read, and the card numbers are ones no name holds.
    earlier = {(name, frozenset(attributes.items())) for name, attributes, _ in otel.points()}
    key = f"secret-key-{uuid.uuid4()}"
    event = str(uuid.uuid4())
    card, other_card = "4242-4242-4242-4242", "0000-0000-0000-0000"
    post(client, URL, key, {"card": card})
    post(client, URL, key, {"card": card})
    post(client, URL, key, {"card": other_card})
    process_event("c.attrs", event, lambda: None)
    process_event("c.attrs", event, lambda: None)
    with transaction.atomic():
        outbox.send("attrs.topic", {"card": card}, key="order-77", event_id=event)
    Relay(transports={"default": Answering(set())}).run_once()
    owner = IdempotencyRecord.objects.get(key=key).owner
    forbidden = {key, event, owner, "order-77", card, other_card}
    points = [
        (name, attributes, value)
        for name, attributes, value in otel.points()
        if (name, frozenset(attributes.items())) not in earlier
    ]
    assert points
    for name, attributes, _ in points:
        for attribute, value in attributes.items():
            assert not any(secret in str(value) for secret in forbidden), (name, attribute)
        assert set(attributes) <= {
            "idempotency.outcome",
            "idempotency.result",
            "idempotency.step",
            "idempotency.consumer",
            "idempotency.transport",
            "idempotency.flow",
            "idempotency.database",
        }, (name, attributes)


# --- Off, and absent ----------------------------------------------------------------------------


@override_settings(IDEMPOTENCY={"TELEMETRY": False, "OUTBOX_TRANSPORTS": NULL_TRANSPORTS})
def test_the_setting_turns_everything_off(client: Client, otel: Sdk) -> None:
    telemetry.reset()
    assert counted(otel, lambda: post(client, URL, "off"), histograms=True) == {}
    assert otel.finished() == []
    with transaction.atomic():
        outbox.send("off.topic", {})
    assert "traceparent" not in OutboxEntry.objects.get(destination="off.topic").headers


def test_the_setting_is_validated() -> None:
    from django.core.exceptions import ImproperlyConfigured

    from django_idempotency.conf import conf

    with (
        override_settings(IDEMPOTENCY={"TELEMETRY": "yes"}),
        pytest.raises(ImproperlyConfigured, match=r"TELEMETRY.*True or False"),
    ):
        print(conf.TELEMETRY)


BLOCKED = textwrap.dedent(
    """
    import importlib.abc, json, os, sys, uuid

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
            return None

    sys.meta_path.insert(0, Block())
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    import django
    django.setup()
    from django.test.utils import setup_test_environment
    setup_test_environment()
    from django.core.management import call_command
    call_command("migrate", verbosity=0)
    from django.db import transaction
    from django.test import Client
    from django_idempotency import telemetry
    from django_idempotency.events.core import process_event
    from django_idempotency.models import OutboxEntry
    from django_idempotency.outbox import core as outbox
    from django_idempotency.outbox.relay import Relay

    client = Client()
    first = client.post("/probe/effect/", "{}", content_type="application/json",
                        headers={"Idempotency-Key": "hidden"})
    again = client.post("/probe/effect/", "{}", content_type="application/json",
                        headers={"Idempotency-Key": "hidden"})
    event = str(uuid.uuid4())
    applied = process_event("c.hidden", event, lambda: None).applied
    with transaction.atomic():
        outbox.send("hidden.topic", {"n": 1})
    headers = OutboxEntry.objects.get(destination="hidden.topic").headers
    print(json.dumps({
        "statuses": [first.status_code, again.status_code],
        "replayed": again.headers.get("Idempotent-Replayed"),
        "applied": applied,
        "headers": headers,
        "enabled": telemetry.enabled(),
        "imported": sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"),
    }))
    """
)


def run_fresh(script: str, database: Path, **env: str) -> dict[str, Any]:
    """Run ``script`` in a fresh interpreter of the test project, on the throwaway SQLite
    ``database`` of its own, with outbox transports that send nothing (``env`` added to its
    environment); it must succeed, and its last line is JSON: that, read."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
            "DATABASE_URL": f"sqlite:///{database}",
            "IDEMPOTENCY_OUTBOX_TRANSPORTS": json.dumps(NULL_TRANSPORTS),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_without_opentelemetry_nothing_is_imported_and_nothing_changes(tmp_path: Path) -> None:
    """A fresh interpreter that cannot import ``opentelemetry`` (a meta-path finder refuses it)
    serves a request and its replay, applies an event and writes an outbox message: all work,
    and no ``opentelemetry`` module was loaded. On a throwaway SQLite database of its own."""
    result = run_fresh(BLOCKED, tmp_path / "hidden.sqlite3")
    assert result == {
        "statuses": [201, 201],
        "replayed": "true",
        "applied": True,
        "headers": {},
        "enabled": False,
        "imported": [],
    }


BAD_PROPAGATOR = textwrap.dedent(
    """
    import json, logging, os, uuid

    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    import django
    django.setup()
    from django.test.utils import setup_test_environment
    setup_test_environment()
    from django.core.management import call_command
    call_command("migrate", verbosity=0)
    from django.db import transaction
    from django.test import Client
    from django_idempotency import telemetry
    from django_idempotency.events.core import process_event
    from django_idempotency.models import OutboxEntry
    from django_idempotency.outbox import core as outbox
    from django_idempotency.outbox.relay import Relay

    class Seen(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []
        def emit(self, record):
            if record.name == "django_idempotency":
                self.lines.append(record.getMessage())

    seen = Seen()
    logging.getLogger("django_idempotency").addHandler(seen)
    client = Client()
    statuses = []
    for _ in range(2):
        statuses.append(client.post("/probe/effect/", "{}", content_type="application/json",
                                    headers={"Idempotency-Key": "bad-propagator"}).status_code)
    applied = process_event("c.bad", str(uuid.uuid4()), lambda: None).applied
    with transaction.atomic():
        outbox.send("bad.topic", {"n": 1})
        outbox.send("bad.topic", {"n": 2})
    relayed = Relay().drain().sent
    print(json.dumps({
        "statuses": statuses,
        "applied": applied,
        "relayed": relayed,
        "enabled": telemetry.enabled(),
        "tracing": telemetry.tracing(),
        "warnings": [line for line in seen.lines if line.startswith("telemetry:")],
    }))
    """
)


def test_an_opentelemetry_that_fails_to_load_switches_telemetry_off_once(tmp_path: Path) -> None:
    """``OTEL_PROPAGATORS`` naming a propagator that is not installed makes the real
    ``opentelemetry.propagate`` raise ValueError on import. A request and its replay, an event,
    two outbox messages and the relay's batch all work; telemetry is off, and one WARNING
    names the cause (the import is not tried again at every call)."""
    result = run_fresh(
        BAD_PROPAGATOR, tmp_path / "bad-propagator.sqlite3", OTEL_PROPAGATORS="b3multi_typo"
    )
    warnings = result.pop("warnings")
    assert result == {
        "statuses": [201, 201],
        "applied": True,
        "relayed": 2,
        "enabled": False,
        "tracing": False,
    }
    assert len(warnings) == 1, warnings
    assert "b3multi_typo" in warnings[0] and "OTEL_PROPAGATORS" in warnings[0]


def test_with_no_op_providers_the_library_skips_its_span_and_metric_work(otel: Sdk) -> None:
    """The ``otel`` extra without an SDK: the API's providers would answer every call with a
    no-op; the library sees that and does not even build spans (the microbenchmark's
    ``otel-noop-first`` row), while an SDK provider set later is picked up at the next call."""
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.trace import NoOpTracerProvider

    telemetry.configure(NoOpTracerProvider(), NoOpMeterProvider())
    assert telemetry.enabled()
    assert telemetry.span("x") is telemetry._NULL
    assert telemetry.timed("claim") is telemetry._NULL
    assert telemetry.inject({"a": "b"}) == {"a": "b"}
    telemetry.reset()  # back to the global providers: the SDK of these tests
    assert telemetry.span("x") is not telemetry._NULL


def test_a_message_without_an_event_id_is_counted_as_parked(otel: Sdk) -> None:
    from django_idempotency.events.core import park_message

    changes = counted(otel, lambda: park_message("c.noid", "task-1", "no event id"))
    assert one(changes) == deliveries("c.noid", "parked")


def test_after_a_reset_the_gauges_read_the_tables_again(otel: Sdk) -> None:
    """Regression: a meter keeps the callbacks of the first gauge of a name and ignores a
    second registration's, so after ``telemetry.reset()`` the gauges still answered from the
    first registration's figures, read less than a second before: CI saw the pending gauge
    read 4 for 2, after an earlier test had observed the database."""
    alias = connection.alias
    assert telemetry.observe(alias)
    with transaction.atomic():
        for n in range(4):
            outbox.send("gauge.topic", {"n": n})
    assert [v for name, _, v in otel.points() if name == telemetry.OUTBOX_PENDING] == [4]
    first_two = list(OutboxEntry.objects.order_by("id").values_list("pk", flat=True)[:2])
    OutboxEntry.objects.filter(pk__in=first_two).delete()
    telemetry.reset()
    assert telemetry.observe(alias)
    pending = [value for name, _, value in otel.points() if name == telemetry.OUTBOX_PENDING]
    assert pending == [2]


@pytest.mark.django_db(databases=["default", "other"])
def test_the_gauges_report_every_database_a_process_observes(otel: Sdk) -> None:
    """Regression: each observe() registered its own gauges, and a meter keeps the first
    gauge of a name, so a process relaying two databases reported the first one only."""
    assert telemetry.observe("default")
    assert telemetry.observe("other")
    with transaction.atomic(using="other"):
        outbox.send("gauge.topic", {"n": 1}, using="other")
    pending = {
        attributes["idempotency.database"]: value
        for name, attributes, value in otel.points()
        if name == telemetry.OUTBOX_PENDING
    }
    assert pending == {"default": 0, "other": 1}


@pytest.mark.django_db(databases=["default", "other"], transaction=True)
def test_a_database_that_cannot_be_read_hides_no_other(
    otel: Sdk, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: one callback reads every observed database, and the first that failed
    raised into the SDK, which then reported no database at all for that gauge."""
    from django.db import connections

    assert telemetry.observe("default")
    assert telemetry.observe("other")
    with transaction.atomic(using="default"):
        outbox.send("gauge.topic", {"n": 1})
    other = connections["other"]
    other.close()
    saved = dict(other.settings_dict)
    if other.vendor == "sqlite":  # the database is down: a file that cannot be opened
        other.settings_dict["NAME"] = "/nonexistent-directory/db.sqlite3"
    else:  # nothing listens there
        other.settings_dict["PORT"] = "1"
    try:
        with caplog.at_level("WARNING"):
            pending = {
                attributes["idempotency.database"]: value
                for name, attributes, value in otel.points()
                if name == telemetry.OUTBOX_PENDING
            }
    finally:
        other.close()
        other.settings_dict.update(saved)
    assert pending == {"default": 1}
    # One line naming the database and the cause; the traceback only at DEBUG (a database
    # outage added one per collection to the relay's log).
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert warning.getMessage().startswith(
        "telemetry: cannot read the figures of database 'other' (OperationalError: "
    )
    assert warning.exc_info is None


@pytest.mark.django_db(transaction=True)
def test_a_collection_on_a_thread_in_a_transaction_leaves_its_connection_alone(
    otel: Sdk,
) -> None:
    """Regression: off the main thread a collection closed the thread's connection, meant for
    a periodic reader's thread of its own; a thread that collects in the middle of its own
    work (a /metrics view served by a threaded server, under ATOMIC_REQUESTS) lost its
    transaction, and its next query failed."""
    from django.db import connections

    assert telemetry.observe("default")
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with transaction.atomic():
                outbox.send("gauge.topic", {"n": 1})
                points = otel.points()  # the callbacks run on this thread
                assert [v for n, _, v in points if n == telemetry.OUTBOX_PENDING] == [1]
                assert OutboxEntry.objects.count() == 1  # the transaction goes on
        except BaseException as exc:  # noqa: BLE001 - reported to the test's thread
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(30)
    assert not errors, errors
