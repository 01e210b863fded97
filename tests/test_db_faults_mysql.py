"""Database faults on MariaDB: the request's COMMIT cut before and after the server answers.

The same check as tests/test_db_faults.py's (which runs every point on PostgreSQL), through
:class:`tests.db_proxy.MySqlProxy` in front of MariaDB: gunicorn reaches the database through
the proxy, the test's own connection is direct.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from django.db import connection

from tests.db_proxy import MySqlProxy, mysql_proxy
from tests.servers import Gunicorn, gunicorn
from tests.test_db_faults import COMMIT, assert_once, assert_unavailable, post, until_answered

pytestmark = [
    pytest.mark.mysql,
    pytest.mark.timeout(600),  # above the sum of its guards against a hang
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture(scope="module")
def proxy(django_db_setup: None) -> Iterator[MySqlProxy]:
    if connection.vendor != "mysql":
        pytest.skip("runs in the MariaDB pass")
    settings = connection.settings_dict
    with mysql_proxy((settings["HOST"] or "127.0.0.1", int(settings["PORT"] or 3306))) as running:
        yield running


@pytest.fixture(scope="module")
def server(proxy: MySqlProxy) -> Iterator[Gunicorn]:
    settings = {**connection.settings_dict, "HOST": "127.0.0.1", "PORT": proxy.port}
    with gunicorn(settings, workers=2) as running:
        yield running


@pytest.mark.parametrize("when", ["before", "after"])
def test_cut_at_the_request_commit(server: Gunicorn, proxy: MySqlProxy, when: str) -> None:
    key = str(uuid.uuid4())
    rule = proxy.cut(COMMIT, when=when)
    try:
        first = post(server, key)
        assert rule.hits == 1, server.logs()
    finally:
        proxy.clear()
    assert_unavailable(first, "whether it took effect is unknown")  # not Django's 500
    reply, _ = until_answered(server, key)
    executed = "Idempotent-Replayed" not in reply.headers
    assert executed == (when == "before"), reply.headers
    assert_once(server, key, reply)
