"""A first delivery (``redelivered=False``) at REPEATABLE READ and SERIALIZABLE, on PostgreSQL
and MariaDB: a parked event never runs.

Such a delivery skips its count, and its reservation reads the event's counter after the
insert, which waits for any delivery that holds the event. A failed first delivery parks the
event while it holds it (``_fail_first_delivery``). Under ``READ COMMITTED`` the read after the
wait sees the parking. At the stricter levels a plain read sees the transaction's snapshot,
taken before the wait: on PostgreSQL, ``django_idempotency_reserve_v1`` read no counter there
and the parked event ran. The interleaving is made, not hoped for: a third connection holds an
uncommitted counter of the event, so the failure's count waits on it while it holds the event;
the second delivery then waits on the failure's reservation (both waits seen in
``pg_stat_activity`` or ``INNODB_TRX``) before that connection lets go.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency import new_event_id
from django_idempotency.events.core import process_event
from django_idempotency.exceptions import EventParked
from django_idempotency.models import EventDelivery, ProcessedEvent
from django_idempotency.retention import partitioning
from testproject.shop.models import Effect
from tests.lock_waits import WAIT_TIMEOUT, session_of, wait_until_blocked

RR = "repeatable_read"
"""The test database through connections at REPEATABLE READ (testproject/settings.py)."""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, databases=["default", RR]),
]


class Poison(Exception):
    pass


class Runs:
    """Functions run in threads, each with its own connections; what each returned or raised."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.outcomes: dict[str, Any] = {}

    def start(self, name: str, target: Callable[[], Any]) -> None:
        def run() -> None:
            try:
                self.outcomes[name] = target()
            except BaseException as exc:  # noqa: BLE001 - asserted on in the test's thread
                self.outcomes[name] = exc
            finally:
                connections.close_all()

        thread = threading.Thread(target=run, daemon=True)
        self.threads.append(thread)
        thread.start()

    def failed(self, name: str) -> Callable[[], BaseException | None]:
        """What ``name`` raised, if it has ended: for :func:`wait_until_blocked`."""
        return lambda: (
            self.outcomes[name] if isinstance(self.outcomes.get(name), BaseException) else None
        )

    def join(self) -> None:
        for thread in self.threads:
            thread.join(WAIT_TIMEOUT)
            assert not thread.is_alive(), f"a thread did not finish in time: {self.outcomes}"


@pytest.fixture
def runs() -> Iterator[Runs]:
    runner = Runs()
    yield runner
    for thread in runner.threads:
        thread.join(WAIT_TIMEOUT)


@pytest.fixture
def layout(request: pytest.FixtureRequest) -> Iterator[str]:
    """``default``, or ``partitioned`` (PostgreSQL's EVENT_PARTITIONS, committed for real:
    the other connections must see the partitions), reverted after the test."""
    name: str = request.param
    if name == "default":
        yield name
        return
    if connection.vendor != "postgresql":
        pytest.skip("the partitioned layout is PostgreSQL's")
    with override_settings(IDEMPOTENCY={"EVENT_PARTITIONS": "day"}):
        partitioning.convert("default")
        try:
            yield name
        finally:
            if partitioning.is_partitioned("default"):
                partitioning.revert("default")


def set_level(level: str) -> None:
    """This thread's connection to the RR alias at ``level`` (REPEATABLE READ as configured)."""
    if level == "repeatable read":
        return
    wrapper = connections[RR]
    wrapper.ensure_connection()
    if wrapper.vendor == "postgresql":
        import psycopg

        wrapper.connection.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
    else:
        with wrapper.cursor() as cursor:
            cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE")


def isolation_of(alias: str) -> str:
    """The isolation level a transaction on ``alias`` runs at, asked inside one."""
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        if connections[alias].vendor == "postgresql":
            cursor.execute("SELECT current_setting('transaction_isolation')")
        elif connections[alias].mysql_is_mariadb:
            cursor.execute("SELECT @@session.tx_isolation")
        else:
            cursor.execute("SELECT @@session.transaction_isolation")
        return str(cursor.fetchone()[0]).lower().replace("-", " ")


