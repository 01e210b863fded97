"""The outbox, measured: what ``publish`` costs a transaction, how fast one relay sends, and how
long an event takes from COMMIT to its consumer's effect.

    python -m bench.outbox                                  # PostgreSQL, Redis and RabbitMQ
    python -m bench.outbox --database-url mysql://root@127.0.0.1:3306/idempotency_bench_outbox
    python -m bench.outbox --quick                          # a tiny run, to check it works

Three sections, each measured side by side in one run:

1. **publish cost**: one transaction that creates an ``Order``, alone, with
   ``apply_async_on_commit`` (the task is published to Redis after COMMIT, in the request), and
   with ``outbox.publish`` (one more row in the transaction). Rows alternate round by round;
   time per transaction and statements per transaction.
2. **relay throughput**: ``Relay.drain()`` over N pending messages, through a transport that
   acknowledges at once (the database's share alone), through Celery to Redis and to RabbitMQ
   with publisher confirms, old path and new side by side: one ``send_task`` per message (and
   one confirm round trip each on RabbitMQ) against today's ``CeleryTransport`` (one pipeline
   per batch; all of a batch's confirms waited for at once), and with one AMQP transaction per
   batch; and the new transport alone on the same messages, in the same batches (the broker's
   share alone). Messages per second, against the targets (5,000 and 2,000), and a chart with
   ``--charts DIR``.
3. **latency**: a relay process and a Celery worker over Redis; a producer commits messages at
   a steady pace and one at a time; the time from each COMMIT to its effect's row, p50 to p99,
   with NOTIFY (PostgreSQL) and with polling alone, against ``apply_async_on_commit``: the
   section is :mod:`bench.latency` (run alone, it also compares an older relay side by side).

It uses the test project's settings against its own database (created and migrated here) and
prints a JSON document and tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.servers import create_database

REPO = Path(__file__).resolve().parent.parent
REDIS = "redis://127.0.0.1:6379/12"
RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
DEFAULT_DB = "postgres://postgres@127.0.0.1:5432/idempotency_bench_outbox"


def setup(database_url: str) -> None:
    os.environ["DATABASE_URL"] = database_url
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    os.environ["CELERY_BROKER_URL"] = REDIS  # real publishes, not eager
    os.environ["IDEMPOTENCY_LOG_LEVEL"] = "WARNING"
    create_database(database_url)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def start(database_url: str) -> str:
    """The test project on ``database_url``, migrated, its outbox and shop tables emptied:
    the database's vendor."""
    sys.path.insert(0, str(REPO))
    setup(database_url)
    from django.db import connection

    clear()
    return str(connection.vendor)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def clear() -> None:
    from django_idempotency.models import EventDelivery, OutboxEntry, ProcessedEvent
    from testproject.shop.models import Effect, Order

    for model in (OutboxEntry, Effect, ProcessedEvent, EventDelivery, Order):
        model.objects.all().delete()


@contextmanager
def queue(broker: str, label: str) -> Iterator[str]:
    from tests.workers import delete_queue, new_queue_name

    name = new_queue_name(label)
    try:
        yield name
    finally:
        delete_queue(broker, name)


# --- 1. What publish costs a transaction -------------------------------------------------------


