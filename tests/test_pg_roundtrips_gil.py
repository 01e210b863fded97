"""PostgreSQL with psycopg 3: an exchange of ``django_idempotency.pg_roundtrips`` never waits for
the network while holding the GIL, so the other threads of the process run meanwhile.

A query of several statements answers with several results. The exchange took the second one
with libpq's ``PQgetResult`` as soon as the first had arrived: when the second had not, libpq
blocked reading the socket with the GIL held, and no other thread of the process ran until the
network delivered. Here the network is a database proxy in the same process
(tests/db_proxy.py, its threads) that forwards each result a moment after the one before: before
the fix the proxy's thread could never forward the second one, and the process hung (so the
check runs in a subprocess, whose hang fails the test). The HTTP tests that cut connections with
that proxy in the test process (tests/test_http_lease_release.py) hung the same way, now and
then.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]

SCRIPT = """
import sys
import psycopg
from django_idempotency.pg_roundtrips import _exchange
from tests.db_proxy import PgProxy

host, port, conninfo = sys.argv[1], int(sys.argv[2]), sys.argv[3]
proxy = PgProxy((host, port))
proxy.pace = 0.3  # each result reaches the client a moment after the one before
client = psycopg.connect(f"{conninfo} host=127.0.0.1 port={proxy.port}", autocommit=True)
results = _exchange(client, b"SELECT 1; SELECT 2; SELECT 3")
print(len(results), flush=True)
"""


def test_an_exchange_lets_other_threads_run_while_it_waits_for_a_later_result() -> None:
    import psycopg

    settings = connection.settings_dict
    conninfo = psycopg.conninfo.make_conninfo(
        dbname=settings["NAME"], user=settings["USER"], password=settings["PASSWORD"] or None
    )
    server = [settings["HOST"] or "127.0.0.1", str(settings["PORT"] or 5432)]
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, *server, conninfo],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the exchange held the GIL while waiting: the other thread never ran")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"
