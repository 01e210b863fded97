"""The Dramatiq app of the worker tests: ``python -m dramatiq tests.dramatiq_app``.

It sets Django up (``DJANGO_SETTINGS_MODULE`` and ``DATABASE_URL`` come from the test, pointing
at the test database), builds the broker of ``DRAMATIQ_BROKER_URL`` (RabbitMQ or Redis) and
declares the test actors on the queue ``DRAMATIQ_QUEUE``, which no other test uses. On Redis,
a dead worker's messages are given back after a short heartbeat timeout (Dramatiq's default is a
minute), and the maintenance that does it runs on every command.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
django.setup()

import dramatiq  # noqa: E402
from django.db import transaction  # noqa: E402
from dramatiq.brokers.rabbitmq import RabbitmqBroker  # noqa: E402
from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker  # noqa: E402

from django_idempotency.events.dramatiq import idempotent_actor  # noqa: E402
from testproject.shop.models import Effect  # noqa: E402

BROKER_URL = os.environ.get("DRAMATIQ_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
QUEUE = os.environ.get("DRAMATIQ_QUEUE", "idem-dramatiq")
#: How long a Redis worker may be silent before its messages go back to the queue (ms).
REDIS_HEARTBEAT_TIMEOUT = 3000


def make_broker(url: str) -> dramatiq.Broker:
    if url.startswith("redis"):
        return RedisBroker(
            url=url,
            heartbeat_timeout=REDIS_HEARTBEAT_TIMEOUT,
            maintenance_chance=MAINTENANCE_SCALE,
        )
    return RabbitmqBroker(url=url)


broker = make_broker(BROKER_URL)
dramatiq.set_broker(broker)

#: Retries fast, so that a poison message uses up its deliveries in a second or two.
FAST_RETRIES = {"max_retries": 10, "min_backoff": 50, "max_backoff": 200}


def record(name: str, event_id: str) -> None:
    Effect.objects.create(name=name, payload=str(event_id)[:255])


@idempotent_actor(consumer="dq.effect", queue_name=QUEUE, **FAST_RETRIES)
def effect(event_id: str, payload: str = "") -> None:
    record("dq.effect", event_id)


@idempotent_actor(consumer="dq.crash_before_commit", queue_name=QUEUE, **FAST_RETRIES)
def crash_before_commit(event_id: str, marker: str) -> None:
    """Writes the effect, then SIGKILLs its own worker process the first time, inside the
    transaction: nothing was committed, so the redelivery applies it."""
    record("dq.crash_before_commit", event_id)
    if not Path(marker).exists():
        Path(marker).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)


@idempotent_actor(consumer="dq.crash_after_commit", queue_name=QUEUE, **FAST_RETRIES)
def crash_after_commit(event_id: str, marker: str) -> None:
    """Writes the effect; once it has committed, and before Dramatiq acks the message, SIGKILLs
    its own worker process the first time: the redelivery is a duplicate."""
    record("dq.crash_after_commit", event_id)

    def die() -> None:
        if not Path(marker).exists():
            Path(marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)

    transaction.on_commit(die)


@idempotent_actor(consumer="dq.poison", queue_name=QUEUE, max_deliveries=3, **FAST_RETRIES)
def poison(event_id: str) -> None:
    record("dq.poison", event_id)
    raise RuntimeError("poison: this message always fails")


@idempotent_actor(consumer="dq.ordered", queue_name=QUEUE, **FAST_RETRIES)
def ordered(n: int) -> None:
    """Sent through the outbox's DramatiqTransport: the event id is in the message's options."""
    Effect.objects.create(name="dq.ordered", payload=str(n))
