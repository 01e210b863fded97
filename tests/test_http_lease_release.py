"""Lease mode: the release of a claim after the view's transaction rolled back (the view raised,
or answered ``5xx``) meets a database that cannot be reached.

The request's answer stands (the view's own exception or response, never a ``500`` of the
library's), one WARNING line (``release_failed``) names the record, the connection is left so
that the next request on the same thread works, and the claim holds the key until its lease
runs out: a retry then takes it over and runs the view, as after a crash. A database error
that is not a lost connection is still raised.

Against real PostgreSQL and MariaDB: the alias ``other`` (the records' database here) goes
through :func:`tests.db_proxy.proxy_for`, which cuts the connection when the release's
``DELETE`` is sent; the view's own effects go to ``default``, directly.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections
from django.test import Client, override_settings

from django_idempotency.models import IdempotencyRecord
from testproject.shop.probe_views import ProbeError
from tests.db_proxy import PgProxy, proxy_for, repointed
from tests.probes import post

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, databases=["default", "other"]),
]

RELEASE = (
    r"DELETE (r )?FROM \S*idempotencyrecord\S* (AS r FORCE INDEX \(PRIMARY\) )?WHERE (r\.)?id"
)
"""The release's statement (:meth:`RecordStore.release`), on either backend (MariaDB's names the
primary key, in the multi-table form)."""
LEASE = timedelta(seconds=1)
SETTINGS = {"DATABASE": "other", "LEASE": LEASE}
RETRY_FOR = 30.0
"""How long a retry loop may go on before the test fails: many leases, on a loaded machine."""

URLS = {"raised": "/probe/lease/?raise=1", "5xx": "/probe/lease/?status=500"}


@pytest.fixture
def proxy() -> Iterator[PgProxy]:
    """``other`` through a proxy that cuts what a test asks it to."""
    with (
        proxy_for(connections["other"].settings_dict) as running,
        repointed("other", running.port),
    ):
        yield running


def record(key: str) -> IdempotencyRecord | None:
    return IdempotencyRecord.objects.using("other").filter(key=key).first()


def outcomes(caplog: pytest.LogCaptureFixture, outcome: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "idempotency_outcome", None) == outcome]


def send(url: str, key: str) -> Any:
    """``url`` with ``key``: the view's answer, or its exception as the test client raises it."""
    try:
        return post(Client(), url, key)
    except Exception as exc:  # noqa: BLE001 - the test asserts on which exception it was
        return exc


@pytest.mark.parametrize("case", sorted(URLS))
def test_a_release_that_loses_the_database_keeps_the_views_answer(
    proxy: PgProxy, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = f"release-lost-{case}-{uuid.uuid4()}"
    rule = proxy.cut(RELEASE, when="before")
    with (
        override_settings(IDEMPOTENCY=SETTINGS),
        caplog.at_level(logging.DEBUG, logger="django_idempotency"),
    ):
        answer = send(URLS[case], key)
        assert rule.hits == 1
        proxy.clear()
        # The view's own answer: its exception propagates, or its 5xx response is sent. Not the
        # driver's error (a 500 of the library's).
        if case == "raised":
            assert isinstance(answer, ProbeError), answer
        else:
            assert not isinstance(answer, Exception), answer
            assert answer.status_code == 500
            assert "effect" in json.loads(answer.content)  # the view's body, not an error page
        lines = outcomes(caplog, "release_failed")
        assert len(lines) == 1, [r.getMessage() for r in caplog.records]
        line = lines[0]
        assert line.levelno == logging.WARNING and line.exc_info is None
        held = record(key)
        assert held is not None and held.state == IdempotencyRecord.State.IN_PROGRESS
        message = line.getMessage()
        assert f"record={held.pk}" in message and "database=other" in message, message
        assert "lease=1s" in message and "cause=" in message, message
        assert any(
            r.levelno == logging.DEBUG and r.exc_info and "release" in r.getMessage()
            for r in caplog.records
        )
        # The next request on this thread gets a working connection.
        fresh = post(Client(), "/probe/lease/", f"{key}-next")
        assert fresh.status_code == 201, fresh.content

        # The claim holds the key until its lease runs out (409), then a retry takes it over
        # and runs the view again.
        deadline = time.monotonic() + RETRY_FOR
        while True:
            caplog.clear()
            retried = post(Client(raise_request_exception=False), URLS[case], key)
            if retried.status_code != 409:
                break
            assert time.monotonic() < deadline, "the claim outlived its lease"
            time.sleep(0.2)
    assert retried.status_code == 500
    assert outcomes(caplog, "taken_over"), [r.getMessage() for r in caplog.records]
    assert record(key) is None  # released this time: the database was there


@pytest.fixture
def refused_release() -> Iterator[None]:
    """A trigger on ``other``'s records table that fails every ``DELETE``: a statement error on
    a live connection."""
    table = connections["other"].ops.quote_name(IdempotencyRecord._meta.db_table)
    with connections["other"].cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "CREATE OR REPLACE FUNCTION lr_refuse_delete() RETURNS trigger "
                "LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'no release here'; END $$"
            )
            cursor.execute(
                f"CREATE TRIGGER lr_refuse BEFORE DELETE ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION lr_refuse_delete()"
            )
        else:
            cursor.execute(
                f"CREATE TRIGGER lr_refuse BEFORE DELETE ON {table} FOR EACH ROW "
                "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'no release here'"
            )
    try:
        yield
    finally:
        with connections["other"].cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(f"DROP TRIGGER lr_refuse ON {table}")
                cursor.execute("DROP FUNCTION lr_refuse_delete()")
            else:
                cursor.execute("DROP TRIGGER lr_refuse")


@pytest.mark.usefixtures("refused_release")
def test_a_release_that_fails_on_a_live_connection_still_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only a lost connection is logged and let go: a failing statement is a bug to see."""
    with (
        override_settings(IDEMPOTENCY=SETTINGS),
        caplog.at_level(logging.DEBUG, logger="django_idempotency"),
        pytest.raises(DatabaseError, match="no release here"),
    ):
        post(Client(), URLS["5xx"], f"release-refused-{uuid.uuid4()}")
    assert not outcomes(caplog, "release_failed")
