"""The `pooler` pass really runs through PgBouncer in transaction pooling mode, and the claim
works there without prepared statements (its plan is cached inside the server session)."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction
from django.test import Client

from tests.conftest import PGBOUNCER
from tests.probes import effects, post

pytestmark = [pytest.mark.postgres, pytest.mark.pooler]


def admin_console(command: str) -> list[dict[str, Any]]:
    """A command on PgBouncer's admin console (the `pgbouncer` database on the same port)."""
    settings = connection.settings_dict
    with psycopg.connect(
        host=settings["HOST"],
        port=settings["PORT"],
        user=settings["USER"],
        dbname="pgbouncer",
        autocommit=True,
    ) as console:
        cursor = console.cursor()
        cursor.execute(command)  # the console takes no parameters, nor prepared statements
        names = [column.name for column in cursor.description or ()]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


@pytest.mark.skipif(not PGBOUNCER, reason="PGBOUNCER=1 is the pass through PgBouncer")
@pytest.mark.django_db
def test_the_pass_goes_through_pgbouncer_in_transaction_mode() -> None:
    config = {row["key"]: row["value"] for row in admin_console("SHOW CONFIG")}
    assert config["pool_mode"] == "transaction"
    pools = {row["database"] for row in admin_console("SHOW POOLS")}
    assert connection.settings_dict["NAME"] in pools


@pytest.mark.django_db(transaction=True)
def test_the_claim_is_a_short_call_that_works_in_many_transactions(client: Client) -> None:
    """Each request is its own transaction; behind PgBouncer each may land on another server
    connection. A prepared statement would be missing there; the function call never is."""
    keys = [str(uuid.uuid4()) for _ in range(12)]
    for key in keys:
        assert post(client, "/probe/effect/", key).status_code == 201
    for key in keys:
        again = post(client, "/probe/effect/", key)
        assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert effects() == len(keys)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_proc WHERE proname = 'django_idempotency_claim_v1'"
        )
        assert cursor.fetchone() == (1,)
