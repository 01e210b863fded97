"""The Kafka handler of the Kafka tests (``tests/test_kafka_runner.py``), consumer ``shop.kafka``.

Each message's value is a JSON object. The handler writes one
:class:`~testproject.shop.models.Effect` named ``kafka`` per execution, with the event id as its
payload, so the tests can count effects. ``"behaviour"`` makes it misbehave on purpose:

* ``"fail"``: raise, every time (a poison message), unless ``$SHOP_KAFKA_FIXED`` is set (the
  bug was fixed: the dead-letter replay test);
* ``"fail_twice"``: raise on the first two deliveries, then succeed (it reads the delivery
  counter, so the deliveries must be counted: a partition's first messages on a new owner);
* ``"fail_first_two"``: raise on the first two executions, counted or not, in a batch or alone
  (the lines of ``<event id>.runs``, below; ``$SHOP_KAFKA_PROBE_DIR`` must be set), then
  succeed;
* ``"die"``: SIGKILL its own process, inside the transaction (a message that kills its
  consumer every time), unless ``$SHOP_KAFKA_FIXED`` is set;
* ``"exit"``: end its own process with ``os._exit(3)`` inside the transaction (a crash that
  runs no cleanup: a segfault in a client library, say);
* ``"hang"``: sleep for ever inside the transaction (a call without a timeout, a deadlock),
  unless ``$SHOP_KAFKA_FIXED`` is set: the runner's ``HANDLER_TIMEOUT`` ends the process;
* ``"slow"``: write ``<event id>.started`` into ``$SHOP_KAFKA_PAUSE_DIR``, then take two
  seconds (the graceful stop test sends SIGTERM meanwhile);
* ``"pause_after_commit"``: after the transaction commits, write ``<event id>.committed`` into
  ``$SHOP_KAFKA_PAUSE_DIR`` and wait for ever: the test SIGKILLs the consumer there, after the
  database commit and before the offset commit.

With ``$SHOP_KAFKA_PROBE_DIR`` set, each execution first appends a line to ``<event id>.runs``
there: how many events are reserved in its transaction with this one (its batch, whose
reservations share one ``processed_at``; ``1`` alone), so a test sees whether a poison message
ran inside a batch before it failed or killed its consumer.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from django.db import transaction

from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.shop.models import Effect

if TYPE_CHECKING:
    from confluent_kafka import Message

CONSUMER = "shop.kafka"


def event_id_header(message: Message) -> str:
    headers = dict(message.headers() or [])
    value = headers.get("event_id")
    return value.decode() if isinstance(value, bytes) else str(value)


def apply(message: Message) -> None:
    event = json.loads(message.value() or b"{}")
    event_id = event.get("event_id") or event_id_header(message)
    Effect.objects.create(name="kafka", payload=event_id)
    behaviour = event.get("behaviour")
    runs = _probe(event_id)
    if behaviour == "fail_first_two" and runs <= 2:
        raise RuntimeError(f"failure {runs} of {event_id}")
    if behaviour == "fail" and not os.environ.get("SHOP_KAFKA_FIXED"):
        raise RuntimeError(f"poison message {event_id}")
    if behaviour == "fail_twice":
        deliveries = EventDelivery.objects.get(consumer=CONSUMER, event_id=event_id).deliveries
        if deliveries <= 2:
            raise RuntimeError(f"failure {deliveries} of {event_id}")
    if behaviour == "die" and not os.environ.get("SHOP_KAFKA_FIXED"):
        os.kill(os.getpid(), signal.SIGKILL)
    if behaviour == "exit":
        os._exit(3)
    if behaviour == "hang" and not os.environ.get("SHOP_KAFKA_FIXED"):
        while True:
            time.sleep(0.1)
    if behaviour == "slow":
        (Path(os.environ["SHOP_KAFKA_PAUSE_DIR"]) / f"{event_id}.started").touch()
        time.sleep(2)
    if behaviour == "pause_after_commit":
        transaction.on_commit(lambda: _pause(event_id))


def _probe(event_id: str) -> int:
    """With ``$SHOP_KAFKA_PROBE_DIR``: append this execution's batch size to ``<event id>.runs``
    and return how many executions the file holds (0 without the variable)."""
    folder = os.environ.get("SHOP_KAFKA_PROBE_DIR")
    if not folder:
        return 0
    reserved = ProcessedEvent.objects.filter(consumer=CONSUMER)
    stamp = reserved.filter(event_id=event_id).values("processed_at")[:1]
    mates = reserved.filter(processed_at=stamp).count()
    path = Path(folder) / f"{event_id}.runs"
    with path.open("a") as runs:  # closed, so written before an os._exit or a SIGKILL
        runs.write(f"{mates}\n")
    return len(path.read_text().splitlines())


def _pause(event_id: str) -> None:
    folder = Path(os.environ["SHOP_KAFKA_PAUSE_DIR"])  # only the crash test sets it
    (folder / f"{event_id}.committed").touch()
    while True:
        time.sleep(0.1)
