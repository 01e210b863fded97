"""``outbox.publish(task, args, kwargs, **options)`` gives the task what ``task.apply_async(args,
kwargs, **options)`` gives it (issue 36): the table of ``tests/celery_call_rows.py``, one row per
kind of call, each sent both ways, on Redis and on RabbitMQ.

* :func:`test_a_call_reaches_the_queue_as_apply_async_puts_it`: what lands on the queue, read as
  a worker reads it (kombu decodes the body with the message's serializer): the arguments and
  their types, the headers a worker turns into ``task.request`` (eta, expires, retries, time
  limits, shadow, custom headers, ...), the message's properties and routing. Quick: no worker.
* :func:`test_a_real_worker_receives_the_same_call_both_ways` (slow): the same rows through a
  real ``celery worker`` process, which writes what its task received (``shop.probe_call``),
  the outbox's messages through ``outbox.publish()`` in a committed transaction and a relay.
* :func:`test_a_refused_call_says_why`: the rows ``publish()`` refuses, each with its reason
  (``docs/outbox.md``, "Celery calls").

Only the ids differ (a new task id each way, and the outbox's ``event_id`` header), and an eta or
an expiry, which counts from the ``apply_async`` call one way and from the COMMIT the other.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import transaction
from django.test import override_settings
from kombu import Connection, Exchange, Queue

from django_idempotency.outbox import core as outbox
from django_idempotency.outbox.relay import Relay
from django_idempotency.outbox.transports import CeleryTransport
from tests.celery_call_rows import REFUSED_ROWS, SENT, Row, compare, wire_report, worker_report
from tests.conftest import require_service
from tests.services import BROKER_URLS
from tests.transport_helpers import celery_app, take
from tests.workers import WorkerGroup, broker_workers_fixture, delete_queue, new_queue_name

CELERY = "django_idempotency.outbox.transports.CeleryTransport"
# Seconds between the two publishes that a moment may differ by (an expires moment's AMQP
# expiration is what is left of it at publish): 1 s was exceeded once on a loaded CI run.
SLACK = 5.0
"""Seconds an eta or expiry may differ by, counted from the call and from the commit."""


def transports(url: str) -> dict[str, Any]:
    return {"OUTBOX_TRANSPORTS": {"default": {"BACKEND": CELERY, "OPTIONS": {"broker_url": url}}}}


@pytest.fixture(params=sorted(BROKER_URLS))
def broker(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, str]]:
    """``(broker URL, a publishing app, a declared queue of its own)``."""
    require_service(request.param)
    url = BROKER_URLS[request.param]
    app = celery_app(url)
    name = new_queue_name("parity")
    with Connection(url) as conn:
        Queue(name, Exchange(name, type="direct"), routing_key=name).bind(
            conn.default_channel
        ).declare()
    try:
        with override_settings(IDEMPOTENCY=transports(url)):
            yield url, app, name
    finally:
        delete_queue(url, name)
        app.close()


def through_the_outbox(app: Any, url: str, c: Any) -> tuple[float, str]:
    """Publish ``c`` in a committed transaction and relay it; ``(committed at, event id)``."""
    with transaction.atomic():
        event_id = outbox.publish(c.target, c.args, c.kwargs, **c.options)
        before = time.time()
    committed_at = (before + time.time()) / 2
    relay = Relay(transports={"default": CeleryTransport(app=app, broker_url=url)})
    try:
        result = relay.drain()
    finally:
        relay._transports["default"].close()  # type: ignore[index]
    assert result.sent >= 1, result
    return committed_at, event_id


def called(c: Any) -> float:
    before = time.time()
    c.target.apply_async(c.args, c.kwargs, **c.options)
    return (before + time.time()) / 2


@pytest.mark.broker
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("row", SENT, ids=[row.id for row in SENT])
def test_a_call_reaches_the_queue_as_apply_async_puts_it(
    row: Row, broker: tuple[str, Any, str]
) -> None:
    url, app, queue = broker
    task = app.tasks["shop.probe_call"]
    c = row.build(task, queue, uuid.uuid4().hex)
    called_at = called(c)
    direct = wire_report(take(url, queue, timeout=10))
    committed_at, _ = through_the_outbox(app, url, c)
    outboxed = wire_report(take(url, queue, timeout=10))

    differences = compare(row, direct, outboxed, called_at, committed_at, SLACK)
    assert not differences, "\n".join(differences)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("row", REFUSED_ROWS, ids=[row.id for row in REFUSED_ROWS])
def test_a_refused_call_says_why(row: Row) -> None:
    from testproject.celery import app

    c = row.build(app.tasks["shop.probe_call"], "q", "p")
    with transaction.atomic():
        with pytest.raises(row.error, match=re.compile(row.refused or "", re.S)):
            outbox.publish(c.target, c.args, c.kwargs, **c.options)
        outbox.publish("after")  # nothing was written, the transaction is usable


# --- With real workers --------------------------------------------------------------------------


workers = broker_workers_fixture(
    "workers",
    "parity",
    workers=1,
    concurrency=4,
    extra_env={"CELERY_ACCEPT_CONTENT": "json,pickle,yaml", "C_FORCE_ROOT": "1"},
    doc="One worker process taking JSON, pickle and YAML (as root, Celery wants C_FORCE_ROOT "
    "to take pickle); Redis also holds the probe's reports.",
)


def reports(probes: list[str], group: WorkerGroup, timeout: float) -> dict[str, Any]:
    import redis

    from testproject.shop.call_probe import PROBE_REDIS

    client = redis.Redis.from_url(PROBE_REDIS)
    found: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(found) < len(probes):
            for probe in probes:
                if probe not in found and (value := client.get(f"probe:{probe}")) is not None:
                    found[probe] = json.loads(value)
            if time.monotonic() > deadline:
                missing = [p for p in probes if p not in found]
                pytest.fail(f"no report for {len(missing)} calls in {timeout}s\n{group.logs()}")
            time.sleep(0.1)
    finally:
        client.close()
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_receives_the_same_call_both_ways(workers: WorkerGroup) -> None:
    """Every row, sent both ways to one real worker; the worker's ``task.request`` and the
    arguments' types compared, and the task ran no earlier than its countdown or eta."""
    url, queue = workers.broker_url, workers.queue
    assert workers.publisher is not None
    app = workers.publisher
    task = app.tasks["shop.probe_call"]
    sent: list[tuple[Row, str, str, float, float]] = []
    with override_settings(IDEMPOTENCY=transports(url)):
        for row in SENT:
            direct_probe, outbox_probe = uuid.uuid4().hex, uuid.uuid4().hex
            called_at = called(row.build(task, queue, direct_probe))
            committed_at, _ = through_the_outbox(app, url, row.build(task, queue, outbox_probe))
            sent.append((row, direct_probe, outbox_probe, called_at, committed_at))
    probes = [
        f"{probe}.{suffix}" if suffix else probe
        for row, a, b, _, _ in sent
        for probe in (a, b)
        for suffix in ("", *row.follows)
    ]
    found = reports(probes, workers, timeout=90)

    differences = {}
    for row, direct_probe, outbox_probe, called_at, committed_at in sent:
        direct, outboxed = found[direct_probe], found[outbox_probe]
        found_here = compare(
            row, worker_report(direct), worker_report(outboxed), called_at, committed_at, SLACK
        )
        ran_direct = direct["ran_at"] - called_at
        ran_outbox = outboxed["ran_at"] - committed_at
        if row.delay and not (ran_direct >= row.delay - 0.1 and ran_outbox >= row.delay - 0.1):
            found_here.append(f"ran {ran_direct:.2f} s and {ran_outbox:.2f} s after, not due yet")
        found_here += followed(row, found, direct_probe, outbox_probe)
        if found_here:
            differences[row.id] = found_here
    assert differences == {}


def followed(row: Row, found: dict[str, Any], direct_probe: str, outbox_probe: str) -> list[str]:
    """The differences between the callbacks and chain steps that ran after ``row``'s task, each
    way: what each received, and that it ran as the child of the task before it, in its tree."""
    differences = []
    for index, suffix in enumerate(row.follows):
        before = f".{row.follows[index - 1]}" if index else ""
        pair = []
        for probe in (direct_probe, outbox_probe):
            report, parent = found[f"{probe}.{suffix}"], found[f"{probe}{before}"]
            root = found[probe]["request"]
            request = report["request"]
            if request.get("parent_id") != parent["request"]["id"]:
                differences.append(f"{suffix}: parent {request.get('parent_id')!r}, not the task")
            if request.get("root_id") != (root.get("root_id") or root["id"]):
                differences.append(f"{suffix}: root {request.get('root_id')!r}, not the first")
            stripped = {k: v for k, v in request.items() if k not in ("root_id", "parent_id")}
            pair.append(worker_report({**report, "request": stripped}))
        now = time.time()
        found_here = compare(row, pair[0], pair[1], now, now, SLACK)
        differences += [f"{suffix}: {difference}" for difference in found_here]
    return differences
