"""The batch commands (``idempotency_purge``, ``idempotency_rotate_keys``,
``idempotency_erase``) that lose the database in the middle: a ``CommandError`` that says
nothing is lost and the next run goes on (not the driver's traceback), and the next run does
finish. The connection is cut by the proxy of tests/db_proxy.py, so PostgreSQL and MariaDB."""

from __future__ import annotations

import base64
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import IntegrityError, connection
from django.utils import timezone

from django_idempotency.management.lost_database import resumable_on_loss
from django_idempotency.models import IdempotencyRecord
from django_idempotency.protection import core
from django_idempotency.protection.keys import Keyring, key_id
from tests.db_proxy import proxy_for, repointed
from tests.protection_helpers import keys, new_key
from tests.test_db_faults import COMMIT
from tests.test_protection_rotation import seed
from tests.test_review_decrypt_only import K1, RAW1

pytestmark = [pytest.mark.postgres, pytest.mark.mysql, pytest.mark.django_db(transaction=True)]

K2 = new_key()


def run(command: str, **options: Any) -> str:
    out = StringIO()
    call_command(command, stdout=out, stderr=StringIO(), batch_size=3, **options)
    return out.getvalue()


def cut_then_finish(command: str, options: dict[str, Any], pattern: str) -> str:
    """Run ``command`` through the proxy with the first statement matching ``pattern`` cut
    before the server gets it; require the CommandError; then run it again directly and
    return what it printed."""
    with proxy_for(connection.settings_dict) as proxy:
        proxy.cut(pattern, when="before")
        with repointed("default", proxy.port), pytest.raises(CommandError) as raised:
            run(command, **options)
        assert proxy.faults["cut_before"] == 1
    message = str(raised.value)
    assert "connection to the database 'default' was lost" in message, message
    assert "Nothing is lost" in message and "goes on where it stopped" in message, message
    return run(command, **options)


def test_the_rotation_that_loses_the_database_says_run_it_again() -> None:
    seed(Keyring((RAW1,)), 9)
    with keys(K2, K1):
        printed = cut_then_finish("idempotency_rotate_keys", {}, COMMIT)
        assert "Done: everything is sealed with key" in printed, printed
    assert {core.stored_key_id(headers) for headers in _headers()} == {_newest(K2)}


def test_the_erasure_that_loses_the_database_says_run_it_again() -> None:
    seed(Keyring((RAW1,)), 9)
    with keys(K1):
        printed = cut_then_finish("idempotency_erase", {"owner": "owner"}, COMMIT)
    assert "Erased" in printed, printed
    assert all(core.ERASED in headers for headers in _headers())


def test_the_purge_that_loses_the_database_says_run_it_again() -> None:
    seed(Keyring((RAW1,)), 9)
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(hours=1))
    with keys(K1):
        cut_then_finish("idempotency_purge", {}, r"^\s*DELETE")
    assert not IdempotencyRecord.objects.exists()


def test_another_database_error_keeps_its_own_traceback() -> None:
    """Only a lost connection is turned into the message: a statement's own error (here a
    unique constraint, on a live connection) is raised as it is."""
    seed(Keyring((RAW1,)), 1)
    with pytest.raises(IntegrityError), resumable_on_loss(["default"], "purge"):
        seed(Keyring((RAW1,)), 1)  # the same (owner, key) again


def _headers() -> list[dict[str, Any]]:
    return list(IdempotencyRecord.objects.values_list("response_headers", flat=True))


def _newest(key: str) -> str:
    return key_id(base64.urlsafe_b64decode(key))
