"""Key rotation beside live traffic and after a SIGKILL (issue 37), on every backend.

* Real threads send first executions and replays while ``rotate_keys`` re-encrypts in small
  batches: no replay differs from the original answer, nothing runs twice, and no record is left
  under the old key.
* ``manage.py idempotency_rotate_keys`` is SIGKILLed half-way; run again, it finishes, and every
  record opens to its original response with the new key alone.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.test import Client
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord
from django_idempotency.protection import rotate_keys
from django_idempotency.protection.core import open_response, seal_response, stored_key_id
from django_idempotency.protection.keys import Keyring, key_id
from tests.probes import effects, post
from tests.protection_helpers import keys, kill_half_way, new_key
from tests.servers import REPO, database_url

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

URL = "/probe/secret/"


def kid(key: str) -> str:
    return key_id(base64.urlsafe_b64decode(key))


def under(key: str) -> int:
    return sum(
        stored_key_id(headers) == kid(key)
        for headers in IdempotencyRecord.objects.values_list("response_headers", flat=True)
    )


def test_rotation_beside_first_executions_and_replays() -> None:
    k1, k2 = new_key(), new_key()
    client = Client()
    originals: dict[str, Any] = {}
    with keys(k1):
        for index in range(240):
            key = f"old-{index}"
            response = post(client, URL, key, {"secret": f"secret-{key}", "pad": 200})
            assert response.status_code == 201
            originals[key] = (response.content, response["Location"])
    stop = threading.Event()
    outcomes: Counter[str] = Counter()
    differing: list[str] = []
    errors: list[BaseException] = []
    fresh: list[str] = []

    def replayer(offset: int) -> None:
        mine = Client()
        names = list(originals)
        index = offset
        try:
            while not stop.is_set():
                key = names[index % len(names)]
                index += 7
                response = post(mine, URL, key, {"secret": f"secret-{key}", "pad": 200})
                # A batch's row lock: SQLite's write lock past its timeout; on MariaDB a lock
                # held past TAKEOVER_LOCK_WAIT (tests/test_http_mariadb_finished_lock.py).
                if response.status_code == 409:
                    outcomes["409"] += 1
                    continue
                outcomes["replayed"] += 1
                content, location = originals[key]
                if (
                    response.content != content
                    or response["Location"] != location
                    or response.get("Idempotent-Replayed") != "true"
                ):
                    differing.append(f"{key}: {response.status_code} {response.content[:80]!r}")
        except Exception as exc:  # noqa: BLE001 - handed to the test thread, which asserts
            errors.append(exc)
        finally:
            connections.close_all()

    def first_executions() -> None:
        mine = Client()
        try:
            while not stop.is_set():
                key = f"new-{uuid.uuid4().hex}"
                response = post(mine, URL, key, {"secret": f"secret-{key}"})
                if response.status_code == 409:
                    outcomes["409-new"] += 1
                    continue
                assert response.status_code == 201, response.content
                fresh.append(key)
                again = post(mine, URL, key, {"secret": f"secret-{key}"})
                if again.status_code != 409 and again.content != response.content:
                    differing.append(f"{key}: a first execution's replay differs")
        except Exception as exc:  # noqa: BLE001 - handed to the test thread, which asserts
            errors.append(exc)
        finally:
            connections.close_all()

    with keys(k2, k1):
        threads = [threading.Thread(target=replayer, args=(n,)) for n in range(2)]
        threads.append(threading.Thread(target=first_executions))
        for thread in threads:
            thread.start()
        time.sleep(0.3)  # traffic first, then the rotation in the middle of it
        started = time.monotonic()
        results = rotate_keys(batch_size=4)
        rotation_seconds = time.monotonic() - started
        time.sleep(0.3)
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not errors, errors
    assert not differing, differing[:5]
    assert results[0].finished and results[0].undecryptable == 0
    assert results[0].resealed + len(fresh) >= 240
    assert outcomes["replayed"] > 50, (outcomes, rotation_seconds)
    assert under(k1) == 0  # nothing left under the old key
    assert under(k2) == IdempotencyRecord.objects.count() == 240 + len(fresh)
    assert effects("secret") == 240 + len(fresh)  # nothing ran twice
    with keys(k2):  # the old key removed: every original still replays, byte for byte
        for key, (content, location) in list(originals.items())[::10]:
            response = post(client, URL, key, {"secret": f"secret-{key}", "pad": 200})
            assert (response.content, response["Location"]) == (content, location)
    print(f"\nrotation: {rotation_seconds:.2f}s beside {dict(outcomes)}, {len(fresh)} new keys")


def seed(ring: Keyring, count: int) -> dict[str, bytes]:
    """``count`` completed records sealed with ``ring``'s newest key, written in bulk."""
    now = timezone.now()
    bodies: dict[str, bytes] = {}
    rows = []
    for index in range(count):
        key = f"seed-{index}"
        body = f'{{"seed": {index}, "secret": "{uuid.uuid4().hex}"}}'.encode()
        headers, sealed = seal_response(
            ring, "owner", key, {"Content-Type": "x/y"}, body, status=201
        )
        bodies[key] = body
        rows.append(
            IdempotencyRecord(
                owner="owner",
                key=key,
                fingerprint="f" * 64,
                method="POST",
                path="/",
                state=IdempotencyRecord.State.COMPLETED,
                response_status=201,
                response_headers=headers,
                response_body=sealed,
                completed_at=now,
                expires_at=now + timedelta(hours=1),
            )
        )
    IdempotencyRecord.objects.bulk_create(rows, batch_size=500)
    return bodies


def test_the_rotation_goes_on_after_a_sigkill() -> None:
    k1, k2 = new_key(), new_key()
    count = 3000
    bodies = seed(Keyring((base64.urlsafe_b64decode(k1),)), count)
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DATABASE_URL": database_url(connection.settings_dict),
        "IDEMPOTENCY_ENCRYPTION_KEYS": f"{k2},{k1}",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("COV_CORE_SOURCE", None)
    command = [sys.executable, "manage.py", "idempotency_rotate_keys", "--batch-size", "10"]
    kill_half_way(command, env, lambda: under(k2) >= count // 10)
    done = under(k2)
    assert 0 < done < count, done  # killed half-way
    assert done + under(k1) == count  # each row under one key or the other, none broken
    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"idempotency records: re-encrypted {count - done} in" in rerun.stdout
    assert "Done: everything is sealed" in rerun.stdout
    assert under(k2) == count and under(k1) == 0
    with keys(k2):
        for record in IdempotencyRecord.objects.all():
            headers, body = open_response(
                record.owner,
                record.key,
                record.response_headers,
                bytes(record.response_body),
                status=record.response_status,
            )
            assert body == bodies[record.key] and headers == {"Content-Type": "x/y"}