def test_the_alias_runs_its_transactions_at_repeatable_read() -> None:
    assert isolation_of(RR) == "repeatable read"
    assert isolation_of("default") == "read committed"


@pytest.mark.parametrize("layout", ["default", "partitioned"], indirect=True)
@pytest.mark.parametrize("level", ["repeatable read", "serializable"])
@pytest.mark.parametrize("after_a_read", [False, True], ids=["alone", "after-a-read"])
def test_a_first_delivery_waiting_on_a_failure_that_parks_the_event_does_not_run(
    runs: Runs, layout: str, level: str, after_a_read: bool
) -> None:
    """Regression: on PostgreSQL, delivery B's reservation waited for failure A, which parked
    the event (MAX_DELIVERIES=1) and gave the event up; B then read the counter in its
    snapshot, found none, ran the body and committed: a parked event applied. Now B's
    reservation meets the counter and raises a serialization failure; alone in its
    transaction, B then counts itself, finds the event parked and is refused (EventParked),
    with the error that parked it kept. Inside a transaction that read before (its snapshot
    older still), the failure propagates and that transaction rolls back.

    MariaDB's plain read was right alone (InnoDB fixes the snapshot at the first read, which
    came after the wait) and wrong after a read; it is a locking read now."""
    event = str(new_event_id())
    ran: list[str] = []
    in_body, fail_now = threading.Event(), threading.Event()
    gate_held, open_gate = threading.Event(), threading.Event()
    sessions: dict[str, int] = {}

    def poison() -> None:
        ran.append("A")
        in_body.set()
        assert fail_now.wait(WAIT_TIMEOUT)
        raise Poison("the first delivery died")

    def first_failure() -> Any:
        sessions["A"] = session_of()
        return process_event("ledger", event, poison, redelivered=False, max_deliveries=1)

    def gate() -> None:  # an uncommitted counter: the failure's count waits on it
        with transaction.atomic():
            EventDelivery.objects.create(
                consumer="ledger", event_id=event, expires_at=timezone.now()
            )
            gate_held.set()
            assert open_gate.wait(WAIT_TIMEOUT)
            transaction.set_rollback(True)

    def effect() -> str:
        ran.append("B")
        Effect.objects.using(RR).create(name="isolation", payload=event)
        return "applied"

    def second_delivery() -> Any:
        sessions["B"] = session_of(RR)
        set_level(level)

        def deliver() -> Any:
            return process_event(
                "ledger", event, effect, redelivered=False, max_deliveries=1, using=RR
            )

        if not after_a_read:
            return deliver()
        with transaction.atomic(using=RR):
            assert not Effect.objects.using(RR).exists()  # this read fixes the snapshot
            return deliver()

    runs.start("A", first_failure)
    assert in_body.wait(WAIT_TIMEOUT), runs.outcomes
    runs.start("gate", gate)
    assert gate_held.wait(WAIT_TIMEOUT), runs.outcomes
    fail_now.set()
    wait_until_blocked(sessions["A"], "the failure's count", runs.failed("A"))
    runs.start("B", second_delivery)
    while "B" not in sessions:
        assert not isinstance(runs.outcomes.get("B"), BaseException), runs.outcomes
        time.sleep(0.01)
    wait_until_blocked(sessions["B"], "the second delivery's reservation", runs.failed("B"))
    open_gate.set()
    runs.join()

    assert isinstance(runs.outcomes["A"], Poison), runs.outcomes
    assert ran == ["A"], runs.outcomes  # the parked event never ran again
    assert not Effect.objects.exists()
    assert not ProcessedEvent.objects.exists()
    counter = EventDelivery.objects.get()
    assert counter.parked_at is not None
    assert counter.last_error == "Poison: the first delivery died"  # why it is parked
    refused = runs.outcomes["B"]
    if after_a_read and connection.vendor == "postgresql":
        # The count joined the rolled-back transaction: the next delivery is counted instead.
        assert isinstance(refused, OperationalError), runs.outcomes
        assert "could not serialize" in str(refused)
        assert counter.deliveries == 1
    else:
        assert isinstance(refused, EventParked), runs.outcomes
        assert counter.deliveries == (1 if after_a_read else 2)
