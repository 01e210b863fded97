"""``manage.py check --deploy`` warns (W011) when PostgreSQL's
``idle_in_transaction_session_timeout`` is 0 for the library's sessions, read from the real
server: the test database's default (0), then set per session and per role."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from io import StringIO

import pytest
from django.core.checks import INFO, CheckMessage, run_checks
from django.core.management import call_command
from django.db import connection, connections
from django.test import override_settings

from django_idempotency import checks
from django_idempotency.checks import IDLE_IN_TRANSACTION, IDLE_IN_TRANSACTION_UNCHECKED
from tests.test_http_unavailable import down  # noqa: F401 - the fixture

pytestmark = [pytest.mark.django_db(transaction=True, databases=["default", "other"])]


def warnings(**kwargs: object) -> list[str]:
    found = run_checks(include_deployment_checks=True, **kwargs)  # type: ignore[arg-type]
    return [message.msg for message in found if message.id == IDLE_IN_TRANSACTION]


@pytest.fixture
def timeout_reset() -> Iterator[None]:
    yield
    for alias in ("default", "other"):
        connections[alias].close()  # a SET of the test ends with its session


@pytest.mark.postgres
@pytest.mark.usefixtures("timeout_reset")
def test_postgresql_without_an_idle_in_transaction_timeout_is_warned() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SHOW idle_in_transaction_session_timeout")
        assert cursor.fetchone()[0] == "0"  # the server's default, as in production
    [message] = warnings()
    assert "idle_in_transaction_session_timeout is 0 on database 'default'" in message
    # Only a deploy check: a plain `check` does not query the database for it.
    assert not [m for m in run_checks() if m.id == IDLE_IN_TRANSACTION]
    output = StringIO()
    call_command("check", "--deploy", stderr=output, stdout=output)
    assert IDLE_IN_TRANSACTION in output.getvalue()

    with connection.cursor() as cursor:
        cursor.execute("SET idle_in_transaction_session_timeout = '5min'")
    assert warnings() == []


@pytest.mark.postgres
@pytest.mark.usefixtures("timeout_reset")
def test_it_reads_the_database_the_library_uses_or_those_given() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SET idle_in_transaction_session_timeout = '5min'")
    assert warnings() == []
    with override_settings(IDEMPOTENCY={"DATABASE": "other"}):
        [message] = warnings()
        assert "on database 'other'" in message
    [message] = warnings(databases=["default", "other"])
    assert "on database 'other'" in message
    # A role's default counts too: it is what a new session of the app's role gets.
    user = connections["other"].settings_dict["USER"]
    name = connections["other"].settings_dict["NAME"]
    connections["other"].close()
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                f'ALTER ROLE "{user}" IN DATABASE "{connection.ops.quote_name(name)[1:-1]}" '
                "SET idle_in_transaction_session_timeout = '2min'"
            )
        assert warnings(databases=["other"]) == []
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                f'ALTER ROLE "{user}" IN DATABASE "{connection.ops.quote_name(name)[1:-1]}" '
                "RESET idle_in_transaction_session_timeout"
            )


def test_other_databases_are_not_warned() -> None:
    if connection.vendor == "postgresql":
        pytest.skip("the warning is PostgreSQL's")
    assert warnings() == []
    assert warnings(databases=["default"]) == []


# -- a database the check cannot reach (issue 35, item 13, review) ----------------------------


def idempotency_messages() -> list[CheckMessage]:
    found = run_checks(include_deployment_checks=True, databases=["other"])  # type: ignore[arg-type]
    return [m for m in found if m.id and m.id.startswith("django_idempotency.")]


@pytest.mark.postgres
def test_an_unreachable_database_is_no_warning_but_a_note_that_it_was_not_checked(
    down: str,  # noqa: F811
) -> None:
    """`check --deploy` often runs where the database is not (an image build, CI): that was
    W011, the warning of a timeout of 0, and `--fail-level WARNING` failed the build."""
    [message] = idempotency_messages()
    assert message.id == IDLE_IN_TRANSACTION_UNCHECKED
    assert message.level == INFO  # never fails `check --deploy --fail-level WARNING`
    assert "not checked on database 'other'" in message.msg
    assert "could not be reached" in message.msg
    assert "SHOW idle_in_transaction_session_timeout" in (message.hint or "")
    output = StringIO()
    call_command("check", "--deploy", "--database", "other", stdout=output, stderr=output)
    assert IDLE_IN_TRANSACTION_UNCHECKED in output.getvalue()
    assert f"{IDLE_IN_TRANSACTION})" not in output.getvalue()


@pytest.fixture
def silent() -> Iterator[str]:
    """The alias ``other`` pointed at a server that accepts connections and never answers (a
    black-holed database, as a firewall that drops packets), with no ``connect_timeout``."""
    alias = "other"
    settings_dict = connections[alias].settings_dict
    saved = dict(settings_dict)
    connections[alias].close()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # the kernel completes the handshake; nobody ever reads
        options = {k: v for k, v in settings_dict["OPTIONS"].items() if k != "connect_timeout"}
        settings_dict.update(HOST="127.0.0.1", PORT=server.getsockname()[1], OPTIONS=options)
        try:
            yield alias
        finally:
            connections[alias].close()
            settings_dict.clear()
            settings_dict.update(saved)


@pytest.mark.postgres
def test_a_silent_database_is_given_up_on_within_the_checks_own_timeout(
    silent: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checks, "CHECK_CONNECT_TIMEOUT", 2)
    found: list[list[CheckMessage]] = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: found.append(idempotency_messages()), daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "check --deploy hung on a database that never answers"
    assert time.monotonic() - started < 10
    [[message]] = found
    assert message.id == IDLE_IN_TRANSACTION_UNCHECKED and message.level == INFO
    # The alias's own connection is untouched: its settings keep no timeout of the check's.
    assert "connect_timeout" not in connections[silent].settings_dict["OPTIONS"]
