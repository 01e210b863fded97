"""Batch mode of the Kafka runner (``BATCH_SIZE`` above 1): one transaction and one offset
commit per batch of a partition, one reservation per message, and the one-at-a-time fallback
that isolates a poison message. Fast in-process proofs on the mock cluster, then the slow
SIGKILL, poison and rebalance proofs with real consumer processes."""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("confluent_kafka")

from confluent_kafka import Message
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.utils import timezone

from django_idempotency.kafka.runner import ConsumerRunner, Outcome
from django_idempotency.kafka.settings import parse_consumers
from django_idempotency.kafka.watchdog import HANG_EXIT_STATUS
from django_idempotency.models import EventDelivery, ProcessedEvent
from testproject.shop.models import Effect
from tests import test_kafka_runner as one_at_a_time
from tests.kafka_batch_helpers import RecordingRunner, topic_fixture
from tests.kafka_cluster import Cluster
from tests.test_kafka_runner import consumers  # noqa: F401 - the fixture of the slow proofs
from tests.test_kafka_runner_fast import (
    REGRESSION,
    committed,
    effect_ids,
    event,
    produce,
    recording_handler,
    settings_for,
    wait_until,
)

pytestmark = [pytest.mark.timeout(480), pytest.mark.django_db(transaction=True)]  # hang guards


topic = topic_fixture("batch")


def test_a_batch_is_one_transaction_with_one_offset_commit(
    kafka_cluster: Cluster, topic: str
) -> None:
    """A newly assigned partition takes its first BATCH_SIZE (3) messages one at a time, and
    one more to settle; the next ones share one transaction per batch: all the batch's
    handlers run before any of its commit hooks."""
    values = [event() for _ in range(12)]
    produce(kafka_cluster, topic, values)
    ids = [json.loads(v)["event_id"] for v in values]
    order: list[str] = []

    def handler(message: Message) -> None:
        event_id = json.loads(message.value() or b"")["event_id"]
        Effect.objects.create(name="fast", payload=event_id)
        order.append(f"run {event_id}")
        transaction.on_commit(lambda: order.append(f"commit {event_id}"))

    settings = settings_for(kafka_cluster, topic, batch_size=3, event_id_source="json")
    runner = ConsumerRunner(settings, handler)
    runner.run(max_messages=12)

    assert runner.counts == {Outcome.APPLIED: 12}
    alone = [entry for event_id in ids[:4] for entry in (f"run {event_id}", f"commit {event_id}")]
    assert order[:8] == alone
    assert "run" in order[9]  # a second handler before the first one's commit: one batch
    assert sorted(entry.split()[1] for entry in order if entry.startswith("commit")) == sorted(ids)
    assert sorted(effect_ids()) == sorted(ids)
    assert sum(committed(kafka_cluster, settings).values()) == 12


@pytest.mark.slow  # over 5 s: kept out of make test-quick; CI runs it with the slow tests
def test_a_failure_rolls_the_batch_back_and_isolates_the_poison(
    kafka_cluster: Cluster, topic: str
) -> None:
    values = [event() for _ in range(3)] + [event(poison=True)] + [event() for _ in range(3)]
    produce(kafka_cluster, topic, values)
    ids = [json.loads(v)["event_id"] for v in values]
    seen: list[str] = []
    settings = settings_for(
        kafka_cluster, topic, batch_size=50, event_id_source="json", max_deliveries=1
    )
    runner = ConsumerRunner(settings, recording_handler(seen, fail=lambda e: "poison" in e))
    thread = threading.Thread(target=runner.run)
    thread.start()
    try:
        wait_until(lambda: runner.counts[Outcome.DEAD_LETTERED] == 1 and len(effect_ids()) == 6)
        wait_until(lambda: sum(committed(kafka_cluster, settings).values()) == 7)
    finally:
        runner.stop()
        thread.join(30)

    healthy = [i for i in ids if i != ids[3]]
    assert Counter(effect_ids()) == Counter(healthy)  # once each, the batch's rolled back
    assert runner.counts[Outcome.DEAD_LETTERED] == 1
    assert runner.counts[Outcome.APPLIED] == 6
    [dead] = kafka_cluster.read(f"{topic}.dlq", 1)
    assert json.loads(dead.value() or b"")["event_id"] == ids[3]
    assert sum(committed(kafka_cluster, settings).values()) == 7


