"""Proofs of the outbox with real processes, real brokers and real SIGKILLs.

Each proof runs ``manage.py idempotency_relay`` subprocesses against the test database, which
publish through :class:`~django_idempotency.outbox.transports.CeleryTransport` to a real broker,
where
``celery worker`` subprocesses apply ``IdempotentConsumer`` tasks. Effects are counted in the
database once everything has settled.

* PostgreSQL pass: every proof on Redis and on RabbitMQ.
* MariaDB pass: every proof on Redis (the broker side is proven on both in the PostgreSQL pass;
  what differs on MariaDB is the claim: ``SKIP LOCKED``, READ COMMITTED).
* SQLite pass: skipped; SQLite serialises relays on its file lock, which the fast tests show.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
from django.db import connection, transaction

from django_idempotency import new_event_id
from django_idempotency.models import OutboxEntry, ProcessedEvent
from django_idempotency.outbox import core as outbox
from testproject.shop.models import Effect, Order
from tests.conftest import require_service
from tests.outbox_helpers import (
    FAST_RELAY,
    Process,
    celery_transports,
    proxy,
    start_relay,
    wait_for,
)
from tests.servers import free_port, gunicorn
from tests.services import ADDRESSES, BROKER_URLS
from tests.workers import WorkerGroup, database_url, worker_group

pytestmark = [
    pytest.mark.slow,
    pytest.mark.broker,
    pytest.mark.timeout(900),
    pytest.mark.django_db(transaction=True),
]

SETTLE = 90.0
SETTLE_VOLUME = 400.0
"""5,000 messages through one consumer process (50 to 100 a second on two shared cores)."""


@pytest.fixture(scope="module", params=sorted(BROKER_URLS))
def broker(request: pytest.FixtureRequest, django_db_setup: None) -> str:
    if connection.vendor == "sqlite":
        pytest.skip("SQLite pass: the outbox proofs run on PostgreSQL and MariaDB")
    if connection.vendor == "mysql" and request.param != "redis":
        pytest.skip("MariaDB pass: outbox proofs run on Redis only (see the module docstring)")
    require_service(request.param)
    require_service("redis")  # the workers' result backend
    return str(request.param)


@pytest.fixture(scope="module")
def workers(broker: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerGroup]:
    with worker_group(
        broker_url=BROKER_URLS[broker],
        db_url=database_url(connection.settings_dict),
        log_dir=tmp_path_factory.mktemp(f"outbox-workers-{broker}"),
        label=f"outbox-{broker}",
    ) as group:
        yield group


def db_url() -> str:
    return database_url(connection.settings_dict)


def effects(event_id: str) -> int:
    return Effect.objects.filter(name="shop.effect", payload=event_id).count()


def settle(
    expected: int, logs: object, name: str = "shop.effect", timeout: float = SETTLE
) -> None:
    """Wait until ``expected`` effects exist, then a little longer for any extra one."""
    wait_for(
        lambda: Effect.objects.filter(name=name).count() >= expected,
        timeout,
        f"{expected} effects",
        lambda: str(logs() if callable(logs) else logs),
    )
    time.sleep(1.0)


def test_producer_killed_right_after_commit_still_delivers_once(
    workers: WorkerGroup, broker: str, tmp_path: Path
) -> None:
    producer = subprocess.run(
        [sys.executable, "-m", "tests.outbox_producer", workers.queue],
        cwd=Path(__file__).resolve().parent.parent,
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "testproject.settings",
            "DATABASE_URL": db_url(),
            "CELERY_BROKER_URL": BROKER_URLS[broker],
        },
        capture_output=True,
        timeout=120,  # a guard: Django's start alone took 11 s on the loaded CI machine
    )
    assert producer.returncode == -9, producer.stderr.decode()
    ids = json.loads(producer.stdout.decode().strip().splitlines()[-1])

    # The COMMIT happened: the outbox row is there, pending; nothing was published.
    (row,) = OutboxEntry.objects.all()
    assert (row.event_id, row.state) == (ids["outbox"], "pending")

    relay = start_relay(
        "--once",
        db_url=db_url(),
        transports=celery_transports(BROKER_URLS[broker]),
        log=tmp_path / "relay.log",
        broker_url=BROKER_URLS[broker],
    )
    assert relay.wait(120) == 0, relay.output()
    settle(1, workers.logs)

    assert effects(ids["outbox"]) == 1  # delivered, once
    assert effects(ids["on_commit"]) == 0  # delay_on_commit lost it with the process
    assert effects(ids["rolled_back"]) == 0  # a rolled-back transaction published nothing
    assert OutboxEntry.objects.get().state == "sent"


def test_web_worker_killed_right_after_commit_still_delivers_once(
    workers: WorkerGroup, broker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same crash in a gunicorn worker serving the request over HTTP."""
    monkeypatch.setenv("CELERY_BROKER_URL", BROKER_URLS[broker])  # apply_async_on_commit: real
    ids = {"outbox": str(new_event_id()), "on_commit": str(new_event_id())}
    body = json.dumps({"queue": workers.queue, **ids}).encode()
    with gunicorn(connection.settings_dict, workers=1) as server, pytest.raises(OSError):
        server.post("/probe/outbox/order-then-die/", "unused", body=body)  # dies: no answer
    (row,) = OutboxEntry.objects.all()
    assert (row.event_id, row.state) == (ids["outbox"], "pending")
    assert Order.objects.filter(reference="KILLED-AFTER-COMMIT").count() == 1  # committed

    relay = start_relay(
        "--once",
        db_url=db_url(),
        transports=celery_transports(BROKER_URLS[broker]),
        log=tmp_path / "relay.log",
        broker_url=BROKER_URLS[broker],
    )
    assert relay.wait(120) == 0, relay.output()
    settle(1, workers.logs)

    assert effects(ids["outbox"]) == 1
    assert effects(ids["on_commit"]) == 0


