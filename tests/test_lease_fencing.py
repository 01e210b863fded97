"""The fencing token while the new holder is still running, and the database clock.

The lease tests in test_lease.py wake a stale holder only after the new holder has finished;
these wake it while the new holder's view is still running, which is when a compare-and-swap
without the token (in ``complete()`` or ``release()``) would let the stale holder win. Then: the
claim compares times on the database clock, so an app server whose clock runs ahead still
replays a completed key.
"""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from django_idempotency.exceptions import RequestInProgress
from django_idempotency.http.core import Idempotency, Policy, Replay
from django_idempotency.models import IdempotencyRecord
from testproject.shop.models import Effect
from testproject.shop.probe_views import ProbeError
from tests.probes import effects, in_thread, post
from tests.test_lease import capture, command

pytestmark = pytest.mark.django_db(transaction=True)


def short_lease() -> Policy:
    return Policy(using=connection.alias, lease=timedelta(milliseconds=200), retry_after=1)


def take_over(key: str, view: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Start a new holder once the stale one's lease ran out; return when its view runs."""
    running = threading.Event()

    def new_holder_view() -> str:
        running.set()
        return str(view())

    def run() -> Any:
        while True:
            try:
                return Idempotency(short_lease()).run(command(key), new_holder_view, capture)
            except RequestInProgress:
                threading.Event().wait(0.05)  # inside the lease: a client retries later

    thread, outcome = in_thread(run)
    assert running.wait(60), "the new holder never took the claim over"
    return thread, outcome


def stale_holder(key: str, view: Any) -> tuple[threading.Thread, dict[str, Any], threading.Event]:
    started, wake = threading.Event(), threading.Event()

    def holder_view() -> Any:
        started.set()
        assert wake.wait(180), "the test never woke the stale holder"
        return view()

    thread, outcome = in_thread(
        lambda: Idempotency(short_lease()).run(command(key), holder_view, capture)
    )
    assert started.wait(60)
    return thread, outcome, wake


def test_a_stale_holder_finishing_while_the_new_one_runs_gets_409() -> None:
    """Without the token in complete()'s compare-and-swap the stale holder stored its response
    over the running claim, and the new holder, the one that should win, got the 409."""
    key = str(uuid.uuid4())

    def stale_view() -> str:
        Effect.objects.create(name="charge", payload="stale")
        return "stale"

    stale, stale_outcome, wake_stale = stale_holder(key, stale_view)
    finish_new = threading.Event()

    def new_view() -> str:
        assert finish_new.wait(180)
        Effect.objects.create(name="charge", payload="new")
        return "new"

    new, new_outcome = take_over(key, new_view)
    wake_stale.set()  # the new holder's view is still running
    stale.join(60)
    assert isinstance(stale_outcome.get("error"), RequestInProgress), stale_outcome
    finish_new.set()
    new.join(60)
    assert new_outcome == {"result": "new"}
    assert list(Effect.objects.values_list("payload", flat=True)) == ["new"]
    assert bytes(IdempotencyRecord.objects.get().response_body or b"") == b"new"


def test_a_stale_holder_raising_while_the_new_one_runs_keeps_the_new_claim() -> None:
    """Without the token check in release() the stale holder deleted the new holder's claim.
    Checked before the new holder finishes: its retry loop would otherwise hide the loss."""
    key = str(uuid.uuid4())

    def stale_view() -> str:
        raise ProbeError("the stale holder fails after the takeover")

    stale, stale_outcome, wake_stale = stale_holder(key, stale_view)
    finish_new = threading.Event()
    new, new_outcome = take_over(key, lambda: "new" if finish_new.wait(180) else "timed out")
    claim = IdempotencyRecord.objects.get()
    wake_stale.set()
    stale.join(60)
    assert isinstance(stale_outcome.get("error"), ProbeError)
    still = IdempotencyRecord.objects.filter(pk=claim.pk, token=claim.token).first()
    assert still is not None, "the stale holder released the new holder's claim"
    assert still.state == IdempotencyRecord.State.IN_PROGRESS
    finish_new.set()
    new.join(60)
    assert new_outcome == {"result": "new"}
    assert isinstance(
        Idempotency(short_lease()).run(command(key), lambda: "again", capture), Replay
    )


def test_an_app_clock_two_days_ahead_still_replays_a_completed_key(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expiry is the database's to judge: with the app's clock deciding, this app server would
    take the 24-hour record for expired and run the request again."""
    first = post(client, "/probe/effect/", "k")
    assert first.status_code == 201
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() + timedelta(days=2))
    again = post(client, "/probe/effect/", "k")
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert effects() == 1
