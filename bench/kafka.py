"""Kafka: messages per second through the consumer runner, with and without the reservation.

Both rows run the same :class:`django_idempotency.kafka.runner.ConsumerRunner` loop on
librdkafka's mock
cluster (started in this process): poll, one ``transaction.atomic`` per message that inserts one
``Effect``, then a synchronous offset commit. They differ in the transaction only:

* ``handler alone``: the handler in ``transaction.atomic`` (an unprotected consumer);
* ``with the reservation``: :func:`~django_idempotency.events.core.process_event`, as the runner
  does: the reservation and the handler in one transaction; the delivery count, committed
  apart, only until the partition has applied a message (here, the first message);
* ``with the reservation, every message counted``: the same with a delivery count before
  every message, as the runner did before it skipped the count of first deliveries;
* ``with the reservation, in batches of 100``: batch mode (``BATCH_SIZE=100``): up to 100
  messages of a partition in one transaction, one reservation each (all made together, in
  three statements per batch), and one offset commit per batch. Each partition first takes
  101 messages one at a time and counted, as a newly assigned partition does (the mock
  cluster's topics have 4 partitions: 404 of the 2,000 messages of a round). The handler
  alone still commits once per message.

Rounds alternate the rows; each round consumes ``--messages`` fresh messages from a topic of its
own, timed from the first message handled to the last (the group join is not timed). The
database ``BENCH_DATABASE_URL`` names is created if it does not exist. The ratio
is the median over rounds of (with the reservation) / (handler alone), measured side by side::

    BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/idempotency_bench_app \\
        python -m bench.kafka --messages 2000 --rounds 3

It prints one JSON document on stdout. The mock cluster keeps everything in memory in this same
process, so the figures say what the reservation costs next to the runner's own work, not what
a real broker sustains.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from typing import Any

from bench.rounds import median_ratio, rotation

BATCH = "with the reservation, in batches of 100 (BATCH_SIZE=100)"
ROWS = (
    "handler alone",
    "with the reservation",
    "with the reservation, every message counted",
    BATCH,
)


def _setup() -> None:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.benchproject.settings")
    os.environ.setdefault("BENCH_VARIANT", "app")
    from bench.benchproject.settings import DATABASE_URL
    from bench.servers import create_database

    create_database(DATABASE_URL)  # a fresh machine has none
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def run(messages: int, rounds: int) -> dict[str, Any]:
    _setup()
    from confluent_kafka import Message, Producer
    from django.db import transaction

    from bench.benchproject.models import Effect
    from django_idempotency.kafka.runner import ConsumerRunner, Outcome
    from django_idempotency.kafka.settings import ConsumerSettings

    owner = Producer({"test.mock.num.brokers": 1, "log_level": 3})
    bootstrap = ",".join(
        f"{b.host}:{b.port}" for b in owner.list_topics(timeout=10).brokers.values()
    )
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})

    def handler(message: Message) -> None:
        Effect.objects.create(name="kafka-bench", payload=str(message.offset()), amount_cents=1)

    class TimedRunner(ConsumerRunner):
        first: float | None = None
        last: float = 0.0

        def handle(self, message: Message) -> Outcome:
            if self.first is None:
                self.first = time.perf_counter()
            outcome = super().handle(message)
            self.last = time.perf_counter()
            return outcome

        def handle_batch(self, messages: Any) -> int:
            if self.first is None:
                self.first = time.perf_counter()
            handled = super().handle_batch(messages)
            self.last = time.perf_counter()
            return handled

    class UnprotectedRunner(TimedRunner):
        def process(self, message: Message) -> Outcome:
            with transaction.atomic():
                self.handler(message)
            return Outcome.APPLIED

    class CountingRunner(TimedRunner):
        def process(self, message: Message) -> Outcome:
            self._settled.clear()  # every partition as if just assigned: every message counted
            return super().process(message)

    runners = {
        "handler alone": UnprotectedRunner,
        "with the reservation": TimedRunner,
        "with the reservation, every message counted": CountingRunner,
        BATCH: TimedRunner,
    }

    def one_round(row: str) -> float:
        topic = f"bench-{uuid.uuid4().hex[:8]}"
        for _ in range(messages):
            producer.produce(topic, value=b"{}", headers={"event_id": str(uuid.uuid4())})
            producer.poll(0)
        producer.flush(60)
        settings = ConsumerSettings(
            name="bench.kafka",
            handler="unused",
            topics=(topic,),
            group=f"bench-{uuid.uuid4().hex[:8]}",
            config={"bootstrap.servers": bootstrap},
            poll_timeout=0.1,
            batch_size=100 if row == BATCH else 1,
        )
        runner = runners[row](settings, handler=handler)
        runner.run(max_messages=messages)
        assert runner.first is not None and runner.counts[Outcome.APPLIED] == messages
        return round(messages / (runner.last - runner.first), 1)

    one_round("with the reservation")  # warm-up: connections, imports, plan caches
    per_round: dict[str, list[float]] = {row: [] for row in ROWS}
    for round_no in range(rounds):
        for row in rotation(ROWS, round_no):
            per_round[row].append(one_round(row))

    def ratio(row: str) -> float:
        return median_ratio(per_round[row], per_round["handler alone"])

    return {
        "messages_per_round": messages,
        "rounds": rounds,
        "rows": [
            {
                "row": row,
                "messages_per_s": statistics.median(per_round[row]),
                "rounds": per_round[row],
                "ratio_to_alone": ratio(row),
            }
            for row in ROWS
        ],
        "ratio_with_reservation_to_alone": ratio("with the reservation"),
        "ratio_batch_to_alone": ratio(BATCH),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000, help="messages per row per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.messages, args.rounds)))


if __name__ == "__main__":
    main()