def test_broker_down_at_commit_is_delivered_once_it_is_back(
    workers: WorkerGroup, broker: str, tmp_path: Path
) -> None:
    port = free_port()
    scheme_url = BROKER_URLS[broker].replace(f":{ADDRESSES[broker][1]}", f":{port}")
    event_ids = []
    with transaction.atomic():
        for _ in range(20):
            event_ids.append(outbox.publish("shop.effect", queue=workers.queue, key="one-key"))

    with proxy(ADDRESSES[broker], port) as broker_proxy:
        relay = start_relay(
            *FAST_RELAY,
            db_url=db_url(),
            transports=celery_transports(scheme_url, connect_timeout=1),
            log=tmp_path / "relay.log",
            broker_url=scheme_url,
        )
        try:
            # The broker is unreachable: the relay tries, fails, and backs off.
            wait_for(
                lambda: OutboxEntry.objects.filter(attempts__gte=2).exists(),
                120,
                "failed attempts",
                relay.output,
            )
            assert not OutboxEntry.objects.filter(state="sent").exists()
            assert OutboxEntry.objects.exclude(last_error="").exists()

            broker_proxy.start()  # the broker is back
            wait_for(
                lambda: not OutboxEntry.objects.exclude(state="sent").exists(),
                120,
                "all sent",
                relay.output,
            )
            settle(20, workers.logs)
        finally:
            assert relay.stop() == 0, relay.output()

    assert all(effects(event_id) == 1 for event_id in event_ids)
    assert Effect.objects.count() == 20


