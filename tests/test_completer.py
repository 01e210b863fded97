"""The completer: it finishes flows whose client never came back, or rolls them forward."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from django.utils import timezone

from django_idempotency.flows.completer import complete_abandoned, delete_orphans
from django_idempotency.flows.phases import FlowFailed
from django_idempotency.models import FlowRun, IdempotencyRecord
from django_idempotency.tasks import complete_flows
from testproject.shop import probe_flows
from testproject.shop.probe_flows import REMOTE_CALLS, ProbeError
from tests.probes import body, effects, post, problem

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("remote_calls")]

URL = "/probe/flow/"


def abandon(client: Client, after: str, url: str = URL) -> str:
    """A client sends a request that stops after ``after``, and never retries."""
    key = str(uuid.uuid4())
    with pytest.raises(ProbeError):
        post(client, url, key, data={"ride": 1}, headers={"X-Flow-Raise": after})
    return key


@pytest.mark.parametrize("after", ["one", "two", "three"])
def test_the_completer_finishes_the_flow_and_a_late_retry_gets_a_replay(
    client: Client, after: str
) -> None:
    key = abandon(client, after)
    [done] = complete_abandoned()
    assert (done.key, done.outcome, done.status) == (key, "completed", 201)
    assert effects("flow-one", key) == effects("flow-three", key) == 1
    assert sum(REMOTE_CALLS.values()) == 1
    record = IdempotencyRecord.objects.get(key=key)
    assert record.state == IdempotencyRecord.State.COMPLETED
    assert FlowRun.objects.get(record=record).state == FlowRun.State.COMPLETED

    late = post(client, URL, key, data={"ride": 1})
    assert late.status_code == 201
    assert late["Idempotent-Replayed"] == "true"
    assert body(late)["resumed"] is True  # the completer's run, replayed
    assert complete_abandoned() == []


def test_the_completer_leaves_live_leases_alone(client: Client) -> None:
    key = abandon(client, "one")
    IdempotencyRecord.objects.filter(key=key).update(
        locked_until=timezone.now() + timedelta(seconds=30)
    )
    assert complete_abandoned() == []
    assert IdempotencyRecord.objects.get(key=key).state == IdempotencyRecord.State.IN_PROGRESS


def test_after_max_attempts_the_flow_rolls_forward_with_its_compensations(
    client: Client,
) -> None:
    key = abandon(client, "two")
    FlowRun.objects.filter(record__key=key).update(attempts=3)
    [done] = complete_abandoned(max_attempts=3)
    assert (done.outcome, done.status) == ("failed", FlowFailed.status)
    assert effects("flow-refund-two", key) == effects("flow-undo-one", key) == 1
    assert effects("flow-three", key) == 0
    late = post(client, URL, key, data={"ride": 1})
    assert late["Idempotent-Replayed"] == "true"
    assert problem(late, FlowFailed.status)["compensated"] == ["two", "one"]
    assert effects("flow-refund-two", key) == effects("flow-undo-one", key) == 1


def test_a_view_that_keeps_raising_is_counted_then_rolled_forward(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = abandon(client, "one")

    def broken(call_key: str, request: object) -> dict[str, object]:
        raise ProbeError("the provider is down")

    # The completer's rebuilt request has no X-Flow-Raise; make the remote call fail instead.
    monkeypatch.setattr(probe_flows, "_remote", broken)
    outcomes = [complete_abandoned(max_attempts=3)[0].outcome for _ in range(3)]
    monkeypatch.undo()
    assert outcomes == ["raised", "raised", "failed"]
    run = FlowRun.objects.get(record__key=key)
    assert run.state == FlowRun.State.FAILED
    assert run.attempts == 3
    assert "the provider is down" in run.last_error
    assert effects("flow-undo-one", key) == 1


def test_a_flow_whose_view_is_gone_is_reported_not_lost(client: Client) -> None:
    key = abandon(client, "one")
    FlowRun.objects.filter(record__key=key).update(flow="testproject.gone:view")
    [done] = complete_abandoned()
    assert done.outcome == "unavailable"
    assert "cannot be imported" in done.detail
    assert IdempotencyRecord.objects.get(key=key).state == IdempotencyRecord.State.IN_PROGRESS


def test_the_command_and_the_task(client: Client) -> None:
    first, second = abandon(client, "one"), abandon(client, "three")
    out = StringIO()
    call_command("idempotency_complete", "--dry-run", stdout=out)
    assert f"key={first}" in out.getvalue() and f"key={second}" in out.getvalue()
    assert IdempotencyRecord.objects.filter(state="in_progress").count() == 2
    out = StringIO()
    call_command("idempotency_complete", "--dry-run", "--json", stdout=out)
    listed = [json.loads(line) for line in out.getvalue().splitlines()]
    assert {run["key"] for run in listed} == {first, second}
    assert all(isinstance(run["attempts"], int) and "flow" in run for run in listed)
    assert IdempotencyRecord.objects.filter(state="in_progress").count() == 2

    out = StringIO()
    call_command("idempotency_complete", "--json", "--limit", "1", stdout=out)
    [line] = out.getvalue().splitlines()
    assert json.loads(line)["outcome"] == "completed"
    [result] = complete_flows.delay().get()  # eager in the test settings
    assert result["outcome"] == "completed"
    assert {result["key"], json.loads(line)["key"]} == {first, second}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--limit", "abc"], "--limit: must be a whole number, not 'abc'"),
        (["--limit", "1.5"], "--limit: must be a whole number"),
        (["--limit", "0"], "--limit: must be from 1 to 1000000, not 0"),
        (["--limit", "99999999999999999999"], "--limit: must be from 1 to 1000000"),
        (["--max-attempts", "x"], "--max-attempts: must be a whole number, not 'x'"),
        (["--max-attempts", "-1"], "--max-attempts: must be a positive integer, not -1"),
    ],
)
def test_the_command_rejects_bad_numbers_with_a_clear_message(
    client: Client, args: list[str], message: str
) -> None:
    """Once a traceback (a LIMIT the database cannot take) or argparse's bare "invalid
    _positive_int value"; now a CommandError that says what to pass, and nothing is touched."""
    abandon(client, "one")
    with pytest.raises(CommandError) as exc:
        call_command("idempotency_complete", *args, stdout=StringIO())
    assert message in str(exc.value)
    assert FlowRun.objects.get().state == FlowRun.State.RUNNING


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, 10**20])
def test_complete_abandoned_rejects_a_limit_out_of_range(client: Client, limit: int) -> None:
    abandon(client, "one")
    with pytest.raises(ValueError, match="limit must be a positive integer of at most 1000000"):
        complete_abandoned(limit=limit)
    assert FlowRun.objects.get().state == FlowRun.State.RUNNING


def test_runs_whose_record_was_purged_are_deleted(client: Client) -> None:
    """The backstop: runs left by a version whose purge kept them, or a raw-SQL delete."""
    key = abandon(client, "one")
    table, column = IdempotencyRecord._meta.db_table, connection.ops.quote_name("key")
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {table} WHERE {column} = %s", [key])
    assert FlowRun.objects.count() == 1
    assert delete_orphans() == 1
    assert FlowRun.objects.count() == 0


def test_the_beat_schedule_of_the_guide_names_the_registered_task() -> None:
    from django.conf import settings

    from django_idempotency.tasks import COMPLETE_FLOWS_TASK_NAME
    from testproject.celery import app

    entry = settings.CELERY_BEAT_SCHEDULE["idempotency-complete-flows"]
    assert entry["task"] == COMPLETE_FLOWS_TASK_NAME
    assert COMPLETE_FLOWS_TASK_NAME in app.tasks
