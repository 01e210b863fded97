"""Past one database: the outbox table read through PostgreSQL's logical decoding.

A shop that replaces the relay with Debezium's outbox event router (docs/scale.md) relies on one
property of the table: its rows reach the change stream in **commit order**, each transaction's
rows together, with every column the router is configured to read. That is what this test shows,
with the app's own ``outbox.send()`` and PostgreSQL's own ``test_decoding`` plugin (the same
stream ``pgoutput`` encodes for Debezium).

Logical decoding needs ``wal_level=logical``, which the shared server does not have (and must not
be restarted for), so the test starts a throwaway PostgreSQL of its own: ``initdb`` in a temporary
folder, its own port, stopped and removed afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.outbox_helpers import NULL_TRANSPORTS

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
TABLE = "django_idempotency_outboxentry"


def connector_properties() -> dict[str, str]:
    """docs/scale.md's Debezium connector configuration, as ``{option: value}``."""
    page = (ROOT / "docs" / "scale.md").read_text()
    (block,) = re.findall(r"```properties\n(.*?)```", page, re.S)
    return dict(line.split("=", 1) for line in block.splitlines() if "=" in line)


def router_columns(properties: dict[str, str]) -> tuple[str, ...]:
    """The columns the outbox event router reads, as ``properties`` configure it."""
    prefix = "transforms.outbox."
    named = [
        value
        for option, value in properties.items()
        if option.startswith(f"{prefix}table.field.") or option == f"{prefix}route.by.field"
    ]
    placement = properties.get(f"{prefix}table.fields.additional.placement", "")
    named += [entry.split(":")[0] for entry in placement.split(",") if entry]
    return tuple(dict.fromkeys(named))


#: The columns Debezium's outbox event router reads, as docs/scale.md configures it.
ROUTER_COLUMNS = router_columns(connector_properties())