def publish_cost(transactions: int, rounds: int) -> dict[str, Any]:
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from django_idempotency import new_event_id
    from django_idempotency.outbox import core as outbox
    from testproject.shop.models import Order
    from testproject.shop.tasks import effect

    with queue(REDIS, "bench-publish") as name:

        def alone() -> None:
            with transaction.atomic():
                Order.objects.create(reference="bench", amount_cents=1)

        def on_commit() -> None:
            with transaction.atomic():
                Order.objects.create(reference="bench", amount_cents=1)
                effect.apply_async_on_commit(kwargs={"event_id": str(new_event_id())}, queue=name)

        def via_outbox() -> None:
            with transaction.atomic():
                Order.objects.create(reference="bench", amount_cents=1)
                outbox.publish(effect, queue=name)

        rows: dict[str, Callable[[], None]] = {
            "order alone": alone,
            "order + apply_async_on_commit (Redis)": on_commit,
            "order + outbox.publish": via_outbox,
        }
        times: dict[str, list[float]] = {row: [] for row in rows}
        statements: dict[str, int] = {}
        for row, run in rows.items():  # warm-up, and the statement count
            run()
            with CaptureQueriesContext(connection) as captured:
                run()
            statements[row] = len(captured.captured_queries)
        per_round = max(1, transactions // rounds)
        for _ in range(rounds):
            for row, run in rows.items():
                for _ in range(per_round):
                    started = time.perf_counter()
                    run()
                    times[row].append(time.perf_counter() - started)
    clear()
    base = statistics.mean(times["order alone"])
    return {
        row: {
            "statements": statements[row],
            "mean_us": round(statistics.mean(values) * 1e6),
            "p50_us": round(percentile(values, 50) * 1e6),
            "p99_us": round(percentile(values, 99) * 1e6),
            "vs_alone": round(statistics.mean(values) / base, 2),
            "transactions": len(values),
        }
        for row, values in times.items()
    }


# --- 2. Relay throughput -----------------------------------------------------------------------


class NullTransport:
    """Acknowledges every message at once: the relay's database work alone."""

    def send(self, messages: Sequence[Any]) -> list[BaseException | None]:
        return [None] * len(messages)

    def close(self) -> None:
        pass


def fill(count: int, queue_name: str) -> None:
    from django.db import transaction

    from django_idempotency.outbox import core as outbox

    for start in range(0, count, 500):
        with transaction.atomic():
            for n in range(start, min(count, start + 500)):
                outbox.publish("shop.effect", queue=queue_name, key=f"k{n % 100}")
    vacuum()


def vacuum() -> None:
    """What autovacuum does in a steady state: drop dead index entries, refresh statistics.

    Without it, the dead rows of earlier runs make the claim's index scan read every one of
    them (and the planner's stale estimate picks a bitmap scan and a sort).
    """
    from django.db import connection

    from django_idempotency.models import OutboxEntry

    table = connection.ops.quote_name(OutboxEntry._meta.db_table)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"VACUUM ANALYZE {table}")
        elif connection.vendor == "mysql":
            cursor.execute(f"ANALYZE TABLE {table}")
            cursor.fetchall()


class SendTaskTransport:
    """The previous ``CeleryTransport``, kept here to measure against: one ``send_task`` per
    message (inside kombu's ``Producer.batch`` on Redis) and, on RabbitMQ, a publisher confirm
    waited for after each message (py-amqp's ``confirm_publish``)."""

    def __init__(self, app: Any, broker_url: str) -> None:
        self.app = app
        self.broker_url = broker_url
        self.connection: Any = None

    def send(self, messages: Sequence[Any]) -> list[BaseException | None]:
        from django_idempotency.events.core import EVENT_ID_KEY

        if self.connection is None:
            self.connection = self.app.connection_for_write(
                self.broker_url, transport_options={"confirm_publish": True}
            )
            self.connection.ensure_connection(max_retries=1)
            self.producer = self.app.amqp.Producer(self.connection)
        results: list[BaseException | None] = []
        with self.producer.batch(max_size=4 * len(messages) + 16):
            for message in messages:
                payload = message.payload
                self.app.send_task(
                    message.destination,
                    args=list(payload["args"]),
                    kwargs=dict(payload["kwargs"]),
                    task_id=message.event_id,
                    headers={**message.headers, EVENT_ID_KEY: message.event_id},
                    producer=self.producer,
                    retry=False,
                    **dict(payload.get("options") or {}),
                )
                results.append(None)
        return results

    def close(self) -> None:
        if self.connection is not None:
            self.connection.release()
            self.connection = None


RELAY_PATHS: list[tuple[str, str | None, dict[str, Any], bool, int | None]] = [
    # label, broker (None: no broker), CeleryTransport options, old path to compare, target msg/s
    ("null transport (the database's share)", None, {}, False, None),
    ("Celery to Redis", REDIS, {}, True, 5000),
    ("Celery to RabbitMQ, publisher confirms", RABBITMQ, {}, True, 2000),
    ("Celery to RabbitMQ, AMQP transactions", RABBITMQ, {"transactions": True}, False, None),
]


