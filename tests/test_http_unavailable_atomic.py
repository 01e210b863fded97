"""``ATOMIC_REQUESTS = True`` on the idempotency database, and that database cannot be reached at
the claim: still ``503`` with ``Retry-After`` and a problem document, not Django's bare 500
(issue 35, item 11, review).

Django opens the request's transaction (``transaction.atomic`` around the view) before the view,
and so before a decorated view's claim, runs: a closed port failed there, outside the library,
and an open connection whose server session was terminated failed at the ``COMMIT`` of that
transaction, after the library had answered 503. Real databases: an alias pointed at a closed
port, and a connection terminated by the server (``pg_terminate_backend``, MariaDB's ``KILL``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from django.db import connection, connections
from django.test import Client, override_settings

from django_idempotency.models import IdempotencyRecord
from tests.lock_waits import session_of
from tests.probes import effects, post
from tests.test_http_unavailable import (
    assert_unavailable,
    down,  # noqa: F401 - the fixture
    terminate,
    with_middleware,  # noqa: F401 - the fixture
)

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, databases=["default", "other", "repeatable_read"]),
]

#: The adapters whose claim runs inside the request's transaction, or opens it.
URLS = {
    "decorator": "/probe/effect/",
    "middleware": "/probe/mw/effect/",
    "drf-mixin": "/probe/drf/atomic-mixin/",
    "decorated-dispatch": "/probe/cbv-dispatch/",
}


@pytest.fixture
def atomic_requests() -> Iterator[None]:
    """``ATOMIC_REQUESTS = True`` on every alias, as a project sets it."""
    saved = {alias: connections[alias].settings_dict["ATOMIC_REQUESTS"] for alias in connections}
    for alias in connections:
        connections[alias].settings_dict["ATOMIC_REQUESTS"] = True
    try:
        yield
    finally:
        for alias, value in saved.items():
            connections[alias].settings_dict["ATOMIC_REQUESTS"] = value


@pytest.mark.usefixtures("with_middleware", "atomic_requests")
@pytest.mark.parametrize("adapter", sorted(URLS))
def test_a_closed_port_under_atomic_requests_is_503(adapter: str, down: str) -> None:  # noqa: F811
    key = f"down-atomic-{adapter}-{uuid.uuid4()}"
    with override_settings(IDEMPOTENCY={"DATABASE": down, "PATHS": [r"^/probe/mw/"]}):
        response = post(Client(), URLS[adapter], key)
    assert_unavailable(response)
    assert effects(key=key) == 0


@pytest.mark.usefixtures("atomic_requests")
@pytest.mark.parametrize("url", ["/probe/effect/", "/probe/drf/apiview/", "/probe/cbv-dispatch/"])
def test_a_killed_connection_under_atomic_requests_is_503_then_the_retry_runs(url: str) -> None:
    """A decorated handler *method* (``/probe/drf/apiview/``) runs inside the transaction
    Django opened: on PostgreSQL the dead connection is met first at the claim (psycopg's BEGIN
    travels with it), and the request's transaction is rolled back instead of committed. On
    MariaDB Django's own ``autocommit(False)`` meets it, before any view code: Django's 500
    (docs/http.md, *How one transaction stays fast and race-free*)."""
    if url == "/probe/drf/apiview/" and connection.vendor != "postgresql":
        pytest.skip("MariaDB: the lost connection is met by Django, before the handler method")
    key = f"killed-atomic-{uuid.uuid4()}"
    post(Client(), "/probe/effect/")  # no key: opens this thread's connection, as a request would
    terminate(session_of())
    client = Client()
    assert_unavailable(post(client, url, key))
    assert effects(key=key) == 0
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    retried = post(client, url, key)
    assert retried.status_code == 201, retried.content
    assert effects(key=key) == 1


@pytest.mark.usefixtures("atomic_requests")
def test_a_request_without_a_key_still_runs_in_the_request_transaction() -> None:
    """The decorator opens the request's transaction itself (Django no longer does, for its
    database): a view's exception still rolls back what it wrote, with or without a key."""
    for key in (None, f"raise-{uuid.uuid4()}"):
        client = Client(raise_request_exception=False)
        response = post(client, "/probe/raise/", key)
        assert response.status_code == 500
    assert effects(name="raising") == 0


def test_without_atomic_requests_nothing_changes(down: str) -> None:  # noqa: F811
    assert not connection.settings_dict["ATOMIC_REQUESTS"]
    key = f"down-plain-{uuid.uuid4()}"
    with override_settings(IDEMPOTENCY={"DATABASE": down}):
        assert_unavailable(post(Client(), "/probe/effect/", key))
