"""Lease mode, ``@idempotent(atomic=False, lease=...)``: a committed claim, the view in its own
transaction, takeover after the lease with a fencing token. (The SIGKILL proofs are in
test_http_crash.py.)"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.test import Client
from django.utils import timezone

from django_idempotency.exceptions import RequestInProgress
from django_idempotency.http.core import Captured, Command, Idempotency, Policy, Replay
from django_idempotency.http.fingerprint import fingerprint
from django_idempotency.models import IdempotencyRecord
from testproject.shop.models import Effect
from testproject.shop.probe_views import ProbeError
from tests.probes import effects, in_thread, post, problem

pytestmark = pytest.mark.pooler

URL = "/probe/lease/"
PATH = "/charge"


def command(key: str) -> Command:
    return Command("anonymous", key, "POST", PATH, fingerprint("POST", PATH, b""))


def capture(result: str) -> Captured:
    return Captured(201, {"Content-Type": "text/plain"}, result.encode())


def lease_policy(seconds: float) -> Policy:
    return Policy(using=connection.alias, lease=timedelta(seconds=seconds), retry_after=2)


def stale_claim(key: str, *, lease_left: timedelta, data: bytes = b"{}") -> IdempotencyRecord:
    """The committed claim a holder leaves behind when its process dies mid-view."""
    now = timezone.now()
    return IdempotencyRecord.objects.create(
        owner="anonymous",
        key=key,
        fingerprint=fingerprint("POST", URL, data, "application/json"),
        method="POST",
        path=URL,
        locked_until=now + lease_left,
        expires_at=now + timedelta(days=1),
    )


# -- through the probe view -------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_first_execution_and_replay(client: Client) -> None:
    first = post(client, URL, "k")
    again = post(client, URL, "k")
    assert first.status_code == 201
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    stored = IdempotencyRecord.objects.get()
    assert stored.state == IdempotencyRecord.State.COMPLETED
    assert stored.locked_until is None
    assert effects("lease") == 1


@pytest.mark.django_db(transaction=True)
def test_a_raising_view_releases_the_claim(client: Client) -> None:
    with pytest.raises(ProbeError):
        post(client, f"{URL}?raise=1", "k")
    assert effects() == 0  # the view's own transaction rolled back
    assert not IdempotencyRecord.objects.exists()  # and the claim was released
    assert post(client, URL, "k").status_code == 201


@pytest.mark.django_db(transaction=True)
def test_a_5xx_is_rolled_back_and_released_and_a_429_released(client: Client) -> None:
    assert post(client, f"{URL}?status=503", "k").status_code == 503
    assert effects() == 0
    assert post(client, f"{URL}?status=429", "k").status_code == 429
    assert effects() == 1
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_live_lease_answers_409(client: Client) -> None:
    stale_claim("k", lease_left=timedelta(minutes=1))
    response = post(client, URL, "k")
    problem(response, 409)
    assert response["Retry-After"] == "1"
    problem(post(client, URL, "k", {"other": True}), 422)
    assert effects() == 0


@pytest.mark.django_db(transaction=True)
def test_an_expired_lease_is_taken_over_with_a_new_token(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="django_idempotency")
    crashed = stale_claim("k", lease_left=-timedelta(seconds=1))
    # A different request may not take over someone's claim; the same request may.
    problem(post(client, URL, "k", {"other": True}), 422)
    response = post(client, URL, "k")
    assert response.status_code == 201
    stored = IdempotencyRecord.objects.get()
    assert stored.pk == crashed.pk
    assert stored.token != crashed.token
    assert stored.state == IdempotencyRecord.State.COMPLETED
    assert bytes(stored.response_body or b"") == response.content
    assert "taken_over" in [getattr(r, "idempotency_outcome", None) for r in caplog.records]
    assert effects() == 1


@pytest.mark.django_db
def test_lease_mode_refuses_to_run_inside_a_transaction(client: Client) -> None:
    # pytest-django wraps this test in a transaction, as ATOMIC_REQUESTS would wrap the view.
    with pytest.raises(ImproperlyConfigured, match="non_atomic_requests"):
        post(client, URL, "k")


# -- through the core -------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_claim_is_committed_before_the_view_runs() -> None:
    seen: dict[str, Any] = {}
    key = str(uuid.uuid4())

    def view() -> str:
        seen["in_transaction"] = connection.in_atomic_block

        def look() -> None:  # another connection: sees only committed rows
            row = IdempotencyRecord.objects.values("state", "locked_until", "created_at").get()
            seen.update(row)

        thread, outcome = in_thread(look)
        thread.join(60)
        assert outcome == {"result": None}
        return "ok"

    Idempotency(lease_policy(90)).run(command(key), view, capture)
    assert seen["in_transaction"] is True
    assert seen["state"] == IdempotencyRecord.State.IN_PROGRESS
    lease = seen["locked_until"] - seen["created_at"]
    assert abs(lease - timedelta(seconds=90)) < timedelta(milliseconds=2)
    assert IdempotencyRecord.objects.get().state == IdempotencyRecord.State.COMPLETED


@pytest.mark.django_db(transaction=True)
def test_a_stale_holder_that_wakes_after_a_takeover_cannot_store(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="django_idempotency")
    key = str(uuid.uuid4())
    # Long enough that the first retry, at once, lands inside it on a loaded machine.
    policy = lease_policy(4)
    started, wake = threading.Event(), threading.Event()

    def slow_holder() -> str:
        started.set()
        assert wake.wait(120), "the test never woke the holder"
        Effect.objects.create(name="charge", payload="first holder")
        return "first holder"

    def retry() -> str:
        Effect.objects.create(name="charge", payload="retry")
        return "retry"

    holder, holder_outcome = in_thread(
        lambda: Idempotency(policy).run(command(key), slow_holder, capture)
    )
    assert started.wait(60)
    refused = 0
    deadline = time.monotonic() + 60  # a guard against a hang, not a timing
    while True:  # a client retrying on 409 until the lease runs out
        try:
            result = Idempotency(policy).run(command(key), retry, capture)
            break
        except RequestInProgress:
            refused += 1
            assert time.monotonic() < deadline, "the lease was never taken over"
            time.sleep(0.1)
    assert result == "retry"
    assert refused >= 1  # inside the lease the retry was refused
    wake.set()
    holder.join(60)
    # The first holder woke up, did its work, and failed to store: its transaction rolled back.
    assert isinstance(holder_outcome.get("error"), RequestInProgress)
    assert list(Effect.objects.values_list("payload", flat=True)) == ["retry"]
    stored = IdempotencyRecord.objects.get()
    assert bytes(stored.response_body or b"") == b"retry"
    replay = Idempotency(policy).run(command(key), retry, capture)
    assert isinstance(replay, Replay)
    assert replay.body == b"retry"
    stale = [r for r in caplog.records if getattr(r, "idempotency_outcome", None) == "stale"]
    assert stale and stale[0].levelno == logging.ERROR


@pytest.mark.django_db(transaction=True)
def test_a_concurrent_duplicate_during_the_lease_is_refused() -> None:
    key = str(uuid.uuid4())
    policy = lease_policy(60)
    started, wake = threading.Event(), threading.Event()

    def holder_view() -> str:
        started.set()
        assert wake.wait(120)
        return body_text

    body_text = "holder"
    holder, holder_outcome = in_thread(
        lambda: Idempotency(policy).run(command(key), holder_view, capture)
    )
    assert started.wait(60)
    with pytest.raises(RequestInProgress) as caught:
        Idempotency(policy).run(command(key), lambda: "duplicate", capture)
    assert caught.value.as_response()["Retry-After"] == "2"
    wake.set()
    holder.join(60)
    assert holder_outcome == {"result": "holder"}
    assert isinstance(Idempotency(policy).run(command(key), lambda: "again", capture), Replay)


@pytest.mark.django_db(transaction=True)
def test_a_stale_holder_that_raises_does_not_release_the_new_claim(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="django_idempotency")
    key = str(uuid.uuid4())
    policy = lease_policy(0.3)
    started, wake = threading.Event(), threading.Event()

    def holder_view() -> str:
        started.set()
        assert wake.wait(120)
        raise ProbeError("the holder fails after the takeover")

    holder, holder_outcome = in_thread(
        lambda: Idempotency(policy).run(command(key), holder_view, capture)
    )
    assert started.wait(60)
    deadline = time.monotonic() + 60  # a guard against a hang, not a timing
    while True:
        try:
            assert Idempotency(policy).run(command(key), lambda: "retry", capture) == "retry"
            break
        except RequestInProgress:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    wake.set()
    holder.join(60)
    assert isinstance(holder_outcome.get("error"), ProbeError)  # propagated as usual
    stored = IdempotencyRecord.objects.get()
    assert stored.state == IdempotencyRecord.State.COMPLETED  # not released by the holder
    assert bytes(stored.response_body or b"") == b"retry"
    outcomes = [getattr(r, "idempotency_outcome", None) for r in caplog.records]
    assert "stale" in outcomes
