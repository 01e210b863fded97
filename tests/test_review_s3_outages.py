"""Review s3: a statement's error raised while a connection is being set up, but not by the
driver's connect (a ``connection_created`` handler's query), is no lost database."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import OperationalError, connection
from django.db.backends.signals import connection_created

from django_idempotency.outages import connection_lost, raised_by_connect

pytestmark = pytest.mark.django_db(transaction=True)

FAILING = {
    "postgresql": "SET statement_timeout = 1; SELECT pg_sleep(1)",
    "sqlite": "SELECT * FROM review_s3_no_such_table",
}


def test_a_connection_created_handlers_failing_statement_is_no_connect_failure() -> None:
    if connection.vendor not in FAILING:
        pytest.skip("no OperationalError-raising statement for this vendor here")

    def handler(sender: Any, connection: Any, **kwargs: Any) -> None:
        with connection.cursor() as cursor:
            cursor.execute(FAILING[connection.vendor])

    connection.close()
    connection_created.connect(handler)
    try:
        with pytest.raises(OperationalError) as raised:
            connection.ensure_connection()
    finally:
        connection_created.disconnect(handler)
    assert connection.connection is not None  # connected: the handler's statement failed
    assert not raised_by_connect(raised.value)
    assert not connection_lost(connection, raised.value)
    connection.close()
