"""One trace across the outbox: the request, the relay and the consumer, in three processes.

A request (here, in the test process, its spans in the SDK's in-memory exporter) publishes a
message through the outbox. A relay subprocess sends it, and a consumer subprocess (a Celery
worker, or ``idempotency_consume`` on the mock Kafka cluster) applies it. The subprocesses write
their spans to one file as JSON lines (``IDEMPOTENCY_SPANS_FILE``, see testproject/otel.py).
Every span of the message, in every process, belongs to the request's trace, and still does
after a resend by a second relay (a relay restart) and after a Kafka dead-letter replay.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client, override_settings
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

pytest.importorskip("opentelemetry.sdk")

from django_idempotency import idempotent
from django_idempotency.models import OutboxEntry
from django_idempotency.outbox import core as outbox
from testproject.otel import span_record
from testproject.shop.models import Effect
from tests.conftest import require_service
from tests.otel_helpers import sdk
from tests.outbox_helpers import celery_transports, start_relay, wait_for
from tests.probes import post
from tests.services import BROKER_URLS
from tests.workers import database_url, worker_group

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.timeout(600),
    pytest.mark.django_db(transaction=True),
]


@csrf_exempt
@idempotent(required=True)
def publish_view(request: HttpRequest) -> HttpResponse:
    """Publish one message: a Celery task call (``queue``) or a Kafka record (``topic``)."""
    data = json.loads(request.body)
    with transaction.atomic():
        if "topic" in data:
            event = outbox.send(data["topic"], data["value"], transport="kafka")
        else:
            event = outbox.publish("shop.effect", queue=data["queue"])
    return JsonResponse({"event": event}, status=201)


urlpatterns = [path("publish/", publish_view)]

REQUEST_SPANS: list[dict[str, Any]] = []
"""The spans of the last request, made in this process (the in-memory exporter)."""


def read_spans(file: Path) -> list[dict[str, Any]]:
    if not file.exists():
        return []
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def wait_for_spans(file: Path, predicate: Callable[[list[dict[str, Any]]], bool]) -> None:
    wait_for(
        lambda: predicate(read_spans(file)),
        120,
        "the spans",
        lambda: json.dumps(read_spans(file), indent=1)[-4000:],
    )


def request_trace(client: Client, data: dict[str, Any]) -> tuple[str, str, str]:
    """POST ``data`` to the publishing view; (event id, trace id, request span id)."""
    otel = sdk()
    with override_settings(ROOT_URLCONF=__name__):
        response = post(client, "/publish/", f"trace-{uuid.uuid4()}", data)
    assert response.status_code == 201, response.content  # type: ignore[attr-defined]
    event = json.loads(response.content)["event"]  # type: ignore[attr-defined]
    REQUEST_SPANS[:] = [{**span_record(s), "process": "app"} for s in otel.finished()]
    [span] = [s for s in otel.finished() if s.name == "idempotency.request"]
    trace_id, span_id = f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"
    # Stored with the message, in its headers: no new column, no migration.
    stored = OutboxEntry.objects.get(event_id=event).headers["traceparent"]
    assert stored.startswith(f"00-{trace_id}-{span_id}-")  # then the flags: sampled
    return event, trace_id, span_id


def consumed(count: int) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda spans: len(named(spans, "idempotency.consume")) >= count


def named(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [span for span in spans if span["name"] == name]


@pytest.fixture
def spans_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    if connection.vendor != "postgresql":
        pytest.skip("the trace proofs run on PostgreSQL")
    file = tmp_path / "spans.jsonl"
    monkeypatch.setenv("IDEMPOTENCY_SPANS_FILE", str(file))
    return file


@pytest.mark.broker
@pytest.mark.parametrize("instrumented", [False, True], ids=["plain", "celery-instrumented"])
def test_request_relay_and_celery_worker_share_one_trace(
    client: Client,
    spans_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    instrumented: bool,
) -> None:
    """With opentelemetry-instrumentation-celery in the relay and the worker, its spans join the
    request's trace too: the relay publishes inside the stored context, so Celery's injected
    ``traceparent`` is the request's and not the relay's batch."""
    require_service("redis")
    broker = BROKER_URLS["redis"]
    db_url = database_url(connection.settings_dict)
    if instrumented:
        monkeypatch.setenv("IDEMPOTENCY_SPANS_CELERY", "1")
    monkeypatch.setenv("IDEMPOTENCY_SPANS_SERVICE", "worker")
    with worker_group(
        broker_url=broker, db_url=db_url, log_dir=tmp_path, label="otel", workers=1, concurrency=1
    ) as group:
        event, trace_id, request_span = request_trace(client, {"queue": group.queue})
        transports = celery_transports(broker)
        monkeypatch.setenv("IDEMPOTENCY_SPANS_SERVICE", "relay")
        for run in range(2):  # the second: a resend by another relay, as after a crash
            if run:
                OutboxEntry.objects.filter(event_id=event).update(
                    state="pending", sent_at=None, expires_at=None, locked_until=None
                )
            relay = start_relay(
                "--once",
                db_url=db_url,
                transports=transports,
                log=tmp_path / f"relay{run}.log",
                broker_url=broker,
            )
            assert relay.wait(120) == 0, relay.output()  # Django's start: 11 s on CI
            wait_for_spans(spans_file, consumed(run + 1))
        assert OutboxEntry.objects.get(event_id=event).state == "sent"
        assert Effect.objects.filter(name="shop.effect", payload=event).count() == 1

    spans = read_spans(spans_file)
    dump = os.environ.get("IDEMPOTENCY_TRACE_DUMP")
    if dump and instrumented:  # the spans behind docs/img/outbox-trace.png (scripts/draw_trace.py)
        everything = REQUEST_SPANS + spans
        Path(dump).write_text("".join(json.dumps(s, default=str) + "\n" for s in everything))
    sends = named(spans, "idempotency.outbox.send")
    consumes = named(spans, "idempotency.consume")
    batches = named(spans, "idempotency.outbox.batch")
    assert len(sends) == 2 and len(consumes) == 2 and len(batches) == 2
    # Every span of the message, in the relays and the worker, is in the request's trace.
    for span in sends + consumes + named(spans, "idempotency.reserve"):
        assert span["trace_id"] == trace_id, span
    assert {s["process"] for s in sends} == {"relay"}
    assert {s["process"] for s in consumes} == {"worker"}
    # The sends are children of the request, linked to their relay's batch (its own trace).
    for send, batch in zip(sends, batches, strict=True):
        assert send["parent_id"] == request_span
        assert batch["trace_id"] != trace_id
        assert send["links"] == [f"{batch['trace_id']}:{batch['span_id']}"]
    outcomes = sorted(s["attributes"]["idempotency.outcome"] for s in consumes)
    assert outcomes == ["applied", "duplicate"]
    assert all(s["attributes"]["messaging.message.id"] == event for s in consumes)
    if not instrumented:
        # No instrumentation: the consumer's span is a child of the request itself.
        assert all(s["parent_id"] == request_span for s in consumes)
        return
    # Celery's own spans: apply_async inside the relay's send span, run/<task> in the worker,
    # all in the request's trace; the consumer's span nests in the run span, not beside it.
    publishes = [s for s in spans if s["name"].startswith("apply_async/")]
    runs = [s for s in spans if s["name"] == "run/shop.effect"]
    assert len(publishes) == 2 and len(runs) == 2
    send_ids = {s["span_id"] for s in sends}
    assert all(p["trace_id"] == trace_id and p["parent_id"] in send_ids for p in publishes)
    assert all(r["trace_id"] == trace_id for r in runs)
    run_ids = {r["span_id"] for r in runs}
    assert all(c["parent_id"] in run_ids for c in consumes)
    assert all(c["links"] == [] for c in consumes)  # same trace: nothing to link


def test_request_relay_and_kafka_runner_share_one_trace_through_a_dead_letter_replay(
    client: Client, spans_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("confluent_kafka")
    from tests.kafka_cluster import Cluster, consumer_env, manage_env, run_manage, start_consumer

    cluster = Cluster()
    try:
        topic = cluster.new_topic("otel")
        group = f"otel-{uuid.uuid4().hex[:8]}"
        db_url = database_url(connection.settings_dict)
        transports = {
            "default": {"BACKEND": "django_idempotency.outbox.transports.CeleryTransport"},
            "kafka": {
                "BACKEND": "django_idempotency.kafka.transport.KafkaTransport",
                "OPTIONS": {"config": {"bootstrap.servers": cluster.bootstrap}},
            },
        }
        kafka_transports = json.dumps(transports)
        with override_settings(IDEMPOTENCY={"OUTBOX_TRANSPORTS": transports}):
            event, trace_id, request_span = request_trace(
                client, {"topic": topic, "value": {"behaviour": "fail"}}
            )
        env = manage_env(
            db_url,
            IDEMPOTENCY_OUTBOX_TRANSPORTS=kafka_transports,
            IDEMPOTENCY_SPANS_SERVICE="relay",
        )
        run_manage(env, "idempotency_relay", "--once")
        assert OutboxEntry.objects.get(event_id=event).state == "sent"

        # The handler fails every time: three deliveries, then the dead-letter topic.
        monkeypatch.setenv("IDEMPOTENCY_SPANS_SERVICE", "consumer")
        broken = start_consumer(
            cluster, topic=topic, group=group, db_url=db_url, log_dir=tmp_path, name="broken"
        )
        cluster.wait_caught_up(topic, group)
        assert broken.terminate() == 0, broken.output()
        [dead] = cluster.read(f"{topic}.dlq", 1)
        # The dead letter keeps the message's headers, its trace context among them.
        parent = dict(dead.headers() or [])["traceparent"]
        assert isinstance(parent, bytes) and parent.decode().startswith(
            f"00-{trace_id}-{request_span}-"
        )

        # Fixed, replayed from the dead-letter topic, applied: still the request's trace.
        replay_env = {
            **consumer_env(cluster, topic=topic, group=group, db_url=db_url),
            "IDEMPOTENCY_SPANS_SERVICE": "replay",
        }
        run_manage(replay_env, "idempotency_consume", "--replay-dead-letters", "shop.kafka")
        fixed = start_consumer(
            cluster,
            topic=topic,
            group=group,
            db_url=db_url,
            log_dir=tmp_path,
            name="fixed",
            extra_env={"SHOP_KAFKA_FIXED": "1"},
        )
        cluster.wait_caught_up(topic, group)
        wait_for_spans(
            spans_file,
            lambda s: any(
                c["attributes"].get("idempotency.outcome") == "applied"
                for c in named(s, "idempotency.consume")
            ),
        )
        assert fixed.terminate() == 0, fixed.output()
    finally:
        cluster.close()
    spans = read_spans(spans_file)
    [send] = named(spans, "idempotency.outbox.send")
    consumes = named(spans, "idempotency.consume")
    assert send["trace_id"] == trace_id and send["parent_id"] == request_span
    assert send["attributes"] == {"messaging.system": "kafka"}
    # Three failed deliveries (parked on the third), then the replayed one that applied.
    outcomes = [c["attributes"].get("idempotency.outcome") for c in consumes]
    assert outcomes.count("applied") == 1 and outcomes[-1] == "applied"
    assert "failed" in outcomes and "parked" in outcomes
    for span in consumes:
        assert span["trace_id"] == trace_id and span["parent_id"] == request_span, span
