"""A flow whose resumption kills the completer's process every time is parked, not retried.

``/probe/flow-poison/`` (``testproject/shop/probe_flows.py``) runs ``one`` and ``two``; for a body
``{"poison": true}`` its ``two`` SIGKILLs the process that runs it when that process was started
with ``PROBE_POISON=1``, as the completer's processes here are. Each run is started on a real
gunicorn worker that dies after ``one`` committed (``X-Crash-At: one:committed``), so the client
never comes back. Then ``manage.py idempotency_complete`` runs, each pass a process of its own,
the leases expired by SQL between passes as if they had run out.

Before, a pass counted a run's attempt only when it ended (a pause, a raise): a pass killed in
``two`` was never counted, and every pass after the lease took the poisoned run over and died
again, for ever; the healthy run behind it (older ``updated_at`` first) was never reached. Now
each pass counts the attempt before any phase runs: after ``max_attempts`` passes died, the next
one rolls the run forward to failure (``one``'s compensation runs once, the ``flow-failed``
answer is stored and replayed), and the healthy run completes, its count given back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from django_idempotency.models import FlowRun, IdempotencyRecord
from tests.probes import effects
from tests.servers import REPO, Gunicorn, Reply, database_url, gunicorn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.timeout(600),  # above the sum of its guards against a hang
    pytest.mark.django_db(transaction=True),
]

URL = "/probe/flow-poison/"
POISON = json.dumps({"poison": True}).encode()
HEALTHY = b"{}"
MAX_ATTEMPTS = 2


@pytest.fixture(scope="module")
def server(django_db_setup: None) -> Iterator[Gunicorn]:
    with gunicorn(connection.settings_dict, workers=2) as running:
        yield running


def abandon(server: Gunicorn, key: str, body: bytes) -> None:
    """Start the flow; its worker dies after ``one`` committed and the client never retries."""
    try:
        reply: Reply | None = server.post(
            URL, key, body=body, headers={"X-Crash-At": "one:committed"}
        )
    except OSError:
        reply = None
    assert reply is None or reply.status >= 500, reply
    run = FlowRun.objects.get(record__key=key)
    assert (run.recovery_point, run.attempts) == ("one", 0)


def expire_leases() -> None:
    """As if every lease had run out (a dead pass's lease is never given up)."""
    IdempotencyRecord.objects.filter(state=IdempotencyRecord.State.IN_PROGRESS).update(
        locked_until=timezone.now() - timedelta(seconds=1)
    )


def complete() -> subprocess.CompletedProcess[str]:
    """One pass of ``manage.py idempotency_complete`` in a process of its own."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "PROBE_POISON": "1",
    }
    return subprocess.run(
        [sys.executable, "manage.py", "idempotency_complete", "--json",
         "--max-attempts", str(MAX_ATTEMPTS)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_run_that_kills_every_pass_is_rolled_forward_and_the_healthy_one_completes(
    server: Gunicorn,
) -> None:
    poison_key, healthy_key = f"poison-{os.getpid()}", f"healthy-{os.getpid()}"
    abandon(server, poison_key, POISON)  # first: the older run, which each pass takes first
    abandon(server, healthy_key, HEALTHY)
    expire_leases()

    counted = []
    for _ in range(MAX_ATTEMPTS):
        died = complete()
        assert died.returncode == -signal.SIGKILL, (died.returncode, died.stderr[-3000:])
        poisoned = FlowRun.objects.get(record__key=poison_key)
        counted.append((poisoned.attempts, poisoned.last_error.partition(" (")[0]))
        expire_leases()

    last = complete()
    # Before: never counted, this pass took the run over and died again, as every pass after.
    assert last.returncode == 0, (last.returncode, counted, last.stderr[-3000:])
    # Each pass that died was counted before its phases ran.
    started = "a completer pass started and did not end"
    assert counted == [(n, started) for n in range(1, MAX_ATTEMPTS + 1)]
    outcomes = {
        done["key"]: (done["outcome"], done["status"])
        for done in map(json.loads, last.stdout.splitlines())
    }
    assert outcomes[poison_key] == ("failed", 502)
    # The healthy run completed in this pass, or in a pass that died after it.
    assert outcomes.get(healthy_key, ("completed", 201)) == ("completed", 201)

    poisoned = FlowRun.objects.get(record__key=poison_key)
    assert (poisoned.state, poisoned.attempts) == (FlowRun.State.FAILED, MAX_ATTEMPTS)
    assert effects("poison-one", poison_key) == 1
    assert effects("poison-two", poison_key) == 0
    assert effects("poison-undo-one", poison_key) == 1  # its compensation, once
    replay = server.post(URL, poison_key, body=POISON)
    problem = json.loads(replay.body)
    assert (replay.status, replay.headers.get("Idempotent-Replayed")) == (502, "true")
    assert (problem["interrupted"], problem["compensated"]) == ("two", ["one"])

    healthy = FlowRun.objects.get(record__key=healthy_key)
    # A pass that completes a run gives back the attempt it counted on starting.
    assert (healthy.state, healthy.attempts) == (FlowRun.State.COMPLETED, 0)
    assert (effects("poison-one", healthy_key), effects("poison-two", healthy_key)) == (1, 1)
    assert effects("poison-undo-one", healthy_key) == 0
    late = server.post(URL, healthy_key, body=HEALTHY)
    assert (late.status, late.headers.get("Idempotent-Replayed")) == (201, "true")

    # Nothing is left for the next pass.
    after = complete()
    assert (after.returncode, after.stdout) == (0, "")
    assert effects("poison-undo-one", poison_key) == 1