def test_relay_killed_mid_batch_resends_and_consumers_absorb_it(
    workers: WorkerGroup, broker: str, tmp_path: Path
) -> None:
    with transaction.atomic():
        event_ids = [
            outbox.publish("shop.effect", queue=workers.queue, key=f"k{n % 7}") for n in range(100)
        ]
    transports = celery_transports(
        BROKER_URLS[broker],
        backend="tests.outbox_helpers.CrashingTransport",
        kill_after=25,
        marker=str(tmp_path / "crashed"),
    )
    args = ("--once", "--batch-size", "100", "--lease", "2")
    first = start_relay(
        *args, db_url=db_url(), transports=transports, log=tmp_path / "r1.log",
        broker_url=BROKER_URLS[broker],
    )  # fmt: skip
    assert first.wait(120) == -9, first.output()
    # Killed mid-batch: 25 messages reached the broker, none is marked sent.
    assert OutboxEntry.objects.filter(state="sent").count() == 0
    assert OutboxEntry.objects.filter(locked_until__isnull=False).count() == 100

    time.sleep(2.5)  # the dead relay's lease runs out
    second = start_relay(
        *args, db_url=db_url(), transports=transports, log=tmp_path / "r2.log",
        broker_url=BROKER_URLS[broker],
    )  # fmt: skip
    assert second.wait(120) == 0, second.output()
    settle(100, workers.logs)

    # The event id is the task id, so the workers' logs say how often each event arrived and
    # what the consumer answered. (A duplicate is not counted in EventDelivery: the count is
    # skipped once the event is processed.)
    def arrivals() -> Counter[int]:
        log = "\n".join(worker.output() for worker in workers.workers)
        return Counter(log.count(f"shop.effect[{event_id}] received") for event_id in event_ids)

    wait_for(lambda: arrivals() == {2: 25, 1: 75}, SETTLE, "125 deliveries", workers.logs)
    assert OutboxEntry.objects.filter(state="sent").count() == 100
    assert Counter(effects(event_id) for event_id in event_ids) == {1: 100}  # each absorbed
    log = "\n".join(worker.output() for worker in workers.workers)
    ours = set(event_ids)
    skipped = [
        task_id
        for task_id in re.findall(r"shop\.effect\[([^\]]+)\] succeeded in \S+: None$", log, re.M)
        if task_id in ours
    ]
    assert len(skipped) == 25  # each resend was answered as a duplicate
    assert ProcessedEvent.objects.count() == 100


def test_two_relays_over_600_messages_one_effect_each_in_key_order(
    broker: str, tmp_path: Path
) -> None:
    # Enough keys that each claim takes about half of them (so both relays send), and enough
    # messages per key that they interleave many times; more adds minutes, not proof.
    keys, per_key = 24, 25
    with worker_group(
        broker_url=BROKER_URLS[broker],
        db_url=db_url(),
        log_dir=tmp_path,
        label=f"ordered-{broker}",
        workers=1,
        concurrency=1,  # one consumer: the queue's order is the order of effects
    ) as group:
        logs = [tmp_path / f"relay{n}.jsonl" for n in range(2)]
        relays: list[Process] = [
            start_relay(
                *FAST_RELAY,
                # Half the keys per claim: a relay that claimed every key's head would leave the
                # other blocked behind its leases, and on a loaded machine alone for the run.
                "--batch-size",
                "12",
                db_url=db_url(),
                transports=celery_transports(
                    BROKER_URLS[broker],
                    backend="tests.outbox_helpers.TimedTransport",
                    log=str(log),
                ),
                log=tmp_path / f"relay{n}.log",
                broker_url=BROKER_URLS[broker],
            )
            for n, log in enumerate(logs)
        ]
        try:
            for seq in range(per_key):
                with transaction.atomic():
                    for key in range(keys):
                        outbox.publish(
                            "shop.ordered_effect",
                            kwargs={"key": f"k{key}", "seq": seq},
                            key=f"k{key}",
                            queue=group.queue,
                        )
            total = keys * per_key
            wait_for(
                lambda: OutboxEntry.objects.filter(state="sent").count() == total,
                SETTLE,
                "all sent",
                lambda: "\n".join(r.output()[-3000:] for r in relays),
            )
            settle(total, group.logs, name="shop.ordered_effect", timeout=SETTLE_VOLUME)
        finally:
            for relay in relays:
                assert relay.stop() == 0, relay.output()

    # One effect per message.
    payloads = list(
        Effect.objects.filter(name="shop.ordered_effect")
        .order_by("pk")
        .values_list("payload", flat=True)
    )
    assert len(payloads) == total and len(set(payloads)) == total
    # In key order at the consumer.
    seen: dict[str, list[int]] = defaultdict(list)
    for payload in payloads:
        key, seq = payload.split(":")
        seen[key].append(int(seq))
    assert all(seqs == list(range(per_key)) for seqs in seen.values())
    # Both relays took part, and per key each message was acknowledged before the next one
    # started, whichever relay sent it.
    assert all(log.exists() and log.read_text() for log in logs), "one relay sent nothing"
    sends = [json.loads(line) for log in logs for line in log.read_text().splitlines()]
    by_key: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for key, seq, started, acked, _pid in sends:
        by_key[key].append((seq, started, acked))
    for entries in by_key.values():
        entries.sort()
        assert [seq for seq, _, _ in entries] == list(range(per_key))  # each sent once
        for (_, _, acked), (_, started, _) in pairwise(entries):
            assert acked <= started