def relay_throughput(count: int, batch_size: int) -> dict[str, Any]:
    """Each path's messages per second through ``Relay.drain()``, old path and new side by side
    (the old one is :class:`SendTaskTransport`), and the new transport alone on the same
    messages in the same batches (the broker's share)."""
    from django_idempotency.models import OutboxEntry
    from django_idempotency.outbox.relay import Relay
    from django_idempotency.outbox.transports import CeleryTransport, OutboxMessage
    from testproject.celery import app

    def transport_for(broker: str | None, options: dict[str, Any], old: bool) -> Any:
        if broker is None:
            return NullTransport()
        if old:
            return SendTaskTransport(app, broker)
        return CeleryTransport(app=app, broker_url=broker, **options)

    def drain(broker: str | None, options: dict[str, Any], old: bool) -> tuple[float, float]:
        """Messages per second through the relay, and through the transport alone (0: not
        measured)."""
        with queue(broker or REDIS, "bench-relay") as name:
            fill(count, name)
            transport = transport_for(broker, options, old)
            relay = Relay(batch_size=batch_size, transports={"default": transport})
            started = time.perf_counter()
            total = relay.drain()
            seconds = time.perf_counter() - started
            transport.close()
            assert total.sent == count, total
            alone = 0.0
            if broker is not None and not old:
                rows_sent = OutboxEntry.objects.order_by("pk")
                messages = [OutboxMessage.from_entry(row) for row in rows_sent]
                transport = transport_for(broker, options, old)
                started = time.perf_counter()
                outcomes = [
                    outcome
                    for start in range(0, len(messages), batch_size)
                    for outcome in transport.send(messages[start : start + batch_size])
                ]
                alone = time.perf_counter() - started
                transport.close()
                assert all(outcome is None for outcome in outcomes), outcomes[:3]
        clear()
        return count / seconds, (count / alone if alone else 0.0)

    results: dict[str, Any] = {}
    for label, broker, options, compare, target in RELAY_PATHS:
        row: dict[str, Any] = {"messages": count, "old_per_second": "-"}
        if compare:
            row["old_per_second"] = round(drain(broker, options, old=True)[0])
        relay_rate, alone_rate = drain(broker, options, old=False)
        row["new_per_second"] = round(relay_rate)
        row["speedup"] = f"{relay_rate / row['old_per_second']:.1f}x" if compare else "-"
        row["transport_alone_per_second"] = round(alone_rate) if alone_rate else "-"
        row["target"] = target or "-"
        row["met"] = ("yes" if relay_rate >= target else "no") if target else "-"
        results[label] = row
    return results


def kafka_throughput(count: int, batch_size: int) -> dict[str, Any]:
    """``KafkaTransport`` alone on librdkafka's mock cluster (or ``KAFKA_BOOTSTRAP_SERVERS``):
    batches of ``batch_size`` over 100 ordering keys, so one batch is sent in a few rounds, each
    produced at once and flushed once. Messages per second."""
    import uuid

    from django.utils import timezone

    from django_idempotency.kafka.transport import KafkaTransport
    from django_idempotency.outbox.transports import OutboxMessage
    from tests.kafka_cluster import Cluster

    cluster = Cluster()
    try:
        topic = cluster.new_topic("bench-outbox")
        now = timezone.now()
        messages = [
            OutboxMessage(
                id=n,
                event_id=str(uuid.uuid4()),
                destination=topic,
                payload={"n": n},
                headers={},
                ordering_key=f"k{n % 100}",
                created_at=now,
                attempts=1,
            )
            for n in range(count)
        ]
        transport = KafkaTransport({"bootstrap.servers": cluster.bootstrap})
        transport.send(messages[:10])  # connected, topic known
        started = time.perf_counter()
        outcomes = [
            outcome
            for start in range(0, count, batch_size)
            for outcome in transport.send(messages[start : start + batch_size])
        ]
        seconds = time.perf_counter() - started
        transport.close()
    finally:
        cluster.close()
    assert all(outcome is None for outcome in outcomes), outcomes[:3]
    return {
        "KafkaTransport alone (mock cluster, 100 keys)": {
            "messages": count,
            "seconds": round(seconds, 2),
            "per_second": round(count / seconds),
        }
    }


