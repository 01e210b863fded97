"""MariaDB: a retry of a finished key that meets another writer's lock on its record waits for
it and replays, instead of answering "in progress".

The claim never waits on a lock at first (``innodb_lock_wait_timeout=0``): a request of the same
key that runs now holds its record's lock, and that is answered ``409`` at once. But a finished
record is locked by other writers too: a key rotation's batch (``idempotency_rotate_keys``), an
erasure, a purge, an admin edit. A retry that met one got ``409`` although nothing of its key was
running. The claim now reads the record's latest committed version without a lock: a completed
one means the lock is such a writer's, and the claim waits for it (up to
``TAKEOVER_LOCK_WAIT`` seconds) and replays. A record in progress, or one not committed yet,
is still answered ``409`` at once. The lock is held by a second connection here, and released
once the retry is seen waiting on it (InnoDB's ``INNODB_TRX``), so no sleep decides an order.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db import connections, transaction

from django_idempotency.models import IdempotencyRecord
from tests.lock_waits import wait_until_blocked
from tests.probes import effects
from tests.test_http_mariadb_gaps import claim_in_thread, ended, send, uncommitted_record

pytestmark = [
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, databases=["default", "repeatable_read"]),
]

WRITER = "repeatable_read"
TABLE = IdempotencyRecord._meta.db_table


@contextmanager
def writer_holding(key: str) -> Iterator[None]:
    """Another writer's row lock on the key's finished record, as a rotation batch's
    compare-and-swap holds it, until the block ends (then it commits)."""
    with transaction.atomic(using=WRITER), connections[WRITER].cursor() as cursor:
        cursor.execute(
            f"UPDATE {TABLE} SET response_body = response_body, expires_at = expires_at "
            "WHERE owner = 'anonymous' AND `key` = %s",
            [key],
        )
        assert cursor.rowcount in (0, 1)
        yield


def test_a_replay_waits_for_another_writers_lock_on_the_finished_record() -> None:
    key = f"finished-{uuid.uuid4()}"
    first = send(key)
    assert first.status == 201, first.body
    with writer_holding(key):
        future, session = claim_in_thread(key, "default")
        # Without the wait this ended at once with 409 in-progress.
        wait_until_blocked(session, "the retry of a finished key", lambda: ended(future))
    replay = future.result(60)
    assert replay.status == 201, replay.body
    assert replay.headers.get("Idempotent-Replayed") == "true"
    assert replay.body == first.body
    assert effects(key=key) == 1


def test_a_lock_that_outlasts_the_wait_is_still_answered_in_progress(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wait is bounded: a writer that keeps the lock past it gets the old answer, ``409``
    with ``Retry-After`` (never a wrong replay, never a second execution)."""
    key = f"finished-long-{uuid.uuid4()}"
    assert send(key).status == 201
    with writer_holding(key):
        reply = send(key)  # this thread waits its TAKEOVER_LOCK_WAIT, then answers
    assert reply.status == 409, reply.body
    assert reply.headers["Retry-After"]
    assert json.loads(reply.body)["type"].endswith("#in-progress")
    assert effects(key=key) == 1


def test_a_record_that_is_not_committed_yet_is_still_in_progress_at_once() -> None:
    """A request of this key that runs now (its record inserted, not committed) is what
    ``409`` is for: the plain read does not see its record, so the claim does not wait."""
    key = f"running-{uuid.uuid4()}"
    with uncommitted_record("anonymous", key):
        reply = send(key)
    assert reply.status == 409, reply.body
    assert effects(key=key) == 0