def test_a_batch_reserves_its_messages_together_without_a_savepoint_each(
    kafka_cluster: Cluster, topic: str
) -> None:
    """Regression: each message of a batch took a savepoint (two statements) and, on MariaDB,
    one more for its reservation's insert, then a read of its counter: seven statements with
    the handler's insert. Now a batch reserves all its messages in three statements (the
    processed ones, the insert, their counters), and each message costs its handler alone."""
    values = [event() for _ in range(12)]
    produce(kafka_cluster, topic, values)
    settings = settings_for(kafka_cluster, topic, batch_size=5, event_id_source="json")
    runner = RecordingRunner(settings, recording_handler([]))
    runner.run(max_messages=12)

    assert runner.counts == {Outcome.APPLIED: 12}
    assert runner.batches and runner.fallbacks == 0
    for batch in runner.batches:
        # SQLite's transaction begins with a statement of its own; it is no reservation's.
        statements = [s for s in batch if s.upper() != "BEGIN"]
        handler_inserts = [s for s in statements if "shop_effect" in s]
        library = [s for s in statements if "django_idempotency_" in s]
        assert not [s for s in statements if "SAVEPOINT" in s.upper()], statements
        assert len(library) == 3, library
        assert len(statements) == len(handler_inserts) + 3
    # 5 alone and 1 to settle: the other 6 messages were batched, one handler insert each.
    assert sum(len([s for s in b if "shop_effect" in s]) for b in runner.batches) == 12 - 6
    assert sorted(effect_ids()) == sorted(json.loads(v)["event_id"] for v in values)


