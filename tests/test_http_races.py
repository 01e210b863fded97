"""Races: many requests with the same key at once, in threads and in gunicorn processes.

Exactly one execution commits; every other request gets a 409 problem or an identical replay.
On PostgreSQL and MariaDB a duplicate that arrives while the first request runs gets 409 at once,
never a late replay: the claim does not wait on another request's transaction.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, connections
from django.test import Client, override_settings

from django_idempotency.models import IdempotencyRecord
from tests.probes import effects
from tests.servers import Gunicorn, Reply, gunicorn

pytestmark = [pytest.mark.slow, pytest.mark.pooler, pytest.mark.django_db(transaction=True)]

THREADS = 16
URL = "/probe/effect/"
SLEEP = {"X-Probe-Sleep": "0.5"}


def race(count: int, send: Callable[[int], Reply]) -> list[Reply]:
    """Call ``send(i)`` from ``count`` threads released together."""
    barrier = threading.Barrier(count)

    def one(index: int) -> Reply:
        try:
            barrier.wait(60)
            return send(index)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count), timeout=60))


def in_process(key: str, headers: dict[str, str] = SLEEP) -> Callable[[int], Reply]:
    def send(index: int) -> Reply:
        response = Client().post(
            URL,
            b"{}",
            content_type="application/json",
            headers={"Idempotency-Key": key, **headers},
        )
        return Reply(response.status_code, dict(response.items()), response.content)

    return send


def assert_one_execution(replies: list[Reply], key: str) -> Reply:
    """Exactly one effect; one original 201; the rest 409 problems or identical replays."""
    assert effects(key=key) == 1
    originals = [r for r in replies if r.status == 201 and "Idempotent-Replayed" not in r.headers]
    assert len(originals) == 1, Counter(r.status for r in replies)
    original = originals[0]
    for reply in replies:
        if reply is original:
            continue
        if reply.status == 409:
            assert reply.headers["Content-Type"] == "application/problem+json"
            assert reply.headers["Retry-After"] == "1"
            assert json.loads(reply.body)["type"].endswith("#in-progress")
        else:
            assert reply.status == 201
            assert reply.headers["Idempotent-Replayed"] == "true"
            assert reply.body == original.body
    record = IdempotencyRecord.objects.get(key=key)
    assert record.state == IdempotencyRecord.State.COMPLETED
    assert bytes(record.response_body or b"") == original.body
    return original


#: Long enough that every thread released by the barrier reaches its claim while the first
#: request still holds the key, even on a loaded machine.
HOLD = {"X-Probe-Sleep": "3"}


def test_16_threads_same_key() -> None:
    key = str(uuid.uuid4())
    replies = race(THREADS, in_process(key, HOLD))
    assert_one_execution(replies, key)
    statuses = Counter(r.status for r in replies)
    if connection.vendor == "sqlite":
        # One writer at a time: the duplicates wait for the lock, then replay.
        assert statuses == {201: THREADS}
    else:
        # The claim never waits on another request: every duplicate that arrives while the
        # first runs gets 409 at once. A replay here means a duplicate waited for the first
        # one's commit (a dropped advisory lock on PostgreSQL, a lock wait on MariaDB).
        assert statuses == {201: 1, 409: THREADS - 1}, dict(statuses)
    print(f"\n16 threads on {connection.vendor}: {dict(statuses)}")


@override_settings(IDEMPOTENCY={"WAIT": 10})
def test_16_threads_same_key_with_wait_all_get_the_response() -> None:
    key = str(uuid.uuid4())
    replies = race(THREADS, in_process(key))
    original = assert_one_execution(replies, key)
    assert all(r.status == 201 and r.body == original.body for r in replies)


def test_16_threads_different_keys_do_not_conflict() -> None:
    def send(index: int) -> Reply:
        return in_process(f"distinct-{index}", {"X-Probe-Sleep": "0.05"})(index)

    replies = race(THREADS, send)
    assert Counter(r.status for r in replies) == {201: THREADS}
    assert effects() == THREADS


@pytest.fixture(scope="module")
def server(django_db_setup: None) -> Iterator[Gunicorn]:
    with gunicorn(connection.settings_dict, workers=4) as running:
        yield running


def test_gunicorn_processes_same_key(server: Gunicorn) -> None:
    key = str(uuid.uuid4())
    replies = race(12, lambda index: server.post(URL, key, headers=SLEEP))
    assert_one_execution(replies, key)
    # Another round after it finished: all replays.
    again = race(4, lambda index: server.post(URL, key))
    assert {r.status for r in again} == {201}
    assert all(r.headers["Idempotent-Replayed"] == "true" for r in again)
    assert effects(key=key) == 1
