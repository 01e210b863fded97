"""The completer (``complete_abandoned``, ``idempotency_complete``) when the database goes away
in the middle of a pass: each run's outcome is still reported, and the command says what to do.

A run resumed by the completer answers; then the completer reads the run's state to name the
outcome. A database lost at that read raised out of the whole pass (the outcomes of the runs
before it were not reported, the command printed the driver's traceback); it is now the run's
``paused`` outcome (the next pass reads it again). A database lost when the pass deletes
orphaned runs (housekeeping the next pass does again) is one WARNING line. The command that
cannot reach the database ends with a ``CommandError`` saying to run it again. The connection
is cut by the proxy of tests/db_proxy.py (PostgreSQL and MariaDB); the flow is
tests/test_flow_lost.py's."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections

from testproject.shop.probe_flows import ProbeError
from tests.db_proxy import PgProxy
from tests.test_flow_lost import (
    CRASH,
    RUNS,
    assert_done_once,
    completer,
    flow_view,
    post,
    proxy,  # noqa: F401 (the fixture)
    recovery_point,
    send,
)

pytestmark = [
    pytest.mark.slow,  # a cut connection through the proxy, real flows: 1-2 s each
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, databases=["default", "other"]),
]

Q = r"[`\"]"
STATES_READ = rf"SELECT {Q}{RUNS}{Q}\.{Q}state{Q} AS {Q}state{Q}, .*{Q}record__state{Q}"
ORPHANS = rf"SELECT {Q}{RUNS}{Q}\.{Q}id{Q} AS {Q}pk{Q} FROM {Q}{RUNS}{Q} WHERE NOT EXISTS"


def abandoned_after_one() -> str:
    """A flow whose request committed phase ``one`` and raised, as a dead worker leaves it."""
    key = f"co-{uuid.uuid4()}"
    CRASH.add(key)
    with pytest.raises(ProbeError):
        flow_view(post(key))  # type: ignore[call-arg]
    assert recovery_point(key) == "one"
    return key


def test_a_database_lost_when_the_runs_state_is_read_is_paused_not_raised(
    proxy: PgProxy,  # noqa: F811
) -> None:
    first, second = abandoned_after_one(), abandoned_after_one()
    rule = proxy.cut(STATES_READ, when="before")  # the first run's read only
    done = completer().result(60)  # raised the driver's error out of the pass
    proxy.clear()
    assert rule.hits == 1
    assert sorted((d.outcome, d.status) for d in done) == [("completed", 201), ("paused", 201)]
    [lost] = [d for d in done if d.outcome == "paused"]
    assert "server" in lost.detail.lower() or "lost connection" in lost.detail.lower(), lost
    assert completer().result(60) == []  # both finished: nothing left for the next pass
    for key in (first, second):
        assert_done_once(send(key).result(60), key)


def test_a_database_lost_when_orphans_are_deleted_is_a_warning_after_the_outcomes(
    proxy: PgProxy,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = abandoned_after_one()
    rule = proxy.cut(ORPHANS, when="before")
    with caplog.at_level(logging.WARNING, logger="django_idempotency"):
        done = completer().result(60)
    proxy.clear()
    assert rule.hits == 1
    assert [(d.outcome, d.status) for d in done] == [("completed", 201)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("orphaned runs" in line for line in warnings), warnings
    assert_done_once(send(key).result(60), key)


def test_the_command_that_cannot_reach_the_database_says_to_run_it_again(
    proxy: PgProxy,  # noqa: F811
) -> None:
    key = abandoned_after_one()
    proxy.refuse(3.0)
    with pytest.raises(CommandError) as raised:
        call_command("idempotency_complete")
    message = str(raised.value)
    assert "connection to the database 'other' was lost" in message, message
    assert "Run the completer again" in message, message
    proxy.clear()
    connections["other"].close()  # the command's, which the proxy reset
    time.sleep(3.0)  # the proxy accepts connections again
    assert [d.outcome for d in completer().result(60)] == ["completed"]
    assert_done_once(send(key).result(60), key)
