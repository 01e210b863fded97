"""Stress: the deferred path of PostgreSQL's claim (``django_idempotency_claim_v2``) reads the
record again after it took the advisory lock.

A duplicate that looked for the record while the original was still running, and took the lock
a moment after the original committed, must see the original's record then and replay it. A
claim that skipped that second read would find "no record", run the view again, and fail to
store it (the record is there), answering 409 for a request that is already complete. That
window is microseconds wide, so each round releases threads that send the duplicate again and
again, without pause, around the original's commit; a view that runs for a duplicate is the
bug's trace, whatever that duplicate's client saw in the end.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connections
from django.http import HttpResponse

from tests.probes import counted_view, effects

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROUNDS = 60
DUPLICATES = 6
send, RAN = counted_view("deferred")


def one_round(key: str) -> list[HttpResponse]:
    """The original and its duplicates, released together; each duplicate is sent again at
    once while it gets 409 ("in progress"), until it gets the replay."""
    start = threading.Barrier(DUPLICATES + 1)
    original_done = threading.Event()

    def original() -> list[HttpResponse]:
        try:
            start.wait(60)
            return [send(key)]
        finally:
            original_done.set()
            connections.close_all()

    def duplicate() -> list[HttpResponse]:
        answers = []
        try:
            start.wait(60)
            while not answers or answers[-1].status_code == 409:
                answers.append(send(key))
                assert len(answers) < 100_000 or not original_done.is_set(), "no replay came"
            return answers
        finally:
            connections.close_all()

    with ThreadPoolExecutor(DUPLICATES + 1) as pool:
        futures = [pool.submit(original)] + [pool.submit(duplicate) for _ in range(DUPLICATES)]
        return [answer for future in futures for answer in future.result(60)]


def test_every_duplicate_of_a_completed_request_gets_the_replay() -> None:
    RAN.clear()
    for _ in range(ROUNDS):
        key = str(uuid.uuid4())
        answers = one_round(key)
        assert RAN[key] == 1, f"the view ran {RAN[key]} times for one key"
        assert effects("deferred", key) == 1
        final = [a for a in answers if a.status_code != 409]
        assert all(a.status_code == 201 for a in final), Counter(a.status_code for a in answers)
        assert sum("Idempotent-Replayed" not in a for a in final) == 1