@REGRESSION
def test_a_batch_skips_what_it_applied_before_and_an_id_it_holds_twice(
    kafka_cluster: Cluster, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch met again (its offsets lost after its commit), and a producer's retry inside
    one batch: duplicates, skipped within the batch, with no fallback to one at a time."""
    values = [event() for _ in range(10)]
    ids = [json.loads(v)["event_id"] for v in values]
    applied_before = ids[7]
    ProcessedEvent.objects.create(
        consumer="batch-dup", event_id=applied_before, expires_at=timezone.now()
    )
    produce(kafka_cluster, topic, [*values, values[8]])
    settings = settings_for(
        kafka_cluster, topic, name="batch-dup", batch_size=6, event_id_source="json"
    )
    runner = RecordingRunner(settings, recording_handler([]))
    with caplog.at_level(logging.INFO, "django_idempotency"):
        runner.run(max_messages=11)

    assert runner.counts == {Outcome.APPLIED: 9, Outcome.DUPLICATE: 2}
    assert runner.fallbacks == 0
    assert "rolled back" not in caplog.text
    assert f"duplicate ignored: event {applied_before}" in caplog.text
    assert f"duplicate ignored: event {ids[8]}" in caplog.text
    assert sorted(effect_ids()) == sorted(i for i in ids if i != applied_before)
    assert sum(committed(kafka_cluster, settings).values()) == 11


@REGRESSION
def test_a_parked_event_in_a_batch_is_dead_lettered_after_the_fallback(
    kafka_cluster: Cluster, topic: str
) -> None:
    """An event parked before (by an earlier owner) in a batch: the batch refuses it before any
    handler runs, rolls back, and one at a time the event is dead-lettered, the others
    applied."""
    values = [event() for _ in range(9)]
    ids = [json.loads(v)["event_id"] for v in values]
    now = timezone.now()
    EventDelivery.objects.create(
        consumer="batch-parked",
        event_id=ids[7],
        deliveries=3,
        last_error="RuntimeError: killed it",
        parked_at=now,
        expires_at=now,
    )
    produce(kafka_cluster, topic, values)
    seen: list[str] = []
    settings = settings_for(
        kafka_cluster, topic, name="batch-parked", batch_size=5, event_id_source="json"
    )
    runner = RecordingRunner(settings, recording_handler(seen))
    runner.run(max_messages=9)

    assert runner.counts == {Outcome.APPLIED: 8, Outcome.DEAD_LETTERED: 1}
    assert 1 <= runner.fallbacks <= 3  # the batch that held it, one at a time
    assert ids[7] not in seen
    assert sorted(effect_ids()) == sorted(i for i in ids if i != ids[7])
    [dead] = kafka_cluster.read(f"{topic}.dlq", 1)
    assert json.loads(dead.value() or b"")["event_id"] == ids[7]
    assert dict(dead.headers() or [])["dlq.error"] == b"RuntimeError: killed it"


@REGRESSION
def test_a_batch_whose_event_id_cannot_be_read_says_so_and_goes_one_at_a_time(
    kafka_cluster: Cluster, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a message without an event id in a batch made the runner log "batch of N
    messages rolled back" although no transaction had been opened (the ids are read before
    it). The log says now that the batch could not be started, which message's id could not
    be read and why; its messages still go one at a time, the id-less one dead-lettered."""
    # BATCH_SIZE=3: four messages alone (three, and one more to settle), then batches.
    values = [event() for _ in range(5)] + [json.dumps({"note": "no id"}).encode(), event()]
    produce(kafka_cluster, topic, values)
    settings = settings_for(kafka_cluster, topic, batch_size=3, event_id_source="json")
    runner = RecordingRunner(settings, recording_handler([]))
    with caplog.at_level(logging.INFO, "django_idempotency"):
        runner.run(max_messages=len(values))

    assert runner.counts == {Outcome.APPLIED: 6, Outcome.DEAD_LETTERED: 1}
    assert runner.fallbacks >= 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert not [line for line in warnings if "rolled back" in line], warnings
    [(partition, offset)] = committed(kafka_cluster, settings).items()
    assert offset == len(values)
    [line] = [line for line in warnings if "could not start" in line]
    assert line.startswith("could not start a batch of ") and " messages: " in line, line
    assert f"the event id of {topic}[{partition}]@5 could not be read" in line, line
    assert "MissingEventId" in line and "no event id (json:event_id)" in line, line
    assert "no transaction was opened" in line and "one at a time" in line, line
    [dead] = kafka_cluster.read(f"{topic}.dlq", 1)
    assert json.loads(dead.value() or b"") == {"note": "no id"}
    assert dict(dead.headers() or [])["dlq.error"].startswith(b"MissingEventId: ")
    healthy = [json.loads(v)["event_id"] for v in values if b"event_id" in v]
    assert Counter(effect_ids()) == Counter(healthy)


class Died(BaseException):
    """The consumer's death (SIGKILL, out of memory), in process: no handler catches it."""


class Mortal(ConsumerRunner):
    """A runner whose death commits nothing more: no offset, as after a SIGKILL."""

    dead = False

    def _commit(self, partitions: Any = None) -> None:
        if not self.dead:
            super()._commit(partitions)


@REGRESSION
def test_a_killer_behind_batches_whose_offsets_were_not_committed_is_counted_at_once(
    kafka_cluster: Cluster, topic: str
) -> None:
    """Regression: with COMMIT_INTERVAL, an owner commits batches to the database ahead of
    their offsets. Its next owner meets those messages again as duplicates, and each one used
    up a message of its warm-up (the first BATCH_SIZE messages, one at a time and counted), so
    it batched the messages after the first one it applied, the killer among them: uncounted,
    the killer took one more owner each time. Only applied messages end the warm-up now: the
    killer is counted by every owner after the first, and dead-lettered by the fifth."""
    # Taken three at a time: the killer is the third of its batch, behind two healthy ones.
    values = [event() for _ in range(8)] + [event(die=True)] + [event() for _ in range(3)]
    produce(kafka_cluster, topic, values)
    settings = settings_for(
        kafka_cluster,
        topic,
        batch_size=3,
        commit_interval=3600.0,
        event_id_source="json",
        max_deliveries=3,
    )
    deaths = 0
    while True:
        runner = Mortal(settings, handler=None)  # type: ignore[arg-type]

        def handler(message: Message, runner: Mortal = runner) -> None:
            body = json.loads(message.value() or b"")
            if body.get("die"):
                runner.dead = True
                raise Died
            Effect.objects.create(name="fast", payload=body["event_id"])

        runner.handler = handler
        try:
            runner.run(max_messages=len(values))
        except Died:
            deaths += 1
            assert deaths < 7, "the killer was never counted"
            continue
        break

    assert deaths == 4  # one in a batch, uncounted; three counted; the fifth dead-letters it
    assert runner.counts[Outcome.DEAD_LETTERED] == 1
    [dead] = kafka_cluster.read(f"{topic}.dlq", 1)
    assert dict(dead.headers() or [])["dlq.deliveries"] == b"4"
    healthy = [json.loads(v)["event_id"] for v in values if b'"die"' not in v]
    assert Counter(effect_ids()) == Counter(healthy)


@REGRESSION
def test_a_handler_that_dooms_the_transaction_costs_the_batch_no_message(
    kafka_cluster: Cluster, topic: str
) -> None:
    """Regression: a handler that marks the transaction for rollback without raising
    (``set_rollback(True)``, or on PostgreSQL an error it catches without a savepoint) made
    the batch's COMMIT roll back every message of the batch, silently, and their offsets were
    committed: all lost. The batch goes one message at a time now, where such a message is a
    failed delivery (as with BATCH_SIZE=1): dead-lettered after MAX_DELIVERIES, the others
    applied once each."""
    values = [event() for _ in range(5)] + [event(doom=True)] + [event() for _ in range(3)]
    produce(kafka_cluster, topic, values)
    ids = [json.loads(v)["event_id"] for v in values]

    def handler(message: Message) -> None:
        body = json.loads(message.value() or b"{}")
        Effect.objects.create(name="fast", payload=body["event_id"])
        if body.get("doom"):
            transaction.set_rollback(True)

    settings = settings_for(kafka_cluster, topic, batch_size=3, event_id_source="json")
    runner = RecordingRunner(settings, handler)
    thread = threading.Thread(target=runner.run)
    thread.start()
    try:
        wait_until(lambda: runner.counts[Outcome.DEAD_LETTERED] == 1 and len(effect_ids()) == 8)
        wait_until(lambda: sum(committed(kafka_cluster, settings).values()) == len(values))
    finally:
        runner.stop()
        thread.join(30)

    assert runner.fallbacks >= 1
    assert Counter(effect_ids()) == Counter(i for i in ids if i != ids[5])
    [dead] = kafka_cluster.read(f"{topic}.dlq", 1)
    assert json.loads(dead.value() or b"")["event_id"] == ids[5]
    assert b"unable to commit" in dict(dead.headers() or [])["dlq.error"]


@pytest.mark.parametrize("value", [0, -1, True, "10", 1.5, 10_001])
def test_batch_size_is_validated(value: Any) -> None:
    entry = {
        "HANDLER": "x.y",
        "TOPICS": ["t"],
        "GROUP": "g",
        "CONFIG": {"bootstrap.servers": "k:9092"},
        "BATCH_SIZE": value,
    }
    with pytest.raises(ImproperlyConfigured, match=r"\['BATCH_SIZE'\] must be an integer"):
        parse_consumers("KAFKA_CONSUMERS", {"c": entry})


def test_batch_size_defaults_to_one_message_per_transaction() -> None:
    entry = {"HANDLER": "x.y", "TOPICS": ["t"], "GROUP": "g", "CONFIG": {"bootstrap.servers": "k"}}
    assert parse_consumers("KAFKA_CONSUMERS", {"c": entry})["c"].batch_size == 1


# --- The slow proofs, in batch mode ------------------------------------------------------------


@pytest.fixture
def batched(consumers: Any) -> Any:  # noqa: F811 - the imported fixture
    """The slow proofs' consumers, in batch mode (BATCH_SIZE=50 unless ``env`` says)."""

    def start(**env: str) -> Any:
        return consumers(**{"SHOP_KAFKA_BATCH_SIZE": "50", **env})

    start.topic = consumers.topic  # type: ignore[attr-defined]
    start.group = consumers.group  # type: ignore[attr-defined]
    return start


SMALL_BATCH = {"SHOP_KAFKA_BATCH_SIZE": "3"}
"""BATCH_SIZE=3: a new owner takes its first four messages one at a time (three, and one more
to settle), then the next ones in batches."""


def batch_mates(event_id: str) -> set[str]:
    """The events reserved in the same batch as ``event_id``: a batch's reservations share one
    ``processed_at``, where each message alone takes its own."""
    rows = ProcessedEvent.objects.filter(consumer="shop.kafka")
    stamp = rows.get(event_id=event_id).processed_at
    return set(rows.filter(processed_at=stamp).values_list("event_id", flat=True))


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.mysql
def test_batch_killed_after_the_database_commit_before_the_offset_commit(
    kafka_cluster: Cluster, batched: Any, tmp_path: Path
) -> None:
    """A batch commits, then its consumer is SIGKILLed before the offset commit: the next
    consumer meets every message of the batch again and skips each as a duplicate.
    Regression (of the test): with BATCH_SIZE=50 its seven messages never left the new
    owner's warm-up, so no batch ran; four warm-up messages go first now."""
    warm_up = one_at_a_time.events(4)
    first, paused, *after = one_at_a_time.events(7)
    paused["behaviour"] = "pause_after_commit"
    every = [*warm_up, first, paused, *after]
    kafka_cluster.produce(batched.topic, every, key=lambda e: "one")
    consumer = batched(SHOP_KAFKA_PAUSE_DIR=str(tmp_path), **SMALL_BATCH)
    one_at_a_time.wait_for_file(tmp_path / f"{paused['event_id']}.committed", consumer)
    consumer.kill()

    in_batch = batch_mates(paused["event_id"])
    assert len(in_batch) >= 2, in_batch  # a batch, not one message alone
    assert not in_batch & {e["event_id"] for e in warm_up}
    # The warm-up's offsets, and maybe the first's (a batch of its own); not the batch's.
    assert kafka_cluster.backlog(batched.topic, batched.group) in (6, 7)

    second = batched()
    kafka_cluster.wait_caught_up(batched.topic, batched.group)
    assert one_at_a_time.effects() == Counter(e["event_id"] for e in every)
    assert second.terminate() == 0
    for event_id in in_batch:
        assert f"duplicate ignored: event {event_id}" in second.output()


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.mysql
@pytest.mark.second_broker
def test_batch_poison_message_is_dead_lettered_and_the_consumer_goes_on(
    kafka_cluster: Cluster, batched: Any, tmp_path: Path
) -> None:
    """BATCH_SIZE=3, the poison, a message that fails twice and one without an event id behind
    four warm-up messages, so they meet batches: each batch that holds one of them rolls back
    and goes one message at a time, the poison and the id-less message are dead-lettered, the
    flaky one is applied, and every healthy message once. Regression (of the test): it ran the
    one-at-a-time proof with BATCH_SIZE=50, whose eight messages never left the warm-up, so no
    batch ran. (``fail_twice`` reads the delivery counter, which a batched partition's first
    deliveries skip; ``fail_first_two`` counts the handler's executions.)"""
    warm_up = one_at_a_time.events(4)
    [poison] = one_at_a_time.events(1, behaviour="fail")
    [flaky] = one_at_a_time.events(1, behaviour="fail_first_two")
    no_id = {"behaviour": "none", "note": "no event id"}
    healthy = one_at_a_time.events(8)
    kafka_cluster.produce(
        batched.topic,
        [*warm_up, poison, flaky, no_id, *healthy],
        key=lambda e: "one-partition",
    )
    consumer = batched(SHOP_KAFKA_PROBE_DIR=str(tmp_path), **SMALL_BATCH)
    kafka_cluster.wait_caught_up(batched.topic, batched.group, timeout=120)

    applied = Counter(e["event_id"] for e in [*warm_up, flaky, *healthy])
    assert one_at_a_time.effects() == applied  # the failures rolled their effects back
    dead = kafka_cluster.read(f"{batched.topic}.dlq", 2)
    by_id = {dict(m.headers() or []).get("event_id"): m for m in dead}
    assert set(by_id) == {poison["event_id"].encode(), None}
    headers = dict(by_id[poison["event_id"].encode()].headers() or [])
    assert headers["dlq.deliveries"] == b"4"  # MAX_DELIVERIES=3, parked on the 4th
    assert headers["dlq.error"].startswith(b"RuntimeError: poison message")
    assert headers["dlq.offset"] == b"4"
    assert dict(by_id[None].headers() or [])["dlq.error"].startswith(b"MissingEventId")
    # The poison's first execution was in a batch (its batch-mates reserved with it), and
    # healthy messages shared batches after it.
    runs = (tmp_path / f"{poison['event_id']}.runs").read_text().split()
    assert int(runs[0]) >= 2, runs
    assert max(batch_mates_counts().values()) >= 2
    assert consumer.process.poll() is None  # still consuming
    assert consumer.terminate() == 0
    output = consumer.output()
    assert "rolled back, applying them one at a time" in output
    stopped = output.rsplit("stopped: ", 1)[1].strip().split(", ")
    assert {"13 applied", "2 dead-lettered"} <= set(stopped), stopped


def batch_mates_counts() -> Counter[Any]:
    """How many of the consumer's reservations each ``processed_at`` has: one per message
    alone, the batch's size for a batch."""
    rows = ProcessedEvent.objects.filter(consumer="shop.kafka")
    return Counter(rows.values_list("processed_at", flat=True))


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.mysql
def test_batch_message_that_kills_its_consumer_is_dead_lettered(
    kafka_cluster: Cluster, batched: Any
) -> None:
    """A killer inside a batch (the sixth message, behind four warm-up ones): its first death
    kills the batch, uncounted; each next owner takes its first BATCH_SIZE messages it has
    to apply one at a time and counted, so the killer is counted on every later death and
    parked after MAX_DELIVERIES (3) of them; the messages around it are applied once.
    Regression (of the test): with BATCH_SIZE=50 its five messages never left the warm-up,
    so the killer never met a batch."""
    before, after = one_at_a_time.events(5), one_at_a_time.events(2)
    [killer] = one_at_a_time.events(1, behaviour="die")
    kafka_cluster.produce(batched.topic, [*before, killer, *after], key=lambda e: "one")
    deaths, consumer = one_at_a_time.until_one_survives(batched, applied=7, **SMALL_BATCH)
    assert deaths == 4  # one in a batch, uncounted; three counted; the fifth dead-letters it
    kafka_cluster.wait_caught_up(batched.topic, batched.group)

    assert one_at_a_time.effects() == Counter(e["event_id"] for e in [*before, *after])
    [dead] = kafka_cluster.read(f"{batched.topic}.dlq", 1)
    assert dict(dead.headers() or [])["dlq.deliveries"] == b"4"
    assert consumer.terminate() == 0


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.mysql
def test_batch_that_hangs_ends_its_consumer_and_the_message_is_dead_lettered(
    kafka_cluster: Cluster,
    consumers: Any,  # noqa: F811 - the imported fixture
    tmp_path: Path,
) -> None:
    """A handler that hangs inside a batch (BATCH_SIZE=2, behind the messages a new owner takes
    one at a time): the watchdog ends the consumer once the batch runs past HANDLER_TIMEOUT,
    and the batch rolls back with it, uncounted. Each next owner then meets the message one at
    a time and counted, so it hangs MAX_DELIVERIES (3) times more and the fifth consumer
    dead-letters it; every other message is applied once."""
    before, after = one_at_a_time.events(3), one_at_a_time.events(2)
    [hung] = one_at_a_time.events(1, behaviour="hang")
    kafka_cluster.produce(consumers.topic, [*before, hung, *after], key=lambda e: "one")
    deaths, consumer = one_at_a_time.until_one_survives(
        consumers,
        applied=5,
        status=HANG_EXIT_STATUS,
        SHOP_KAFKA_BATCH_SIZE="2",
        # The healthy batches share it: ample for a fresh process's first one on a loaded CI
        # machine (at nice 19), short enough for four hangs.
        SHOP_KAFKA_HANDLER_TIMEOUT="5",
    )
    assert deaths == 4
    assert ", a batch of " in (tmp_path / "consumer0.log").read_text()
    kafka_cluster.wait_caught_up(consumers.topic, consumers.group)

    assert one_at_a_time.effects() == Counter(e["event_id"] for e in [*before, *after])
    [dead] = kafka_cluster.read(f"{consumers.topic}.dlq", 1)
    assert json.loads(dead.value() or b"")["event_id"] == hung["event_id"]
    assert dict(dead.headers() or [])["dlq.deliveries"] == b"4"
    assert consumer.terminate() == 0


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.mysql
def test_batch_two_consumers_through_rebalances_apply_each_event_once(
    kafka_cluster: Cluster, batched: Any
) -> None:
    """BATCH_SIZE=3: each partition's fifteen messages a round go past the warm-up, in
    batches. (With BATCH_SIZE=50 none did: no batch met a rebalance.)"""

    def small(**env: str) -> Any:
        return batched(**{**SMALL_BATCH, **env})

    small.topic = batched.topic  # type: ignore[attr-defined]
    small.group = batched.group  # type: ignore[attr-defined]
    one_at_a_time.test_two_consumers_through_rebalances_apply_each_event_once(kafka_cluster, small)
    assert max(batch_mates_counts().values()) >= 2  # some messages shared a batch
