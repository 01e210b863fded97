"""The undocumented parts of Django's database connection that ``django_idempotency.pg_roundtrips``
relies on still exist and mean what it assumes, on the installed Django.

``pg_roundtrips`` decides whether a ``COMMIT`` may travel with a statement from
``connection.atomic_blocks``, ``connection.commit_on_exit`` and ``connection.needs_rollback``
(leaving the current block commits next exactly when only one block is open, it was entered with
autocommit on, and nothing marked it for rollback), and it does for its statement what a Django
cursor does with ``in_atomic_block``, ``validate_no_broken_transaction()``,
``close_if_health_check_failed()``, ``execute_wrappers``, ``queries_logged`` and
``queries_log``. None of these is documented, so a Django release may change them: the test
command runs this file on every Django of the version matrix (it is a quick test, on every
backend), so such a change fails here, by name, before it breaks a commit.

Whether leaving a block commits is observed through ``transaction.on_commit``, Django's public
API: its callbacks run when, and only when, Django commits the transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext

ATTRIBUTES = [
    "atomic_blocks",
    "commit_on_exit",
    "needs_rollback",
    "in_atomic_block",
    "execute_wrappers",
    "queries_log",
]
METHODS = ["validate_no_broken_transaction", "close_if_health_check_failed"]


def commit_is_next() -> bool:
    """What ``pg_roundtrips.commit_travels`` reads from Django: leaving the current atomic block
    commits the transaction."""
    return (
        connection.in_atomic_block
        and len(connection.atomic_blocks) == 1
        and connection.commit_on_exit
        and not connection.needs_rollback
    )


class Commits:
    """Whether Django committed: an ``on_commit`` callback registered in the block ran."""

    def __init__(self) -> None:
        self.ran = False

    def register(self) -> None:
        transaction.on_commit(self.run)

    def run(self) -> None:
        self.ran = True


def test_the_attributes_and_methods_exist() -> None:
    missing = [name for name in ATTRIBUTES if not hasattr(connection, name)]
    missing += [name for name in METHODS if not callable(getattr(connection, name, None))]
    assert not missing, f"Django's connection no longer has {missing}: see pg_roundtrips"
    assert isinstance(connection.atomic_blocks, list)
    assert isinstance(connection.execute_wrappers, list)


def outermost(commits: Commits) -> None:
    with transaction.atomic():
        assert commit_is_next()
        commits.register()


def durable(commits: Commits) -> None:
    with transaction.atomic(durable=True):
        assert commit_is_next()
        commits.register()


def marked_for_rollback(commits: Commits) -> None:
    with transaction.atomic():
        commits.register()
        transaction.set_rollback(True)
        assert connection.needs_rollback
        assert not commit_is_next()


def failed_inner_block_without_savepoint(commits: Commits) -> None:
    """An error in an inner block without a savepoint marks the outer block for rollback."""
    with transaction.atomic():
        commits.register()
        with pytest.raises(ZeroDivisionError), transaction.atomic(savepoint=False):
            1 / 0  # noqa: B018 - the error is the point
        assert connection.needs_rollback
        assert not commit_is_next()


def broken_transaction_refused(commits: Commits) -> None:
    """A block marked for rollback refuses statements: what a Django cursor checks first."""
    with transaction.atomic():
        connection.validate_no_broken_transaction()  # a healthy block: nothing raised
        commits.register()
        transaction.set_rollback(True)
        with pytest.raises(TransactionManagementError):
            connection.validate_no_broken_transaction()


SCENARIOS: list[tuple[Callable[[Commits], None], bool]] = [
    (outermost, True),
    (durable, True),
    (marked_for_rollback, False),
    (failed_inner_block_without_savepoint, False),
    (broken_transaction_refused, False),
]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "scenario, committed", SCENARIOS, ids=[scenario.__name__ for scenario, _ in SCENARIOS]
)
def test_leaving_the_block_commits_exactly_when_the_attributes_say_so(
    scenario: Callable[[Commits], None], committed: bool
) -> None:
    commits = Commits()
    assert not connection.in_atomic_block and not connection.atomic_blocks
    scenario(commits)
    assert commits.ran is committed
    assert not connection.in_atomic_block and not connection.atomic_blocks
    assert not connection.needs_rollback


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("savepoint", [True, False])
def test_an_inner_block_is_a_second_entry_and_leaving_it_does_not_commit(savepoint: bool) -> None:
    commits = Commits()
    with transaction.atomic():
        assert len(connection.atomic_blocks) == 1
        with transaction.atomic(savepoint=savepoint):
            assert len(connection.atomic_blocks) == 2
            assert not commit_is_next()
            commits.register()
        assert not commits.ran  # leaving the inner block did not commit
        assert len(connection.atomic_blocks) == 1 and commit_is_next()
    assert commits.ran


@pytest.mark.django_db(transaction=True)
def test_a_block_entered_with_autocommit_off_does_not_commit_on_exit() -> None:
    """With autocommit off, leaving even the only block commits nothing: the caller commits."""
    commits = Commits()
    transaction.set_autocommit(False)
    try:
        with transaction.atomic():
            assert len(connection.atomic_blocks) == 1
            assert connection.commit_on_exit is False
            assert not commit_is_next()
            commits.register()
        assert not commits.ran  # leaving the block committed nothing
        transaction.commit()
    finally:
        transaction.set_autocommit(True)


@pytest.mark.django_db(transaction=True)
def test_execute_wrappers_are_listed_outermost_first_and_run_in_that_order() -> None:
    """``pg_roundtrips`` composes the wrappers as a Django cursor does: the first in
    ``connection.execute_wrappers`` is the outermost, called first."""
    calls: list[str] = []

    def named(name: str) -> Callable[..., Any]:
        def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            calls.append(name)
            return execute(sql, params, many, context)

        return wrapper

    first, second = named("first"), named("second")
    connection.ensure_connection()  # a new connection's own set-up queries are not this one's
    with connection.execute_wrapper(first), connection.execute_wrapper(second):
        assert connection.execute_wrappers == [first, second]
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    assert calls == ["first", "second"]
    assert connection.execute_wrappers == []


@pytest.mark.django_db
def test_the_query_log_is_a_list_of_sql_and_time_while_queries_are_logged() -> None:
    """``pg_roundtrips`` appends ``{"sql", "time"}`` to ``queries_log`` when ``queries_logged``,
    as Django's debug cursor does."""
    with CaptureQueriesContext(connection) as captured:
        assert connection.queries_logged
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        entry = connection.queries_log[-1]
    assert set(entry) == {"sql", "time"}
    assert captured.captured_queries[-1] == entry