def _pg_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def logical_server() -> Iterator[str]:
    """A PostgreSQL with ``wal_level=logical`` on a port of its own; its URL."""
    bin_dir = _pg_bin()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (initdb) on this machine")
    # Not under pytest's tmp_path: its parent is private to root, and the server runs as postgres.
    folder = Path(tempfile.mkdtemp(prefix="idempotency-logical-"))
    as_postgres: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root
        shutil.chown(folder, "postgres")
        as_postgres = ["runuser", "-u", "postgres", "--"]
    data, port = folder / "data", _free_port()
    initdb = [str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"]
    subprocess.run(
        [*as_postgres, *initdb, "--no-sync", "-E", "UTF8"], check=True, capture_output=True
    )
    options = (
        f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={folder} "
        "-c wal_level=logical -c max_replication_slots=4 -c fsync=off"
    )
    ctl = [*as_postgres, str(bin_dir / "pg_ctl"), "-D", str(data), "-w"]
    subprocess.run(
        [*ctl, "-o", options, "-l", str(folder / "log"), "start"], check=True, capture_output=True
    )
    try:
        yield f"postgres://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*ctl, "-m", "immediate", "stop"], check=False, capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


#: Two transactions on two connections: A writes first and commits last, B writes second and
#: commits first. Their ids follow the writes (A's are lower); the stream must follow the commits.
PRODUCER = textwrap.dedent(
    """
    import threading
    import django
    django.setup()
    from django.db import connections, transaction
    from django_idempotency import outbox

    a_wrote, b_committed = threading.Event(), threading.Event()

    def a():
        with transaction.atomic():
            outbox.send("orders.a", {"n": 1}, key="order-1", headers={"h": "a1"})
            outbox.send("orders.a", {"n": 2}, key="order-1", headers={"h": "a2"})
            a_wrote.set()
            assert b_committed.wait(30)
        connections.close_all()

    def b():
        assert a_wrote.wait(30)
        with transaction.atomic():
            outbox.send("orders.b", {"n": 3}, key="order-2", headers={"h": "b1"})
        b_committed.set()
        connections.close_all()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    """
)


def test_outbox_rows_reach_the_change_stream_in_commit_order(logical_server: str) -> None:
    import psycopg

    env = {
        **os.environ,
        "DATABASE_URL": logical_server,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "PYTHONPATH": str(ROOT),
        # Topic messages, as Debezium would route them: no Celery task call to check.
        "IDEMPOTENCY_OUTBOX_TRANSPORTS": json.dumps(NULL_TRANSPORTS),
    }
    migrate = [sys.executable, "manage.py", "migrate", "-v", "0", "django_idempotency"]
    subprocess.run(migrate, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    with psycopg.connect(logical_server, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('idem_outbox', 'test_decoding')")

    done = subprocess.run(
        [sys.executable, "-c", PRODUCER], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr

    with psycopg.connect(logical_server, autocommit=True) as conn:
        ids = dict(conn.execute(f"SELECT (headers->>'h'), id FROM {TABLE}").fetchall())
        changes = [
            row[0]
            for row in conn.execute(
                "SELECT data FROM pg_logical_slot_get_changes('idem_outbox', NULL, NULL)"
            )
        ]
        conn.execute("SELECT pg_drop_replication_slot('idem_outbox')")

    assert ids["a1"] < ids["a2"] < ids["b1"]  # ids follow the writes: A wrote first
    # Keep the outbox's own changes: each transaction is a BEGIN, its inserts, a COMMIT.
    stream: list[list[str]] = []
    for line in changes:
        if line.startswith("BEGIN"):
            stream.append([])
        elif line.startswith(f"table public.{TABLE}: INSERT:"):
            stream[-1].append(line)
    transactions = [inserts for inserts in stream if inserts]
    headers = [[re.search(r'"h": "(\w+)"', i).group(1) for i in t] for t in transactions]  # type: ignore[union-attr]
    # B committed first, so it comes first; A's two rows arrive together, in their own order.
    assert headers == [["b1"], ["a1", "a2"]]
    first = transactions[0][0]
    for column in ROUTER_COLUMNS:
        assert f" {column}[" in first, column
    assert "event_id[character varying]:'" in first
    assert "destination[character varying]:'orders.b'" in first
    assert "ordering_key[character varying]:'order-2'" in first


#: A process that still runs the settings from before "cdc" was switched to the connector (a
#: rolling deploy) writes a relay message for it; then one transaction writes a message for the
#: relay and one for the change-capture connector, a second writes another for the connector;
#: then the purge deletes the connector's rows.
CAPTURE_PRODUCER = textwrap.dedent(
    """
    import django
    django.setup()
    from django.conf import settings
    from django.core.management import call_command
    from django.db import transaction
    from django.test import override_settings
    from django.utils import timezone
    from django_idempotency import outbox
    from django_idempotency.models import OutboxEntry

    before_switch = {"OUTBOX_TRANSPORTS": {
        "default": settings.IDEMPOTENCY["OUTBOX_TRANSPORTS"]["default"],
        "cdc": settings.IDEMPOTENCY["OUTBOX_TRANSPORTS"]["default"],
    }}
    with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, **before_switch}):
        with transaction.atomic():
            outbox.send("orders.before_switch", {"n": -1}, key="order-1", transport="cdc")
    assert OutboxEntry.objects.get(transport="cdc").state == "pending"
    with transaction.atomic():
        outbox.send("orders.relayed", {"n": 0}, key="order-1")
        outbox.send("orders.captured", {"n": 1}, key="order-1", transport="cdc")
    with transaction.atomic():
        outbox.send("orders.captured", {"n": 2}, key="order-1", transport="cdc")
    OutboxEntry.objects.filter(state="external").update(expires_at=timezone.now())
    call_command("idempotency_purge", verbosity=0)
    assert not OutboxEntry.objects.filter(state="external").exists()
    """
)


def _pgoutput_inserts(messages: list[bytes]) -> list[list[dict[str, str | None]]]:
    """The inserted rows of a ``pgoutput`` (protocol 1) stream, one list per transaction: a
    minimal reader of its Begin, Relation, Insert and Commit messages, as Debezium reads them."""
    relations: dict[int, list[str]] = {}
    transactions: list[list[dict[str, str | None]]] = []
    for data in messages:
        kind, body = data[:1], data[1:]
        if kind == b"B":
            transactions.append([])
        elif kind == b"R":
            rel_id = int.from_bytes(body[:4], "big")
            at = body.index(b"\0", 4) + 1  # namespace
            at = body.index(b"\0", at) + 1  # table name
            at += 1  # replica identity
            count = int.from_bytes(body[at : at + 2], "big")
            at += 2
            names = []
            for _ in range(count):
                end = body.index(b"\0", at + 1)
                names.append(body[at + 1 : end].decode())
                at = end + 1 + 8  # type oid and modifier
            relations[rel_id] = names
        elif kind == b"I":
            rel_id = int.from_bytes(body[:4], "big")
            assert body[4:5] == b"N"
            count, at = int.from_bytes(body[5:7], "big"), 7
            row: dict[str, str | None] = {}
            for name in relations[rel_id][:count]:
                flag = body[at : at + 1]
                at += 1
                if flag == b"t":
                    size = int.from_bytes(body[at : at + 4], "big")
                    row[name] = body[at + 4 : at + 4 + size].decode()
                    at += 4 + size
                else:
                    row[name] = None
            transactions[-1].append(row)
        elif kind in (b"U", b"D", b"T"):
            raise AssertionError(f"the publication streamed a {kind!r} message")
    return [rows for rows in transactions if rows]


def test_a_publication_filtered_on_the_capture_transport_streams_only_its_inserts(
    logical_server: str,
) -> None:
    """docs/scale.md's publication, read through ``pgoutput`` as Debezium reads it: only the
    change-capture transport's rows, written ``external`` with their expiry, and not the purge's
    deletes of them (nor the relay's rows)."""
    import psycopg

    env = {
        **os.environ,
        "DATABASE_URL": logical_server,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "PYTHONPATH": str(ROOT),
        "IDEMPOTENCY_OUTBOX_TRANSPORTS": json.dumps(
            {
                **NULL_TRANSPORTS,
                "cdc": {"BACKEND": "django_idempotency.outbox.capture.ChangeCaptureTransport"},
            }
        ),
    }
    migrate = [sys.executable, "manage.py", "migrate", "-v", "0", "django_idempotency"]
    subprocess.run(migrate, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    page = (ROOT / "docs" / "scale.md").read_text()
    (publication,) = re.findall(r"```sql\n(CREATE PUBLICATION .*?)```", page, re.S)
    name = re.search(r"CREATE PUBLICATION (\w+)", publication).group(1)  # type: ignore[union-attr]
    with psycopg.connect(logical_server, autocommit=True) as conn:
        conn.execute(publication)  # docs/scale.md's own statement
        conn.execute("SELECT pg_create_logical_replication_slot('idem_cdc', 'pgoutput')")

    done = subprocess.run(
        [sys.executable, "-c", CAPTURE_PRODUCER], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr

    with psycopg.connect(logical_server, autocommit=True) as conn:
        messages = [
            bytes(row[0])
            for row in conn.execute(
                "SELECT data FROM pg_logical_slot_get_binary_changes('idem_cdc', NULL, NULL, "
                "'proto_version', '1', 'publication_names', %s)",
                [name],
            )
        ]
        conn.execute("SELECT pg_drop_replication_slot('idem_cdc')")

    transactions = _pgoutput_inserts(messages)
    assert [[json.loads(row["payload"] or "")["n"] for row in rows] for rows in transactions] == [
        [1],
        [2],
    ]
    for rows in transactions:
        (row,) = rows
        assert (row["destination"], row["state"], row["transport"]) == (
            "orders.captured",
            "external",
            "cdc",
        )
        assert row["expires_at"] is not None
        for column in ROUTER_COLUMNS:
            assert row[column] is not None, column
