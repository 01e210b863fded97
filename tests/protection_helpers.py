"""Helpers for the data-protection tests: keys, settings, a raw read of every column, and a
command SIGKILLed half-way."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.apps import apps
from django.conf import settings
from django.db import connection
from django.test import override_settings

from tests.servers import REPO


def new_key() -> str:
    """A fresh key as ENCRYPTION_KEYS takes it (Fernet's format: url-safe base64 of 32 bytes)."""
    return base64.urlsafe_b64encode(os.urandom(32)).decode("ascii")


@contextmanager
def keys(*listed: str, **more: Any) -> Iterator[None]:
    """``IDEMPOTENCY["ENCRYPTION_KEYS"] = listed`` (and any other setting given) meanwhile."""
    base = dict(getattr(settings, "IDEMPOTENCY", {}) or {})
    with override_settings(IDEMPOTENCY={**base, "ENCRYPTION_KEYS": list(listed), **more}):
        yield


def raw_tables() -> bytes:
    """Every column of every row of the app's tables, read with raw SQL, as one byte string
    (what a dump, a backup or a read-only SQL leak would show)."""
    out: list[bytes] = []
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        for model in apps.get_app_config("django_idempotency").get_models():
            cursor.execute(f"SELECT * FROM {quote(model._meta.db_table)}")
            for row in cursor.fetchall():
                for value in row:
                    if isinstance(value, (bytes, bytearray, memoryview)):
                        out.append(bytes(value))
                    else:
                        out.append(str(value).encode("utf-8", "surrogatepass"))
    return b"\n".join(out)


def forms_of(secret: str) -> list[bytes]:
    """``secret`` as it may appear in a column: as is, and inside base64 at each of the three
    alignments (a phased request keeps its body in base64)."""
    raw = secret.encode()
    found = [raw]
    for offset in range(3):
        encoded = base64.b64encode(b"x" * offset + raw)
        found.append(encoded[4 if offset else 0 : -4])
    return found


def leaked(secret: str) -> list[bytes]:
    """The forms of ``secret`` that a raw read of the app's tables finds."""
    stored = raw_tables()
    return [form for form in forms_of(secret) if form in stored]


def kill_half_way(command: list[str], env: dict[str, str], half_way: Callable[[], bool]) -> None:
    """Run ``command`` in the repository and SIGKILL it, its process group with it, as soon as
    ``half_way()``; fails, with its output, if it ends first, or if it never gets there."""
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120  # Django's start included: a guard, not a timing
        while not half_way():
            assert process.poll() is None, process.communicate()[0].decode()
            assert time.monotonic() < deadline, f"{' '.join(command[1:])} never got going"
            time.sleep(0.02)
        os.killpg(process.pid, signal.SIGKILL)
        assert process.wait(10) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
