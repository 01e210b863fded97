"""SIGKILL a real gunicorn worker at every crash point of the ride checkout, then finish it.

The ride checkout (``testproject/shop/rides.py``) has three phases: ``ride_created`` (local),
``charge_created`` (a call to the payment provider of ``tests/psp.py``, a real HTTP server that
deduplicates on the idempotency key) and ``finished`` (local). The worker kills itself with
SIGKILL at the crash point the request names (``X-Crash-At``, see
``testproject/shop/probe_flows.py``): ``<phase>:ran`` after the phase's work and before its
commit (for the charge: the provider has charged, nothing is recorded yet), ``<phase>:committed``
at the boundary after it. Then either the client retries, or it never does and the completer
finishes the flow, after which a late retry gets the final response as a replay. Every time:
one ride, one receipt, one distinct charge, every charge call under one key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from django_idempotency.flows.completer import complete_abandoned
from django_idempotency.flows.phases import record_key
from django_idempotency.models import FlowRun, IdempotencyRecord
from testproject.shop.models import Effect, Receipt, Ride
from tests.conftest import require_service
from tests.probes import effects
from tests.psp import Provider
from tests.servers import REPO, Gunicorn, Reply, database_url, gunicorn
from tests.services import BROKER_URLS
from tests.workers import worker_group

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.timeout(600),  # above the sum of its guards against a hang
    pytest.mark.django_db(transaction=True),
]

URL = "/api/rides/"
RIDE = json.dumps({"origin": [52.52, 13.40], "target": [52.50, 13.45]}).encode()
PHASES = ("ride_created", "charge_created", "finished")
CRASH_POINTS = [f"{phase}:{when}" for phase in PHASES for when in ("ran", "committed")]


@pytest.fixture(scope="module")
def server(django_db_setup: None, psp_server: Provider) -> Iterator[Gunicorn]:
    previous = os.environ.get("PSP_URL")
    os.environ["PSP_URL"] = psp_server.url  # inherited by the gunicorn processes
    try:
        with gunicorn(connection.settings_dict, workers=2) as running:
            yield running
    finally:
        if previous is None:
            del os.environ["PSP_URL"]
        else:
            os.environ["PSP_URL"] = previous


def crash(server: Gunicorn, key: str, point: str, url: str = URL, body: bytes = RIDE) -> None:
    """Send the request; its worker dies at ``point`` and the client gets no answer."""
    try:
        reply: Reply | None = server.post(url, key, body=body, headers={"X-Crash-At": point})
    except OSError:
        reply = None
    assert reply is None or reply.status >= 500, reply
    record = IdempotencyRecord.objects.get(key=key)
    assert record.state == IdempotencyRecord.State.IN_PROGRESS  # the claim committed first
    # As if the lease (30 s) had run out; a retry inside it would get 409.
    assert server.post(url, key, body=body).status == 409
    IdempotencyRecord.objects.filter(key=key).update(
        locked_until=timezone.now() - timedelta(seconds=1)
    )


def assert_once(psp: Provider, key: str, reply: Reply) -> None:
    """One ride, one receipt, one distinct charge, every charge call under the derived key."""
    data = json.loads(reply.body)
    assert reply.status == 201, reply
    charge_key = record_key(IdempotencyRecord.objects.get(key=key), "charge_created")
    assert set(psp.charge_keys()) == {charge_key}
    assert psp.charges[charge_key]["id"] == data["charge"]
    assert (Ride.objects.count(), Receipt.objects.count()) == (1, 1)
    ride = Ride.objects.get()
    assert (ride.pk, ride.charge_id, ride.status) == (data["ride"], data["charge"], "charged")


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_the_client_retries_after_the_crash(server: Gunicorn, psp: Provider, point: str) -> None:
    key = f"retry-{point}-{os.getpid()}"
    crash(server, key, point)
    reply = server.post(URL, key, body=RIDE)
    assert "Idempotent-Replayed" not in reply.headers
    assert_once(psp, key, reply)
    replay = server.post(URL, key, body=RIDE)
    assert (replay.headers.get("Idempotent-Replayed"), replay.body) == ("true", reply.body)
    if point in ("ride_created:ran", "charge_created:ran"):
        # Killed after the provider charged (or before any call): the retry called again,
        # under the same key, and the provider answered with the same charge.
        assert len(psp.charge_keys()) == (2 if point == "charge_created:ran" else 1)
    else:
        assert len(psp.charge_keys()) == 1  # stored with its recovery point


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_the_client_never_retries_and_the_completer_finishes(
    server: Gunicorn, psp: Provider, point: str
) -> None:
    key = f"completer-{point}-{os.getpid()}"
    crash(server, key, point)
    completions = complete_abandoned()
    if point == "ride_created:ran":
        # Nothing committed but the claim: no effect happened and nothing is stored to resume.
        assert completions == []
        assert not FlowRun.objects.exists()
        assert (Ride.objects.count(), psp.calls) == (0, [])
        reply = server.post(URL, key, body=RIDE)  # a late retry simply runs
        assert_once(psp, key, reply)
        return
    assert [(done.key, done.outcome, done.status) for done in completions] == [
        (key, "completed", 201)
    ]
    late = server.post(URL, key, body=RIDE)
    assert late.headers.get("Idempotent-Replayed") == "true"
    assert_once(psp, key, late)
    assert FlowRun.objects.get().state == FlowRun.State.COMPLETED


def test_the_command_in_its_own_process_finishes_a_killed_request(
    server: Gunicorn, psp: Provider
) -> None:
    """``manage.py idempotency_complete`` finds the view by name in a fresh process."""
    key = f"command-{os.getpid()}"
    crash(server, key, "charge_created:ran")
    env = {**os.environ, "DATABASE_URL": database_url(connection.settings_dict)}
    env["PSP_URL"] = psp.url
    done = subprocess.run(
        [sys.executable, "manage.py", "idempotency_complete", "--json"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    [line] = done.stdout.splitlines()
    assert json.loads(line) | {"record": None} == {
        "record": None,
        "key": key,
        "flow": "testproject.shop.rides:create_ride",
        "outcome": "completed",
        "status": 201,
        "detail": "",
    }
    late = server.post(URL, key, body=RIDE)
    assert late.headers.get("Idempotent-Replayed") == "true"
    assert_once(psp, key, late)


def test_the_celery_task_on_a_real_worker_finishes_a_killed_request(
    server: Gunicorn, psp: Provider, tmp_path: Path
) -> None:
    require_service("redis")
    key = f"celery-{os.getpid()}"
    crash(server, key, "finished:ran")
    assert os.environ["PSP_URL"] == psp.url  # set by the server fixture; inherited
    with worker_group(
        broker_url=BROKER_URLS["redis"],
        db_url=database_url(connection.settings_dict),
        log_dir=tmp_path,
        label="completer",
        workers=1,
        concurrency=1,
    ) as group:
        result = group.publish("django_idempotency.complete_flows")
        [done] = result.get(timeout=120)  # a guard against a hang, not a timing
    assert (done["key"], done["outcome"], done["status"]) == (key, "completed", 201)
    late = server.post(URL, key, body=RIDE)
    assert late.headers.get("Idempotent-Replayed") == "true"
    assert_once(psp, key, late)


@pytest.mark.parametrize("resumable", [True, False])
def test_sigkill_after_a_call_returned_and_before_it_was_recorded(
    server: Gunicorn, resumable: bool
) -> None:
    """A call that takes a key is made again under it; one marked resumable=False never is."""
    url = "/probe/flow/" if resumable else "/probe/flow-unresumable/"
    key = f"probe-{resumable}-{os.getpid()}"
    crash(server, key, "two:ran", url=url, body=b"{}")
    reply = server.post(url, key)
    call_key = record_key(IdempotencyRecord.objects.get(key=key), "two")
    calls = list(Effect.objects.filter(name="flow-remote-call").values_list("payload", flat=True))
    if resumable:
        assert reply.status == 201, reply
        assert calls == [call_key, call_key]  # again, under the same key
        assert (effects("flow-one", key), effects("flow-three", key)) == (1, 1)
    else:
        assert reply.status == 502, reply
        problem = json.loads(reply.body)
        assert (problem["interrupted"], problem["compensated"]) == ("two", ["one"])
        assert calls == [call_key]  # never again
        assert (effects("flow-undo-one", key), effects("flow-three", key)) == (1, 0)
    replay = server.post(url, key)
    assert (replay.status, replay.headers.get("Idempotent-Replayed")) == (reply.status, "true")
    assert Effect.objects.filter(name="flow-remote-call").count() == len(calls)