def relay_chart(relay: dict[str, Any], out: Path) -> Path:
    """Messages per second per path, old and new side by side, the target as a red mark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "django-idempotency"
    matplotlib.rcParams["svg.fonttype"] = "none"
    labels = list(relay)
    fig, ax = plt.subplots(figsize=(9.5, 0.9 + 0.6 * len(labels)))
    ys = list(range(len(labels)))[::-1]
    old = [row["old_per_second"] if row["old_per_second"] != "-" else 0 for row in relay.values()]
    new = [row["new_per_second"] for row in relay.values()]
    ax.barh([y + 0.2 for y in ys], old, height=0.4, color="#9aa5b1", label="one send_task each")
    ax.barh([y - 0.2 for y in ys], new, height=0.4, color="#2b6cb0", label="batched (now)")
    for y, row in zip(ys, relay.values(), strict=True):
        ax.text(row["new_per_second"], y - 0.2, f" {row['new_per_second']:,}", va="center",
                fontsize=8)  # fmt: skip
        if isinstance(row["target"], int):
            ax.plot([row["target"]] * 2, [y - 0.45, y + 0.45], color="#c53030", linewidth=1.5)
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_xlabel("messages per second, one relay (higher is better; red: the target)", fontsize=8)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Outbox relay throughput", fontsize=10)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "outbox-relay.svg"
    fig.savefig(path)
    plt.close(fig)
    return path


# --- The run -----------------------------------------------------------------------------------


def table(title: str, rows: dict[str, dict[str, Any]]) -> str:
    columns = list(next(iter(rows.values())))
    width = max(len(row) for row in rows) + 2
    sizes = [max(16, len(c) + 2) for c in columns]
    lines = [
        f"\n{title}",
        " " * width + "".join(f"{c:>{n}}" for c, n in zip(columns, sizes, strict=True)),
    ]
    for row, values in rows.items():
        cells = "".join(f"{values[c]!s:>{n}}" for c, n in zip(columns, sizes, strict=True))
        lines.append(f"{row:<{width}}" + cells)
    return "\n".join(lines)


def report(document: dict[str, Any], output: str) -> None:
    """Print ``document`` as JSON, and write it to the file ``output`` too unless empty."""
    print(json.dumps(document, indent=2))
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(document, indent=2) + "\n")


def tables(titles: dict[str, str], results: dict[str, Any], vendor: str) -> None:
    """Print a table per section of ``results`` that ``titles`` names, in its order."""
    for name, title in titles.items():
        if name in results:
            print(table(f"{title} [{vendor}]", results[name]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.outbox", description=__doc__)
    parser.add_argument("--database-url", default=DEFAULT_DB)
    parser.add_argument("--transactions", type=int, default=3000, help="publish cost, per row")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--messages", type=int, default=20_000, help="relay throughput")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--latency-messages", type=int, default=500, help="steady, per row")
    parser.add_argument("--rate", type=float, default=25.0, help="latency: steady commits/s")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="publish,relay,kafka,latency")
    parser.add_argument(
        "--charts", default="", help="a folder for the relay chart (outbox-relay.svg); empty: none"
    )
    parser.add_argument("--output", default="", help="also write the JSON document here")
    args = parser.parse_args(argv)
    if args.quick:
        args.transactions, args.rounds, args.messages, args.latency_messages = 60, 2, 500, 40
    vendor = start(args.database_url)
    sections = args.only.split(",")
    results: dict[str, Any] = {"database": vendor}
    with tempfile.TemporaryDirectory(prefix="bench-outbox-") as tmp:
        if "publish" in sections:
            results["publish"] = publish_cost(args.transactions, args.rounds)
        if "relay" in sections:
            results["relay"] = relay_throughput(args.messages, args.batch_size)
        if "kafka" in sections:
            results["kafka"] = kafka_throughput(args.messages, args.batch_size)
        if "latency" in sections:
            from bench.latency import latency

            results["latency"] = latency(
                count=args.latency_messages,
                rate=args.rate,
                isolated_count=max(10, args.latency_messages // 10),
                rounds=min(args.rounds, 3),
                tmp=Path(tmp),
            )
    report(results, args.output)
    titles = {
        "publish": "What a transaction costs (one Order insert, then the event)",
        "relay": f"Relay throughput (one relay, batches of {args.batch_size})",
        "kafka": f"Kafka transport throughput (batches of {args.batch_size})",
        "latency": f"COMMIT to effect (a Celery worker; steady: {args.rate:g} commits/s)",
    }
    tables(titles, results, vendor)
    if args.charts and "relay" in results:
        print(f"\nchart: {relay_chart(results['relay'], Path(args.charts))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
