"""``DramatiqTransport``: the outbox relay to real ``dramatiq`` workers on RabbitMQ and Redis,
per-key order, and the Celery transport's failure rules (an unreachable broker fails every
message; a message that cannot be sent holds back the later ones of its key, not the others).

The end-to-end proofs run in the PostgreSQL pass (both brokers) and on Redis in the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("dramatiq")

from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency import new_event_id, outbox
from django_idempotency.models import OutboxEntry, ProcessedEvent
from django_idempotency.outbox.dramatiq import DramatiqTransport, dramatiq_envelope
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.transports import OutboxMessage
from testproject.shop.models import Effect
from tests.conftest import require_service
from tests.dramatiq_workers import DramatiqGroup, dramatiq_group, pika_url
from tests.servers import free_port
from tests.services import BROKER_URLS
from tests.workers import database_url

BACKEND = "django_idempotency.outbox.dramatiq.DramatiqTransport"


@pytest.fixture(params=sorted(BROKER_URLS))
def broker_url(request: pytest.FixtureRequest) -> str:
    require_service(request.param)
    return pika_url(BROKER_URLS[request.param])


def settings_for(url: str) -> dict[str, object]:
    return {
        "OUTBOX_TRANSPORTS": {
            "default": {"BACKEND": "django_idempotency.outbox.transports.CeleryTransport"},
            "dramatiq": {"BACKEND": BACKEND, "OPTIONS": {"broker_url": url}},
        }
    }


def message(n: int, queue: str, key: str | None = None, payload: object = None) -> OutboxMessage:
    return OutboxMessage(
        id=n,
        event_id=str(new_event_id()),
        destination="ordered",
        payload=payload if payload is not None else dramatiq_envelope(kwargs={"n": n}),
        headers={},
        ordering_key=key,
        created_at=timezone.now(),
        attempts=1,
    )


# --- Relay -> Dramatiq -> a real worker -------------------------------------------------------


@pytest.fixture
def single(
    broker_url: str, tmp_path: Path, django_db_setup: None, django_db_blocker: object
) -> Iterator[DramatiqGroup]:
    """One worker process with one thread, so that it applies the queue in its order."""
    if connection.vendor != "postgresql" and not broker_url.startswith("redis"):
        pytest.skip("MariaDB and SQLite passes: the Dramatiq proofs run on Redis only")
    with dramatiq_group(
        broker_url=broker_url,
        db_url=database_url(connection.settings_dict),
        log_dir=tmp_path,
        label="relay",
        start=False,
    ) as group:
        group.threads = 1
        yield group


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_the_relay_sends_to_a_real_worker_once_each_in_key_order(single: DramatiqGroup) -> None:
    count = 20
    with override_settings(IDEMPOTENCY=settings_for(single.broker_url)):
        ids = []
        for n in range(count):
            with transaction.atomic():
                ids.append(
                    outbox.send(
                        "ordered",
                        dramatiq_envelope(kwargs={"n": n}, queue_name=single.queue),
                        key="order-1",
                        transport="dramatiq",
                    )
                )
        relay = Relay(batch_size=7)
        relay.drain(max_seconds=60)

    assert set(OutboxEntry.objects.values_list("state", flat=True)) == {"sent"}
    single.start()
    single.wait_for(
        lambda: ProcessedEvent.objects.filter(consumer="dq.ordered").count() == count,
        "every relayed message",
    )
    applied = list(
        Effect.objects.filter(name="dq.ordered").order_by("pk").values_list("payload", flat=True)
    )
    assert applied == [str(n) for n in range(count)]  # once each, in the key's order
    assert set(ProcessedEvent.objects.values_list("event_id", flat=True)) == set(ids)


# --- The failure rules --------------------------------------------------------------------------


def test_an_unreachable_broker_fails_every_message(broker_url: str) -> None:
    port = free_port()
    down = (
        f"amqp://guest:guest@127.0.0.1:{port}/%2F"
        if broker_url.startswith("amqp")
        else f"redis://127.0.0.1:{port}/0"
    )
    transport = DramatiqTransport(broker_url=down, connect_timeout=0.5, timeout=0.5)
    results = transport.send([message(n, "q") for n in range(3)])
    assert all(isinstance(result, Exception) for result in results), results
    transport.close()


def test_a_failed_message_holds_back_its_key_only(broker_url: str) -> None:
    queue = f"idem-dq-hold-{new_event_id()}"
    transport = DramatiqTransport(broker_url=broker_url, queue_name=queue)
    try:
        messages = [
            message(1, queue, key="a"),
            message(2, queue, key="a", payload={"args": "not a list", "kwargs": {}}),
            message(3, queue, key="a"),
            message(4, queue, key="b"),
        ]
        results = transport.send(messages)
        assert results[0] is None and results[3] is None
        assert isinstance(results[1], TypeError)
        assert results[2] is results[1]  # held back behind it, never sent
    finally:
        broker = transport._open()
        broker.flush(queue)
        transport.close()


def test_validate_refuses_what_no_worker_could_run() -> None:
    transport = DramatiqTransport(broker_url="redis://127.0.0.1:6379/15")
    with pytest.raises(TypeError, match="delay"):
        dramatiq_envelope(kwargs={}, delay=1000)
    with pytest.raises(TypeError, match="payload"):
        transport.validate_message("ordered", {"n": 1}, {})
    with pytest.raises(TypeError, match="Unsupported Dramatiq option"):
        transport.validate_message("ordered", {"args": [], "kwargs": {}, "options": {"x": 1}}, {})
    with pytest.raises(ValueError, match="actor name"):
        transport.validate_message("", dramatiq_envelope(), {})
    transport.validate_message("ordered", dramatiq_envelope(args=[1], max_retries=3), {})
